"""Admission at light load and under overload: 10 %, 50 % and 2× the fleet's capacity,
premium and standard, with and without the admission service.

Each run starts a fresh local mesh (``ops.up.Mesh``: nats-server, 8 sim workers, a
gateway, a router, and in one of the two runs the admission service; each its own
process) and drives it with two ``ops.bench`` clients at once over HTTP, open loop,
Poisson: premium traffic at 0.5× and standard traffic at 1.5× the fleet's capacity, so
2× in all. Prompts are distinct (no prefix reuse), so capacity is what the sim
profile's step-time formula gives (printed with the results). Without admission every
request is accepted and queues (the workers still run premium first, by priority);
with it, requests whose predicted TTFT breaks their tier's SLO are refused at once with
429 + Retry-After.

Latencies are the clients' own, converted to simulated time (× speed) so they read as
an H100 fleet would see them; the admission tiers are scaled the other way (premium
TTFT SLO 1 s, standard 2 s, simulated). Admission scales its predictions by the
``--calibration-quantile`` of actual / predicted TTFT it has observed (SloConfig), and
admits when the scaled prediction is within ``--target`` of the SLO.
Goodput counts requests meeting their tier's
TTFT bound and TPOT ≤ 200 ms (``--slo-tpot``); SLO met is that count over all requests sent (refusals
count as misses: they are the price of keeping the rest inside the SLO) and over the
requests served. The workers' step budget is 2048 tokens (``--max-num-batched-tokens``,
vLLM's knob): at saturation every step carries a prefill chunk, so TPOT is about one
step, ~150 ms simulated; vLLM's 8192 default would make it ~0.6 s.

A third run, ``capacity``, offers 1× capacity with admission off: its goodput is the
reference that the goodput under overload is compared with.

Light load, ``on@0.1`` and ``on@0.5``: admission on at 10 % and 50 % of capacity, same
mix. There admission must refuse nothing (a policy tuned for overload that sheds on an
idle mesh is a bug), and its predictions must match what requests then see. For every
case with admission, the table of prediction errors gives admission's own record of
predicted / actual TTFT for the requests it admitted (the calibrated prediction it
decided on, against the TTFT the gateway measured from arrival to first token, and the
formula alone before the learnt overhead and factor): quantiles, and the shares off by
more than 2× either way.

    .venv/bin/python benchmarks/overload.py                       # on@0.1, on@0.5, capacity, off, on: ~18 min
    .venv/bin/python benchmarks/overload.py --cases on            # admission alone, overloaded
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, RunResult, SLOSpec, WorkloadConfig, run_bench
from ops.keys import create_key
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from services.admission.slo import SloConfig
from services.worker.engines.sim_profile import DEFAULT_PROFILE, load_profile

MODEL = "sim-llama-8b"
TIERS = {"premium": (1.0, 2), "standard": (2.0, 1)}  # TTFT SLO (simulated s), priority


def fleet_capacity(args: argparse.Namespace) -> float:
    """The fleet's capacity for the distinct prompts, wall req/s (the profile's formula)."""
    per_worker = load_profile(DEFAULT_PROFILE).costs.requests_per_s(args.input_tokens, args.output_tokens)
    return per_worker * args.workers * args.speed


def tier_shares(args: argparse.Namespace, load: float) -> dict[str, float]:
    return {"premium": args.premium_share * load, "standard": (1 - args.premium_share) * load}


def tier_config(tier: str, url: str, api_key: str, load: float, args: argparse.Namespace,
                extra_body: dict[str, Any] | None = None) -> BenchConfig:
    """One tier's client at ``load`` × capacity: the same arrivals and prompts for every
    system given the same seed (peers.py runs them against the peers' routers)."""
    rate = tier_shares(args, load)[tier] * fleet_capacity(args)
    return BenchConfig(
        endpoints=[EndpointConfig(url, label=tier, api="completions", model=MODEL, api_key=api_key)],
        workload=WorkloadConfig(kind="random", input_tokens=str(args.input_tokens),
                                output_tokens=str(args.output_tokens)),
        rates=[rate], num_requests=max(20, int(rate * args.duration)),
        seed=args.seed + (0 if tier == "premium" else 1000),
        slo=SLOSpec(ttft_s=TIERS[tier][0] / args.speed, tpot_s=args.slo_tpot / args.speed),
        request_timeout=args.timeout / args.speed, label=tier, extra_body=dict(extra_body or {}),
    )


async def run_case(with_admission: bool, load: float, args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="meshserve-bench-overload-"))
    worker_args = ["--max-model-len", "16384", "--gauge-interval", "0.1",
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    extra: dict[str, list[str]] = {}
    if args.router_config:
        extra["router"] = ["--config", args.router_config]
    services: tuple[str, ...] = ("worker", "gateway", "router")
    if with_admission:
        tiers = {name: {"ttft_slo_s": slo / args.speed, "priority": prio} for name, (slo, prio) in TIERS.items()}
        tiers["batch"] = {"ttft_slo_s": 10.0 / args.speed, "priority": 0}
        config_file = state / "admission.json"
        config_file.write_text(json.dumps({"tiers": tiers, "default_tier": "standard",
                                           "slo": {"target": args.target,
                                                   "calibration_quantile": args.calibration_quantile,
                                                   "placement_slack": args.placement_slack}}))
        extra["admission"] = ["--config", str(config_file)]
        services = (*services, "admission")  # without it the gateway fails open (Mesh sets it)
    mesh = Mesh(MeshConfig(state_dir=state, nats_port=0, http_port=free_port(), model=MODEL, workers=args.workers,
                           speed=args.speed, worker_args=worker_args, services=services, dev_key=True,
                           service_args=extra))
    await mesh.start(timeout=120)
    bus = await Bus.open(mesh.settings, "bench-overload", initial_attempts=20)
    try:
        keys = {tier: (await create_key(bus, org="bench", tier=tier, name=f"bench {tier}"))[0] for tier in TIERS}
        await asyncio.sleep(1.0)  # the gateway's key watcher sees them
        fleet = fleet_capacity(args)
        shares = tier_shares(args, load)
        results = await asyncio.gather(*(run_bench(tier_config(t, mesh.gateway_url + "/v1", keys[t], load, args))
                                         for t in TIERS))
        admission: dict[str, Any] = {}
        if with_admission:
            admission = await bus.service_stats("admission")
            router = await bus.service_stats("router")
            admission["router_admission_hints"] = router.get("admission_hints", {})
    finally:
        await bus.close()
        mesh.stop(timeout=60)
    runs: dict[str, RunResult] = {t: r.runs[0] for t, r in zip(TIERS, results, strict=True)}
    return {"admission": with_admission, "load": load, "fleet_capacity": fleet, "shares": shares, "runs": runs,
            "admission_stats": admission}


def _ms(v: float | None, speed: float) -> str:
    return "-" if v is None else f"{v * speed:,.0f}"


def table(cases: list[dict[str, Any]], speed: float) -> str:
    lines = [
        "| load | admission | tier | offered req/s | served | refused 429 | other errors | TTFT p50 | p90 | p99 ms "
        "| TPOT p50 | p99 ms | goodput req/s | SLO met (of sent) | SLO met (of served) |",
        "|" + " --- |" * 15,
    ]
    for case in cases:
        for tier, run in case["runs"].items():
            s = run.summary
            refused = s.errors.get("429", 0)
            other = ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items()) if k != "429") or "0"
            lines.append(
                f"| {case['load']:g}× | {'on' if case['admission'] else 'off'} | {tier} | {(run.rate or 0) / speed:.1f} "
                f"| {s.ok / max(s.requests, 1):.0%} | {refused / max(s.requests, 1):.0%} | {other} "
                f"| {_ms(s.ttft_ms.p50, speed)} | {_ms(s.ttft_ms.p90, speed)} | {_ms(s.ttft_ms.p99, speed)} "
                f"| {_ms(s.tpot_ms.p50, speed)} | {_ms(s.tpot_ms.p99, speed)} | {(s.goodput or 0) / speed:.1f} "
                f"| {s.slo_attainment or 0:.0%} | {(s.slo_met or 0) / max(s.ok, 1):.0%} |"
            )
    return "\n".join(lines)


