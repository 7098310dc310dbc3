"""Output parsers the gateway applies to a model's text, chosen by the names a worker
advertises (``WorkerInfo.tool_parser`` / ``reasoning_parser``, vLLM's parser names).

Pure and synchronous. Each parser object serves one response (one choice): feed it the
text deltas as they arrive, then ``finish()``; its ``parse(text)`` gives the whole-text
result, which the streamed events reassemble to exactly (``assemble`` folds tool-call
events back into it). Chaining, when a model has both: the reasoning parser's
``ContentDelta`` texts are what the tool-call parser reads.
"""

from __future__ import annotations

from services.common.parsers.events import (
    ContentDelta,
    FunctionCall,
    FunctionCallDelta,
    ReasoningDelta,
    ReasoningEvent,
    ToolCall,
    ToolCallDelta,
    ToolEvent,
    merge_by_index,
)
from services.common.parsers.reasoning import ThinkReasoningParser
from services.common.parsers.tool_calls import (
    HermesToolParser,
    IdFactory,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallParser,
    assemble,
    mistral_call_id,
    openai_call_id,
)

_TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM registers the same parser under both
    "mistral": MistralToolParser,
}
# vLLM's names for the <think>…</think> family whose behaviour ThinkReasoningParser has.
_REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "think": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
}

TOOL_PARSERS: tuple[str, ...] = tuple(_TOOL_PARSERS)
REASONING_PARSERS: tuple[str, ...] = tuple(_REASONING_PARSERS)


def tool_parser(name: str, *, id_factory: IdFactory | None = None) -> ToolCallParser:
    """A new tool-call parser for one response. ``id_factory`` makes the call ids
    (default ``call_`` + 24 hex digits; for ``mistral`` 9 alphanumerics, which Mistral's
    chat templates require). ValueError for an unknown name."""
    try:
        cls = _TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None
    return cls(id_factory)


def reasoning_parser(
    name: str, *, enable_thinking: bool = True, end_token_id: int | None = None
) -> ThinkReasoningParser:
    """A new reasoning parser for one response. ``enable_thinking=False`` when the
    request turned thinking off (``chat_template_kwargs``); ``end_token_id``: the id of
    ``</think>`` when it is a single token, for exact reasoning-token counts.
    ValueError for an unknown name."""
    try:
        cls = _REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}"
        ) from None
    return cls(enable_thinking=enable_thinking, end_token_id=end_token_id)


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ContentDelta",
    "FunctionCall",
    "FunctionCallDelta",
    "HermesToolParser",
    "IdFactory",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ReasoningDelta",
    "ReasoningEvent",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolEvent",
    "assemble",
    "merge_by_index",
    "mistral_call_id",
    "openai_call_id",
    "reasoning_parser",
    "tool_parser",
]
