"""What the parsers return: OpenAI's shapes, as msgspec Structs the gateway's response
Structs can embed (``tool_calls: list[ToolCall]`` in a message, ``list[ToolCallDelta]``
in a streamed delta) and encode without copying."""

from __future__ import annotations

from typing import Literal

from msgspec import UNSET, Struct, UnsetType


class FunctionCall(Struct, kw_only=True, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True, frozen=True):
    """One entry of a message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(Struct, kw_only=True, frozen=True, omit_defaults=True):
    name: str | UnsetType = UNSET  # only in a call's first delta
    arguments: str  # always present: "" in the first delta, then fragments


class ToolCallDelta(Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One entry of a streamed delta's ``tool_calls``.

    A call's first delta carries ``index``, ``id``, ``type``, ``function.name`` and
    ``function.arguments == ""``; the later ones ``index`` and an arguments fragment.
    """

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionCallDelta


def merge_by_index(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """``calls`` with one entry per call index, as OpenAI streams them: a chunk whose text
    opened a call and carried its first arguments gave two entries of the same index, and a
    client reading ``tool_calls[0]`` lost the fragment. Fragments join in order; the id,
    type and name come from the entry that has them."""
    if len({call.index for call in calls}) == len(calls):
        return calls
    merged: dict[int, ToolCallDelta] = {}
    for call in calls:
        earlier = merged.get(call.index)
        if earlier is None:
            merged[call.index] = call
            continue
        merged[call.index] = ToolCallDelta(
            index=call.index,
            id=earlier.id if isinstance(earlier.id, str) else call.id,
            type=earlier.type if isinstance(earlier.type, str) else call.type,
            function=FunctionCallDelta(
                name=earlier.function.name if isinstance(earlier.function.name, str) else call.function.name,
                arguments=earlier.function.arguments + call.function.arguments,
            ),
        )
    return list(merged.values())


class ContentDelta(Struct, frozen=True):
    """Text that goes to ``content``."""

    text: str


class ReasoningDelta(Struct, frozen=True):
    """Text that goes to ``reasoning_content``."""

    text: str


ToolEvent = ContentDelta | ToolCallDelta
ReasoningEvent = ContentDelta | ReasoningDelta
