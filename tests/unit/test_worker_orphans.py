"""Which requests a worker stops when their gateway's NATS connection closes for good."""

from __future__ import annotations

from bus.connections import ConnectionEvent
from services.worker.orphans import OrphanWatch


def event(kind: str, name: str, cid: int, server: str = "n1") -> ConnectionEvent:
    return ConnectionEvent(kind, name, (server, cid))


def test_a_gateway_gone_past_its_grace_takes_its_non_resumable_requests() -> None:
    watch = OrphanWatch(grace_s=2.0)
    watch.track("r1", "gw-1", resumable=False)
    watch.track("r2", "gw-1", resumable=False)
    watch.track("r3", "gw-1", resumable=True)  # its client may resume it elsewhere
    watch.track("r4", "gw-2", resumable=False)
    watch.release("r2")  # ended by itself
    assert not watch.observe(event("disconnect", "someone-else", 9), 0.0)  # no request of theirs here
    assert watch.observe(event("disconnect", "gw-1", 1), 10.0)
    assert watch.due(11.0) == {}  # within the grace
    assert watch.next_due(11.0) == 1.0
    assert watch.due(12.0) == {"gw-1": ["r1"]}
    assert watch.due(13.0) == {}  # reported once
    watch.release("r1")  # the stop ends it: nothing left to release


def test_a_gateway_back_within_the_grace_keeps_its_requests() -> None:
    watch = OrphanWatch(grace_s=2.0)
    watch.track("r1", "gw-1", resumable=False)
    watch.observe(event("disconnect", "gw-1", 1, "n1"), 0.0)
    watch.observe(event("connect", "gw-1", 7, "n2"), 0.6)  # failed over to another node
    assert watch.due(5.0) == {}
    watch.release("r1")
    assert not watch.observe(event("disconnect", "gw-1", 7, "n2"), 6.0)  # nothing of it here any more


def test_a_reconnect_while_none_of_its_requests_is_here_still_counts() -> None:
    """The review's case: disconnect, the request ends, the gateway reconnects elsewhere,
    a new request of it arrives: the old disconnect must not stop the new request."""
    watch = OrphanWatch(grace_s=2.0)
    watch.track("r1", "gw", resumable=False)
    assert watch.observe(event("disconnect", "gw", 1, "n1"), 0.0)
    watch.release("r1")
    watch.observe(event("connect", "gw", 5, "n2"), 0.5)
    watch.track("r2", "gw", resumable=False)
    assert watch.due(2.1) == {}
