"""RequestStream: ordering, duplicates, gaps, voided chunks of a lost worker, the slow-client bound;
the dispatcher handing on final chunks' usage events."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from proto import TokenChunk, UsageEvent, encode
from services.gateway.streams import RequestStream, TokenDispatcher


def chunk(seq: int, worker: str = "w1", final: bool = False) -> TokenChunk:
    return TokenChunk(request_id="r", seq=seq, token_ids=[seq], worker_id=worker, finish_reason="length" if final else None)


def drain(stream: RequestStream) -> list[int]:
    out = []
    while (c := stream.get_nowait()) is not None:
        out.append(c.seq)
    return out


def test_reorders_and_drops_duplicates() -> None:
    stream = RequestStream("r", "s")
    for seq in (0, 2, 1, 1, 3, 0):
        stream.deliver(chunk(seq))
    assert drain(stream) == [0, 1, 2, 3]
    assert stream.duplicates == 2 and stream.gap_since is None


def test_gap_is_tracked_until_filled() -> None:
    stream = RequestStream("r", "s")
    stream.deliver(chunk(0))
    stream.deliver(chunk(2))
    assert drain(stream) == [0] and stream.gap_since is not None
    stream.deliver(chunk(1))
    assert drain(stream) == [1, 2] and stream.gap_since is None


def test_the_first_gap_is_what_the_worker_is_asked_for() -> None:
    stream = RequestStream("r", "s")
    assert stream.missing() is None
    for seq in (0, 3, 4, 7):
        stream.deliver(chunk(seq))
    assert stream.missing() == (1, 2)
    stream.gap_checks = 2  # TOKENS looked into, the worker asked
    stream.deliver(chunk(1))
    assert stream.missing() == (2, 2) and stream.gap_checks == 2  # still the same gap
    stream.deliver(chunk(2))
    assert stream.missing() == (5, 6)
    stream.deliver(chunk(5))
    stream.deliver(chunk(6))
    assert stream.missing() is None and stream.gap_checks == 0  # closed: the next gap starts over


def test_retired_worker_chunks_are_void_from_the_cutoff() -> None:
    stream = RequestStream("r", "s")
    stream.deliver(chunk(0, "w1"))
    stream.deliver(chunk(2, "w1"))  # buffered out of order, then w1 is lost
    stream.retire("w1", 1)
    stream.deliver(chunk(1, "w1"))  # late chunk of the lost worker: void
    stream.deliver(chunk(1, "w2"))
    stream.deliver(chunk(2, "w2", final=True))
    assert drain(stream) == [0, 1, 2] and stream.finished


def test_overflow_cuts_the_slow_client_once() -> None:
    cuts = []
    stream = RequestStream("r", "s", max_buffered=3)
    stream.on_overflow = lambda: cuts.append(1)
    for seq in range(6):
        stream.deliver(chunk(seq))
    assert stream.overflowed and cuts == [1]
    assert stream.buffered == 3


def test_retiring_drops_the_lost_workers_unread_chunks_and_rewinds() -> None:
    # The gateway decided to move the request after reading seq 0..2; meanwhile the old
    # worker's seq 3 and 4 arrived (e.g. while it was being probed). They are dropped and
    # the next worker continues at 3: the client never sees 3 and 4 twice.
    stream = RequestStream("r", "s")
    for seq in (0, 1, 2):
        stream.deliver(chunk(seq, "old"))
    assert drain(stream) == [0, 1, 2]
    stream.deliver(chunk(3, "old"))
    stream.deliver(chunk(4, "old", final=True))
    assert stream.next_seq == 5 and stream.finished
    stream.retire("old", 3)
    assert stream.next_seq == 3 and not stream.finished and stream.buffered == 0
    stream.deliver(chunk(3, "new"))
    stream.deliver(chunk(5, "old"))  # late, void
    assert [c.worker_id for c in iter(stream.get_nowait, None)] == ["new"]


def test_retiring_a_worker_whose_chunks_were_all_read_changes_nothing() -> None:
    # A resumed stream re-applies the record's retirements: long-read history is not rewound.
    stream = RequestStream("r", "s")
    for seq, worker in ((0, "old"), (1, "old"), (2, "new"), (3, "new")):
        stream.deliver(chunk(seq, worker))
    assert drain(stream) == [0, 1, 2, 3]
    stream.retire("old", 2)
    assert stream.next_seq == 4
    stream.deliver(chunk(2, "new"))
    assert stream.duplicates == 1 and drain(stream) == []


def test_only_the_placed_worker_and_retired_history_are_taken() -> None:
    # A worker the router gave up on (its forward timed out) may run the request anyway:
    # its chunks number other tokens and must never be mixed in.
    stream = RequestStream("r", "s")
    stream.worker_id = "placed"
    stream.deliver(chunk(0, "stray"))
    stream.deliver(chunk(0, "placed"))
    stream.retired["earlier"] = 5
    stream.deliver(chunk(1, "earlier"))  # history before its cut-off: taken
    assert drain(stream) == [0, 1] and stream.foreign == 1
    stream.worker_id = ""  # being placed: whoever streams is taken
    stream.deliver(chunk(2, "next"))
    assert drain(stream) == [2]


async def test_a_final_chunks_usage_event_is_handed_on_once() -> None:
    """Live, again from TOKENS, or for a request nobody reads any more: once per dedup id."""
    handed: list[UsageEvent] = []
    dispatcher = TokenDispatcher(cast(Any, None), "gw", on_usage=handed.append)
    event = UsageEvent(request_id="r", org="o", key_id="k", model="m", completion_tokens=3)
    final = TokenChunk(request_id="r", seq=3, finish_reason="length", usage_event=event)
    for _ in range(2):  # no stream is open for "r": its client went away
        await dispatcher._on_message(cast(Any, SimpleNamespace(data=encode(final), subject="t")))
    segment = UsageEvent(request_id="r", org="o", key_id="k", model="m", completion_tokens=2, migrations=1)
    await dispatcher._on_message(cast(Any, SimpleNamespace(data=encode(TokenChunk(
        request_id="r", seq=5, finish_reason="length", usage_event=segment)), subject="t")))
    forged = TokenChunk(request_id="other", seq=0, finish_reason="length", usage_event=event)
    await dispatcher._on_message(cast(Any, SimpleNamespace(data=encode(forged), subject="t")))
    assert handed == [event, segment]
