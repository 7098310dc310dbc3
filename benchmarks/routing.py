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
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.js import api

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, RunResult, SLOSpec, WorkloadConfig, run_bench
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
}
DEFAULT_SCENARIOS = ("shared-prefix", "hot-spot")


class GaugeSampler:
    """Each worker's outstanding tokens (queued prefill + running), sampled periodically."""

    def __init__(self, bus: Bus, period_s: float = 0.05) -> None:
        self.bus = bus
        self.period_s = period_s
        self.latest: dict[str, WorkerGauge] = {}
        self.samples: dict[str, list[int]] = defaultdict(list)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def on_gauge(g: WorkerGauge, _msg: Any) -> None:
            self.latest[g.worker_id] = g

        await self.bus.subscribe(self.bus.subjects.gauges_all, WorkerGauge, on_gauge)
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            for wid, g in self.latest.items():
                self.samples[wid].append(g.queued_prefill_tokens + g.running_tokens)

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


async def run_policy(sc: Scenario, policy: str, args: argparse.Namespace,
                     rates: list[float] | None = None) -> dict[str, Any]:
    """One fresh mesh with ``policy``; ``rates`` (simulated req/s) run one after another
    on it (a capacity search), else the scenario's load."""
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
        no_reuse = load_profile(DEFAULT_PROFILE).costs.requests_per_s(sc.prompt_tokens, sc.output_tokens) * args.workers * args.speed
        fleet = (args.capacity or sc.capacity) * args.speed
        sim_rates = rates or [(args.load or sc.load) * fleet / args.speed]
        rate = sim_rates[0] * args.speed
        config = BenchConfig(
            endpoints=[EndpointConfig(mesh.gateway_url + "/v1", label=policy, api="completions", model=MODEL,
                                      api_key=mesh.dev_key)],
            workload=WorkloadConfig(kind="shared-prefix", prefix_groups=sc.groups, prefix_tokens=sc.prefix_tokens,
                                    input_tokens=sc.suffix_tokens, output_tokens=str(sc.output_tokens)),
            rates=[r * args.speed for r in sim_rates],
            num_requests=max(50, int(max(sim_rates) * args.speed * args.duration)), seed=args.seed,
            slo=SLOSpec(ttft_s=args.slo_ttft / args.speed, tpot_s=args.slo_tpot / args.speed),
            request_timeout=120.0, label=f"{sc.name}-{policy}",
        )
        t0 = time.monotonic()
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
    return {
        "scenario": sc.name, "policy": policy, "rate": rate, "fleet_capacity": fleet, "no_reuse": no_reuse,
        "wall_s": wall,
        "summary": run.summary, "client": run.client,
        "hit_rate": sum(e.cached_tokens for e in events) / prompt_tokens if prompt_tokens else 0.0,
        "router_hit_rate": router.get("prefix_hit_rate", 0.0),
        "placements": router.get("placements_by_worker", {}),
        "outstanding": outstanding,
        "imbalance": busiest / idlest if idlest > 0 else math.inf,
        "busiest": busiest, "idlest": idlest,
    }


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
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
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
    args = parser.parse_args()
    names = DEFAULT_SCENARIOS if args.scenario == "all" else (args.scenario,)
    scenarios = [SCENARIOS[n] for n in names]
    if args.find_capacity:
        for sc in scenarios:
            await find_capacity(sc, args.policies.split(",")[0], args)
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
        print(f"\n{sc.name}: {sc.groups} prompt(s) of {sc.prefix_tokens} tokens + {sc.suffix_tokens}-token suffix, "
              f"{sc.output_tokens} output tokens; {args.workers} workers × {sc.kv_blocks} KV blocks; "
              f"offered {args.load or sc.load:.0%} of {fleet:.1f} req/s ({sc.capacity_is}; no-reuse "
              f"capacity {rows[0]['no_reuse'] / args.speed:.1f} req/s), simulated time; speed {args.speed}; "
              f"SLO TTFT ≤ {args.slo_ttft} s, TPOT ≤ {args.slo_tpot * 1000:.0f} ms\n")
        print(table(rows, args.speed), flush=True)
        all_rows.extend(rows)
    if args.out:
        import msgspec

        await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(all_rows))


if __name__ == "__main__":
    asyncio.run(main())
