"""The output side of the Responses API translation (pure): a ``chat.completion`` → a
Response object (``response_from_chat``), each streamed ``chat.completion.chunk`` →
Responses' typed SSE events (``ResponseStream``), and what a stored response hands a
continuation (``stored_history``). The request side (``/v1/responses`` body → chat
body) is :mod:`.responses_api`; the module doc there tells the whole story.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .responses_api import ENCRYPTED_REASONING_INCLUDE, ChatPlan, ResponsesRequest, reasoning_token


@dataclass(slots=True)
class ResponseContext:
    """What a Response object echoes of its request, and its ids."""

    request_id: str  # the mesh request id: every id derives from it
    created_at: int
    model: str
    plan: ChatPlan
    request: ResponsesRequest
    temperature: float | None = None  # the sampling the chat path resolved
    top_p: float | None = None
    store: bool = True
    clock: Callable[[], float] = time.time  # completed_at

    @property
    def response_id(self) -> str:
        return f"resp_{self.request_id}"

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, *,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        req = self.request
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(self.clock()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": self.store, "temperature": self.temperature,
            "text": {"format": self.plan.text_format, "verbosity": "medium"},
            "tool_choice": self.plan.tool_choice, "tools": self.plan.tools,
            "top_logprobs": req.top_logprobs, "top_p": self.top_p, "truncation": req.truncation or "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }


def usage_from_chat(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage → Responses usage (input/output tokens and their details)."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens", 0)
    completion = usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        # cache_write_tokens counts OpenAI's explicit prompt-cache writes: none here.
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                 "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
        "total_tokens": usage.get("total_tokens", prompt + completion),
    }


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def _logprobs(entries: list[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat logprob entries → Responses ``output_text`` logprobs (the same fields). As in
    vLLM's Responses server, a message's logprobs are those of every generated token
    (reasoning and tool-call tokens included): the chat path reports them per choice."""
    return [{"token": e.get("token", ""), "bytes": e.get("bytes") or [], "logprob": e.get("logprob", 0.0),
             "top_logprobs": [{"token": t.get("token", ""), "bytes": t.get("bytes") or [], "logprob": t.get("logprob", 0.0)}
                              for t in e.get("top_logprobs") or []]}
            for e in entries or []]


def _reasoning_item(ctx: ResponseContext, item_id: str, text: str, status: str) -> dict[str, Any]:
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}
    if ENCRYPTED_REASONING_INCLUDE in (ctx.request.include or []):
        item["encrypted_content"] = reasoning_token(text)
    return item


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_from_chat(completion: Mapping[str, Any], ctx: ResponseContext) -> dict[str, Any]:
    """The Response object of a whole ``chat.completion`` (its first choice)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, incomplete = _status(choice.get("finish_reason"))
    item_status = "completed" if status == "completed" else "incomplete"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        output.append(_reasoning_item(ctx, ctx.item_id("rs", len(output)), reasoning, item_status))
    if message.get("content"):
        logprobs = _logprobs((choice.get("logprobs") or {}).get("content")) if ctx.plan.logprobs else []
        output.append(_message_item(ctx.item_id("msg", len(output)), [_text_part(message["content"], logprobs)],
                                    item_status))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        index = len(output)
        output.append(_call_item(ctx.item_id("fc", index), call.get("id") or f"call_{ctx.request_id}_{index}",
                                 function.get("name", ""), function.get("arguments", ""), "completed"))
    return ctx.response(status, output, usage_from_chat(completion.get("usage")), incomplete=incomplete)


# ---------------------------------------------------------- chat chunks → SSE events

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class _Open:
    """The output item being streamed."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int  # output_index
    item_id: str
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_index: int = -1  # the chat tool call index (function_call)
    call_id: str = ""
    name: str = ""


