"""The metering service's query contracts: ``mesh.metering.usage`` and ``mesh.metering.fleet``
(request-reply).

A ``UsageQuery`` filters the ledger (org, key, model, a time range) and names the
dimensions to group by; the ``UsageReport`` answers one ``UsageRow`` per group with
request counts, token sums, the spend and the request count per status.

Times are Unix epoch seconds. An event's time is when it finished (its ``finish_time``,
else its ``arrival_time``, else when metering recorded it); ranges are
``since <= t < until``. Spend is an integer number of nano units of the price table's
currency (1e-9 USD by default) so sums are exact; ``UsageRow.spend`` is the float.

Building a query from HTTP parameters and rendering a report as JSON are not contract:
they live in ``services.common.usage``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import msgspec
from msgspec import Struct

from .messages import SCHEMA_VERSION

GroupBy = Literal["org", "key", "model", "tier", "worker", "status", "region", "hour", "day"]
GROUP_BY_VALUES: tuple[str, ...] = get_args(GroupBy)
DEFAULT_GROUP_BY: tuple[str, ...] = ("org", "key", "model")
MAX_ROWS = 10_000  # a report of 10k rows is ~1.5 MB of msgpack, well under max_payload
NANO = 1_000_000_000  # spend units per currency unit


class UsageQuery(Struct, kw_only=True, omit_defaults=True):
    """client (gateway, ``meshserve usage``) → metering: totals over a time range."""

    v: int = SCHEMA_VERSION
    org: str | None = None  # None: every org (operators only; the gateway always sets it)
    key_id: str | None = None
    model: str | None = None
    since: float | None = None  # inclusive; None: from the first event
    until: float | None = None  # exclusive; None: up to now
    group_by: list[GroupBy] = msgspec.field(default_factory=lambda: ["org", "key", "model"])
    limit: int = 1000  # rows at most; the report says when more existed


class UsageRow(Struct, kw_only=True, omit_defaults=True):
    """Totals of one group. Dimensions not grouped by are absent (None)."""

    org: str | None = None
    key_id: str | None = None
    model: str | None = None
    tier: str | None = None
    worker_id: str | None = None
    status: str | None = None
    region: str | None = None  # where it ran (UsageEvent.region)
    bucket: float | None = None  # start of the hour/day when grouped by time
    requests: int = 0  # each request once (a migrated one has a usage event per segment)
    prompt_tokens: int = 0  # all prompt tokens, cached ones included
    cached_tokens: int = 0
    completion_tokens: int = 0
    spend_nano: int = 0
    by_status: dict[str, int] = {}  # usage events per status (a migrated request's first segments: "migrated")
    first_at: float = 0.0
    last_at: float = 0.0

    @property
    def spend(self) -> float:
        return self.spend_nano / NANO


class UsageReport(Struct, kw_only=True, omit_defaults=True):
    """metering → client: the answer to a ``UsageQuery``."""

    v: int = SCHEMA_VERSION
    rows: list[UsageRow] = []
    group_by: list[str] = []
    since: float | None = None
    until: float | None = None
    currency: str = "USD"
    truncated: bool = False  # more groups matched than the query's limit
    generated_at: float = 0.0

    def total(self) -> UsageRow:
        """The sum of every row (of the rows returned, when truncated)."""
        total = UsageRow()
        by_status: dict[str, int] = {}
        for row in self.rows:
            total.requests += row.requests
            total.prompt_tokens += row.prompt_tokens
            total.cached_tokens += row.cached_tokens
            total.completion_tokens += row.completion_tokens
            total.spend_nano += row.spend_nano
            for status, count in row.by_status.items():
                by_status[status] = by_status.get(status, 0) + count
        total.by_status = by_status
        if self.rows:
            total.first_at = min(r.first_at for r in self.rows)
            total.last_at = max(r.last_at for r in self.rows)
        return total


def check_query(query: UsageQuery) -> None:
    """Raise ``ValueError`` for a query the ledger must not run."""
    bad = [g for g in query.group_by if g not in GROUP_BY_VALUES]
    if bad:
        raise ValueError(f"unknown group_by {bad}; allowed: {', '.join(GROUP_BY_VALUES)}")
    _check_common(query.group_by, query.since, query.until, query.limit)


def _check_common(group_by: list[Any], since: float | None, until: float | None, limit: int) -> None:
    if len(set(group_by)) != len(group_by):
        raise ValueError("group_by names a dimension twice")
    if "hour" in group_by and "day" in group_by:
        raise ValueError("group by hour or by day, not both")
    for name, value in (("since", since), ("until", until)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite epoch time")
    if since is not None and until is not None and until < since:
        raise ValueError("until is before since")
    if not 1 <= limit <= MAX_ROWS:
        raise ValueError(f"limit must be between 1 and {MAX_ROWS}")


# ---- the fleet report: what the fleet cost beside what it served (mesh.metering.fleet) -----
FleetGroupBy = Literal["model", "accelerator", "worker", "hour", "day"]
FLEET_GROUP_BY_VALUES: tuple[str, ...] = get_args(FleetGroupBy)
DEFAULT_FLEET_GROUP_BY: tuple[str, ...] = ("model", "accelerator")


class FleetQuery(Struct, kw_only=True, omit_defaults=True):
    """operator (``meshserve usage --fleet``) → metering: accelerator time, its cost, and the
    usage served on it, over a time range. A capacity period counts at its end."""

    v: int = SCHEMA_VERSION
    model: str | None = None
    since: float | None = None
    until: float | None = None
    group_by: list[FleetGroupBy] = msgspec.field(default_factory=lambda: ["model", "accelerator"])
    limit: int = 1000


class FleetRow(Struct, kw_only=True, omit_defaults=True):
    """One group's cost and what it served. ``model`` "" is a hot-swap host's unallocated
    memory: paid for, holding no model. Usage is matched to accelerators by the worker that
    served it; usage served by no worker (refused, failed before placement), or by one with
    no capacity period in the range, is in the rows without an accelerator (``accelerator`` "")."""

    model: str | None = None
    accelerator: str | None = None
    worker_id: str | None = None
    bucket: float | None = None
    replica_s: float = 0.0  # worker seconds (each worker's periods, whole)
    accelerator_s: float = 0.0  # accelerator seconds held (replica seconds x accelerators x share)
    busy_s: float = 0.0  # worker seconds with a request in flight
    cost_nano: int = 0  # the accelerator seconds at the price table's hourly prices
    unpriced_accelerator_s: float = 0.0  # held on accelerators the price table has no price for
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spend_nano: int = 0  # what the usage was charged (the same price table's token prices)

    @property
    def cost(self) -> float:
        return self.cost_nano / NANO

    @property
    def spend(self) -> float:
        return self.spend_nano / NANO

    @property
    def utilisation(self) -> float | None:
        """The share of replica time with work in flight (None without replica time)."""
        return self.busy_s / self.replica_s if self.replica_s > 0 else None

    def cost_per_million(self, tokens: int) -> float | None:
        """Cost per million of ``tokens`` (None when none were served)."""
        return self.cost_nano / NANO / tokens * 1e6 if tokens > 0 else None


class FleetReport(Struct, kw_only=True, omit_defaults=True):
    """metering → operator: the answer to a ``FleetQuery``."""

    v: int = SCHEMA_VERSION
    rows: list[FleetRow] = []
    group_by: list[str] = []
    since: float | None = None
    until: float | None = None
    currency: str = "USD"
    truncated: bool = False
    generated_at: float = 0.0

    def total(self) -> FleetRow:
        total = FleetRow()
        for row in self.rows:
            for name in ("replica_s", "accelerator_s", "busy_s", "cost_nano", "unpriced_accelerator_s", "requests",
                         "prompt_tokens", "cached_tokens", "completion_tokens", "spend_nano"):
                setattr(total, name, getattr(total, name) + getattr(row, name))
        return total


def check_fleet_query(query: FleetQuery) -> None:
    """Raise ``ValueError`` for a fleet query the ledger must not run."""
    bad = [g for g in query.group_by if g not in FLEET_GROUP_BY_VALUES]
    if bad:
        raise ValueError(f"unknown group_by {bad}; allowed: {', '.join(FLEET_GROUP_BY_VALUES)}")
    _check_common(query.group_by, query.since, query.until, query.limit)
