"""Routing policies on a mesh of 8 sim workers: the same arrivals, one policy per run.

Each run starts a fresh local mesh (``ops.up.Mesh``: nats-server, 8 sim workers, a
gateway and a router with the policy under test, each its own process; caches start
cold) and drives it with ``ops.bench`` over HTTP, open loop, Poisson arrivals, the same
seed for every policy. Admission is not running (the gateway is told to fail open), so
nothing is shed: the policies alone decide the latencies.

Load is a fraction of the fleet's capacity for the scenario's workload: the goodput knee
of the default policy (``prefix``), the highest offered rate at which 90 % of requests
meet the SLO, measured with ``--find-capacity`` and kept in ``Scenario.capacity``. (The
capacity with no prefix reuse, from the sim profile's step-time formula, is printed
beside it: a cache-blind policy's capacity is close to that.)

Scenarios:

- ``shared-prefix``: G system prompts of 1-2k tokens (tenants' prompts, RAG documents),
  each request one of them plus a short distinct suffix. KV is sized so that one worker
  holds only a few of the G prefixes: placement decides whether a prefix is found in
  cache.
- ``hot-spot``: one system prompt shared by every request (G = 1). A cache-affine policy
  must not herd the whole load onto its holder: the figure is the busiest worker's
  mean outstanding tokens (queued prefill + running, from the workers' gauges sampled
  every 50 ms) over the least busy one's.

Prefix hit rate is the engines' own: Σ cached prompt tokens / Σ prompt tokens over the
run's usage events (USAGE stream). Goodput counts requests meeting both SLO bounds.
Latencies are the clients', converted to simulated time (× speed).

    .venv/bin/python benchmarks/routing.py                       # both scenarios, 3 policies
    .venv/bin/python benchmarks/routing.py --scenario hot-spot --policies prefix,least_load
    .venv/bin/python benchmarks/routing.py --scenario shared-prefix --policies prefix \
        --find-capacity 100,140,180,220                           # the knee

Stability (issue 17): one seed is one arrival sequence, and a cache-affine policy can
land in a different equilibrium at another. ``--sweep-seeds`` and ``--sweep-loads`` run
every (scenario, policy, load, seed) on a fresh mesh and report per (policy, load) the
median and the worst seed of p90 TTFT, prefix hit, goodput and busiest/idlest, as a
table and a plot (``--plot-dir``). ``--burst`` runs steady 70 % of capacity, 10 s at
2×, then 70 % again (simulated seconds, one trace with the scenario's prompts) and
reports hit rate, outstanding tokens per worker and p90 TTFT over time, and how long
after the burst p90 TTFT and hit rate are back within 10 % of their values before it.

    .venv/bin/python benchmarks/routing.py --scenario stability --policies prefix,round_robin \
        --sweep-seeds 1,2,3,4,5 --sweep-loads 0.5,0.7,0.8,0.9 --duration 60 --out sweep.json
    .venv/bin/python benchmarks/routing.py --scenario shared-prefix --policies prefix --burst --seed 1

``benchmarks/router_sim.py`` is the same question without a mesh: the real policy and
view in front of the real sim cores in one deterministic process, in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nats.js import api

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, RunResult, SLOSpec, WorkloadConfig, run_bench
from ops.bench.plots import _plt
from ops.bench.workload import LengthDist
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto import UsageEvent, WorkerGauge, decode
from services.worker.engines.sim_profile import DEFAULT_PROFILE, load_profile

MODEL = "sim-llama-8b"


@dataclass(frozen=True)
class Scenario:
    name: str
    groups: int
    prefix_tokens: str  # a distribution (ops.bench LengthDist): one draw per prompt
    suffix_tokens: str
    output_tokens: int
    kv_blocks: int  # per worker (16-token blocks)
    load: float  # fraction of the reference capacity
    # The fleet's capacity for this workload (simulated req/s): the goodput knee of the
    # default policy (``prefix``), i.e. the highest offered rate at which 90 % of
    # requests meet the SLO, measured with ``--find-capacity`` (BENCHMARKS.md).
    capacity: float
    capacity_is: str = "the fleet's measured capacity"
    # or multi-turn: prefix_tokens is the system prompt, suffix each user turn; or random:
    # distinct prompts of suffix_tokens (no prefix, no reuse)
    kind: str = "shared-prefix"
    turns: str = "4"
    think_s: float = 2.0  # multi-turn: mean think time between turns, simulated seconds (exponential)

    @property
    def prompt_tokens(self) -> float:
        return LengthDist.parse(self.prefix_tokens).mean + LengthDist.parse(self.suffix_tokens).mean


SCENARIOS = {
    # 32 system prompts of 1-2k tokens (49k tokens in all) and short distinct suffixes. A
    # worker holds 1024 blocks = 16k tokens, about 8 prompts beside its running requests:
    # the fleet holds all 32 (2.7 times over) only if each lives on one or two workers.
    "shared-prefix": Scenario("shared-prefix", 64, "uniform:1024:2048", "uniform:32:128", 64, 2048, 0.8, 120.0),
    # One 2048-token system prompt shared by every request.
    "hot-spot": Scenario("hot-spot", 1, "2048", "uniform:32:128", 64, 2048, 0.8, 120.0),
    # The first scenario (24 prompts of 4096 tokens, 512-token suffixes), offered at 80 %
    # of its no-reuse capacity (21.5 req/s, profile formula): a light load, where no
    # policy queues and only cache hits tell them apart; and its hot spot. Not in "all".
    "long-prefix": Scenario("long-prefix", 24, "4096", "512", 64, 2048, 0.8, 21.5, "the no-reuse capacity"),
    "long-hot-spot": Scenario("long-hot-spot", 1, "4096", "512", 64, 2048, 0.8, 21.5, "the no-reuse capacity"),
    # Conversations: a 1024-token system prompt, 4 turns of 64-256-token user messages and
    # 64-token replies, each turn's prompt the whole conversation so far. Load in
    # sessions/s; capacity: the knee of `prefix`, measured with 60 s runs
    # (--find-capacity 12,18,24,30,36 --duration 60: 100 % of requests within the SLO up to
    # 24 sessions/s, 98 % at 30, 76 % at 36; 20 s runs still hold at 85, their sessions
    # too young to fill the caches).
    "multi-turn": Scenario("multi-turn", 0, "1024", "uniform:64:256", 64, 2048, 0.8, 30.0,
                           "the measured knee, 60 s runs", kind="multi-turn"),
    # Distinct 1-2k-token prompts (no reuse: only load tells policies apart), at 80 % of the
    # profile's capacity for them (55.1 req/s: no cache to change it). Not in "all".
    "distinct": Scenario("distinct", 0, "0", "uniform:1024:2048", 64, 2048, 0.8, 55.1,
                         "the profile's capacity (no reuse)", kind="random"),
}
DEFAULT_SCENARIOS = ("shared-prefix", "hot-spot")
# issue 17's stability sweep
STABILITY_SCENARIOS = ("shared-prefix", "long-prefix", "hot-spot", "multi-turn")


class GaugeSampler:
    """Each worker's outstanding tokens (queued prefill + running), sampled periodically."""

    def __init__(self, bus: Bus, period_s: float = 0.05) -> None:
        self.bus = bus
        self.period_s = period_s
        self.latest: dict[str, WorkerGauge] = {}
        self.samples: dict[str, list[int]] = defaultdict(list)
        self.times: list[tuple[float, dict[str, int]]] = []  # (epoch s, worker → outstanding)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def on_gauge(g: WorkerGauge, _msg: Any) -> None:
            self.latest[g.worker_id] = g

        await self.bus.subscribe(self.bus.subjects.gauges_all, WorkerGauge, on_gauge)
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            now = {wid: g.queued_prefill_tokens + g.running_tokens for wid, g in self.latest.items()}
            for wid, v in now.items():
                self.samples[wid].append(v)
            self.times.append((time.time(), now))

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
        return {wid: statistics.fmean(v) for wid, v in self.samples.items() if v}