class ResponseStream:
    """Chat chunk dicts in, Responses SSE frames out (``event: <type>`` + ``data``).

    ``start()`` once (``response.created``, ``response.in_progress``); ``feed(chunk)``
    per ``chat.completion.chunk`` (the usage chunk included); then ``finish()`` at the
    chat stream's end, or ``fail(error)`` for its error event. After either,
    ``response`` is the final Response object (store it, then send ``final()``, its
    last event) and further input yields nothing. Each event carries its
    ``sequence_number``.
    """

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items
        self.open: _Open | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response: dict[str, Any] | None = None
        self._final_sent = False
        # Logprobs not sent yet: those of reasoning or tool-call tokens ride the next text
        # delta, so the message's logprobs cover every generated token as in the whole response.
        self.pending_logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = _encoder.encode({"type": kind, "sequence_number": self.sequence, **payload})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> bytes:
        in_progress = self.ctx.response("in_progress", [], None)
        return (self._event("response.created", {"response": in_progress})
                + self._event("response.in_progress", {"response": in_progress}))

    # ---- items --------------------------------------------------------------------------
    def _next_index(self) -> int:
        return len(self.output)

    def _open_item(self, kind: str, *, call: Mapping[str, Any] | None = None) -> list[bytes]:
        index = self._next_index()
        if kind == "reasoning":
            item = _Open(kind, index, self.ctx.item_id("rs", index))
            return [self._event("response.output_item.added", {"output_index": index, "item": {
                        "id": item.item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}}),
                    self._set_open(item, self._event("response.content_part.added", {
                        "item_id": item.item_id, "output_index": index, "content_index": 0,
                        "part": {"type": "reasoning_text", "text": ""}}))]
        if kind == "message":
            item = _Open(kind, index, self.ctx.item_id("msg", index))
            return [self._event("response.output_item.added", {"output_index": index, "item": _message_item(
                        item.item_id, [], "in_progress")}),
                    self._set_open(item, self._event("response.content_part.added", {
                        "item_id": item.item_id, "output_index": index, "content_index": 0, "part": _text_part("", [])}))]
        assert call is not None
        function = call.get("function") or {}
        item = _Open(kind, index, self.ctx.item_id("fc", index), call_index=call.get("index", 0),
                     call_id=call.get("id") or f"call_{self.ctx.request_id}_{index}", name=function.get("name") or "")
        return [self._set_open(item, self._event("response.output_item.added", {"output_index": index, "item": _call_item(
            item.item_id, item.call_id, item.name, "", "in_progress")}))]

    def _set_open(self, item: _Open, frame: bytes) -> bytes:
        self.open = item
        return frame

    def _close(self, status: str) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        text = "".join(item.text)
        common = {"item_id": item.item_id, "output_index": item.index}
        if item.kind == "reasoning":
            done = _reasoning_item(self.ctx, item.item_id, text, status)
            frames = [self._event("response.reasoning_text.done", {**common, "content_index": 0, "text": text}),
                      self._event("response.content_part.done", {**common, "content_index": 0,
                                                                 "part": {"type": "reasoning_text", "text": text}})]
        elif item.kind == "message":
            item.logprobs += self.pending_logprobs  # e.g. the end-of-sequence token's, on the finish chunk
            self.pending_logprobs = []
            part = _text_part(text, item.logprobs)
            done = _message_item(item.item_id, [part], status)
            frames = [self._event("response.output_text.done", {**common, "content_index": 0, "text": text,
                                                               "logprobs": item.logprobs}),
                      self._event("response.content_part.done", {**common, "content_index": 0, "part": part})]
        else:
            done = _call_item(item.item_id, item.call_id, item.name, text, "completed")
            frames = [self._event("response.function_call_arguments.done", {**common, "name": item.name,
                                                                            "arguments": text})]
        self.output.append(done)
        frames.append(self._event("response.output_item.done", {"output_index": item.index, "item": done}))
        return frames

    def _switch(self, kind: str, *, call_index: int = -1) -> list[bytes]:
        """Close the open item unless it is ``kind`` (and that tool call)."""
        if self.open is not None and self.open.kind == kind and self.open.call_index == call_index:
            return []
        return self._close("completed")

    # ---- input --------------------------------------------------------------------------
    def feed(self, chunk: Mapping[str, Any]) -> bytes:
        """The events of one ``chat.completion.chunk`` (a usage-only chunk gives none)."""
        if self.response is not None:
            return b""
        if chunk.get("usage"):
            self.usage = usage_from_chat(chunk["usage"])
        frames: list[bytes] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # Responses has one choice
            delta = choice.get("delta") or {}
            if self.ctx.plan.logprobs:
                self.pending_logprobs += _logprobs((choice.get("logprobs") or {}).get("content"))
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                frames += self._switch("reasoning")
                if self.open is None:
                    frames += self._open_item("reasoning")
                assert self.open is not None
                self.open.text.append(reasoning)
                frames.append(self._event("response.reasoning_text.delta", {
                    "item_id": self.open.item_id, "output_index": self.open.index, "content_index": 0, "delta": reasoning}))
            content = delta.get("content")
            if content:
                frames += self._switch("message")
                if self.open is None:
                    frames += self._open_item("message")
                assert self.open is not None
                logprobs, self.pending_logprobs = self.pending_logprobs, []
                self.open.text.append(content)
                self.open.logprobs += logprobs
                frames.append(self._event("response.output_text.delta", {
                    "item_id": self.open.item_id, "output_index": self.open.index, "content_index": 0, "delta": content,
                    "logprobs": logprobs}))
            for call in delta.get("tool_calls") or []:
                frames += self._switch("function_call", call_index=call.get("index", 0))
                if self.open is None:
                    frames += self._open_item("function_call", call=call)
                assert self.open is not None
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    self.open.text.append(arguments)
                    frames.append(self._event("response.function_call_arguments.delta", {
                        "item_id": self.open.item_id, "output_index": self.open.index, "delta": arguments}))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(frames)

    def finish(self) -> bytes:
        """The chat stream ended: close the open item; ``response`` is final (then ``final()``)."""
        if self.response is not None:
            return b""
        status, incomplete = _status(self.finish_reason)
        frames = self._close("completed" if status == "completed" else "incomplete")
        messages = [item for item in self.output if item["type"] == "message"]
        if messages and self.pending_logprobs:  # tokens after the message closed (a tool call's)
            messages[-1]["content"][0]["logprobs"] = messages[-1]["content"][0]["logprobs"] + self.pending_logprobs
        self.response = self.ctx.response(status, self.output, self.usage, incomplete=incomplete)
        return b"".join(frames)

    def fail(self, error: Mapping[str, Any]) -> bytes:
        """The chat stream's error event (``{"message", "type", "param", "code"}``): the
        response failed, with what was generated so far (then ``final()``)."""
        if self.response is not None:
            return b""
        frames = self._close("incomplete")
        code = error.get("code") if error.get("code") == "rate_limit_exceeded" else "server_error"
        self.response = self.ctx.response("failed", self.output, self.usage,
                                          error={"code": code, "message": str(error.get("message", ""))})
        return b"".join(frames)

    def final(self) -> bytes:
        """The last event, of the final ``response``: ``response.completed``, or
        ``response.incomplete`` (it hit ``max_output_tokens``), or ``response.failed``."""
        assert self.response is not None, "finish() or fail() first"
        if self._final_sent:
            return b""
        self._final_sent = True
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response["status"], "response.failed")
        return self._event(kind, {"response": self.response})


