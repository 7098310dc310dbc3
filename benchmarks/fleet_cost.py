"""What a fleet costs per million tokens at light and heavy load: a static pool against the
autoscaler, measured by the mesh's own fleet report (``meshserve usage --fleet``).

Each case is a fresh local mesh (nats-server, gateway, router, metering; sim workers with
the ``llama-3.1-8b-h100`` profile at ``--speed``): either ``--replicas`` workers started
with the mesh (``static``), or one worker and the autoscaler with the local driver
(``autoscaled``: min 1, max ``--replicas``, its default target utilisation). One
``ops.bench`` client offers Poisson arrivals of distinct prompts at a share of the
``--replicas``-worker fleet's capacity (the profile's formula) for ``--duration`` seconds.
Workers report their time every ``--capacity-interval`` seconds; the fleet report is read
for the periods that ended inside the run, with the price table below.

Figures read as an H100 fleet would see them: latencies × speed, and cost × speed (a sim
at speed 0.25 takes four times an H100's time for the same tokens, and its accelerator
time is four times as long). The plan column is ``meshserve plan``'s arithmetic for the
same rate (replicas = ⌈λ / (ρ·μ)⌉ at ρ 0.7, μ the profile's), at the same price.

    .venv/bin/python benchmarks/fleet_cost.py                         # 4 cases, ~6 min
    .venv/bin/python benchmarks/fleet_cost.py --loads 0.1 --cases static
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, RunResult, SLOSpec, WorkloadConfig, run_bench
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto.metering import FleetQuery, FleetReport
from services.worker.engines.sim_profile import DEFAULT_PROFILE, load_profile

MODEL = "sim-llama-8b"
PRICE_PER_HOUR = 2.99  # an example H100 hour, not anyone's quote
PRICES = f"""
currency = "USD"
[models."{MODEL}"]
input = 0.10
output = 0.40
[accelerators."H100-80GB"]
per_hour = {PRICE_PER_HOUR}
"""


def per_worker_capacity(args: argparse.Namespace) -> float:
    """Requests per wall second one sim worker sustains (the profile's formula)."""
    return load_profile(DEFAULT_PROFILE).costs.requests_per_s(args.input_tokens, args.output_tokens) * args.speed


async def run_case(case: str, load: float, args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="meshserve-bench-fleet-cost-"))
    (state / "prices.toml").write_text(PRICES)
    worker_args = ["--max-model-len", "16384", "--capacity-interval", str(args.capacity_interval),
                   "--drain-timeout", "20"]
    static = case == "static"
    service_args = {"metering": ["--prices", str(state / "prices.toml")],
                    # the local driver starts the pool's workers with the mesh's worker flags
                    "autoscaler": ["--max-replicas", str(args.replicas), "--max-workers", str(args.replicas),
                                   "--cooldown", str(args.cooldown), "--tick", "1"]}
    mesh = Mesh(MeshConfig(state_dir=state, nats_port=0, http_port=free_port(), model=MODEL,
                           workers=args.replicas if static else 1, speed=args.speed, worker_args=worker_args,
                           services=("worker" if static else "autoscaler", "gateway", "router", "metering"),
                           service_args=service_args))
    await mesh.start(timeout=120)
    bus = await Bus.open(mesh.settings, "bench-fleet-cost", initial_attempts=20)
    try:
        rate = load * args.replicas * per_worker_capacity(args)
        config = BenchConfig(
            endpoints=[EndpointConfig(mesh.gateway_url + "/v1", label=case, api="completions", model=MODEL,
                                      api_key=mesh.dev_key)],
            workload=WorkloadConfig(kind="random", input_tokens=str(args.input_tokens),
                                    output_tokens=str(args.output_tokens)),
            rates=[rate], num_requests=max(20, int(rate * args.duration)), seed=args.seed,
            slo=SLOSpec(ttft_s=args.slo_ttft / args.speed), request_timeout=600.0, label=case,
        )
        started = time.time()
        result = await run_bench(config)
        ended = max(time.time(), started + 2 * args.capacity_interval)  # a window that holds a period
        # The periods that end inside the run; the last ones are reported one interval on.
        await asyncio.sleep(max(0.0, ended - time.time()) + args.capacity_interval + 1.0)
        window_since = started + args.capacity_interval  # a period ending here began at the run's start
        report = await bus.request(bus.subjects.metering_fleet,
                                   FleetQuery(model=MODEL, since=window_since, until=ended, group_by=[]),
                                   FleetReport, timeout=10)
    finally:
        await bus.close()
        mesh.stop(timeout=60)
    run: RunResult = result.runs[0]
    return {"case": case, "load": load, "rate": rate, "run": run, "fleet": report.total(),
            "window_s": ended - window_since}


