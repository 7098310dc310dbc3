"""From worker token chunks to what clients receive (pure, deterministic).

A chunk with sequence number ``s`` becomes one or more OpenAI stream events, numbered
``s.0``, ``s.1``, ...: per choice, the role delta before its first output (chat), the
content / reasoning / tool-call delta with its logprobs, the finish chunk; then the
usage chunk (``include_usage``), an error event, ``[DONE]``. The same chunks always yield
the same events and ids (``output.ChoiceAssembler`` is deterministic), which is what
lets any gateway replay a stream from JetStream and skip exactly the events a client
already has (``Last-Event-ID``).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import OutputOptions, TokenChunk

from .errors import ApiError, from_mesh_error
from .openai_api import error_json
from .output import ChoiceAssembler

DONE = b"[DONE]"


@dataclass(slots=True)
class StreamEvent:
    seq: int
    index: int
    data: bytes  # the JSON of an OpenAI chunk (or ``[DONE]``)
    error: ApiError | None = None  # set on the event carrying an error body (NATS adds its error headers)

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
    def __init__(self, kind: str, request_id: str, model: str, created: int, include_usage: bool,
                 options: OutputOptions | None = None) -> None:
        self.kind = kind
        self.assembler = ChoiceAssembler("chat" if kind == "chat" else "completion", request_id, model, created,
                                         options or OutputOptions(), include_usage)
        self.include_usage = include_usage

    def events(self, chunk: TokenChunk, first: bool = False) -> list[StreamEvent]:
        """The client events of ``chunk`` (feed every chunk of the request, in order)."""
        datas: list[bytes] = []
        if chunk.error is not None:
            error = from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
            if chunk.text or chunk.token_ids:  # what the worker produced before it failed
                for delta in self.assembler.deltas(TokenChunk(request_id=chunk.request_id, seq=chunk.seq,
                                                              index=chunk.index, token_ids=chunk.token_ids,
                                                              text=chunk.text, logprobs=chunk.logprobs)):
                    datas.extend(self.assembler.chunk_json(delta))
            datas.append(error_json(error.message, error.type, error.param, error.code))
            datas.append(DONE)
            events = [StreamEvent(chunk.seq, i, d) for i, d in enumerate(datas)]
            events[-2].error = error
            return events
        for delta in self.assembler.deltas(chunk):
            datas.extend(self.assembler.chunk_json(delta))
        if chunk.finish_reason is not None:
            if self.include_usage and chunk.usage is not None:
                datas.append(self.assembler.usage_chunk(chunk.usage))
            datas.append(DONE)
        return [StreamEvent(chunk.seq, i, d) for i, d in enumerate(datas)]
