"""RequestStream: ordering, duplicates, gaps, voided chunks of a lost worker, the slow-client bound."""

from __future__ import annotations

from proto import TokenChunk
from services.gateway.streams import RequestStream


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
