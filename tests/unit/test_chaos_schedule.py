"""The chaos soak's fault schedule (benchmarks/chaos_schedule.py): seeded, survivable by design."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.chaos_schedule import KINDS, Fault, ScheduleConfig, counts, schedule

TARGETS = {
    "worker": ["worker-1", "worker-2", "worker-3"],
    "gateway": ["gateway", "gateway-2"],
    "nats": ["nats-0", "nats-1", "nats-2"],
    "router": ["router"],
    "admission": ["admission"],
    "metering": ["metering"],
}


def test_same_seed_same_schedule_other_seed_another() -> None:
    assert schedule(7, 300, TARGETS) == schedule(7, 300, TARGETS)
    assert schedule(7, 300, TARGETS) != schedule(8, 300, TARGETS)


@pytest.mark.parametrize("seed", range(20))
def test_faults_are_survivable(seed: int) -> None:
    config = ScheduleConfig()
    faults = schedule(seed, 600, TARGETS, config)
    assert faults == sorted(faults, key=lambda f: f.at)
    for f in faults:
        assert f.target in TARGETS[f.kind]
        assert f.at >= config.warmup_s and f.ends <= 600 - config.quiet_s
        low, high = config.kill_down_s if f.action == "kill" else config.pause_down_s
        assert low <= f.down_s <= high
        assert not (f.kind == "nats" and f.action == "pause")
    for kind in KINDS:  # never two of a kind at once: one of each always serves
        mine = [f for f in faults if f.kind == kind]
        assert all(a.ends <= b.at for a, b in itertools.pairwise(mine)), kind
    for f in faults:  # never more than max_concurrent under way
        assert sum(g.at <= f.at < g.ends for g in faults) <= config.max_concurrent


def test_a_minute_strikes_every_kind_both_ways() -> None:
    faults = schedule(1, 60, TARGETS)
    assert set(counts(faults)) == {f"{a} {k}" for k in KINDS for a in ("kill", "pause")} - {"pause nats"}


def test_kinds_without_targets_are_spared() -> None:
    faults = schedule(3, 300, {"worker": ["worker-1", "worker-2"], "nats": []})
    assert faults and {f.kind for f in faults} == {"worker"}
    assert schedule(3, 300, {}) == []


def test_too_short_for_any_fault() -> None:
    assert schedule(1, 8, TARGETS) == []


def test_counts_by_action_and_kind() -> None:
    faults = [Fault(1, "kill", "worker", "worker-1", 2), Fault(4, "pause", "worker", "worker-2", 2),
              Fault(5, "kill", "worker", "worker-1", 2)]
    assert counts(faults) == {"kill worker": 2, "pause worker": 1}
