"""``meshserve status``: what the autoscaler sees and decided, per pool.

Asks ``mesh.autoscaler.status`` and prints, per pool, the replica counts, the signals of
the last tick, the workers, drains in progress and the last decisions with their reasons;
then the driver's health. ``--json`` prints the reply as JSON instead.

A mesh without an autoscaler (``meshserve up --no-autoscaler``, hot-swap hosts, workers
started by hand) still gets an answer: the workers' registry entries and one gauge of
each, read directly (``workers_from_registry``), with hot-swap residency in the state
column (``loading``, ``cold``, ``evicting``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from typing import Any

import msgspec

from bus import Bus
from ops.console import CliError, mesh_bus, plain, print_table
from proto.autoscaler import AutoscalerStatus, AutoscalerStatusRequest, PoolStatus, WorkerView
from proto.errors import MeshError
from services.common.cli_types import add_nats_url_argument, count, positive_seconds, subject_root


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="autoscaler status: replicas, signals and decisions per pool",
        description="What the autoscaler sees and decided, per pool: tables for people (whole at any width: "
                    "a narrow terminal gets them stacked), --json for scripts. Exit 3 when the driver cannot act.")
    add_nats_url_argument(parser)
    parser.add_argument("--root", type=subject_root, default=None, help="subject root (env MESHSERVE_ROOT)")
    parser.add_argument("--pool", default="", help="only this pool")
    parser.add_argument("--decisions", type=count, default=10, help="recent decisions per pool")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON (for scripts)")
    parser.add_argument("--timeout", type=positive_seconds, default=3.0, help="seconds to wait for the autoscaler")
    parser.set_defaults(func=run_status)


async def fetch_status(bus: Bus, pool: str = "", decisions: int = 10, timeout: float = 3.0) -> AutoscalerStatus:
    return await bus.request(
        bus.subjects.autoscaler_status, AutoscalerStatusRequest(pool=pool, decisions=decisions), AutoscalerStatus,
        timeout=timeout,
    )


def run_status(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)

    async def main() -> AutoscalerStatus | list[WorkerView]:
        async with mesh_bus("meshserve-status") as bus:
            try:
                return await fetch_status(bus, args.pool, args.decisions, args.timeout)
            except MeshError as exc:
                workers = await workers_from_registry(bus, args.pool)
                if not workers:
                    raise CliError(f"no autoscaler answered on {bus.subjects.autoscaler_status} ({exc}),"
                                   " and no worker is registered") from exc
                return workers

    status = asyncio.run(main())
    if isinstance(status, AutoscalerStatus) and args.pool and not status.pools:
        raise CliError(f"the autoscaler has no pool {args.pool!r} (meshserve status lists its pools)")
    if isinstance(status, list):
        if args.json:
            sys.stdout.write(_json({"workers": status}) + "\n")
        else:
            from rich.console import Console

            console = Console()
            console.print("no autoscaler on this mesh: the workers, from the registry and their gauges", soft_wrap=True)
            _print_workers(console, status, "workers")
        return 0
    if args.json:
        sys.stdout.write(_json(status) + "\n")
    else:
        print_status(status)
    return 0 if status.driver.ok else 3


def _every_field(value: Any) -> Any:
    """Builtins with every field of every Struct: the wire format leaves out default values
    (0, "", []), and a script reading ``pool["draining"]`` must not fail when it is 0."""
    if isinstance(value, msgspec.Struct):
        return {name: _every_field(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [_every_field(v) for v in value]
    if isinstance(value, dict):
        return {k: _every_field(v) for k, v in value.items()}
    return value


def _json(value: Any) -> str:
    return msgspec.json.format(msgspec.json.encode(_every_field(value))).decode()


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "-"


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def print_status(status: AutoscalerStatus, console: Any = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    summary = Table(title=f"autoscaler {status.instance_id} (tick {status.tick_s:g} s, at {_clock(status.at)})")
    for column in ("pool", "current", "desired", "ready", "starting", "draining", "min–max", "load tokens",
                   "capacity/replica", "pending"):
        summary.add_column(column, justify="left" if column == "pool" else "right")
    for p in status.pools:
        s = p.signals
        summary.add_row(
            plain(p.pool), str(p.current), f"[bold]{p.desired}[/bold]", str(p.ready), str(p.starting), str(p.draining),
            f"{p.min_replicas}–{p.max_replicas}",
            _num(s.waiting_tokens + s.running_tokens) if s else "-",
            plain(f"{_num(s.replica_token_capacity)} ({s.capacity_source})") if s else "-",
            str(p.pending_requests),
        )
    print_table(console, summary)
    for p in status.pools:
        _print_pool(console, p, status.at)
    d = status.driver
    colour = "green" if d.ok else "red"
    console.print(f"driver [bold]{escape(d.name)}[/bold]: [{colour}]{'ok' if d.ok else 'CANNOT ACT'}[/{colour}]"
                  f" — {escape(d.message)}", soft_wrap=True)
    if d.errors:
        console.print("  errors: " + ", ".join(f"{reason} ×{n}" for reason, n in sorted(d.errors.items())),
                      markup=False, soft_wrap=True)
    if d.last_error and d.last_error != d.message:
        console.print(f"  last error at {_clock(d.last_error_at)}: {d.last_error}", markup=False, soft_wrap=True)


def _print_pool(console: Any, p: PoolStatus, now: float) -> None:
    from rich.markup import escape
    from rich.table import Table

    console.print(f"\n[bold]{escape(p.pool)}[/bold]: {escape(p.last_reason)}", soft_wrap=True)
    if p.signals is not None:
        s = p.signals
        signals = Table(show_header=True, box=None, pad_edge=False)
        for column in ("waiting tok", "running tok", "needed", "for prefill", "warm", "floor", "window max",
                       "cooldown left", "idle", "prompt tok/s in", "prefill tok/s", "decode tok/s", "queue drains in"):
            signals.add_column(column, justify="right")
        signals.add_row(
            _num(s.waiting_tokens), _num(s.running_tokens), str(s.needed), str(s.needed_prefill),
            str(s.warm_buffer), str(s.floor),
            str(s.window_max), f"{s.cooldown_remaining_s:,.0f} s", f"{s.idle_s:,.0f} s",
            _num(s.prefill_demand_tokens_per_s),
            _num(s.prefill_tokens_per_s), _num(s.decode_tokens_per_s),
            f"{s.queue_drain_s:,.1f} s" if s.queue_drain_s is not None else "-",
        )
        print_table(console, signals)
    if p.workers:
        _print_workers(console, p.workers, "workers")
    for drain in p.drains:
        left = drain.deadline - now
        console.print(
            f"  draining {drain.worker_id}: since {_clock(drain.issued_at)}, {drain.in_flight} in flight when asked, "
            f"{'acknowledged' if drain.acknowledged else 'NOT acknowledged'}, forced stop in {max(0.0, left):,.0f} s",
            markup=False, soft_wrap=True,
        )
    if p.decisions:
        decisions = Table(title="recent decisions", title_justify="left")
        for column in ("at", "action", "current → desired", "reason", "outcome"):
            decisions.add_column(column, overflow="fold")
        for r in p.decisions:
            colour = {"scale_up": "green", "scale_down": "yellow"}.get(r.action, "")
            action = f"[{colour}]{r.action}[/{colour}]" if colour else r.action
            decisions.add_row(_clock(r.at), action, f"{r.current} → {r.desired}", plain(r.reason), plain(r.outcome))
        print_table(console, decisions)


def _print_workers(console: Any, views: list[WorkerView], title: str) -> None:
    from rich.table import Table

    workers = Table(title=title, title_justify="left")
    regional = any(w.region for w in views)  # a column only where the mesh spans regions
    for column in ("worker", *(("region",) if regional else ()), "state", "running", "waiting", "running tok",
                   "queued prefill", "KV", "gauge age", "ours"):
        workers.add_column(column, justify="left" if column in ("worker", "region", "state") else "right")
    for w in views:
        workers.add_row(
            plain(w.worker_id), *((plain(w.region or "-"),) if regional else ()), plain(w.state), str(w.running), str(w.waiting), _num(w.running_tokens), _num(w.queued_prefill_tokens),
            f"{w.kv_usage:.0%}", f"{w.gauge_age_s:.1f} s" if w.gauge_age_s is not None else "-",
            "yes" if w.managed else "",
        )
    print_table(console, workers)


async def workers_from_registry(bus: Bus, model: str = "", listen_s: float = 1.0) -> list[WorkerView]:
    """Every registered worker (of ``model``, if given) with its latest gauge heard within
    ``listen_s``; a hot-swap entry that is ready but not resident shows its residency."""
    import time

    from ops.up import ready_workers
    from proto.codec import decode
    from proto.workers import WorkerGauge

    gauges: dict[str, tuple[float, WorkerGauge]] = {}

    async def on_gauge(msg: Any) -> None:
        try:
            g = decode(msg.data, WorkerGauge)
        except Exception:  # a malformed gauge is the worker's problem, not the status's
            return
        gauges[g.worker_id] = (time.monotonic(), g)

    sub = await bus.nc.subscribe(bus.subjects.gauges_all, cb=on_gauge)
    try:
        await asyncio.sleep(listen_s)
    finally:
        await sub.unsubscribe()
    infos = [w for w in await ready_workers(bus) if not model or w.model == model]
    now = time.monotonic()
    views = []
    for info in sorted(infos, key=lambda w: w.worker_id):
        heard = gauges.get(info.worker_id)
        g = heard[1] if heard else None
        state = g.residency if g is not None and info.state == "ready" and g.residency not in ("", "resident") else info.state
        if info.role == "prefill":
            state = f"{state} (prefill)"  # computes prompts for the others (P/D split)
        views.append(WorkerView(
            worker_id=info.worker_id, region=info.region, state=state, running=g.running if g else 0, waiting=g.waiting if g else 0,
            running_tokens=g.running_tokens if g else 0, queued_prefill_tokens=g.queued_prefill_tokens if g else 0,
            kv_usage=g.kv_usage if g else 0.0, gauge_age_s=(now - heard[0]) if heard else None,
        ))
    return views
