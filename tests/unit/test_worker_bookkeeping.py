"""What a worker remembers of its requests (``services.worker.bookkeeping``): superseded
copies, probes' progress, gauges' arrivals, a request's choices and its usage event."""

from __future__ import annotations

from proto import GenerateRequest, SamplingParams, Timings, Usage, pack_tokens
from services.worker.bookkeeping import (
    ARRIVALS_WINDOW_S,
    SUPERSEDED_MEMORY_S,
    RequestBook,
    request_choices,
    usage_event,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book() -> tuple[RequestBook, Clock]:
    clock = Clock()
    return RequestBook(clock), clock


def test_a_copy_superseded_before_it_came_is_remembered_then_forgotten() -> None:
    b, clock = book()
    assert b.supersede("r", 0) is False  # not here (yet)
    assert b.superseded("r", 0) and not b.superseded("r", 1)  # a later segment is no stale copy
    clock.now += SUPERSEDED_MEMORY_S
    b.supersede("other", 0)  # marks expire when the next one is made
    assert not b.superseded("r", 0) and b.superseded("other", 0)


def test_a_held_copys_mark_outlives_the_memory_while_it_runs() -> None:
    b, clock = book()
    b.hold("r", 2)
    assert b.supersede("r", 2) is True  # held here: the shell stops it
    clock.now += 10 * SUPERSEDED_MEMORY_S
    b.supersede("other", 0)
    assert b.superseded("r", 2)  # still running: its chunks and usage stay suppressed
    b.release("r")
    b.supersede("third", 0)
    assert not b.superseded("r", 2)


def test_a_later_segment_makes_the_held_one_stale() -> None:
    b, _ = book()
    assert b.stale_segment("r", 1) is None  # nothing held
    b.hold("r", 1)
    assert b.stale_segment("r", 1) is None and b.stale_segment("r", 0) is None
    assert b.stale_segment("r", 2) == 1


def test_probe_progress_waiting_then_running_and_engine_idleness() -> None:
    b, clock = book()
    assert b.progress("r") == ("unknown", 0.0, 0.0)  # an idle worker is not a hung one
    clock.now += 100.0
    b.hold("r", 0)
    clock.now += 3.0
    assert b.progress("r") == ("waiting", 3.0, 3.0)  # idle since the request arrived, not for 103 s
    b.output("r")
    clock.now += 0.5
    assert b.progress("r") == ("running", 0.5, 0.5)
    assert b.progress("other")[0] == "unknown"


def test_release_keeps_nothing_of_the_request() -> None:
    b, _ = book()
    b.hold("r", 0)
    b.output("r")
    b.engine_ids["r"] = ["r/0", "r/1"]
    b.drain_errors.add("r")
    assert not b.empty
    b.release("r")
    assert b.empty


def test_gauges_name_each_recent_arrival_once() -> None:
    b, clock = book()
    b.engine_took("old")
    clock.now += ARRIVALS_WINDOW_S + 0.1
    for rid in ("a", "b", "a"):  # n choices enter the engine one by one
        b.engine_took(rid)
    assert b.arrived() == ["a", "b"]


def test_choices_of_n_continue_their_own_prior_output_with_their_own_seed() -> None:
    one = GenerateRequest(request_id="r", model="m", prompt=b"", token_subject="t", prior_output=pack_tokens([7, 8]), sampling=SamplingParams(n=1))
    [c] = request_choices(one, [1, 2, 7, 8])
    assert (c.index, c.engine_id, c.prior, c.prompt) == (0, "r", 2, [1, 2, 7, 8])
    many = GenerateRequest(request_id="r", model="m", prompt=b"", token_subject="t", sampling=SamplingParams(n=3, seed=10), finished_choices=[1],
                           prior_outputs=[pack_tokens([5]), pack_tokens([6]), pack_tokens([])])
    choices = request_choices(many, [1, 2])
    assert [(c.index, c.engine_id, c.prompt, c.prior, c.sampling.seed, c.sampling.n) for c in choices] == [
        (0, "r/0", [1, 2, 5], 1, 10, 1), (2, "r/2", [1, 2], 0, 12, 1)]


def test_usage_event_names_the_segment_and_falls_back_without_timings() -> None:
    request = GenerateRequest(request_id="r", model="m", prompt=b"", token_subject="t", org="o", key_id="k", tier="pro", migrations=2,
                              reserved_tokens=99, user="u", metadata={"a": "b"})
    usage = Usage(prompt_tokens=0, completion_tokens=4)
    timed = usage_event(request, usage, "finished", Timings(arrival=1.0, first_token=2.0, finished=3.0), "",
                        worker_id="w", now=50.0)
    assert (timed.arrival_time, timed.first_token_time, timed.finish_time) == (1.0, 2.0, 3.0)
    assert (timed.org, timed.key_id, timed.tier, timed.worker_id, timed.migrations, timed.reserved_tokens) == (
        "o", "k", "pro", "w", 2, 99)
    assert (timed.completion_tokens, timed.status, timed.user, timed.metadata) == (4, "finished", "u", {"a": "b"})
    refused = usage_event(request, Usage(), "failed", None, "bad", worker_id="w", now=50.0)
    assert (refused.arrival_time, refused.first_token_time, refused.finish_time, refused.error) == (0.0, 0.0, 50.0, "bad")