async def usage_events(bus: Bus) -> list[UsageEvent]:
    s = bus.subjects
    n = (await bus.js.stream_info(s.usage_stream)).state.messages
    if not n:
        return []
    # No acks: a pull consumer stops delivering at max_ack_pending unacked messages.
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE)
    sub = await bus.js.pull_subscribe(s.usage_all, durable=None, stream=s.usage_stream, config=config)
    out: list[UsageEvent] = []
    while len(out) < n:
        out.extend(decode(m.data, UsageEvent) for m in await sub.fetch(min(n - len(out), 500), timeout=10))
    await sub.unsubscribe()
    return out


def no_reuse_capacity(sc: Scenario, args: argparse.Namespace) -> float:
    """The fleet's capacity without prefix reuse (profile formula), wall req/s."""
    per_worker = load_profile(DEFAULT_PROFILE).costs.requests_per_s(sc.prompt_tokens, sc.output_tokens)
    return per_worker * args.workers * args.speed


def bench_config(sc: Scenario, args: argparse.Namespace, endpoint: EndpointConfig, sim_rates: list[float],
                 seed: int, trace: tuple[Path, int] | None = None) -> BenchConfig:
    """The scenario's load against ``endpoint``: open loop at ``sim_rates`` (simulated
    req/s, or sessions/s), or a burst ``trace``; the same arrivals and prompts for every
    system at the same seed."""
    if trace is not None:
        workload = WorkloadConfig(kind="trace", trace=str(trace[0]), trace_block_size=BURST_BLOCK)
    elif sc.kind == "multi-turn":
        # rates are sessions/s; think times are wall seconds, hence / speed
        workload = WorkloadConfig(kind="multi-turn", prefix_tokens=sc.prefix_tokens, input_tokens=sc.suffix_tokens,
                                  output_tokens=str(sc.output_tokens), turns=sc.turns,
                                  think_time=f"exponential:{sc.think_s / args.speed:g}")
    elif sc.kind == "random":
        workload = WorkloadConfig(kind="random", input_tokens=sc.suffix_tokens, output_tokens=str(sc.output_tokens))
    else:
        workload = WorkloadConfig(kind="shared-prefix", prefix_groups=sc.groups, prefix_tokens=sc.prefix_tokens,
                                  input_tokens=sc.suffix_tokens, output_tokens=str(sc.output_tokens))
    return BenchConfig(
        endpoints=[endpoint],
        workload=workload,
        rates=None if trace is not None else [r * args.speed for r in sim_rates],
        num_requests=trace[1] if trace is not None else None if sc.kind == "multi-turn"
        else max(50, int(max(sim_rates) * args.speed * args.duration)),
        duration=args.duration if sc.kind == "multi-turn" and trace is None else None,
        seed=seed,
        slo=SLOSpec(ttft_s=args.slo_ttft / args.speed, tpot_s=args.slo_tpot / args.speed),
        request_timeout=120.0, label=f"{sc.name}-{endpoint.label}",
    )