def stored_history(conversation: list[dict[str, Any]], response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a continuation of a stored response prepends: its conversation, then its output."""
    return [*conversation, *(response.get("output") or [])]


MAX_INPUT_ITEMS_PAGE = 100


def input_items_page(response_id: str, conversation: list[dict[str, Any]], *, after: str | None = None,
                     limit: int = 20, order: str = "desc") -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the items the response answered (earlier
    turns first in ``asc``), as the SDK's ``ResponseItem``s: each with an id (derived
    from the response's and its position where the client gave none), string contents as
    content parts, a status. Raises ValueError naming the parameter for a bad one."""
    if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
        raise ValueError(f"limit: must be between 1 and {MAX_INPUT_ITEMS_PAGE}")
    if order not in ("asc", "desc"):
        raise ValueError("order: must be 'asc' or 'desc'")
    items = [_input_item(response_id, i, item) for i, item in enumerate(conversation)]
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ValueError(f"after: no input item '{after[:80]}' in this response")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def _input_item(response_id: str, index: int, given: Mapping[str, Any]) -> dict[str, Any]:
    item = dict(given)
    kind = item.setdefault("type", "message")
    if "id" not in item:
        digest = hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:32]
        item["id"] = f"{'msg' if kind == 'message' else 'item'}_{digest}"
    if kind == "message" and isinstance(item.get("content"), str):
        if item.get("role") == "assistant":
            item["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
        else:
            item["content"] = [{"type": "input_text", "text": item["content"]}]
    if kind in ("message", "function_call", "function_call_output"):
        item.setdefault("status", "completed")
    return item
