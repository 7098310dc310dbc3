"""Time-constant exponential smoothing for samples that arrive at irregular times."""

from __future__ import annotations

import math


def ewma(old: float | None, old_at: float | None, sample: float, now: float, tau: float) -> float:
    """``old`` (taken at ``old_at``) moved towards ``sample`` by the weight the elapsed time
    earns with time constant ``tau``; with no previous value, the sample itself."""
    if old is None or old_at is None:
        return sample
    alpha = 1.0 - math.exp(-max(0.0, now - old_at) / tau)
    return old + alpha * (sample - old)
