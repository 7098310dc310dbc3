"""The metering service's query contract: ``mesh.metering.usage`` (request-reply).

A ``UsageQuery`` filters the ledger (org, key, model, a time range) and names the
dimensions to group by; the ``UsageReport`` answers one ``UsageRow`` per group with
request counts, token sums, the spend and the request count per status.

Times are Unix epoch seconds. An event's time is when it finished (its ``finish_time``,
else its ``arrival_time``, else when metering recorded it); ranges are
``since <= t < until``. Spend is an integer number of nano units of the price table's
currency (1e-9 USD by default) so sums are exact; ``UsageRow.spend`` is the float.

The gateway's ``GET /v1/usage`` builds its query with ``org_usage_query`` (the org is
the calling key's, never the client's choice) and renders the report with
``usage_report_json``; ``meshserve usage`` uses ``parse_time`` for ``--since/--until``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import msgspec
from msgspec import Struct

from .messages import SCHEMA_VERSION

GroupBy = Literal["org", "key", "model", "tier", "worker", "status", "hour", "day"]
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
    bucket: float | None = None  # start of the hour/day when grouped by time
    requests: int = 0
    prompt_tokens: int = 0  # all prompt tokens, cached ones included
    cached_tokens: int = 0
    completion_tokens: int = 0
    spend_nano: int = 0
    by_status: dict[str, int] = {}  # requests per UsageEvent status
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
    if len(set(query.group_by)) != len(query.group_by):
        raise ValueError("group_by names a dimension twice")
    if "hour" in query.group_by and "day" in query.group_by:
        raise ValueError("group by hour or by day, not both")
    for name in ("since", "until"):
        value = getattr(query, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite epoch time")
    if query.since is not None and query.until is not None and query.until < query.since:
        raise ValueError("until is before since")
    if not 1 <= query.limit <= MAX_ROWS:
        raise ValueError(f"limit must be between 1 and {MAX_ROWS}")


_RELATIVE = re.compile(r"^-\s*(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(value: str, now: float) -> float:
    """``-1h``/``-30m``/``-7d``/``-2w``/``-90s`` before ``now``, ``now``, epoch seconds, or ISO 8601.

    ISO times without an offset are UTC (the ledger and the servers keep UTC).
    """
    text = value.strip()
    if not text:
        raise ValueError("empty time")
    if text.lower() == "now":
        return now
    relative = _RELATIVE.match(text.lower())
    if relative:
        return now - float(relative.group(1)) * _UNIT_S[relative.group(2)]
    try:
        epoch = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(epoch):
            raise ValueError(f"not a time: {value!r}")
        return epoch
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a time: {value!r} (use ISO 8601, epoch seconds, now, or -1h/-30m/-7d)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def org_usage_query(org: str, params: Mapping[str, str], now: float, *, key_id: str | None = None) -> UsageQuery:
    """The query the gateway sends for ``GET /v1/usage`` of an authenticated key.

    ``org`` is the calling key's org and always wins over the parameters, so a key sees
    its own org only. Parameters (all optional): ``since``, ``until`` (``parse_time``
    forms), ``model``, ``key_id`` (one key of the org), ``group_by`` (comma-separated;
    default ``model``; ``org`` is accepted and means nothing more), ``limit``.
    Pass ``key_id`` to restrict a key to its own usage. Raises ``ValueError`` (HTTP 400).
    """
    known = {"since", "until", "model", "key_id", "group_by", "limit"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(unknown)}")
    group_by = [g.strip() for g in params.get("group_by", "model").split(",") if g.strip()]
    query = UsageQuery(
        org=org,
        key_id=key_id if key_id is not None else (params.get("key_id") or None),
        model=params.get("model") or None,
        since=parse_time(params["since"], now) if params.get("since") else None,
        until=parse_time(params["until"], now) if params.get("until") else None,
        group_by=[g for g in group_by if g != "org"],  # type: ignore[misc]  # checked below
        limit=_int_param(params.get("limit"), 1000),
    )
    check_query(query)
    return query


def _int_param(value: str | None, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"limit must be an integer, got {value!r}") from None


def usage_report_json(report: UsageReport) -> dict[str, Any]:
    """The JSON body of ``GET /v1/usage``: the report with spend as a decimal number too."""
    rows = []
    for row in report.rows:
        item: dict[str, Any] = {
            name: getattr(row, name)
            for name in ("org", "key_id", "model", "tier", "worker_id", "status", "bucket")
            if getattr(row, name) is not None
        }
        item.update(
            requests=row.requests,
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
            spend=round(row.spend, 9),
            spend_nano=row.spend_nano,
            by_status=dict(row.by_status),
            first_at=row.first_at,
            last_at=row.last_at,
        )
        rows.append(item)
    return {
        "object": "usage.report",
        "currency": report.currency,
        "since": report.since,
        "until": report.until,
        "group_by": list(report.group_by),
        "truncated": report.truncated,
        "generated_at": report.generated_at,
        "data": rows,
    }
