"""Usage queries from people's input and reports for people: not wire contract.

The gateway's ``GET /v1/usage`` builds its query with ``org_usage_query`` (the org is
the calling key's, never the client's choice) and renders the report with
``usage_report_json``; ``meshserve usage`` uses ``parse_time`` for ``--since/--until``.
The query and report themselves are ``proto.metering``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from proto.metering import NANO, FleetReport, UsageQuery, UsageReport, check_query

_RELATIVE = re.compile(r"^-\s*(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(value: str, now: float) -> float:
    """``-1h``/``-30m``/``-7d``/``-2w``/``-90s`` before ``now``, ``now``, epoch seconds, or ISO 8601.

    ISO times without an offset are UTC (the ledger and the servers keep UTC). A time no
    calendar date names (a millisecond epoch read as seconds, ``1e20``) is refused: every
    report prints its window as dates.
    """
    epoch = _parse_time(value, now)
    try:
        datetime.fromtimestamp(epoch, UTC)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"not a time: {value!r} is outside the years 1-9999 (an epoch time is in seconds)") from None
    return epoch


def _parse_time(value: str, now: float) -> float:
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
            for name in ("org", "key_id", "model", "tier", "worker_id", "status", "region", "bucket")
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
    return _report_json("usage.report", report, rows)


def _report_json(kind: str, report: UsageReport | FleetReport, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": kind,
        "currency": report.currency,
        "since": report.since,
        "until": report.until,
        "group_by": list(report.group_by),
        "truncated": report.truncated,
        "generated_at": report.generated_at,
        "data": rows,
    }


def fleet_report_json(report: FleetReport) -> dict[str, Any]:
    """A fleet report as JSON: the sums, with cost, spend and the derived figures as decimals."""
    rows = []
    for row in report.rows:
        item: dict[str, Any] = {name: getattr(row, name) for name in ("model", "accelerator", "worker_id", "bucket")
                                if getattr(row, name) is not None}
        tokens = row.prompt_tokens + row.completion_tokens
        item.update(
            replica_s=row.replica_s,
            accelerator_s=row.accelerator_s,
            busy_s=row.busy_s,
            utilisation=row.utilisation,
            cost=round(row.cost, 9),
            cost_nano=row.cost_nano,
            unpriced_accelerator_s=row.unpriced_accelerator_s,
            requests=row.requests,
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
            cost_per_million_tokens=row.cost_per_million(tokens),
            cost_per_million_output_tokens=row.cost_per_million(row.completion_tokens),
            spend=round(row.spend, 9),
            spend_nano=row.spend_nano,
            margin=round((row.spend_nano - row.cost_nano) / NANO, 9),
        )
        rows.append(item)
    return _report_json("fleet.report", report, rows)