def case_spec(name: str, overload: float) -> tuple[bool, float]:
    """(admission on, load over capacity) of a ``--cases`` item."""
    if name == "capacity":
        return False, 1.0
    if name in ("on", "off"):
        return name == "on", overload
    if name.startswith("on@"):
        try:
            return True, float(name[3:])
        except ValueError:
            pass
    raise SystemExit(f"unknown case {name!r}: expected capacity, off, on or on@<load>")


def late_requests(cases: list[dict[str, Any]], speed: float) -> str:
    """Every admitted request that missed its TTFT SLO: when it arrived in the run and
    by how much it missed (simulated), so a miss at start-up reads apart from one under
    steady overload."""
    lines = []
    for case in cases:
        if not case["admission"]:
            continue
        for tier, run in case["runs"].items():
            slo = TIERS[tier][0]
            late = sorted((r.scheduled_s * speed, r.ttft_s * speed) for r in run.requests
                          if r.status == "ok" and r.ttft_s is not None and r.ttft_s * speed > slo)
            shown = ", ".join(f"{t:.1f} s: {ttft * 1000:,.0f} ms" for t, ttft in late[:12])
            more = f" (+{len(late) - 12})" if len(late) > 12 else ""
            lines.append(f"{case['load']:g}× {tier}: {len(late)} late of {run.summary.ok} served"
                         + (f"; arrived at {shown}{more}" if late else ""))
    return "\n".join(lines)


