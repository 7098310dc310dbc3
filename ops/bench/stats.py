"""Statistics of a run (pure): percentiles, throughput, goodput, the SLO knee, and the
client's own health.

Percentiles interpolate linearly between order statistics (numpy's default, as in
``vllm bench serve``): p50 of [1, 2, 3, 4] is 2.5. Latency distributions cover the
requests that succeeded; SLO attainment counts every request sent, so errors are
misses. A request with fewer than two output tokens has no TPOT and is judged on the
other bounds only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from ops.bench.results import (
    STATUS_OK,
    ClientHealth,
    Dist,
    RequestResult,
    SLOSpec,
    Summary,
)

PERCENTILES = (50, 90, 95, 99)

# A client whose event loop runs this late, or sends requests this late, is a suspect
# witness: its latencies include its own queueing.
LAG_P99_LIMIT_S = 0.010
LATE_SEND_LIMIT_S = 0.010
LATE_SEND_FRACTION = 0.01


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q))


def dist(values: Iterable[float | None], scale: float = 1.0) -> Dist:
    """Summary of a sample (None entries skipped), each value multiplied by ``scale``."""
    arr = np.fromiter((v for v in values if v is not None), dtype=float) * scale
    if arr.size == 0:
        return Dist()
    p50, p90, p95, p99 = (float(x) for x in np.percentile(arr, PERCENTILES))
    return Dist(n=int(arr.size), mean=float(arr.mean()), p50=p50, p90=p90, p95=p95, p99=p99,
                min=float(arr.min()), max=float(arr.max()))


def meets_slo(rec: RequestResult, slo: SLOSpec) -> bool:
    if rec.status != STATUS_OK:
        return False
    if slo.ttft_s is not None and (rec.ttft_s is None or rec.ttft_s > slo.ttft_s):
        return False
    if slo.tpot_s is not None and rec.tpot_s is not None and rec.tpot_s > slo.tpot_s:
        return False
    return not (slo.e2e_s is not None and (rec.e2e_s is None or rec.e2e_s > slo.e2e_s))


def run_duration(records: Sequence[RequestResult]) -> float:
    """From the run's start (t=0) to the last request's end."""
    ends = [r.sent_s + r.e2e_s for r in records if r.e2e_s is not None]
    sends = [r.sent_s for r in records]
    return max(ends + sends, default=0.0)


def summarize(records: Sequence[RequestResult], slo: SLOSpec | None = None,
              duration_s: float | None = None) -> Summary:
    """Per-run figures. Throughputs divide by ``duration_s`` (default: start to last end)."""
    slo = slo or SLOSpec()
    duration = run_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.status == STATUS_OK]
    errors = Counter(r.status for r in records if r.status != STATUS_OK)
    s = Summary(requests=len(records), ok=len(ok), errors=dict(sorted(errors.items())),
                duration_s=duration)
    sends = sorted(r.sent_s for r in records)
    if len(sends) >= 2 and sends[-1] > sends[0]:
        s.offered_rate = (len(sends) - 1) / (sends[-1] - sends[0])
    s.input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens for r in ok)
    s.output_tokens = sum(r.output_tokens for r in ok)
    if duration > 0:
        s.request_throughput = len(ok) / duration
        s.input_token_throughput = s.input_tokens / duration
        s.output_token_throughput = s.output_tokens / duration
        s.total_token_throughput = (s.input_tokens + s.output_tokens) / duration
    s.output_len_mismatch = sum(1 for r in ok if r.max_tokens and r.output_tokens != r.max_tokens)
    s.ttft_ms = dist((r.ttft_s for r in ok), 1000.0)
    s.tpot_ms = dist((r.tpot_s for r in ok), 1000.0)
    s.e2e_ms = dist((r.e2e_s for r in ok), 1000.0)
    s.itl_ms = dist((x for r in ok for x in r.itl_s), 1000.0)
    if slo.active:
        met = sum(1 for r in records if meets_slo(r, slo))
        s.slo_met = met
        s.goodput = met / duration if duration > 0 else 0.0
        s.slo_attainment = met / len(records) if records else None
        s.slo_holds = s.slo_attainment is not None and s.slo_attainment >= slo.attainment
    return s


def find_knee(points: Sequence[tuple[float, bool | None]]) -> float | None:
    """The highest load whose SLO holds with every lower load holding too.

    ``points`` are (load, holds) pairs in any order; None when the lowest load fails.
    """
    knee: float | None = None
    for load, holds in sorted(points, key=lambda p: p[0]):
        if not holds:
            break
        knee = load
    return knee


def client_health(
    lags_s: Sequence[float],
    send_late_s: Sequence[float],
    cpu_s: float,
    wall_s: float,
    loop: str = "asyncio",
    *,
    lag_limit_s: float = LAG_P99_LIMIT_S,
    late_limit_s: float = LATE_SEND_LIMIT_S,
    late_fraction: float = LATE_SEND_FRACTION,
) -> ClientHealth:
    """Judge whether the load generator itself was a bottleneck during a run."""
    h = ClientHealth(loop=loop, lag_ms=dist(lags_s, 1000.0), send_late_ms=dist(send_late_s, 1000.0))
    h.late_sends = sum(1 for x in send_late_s if x > late_limit_s)
    h.cpu_util = cpu_s / wall_s if wall_s > 0 else 0.0
    lag_p99 = percentile(lags_s, 99)
    if lag_p99 is not None and lag_p99 > lag_limit_s:
        h.reasons.append(f"event-loop lag p99 {lag_p99 * 1000:.1f} ms > {lag_limit_s * 1000:g} ms")
    if send_late_s and h.late_sends > late_fraction * len(send_late_s):
        h.reasons.append(f"{h.late_sends}/{len(send_late_s)} requests sent more than "
                         f"{late_limit_s * 1000:g} ms late")
    if h.cpu_util > 0.9:
        h.reasons.append(f"client CPU {h.cpu_util:.0%} of a core")
    h.lagged = bool(h.reasons)
    return h


def fmt_load(mode: str, arrival: str, rate: float | None, concurrency: int | None,
             unit: str = "req/s") -> str:
    """``unit`` is sessions/s for multi-turn workloads (arrivals start sessions)."""
    if mode == "closed-loop":
        return f"closed-loop c={concurrency}"
    if rate is None or math.isinf(rate):
        return f"{arrival} all-at-once"
    return f"{arrival} {rate:g} {unit}"