async def run_policy(sc: Scenario, policy: str, args: argparse.Namespace,
                     rates: list[float] | None = None, *, load: float | None = None,
                     seed: int | None = None, trace: tuple[Path, int] | None = None) -> dict[str, Any]:
    """One fresh mesh with ``policy``; ``rates`` (simulated req/s) run one after another
    on it (a capacity search), else ``load`` (default: ``--load``, else the scenario's);
    with ``trace`` (a burst: its file and number of requests), its own arrivals instead."""
    seed = args.seed if seed is None else seed
    load = load or args.load or sc.load
    state = Path(tempfile.mkdtemp(prefix=f"meshserve-bench-{policy}-"))
    worker_args = ["--num-kv-blocks", str(sc.kv_blocks), "--max-model-len", "16384", "--gauge-interval", "0.1"]
    # no admission: the gateway fails open (Mesh sets it), nothing is shed
    router_args = ["--policy", policy, *(["--config", args.router_config] if args.router_config else [])]
    mesh = Mesh(MeshConfig(state_dir=state, nats_port=0, http_port=free_port(), model=MODEL, workers=args.workers,
                           speed=args.speed, worker_args=worker_args, services=("worker", "gateway", "router"),
                           service_args={"router": router_args}))
    await mesh.start(timeout=120)
    bus = await Bus.open(mesh.settings, "bench-routing", initial_attempts=20)
    sampler = GaugeSampler(bus)
    try:
        await sampler.start()
        no_reuse = no_reuse_capacity(sc, args)
        fleet = (args.capacity or sc.capacity) * args.speed
        sim_rates = rates or [load * fleet / args.speed]
        rate = sim_rates[0] * args.speed
        config = bench_config(sc, args, EndpointConfig(mesh.gateway_url + "/v1", label=policy, api="completions",
                                                       model=MODEL, api_key=mesh.dev_key),
                              sim_rates, seed, trace)
        t0 = time.monotonic()
        epoch0 = time.time()
        result = await run_bench(config)
        wall = time.monotonic() - t0
        outstanding = await sampler.stop()
        events = await usage_events(bus)
        router = await bus.service_stats("router")
    finally:
        await bus.close()
        mesh.stop(timeout=30)
    if rates:
        return {"policy": policy, "runs": result.runs, "knee": result.knees.get(policy), "no_reuse": no_reuse}
    run: RunResult = result.runs[0]
    prompt_tokens = sum(e.prompt_tokens for e in events)
    busiest = max(outstanding.values(), default=0.0)
    idlest = min(outstanding.values(), default=0.0)
    row = {
        "scenario": sc.name, "policy": policy, "rate": rate, "fleet_capacity": fleet, "no_reuse": no_reuse,
        "load": load, "seed": seed, "wall_s": wall,
        "summary": run.summary, "client": run.client,
        "hit_rate": sum(e.cached_tokens for e in events) / prompt_tokens if prompt_tokens else 0.0,
        "router_hit_rate": router.get("prefix_hit_rate", 0.0),
        "placements": router.get("placements_by_worker", {}),
        "outstanding": outstanding,
        "imbalance": busiest / idlest if idlest > 0 else math.inf,
        "busiest": busiest, "idlest": idlest,
        # issue 17's counters: spills, their re-prefilled tokens, spills held back, the
        # underused rule's takes, admission-hint outcomes, mean cost terms
        "router": {k: router.get(k) for k in ("placements", "spills", "spill_tokens", "spills_held", "rebalanced",
                                              "admission_hints", "cost_terms_mean")},
    }
    if trace is not None:
        row["timeline"] = timeline(run, events, sampler.times, epoch0, args.speed)
    return row


