"""``meshserve usage``: usage and spend totals from the metering service's ledger.

Asks ``mesh.metering.usage`` and prints a table, one row per group::

    meshserve usage --since -24h --group-by org,model
    meshserve usage --org acme --key k_123 --since 2025-01-01 --until 2025-02-01 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

from proto.metering import (
    DEFAULT_GROUP_BY,
    GROUP_BY_VALUES,
    MAX_ROWS,
    UsageQuery,
    UsageReport,
    UsageRow,
    check_query,
)
from services.common.cli_types import add_nats_url_argument, positive_int, positive_seconds, subject_root
from services.common.usage import parse_time, usage_report_json


def add_parser(subparsers: Any) -> None:
    usage = subparsers.add_parser(
        "usage", help="usage and spend totals per org, key and model (from metering)",
        description="Usage and spend totals from the metering service's ledger: a table for people (whole at any "
                    "width: a narrow terminal gets it stacked), --json for scripts.")
    add_nats_url_argument(usage)
    usage.add_argument("--root", type=subject_root, default=None, help="subject root (env MESHSERVE_ROOT)")
    usage.add_argument("--org", default=None, help="only this org")
    usage.add_argument("--key", default=None, help="only this API key id")
    usage.add_argument("--model", default=None, help="only this model")
    usage.add_argument("--since", default=None,
                       help="from (inclusive): ISO 8601 (UTC unless an offset is given), epoch seconds, or -1h/-30m/-7d")
    usage.add_argument("--until", default=None, help="to (exclusive), same forms; default now")
    usage.add_argument("--group-by", default=",".join(DEFAULT_GROUP_BY),
                       help=f"comma-separated from {','.join(GROUP_BY_VALUES)} (empty: one total)")
    usage.add_argument("--limit", type=positive_int, default=1000, help=f"rows at most (up to {MAX_ROWS})")
    usage.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    usage.add_argument("--timeout", type=positive_seconds, default=10.0, help="seconds to wait for the metering service")
    usage.set_defaults(func=run_usage)
    # `--since -1h`: argparse takes "-1h" for an option unless it looks like a negative
    # number; widen its notion of one for this parser (it has no options that look so).
    usage._negative_number_matcher = re.compile(r"^-\d+(\.\d+)?[smhdw]?$|^-\d*\.\d+$")


def build_query(args: argparse.Namespace, now: float) -> UsageQuery:
    query = UsageQuery(
        org=args.org,
        key_id=args.key,
        model=args.model,
        since=parse_time(args.since, now) if args.since else None,
        until=parse_time(args.until, now) if args.until else None,
        group_by=[g.strip() for g in args.group_by.split(",") if g.strip()],  # type: ignore[misc]  # checked below
        limit=args.limit,
    )
    check_query(query)
    return query


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _spend(row: UsageRow) -> str:
    return f"{row.spend_nano / 1e9:,.6f}"


def _statuses(by_status: dict[str, int]) -> str:
    return " ".join(f"{status}={count:,}" for status, count in sorted(by_status.items()))


def render(report: UsageReport) -> Any:
    from rich.table import Table

    from ops.console import plain

    headers = {"org": "org", "key": "key", "model": "model", "tier": "tier", "worker": "worker", "status": "status",
               "hour": "hour (UTC)", "day": "day (UTC)"}
    fields = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
              "status": "status", "hour": "bucket", "day": "bucket"}
    since = _when(report.since) if report.since is not None else "the first event"
    until = _when(report.until) if report.until is not None else "now"
    window = f"{since} → {until} (UTC)"
    table = Table(title=f"usage {window}", show_footer=len(report.rows) > 1)
    total = report.total()
    for i, name in enumerate(report.group_by):
        table.add_column(headers.get(name, name), footer="total" if i == 0 else "")
    for title, value in (("requests", total.requests), ("prompt", total.prompt_tokens),
                         ("cached", total.cached_tokens), ("completion", total.completion_tokens)):
        table.add_column(title, justify="right", footer=f"{value:,}")
    table.add_column(f"spend ({report.currency})", justify="right", footer=_spend(total))
    table.add_column("by status", footer=_statuses(total.by_status))
    for row in report.rows:
        dims = []
        for name in report.group_by:
            dim = getattr(row, fields[name])
            if name in ("hour", "day"):
                dim = _when(dim)[: 10 if name == "day" else 16]
            dims.append("" if dim is None else plain(str(dim) or "-"))
        table.add_row(*dims, f"{row.requests:,}", f"{row.prompt_tokens:,}", f"{row.cached_tokens:,}",
                      f"{row.completion_tokens:,}", _spend(row), _statuses(row.by_status))
    return table


async def fetch_report(query: UsageQuery, timeout: float) -> UsageReport:
    from ops.console import mesh_bus

    async with mesh_bus("meshserve-usage") as bus:
        return await bus.request(bus.subjects.metering_usage, query, UsageReport, timeout=timeout)


def run_usage(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ops.console import EXIT_USAGE, CliError, print_table
    from proto.errors import MeshError

    from .serve import apply_common_arguments

    apply_common_arguments(args)
    try:
        query = build_query(args, time.time())
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    try:
        report = asyncio.run(fetch_report(query, args.timeout))
    except MeshError as exc:
        raise CliError(f"{exc.message} (is `meshserve serve metering` running?)") from exc
    if args.json:
        json.dump(usage_report_json(report), sys.stdout, indent=2)
        print()
        return 0
    print_table(Console(), render(report))
    if report.truncated:
        Console(stderr=True).print(
            f"[yellow]more groups matched than --limit {query.limit}; showing the first {len(report.rows)}[/yellow]",
            soft_wrap=True)
    return 0