def plan_replicas(rate: float, args: argparse.Namespace) -> int:
    return max(1, math.ceil(rate / (0.7 * per_worker_capacity(args)) - 1e-9))


def table(cases: list[dict[str, Any]], args: argparse.Namespace) -> str:
    speed = args.speed
    rows = ["| fleet | load | offered req/s (H100) | served | TTFT p50 | p90 ms | mean replicas | busy | "
            "cost per hour | per 1M tokens | per 1M output | margin per 1M tokens | plan: replicas | plan: per 1M tokens |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cases:
        run, fleet = c["run"], c["fleet"]
        ok = [r for r in run.requests if r.status == "ok"]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)

        def q(p: float, values: list[float] = ttfts) -> str:
            return "-" if not values else f"{values[min(len(values) - 1, int(p * len(values)))] * 1000 * speed:,.0f}"

        tokens = fleet.prompt_tokens + fleet.completion_tokens
        cost = fleet.cost_nano / 1e9 * speed  # an H100 does the same work in speed × the sim's time
        per_million = cost / tokens * 1e6 if tokens else float("nan")
        per_output = cost / fleet.completion_tokens * 1e6 if fleet.completion_tokens else float("nan")
        spend = fleet.spend_nano / 1e9
        mean_replicas = fleet.replica_s / c["window_s"]
        replicas = plan_replicas(c["rate"], args)
        plan_per_million = replicas * PRICE_PER_HOUR / (c["rate"] / speed * 3600 * (args.input_tokens + args.output_tokens)) * 1e6
        rows.append(
            f"| {c['case']} | {c['load']:.0%} | {c['rate'] / speed:.1f} | {len(ok) / max(1, len(run.requests)):.0%} | "
            f"{q(0.5)} | {q(0.9)} | {mean_replicas:.2f} | "
            f"{fleet.busy_s / fleet.replica_s if fleet.replica_s else float('nan'):.0%} | "
            f"{mean_replicas * PRICE_PER_HOUR:.2f} | {per_million:.4f} | {per_output:.4f} | "
            f"{(spend - cost) / tokens * 1e6 if tokens else float('nan'):.4f} | {replicas} | {plan_per_million:.4f} |")
    return "\n".join(rows)


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="static,autoscaled", help="comma-separated: static, autoscaled")
    p.add_argument("--loads", default="0.1,0.6", help="comma-separated shares of the static fleet's capacity")
    p.add_argument("--replicas", type=int, default=4, help="the static fleet, and the autoscaler's maximum")
    p.add_argument("--speed", type=float, default=0.25, help="the sim's speed (1: an H100's own time)")
    p.add_argument("--input-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per case")
    p.add_argument("--capacity-interval", type=float, default=2.0, help="the workers' report period, seconds")
    p.add_argument("--cooldown", type=float, default=15.0, help="the autoscaler's scale-down cooldown, seconds")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO, simulated seconds (for the bench's goodput)")
    p.add_argument("--seed", type=int, default=1)
    return p


async def main() -> None:
    args = arg_parser().parse_args()
    cases = []
    for load in (float(x) for x in args.loads.split(",")):
        for case in args.cases.split(","):
            print(f"{case} at {load:.0%} of {args.replicas} replicas' capacity ...", flush=True)
            cases.append(await run_case(case.strip(), load, args))
    print(f"\nprices: {PRICE_PER_HOUR} USD an H100-hour; tokens 0.10 in / 0.40 out per million; speed {args.speed}; "
          f"{args.input_tokens} prompt + {args.output_tokens} output tokens; per-worker capacity "
          f"{per_worker_capacity(args) / args.speed:.2f} req/s (H100)\n")
    print(table(cases, args))


if __name__ == "__main__":
    asyncio.run(main())
