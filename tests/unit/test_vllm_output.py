"""``OutputConverter``: vLLM's per-step outputs (as its ``RequestOutput`` objects carry them)
into the worker's ``EngineOutput``s, without vLLM (tests/vllm runs the real engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from proto.messages import SamplingParams
from services.worker.engines.base import EngineRequest
from services.worker.engines.vllm_output import OutputConverter


def lp(logprob: float, rank: int, token: str) -> Any:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def step(ids: list[int], text: str, *, finished: bool = False, reason: str | None = None, stop_reason: Any = None,
         logprobs: list[dict[int, Any]] | None = None, prompt: list[dict[int, Any]] | None = None,
         cached: int | None = None) -> Any:
    completion = SimpleNamespace(token_ids=ids, text=text, finish_reason=reason, stop_reason=stop_reason,
                                 logprobs=logprobs)
    return SimpleNamespace(outputs=[completion], num_cached_tokens=cached, prompt_logprobs=prompt, finished=finished,
                           metrics=None)


def converter(**sampling: Any) -> OutputConverter:
    req = EngineRequest(request_id="r", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(**sampling), arrival_time=100.0)
    return OutputConverter(req, [5, 6, 7], lambda t: f"<{t}>")


def test_tokens_times_and_the_finish() -> None:
    c = converter()
    assert c.convert(step([], ""), 100.5, False) == (0, None)  # nothing new: nothing to yield
    n, first = c.convert(step([1, 2], "ab", cached=2), 101.0, False)
    assert n == 2 and first is not None
    assert (first.new_token_ids, first.text, first.finish_reason, first.cached_tokens) == ([1, 2], "ab", None, 2)
    assert first.timings is not None and first.timings.first_token == 101.0 and first.timings.scheduled == 101.0
    n, last = c.convert(step([3], "c", finished=True, reason="repetition"), 102.0, False)
    assert last is not None and last.finish_reason == "stop" and last.completion_tokens == 3
    assert last.timings is not None and (last.timings.first_token, last.timings.finished) == (101.0, 102.0)
    assert c.engine_done and c.output_ids == [1, 2, 3]


def test_stop_reason_only_on_a_stop() -> None:
    _, out = converter().convert(step([1], "a", finished=True, reason="stop", stop_reason="END"), 1.0, False)
    assert out is not None and out.stop_reason == "END"
    _, out = converter().convert(step([1], "a", finished=True, reason="length", stop_reason="END"), 1.0, False)
    assert out is not None and out.finish_reason == "length" and out.stop_reason is None


def test_prompt_logprobs_ride_on_the_next_output_once() -> None:
    c = converter(logprobs=1, prompt_logprobs=1)
    prompt = [{}, {6: lp(-1.0, 1, "six")}, {7: lp(-2.0, 2, "seven"), 9: lp(-0.5, 1, "nine")}]
    _, out = c.convert(step([1], "a", logprobs=[{1: lp(-0.1, 1, "one")}], prompt=prompt), 1.0, False)
    assert out is not None and out.prompt_logprobs is not None
    assert [p.token if p else None for p in out.prompt_logprobs] == [None, "six", "seven"]
    assert out.logprobs is not None and out.logprobs[0].token == "one"
    _, later = c.convert(step([2], "b", logprobs=[{2: lp(-0.2, 1, "two")}]), 2.0, False)
    assert later is not None and later.prompt_logprobs is None


def test_an_abort_before_vllm_knew_the_request_ends_it() -> None:
    _, out = converter().convert(step([], ""), 1.0, True)
    assert out is not None and out.finish_reason == "abort"


def test_a_request_without_a_finish_ends_in_an_error() -> None:
    c = converter()
    c.convert(step([1, 2], "ab", cached=1), 1.0, False)
    out = c.failed("vLLM: boom", False, 3.0)
    assert (out.finish_reason, out.error, out.completion_tokens, out.cached_tokens) == ("error", "vLLM: boom", 2, 1)
    assert out.timings is not None and (out.timings.first_token, out.timings.finished) == (1.0, 3.0)
