"""Admission: quota (token buckets per key and org) and predictive SLO shedding per tier
(DESIGN.md, Admission). ``buckets``, ``slo`` and ``policy`` are synchronous and take the
clock as ``now``; the async NATS shell drives them."""

from .buckets import (
    Limiter,
    LimiterConfig,
    Limits,
    QuotaResult,
    Reservation,
    Shortfall,
    TokenBucket,
    reserve_all,
)
from .policy import AdmissionPolicy, limits_of
from .slo import DEFAULT_TIERS, ReplicaLoad, SloAdmitter, SloConfig, SloVerdict, TierMix, TierSLO

__all__ = [
    "DEFAULT_TIERS",
    "AdmissionPolicy",
    "Limiter",
    "LimiterConfig",
    "Limits",
    "QuotaResult",
    "ReplicaLoad",
    "Reservation",
    "Shortfall",
    "SloAdmitter",
    "SloConfig",
    "SloVerdict",
    "TierMix",
    "TierSLO",
    "TokenBucket",
    "limits_of",
    "reserve_all",
]
