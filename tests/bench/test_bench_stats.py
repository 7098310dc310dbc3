"""Statistics against hand-computed cases: percentiles, TPOT, goodput, the knee, health."""

from __future__ import annotations

import math

import pytest

from ops.bench.results import RequestResult, SLOSpec
from ops.bench.stats import (
    client_health,
    dist,
    find_knee,
    meets_slo,
    percentile,
    run_duration,
    summarize,
)
from ops.bench.stream import tpot


def rec(i: int, status: str = "ok", ttft: float | None = 0.5, e2e: float | None = 1.0, out: int = 10,
        sent: float = 0.0, itl: list[float] | None = None, max_tokens: int = 10,
        prompt: int | None = None) -> RequestResult:
    r = RequestResult(index=i, session=i, turn=0, scheduled_s=sent, sent_s=sent, status=status,
                      input_tokens=100, prompt_tokens=prompt, max_tokens=max_tokens, output_tokens=out,
                      ttft_s=ttft, e2e_s=e2e, itl_s=itl or [])
    if status == "ok" and ttft is not None and e2e is not None:
        r.tpot_s = tpot(e2e, ttft, out)
    return r


def test_percentile_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # 1 + 0.9*3 = 3.7th order stat
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_dist_scales_and_skips_none() -> None:
    d = dist([0.1, None, 0.2, 0.3, 0.4], 1000.0)
    assert d.n == 4
    assert d.mean == pytest.approx(250.0)
    assert d.p50 == pytest.approx(250.0)
    assert d.p90 == pytest.approx(370.0)
    assert d.p95 == pytest.approx(385.0)
    assert d.p99 == pytest.approx(397.0)
    assert (d.min, d.max) == (pytest.approx(100.0), pytest.approx(400.0))
    assert dist([]).n == 0 and dist([]).p50 is None


def test_tpot() -> None:
    # first token at 0.2 s, 10 tokens by 1.1 s: 9 gaps over 0.9 s
    assert tpot(1.1, 0.2, 10) == pytest.approx(0.1)
    assert tpot(0.5, 0.2, 2) == pytest.approx(0.3)
    assert tpot(0.5, 0.2, 1) is None and tpot(0.5, 0.2, 0) is None


def test_goodput_and_attainment() -> None:
    slo = SLOSpec(ttft_s=1.0, tpot_s=0.05)
    records = [
        rec(0, ttft=0.5, e2e=0.5 + 9 * 0.04),           # meets both
        rec(1, ttft=1.5, e2e=1.5 + 9 * 0.01),           # TTFT too slow
        rec(2, ttft=0.5, e2e=0.5 + 9 * 0.06),           # TPOT too slow
        rec(3, status="429", ttft=None, e2e=0.01),      # errors always miss
        rec(4, ttft=0.9, e2e=0.9, out=1, max_tokens=1),  # no TPOT: judged on TTFT only
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False, True]
    s = summarize(records, slo, duration_s=2.0)
    assert s.requests == 5 and s.ok == 4 and s.errors == {"429": 1}
    assert s.slo_met == 2
    assert s.goodput == pytest.approx(1.0)           # 2 requests / 2 s
    assert s.slo_attainment == pytest.approx(0.4)    # 2 of 5 sent
    assert s.slo_holds is False                      # 0.4 < 0.9
    assert s.request_throughput == pytest.approx(2.0)  # 4 ok / 2 s
    assert s.output_tokens == 31 and s.output_token_throughput == pytest.approx(15.5)
    assert s.tpot_ms.n == 3 and s.ttft_ms.n == 4
    assert s.tpot_ms.p50 == pytest.approx(40.0)
    assert summarize(records, SLOSpec(ttft_s=2.0, tpot_s=0.1, attainment=0.8), 2.0).slo_holds is True
    assert summarize(records, None, 2.0).goodput is None  # no SLO, no goodput


def test_e2e_slo_and_throughput_counts_reported_prompt_tokens() -> None:
    slo = SLOSpec(e2e_s=1.0)
    records = [rec(0, e2e=0.9, prompt=120), rec(1, e2e=1.1)]
    s = summarize(records, slo, duration_s=1.0)
    assert s.slo_met == 1
    assert s.input_tokens == 120 + 100  # the target's count when it reported one


def test_duration_is_start_to_last_end() -> None:
    records = [rec(0, sent=0.0, e2e=1.0), rec(1, sent=0.5, e2e=2.0), rec(2, status="timeout", sent=1.0, e2e=None)]
    assert run_duration(records) == pytest.approx(2.5)
    s = summarize(records)
    assert s.duration_s == pytest.approx(2.5)
    assert s.offered_rate == pytest.approx(2.0)  # 3 sends over 1 s: 2 gaps / 1 s
    assert s.request_throughput == pytest.approx(2 / 2.5)


def test_itl_pooled_over_requests_and_length_mismatch() -> None:
    records = [rec(0, itl=[0.01, 0.02]), rec(1, itl=[0.03], out=8), rec(2, status="500", itl=[9.0])]
    s = summarize(records)
    assert s.itl_ms.n == 3 and s.itl_ms.p50 == pytest.approx(20.0)
    assert s.output_len_mismatch == 1


def test_find_knee() -> None:
    assert find_knee([(1, True), (2, True), (4, False), (8, True)]) == 2
    assert find_knee([(8, True), (1, True), (4, True), (2, True)]) == 8
    assert find_knee([(1, False), (2, True)]) is None
    assert find_knee([(1, None)]) is None
    assert find_knee([]) is None
    assert find_knee([(1, True), (math.inf, True)]) == math.inf


def test_client_health_flags_lag_and_late_sends() -> None:
    calm = client_health([0.001] * 100, [0.0005] * 50, cpu_s=0.2, wall_s=1.0, loop="uvloop")
    assert not calm.lagged and calm.reasons == [] and calm.loop == "uvloop"
    assert calm.lag_ms.p99 == pytest.approx(1.0) and calm.cpu_util == pytest.approx(0.2)
    lagged = client_health([0.001] * 90 + [0.05] * 10, [0.0] * 50, cpu_s=0.1, wall_s=1.0)
    assert lagged.lagged and "lag p99" in lagged.reasons[0]
    late = client_health([0.001] * 100, [0.0] * 95 + [0.02] * 5, cpu_s=0.1, wall_s=1.0)
    assert late.lagged and late.late_sends == 5 and "late" in late.reasons[0]
    busy = client_health([0.001], [0.0], cpu_s=0.95, wall_s=1.0)
    assert busy.lagged and "CPU" in busy.reasons[0]
