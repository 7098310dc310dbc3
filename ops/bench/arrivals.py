"""Arrival processes: when each request (or session) of an open-loop run is sent.

Pure and deterministic: a process draws from an injected ``numpy.random.Generator``
and returns offsets in seconds from the start of the run, first arrival at 0. The
gaps are drawn at unit rate and divided by the rate, so one seed gives the same
arrival pattern, time-scaled, at every rate of a sweep: runs at different rates
differ only in load, never in the luck of the draw.

Kinds:
- ``poisson``: exponential gaps (mean 1/rate, variance 1/rate²), the memoryless
  arrivals of many independent users; the default, as in ``vllm bench serve``.
- ``constant``: one request every 1/rate seconds.
- ``gamma``: gamma gaps with shape ``burstiness`` (1 = Poisson, < 1 burstier,
  > 1 smoother), mean 1/rate; the same knob as vLLM's ``--burstiness``.
- ``burst``: groups of ``burst_size`` requests sent at the same instant, one group
  every burst_size/rate seconds, so the mean rate is still ``rate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("poisson", "constant", "gamma", "burst")

# Gaps are drawn in blocks when only a duration bounds the run.
_BLOCK = 4096


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    kind: str = "poisson"
    burst_size: int = 8
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind must be one of {KINDS}, got {self.kind!r}")
        if self.burst_size < 1:
            raise ValueError("burst_size must be >= 1")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")

    def unit_gaps(self, n: int, rng: np.random.Generator, start: int = 0) -> np.ndarray:
        """Gaps ``start .. start+n-1`` between consecutive arrivals at rate 1.

        Gap i precedes arrival i; gap 0 is dropped so the first arrival is at 0.
        Drawing in blocks gives the same sequence as one long draw.
        """
        if self.kind == "poisson":
            return rng.exponential(1.0, size=n)
        if self.kind == "gamma":
            return rng.gamma(self.burstiness, 1.0 / self.burstiness, size=n)
        if self.kind == "constant":
            return np.ones(n)
        # burst: a gap of burst_size before each group's first arrival, 0 inside a group.
        idx = np.arange(start, start + n)
        return np.where(idx % self.burst_size == 0, float(self.burst_size), 0.0)

    def offsets(
        self,
        rate: float,
        rng: np.random.Generator,
        *,
        max_requests: int | None = None,
        max_duration: float | None = None,
    ) -> np.ndarray:
        """Arrival offsets (s) for ``rate`` requests/s, bounded by a count, a duration or both.

        ``rate = inf`` sends everything at once (a count bound is then required).
        """
        if max_requests is None and max_duration is None:
            raise ValueError("bound the arrivals by max_requests, max_duration or both")
        if not rate > 0:
            raise ValueError("rate must be > 0")
        if math.isinf(rate):
            if max_requests is None:
                raise ValueError("an infinite rate needs max_requests")
            return np.zeros(max_requests)
        if max_requests is not None:
            gaps = self.unit_gaps(max_requests, rng)
        else:
            assert max_duration is not None
            parts: list[np.ndarray] = []
            drawn, span = 0, 0.0
            while span <= max_duration * rate:
                block = self.unit_gaps(_BLOCK, rng, start=drawn)
                span += float(block.sum()) - (float(block[0]) if drawn == 0 else 0.0)
                parts.append(block)
                drawn += _BLOCK
            gaps = np.concatenate(parts)
        out = _offsets_from_gaps(gaps, rate)
        if max_duration is not None:
            out = out[out <= max_duration]
        return out


def _offsets_from_gaps(gaps: np.ndarray, rate: float) -> np.ndarray:
    if gaps.size == 0:
        return gaps
    # The first gap is dropped so the first arrival is at t=0.
    offsets = np.concatenate(([0.0], np.cumsum(gaps[1:]))) / rate
    return offsets


def scale_trace(timestamps: list[float] | np.ndarray, rate: float | None) -> np.ndarray:
    """Trace timestamps as offsets from the first, time-scaled to a mean ``rate`` if given."""
    ts = np.asarray(timestamps, dtype=float)
    if ts.size == 0:
        return ts
    order_ok = bool(np.all(np.diff(ts) >= 0))
    if not order_ok:
        raise ValueError("trace timestamps must be non-decreasing")
    offsets = ts - ts[0]
    if rate is None or ts.size < 2 or offsets[-1] == 0:
        return offsets
    if math.isinf(rate):
        return np.zeros_like(offsets)
    native = (ts.size - 1) / offsets[-1]
    return offsets * (native / rate)
