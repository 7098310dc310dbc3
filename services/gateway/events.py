"""From worker token chunks to what clients receive (pure, deterministic).

A chunk with sequence number ``s`` becomes one or more OpenAI stream events, numbered
``s.0``, ``s.1``, ...: the role delta before the first text (chat), the text delta, the
finish chunk, the usage chunk (``include_usage``), an error event, ``[DONE]``. The same
chunk always yields the same events and ids, which is what lets any gateway replay a
stream from JetStream and skip exactly the events a client already has
(``Last-Event-ID``).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import TokenChunk

from .errors import from_mesh_error
from .openai_api import ChatStream, CompletionStream, error_json, response_id, usage_from_proto

DONE = b"[DONE]"


@dataclass(slots=True)
class StreamEvent:
    seq: int
    index: int
    data: bytes  # the JSON of an OpenAI chunk (or ``[DONE]``)

    @property
    def id(self) -> str:
        return f"{self.seq}.{self.index}"


def parse_event_id(value: str | None) -> tuple[int, int] | None:
    """``"12.1"`` → (12, 1); anything else → None (the stream starts over)."""
    if not value:
        return None
    seq, _, index = value.strip().partition(".")
    try:
        return int(seq), int(index or 0)
    except ValueError:
        return None


class EventBuilder:
    def __init__(self, kind: str, request_id: str, model: str, created: int, include_usage: bool) -> None:
        rid = response_id("chat" if kind == "chat" else "completion", request_id)
        self.kind = kind
        self.chat = ChatStream(rid, model, created, include_usage) if kind == "chat" else None
        # Both builders share content/finish/usage; only chat has a role delta.
        self.stream: ChatStream | CompletionStream = self.chat or CompletionStream(rid, model, created, include_usage)
        self.include_usage = include_usage

    def events(self, chunk: TokenChunk, first: bool) -> list[StreamEvent]:
        """The client events of ``chunk``; ``first`` marks the request's first chunk."""
        datas: list[bytes] = []
        if chunk.error is not None:
            error = from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
            if chunk.text:
                datas.append(self.stream.content(chunk.text))
            datas.append(error_json(error.message, error.type, error.param, error.code))
            datas.append(DONE)
        else:
            if first and self.chat is not None:
                datas.append(self.chat.role())
            # Tokens that render no text (special tokens, a UTF-8 sequence still incomplete)
            # still get an empty delta, as vLLM's server sends: the client sees progress.
            if chunk.text or (chunk.token_ids and chunk.finish_reason is None):
                datas.append(self.stream.content(chunk.text))
            if chunk.finish_reason is not None:
                datas.append(self.stream.finish(chunk.finish_reason))
                if self.include_usage and chunk.usage is not None:
                    datas.append(self.stream.usage(usage_from_proto(chunk.usage)))
                datas.append(DONE)
        return [StreamEvent(chunk.seq, i, d) for i, d in enumerate(datas)]
