"""Arrival processes: statistics for a seed, bounds, determinism across rates."""

from __future__ import annotations

import numpy as np
import pytest

from ops.bench.arrivals import ArrivalProcess, scale_trace


def rng(seed: int = 1) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_poisson_mean_and_variance() -> None:
    rate = 5.0
    offsets = ArrivalProcess("poisson").offsets(rate, rng(), max_requests=20001)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() == pytest.approx(1 / rate**2, rel=0.06)  # exponential: var = mean²
    # Counts per 1 s window are Poisson(rate): mean == variance.
    counts = np.bincount(offsets.astype(int))[:-1]
    assert counts.mean() == pytest.approx(rate, rel=0.05)
    assert counts.var() == pytest.approx(rate, rel=0.15)


def test_constant_and_burst_keep_the_mean_rate() -> None:
    const = ArrivalProcess("constant").offsets(4.0, rng(), max_requests=5)
    assert const.tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    burst = ArrivalProcess("burst", burst_size=3).offsets(6.0, rng(), max_requests=7)
    assert burst.tolist() == pytest.approx([0, 0, 0, 0.5, 0.5, 0.5, 1.0])


def test_gamma_burstiness_sets_the_variance() -> None:
    rate, k = 10.0, 0.25
    gaps = np.diff(ArrivalProcess("gamma", burstiness=k).offsets(rate, rng(3), max_requests=40001))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    assert gaps.var() == pytest.approx(1 / (k * rate**2), rel=0.1)  # CV² = 1/k


def test_bounds_by_count_duration_or_both() -> None:
    p = ArrivalProcess("poisson")
    assert len(p.offsets(10, rng(), max_requests=50)) == 50
    by_time = p.offsets(10, rng(), max_duration=30.0)
    assert by_time[-1] <= 30.0 and 250 < len(by_time) < 350
    both = p.offsets(10, rng(), max_requests=1000, max_duration=2.0)
    assert both[-1] <= 2.0 and len(both) < 1000
    # A duration bound draws the same sequence as a count bound.
    assert by_time[:50] == pytest.approx(p.offsets(10, rng(), max_requests=50))
    assert p.offsets(float("inf"), rng(), max_requests=4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        p.offsets(10, rng())
    with pytest.raises(ValueError):
        p.offsets(float("inf"), rng(), max_duration=1.0)
    with pytest.raises(ValueError):
        ArrivalProcess("fractal")


def test_same_seed_same_pattern_time_scaled_across_rates() -> None:
    p = ArrivalProcess("poisson")
    slow = p.offsets(2.0, rng(9), max_requests=100)
    fast = p.offsets(8.0, rng(9), max_requests=100)
    assert slow == pytest.approx(fast * 4)
    assert not np.allclose(p.offsets(2.0, rng(10), max_requests=100), slow)


def test_scale_trace() -> None:
    ts = [10.0, 11.0, 13.0, 14.0]  # native mean rate 3 / 4 s = 0.75 req/s
    assert scale_trace(ts, None).tolist() == [0, 1, 3, 4]
    assert scale_trace(ts, 1.5).tolist() == pytest.approx([0, 0.5, 1.5, 2.0])
    assert scale_trace(ts, float("inf")).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        scale_trace([2.0, 1.0], None)