def worst_predictions(cases: list[dict[str, Any]], speed: float) -> str:
    """Admission's own list of the predictions furthest from the TTFT seen, per case and
    tier (simulated seconds; admitted at: seconds after the first outcome it kept)."""
    lines = []
    for case in cases:
        for tier, rows in sorted(case["admission_stats"].get("prediction_worst", {}).items()):
            shown = "; ".join(f"at {r['at_s'] * speed:.1f} s: predicted {r['predicted_s'] * speed * 1000:,.0f} ms "
                              f"(formula {r['formula_s'] * speed * 1000:,.0f}), TTFT {r['actual_s'] * speed * 1000:,.0f}"
                              for r in rows)
            lines.append(f"{case['load']:g}× {tier}: {shown}")
    return "\n".join(lines)


def error_table(cases: list[dict[str, Any]]) -> str:
    """Admission's predicted / actual TTFT of the requests it admitted, per case and tier:
    the calibrated point prediction it reports, the formula alone (before the overhead
    and the calibration factor), and the tail bound it held against the SLO."""
    lines = [
        "| load | tier | admitted | predicted: p1 | p10 | p50 | p90 | p99 | > 2× over | > 2× under "
        "| formula: p10 | p50 | p90 | > 2× over | > 2× under | bound: p50 | p99 | factor | overhead ms (wall) |",
        "|" + " --- |" * 19,
    ]
    for case in cases:
        stats = case["admission_stats"]
        if not stats:
            continue
        for tier, e in sorted(stats.get("prediction_error", {}).items()):
            lines.append(
                f"| {case['load']:g}× | {tier} | {e['n']:.0f} | {e['p1']:.2f} | {e['p10']:.2f} | {e['p50']:.2f} "
                f"| {e['p90']:.2f} | {e['p99']:.2f} | {e['over_2x']:.1%} | {e['under_2x']:.1%} "
                f"| {e['raw_p10']:.2f} | {e['raw_p50']:.2f} | {e['raw_p90']:.2f} | {e['raw_over_2x']:.1%} "
                f"| {e['raw_under_2x']:.1%} | {e['bound_p50']:.2f} | {e['bound_p99']:.2f} "
                f"| {stats.get('ttft_calibration', {}).get(tier, 1.0):.2f} "
                f"| {stats.get('ttft_overhead_s', 0.0) * 1000:.0f} |"
            )
    return "\n".join(lines)


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speed", type=float, default=0.25, help="sim speed factor (1.0 = real time)")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load over capacity")
    parser.add_argument("--premium-share", type=float, default=0.25, help="premium part of the offered load")
    parser.add_argument("--input-tokens", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the workers' step budget (vLLM's; 2048 keeps steps, hence TPOT, short)")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--duration", type=float, default=80.0, help="seconds of arrivals per run (wall)")
    parser.add_argument("--target", type=float, default=1.0,
                        help="admission admits predictions within this fraction of the SLO (SloConfig.target)")
    parser.add_argument("--calibration-quantile", type=float, default=SloConfig().calibration_quantile,
                        help="admission holds this quantile of actual/predicted TTFT against the SLO")
    parser.add_argument("--placement-slack", type=float, default=SloConfig().placement_slack,
                        help="work the router may add ahead of an admitted request, as a fraction of its predicted "
                             "TTFT (SloConfig.placement_slack)")
    parser.add_argument("--timeout", type=float, default=30.0, help="request timeout, simulated seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT bound of goodput, simulated seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", default="on@0.1,on@0.5,capacity,off,on",
                        help="capacity (1× load, admission off: the reference goodput), off, on (both at --overload), "
                             "on@X (admission on at X× capacity)")
    parser.add_argument("--router-config", default=None, help="router config file (e.g. the prefix policy's beta)")
    return parser


