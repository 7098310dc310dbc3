"""What a worker remembers of its requests (``services.worker.bookkeeping``): superseded
copies, probes' progress, gauges' arrivals, a request's choices and its usage event."""

from __future__ import annotations

from proto import GenerateRequest, SamplingParams, Timings, Usage, pack_tokens
from proto.messages import TokenChunk
from services.worker.bookkeeping import (
    ARRIVALS_GAUGES,
    ARRIVALS_WINDOW_S,
    SUPERSEDED_MEMORY_S,
    RequestBook,
    SentChunks,
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
    assert b.stale_copy("r", 1, 0) is None  # nothing held
    b.hold("r", 1)
    assert b.stale_copy("r", 1, 0) is None and b.stale_copy("r", 0, 0) is None
    assert b.stale_copy("r", 2, 0) == (1, 0)


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
    b.handed_over.add("r")
    assert not b.empty
    b.release("r")
    assert b.empty


def test_gauges_name_each_recent_arrival_once() -> None:
    b, clock = book()
    b.engine_took("old")
    clock.now += ARRIVALS_WINDOW_S + 0.1
    for rid in ("a", "b", "a"):  # n choices enter the engine one by one
        b.engine_took(rid)
    assert b.arrivals_for_gauge() == ["a", "b"]


def test_each_arrival_is_named_by_a_few_gauges_not_by_every_gauge_of_its_window() -> None:
    # Gauges come on every change: named for a whole window, each arrival rode in every
    # one of them, and a gauge's size grew with the request rate.
    b, clock = book()
    b.engine_took("a")
    named = [b.arrivals_for_gauge() for _ in range(ARRIVALS_GAUGES - 1)]
    b.engine_took("b")
    named.append(b.arrivals_for_gauge())
    assert named == [["a"]] * (ARRIVALS_GAUGES - 1) + [["a", "b"]]
    clock.now += 0.01
    assert b.arrivals_for_gauge() == ["b"]  # "a" named ARRIVALS_GAUGES times
    for _ in range(ARRIVALS_GAUGES - 2):
        assert b.arrivals_for_gauge() == ["b"]
    assert b.arrivals_for_gauge() == []


def test_resends_find_the_chunks_kept_until_retention_after_the_end() -> None:
    clock = Clock()
    sent = SentChunks(10.0, clock)
    for seq in range(3):
        sent.keep("r", "subj", TokenChunk(request_id="r", seq=seq, token_ids=[seq]))
    subject, chunks = sent.between("r", 1, 5)
    assert subject == "subj" and [c.seq for c in chunks] == [1, 2]
    sent.ended("r", held=())
    clock.now += 9.0
    sent.ended("other", held=())  # nothing kept of it: it only ages the others
    assert [c.seq for c in sent.between("r", 0, 2)[1]] == [0, 1, 2]
    clock.now += 1.5
    sent.ended("other", held={"r"})  # "r" migrated back here: its chunks are its again
    assert len(sent.between("r", 0, 2)[1]) == 3
    sent.ended("r", held=())
    clock.now += 10.5
    sent.ended("other", held=())
    assert sent.between("r", 0, 2) == ("", [])


def test_no_retention_keeps_nothing() -> None:
    sent = SentChunks(0.0, Clock())
    sent.keep("r", "subj", TokenChunk(request_id="r", seq=0, token_ids=[1]))
    assert sent.between("r", 0, 0) == ("", [])


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
                        worker_id="w", region="eu", now=50.0)
    assert (timed.arrival_time, timed.first_token_time, timed.finish_time) == (1.0, 2.0, 3.0)
    assert timed.region == "eu"  # where it ran, for metering by region
    assert (timed.org, timed.key_id, timed.tier, timed.worker_id, timed.migrations, timed.reserved_tokens) == (
        "o", "k", "pro", "w", 2, 99)
    assert (timed.completion_tokens, timed.status, timed.user, timed.metadata) == (4, "finished", "u", {"a": "b"})
    refused = usage_event(request, Usage(), "failed", None, "bad", worker_id="w", region="", now=50.0)
    assert (refused.arrival_time, refused.first_token_time, refused.finish_time, refused.error) == (0.0, 0.0, 50.0, "bad")
