"""Turning a streamed OpenAI response into timings (pure; the clients feed it).

``SSEParser`` splits a ``text/event-stream`` into event data. ``StreamAccumulator``
takes each decoded chunk with the instant it arrived and keeps what a benchmark needs:
when the first token came, how many tokens each chunk carried, the usage, the end.

Token counting per chunk, best source first: the cumulative ``usage.completion_tokens``
of a chunk (vLLM's ``continuous_usage_stats``), else the chunk's new text counted with
the target's tokenizer (at least 1 when it carries text). The request's output length
is the final usage's ``completion_tokens`` when present. A chunk without new text or
tokens (the role preamble, the finish chunk, the usage chunk) is not a token: it does
not start TTFT and adds no inter-token latency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ops.bench.results import (
    STATUS_INCOMPLETE,
    STATUS_OK,
    STATUS_PROTOCOL,
    STATUS_STREAM_ERROR,
    RequestResult,
)


class SSEParser:
    """Incremental server-sent-events parser: feed lines, get each event's data.

    Handles ``data:`` with or without the space, multi-line data (joined by newlines),
    comments, other fields, CRLF. An event is dispatched at its blank line.
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, raw: bytes | str) -> str | None:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data = "\n".join(self._data)
            self._data = []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        # event:, id:, retry: carry nothing the benchmark needs.
        return None

    def flush(self) -> str | None:
        """Data of an event the stream ended without a blank line after."""
        return self.feed_line("")


def error_message(obj: Any) -> tuple[str, str | None]:
    """(message, code/type) from an OpenAI error body, tolerant of odd shapes."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = str(err.get("message") or err)
            code = err.get("code") or err.get("type")
            return msg, (str(code) if code is not None else None)
        return str(err), None
    return str(obj), None


class StreamAccumulator:
    """Collects one request's chunks into a ``RequestResult``.

    Times are absolute ``perf_counter`` readings; ``t_sent`` anchors them.
    """

    __slots__ = (
        "_continuous",
        "_count",
        "_last_cum",
        "_last_t",
        "_t_first",
        "chunk_s",
        "chunk_tokens",
        "done",
        "error",
        "finish_reason",
        "http_status",
        "itl_s",
        "keep_text",
        "response_id",
        "status",
        "t_end",
        "t_sent",
        "text_parts",
        "usage_completion",
        "usage_prompt",
    )

    def __init__(self, count_tokens: Callable[[str], int], keep_text: bool = False,
                 t_sent: float = 0.0) -> None:
        self.t_sent = t_sent
        self._count = count_tokens
        self._t_first: float | None = None
        self._last_t = t_sent
        self._last_cum = 0
        self._continuous = False
        self.chunk_s: list[float] = []
        self.chunk_tokens: list[int] = []
        self.itl_s: list[float] = []
        self.usage_prompt: int | None = None
        self.usage_completion: int | None = None
        self.finish_reason: str | None = None
        self.status: str | None = None  # set on error or end
        self.error: str | None = None
        self.http_status: int | None = None
        self.done = False
        self.t_end: float | None = None
        self.keep_text = keep_text
        self.text_parts: list[str] = []
        self.response_id: str | None = None  # the chunks' ``id``: the server's name for the request

    def start(self, t: float) -> None:
        """The request left the client at ``t``."""
        self.t_sent = self._last_t = t

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def on_chunk(self, t: float, obj: Any) -> None:
        """One decoded stream chunk that arrived at ``t``."""
        if self.status is not None:
            return
        if not isinstance(obj, dict):
            self.fail(t, STATUS_PROTOCOL, f"chunk is not an object: {obj!r:.80}")
            return
        if obj.get("error"):
            msg, code = error_message(obj)
            self.fail(t, STATUS_STREAM_ERROR, f"{code}: {msg}" if code else msg)
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        text = ""
        choices = obj.get("choices") or ()
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if delta.get("tool_calls"):
                    text += str(delta["tool_calls"])
            elif isinstance(choice.get("text"), str):
                text += choice["text"]
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        n = 0
        by_usage = False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if usage.get("prompt_tokens") is not None:
                self.usage_prompt = int(usage["prompt_tokens"])
            cum = usage.get("completion_tokens")
            if cum is not None:
                cum = int(cum)
                self.usage_completion = cum
                # Continuous usage (usage on content chunks from the first one on): the
                # delta is exact. Usage first seen on a late content chunk is the final
                # total riding on the last chunk: count that chunk's text instead.
                if choices and (self._continuous or not self.chunk_tokens):
                    self._continuous = by_usage = True
                    n = max(0, cum - self._last_cum)
                self._last_cum = cum
        if not by_usage and text:
            n = max(1, self._count(text))
        if self.keep_text and text:
            self.text_parts.append(text)
        if n <= 0:
            return
        if self._t_first is None:
            self._t_first = t
        else:
            gap = (t - self._last_t) / n
            self.itl_s.extend([gap] * n)
        self._last_t = t
        self.chunk_s.append(t - self.t_sent)
        self.chunk_tokens.append(n)

    def on_done(self, t: float) -> None:
        """The end-of-stream marker ([DONE] / Meshserve-Done) arrived at ``t``."""
        if self.status is None:
            self.done = True
            self.t_end = t
            self.status = STATUS_OK

    def on_eof(self, t: float) -> None:
        """The transport ended; fine if a finish reason was seen, else incomplete."""
        if self.status is not None:
            return
        self.t_end = t
        if self.finish_reason is not None:
            self.status = STATUS_OK
        else:
            self.status = STATUS_INCOMPLETE
            self.error = "stream ended without [DONE]"

    def fail(self, t: float, status: str, error: str, http_status: int | None = None) -> None:
        if self.status is not None:
            return
        self.t_end = t
        self.status = status
        self.error = error
        self.http_status = http_status

    def fill(self, rec: RequestResult) -> RequestResult:
        """Write the outcome into ``rec`` (TTFT, TPOT, E2E, tokens, chunk timings)."""
        rec.status = self.status or STATUS_INCOMPLETE
        rec.error = self.error
        rec.http_status = self.http_status
        rec.finish_reason = self.finish_reason
        rec.response_id = self.response_id
        rec.prompt_tokens = self.usage_prompt
        rec.chunk_s = self.chunk_s
        rec.chunk_tokens = self.chunk_tokens
        rec.itl_s = self.itl_s
        streamed = sum(self.chunk_tokens)
        rec.output_tokens = self.usage_completion if self.usage_completion is not None else streamed
        if self.t_end is not None:
            rec.e2e_s = self.t_end - self.t_sent
        if self._t_first is not None:
            rec.ttft_s = self._t_first - self.t_sent
        if rec.status == STATUS_OK and rec.ttft_s is not None and rec.e2e_s is not None:
            rec.tpot_s = tpot(rec.e2e_s, rec.ttft_s, rec.output_tokens)
        return rec


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E − TTFT) / (tokens − 1); None below 2 tokens."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)
