"""A worker's superseded marks name the placement try (``services.worker.bookkeeping``):
a later try of a segment whose earlier try was superseded is no stale copy."""

from __future__ import annotations

from services.worker.bookkeeping import SUPERSEDED_MEMORY_S, RequestBook


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_mark_blocks_its_own_try_only() -> None:
    b = RequestBook(Clock())
    assert b.supersede("r", 1, 5) is False  # not here (yet): a paused worker's queued cancel
    assert b.superseded("r", 1, 5)
    assert not b.superseded("r", 1, 6)  # the gateway's next try of the same segment
    assert not b.superseded("r", 2, 5) and not b.superseded("r", 1)


def test_a_later_try_of_the_held_segment_makes_it_stale_an_earlier_one_is_refused() -> None:
    b = RequestBook(Clock())
    assert b.stale_copy("r", 1, 6) is None  # nothing held
    b.hold("r", 1, 6)
    assert b.held("r") == (1, 6)
    assert b.stale_copy("r", 1, 7) == (1, 6)  # a later try: the held one is stale
    assert b.stale_copy("r", 2, 1) == (1, 6)  # a later segment, whatever its try
    assert b.stale_copy("r", 1, 5) is None and b.later_try_held("r", 1, 5)  # an earlier try: refused
    assert not b.later_try_held("r", 1, 7) and not b.later_try_held("r", 2, 5)


def test_copies_of_placers_that_name_no_try_behave_as_before() -> None:
    b = RequestBook(Clock())
    b.hold("r", 1)
    assert b.stale_copy("r", 1, 0) is None and not b.later_try_held("r", 1, 0)  # the same copy twice
    assert b.stale_copy("r", 2, 0) == (1, 0)
    assert b.supersede("r", 1) is True and b.superseded("r", 1, 0)


def test_a_held_trys_mark_outlives_the_memory_while_it_runs() -> None:
    clock = Clock()
    b = RequestBook(clock)
    b.hold("r", 1, 6)
    assert b.supersede("r", 1, 6) is True
    clock.now += 10 * SUPERSEDED_MEMORY_S
    b.supersede("other", 0, 1)  # marks expire when the next one is made
    assert b.superseded("r", 1, 6)
    b.release("r")
    b.supersede("third", 0, 1)
    assert not b.superseded("r", 1, 6) and b.held("r") is None and b.empty
