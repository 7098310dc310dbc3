"""SSE parsing and per-chunk accounting: what counts as a token, and when."""

from __future__ import annotations

import pytest

from ops.bench.results import RequestResult
from ops.bench.stream import SSEParser, StreamAccumulator, error_message


def test_sse_parser() -> None:
    p = SSEParser()
    lines = [b": keep-alive\n", b"event: message\n", b'data: {"a": 1}\n', b"\n",
             b'data:{"b":2}\r\n', b"\r\n", b"data: line1\n", b"data: line2\n", b"\n", b"\n",
             b"data: [DONE]\n", b"\n"]
    out = [d for line in lines if (d := p.feed_line(line)) is not None]
    assert out == ['{"a": 1}', '{"b":2}', "line1\nline2", "[DONE]"]
    p.feed_line("data: tail")
    assert p.flush() == "tail" and p.flush() is None


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None,
          usage: dict | None = None, text: str | None = None) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish}
    if text is not None:
        choice["text"] = text
    else:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        choice["delta"] = delta
    out: dict = {"choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    return out


def byte_count(text: str) -> int:
    return len(text.encode())


def fill(acc: StreamAccumulator) -> RequestResult:
    return acc.fill(RequestResult(index=0, session=0, turn=0, scheduled_s=0.0))


def test_accumulator_timings() -> None:
    acc = StreamAccumulator(byte_count)
    acc.start(10.0)
    acc.on_chunk(10.1, {**chunk("", role=True), "id": "chatcmpl-1"})  # role preamble: not a token
    acc.on_chunk(10.2, {**chunk("a"), "id": "chatcmpl-2"})            # first token (the first id counts)
    acc.on_chunk(10.3, chunk("bcd"))                # 3 coalesced tokens
    acc.on_chunk(10.35, chunk("e", finish="length"))
    acc.on_chunk(10.36, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})
    acc.on_done(10.4)
    r = fill(acc)
    assert r.status == "ok" and r.finish_reason == "length" and r.response_id == "chatcmpl-1"
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.4)
    assert r.output_tokens == 5 and r.prompt_tokens == 7
    assert r.tpot_s == pytest.approx((0.4 - 0.2) / 4)
    assert r.chunk_tokens == [1, 3, 1]
    assert r.chunk_s == pytest.approx([0.2, 0.3, 0.35])
    assert r.itl_s == pytest.approx([0.1 / 3] * 3 + [0.05])


def test_accumulator_continuous_usage_and_completions_text() -> None:
    acc = StreamAccumulator(lambda t: 1)  # a tokenizer that would undercount
    acc.start(0.0)
    acc.on_chunk(0.5, chunk(text="ab", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    acc.on_chunk(0.6, chunk(text="cde", usage={"prompt_tokens": 3, "completion_tokens": 5}))
    acc.on_chunk(0.7, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    acc.on_done(0.7)
    r = fill(acc)
    assert r.chunk_tokens == [2, 3] and r.output_tokens == 5
    assert r.itl_s == pytest.approx([0.1 / 3] * 3)


def test_final_usage_riding_on_the_last_content_chunk() -> None:
    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("a"))
    acc.on_chunk(0.2, chunk("b"))
    acc.on_chunk(0.3, chunk("c", finish="length", usage={"prompt_tokens": 3, "completion_tokens": 3}))
    acc.on_done(0.3)  # e.g. a Meshserve-Done message whose body is the last chunk
    r = fill(acc)
    assert r.chunk_tokens == [1, 1, 1] and r.output_tokens == 3 and r.prompt_tokens == 3
    # A one-chunk answer carrying its usage: all tokens in that chunk.
    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("xyz", finish="stop", usage={"prompt_tokens": 1, "completion_tokens": 2}))
    acc.on_done(0.1)
    assert fill(acc).chunk_tokens == [2]


def test_continuous_usage_holds_back_text_without_new_tokens() -> None:
    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.05, chunk("", role=True, usage={"prompt_tokens": 3, "completion_tokens": 0}))
    acc.on_chunk(0.1, chunk("", usage={"prompt_tokens": 3, "completion_tokens": 1}))  # held-back text
    acc.on_chunk(0.2, chunk("ab", usage={"prompt_tokens": 3, "completion_tokens": 1}))
    acc.on_chunk(0.3, chunk("c", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    acc.on_done(0.3)
    r = fill(acc)
    assert r.chunk_tokens == [1, 1] and r.ttft_s == pytest.approx(0.1)


def test_accumulator_errors_and_incomplete() -> None:
    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("a"))
    acc.on_chunk(0.2, {"error": {"message": "engine died", "type": "internal", "code": 500}})
    acc.on_chunk(0.3, chunk("b"))  # ignored after the error
    r = fill(acc)
    assert r.status == "stream_error" and "engine died" in (r.error or "")
    assert r.tpot_s is None and r.output_tokens == 1

    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("a"))
    acc.on_eof(0.2)
    assert fill(acc).status == "incomplete"

    acc = StreamAccumulator(byte_count)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("a", finish="stop"))
    acc.on_eof(0.2)  # no [DONE] but a finish reason: complete
    assert fill(acc).status == "ok"

    acc = StreamAccumulator(byte_count, keep_text=True)
    acc.start(0.0)
    acc.on_chunk(0.1, chunk("hi"))
    acc.on_chunk(0.2, ["not", "an", "object"])
    assert fill(acc).status == "protocol" and acc.text == "hi"


def test_error_message_shapes() -> None:
    assert error_message({"error": {"message": "m", "type": "t", "code": "c"}}) == ("m", "c")
    assert error_message({"error": {"message": "m", "type": "t"}}) == ("m", "t")
    assert error_message({"error": "flat"}) == ("flat", None)
    assert error_message("text") == ("text", None)
