"""``bus.registry``: when heartbeats expire. One silent worker among live ones expires at
one TTL; every heartbeat stale at once (the bucket lost its leader when a NATS node died)
expires nobody until three TTLs have passed."""

from __future__ import annotations

from typing import cast

from bus.client import Bus
from bus.registry import OUTAGE_TTLS, WorkerRegistry, expired_heartbeats
from proto import WorkerInfo

TTL = 10.0  # workers heartbeat every TTL/4, each on its own phase


def test_a_silent_worker_among_live_ones_expires_at_one_ttl() -> None:
    assert expired_heartbeats({"live": 99.0, "silent": 89.0}, 100.0, TTL) == ["silent"]
    assert expired_heartbeats({"live": 99.0, "silent": 90.0}, 100.0, TTL) == []  # exactly one TTL: not yet


def test_every_heartbeat_stale_at_once_expires_nobody_before_three_ttls() -> None:
    # The last heartbeats stored before the bucket failed at 100, a heartbeat period apart.
    beats = {"a": 99.9, "b": 98.3, "c": 97.5}
    for now in (107.6, 110.0, 120.0, 127.4):  # c is stale from 107.5 on, all from 109.9
        assert expired_heartbeats(beats, now, TTL) == [], now
    assert expired_heartbeats(beats, 97.5 + 3 * TTL + 0.1, TTL) == ["c"]
    assert sorted(expired_heartbeats(beats, 99.9 + 3 * TTL + 0.1, TTL)) == ["a", "b", "c"]
    assert OUTAGE_TTLS == 3.0


def test_heartbeats_coming_back_expire_the_workers_that_died_meanwhile() -> None:
    # The bucket is back: the live workers' heartbeats are stored again; the dead one's is not.
    assert expired_heartbeats({"a": 125.0, "b": 124.0, "dead": 99.0}, 125.5, TTL) == ["dead"]


def test_heartbeats_never_stored_count_for_nothing() -> None:
    assert expired_heartbeats({"new": 0.0}, 1e9, TTL) == []
    assert expired_heartbeats({"new": 0.0, "old": 1.0}, 1e9, TTL) == ["old"]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def registry_with(clock: Clock, **beats: float) -> WorkerRegistry:
    registry = WorkerRegistry(cast(Bus, None), ttl_s=TTL, clock=clock)  # reap() needs no connection
    registry._replayed = True  # as a watch that has read the bucket
    for worker_id, at in beats.items():
        registry.workers[worker_id] = WorkerInfo(worker_id=worker_id, model="m", engine="sim", state="ready", heartbeat_at=at)
    return registry


def test_the_registry_keeps_its_workers_through_a_heartbeat_outage() -> None:
    clock = Clock(1000.0)
    registry = registry_with(clock, w1=1000.0, w2=997.6)
    dropped: list[str] = []
    registry.on_change(lambda worker_id, info: dropped.append(worker_id) if info is None else None)
    while clock.now + 2.5 < 997.6 + 3 * TTL:  # the reaper's pace, through the outage
        clock.now += 2.5
        assert registry.reap() == [], clock.now
    assert set(registry.workers) == {"w1", "w2"} and dropped == []
    clock.now = 1000.0 + 3 * TTL + 1
    assert sorted(registry.reap()) == ["w1", "w2"] and registry.workers == {} and sorted(dropped) == ["w1", "w2"]


def test_the_registry_drops_one_silent_worker_at_one_ttl() -> None:
    clock = Clock(1000.0)
    registry = registry_with(clock, live=1000.0, silent=1000.0)
    for step in range(1, 5):  # live keeps heartbeating every TTL/4
        clock.now = 1000.0 + step * 2.5
        registry.workers["live"].heartbeat_at = clock.now
        assert registry.reap() == []
    clock.now = 1010.5
    assert registry.reap() == ["silent"] and list(registry.workers) == ["live"]
