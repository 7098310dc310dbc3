"""``meshserve usage``: usage and spend totals from the metering service's ledger.

Asks ``mesh.metering.usage`` and prints a table, one row per group::

    meshserve usage --since -24h --group-by org,model
    meshserve usage --org acme --key k_123 --since 2025-01-01 --until 2025-02-01 --json

With ``--fleet`` it asks ``mesh.metering.fleet`` instead: what the fleet's accelerators
cost beside what they served (replica and accelerator hours, busy share, cost, cost per
million tokens, spend, margin), per model and accelerator by default::

    meshserve usage --fleet --since -24h
    meshserve usage --fleet --group-by model,day --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from proto.metering import (
    DEFAULT_FLEET_GROUP_BY,
    DEFAULT_GROUP_BY,
    FLEET_GROUP_BY_VALUES,
    GROUP_BY_VALUES,
    MAX_ROWS,
    FleetQuery,
    FleetReport,
    FleetRow,
    UsageQuery,
    UsageReport,
    UsageRow,
    check_fleet_query,
    check_query,
)
from services.common.cli_types import add_nats_url_argument, positive_int, positive_seconds, subject_root
from services.common.usage import fleet_report_json, parse_time, usage_report_json


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
    usage.add_argument("--group-by", default=None,
                       help=f"comma-separated from {','.join(GROUP_BY_VALUES)} (default {','.join(DEFAULT_GROUP_BY)}); "
                            f"with --fleet from {','.join(FLEET_GROUP_BY_VALUES)} (default "
                            f"{','.join(DEFAULT_FLEET_GROUP_BY)}); empty: one total")
    usage.add_argument("--fleet", action="store_true",
                       help="what the fleet cost beside what it served: accelerator hours, busy share, cost at the "
                            "price table's accelerator prices, cost per million tokens, spend, margin")
    usage.add_argument("--limit", type=positive_int, default=1000, help=f"rows at most (up to {MAX_ROWS})")
    usage.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    usage.add_argument("--timeout", type=positive_seconds, default=10.0, help="seconds to wait for the metering service")
    usage.set_defaults(func=run_usage)
    # `--since -1h`: argparse takes "-1h" for an option unless it looks like a negative
    # number; widen its notion of one for this parser (it has no options that look so).
    usage._negative_number_matcher = re.compile(r"^-\d+(\.\d+)?[smhdw]?$|^-\d*\.\d+$")


def _group_by(args: argparse.Namespace, default: tuple[str, ...]) -> list[Any]:
    text = ",".join(default) if args.group_by is None else args.group_by
    return [g.strip() for g in text.split(",") if g.strip()]


def build_query(args: argparse.Namespace, now: float) -> UsageQuery:
    query = UsageQuery(
        org=args.org,
        key_id=args.key,
        model=args.model,
        since=parse_time(args.since, now) if args.since else None,
        until=parse_time(args.until, now) if args.until else None,
        group_by=_group_by(args, DEFAULT_GROUP_BY),  # checked below
        limit=args.limit,
    )
    check_query(query)
    return query


def build_fleet_query(args: argparse.Namespace, now: float) -> FleetQuery:
    given = [flag for flag, value in (("--org", args.org), ("--key", args.key)) if value is not None]
    if given:
        raise ValueError(f"{' and '.join(given)}: the fleet report is per model, accelerator, worker and time, "
                         "not per customer (without --fleet, usage is)")
    query = FleetQuery(
        model=args.model,
        since=parse_time(args.since, now) if args.since else None,
        until=parse_time(args.until, now) if args.until else None,
        group_by=_group_by(args, DEFAULT_FLEET_GROUP_BY),  # checked below
        limit=args.limit,
    )
    check_fleet_query(query)
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
               "region": "region", "hour": "hour (UTC)", "day": "day (UTC)"}
    fields = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
              "status": "status", "region": "region", "hour": "bucket", "day": "bucket"}
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


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f}"


def _money(nano: int) -> str:
    return f"{nano / 1e9:,.4f}"


def _optional(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def fleet_cells(row: FleetRow) -> list[str]:
    """The figures of one fleet row, as the table prints them."""
    tokens = row.prompt_tokens + row.completion_tokens
    utilisation = row.utilisation
    return [_hours(row.replica_s), _optional(None if utilisation is None else 100 * utilisation, ".1f"),
            _hours(row.accelerator_s), _money(row.cost_nano), f"{row.requests:,}", f"{row.prompt_tokens:,}",
            f"{row.completion_tokens:,}", _optional(row.cost_per_million(tokens), ",.4f"),
            _optional(row.cost_per_million(row.completion_tokens), ",.4f"), _money(row.spend_nano),
            _money(row.spend_nano - row.cost_nano)]


def render_fleet(report: FleetReport) -> Any:
    from rich.table import Table

    from ops.console import plain

    fields = {"model": "model", "accelerator": "accelerator", "worker": "worker_id", "hour": "bucket", "day": "bucket"}
    headers = {"hour": "hour (UTC)", "day": "day (UTC)"}
    since = _when(report.since) if report.since is not None else "the first report"
    until = _when(report.until) if report.until is not None else "now"
    total = report.total()
    unpriced = total.unpriced_accelerator_s
    caption = (f"{unpriced / 3600:,.2f} accelerator-hours had no price: add their accelerators to the price table "
               "(`[accelerators.\"NAME\"] per_hour = ...`)" if unpriced > 0 else None)
    table = Table(title=f"fleet cost {since} → {until} (UTC)", caption=caption, show_footer=len(report.rows) > 1)
    for i, name in enumerate(report.group_by):
        table.add_column(headers.get(name, name), footer="total" if i == 0 else "")
    cur = report.currency
    titles = ["replica h", "busy %", "accel h", f"cost ({cur})", "requests", "prompt", "completion",
              f"{cur} / 1M tok", f"{cur} / 1M out", f"spend ({cur})", f"margin ({cur})"]
    for title, footer in zip(titles, fleet_cells(total), strict=True):
        table.add_column(title, justify="right", footer=footer)
    for row in report.rows:
        dims = []
        for name in report.group_by:
            dim = getattr(row, fields[name])
            if name in ("hour", "day"):
                dim = _when(dim)[: 10 if name == "day" else 16]
            elif name == "model" and dim == "":
                dim = "(unallocated)"  # a hot-swap host's memory no model held
            dims.append("" if dim is None else plain(str(dim) or "-"))
        table.add_row(*dims, *fleet_cells(row))
    return table


async def fetch_report(query: UsageQuery, timeout: float) -> UsageReport:
    from ops.console import mesh_bus

    async with mesh_bus("meshserve-usage") as bus:
        return await bus.request(bus.subjects.metering_usage, query, UsageReport, timeout=timeout)


async def fetch_fleet_report(query: FleetQuery, timeout: float) -> FleetReport:
    from ops.console import mesh_bus

    async with mesh_bus("meshserve-usage") as bus:
        return await bus.request(bus.subjects.metering_fleet, query, FleetReport, timeout=timeout)


def run_usage(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)
    if args.fleet:
        return _run_report(args, build_fleet_query, fetch_fleet_report, fleet_report_json, render_fleet)
    return _run_report(args, build_query, fetch_report, usage_report_json, render)


def _run_report(args: argparse.Namespace, build: Callable[[argparse.Namespace, float], Any],
                fetch: Callable[[Any, float], Coroutine[Any, Any, Any]], as_json: Callable[[Any], dict[str, Any]],
                draw: Callable[[Any], Any]) -> int:
    """Ask metering for one report (usage, or the fleet's cost) and print it as a table or JSON."""
    from rich.console import Console

    from ops.console import EXIT_USAGE, CliError, print_table
    from proto.errors import MeshError

    try:
        query = build(args, time.time())
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    try:
        report: Any = asyncio.run(fetch(query, args.timeout))
    except MeshError as exc:
        raise CliError(f"{exc.message} (is `meshserve serve metering` running?)") from exc
    if args.json:
        json.dump(as_json(report), sys.stdout, indent=2)
        print()
        return 0
    print_table(Console(), draw(report))
    if report.truncated:
        Console(stderr=True).print(
            f"[yellow]more groups matched than --limit {query.limit}; showing the first {len(report.rows)}[/yellow]",
            soft_wrap=True)
    return 0
