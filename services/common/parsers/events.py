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


class ContentDelta(Struct, frozen=True):
    """Text that goes to ``content``."""

    text: str


class ReasoningDelta(Struct, frozen=True):
    """Text that goes to ``reasoning_content``."""

    text: str


ToolEvent = ContentDelta | ToolCallDelta
ReasoningEvent = ContentDelta | ReasoningDelta
