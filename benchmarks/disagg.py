"""Prefill and decode apart against one pool, on the same accelerators: what a prefill/decode
split does to TTFT, TPOT and the tokens between them, and to goodput under both SLOs.

Each case is a fresh local mesh (nats-server, gateway, router; sim workers with
the ``llama-3.1-8b-h100`` profile at ``--speed``) of ``--gpus`` workers: all of them taking
requests (``aggregated``), or ``P`` of them prefill workers and the rest taking requests
(``split:P``, ``meshserve up --prefill-workers P``'s layout). One ``ops.bench`` client
offers the same Poisson arrivals of distinct prompts to each, at a share of the aggregated
pool's capacity (the profile's formula) for ``--duration`` seconds. Admission is left out:
what it refuses would differ by layout, and the layouts are compared on the same requests.

Figures read as an H100 fleet would see them (latencies × speed). Goodput: the share of
requests that meet both SLOs (TTFT and TPOT, DistServe's measure), and those per second, for
a relaxed pair and a tight one (``--slos``).

    .venv/bin/python benchmarks/disagg.py                          # 3 layouts × 2 loads, ~10 min
    .venv/bin/python benchmarks/disagg.py --cases aggregated,split:1 --loads 0.5 --seed 2
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, RunResult, WorkloadConfig, run_bench
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from services.worker.engines.sim_profile import DEFAULT_PROFILE, load_profile

MODEL = "sim-llama-8b"


def per_worker_capacity(args: argparse.Namespace) -> float:
    """Requests per wall second one aggregated sim worker sustains (the profile's formula)."""
    return load_profile(DEFAULT_PROFILE).costs.requests_per_s(args.input_tokens, args.output_tokens) * args.speed


async def run_case(case: str, load: float, args: argparse.Namespace) -> dict[str, Any]:
    prefill = int(case.split(":", 1)[1]) if case.startswith("split:") else 0
    if not 0 <= prefill < args.gpus:
        raise SystemExit(f"{case}: a split needs 1 to {args.gpus - 1} prefill workers")
    state = Path(tempfile.mkdtemp(prefix="meshserve-bench-disagg-"))
    router_args: list[str] = []
    if args.remote_prefill:
        (state / "router.toml").write_text("[default]\n" + "".join(
            f"remote_prefill_{k.strip()} = {int(v)}\n" for k, v in (kv.split("=") for kv in args.remote_prefill.split(","))))
        router_args = ["--config", str(state / "router.toml")]
    mesh = Mesh(MeshConfig(state_dir=state, nats_port=0, http_port=free_port(), model=MODEL,
                           workers=args.gpus - prefill, prefill_workers=prefill, speed=args.speed,
                           worker_args=["--max-model-len", "16384"], service_args={"router": router_args},
                           services=("worker", "gateway", "router")))
    await mesh.start(timeout=120)
    bus = await Bus.open(mesh.settings, "bench-disagg", initial_attempts=20)
    try:
        rate = load * args.gpus * per_worker_capacity(args)
        config = BenchConfig(
            endpoints=[EndpointConfig(mesh.gateway_url + "/v1", label=case, api="completions", model=MODEL,
                                      api_key=mesh.dev_key)],
            workload=WorkloadConfig(kind="random", input_tokens=args.input_tokens_dist or str(args.input_tokens),
                                    output_tokens=str(args.output_tokens)),
            rates=[rate], num_requests=max(20, int(rate * args.duration)), seed=args.seed,
            request_timeout=600.0, label=case,
        )
        result = await run_bench(config)
        workers = await bus.every_service_stats("worker")
    finally:
        await bus.close()
        mesh.stop(timeout=60)
    return {"case": case, "load": load, "rate": rate, "run": result.runs[0],
            "remote": sum(int(w.get("remote_prefills", 0)) for w in workers),
            "fallbacks": sum(int(w.get("remote_prefill_fallbacks", 0)) for w in workers)}


def _q(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


def table(cases: list[dict[str, Any]], args: argparse.Namespace) -> str:
    speed = args.speed
    ms = 1000 * speed  # wall seconds → an H100's milliseconds
    slos = [f"goodput at TTFT ≤ {t:g} s, TPOT ≤ {p * 1000:g} ms" for t, p in args.slo_pairs]
    rows = ["| layout | load | req/s (H100) | served | remote prefills | TTFT p50 | p90 | p99 ms | TPOT p50 | p99 ms | "
            "ITL p99.9 | max ms | tokens > 100 ms late | " + " | ".join(slos) + " |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(slos)]
    for c in cases:
        run: RunResult = c["run"]
        ok = [r for r in run.requests if r.status == "ok"]
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tpot = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
        itl = sorted(x for r in ok for x in r.itl_s)
        span = max((r.sent_s + (r.e2e_s or 0.0) for r in ok), default=1.0)
        total = max(1, len(run.requests))
        goodput = []
        for slo_ttft, slo_tpot in args.slo_pairs:
            good = sum(1 for r in ok if r.ttft_s is not None and r.tpot_s is not None
                       and r.ttft_s * speed <= slo_ttft and r.tpot_s * speed <= slo_tpot)
            goodput.append(f"{good / total:.0%} ({good / span / speed:.2f}/s)")
        fallbacks = f" ({c['fallbacks']} computed after all)" if c["fallbacks"] else ""
        rows.append(
            f"| {c['case']} | {c['load']:.0%} | {c['rate'] / speed:.2f} | {len(ok) / total:.0%} | "
            f"{c['remote']}{fallbacks} | "
            f"{_q(ttft, 0.5) * ms:,.0f} | {_q(ttft, 0.9) * ms:,.0f} | {_q(ttft, 0.99) * ms:,.0f} | "
            f"{_q(tpot, 0.5) * ms:.1f} | {_q(tpot, 0.99) * ms:.1f} | {_q(itl, 0.999) * ms:.0f} | "
            f"{(itl[-1] if itl else float('nan')) * ms:.0f} | {sum(x * speed > 0.1 for x in itl) / max(1, len(itl)):.2%} | "
            + " | ".join(goodput) + " |")
    return "\n".join(rows)


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="aggregated,split:1,split:2",
                   help="comma-separated: aggregated, split:P (P of the --gpus workers prefill)")
    p.add_argument("--loads", default="0.4,0.7", help="comma-separated shares of the aggregated pool's capacity")
    p.add_argument("--gpus", type=int, default=4, help="workers in every layout")
    p.add_argument("--speed", type=float, default=0.25, help="the sim's speed (1: an H100's own time)")
    p.add_argument("--input-tokens", type=int, default=4096)
    p.add_argument("--input-tokens-dist", default=None, help="a length distribution instead (ops.bench's syntax)")
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per case")
    p.add_argument("--slos", default="2:50,1:15",
                   help="goodput's SLO pairs, TTFT seconds : TPOT ms on an H100, comma-separated")
    p.add_argument("--remote-prefill", default="",
                   help="the router's settings, e.g. max_queue_tokens=8192,min_tokens=512 (PolicyConfig.remote_prefill_*)")
    p.add_argument("--seed", type=int, default=1)
    return p


async def main() -> None:
    args = arg_parser().parse_args()
    args.slo_pairs = [(float(t), float(p) / 1000) for t, p in (pair.split(":") for pair in args.slos.split(","))]
    cases = []
    for load in (float(x) for x in args.loads.split(",")):
        for case in args.cases.split(","):
            print(f"{case} at {load:.0%} of the aggregated pool's capacity ...", flush=True)
            cases.append(await run_case(case.strip(), load, args))
    print(f"\n{args.gpus} sim H100s (llama-3.1-8b), speed {args.speed}; {args.input_tokens} prompt + "
          f"{args.output_tokens} output tokens; aggregated capacity {args.gpus * per_worker_capacity(args) / args.speed:.2f}"
          f" req/s; seed {args.seed}; remote prefill settings {args.remote_prefill or 'the defaults'}\n")
    print(table(cases, args))


if __name__ == "__main__":
    asyncio.run(main())
