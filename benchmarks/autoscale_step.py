"""Autoscaling under a step load: replicas, offered load and p90 TTFT over time.

A local mesh (nats-server, gateway, one sim worker) plus the autoscaler with the local
driver. The bench tool's Python API (``ops.bench.run_bench``) replays a trace of
Poisson arrivals at ``--base-rate`` for ``--before`` seconds, ``--factor`` times that
for ``--step`` seconds, then the base rate again for ``--after`` seconds, through the
gateway's OpenAI API. A sampler asks ``mesh.autoscaler.status`` every half second.

Writes ``OUT/autoscale_step.png`` (replicas, offered load and p90 TTFT in bins of
``--bin`` seconds), ``OUT/timeline.json`` and ``OUT/bench.json``; prints the summary:
time from the step to the scale-up decision and to the added replicas being ready,
p90 TTFT before / during / after the step, failed requests.

    .venv/bin/python benchmarks/autoscale_step.py --out results/autoscale_step

The sim replica is Llama-3.1-8B on one H100 (profile ``llama-3.1-8b-h100``) at
``--speed`` (1.0 = real time) limited to ``--max-num-seqs`` sequences, so a few
requests per second saturate it; sim workers start in about a second, where real
ones take minutes (that gap is what ``--warm-buffer`` is for).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bus import Bus
from ops.bench.config import BenchConfig, EndpointConfig, WorkloadConfig
from ops.bench.results import RequestResult, save_result
from ops.bench.runner import run_bench
from ops.natsserver import free_port
from ops.status import fetch_status
from ops.up import Mesh, MeshConfig, ServiceProcess
from proto.errors import MeshError

MODEL = "sim-llama-8b"


def step_trace(args: argparse.Namespace, path: Path) -> list[tuple[float, float]]:
    """Piecewise-Poisson arrivals as a JSONL trace; returns the (start, rate) phases."""
    rng = np.random.default_rng(args.seed)
    phases = [(0.0, args.base_rate), (args.before, args.base_rate * args.factor),
              (args.before + args.step, args.base_rate)]
    end = args.before + args.step + args.after
    lines = []
    for i, (start, rate) in enumerate(phases):
        stop = phases[i + 1][0] if i + 1 < len(phases) else end
        t = start + rng.exponential(1.0 / rate)
        while t < stop:
            lines.append(json.dumps({"timestamp": round(t, 4), "input_tokens": args.input_tokens,
                                     "output_tokens": args.output_tokens}))
            t += rng.exponential(1.0 / rate)
    # The bench measures offsets from the first arrival: anchor it at t = 0.
    lines.insert(0, json.dumps({"timestamp": 0.0, "input_tokens": args.input_tokens, "output_tokens": args.output_tokens}))
    path.write_text("\n".join(lines) + "\n")
    return phases


async def sample(bus: Bus, t0: float, out: list[dict[str, Any]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            status = await fetch_status(bus, decisions=50, timeout=1.0)
            (p,) = status.pools
            out.append({"t": time.time() - t0, "current": p.current, "ready": p.ready, "desired": p.desired,
                        "starting": p.starting, "draining": p.draining,
                        "load_tokens": (p.signals.waiting_tokens + p.signals.running_tokens) if p.signals else 0,
                        "decisions": [(d.at - t0, d.action, d.current, d.desired) for d in p.decisions
                                      if d.action != "hold"]})
        except MeshError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


def binned(records: list[RequestResult], width: float, end: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    edges = np.arange(0.0, end + width, width)
    offered = np.zeros(len(edges) - 1)
    p90 = np.full(len(edges) - 1, np.nan)
    for i in range(len(edges) - 1):
        inside = [r for r in records if edges[i] <= r.scheduled_s < edges[i + 1]]
        offered[i] = len(inside) / width
        ttfts = [r.ttft_s for r in inside if r.ttft_s is not None]
        if ttfts:
            p90[i] = float(np.percentile(ttfts, 90))
    return edges[:-1] + width / 2, offered, p90


def p90_between(records: list[RequestResult], start: float, stop: float) -> float | None:
    ttfts = [r.ttft_s for r in records if start <= r.scheduled_s < stop and r.ttft_s is not None]
    return float(np.percentile(ttfts, 90)) if ttfts else None


def plot(path: Path, timeline: list[dict[str, Any]], records: list[RequestResult], phases: list[tuple[float, float]],
         args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = args.before + args.step + args.after
    centers, offered, p90 = binned(records, args.bin, end)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = [s["t"] for s in timeline]
    axes[0].step(t, [s["ready"] for s in timeline], where="post", label="ready")
    axes[0].step(t, [s["desired"] for s in timeline], where="post", linestyle="--", label="desired")
    axes[0].step(t, [s["draining"] for s in timeline], where="post", linestyle=":", label="draining")
    axes[0].set_ylabel("replicas")
    axes[0].legend(loc="upper left")
    axes[1].bar(centers, offered, width=args.bin * 0.9, alpha=0.6, label="offered (req/s)")
    axes[1].step([p[0] for p in phases] + [end], [p[1] for p in phases] + [phases[-1][1]], where="post",
                 color="black", label="nominal rate")
    axes[1].set_ylabel("requests/s")
    axes[1].legend(loc="upper left")
    axes[2].plot(centers, p90 * 1000, marker="o")
    axes[2].set_ylabel("p90 TTFT (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds since load start")
    for ax in axes:
        ax.axvspan(args.before, args.before + args.step, color="orange", alpha=0.08)
        ax.grid(alpha=0.3)
    fig.suptitle(f"step {args.base_rate:g} → {args.base_rate * args.factor:g} req/s, cooldown {args.cooldown:g} s, "
                 f"sim speed {args.speed:g}, max {args.max_num_seqs} seqs/replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace, out: Path, state: Path) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """The mesh, the autoscaler and the bench: the timeline, the bench result, exit codes."""
    worker_args = ["--engine", "sim", "--speed", str(args.speed), "--max-num-seqs", str(args.max_num_seqs)]
    mesh = Mesh(MeshConfig(state_dir=state, nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                           speed=args.speed, worker_args=worker_args[4:],
                           # No admission service runs here: the gateway must not fail closed.
                           gateway_args=["--admission-unreachable", "open"]))
    await mesh.start()
    autoscaler_argv = [
        "--pool", MODEL, "--driver", "local", "--min-replicas", "1", "--max-replicas", str(args.max_replicas),
        "--cooldown", str(args.cooldown), "--warm-buffer", str(args.warm_buffer), "--tick", "1",
        "--state-dir", str(state), "--max-workers", str(args.max_replicas), "--worker-args", " ".join(worker_args),
    ]
    mesh.add_process(ServiceProcess("autoscaler", "autoscaler", autoscaler_argv, mesh.log_dir / "autoscaler.log"))
    bus = await Bus.open(mesh.settings, "autoscale-step", initial_attempts=20)
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await fetch_status(bus, timeout=1.0)
                break
            except MeshError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        config = BenchConfig(
            endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", label="mesh", model=MODEL, api_key=mesh.dev_key)],
            workload=WorkloadConfig(kind="trace", trace=str(out / "trace.jsonl")),
            num_requests=None, duration=args.before + args.step + args.after, request_timeout=120.0, progress=True,
            label="autoscale-step",
        )
        t0 = time.time()  # the bench's run starts now (target set-up adds well under 0.1 s)
        sampler = asyncio.create_task(sample(bus, t0, timeline, stop))
        result = await run_bench(config)
        await asyncio.sleep(args.tail)  # watch the scale-down finish
        stop.set()
        await sampler
    finally:
        await bus.close()
        codes = mesh.stop()
    return timeline, result, codes


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="autoscale-step-"))
    phases = step_trace(args, out / "trace.jsonl")
    timeline, result, codes = asyncio.run(run(args, out, state))
    save_result(result, out / "bench.json")
    (out / "timeline.json").write_text(json.dumps(timeline))
    records = result.runs[0].requests
    plot(out / "autoscale_step.png", timeline, records, phases, args)

    step_at, step_end = args.before, args.before + args.step
    decisions = timeline[-1]["decisions"] if timeline else []
    first_up = next((d[0] for d in decisions if d[1] == "scale_up" and d[0] >= step_at), None)
    base_ready = next((s["ready"] for s in reversed(timeline) if s["t"] < step_at), 1)
    peak = max((s["ready"] for s in timeline), default=0)
    peak_at = next((s["t"] for s in timeline if s["ready"] == peak and s["t"] >= step_at), None)
    failed = [r for r in records if r.status != "ok"]
    summary = {
        "phases": phases,
        "requests": len(records),
        "failed": len(failed),
        "failed_statuses": sorted({r.status for r in failed}),
        "replicas_before": base_ready,
        "replicas_peak": peak,
        "replicas_end": timeline[-1]["ready"] if timeline else None,
        "scale_up_decision_after_step_s": None if first_up is None else round(first_up - step_at, 2),
        "peak_ready_after_step_s": None if peak_at is None else round(peak_at - step_at, 2),
        "p90_ttft_before_s": p90_between(records, 0, step_at),
        "p90_ttft_step_first_10s_s": p90_between(records, step_at, step_at + 10),
        "p90_ttft_step_rest_s": p90_between(records, step_at + 10, step_end),
        "p90_ttft_after_s": p90_between(records, step_end, step_end + args.after),
        "decisions": decisions,
        "exit_codes": codes,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "decisions"}, indent=1))
    print(f"plot: {out / 'autoscale_step.png'}")
    return 0 if not failed else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base-rate", type=float, default=2.0, help="requests/s before and after the step")
    parser.add_argument("--factor", type=float, default=5.0, help="the step multiplies the rate by this")
    parser.add_argument("--before", type=float, default=30.0)
    parser.add_argument("--step", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=60.0)
    parser.add_argument("--tail", type=float, default=15.0, help="seconds to keep watching after the last request")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--cooldown", type=float, default=30.0)
    parser.add_argument("--warm-buffer", type=int, default=0)
    parser.add_argument("--bin", type=float, default=5.0, help="seconds per plot bin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/autoscale_step")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
