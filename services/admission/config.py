"""The admission service's settings: ``AdmissionConfig`` and its file (JSON or TOML)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.config import build, checked, read_file

from .buckets import LimiterConfig
from .replicas import BookConfig
from .slo import SloConfig, TierSLO


@dataclass(frozen=True)
class AdmissionConfig:
    limiter: LimiterConfig = field(default_factory=LimiterConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    book: BookConfig = field(default_factory=BookConfig)
    lease_ttl_s: float = 3.0
    lease_renew_s: float = 1.0
    checkpoint_interval_s: float = 0.5
    expire_interval_s: float = 1.0
    snapshot_timeout_s: float = 2.0
    resync_retry_s: float = 2.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    # What it refused for want of capacity, reported to the autoscalers every
    # ``demand_interval_s`` over the last ``demand_window_s`` (``PoolDemand``).
    demand_window_s: float = 5.0
    demand_interval_s: float = 1.0
    # A key at its limit of requests in flight: how long a check waits for one of them to
    # end before it is refused. A request that just ended is settled by its usage event,
    # which travels the USAGE stream while the client's next request races it here; well
    # under the gateway's wait for admission (1 s), and before its forward_by (0.5 s).
    slot_wait_s: float = 0.4
    # Beyond this many of one key's checks waiting at once, the next is refused at once: a
    # client flooding a key at its limit gets 429s, not a pile of waiting checks.
    slot_waiters_per_key: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.lease_renew_s < self.lease_ttl_s / 2:
            raise ValueError("the lease must be renewed at least twice per TTL")


# ============================================================================ config file

_SECTIONS = {"tiers", "default_tier", "limits", "slo", "replicas", "service"}


def load_config(path: str | Path | None, **overrides: Any) -> AdmissionConfig:
    """An ``AdmissionConfig`` from a JSON or TOML (``.toml``) file, and CLI overrides."""
    return parse_config(read_file(path), **overrides)


def parse_config(raw: Mapping[str, Any], **overrides: Any) -> AdmissionConfig:
    """The file's schema (every section optional)::

        default_tier = "standard"
        [tiers.premium]            # replaces the default tiers when present
        ttft_slo_s = 1.0
        priority = 2
        [tiers.standard]
        ttft_slo_s = 2.0
        priority = 1
        [limits]                   # LimiterConfig: burst_s, reservation_ttl_s, idle_bucket_ttl_s
        burst_s = 60
        [slo]                      # SloConfig: headroom, long_prompt_slack, priority_queues, ...
        headroom = 0.8
        calibration_quantile = 0.999  # the share of admitted requests meant to meet the SLO
        [replicas]                 # BookConfig: gauge_stale_s, settle_s, pending_max_age_s
        [service]                  # lease_ttl_s, lease_renew_s, checkpoint_interval_s, ...

    ``overrides`` (from the CLI) win over the file. Keys: ``burst_s``,
    ``reservation_ttl_s`` (limiter), and any ``AdmissionConfig`` field.
    """
    unknown = set(raw) - _SECTIONS
    if unknown:
        raise ValueError(f"unknown admission config sections {sorted(unknown)}; expected {sorted(_SECTIONS)}")
    limits = checked(LimiterConfig, raw.get("limits") or {}, "limits")
    for key in ("burst_s", "reservation_ttl_s"):
        if key in overrides:
            limits[key] = overrides.pop(key)
    slo = checked(SloConfig, raw.get("slo") or {}, "slo")
    if "tiers" in slo:
        raise ValueError("slo.tiers is not a setting: use the tiers section")
    if raw.get("tiers"):
        slo["tiers"] = _tiers(raw["tiers"])
    if "default_tier" in raw:
        slo["default_tier"] = raw["default_tier"]
    service = checked(AdmissionConfig, raw.get("service") or {}, "service")
    for nested in ("limiter", "slo", "book"):
        if nested in service:
            raise ValueError(f"service.{nested} is not a setting: use its own section")
    service.update(overrides)
    return build(AdmissionConfig, {
        "limiter": build(LimiterConfig, limits, "limits"),
        "slo": build(SloConfig, slo, "slo"),
        "book": build(BookConfig, raw.get("replicas") or {}, "replicas"),
        **service,
    }, "service")


def _tiers(tiers: Any) -> tuple[TierSLO, ...]:
    """The ``tiers`` section: a table of tables by name, or a list of tables with a name."""
    if isinstance(tiers, Mapping):
        items = list(tiers.items())
    elif isinstance(tiers, list):
        items = []
        for i, spec in enumerate(tiers):
            if not isinstance(spec, Mapping):
                raise ValueError(f"tiers[{i}]: expected a table of settings (ttft_slo_s, priority), "
                                 f"not {type(spec).__name__}")
            if not isinstance(spec.get("name"), str):
                raise ValueError(f"tiers[{i}]: name must be a string")
            items.append((spec["name"], spec))
    else:
        raise ValueError(f"tiers: expected a table of tiers by name, not {type(tiers).__name__}")
    built = []
    for name, spec in items:
        where = f"tiers.{name}"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: expected a table of settings (ttft_slo_s, priority), not {type(spec).__name__}")
        built.append(build(TierSLO, {**{k: v for k, v in spec.items() if k != "name"}, "name": name}, where))
    return tuple(built)