async def main() -> None:
    args = arg_parser().parse_args()
    cases = []
    for name in args.cases.split(","):
        with_admission, load = case_spec(name, args.overload)
        case = await run_case(with_admission, load, args)
        for tier, run in case["runs"].items():
            c = run.client
            flag = " CLIENT LAGGED: " + "; ".join(c.reasons) if c.lagged else ""
            print(f"admission {name} {tier}: client lag p99 {c.lag_ms.p99:.1f} ms, cpu {c.cpu_util:.0%}{flag}", flush=True)
        if case["admission_stats"]:
            print(f"admission stats: {case['admission_stats']}", flush=True)
        cases.append(case)
    fleet = cases[0]["fleet_capacity"] / args.speed
    print(f"\n{args.workers} workers, {args.input_tokens} prompt / {args.output_tokens} output tokens (distinct prompts); "
          f"capacity {fleet:.1f} req/s (simulated time); offered {args.overload:g}× = "
          f"{args.premium_share:.0%} premium + {1 - args.premium_share:.0%} standard; speed {args.speed}; "
          f"SLO TTFT premium ≤ {TIERS['premium'][0]} s, standard ≤ {TIERS['standard'][0]} s, "
          f"TPOT ≤ {args.slo_tpot * 1000:.0f} ms; admission target {args.target:g}, calibration quantile "
          f"{args.calibration_quantile:g}\n")
    print(table(cases, args.speed), flush=True)
    print()
    print(error_table(cases), flush=True)
    print()
    print("Admitted requests past their TTFT SLO (arrival in the run, TTFT; simulated):")
    print(late_requests(cases, args.speed), flush=True)
    print()
    print("Admission's predictions furthest from the TTFT seen (simulated):")
    print(worst_predictions(cases, args.speed), flush=True)
    totals = [sum((r.summary.goodput or 0) for r in c["runs"].values()) / args.speed for c in cases]
    reference = next((t for c, t in zip(cases, totals, strict=True) if c["load"] == 1.0 and not c["admission"]), None)
    print()
    for c, total in zip(cases, totals, strict=True):
        ratio = f" = {total / reference:.0%} of the goodput at capacity" if reference else ""
        print(f"{c['load']:g}× load, admission {'on' if c['admission'] else 'off'}: goodput {total:.1f} req/s{ratio}")


if __name__ == "__main__":
    asyncio.run(main())
