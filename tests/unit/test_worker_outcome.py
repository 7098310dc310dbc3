"""How a request ended on a worker (``services.worker.outcome``) and what each segment of
a request bills (``proto.segment_usage``)."""

from __future__ import annotations

from proto import ErrorInfo, Timings, Usage, segment_usage
from services.worker.engines.base import EngineOutput
from services.worker.outcome import request_outcome

TIMINGS = Timings(arrival=1.0, scheduled=1.5, first_token=2.0, finished=3.0)


def output(finish: str | None, *, cached: int = 0, error: str | None = None) -> EngineOutput:
    return EngineOutput(request_id="r", finish_reason=finish, cached_tokens=cached, timings=TIMINGS, error=error)  # type: ignore[arg-type]


def test_a_finished_request_bills_its_prompt_and_what_was_streamed() -> None:
    o = request_outcome(output("stop", cached=32), prompt_tokens=100, prior_tokens=0, streamed=7, migrations=0)
    assert (o.finish, o.status, o.error, o.error_text) == ("stop", "finished", None, "")
    assert o.usage == Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=32)
    assert o.billed == o.usage
    assert o.timings == TIMINGS


def test_length_and_abort_map_to_their_usage_status() -> None:
    assert request_outcome(output("length"), prompt_tokens=1, prior_tokens=0, streamed=1, migrations=0).status == "length"
    aborted = request_outcome(output("abort"), prompt_tokens=1, prior_tokens=0, streamed=0, migrations=0)
    assert (aborted.status, aborted.error) == ("cancelled", None)


def test_a_migrated_segment_shows_the_whole_request_and_bills_only_its_output() -> None:
    # The engine got 100 prompt tokens plus 20 an earlier worker produced; 40 of them cached.
    o = request_outcome(output("stop", cached=140), prompt_tokens=100, prior_tokens=20, streamed=5, migrations=1)
    assert o.usage == Usage(prompt_tokens=100, completion_tokens=25, cached_tokens=100)  # cached capped at the prompt
    assert o.billed == Usage(completion_tokens=5)


def test_an_engine_failure_is_an_internal_error_with_its_text() -> None:
    o = request_outcome(None, prompt_tokens=10, prior_tokens=0, streamed=0, migrations=0, engine_error="engine failure: boom")
    assert (o.finish, o.status) == ("error", "failed")
    assert o.error == ErrorInfo(code="internal", message="engine failure: boom")
    assert o.usage == Usage(prompt_tokens=10) and o.timings is None


def test_an_engine_error_output_keeps_the_engines_message_else_says_none_came() -> None:
    o = request_outcome(output("error", error="CUDA OOM"), prompt_tokens=10, prior_tokens=0, streamed=3, migrations=0)
    assert o.error == ErrorInfo(code="internal", message="CUDA OOM") and o.error_text == "CUDA OOM"
    # the stream ended without a finish reason
    o = request_outcome(output(None), prompt_tokens=10, prior_tokens=0, streamed=3, migrations=0)
    assert o.finish == "error" and o.error_text == "engine ended the request without a finish reason"


def test_a_request_the_engine_refused_is_the_clients_error() -> None:
    # An engine that checks a request itself (prompt past max_model_len, vLLM's own
    # sampling checks, a structured output it cannot build) refuses it: a 400, not a 500.
    refused = EngineOutput(request_id="r", finish_reason="error", error="empty prompt", rejected=True)
    o = request_outcome(refused, prompt_tokens=0, prior_tokens=0, streamed=0, migrations=0)
    assert o.error == ErrorInfo(code="bad_request", message="empty prompt") and o.status == "failed"
    # a failure after the refusal came (the worker's own) stays internal
    o = request_outcome(refused, prompt_tokens=0, prior_tokens=0, streamed=0, migrations=0, engine_error="boom")
    assert o.error is not None and o.error.code == "internal"


def test_an_engine_failure_after_the_finish_is_reported_but_does_not_fail_the_request() -> None:
    o = request_outcome(output("stop"), prompt_tokens=10, prior_tokens=0, streamed=2, migrations=0, engine_error="close failed")
    assert (o.finish, o.error, o.error_text) == ("stop", None, "close failed")


def test_an_answer_the_bus_could_not_carry_fails_the_request_as_the_clients_error() -> None:
    # even when the engine finished: its last chunk (the prompt's logprobs) never went
    o = request_outcome(output("length"), prompt_tokens=10, prior_tokens=0, streamed=1, migrations=0,
                        undeliverable="too large")
    assert (o.finish, o.error_text, o.status) == ("error", "too large", "failed")
    assert o.error is not None and o.error.code == "bad_request"


def test_segment_usage_bills_the_prompt_on_the_first_segment_only() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=32)
    assert segment_usage(usage, 0) == usage
    assert segment_usage(usage, 1) == Usage(completion_tokens=7)
    assert segment_usage(usage, 3) == Usage(completion_tokens=7)
