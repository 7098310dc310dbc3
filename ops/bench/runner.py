"""Runs a benchmark: plans arrivals and prompts (pure), sends them (async), measures.

``run_bench(config)`` is the Python API the CLI and other benchmarks call. For each
load point (rate or concurrency) and each endpoint in turn it plans the same sessions
and arrival offsets, dispatches them open-loop (or closed-loop), watches its own event
loop, and returns every request's raw timings with per-run summaries.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from ops.bench.arrivals import ArrivalProcess, scale_trace
from ops.bench.bodies import build_body
from ops.bench.config import BenchConfig, EndpointConfig
from ops.bench.results import (
    STATUS_CANCELLED,
    STATUS_OK,
    STATUS_TIMEOUT,
    BenchResult,
    RequestResult,
    RunResult,
)
from ops.bench.stats import client_health, find_knee, fmt_load, summarize
from ops.bench.stream import StreamAccumulator
from ops.bench.targets import KEY_REFUSED, PASS_KEY, Target, make_target
from ops.bench.workload import Session, TextFactory, TraceWorkload, Workload

_ARRIVAL_SEED_TAG = 99
_WARMUP_SEED_OFFSET = 7919


# ---------------------------------------------------------------------------- planning (pure)


@dataclass(frozen=True, slots=True)
class PlannedSession:
    session: Session
    offset: float      # scheduled start (s from run start); 0 in closed loop
    n_turns: int       # turns to send (the request bound may cut the last session)


def iter_sessions(
    workload: Workload,
    offsets: Sequence[float] | np.ndarray | None,
    max_requests: int | None,
) -> Iterator[PlannedSession]:
    """Pair sessions with offsets until the offsets, the workload or ``max_requests``
    (counted in requests, i.e. turns) runs out; ``offsets=None``: closed loop, unbounded
    when neither the workload nor ``max_requests`` bounds it (the run's duration does)."""
    budget = max_requests if max_requests is not None else math.inf
    i = 0
    while budget > 0:
        if offsets is not None and i >= len(offsets):
            return
        if workload.size is not None and i >= workload.size:
            return
        s = workload.session(i)
        n = int(min(len(s.turns), budget))
        yield PlannedSession(s, float(offsets[i]) if offsets is not None else 0.0, n)
        budget -= n
        i += 1


def plan_sessions(
    workload: Workload,
    offsets: Sequence[float] | np.ndarray | None,
    max_requests: int | None,
) -> list[PlannedSession]:
    """``iter_sessions`` planned ahead: every session of a bounded plan."""
    if offsets is None and max_requests is None and workload.size is None:
        raise ValueError("a closed loop without a request bound needs a bounded workload")
    return list(iter_sessions(workload, offsets, max_requests))


@dataclass(frozen=True, slots=True)
class LazyPlan:
    """A closed loop's sessions, generated as its workers take them. A session depends
    only on its index and the seed, so every endpoint still gets the same ones; planning
    a million-request bound ahead (or refusing a loop bounded by its duration alone) made
    the client spend the run building prompts it never sent."""

    workload: Workload
    max_requests: int | None

    def __iter__(self) -> Iterator[PlannedSession]:
        return iter_sessions(self.workload, None, self.max_requests)


def planned_turns(plan: list[PlannedSession] | LazyPlan) -> int | None:
    """Requests a plan sends at most (None: as many as its duration allows)."""
    return plan.max_requests if isinstance(plan, LazyPlan) else sum(ps.n_turns for ps in plan)


def arrival_offsets(config: BenchConfig, workload: Workload, rate: float | None) -> np.ndarray:
    """Open-loop offsets for one rate: same seed at every rate and for every endpoint."""
    if config.arrival_kind == "trace":
        assert isinstance(workload, TraceWorkload)
        offsets = scale_trace(workload.timestamps, rate)
        if config.duration is not None:
            offsets = offsets[offsets <= config.duration]
        return offsets
    assert rate is not None
    process = ArrivalProcess(config.arrival_kind, config.burst_size, config.burstiness)
    rng = np.random.default_rng([config.seed & 0xFFFFFFFF, _ARRIVAL_SEED_TAG])
    bound = config.num_requests
    if bound is not None and workload.size is not None:
        bound = min(bound, workload.size)
    return process.offsets(rate, rng, max_requests=bound, max_duration=config.duration)


# ---------------------------------------------------------------------------- client health


class LagMonitor:
    """A ticker that measures how late the event loop wakes it: the client's own lag."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        clock, interval, lags = time.perf_counter, self.interval, self.lags
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            lags.append(max(0.0, clock() - due))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def loop_name() -> str:
    mod = type(asyncio.get_running_loop()).__module__
    return "uvloop" if mod.startswith("uvloop") else "asyncio"


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------------------- one run


class _Run:
    """One load point on one endpoint."""

    def __init__(self, config: BenchConfig, target: Target, model: str, text: TextFactory,
                 plan: list[PlannedSession] | LazyPlan, progress: Any = None, task_id: Any = None,
                 concurrency: int = 1) -> None:
        self.config = config
        self.concurrency = concurrency
        self.target = target
        self.endpoint: EndpointConfig = target.endpoint
        self.model = model
        self.count_tokens: Callable[[str], int] = text.count
        self.plan = plan
        self.records: list[RequestResult] = []
        self.progress = progress
        self.task_id = task_id
        self.t0 = 0.0
        self.deadline = math.inf
        self.finished = 0
        self.failed = 0
        self.inflight = 0
        self._actual_history = config.workload.history == "actual"

    def _tick_progress(self) -> None:
        if self.progress is not None:
            self.progress.update(self.task_id, completed=self.finished, errors=self.failed,
                                 inflight=self.inflight)

    async def _request(self, ps: PlannedSession, k: int, due: float,
                       history: list[str | None]) -> StreamAccumulator:
        s = ps.session
        rec = RequestResult(index=len(self.records), session=s.index, turn=k,
                            scheduled_s=due - self.t0, input_tokens=s.input_tokens(k),
                            max_tokens=s.turns[k].output_tokens)
        self.records.append(rec)
        body = build_body(self.endpoint.api, self.model, s, k, ignore_eos=self.config.ignore_eos,
                          continuous_usage=self.config.continuous_usage,
                          history=history if self._actual_history else None,
                          extra=self.config.extra_body)
        acc = StreamAccumulator(self.count_tokens, keep_text=self.config.keep_text,
                                t_sent=time.perf_counter())
        self.inflight += 1
        try:
            async with asyncio.timeout(self.config.request_timeout):
                await self.target.send(body, acc)
        except TimeoutError:
            acc.fail(time.perf_counter(), STATUS_TIMEOUT,
                     f"no end of stream within {self.config.request_timeout:g} s")
        except asyncio.CancelledError:
            acc.fail(time.perf_counter(), STATUS_CANCELLED, "still running at the drain timeout")
            raise
        finally:
            self.inflight -= 1
            acc.fill(rec)
            rec.sent_s = acc.t_sent - self.t0
            self.finished += 1
            if rec.status != STATUS_OK:
                self.failed += 1
            self._tick_progress()
        return acc

    async def _session(self, ps: PlannedSession, due: float) -> None:
        history: list[str | None] = []
        for k in range(ps.n_turns):
            if k > 0:
                # Later turns follow the previous response plus think time.
                due = time.perf_counter() + ps.session.turns[k].think_time
                if due > self.deadline:
                    break
                await _sleep_until(due)
            acc = await self._request(ps, k, due, history)
            history.append(acc.text if acc.status == STATUS_OK and self._actual_history else None)

    async def execute(self) -> tuple[list[RequestResult], float, list[float], float, float]:
        cfg = self.config
        lag = LagMonitor()
        lag.start()
        await asyncio.sleep(0)  # let the ticker start before t0
        cpu0 = time.process_time()
        self.t0 = time.perf_counter()
        if cfg.duration is not None:
            self.deadline = self.t0 + cfg.duration
        # By default every request ends by its own timeout before the drain gives up.
        drain = cfg.drain_timeout if cfg.drain_timeout is not None else cfg.request_timeout + 1.0
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        if cfg.closed_loop:
            it = iter(self.plan)

            async def worker() -> None:
                for ps in it:
                    if time.perf_counter() > self.deadline:
                        return
                    await self._session(ps, time.perf_counter())

            # No more loops than sessions to run: -n 3 --concurrency 1000000 built a million.
            sessions = self.plan.max_requests if isinstance(self.plan, LazyPlan) else len(self.plan)
            loops = self.concurrency if sessions is None else min(self.concurrency, sessions)
            tasks = {loop.create_task(worker()) for _ in range(loops)}
            timeout = None if cfg.duration is None else cfg.duration + drain
        else:
            for ps in self.plan:
                due = self.t0 + ps.offset
                if due > self.deadline:
                    break
                await _sleep_until(due)
                tasks.add(loop.create_task(self._session(ps, due)))
            timeout = drain
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                    raise res
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - cpu0
        await lag.stop()
        return self.records, wall, lag.lags, cpu, self.t0


# ---------------------------------------------------------------------------- the benchmark


def _meta() -> dict[str, Any]:
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "host": platform.node(), "cpus": os.cpu_count(), "commit": commit,
            "numpy": np.__version__, "tool": "meshserve bench"}


def _warnings(run: RunResult, api_key: str | None = None) -> list[str]:
    s, out = run.summary, []
    if run.client.lagged:
        out.append("client lagged (" + "; ".join(run.client.reasons) +
                   "): latencies include the load generator's own delay")
    failed = s.requests - s.ok
    if failed:
        kinds = ", ".join(f"{k}×{v}" for k, v in s.errors.items())
        first: dict[str, str] = {}  # the first message the target gave for each status
        for r in run.requests:
            if r.status != STATUS_OK and r.error and r.status not in first:
                first[r.status] = r.error if len(r.error) <= 300 else r.error[:299] + "…"
        why = "".join(f"; {status}: {message}" for status, message in first.items())
        out.append(f"{failed}/{s.requests} requests failed ({kinds}){why}")
        if any(r.http_status in (401, 403) for r in run.requests):
            out.append(KEY_REFUSED if api_key else PASS_KEY)
    if s.output_len_mismatch:
        out.append(f"{s.output_len_mismatch} ok requests returned a different output length than "
                   "max_tokens (does the target honour ignore_eos?)")
    if run.api == "completions":
        off = sum(1 for r in run.requests if r.status == STATUS_OK and r.prompt_tokens is not None
                  and abs(r.prompt_tokens - r.input_tokens) > 1)
        if off:
            out.append(f"{off} requests: the target counted a different prompt length "
                       "(tokenizer mismatch? see --tokenizer)")
    return out


async def _warmup(config: BenchConfig, target: Target, model: str, workload: Workload,
                  text: TextFactory) -> None:
    if config.warmup <= 0:
        return
    plan = plan_sessions(_reseeded(workload, config.seed + _WARMUP_SEED_OFFSET, config), None,
                         config.warmup)
    run = _Run(config, target, model, text, plan)
    run.t0 = time.perf_counter()
    for ps in plan:
        await run._session(ps, time.perf_counter())


def _reseeded(workload: Workload, seed: int, config: BenchConfig) -> Workload:
    """The same workload with another seed (warm-up prompts differ from measured ones)."""
    if isinstance(workload, TraceWorkload):
        return workload
    return config.workload.build(seed)


async def run_bench(config: BenchConfig, *, console: Any = None) -> BenchResult:
    """Run every load point on every endpoint; returns all raw timings and summaries.

    With ``config.progress`` a rich progress bar is drawn on ``console`` (or stderr).
    """
    workload = config.workload.build(config.seed)
    text = TextFactory(config.workload.tokenizer)
    targets = [make_target(ep) for ep in config.endpoints]
    result = BenchResult(created=datetime.now(UTC).isoformat(timespec="seconds"),
                         label=config.label, config=config.to_dict(), slo=config.slo,
                         meta={**_meta(), "loop": loop_name(), "workload": workload.describe()})
    progress = None
    if config.progress:
        progress = _make_progress(console)
        progress.start()
    try:
        models: dict[str, str] = {}
        for target in targets:
            ep = target.endpoint
            where = f"{ep.label}: " if ep.label != ep.url else ""
            try:
                await target.start()
            except ValueError as exc:  # it refused what it was given (the API key)
                raise ValueError(f"{where}{exc}") from exc
            except ConnectionError as exc:  # said in full by the target
                raise ConnectionError(f"{where}{exc}") from exc
            except Exception as exc:  # nats.connect raises its own families
                raise ConnectionError(f"{where}cannot connect: {type(exc).__name__}: {exc}") from exc
            model = target.endpoint.model or await target.discover_model()
            if model is None:
                other = next((m for m in models.values()), None)
                if other is None:
                    why = f" ({target.discovery_error})" if target.discovery_error else ""
                    # A server that does not answer fails at run time (exit 1); one that lists
                    # no model, or refuses the key, was given the wrong input (exit 2).
                    failure = ConnectionError if target.discovery_unreachable else ValueError
                    raise failure(f"{target.endpoint.label}: no model given and none discovered{why}; "
                                  f"{target.discovery_hint}")
                model = other
            models[target.endpoint.label] = model
        result.meta["models"] = models
        for target in targets:
            await _warmup(config, target, models[target.endpoint.label], workload, text)

        if config.closed_loop:
            assert config.concurrency is not None
            loads: list[tuple[float | None, int | None]] = [(None, c) for c in config.concurrency]
        elif config.rates is None:
            loads = [(None, None)] if config.arrival_kind == "trace" else [(1.0, None)]
        else:
            loads = [(r, None) for r in config.rates]

        for li, (rate, conc) in enumerate(loads):
            offsets = None if config.closed_loop else arrival_offsets(config, workload, rate)
            plan: list[PlannedSession] | LazyPlan
            if offsets is None and workload.size is None:
                plan = LazyPlan(workload, config.num_requests)
            else:
                plan = plan_sessions(workload, offsets, config.num_requests)
            if rate is None and offsets is not None and len(offsets) > 1 and offsets[-1] > 0:
                rate = (len(offsets) - 1) / float(offsets[-1])  # a trace's native mean rate
            for ti, target in enumerate(targets):
                if config.cooldown > 0 and (li or ti):
                    await asyncio.sleep(config.cooldown)
                run = await _one_run(config, target, models[target.endpoint.label], text, plan,
                                     rate, conc, progress)
                result.runs.append(run)
    finally:
        if progress is not None:
            progress.stop()
        for target in targets:
            await target.close()
    result.client_lagged = any(r.client.lagged for r in result.runs)
    if config.slo.active:
        for ep in config.endpoints:
            # "All at once" is no rate on the axis: the knee is among the finite loads.
            points = [(r.load_value, r.summary.slo_holds) for r in result.runs
                      if r.endpoint == ep.label and not math.isinf(r.load_value)]
            result.knees[ep.label] = find_knee(points)
    return result


async def _one_run(config: BenchConfig, target: Target, model: str, text: TextFactory,
                   plan: list[PlannedSession] | LazyPlan, rate: float | None, conc: int | None,
                   progress: Any) -> RunResult:
    ep = target.endpoint
    mode = "closed-loop" if config.closed_loop else "open-loop"
    arrival = config.arrival_kind
    unit = "sessions/s" if config.workload.kind == "multi-turn" else "req/s"
    label = fmt_load(mode, arrival, rate, conc, unit)
    if arrival == "trace" and config.rates is None:
        label = f"trace native ({rate:.3g} req/s)" if rate else "trace native"
    total = planned_turns(plan)
    task_id = None
    if progress is not None:
        # The column parses its text as markup: a label is the user's, "x[/]" is no tag.
        task_id = progress.add_task(escape(f"{ep.label} · {label}"), total=total, errors=0, inflight=0)
    run = _Run(config, target, model, text, plan, progress, task_id, concurrency=conc or 1)
    records, wall, lags, cpu, _ = await run.execute()
    send_late = [max(0.0, r.sent_s - r.scheduled_s) for r in records]
    health = client_health(lags, send_late, cpu, wall, loop_name())
    out = RunResult(endpoint=ep.label, target=ep.url, api=ep.api, mode=mode, arrival=arrival,
                    rate=None if rate is None or math.isinf(rate) else rate,
                    concurrency=conc, load=label, summary=summarize(records, config.slo),
                    client=health, requests=records)
    out.warnings = _warnings(out, ep.api_key)
    return out


def _make_progress(console: Any = None) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    return Progress(
        # A long description (endpoint and load) wraps rather than cut the counts and
        # the time off the line: a pipe or a log is 80 columns wide.
        TextColumn("[bold]{task.description}", table_column=Column(overflow="fold")),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("in-flight {task.fields[inflight]}"),
        TextColumn("[red]err {task.fields[errors]}"),
        TimeElapsedColumn(),
        console=console,
        refresh_per_second=4,
        transient=False,
    )


def run_bench_blocking(config: BenchConfig, *, console: Any = None) -> BenchResult:
    """``run_bench`` on a fresh event loop (uvloop when installed)."""
    return run_loop(run_bench(config, console=console))


def run_loop(coro: Any) -> Any:
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
