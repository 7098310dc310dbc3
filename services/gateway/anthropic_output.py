"""The output side of the Messages API translation (pure): a ``chat.completion`` → a
Message (``message_from_chat``), each streamed ``chat.completion.chunk`` → the Messages
API's SSE events (``MessageStream``), and errors in Anthropic's shape
(``anthropic_error_body``). The request side is :mod:`.anthropic_api`, whose module doc
tells the whole story.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .errors import ApiError

_encoder = msgspec.json.Encoder()


# ------------------------------------------------------------------------------ errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                504: "timeout_error", 529: "overloaded_error"}
_OVERLOADED_CODES = ("slo_overloaded", "no_capacity", "overloaded", "draining")


def anthropic_error_type(status: int, code: str | None) -> str:
    if code in _OVERLOADED_CODES or status in (503, 529):
        return "overloaded_error"
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_param(param: str) -> str:
    """``messages[2].content[0].text`` → ``messages.2.content.0.text`` (Anthropic's paths)."""
    return param.replace("[", ".").replace("]", "")


def anthropic_error(exc: ApiError, request_id: str | None = None) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the field leads the message."""
    message = f"{anthropic_param(exc.param)}: {exc.message}" if exc.param else exc.message
    out: dict[str, Any] = {"type": "error", "error": {"type": anthropic_error_type(exc.status, exc.code),
                                                      "message": message}}
    if request_id:
        out["request_id"] = request_id
    return out


def anthropic_error_body(exc: ApiError) -> bytes:
    return _encoder.encode(anthropic_error(exc))


# ------------------------------------------------------------------------------ output



@dataclass(slots=True)
class MessageContext:
    request_id: str  # the mesh request id: the message id derives from it
    model: str  # as the client named it
    input_tokens: int  # the prompt's tokens, known before the first output token

    @property
    def message_id(self) -> str:
        return f"msg_{self.request_id}"


def usage_from_chat(usage: Mapping[str, Any] | None, input_tokens: int = 0) -> dict[str, int]:
    """Chat usage → Anthropic's: ``input_tokens`` are the prompt's uncached tokens
    (Anthropic's total input is input + cache read + cache creation)."""
    if not usage:
        return {"input_tokens": input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return {"input_tokens": max(0, usage.get("prompt_tokens", 0) - cached),
            "output_tokens": usage.get("completion_tokens", 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def stop_reason(finish_reason: str | None, stop: int | str | None, *, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat finish, as vLLM maps them: the token
    limit always wins; a matched stop string wins unless it came after complete tool calls
    (a call it cut short must not run)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None  # cut off otherwise (an abort): no reason Anthropic names
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the ``input`` object; None when they are not one (cut short)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def thinking_signature(text: str) -> str:
    """A thinking block's ``signature``: clients hand it back and meshserve reads the text,
    so it only has to be stable (the same in the streamed and the whole answer)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def message_from_chat(completion: Mapping[str, Any], ctx: MessageContext) -> dict[str, Any]:
    """The Message of a whole ``chat.completion`` (its first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    complete = bool(calls)
    for call in calls:
        function = call.get("function") or {}
        parsed = _tool_input(function.get("arguments", ""))
        complete = complete and parsed is not None
        content.append({"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                        "input": parsed if parsed is not None else {}})
    if not content:
        content.append({"type": "text", "text": ""})  # strict clients read content[0]
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), tool_used=bool(calls),
                                   tool_complete=complete)
    return {"id": ctx.message_id, "type": "message", "role": "assistant", "model": ctx.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_from_chat(completion.get("usage"), ctx.input_tokens)}


@dataclass(slots=True)
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    index: int
    call_index: int = -1
    text: list[str] = field(default_factory=list)


class MessageStream:
    """Chat chunk dicts in, the Messages API's SSE frames out (``event: <type>`` + ``data``).

    ``start()`` once (``message_start``, a ``ping``); ``feed(chunk)`` per
    ``chat.completion.chunk`` (the usage chunk included); then ``finish()`` at the chat
    stream's end (the open block's stop, ``message_delta`` with the stop reason and
    usage, ``message_stop``), or ``fail(error)`` for its error event. After either,
    further input yields nothing.
    """

    def __init__(self, ctx: MessageContext) -> None:
        self.ctx = ctx
        self.blocks = 0  # blocks opened so far: the next one's index
        self.open: _Block | None = None
        self.usage: Mapping[str, Any] | None = None
        self.finish_reason: str | None = None
        self.stop: int | str | None = None
        self.tool_used = False
        self.last_arguments: list[str] = []
        # Text that came while a tool_use block was open: sent as a text block of its own
        # once that block closes (a call's arguments may go on after it, as in vLLM's).
        self.held_text: list[str] = []
        self.done = False

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode({"type": kind, **payload}) + b"\n\n"

    def start(self) -> bytes:
        message: dict[str, Any] = {"id": self.ctx.message_id, "type": "message", "role": "assistant", "model": self.ctx.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_from_chat(None, self.ctx.input_tokens)}
        return self._event("message_start", {"message": message}) + self._event("ping", {})

    def _close(self) -> list[bytes]:
        block = self.open
        if block is None:
            return []
        self.open = None
        frames = []
        if block.kind == "thinking":
            frames.append(self._event("content_block_delta", {"index": block.index, "delta": {
                "type": "signature_delta", "signature": thinking_signature("".join(block.text))}}))
        frames.append(self._event("content_block_stop", {"index": block.index}))
        if block.kind == "tool_use" and self.held_text:
            text = "".join(self.held_text)
            self.held_text = []
            frames += self._switch("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": text}, text))
            frames += self._close()
        return frames

    def _switch(self, kind: str, start: dict[str, Any], call_index: int = -1) -> list[bytes]:
        """Open a ``kind`` block unless it is the open one (and that tool call)."""
        if self.open is not None and self.open.kind == kind and self.open.call_index == call_index:
            return []
        frames = self._close()
        self.open = _Block(kind, self.blocks, call_index)
        self.blocks += 1
        frames.append(self._event("content_block_start", {"index": self.open.index, "content_block": start}))
        return frames

    def _delta(self, delta: dict[str, Any], text: str) -> bytes:
        assert self.open is not None
        self.open.text.append(text)
        return self._event("content_block_delta", {"index": self.open.index, "delta": delta})

    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        """The events of one ``chat.completion.chunk`` (a usage-only chunk gives none)."""
        if self.done:
            return b""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        frames: list[bytes] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # the Messages API has one answer
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                frames += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                frames.append(self._delta({"type": "thinking_delta", "thinking": reasoning}, reasoning))
            content = delta.get("content")
            if content and self.open is not None and self.open.kind == "tool_use":
                self.held_text.append(content)
            elif content:
                frames += self._switch("text", {"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": content}, content))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                index = call.get("index", 0)
                opened = self._switch("tool_use", {"type": "tool_use", "id": call.get("id") or "",
                                                   "name": function.get("name") or "", "input": {}}, index)
                if opened:
                    self.tool_used = True
                    self.last_arguments = []
                    frames += opened
                arguments = function.get("arguments")
                if arguments and not self.last_arguments:
                    # Leading whitespace of a forced call's raw text: insignificant in JSON, and
                    # a fragment of only that fails a client's partial-JSON parse.
                    arguments = arguments.lstrip()
                if arguments:
                    self.last_arguments.append(arguments)
                    frames.append(self._delta({"type": "input_json_delta", "partial_json": arguments}, arguments))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop = choice.get("stop_reason")
        return b"".join(frames)

    def finish(self) -> bytes:
        """The chat stream ended: close the open block, then the message."""
        if self.done:
            return b""
        self.done = True
        frames = self._close()
        complete = self.tool_used and _tool_input("".join(self.last_arguments)) is not None
        reason, sequence = stop_reason(self.finish_reason or "stop", self.stop, tool_used=self.tool_used,
                                       tool_complete=complete)
        frames.append(self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                    "usage": usage_from_chat(self.usage, self.ctx.input_tokens)}))
        frames.append(self._event("message_stop", {}))
        return b"".join(frames)

    def fail(self, error: Mapping[str, Any]) -> bytes:
        """The chat stream's error event (``{"message", "type", "param", "code"}``): the
        Messages API's ``error`` event; nothing follows it."""
        if self.done:
            return b""
        self.done = True
        code = error.get("code")
        kind = "rate_limit_error" if code == "rate_limit_exceeded" else anthropic_error_type(500, code)
        return self._event("error", {"error": {"type": kind, "message": str(error.get("message", ""))}})
