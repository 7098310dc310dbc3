"""Limiter hand-over (snapshot / restore) and the admission config file."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.admission.buckets import Limiter, LimiterConfig, Limits
from services.admission.config import AdmissionConfig, load_config, parse_config
from services.admission.lease import Checkpoint
from services.admission.main import add_arguments, build_config

LIMITS = Limits(rpm=100, tpm=1000, org_tpm=5000)


def test_snapshot_restore_carries_balances_and_open_reservations() -> None:
    old = Limiter()
    assert old.reserve("r1", "k", "o", 300, LIMITS, 0.0).admitted
    assert old.reserve("r2", "k", "o", 200, LIMITS, 0.0).admitted
    old.reconcile("r1", 100, 1.0)  # settled: 200 back
    old.reserve("idle", "k2", "o2", 10, Limits(tpm=1000), 0.0)
    old.release("idle", 0.5)  # k2's bucket is full again: left out of the snapshot
    state = old.snapshot(2.0)
    names = {b.name for b in state.buckets}
    assert "key:k2:tpm" not in names and "key:k:tpm" in names
    wire = msgspec.msgpack.encode(Checkpoint(instance_id="a", usage_seq=7, limiter=state))
    restored = msgspec.msgpack.decode(wire, type=Checkpoint)
    new = Limiter()
    new.restore(restored.limiter, 2.0)
    assert new.is_open("r2") and not new.is_open("r1") and len(new) == 1
    for name in ("key:k:tpm", "key:k:rpm", "org:o:tpm"):
        a, b = old.bucket(name), new.bucket(name)
        assert a is not None and b is not None
        assert (b.refill(2.0), b.rate, b.capacity) == pytest.approx((a.refill(2.0), a.rate, a.capacity))
    # the successor reconciles the open reservation exactly once, into the restored buckets
    assert new.reconcile("r2", 50, 3.0) == 150
    assert new.reconcile("r2", 50, 3.0) is None
    bucket = new.bucket("key:k:tpm")
    assert bucket is not None and bucket.tokens == pytest.approx(min(1000.0, 1000 - 100 - 50 + 3.0 * 1000 / 60))


def test_a_debt_survives_the_hand_over() -> None:
    old = Limiter()
    old.reserve("r", "k", "o", 100, Limits(tpm=600), 0.0)
    old.reconcile("r", 900, 0.0)  # used far more than reserved: the bucket is in debt
    new = Limiter()
    new.restore(old.snapshot(0.0), 0.0)
    b = new.bucket("key:k:tpm")
    assert b is not None and b.tokens == pytest.approx(-300.0)


def test_config_file_tiers_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "admission.toml"
    path.write_text(
        'default_tier = "gold"\n'
        "[tiers.gold]\nttft_slo_s = 0.5\npriority = 5\n"
        "[tiers.bronze]\nttft_slo_s = 4.0\npriority = 1\n"
        "[limits]\nburst_s = 10\n"
        "[slo]\nheadroom = 0.7\n"
        "[replicas]\ngauge_stale_s = 2\n"
        "[service]\nlease_ttl_s = 6\nlease_renew_s = 2\n"
    )
    cfg = load_config(path, reservation_ttl_s=60.0, metrics_port=None)
    assert [t.name for t in cfg.slo.tiers] == ["gold", "bronze"] and cfg.slo.default_tier == "gold"
    assert cfg.slo.tiers[0].ttft_slo_s == 0.5 and cfg.slo.headroom == 0.7
    assert cfg.limiter == LimiterConfig(burst_s=10, reservation_ttl_s=60.0)
    assert cfg.book.gauge_stale_s == 2 and cfg.lease_ttl_s == 6


@pytest.mark.parametrize(
    "raw",
    [
        {"tier": {}},
        {"tiers": {"gold": {"ttft_slo_s": 1, "priority": 1}}},  # default tier "standard" missing
        {"limits": {"burst": 5}},
        {"service": {"lease_ttl_s": 1, "lease_renew_s": 1}},  # renewed less than twice per TTL
        {"slo": {"headroom": 2}},
        {"replicas": 5},  # a section that is not a table
    ],
)
def test_bad_configs_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_config(raw)


def test_cli_arguments() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = build_config(parser.parse_args(["--burst", "30", "--reservation-ttl", "120", "--lease-ttl", "6"]))
    assert cfg.limiter.burst_s == 30 and cfg.limiter.reservation_ttl_s == 120
    assert cfg.lease_ttl_s == 6 and cfg.lease_renew_s == 2
    # options not given leave the dataclasses' defaults
    cfg = build_config(parser.parse_args([]))
    defaults = AdmissionConfig()
    assert (cfg.limiter, cfg.lease_ttl_s, cfg.lease_renew_s, cfg.metrics_host) == (
        defaults.limiter, defaults.lease_ttl_s, defaults.lease_renew_s, defaults.metrics_host)


def test_a_keys_requests_in_flight_are_counted_after_the_hand_over() -> None:
    old = Limiter()
    limits = Limits(concurrent=1)
    assert old.reserve("r1", "k", "o", 10, limits, 0.0).admitted
    wire = msgspec.msgpack.encode(Checkpoint(instance_id="a", usage_seq=1, limiter=old.snapshot(1.0)))
    new = Limiter()
    new.restore(msgspec.msgpack.decode(wire, type=Checkpoint).limiter, 1.0)
    assert not new.reserve("r2", "k", "o", 10, limits, 1.0).admitted  # r1 still holds the key's one slot
    new.reconcile("r1", 10, 2.0)
    assert new.reserve("r2", "k", "o", 10, limits, 2.0).admitted