# ---------------------------------------------------------------------------- the burst

BURST_BLOCK = 16  # tokens per trace hash id: the engines' block size, so prefixes match exactly
BURST_BUCKET_S = 5.0  # simulated seconds per point of the burst's timeline


@dataclass(frozen=True)
class Burst:
    """Simulated seconds: ``before_s`` at ``base``, ``burst_s`` at ``factor`` × it, ``after_s`` at ``base``."""

    base: float = 0.7
    factor: float = 2.0
    before_s: float = 30.0
    burst_s: float = 10.0
    after_s: float = 60.0

    @property
    def start(self) -> float:
        return self.before_s

    @property
    def end(self) -> float:
        return self.before_s + self.burst_s


def burst_trace(sc: Scenario, burst: Burst, capacity: float, speed: float, seed: int, path: Path) -> int:
    """Write the burst's arrivals as a JSONL trace (wall-clock timestamps); the scenario's
    prompts as Mooncake-style ``hash_ids``: a group's prefix is the same block ids in
    every request, each suffix its own. Returns the number of requests."""
    rng = random.Random(f"routing-burst-{sc.name}-{seed}")
    np_rng = np.random.default_rng(seed)
    prefix_dist, suffix_dist = LengthDist.parse(sc.prefix_tokens), LengthDist.parse(sc.suffix_tokens)
    prefix_blocks = [prefix_dist.sample_int(np_rng) // BURST_BLOCK for _ in range(sc.groups)]
    lines: list[str] = []
    t = 0.0
    for seconds, load in ((burst.before_s, burst.base), (burst.burst_s, burst.base * burst.factor),
                          (burst.after_s, burst.base)):
        end = t + seconds
        while True:
            t += rng.expovariate(load * capacity)
            if t >= end:
                t = end
                break
            i = len(lines)
            g = rng.randrange(sc.groups)
            suffix = suffix_dist.sample_int(np_rng)
            ids = [g * 1_000_000 + k for k in range(prefix_blocks[g])]
            ids += [10**9 + i * 1_000 + k for k in range(-(-suffix // BURST_BLOCK))]
            lines.append(json.dumps({"timestamp": t / speed, "input_tokens": prefix_blocks[g] * BURST_BLOCK + suffix,
                                     "output_tokens": sc.output_tokens, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def timeline(run: RunResult, events: list[UsageEvent], gauges: list[tuple[float, dict[str, int]]],
             epoch0: float, speed: float, bucket_s: float = BURST_BUCKET_S) -> list[dict[str, Any]]:
    """Per ``bucket_s`` of simulated time since the run started: p90 TTFT (simulated ms) of
    the requests sent then (a failed one counts as infinitely slow), the engines' prefix
    hit over the requests that arrived then, and each worker's mean outstanding tokens."""
    ttfts: dict[int, list[float]] = defaultdict(list)
    for r in run.requests:
        ttfts[int(r.scheduled_s * speed // bucket_s)].append(
            r.ttft_s * speed * 1000 if r.status == "ok" and r.ttft_s is not None else math.inf)
    hits: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for e in events:
        h = hits[int((e.arrival_time - epoch0) * speed // bucket_s)]
        h[0] += e.cached_tokens
        h[1] += e.prompt_tokens
    loads: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for ts, per_worker in gauges:
        for wid, v in per_worker.items():
            loads[int((ts - epoch0) * speed // bucket_s)][wid].append(v)
    out = []
    for b in range(max(ttfts, default=-1) + 1):
        vals = sorted(ttfts.get(b, []))
        cached, prompt = hits.get(b, (0, 0))
        out.append({
            "t": b * bucket_s, "n": len(vals),
            "ttft_p90_ms": vals[min(len(vals) - 1, int(0.9 * len(vals)))] if vals else None,
            "hit_rate": cached / prompt if prompt else None,
            "outstanding": {wid: statistics.fmean(v) for wid, v in sorted(loads.get(b, {}).items())},
        })
    return out


def recovery(points: list[dict[str, Any]], burst: Burst, tolerance: float = 0.1) -> dict[str, Any]:
    """Pre-burst p90 TTFT and hit (the 20 s before the burst, after 10 s of warm-up), and
    how long after the burst's end every later point stays within ``tolerance`` of them."""
    pre = [p for p in points if max(10.0, burst.start - 20.0) <= p["t"] < burst.start and p["n"]]
    if not pre:
        return {"pre_p90_ms": None, "pre_hit": None, "recovered_after_s": None}
    pre_p90 = statistics.median(p["ttft_p90_ms"] for p in pre)
    pre_hit = statistics.median(p["hit_rate"] or 0.0 for p in pre)

    def ok(p: dict[str, Any]) -> bool:
        return (p["ttft_p90_ms"] is not None and p["ttft_p90_ms"] <= (1 + tolerance) * pre_p90
                and (p["hit_rate"] or 0.0) >= (1 - tolerance) * pre_hit)

    after = [p for p in points if p["t"] >= burst.end and p["n"]]
    back = None
    for i, p in enumerate(after):
        if all(ok(q) for q in after[i:]):
            back = p["t"] - burst.end
            break
    return {"pre_p90_ms": pre_p90, "pre_hit": pre_hit, "recovered_after_s": back}


def burst_table(points: list[dict[str, Any]]) -> str:
    lines = ["| t (s) | requests | TTFT p90 ms | prefix hit | outstanding tokens/worker: mean | busiest / idlest |",
             "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for p in points:
        o = list(p["outstanding"].values())
        p90 = "-" if p["ttft_p90_ms"] is None else f"{p['ttft_p90_ms']:,.0f}"
        hit = "-" if p["hit_rate"] is None else f"{p['hit_rate']:.0%}"
        spread = f"{max(o):,.0f} / {min(o):,.0f}" if o else "-"
        lines.append(f"| {p['t']:.0f} | {p['n']} | {p90} | {hit} | {statistics.fmean(o) if o else 0:,.0f} | {spread} |")
    return "\n".join(lines)


def plot_burst(rows: list[dict[str, Any]], burst: Burst, path: Path) -> Path:
    """Hit rate, outstanding tokens per worker and p90 TTFT against time, one colour per run."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for ci, row in enumerate(rows):
        pts = row["timeline"]
        ts = [p["t"] for p in pts]
        label = f"{row['policy']} seed {row['seed']}"
        axes[0].plot(ts, [math.nan if p["hit_rate"] is None else p["hit_rate"] for p in pts], "-o", ms=3,
                     color=f"C{ci}", label=label)
        workers = sorted({w for p in pts for w in p["outstanding"]})
        for wi, w in enumerate(workers):
            axes[1].plot(ts, [p["outstanding"].get(w, math.nan) for p in pts], "-", lw=0.8, color=f"C{ci}",
                         alpha=0.6, label=label if wi == 0 else None)
        axes[2].plot(ts, [math.nan if p["ttft_p90_ms"] in (None, math.inf) else p["ttft_p90_ms"] for p in pts],
                     "-o", ms=3, color=f"C{ci}", label=label)
    for ax, title in zip(axes, ("prefix hit rate", "outstanding tokens per worker", "p90 TTFT (ms, simulated)"),
                         strict=True):
        ax.axvspan(burst.start, burst.end, color="grey", alpha=0.2)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("simulated seconds (shaded: the burst)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{rows[0]['scenario']}: {burst.base:.0%} of capacity, {burst.burst_s:.0f} s at {burst.factor:g}×")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the sweep

# metric → (row → value, which seed is the worst: max or min)
SWEEP_METRICS: dict[str, tuple[Any, Any]] = {
    "ttft_p90_ms": (lambda r, speed: (r["summary"].ttft_ms.p90 or math.inf) * speed, max),
    "hit_rate": (lambda r, speed: r["hit_rate"], min),
    "goodput": (lambda r, speed: (r["summary"].goodput or 0.0) / speed, min),
    "slo_met": (lambda r, speed: r["summary"].slo_attainment or 0.0, min),
    "imbalance": (lambda r, speed: r["imbalance"], max),
    "spills": (lambda r, speed: (r["router"].get("spills") or 0) / max(r["router"].get("placements") or 0, 1), max),
}


def sweep_cells(rows: list[dict[str, Any]], speed: float) -> list[dict[str, Any]]:
    """Per (scenario, policy, load): each metric's median over seeds, its worst seed's
    value and that seed."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["scenario"], r["policy"], r["load"])].append(r)
    cells = []
    for (scenario, policy, load), rs in sorted(groups.items()):
        cell: dict[str, Any] = {"scenario": scenario, "policy": policy, "load": load, "rate": rs[0]["rate"] / speed,
                                "seeds": [r["seed"] for r in rs]}
        for name, (get, worst) in SWEEP_METRICS.items():
            vals = [get(r, speed) for r in rs]
            w = worst(range(len(vals)), key=lambda i, vals=vals: vals[i])
            cell[name] = {"median": statistics.median(vals), "worst": vals[w], "worst_seed": rs[w]["seed"],
                          "all": vals}
        cells.append(cell)
    return cells


def sweep_table(cells: list[dict[str, Any]]) -> str:
    def fmt(c: dict[str, Any], name: str, spec: str) -> str:
        m = c[name]
        return f"{m['median']:{spec}} / {m['worst']:{spec}} (s{m['worst_seed']})"

    lines = ["| policy | load | req/s | p90 TTFT ms: median / worst | prefix hit | goodput req/s | SLO met "
             "| busiest/idlest | spills/placement | seeds |", "|" + " --- |" * 10]
    for c in cells:
        lines.append(
            f"| {c['policy']} | {c['load']:.0%} | {c['rate']:.1f} | {fmt(c, 'ttft_p90_ms', ',.0f')} "
            f"| {fmt(c, 'hit_rate', '.0%')} | {fmt(c, 'goodput', '.1f')} | {fmt(c, 'slo_met', '.0%')} "
            f"| {fmt(c, 'imbalance', '.2f')} | {fmt(c, 'spills', '.1%')} | {','.join(map(str, c['seeds']))} |")
    return "\n".join(lines)


def plot_sweep(cells: list[dict[str, Any]], path: Path) -> Path:
    """p90 TTFT, prefix hit and goodput against load: per policy the median (solid), the
    worst seed (dashed) and every seed (dots)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    policies = sorted({c["policy"] for c in cells})
    for ci, policy in enumerate(policies):
        cs = sorted((c for c in cells if c["policy"] == policy), key=lambda c: c["load"])
        xs = [c["load"] for c in cs]
        for ax, name in zip(axes, ("ttft_p90_ms", "hit_rate", "goodput"), strict=True):
            ax.plot(xs, [c[name]["median"] for c in cs], "-o", color=f"C{ci}", label=f"{policy} median")
            ax.plot(xs, [c[name]["worst"] for c in cs], "--", color=f"C{ci}", label=f"{policy} worst seed")
            for c in cs:
                ax.plot([c["load"]] * len(c[name]["all"]), c[name]["all"], ".", color=f"C{ci}", alpha=0.4)
    for ax, title in zip(axes, ("p90 TTFT (ms, simulated)", "prefix hit rate", "goodput (req/s)"), strict=True):
        ax.set_xlabel("offered load (fraction of the measured knee)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{cells[0]['scenario']}: median and worst over seeds {','.join(map(str, cells[0]['seeds']))}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v: float | None, speed: float) -> str:
    """Client-measured milliseconds, reported in simulated time (× speed)."""
    return "-" if v is None else f"{v * speed:,.0f}"


def table(rows: list[dict[str, Any]], speed: float) -> str:
    head = ("| policy | req/s | TTFT p50 | p90 | p99 ms | TPOT p50 | p90 | p99 ms | prefix hit | goodput req/s "
            "| SLO met | busiest/idlest outstanding | errors |")
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        s = r["summary"]
        lines.append(
            f"| {r['policy']} | {r['rate'] / speed:.1f} | {_ms(s.ttft_ms.p50, speed)} | {_ms(s.ttft_ms.p90, speed)} "
            f"| {_ms(s.ttft_ms.p99, speed)} | {_ms(s.tpot_ms.p50, speed)} | {_ms(s.tpot_ms.p90, speed)} "
            f"| {_ms(s.tpot_ms.p99, speed)} | {r['hit_rate']:.0%} | {(s.goodput or 0) / speed:.1f} "
            f"| {s.slo_attainment or 0:.0%} | {r['busiest']:,.0f} / {r['idlest']:,.0f} "
            f"({r['imbalance']:.1f}×) | {sum(s.errors.values())} |"
        )
    return "\n".join(lines)


async def find_capacity(sc: Scenario, policy: str, args: argparse.Namespace) -> None:
    rates = [float(r) for r in args.find_capacity.split(",")]
    out = await run_policy(sc, policy, args, rates)
    print(f"\n{sc.name}, {policy}: SLO attainment by offered rate (simulated req/s; the knee is the highest "
          f"rate with ≥ 90 % within TTFT ≤ {args.slo_ttft} s and TPOT ≤ {args.slo_tpot * 1000:.0f} ms, every "
          f"lower rate holding too)")
    for run in out["runs"]:
        s = run.summary
        print(f"  {(run.rate or 0) / args.speed:7.1f} req/s: SLO met {s.slo_attainment or 0:.0%}, TTFT p90 "
              f"{_ms(s.ttft_ms.p90, args.speed)} ms, TPOT p90 {_ms(s.tpot_ms.p90, args.speed)} ms, "
              f"goodput {(s.goodput or 0) / args.speed:.1f} req/s")
    knee = out["knee"]
    print(f"knee: {knee / args.speed:.1f} req/s" if knee is not None else "knee: none (the lowest rate fails)")
    print(f"no-reuse capacity (profile formula, for reference): {out['no_reuse'] / args.speed:.1f} req/s")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all", "stability"], default="all",
                        help=f"all: {', '.join(DEFAULT_SCENARIOS)}; stability: {', '.join(STABILITY_SCENARIOS)}")
    parser.add_argument("--policies", default="round_robin,least_load,prefix")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speed", type=float, default=0.25,
                        help="sim speed factor (1.0 = real time; below 1 keeps the harness's 2 cores unsaturated)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (wall) of arrivals per run")
    parser.add_argument("--load", type=float, default=None,
                        help="offered load as a fraction of the reference capacity (default: the scenario's, 0.8)")
    parser.add_argument("--capacity", type=float, default=None,
                        help="reference capacity, simulated req/s (default: the scenario's measured knee)")
    parser.add_argument("--find-capacity", default=None, metavar="RATES",
                        help="measure the knee instead: comma-separated simulated req/s, run in turn on one "
                             "mesh with the first policy of --policies")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT bound of goodput, simulated seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT bound of goodput, simulated seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--router-config", default=None, help="router config file (e.g. the prefix policy's beta)")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    parser.add_argument("--sweep-seeds", default=None, metavar="SEEDS",
                        help="stability sweep: comma-separated seeds, each (policy, load, seed) on a fresh mesh")
    parser.add_argument("--sweep-loads", default=None, metavar="LOADS",
                        help="stability sweep: comma-separated fractions of the capacity (default: --load)")
    parser.add_argument("--burst", action="store_true",
                        help="burst test: --load (default 0.7), 10 s at 2×, then --load again; a timeline")
    parser.add_argument("--burst-before", type=float, default=30.0, help="simulated seconds before the burst")
    parser.add_argument("--burst-after", type=float, default=60.0, help="simulated seconds after the burst")
    parser.add_argument("--plot-dir", default="results/routing", help="where the sweep and burst plots go")
    args = parser.parse_args()
    names = {"all": DEFAULT_SCENARIOS, "stability": STABILITY_SCENARIOS}.get(args.scenario, (args.scenario,))
    scenarios = [SCENARIOS[n] for n in names]
    try:
        seeds = [int(x) for x in args.sweep_seeds.split(",")] if args.sweep_seeds else None
        loads = [float(x) for x in args.sweep_loads.split(",")] if args.sweep_loads else None
    except ValueError:
        parser.error("--sweep-seeds takes integers and --sweep-loads fractions, comma-separated (e.g. 1,2,3 and 0.5,0.8)")
    if loads is not None and any(not 0 < x for x in loads):
        parser.error("--sweep-loads must be positive fractions of the capacity")
    if loads is not None and seeds is None:
        seeds = [args.seed]
    if args.burst and (seeds or args.find_capacity):
        parser.error("--burst runs one timeline per policy at --seed; it does not combine with a sweep or --find-capacity")
    if args.burst and any(sc.kind != "shared-prefix" for sc in scenarios):
        parser.error("--burst replays shared-prefix prompts; multi-turn has no burst trace")
    if args.find_capacity:
        for sc in scenarios:
            await find_capacity(sc, args.policies.split(",")[0], args)
        return
    if seeds is not None:
        await sweep(scenarios, seeds, loads or [args.load or 0.0], args)
        return
    if args.burst:
        await burst_runs(scenarios, args)
        return
    all_rows: list[dict[str, Any]] = []
    for sc in scenarios:
        rows = []
        for policy in args.policies.split(","):
            row = await run_policy(sc, policy, args)
            rows.append(row)
            c = row["client"]
            flag = " CLIENT LAGGED: " + "; ".join(c.reasons) if c.lagged else ""
            print(f"{sc.name} {policy}: done in {row['wall_s']:.0f} s, client lag p99 {c.lag_ms.p99:.1f} ms, "
                  f"cpu {c.cpu_util:.0%}{flag}", flush=True)
        fleet = rows[0]["fleet_capacity"] / args.speed
        shape = (f"distinct {sc.suffix_tokens}-token prompts" if sc.kind == "random" else
                 f"{sc.groups} prompt(s) of {sc.prefix_tokens} tokens + {sc.suffix_tokens}-token suffix")
        print(f"\n{sc.name}: {shape}, "
              f"{sc.output_tokens} output tokens; {args.workers} workers × {sc.kv_blocks} KV blocks; "
              f"offered {args.load or sc.load:.0%} of {fleet:.1f} req/s ({sc.capacity_is}; no-reuse "
              f"capacity {rows[0]['no_reuse'] / args.speed:.1f} req/s), simulated time; speed {args.speed}; "
              f"SLO TTFT ≤ {args.slo_ttft} s, TPOT ≤ {args.slo_tpot * 1000:.0f} ms\n")
        print(table(rows, args.speed), flush=True)
        all_rows.extend(rows)
    if args.out:
        import msgspec

        await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(all_rows))


async def sweep(scenarios: Sequence[Scenario], seeds: list[int], loads: list[float],
                args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    plot_dir = Path(args.plot_dir)
    await asyncio.to_thread(plot_dir.mkdir, parents=True, exist_ok=True)
    for sc in scenarios:
        sc_rows = []
        for policy in args.policies.split(","):
            for load in loads:
                for seed in seeds:
                    row = await run_policy(sc, policy, args, load=load or sc.load, seed=seed)
                    sc_rows.append(row)
                    s = row["summary"]
                    print(f"{sc.name} {policy} load {row['load']:.0%} seed {seed}: p90 TTFT "
                          f"{_ms(s.ttft_ms.p90, args.speed)} ms, hit {row['hit_rate']:.0%}, goodput "
                          f"{(s.goodput or 0) / args.speed:.1f}, SLO met {s.slo_attainment or 0:.0%}, spills "
                          f"{row['router'].get('spills')}, held {row['router'].get('spills_held')}, client lag p99 "
                          f"{row['client'].lag_ms.p99:.1f} ms{' LAGGED' if row['client'].lagged else ''}", flush=True)
        cells = sweep_cells(sc_rows, args.speed)
        print(f"\n{sc.name}: offered load as a fraction of {args.capacity or sc.capacity:.1f} "
              f"{'sessions' if sc.kind == 'multi-turn' else 'req'}/s ({sc.capacity_is}); median / worst seed "
              f"(its number) over seeds {','.join(map(str, seeds))}; {args.duration:.0f} s of arrivals, speed "
              f"{args.speed}\n")
        print(sweep_table(cells), flush=True)
        print(f"plot: {plot_sweep(cells, plot_dir / f'sweep-{sc.name}.png')}")
        rows.extend(sc_rows)
    if args.out:
        import msgspec

        await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(rows))


async def burst_runs(scenarios: Sequence[Scenario], args: argparse.Namespace) -> None:
    burst = Burst(base=args.load or 0.7, before_s=args.burst_before, after_s=args.burst_after)
    plot_dir = Path(args.plot_dir)
    await asyncio.to_thread(plot_dir.mkdir, parents=True, exist_ok=True)
    rows = []
    for sc in scenarios:
        sc_rows = []
        for policy in args.policies.split(","):
            trace = Path(tempfile.mkdtemp(prefix="meshserve-burst-")) / "burst.jsonl"
            n = burst_trace(sc, burst, args.capacity or sc.capacity, args.speed, args.seed, trace)
            row = await run_policy(sc, policy, args, load=burst.base, trace=(trace, n))
            row["recovery"] = recovery(row["timeline"], burst)
            sc_rows.append(row)
            rec = row["recovery"]
            back = rec["recovered_after_s"]
            pre_p90, pre_hit = rec["pre_p90_ms"], rec["pre_hit"]
            print(f"\n{sc.name} {policy}, seed {args.seed}: {n} requests, {burst.base:.0%} of "
                  f"{args.capacity or sc.capacity:.1f} req/s, {burst.burst_s:.0f} s at {burst.factor:g}× from "
                  f"{burst.start:.0f} s (simulated); pre-burst p90 TTFT "
                  f"{'-' if pre_p90 is None else f'{pre_p90:,.0f}'} ms, hit "
                  f"{'-' if pre_hit is None else f'{pre_hit:.0%}'}; back within 10 % "
                  f"{'never' if back is None else f'{back:.0f} s after the burst'}\n")
            print(burst_table(row["timeline"]), flush=True)
        print(f"plot: {plot_burst(sc_rows, burst, plot_dir / f'burst-{sc.name}.png')}")
        rows.extend(sc_rows)
    if args.out:
        import msgspec

        await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(rows))


if __name__ == "__main__":
    asyncio.run(main())
