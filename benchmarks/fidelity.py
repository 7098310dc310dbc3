"""The sim held against the real engine: vLLM's CPU build and ``meshserve sim-server``,
fitted to it, under the same trace.

1. vLLM's own OpenAI server starts on the tiny model (``meshserve make-tiny-model``,
   made here unless ``--model-dir`` is given) with CPU-safe settings.
2. ``meshserve calibrate --engine-url`` measures it (its own prefill and decode times,
   from its metrics) and fits a sim profile, KV capacity included.
3. ``meshserve sim-server`` starts with that profile and the same engine limits.
4. The same open-loop Poisson trace (same seed, so the same arrival times and prompt and
   output lengths; each target's text made for its own tokenizer) runs against each at
   several rates, up to past the engine's saturation, for distinct prompts and for
   shared prefixes. The targets alternate at each rate, so the machine's drift affects
   both alike.

Where there are two CPUs or more, the model computes on one alone (``--engine-cpu``, 0):
vLLM's worker process, and the sim-server; the client and the rest of vLLM (API server,
engine core) on the others. vLLM's CPU build computes on the CPU, so a load generator on
its cores slows its steps as load grows, which no GPU engine sees; unpinned, vLLM's TPOT
rose from 3.2 to 5.2 ms between 10 and 41 req/s.

Per rate: TTFT and TPOT p50/p90 of both as the client sees them, the engine's own view
from its metrics (mean TTFT from arrival at the engine, mean decode time per token: no
HTTP server in front), and the sim's error (sim / vLLM − 1) on each; and the
saturation rate of each: the highest offered rate whose served rate keeps within 5 % of
the offered and whose TTFT p90 stays under ``--knee-ttft-factor`` × the lightest rate's.
Target (issue 18): within 10 %.

Run it with vLLM's venv (``make vllm-cpu``):

    .venv-vllm/bin/python benchmarks/fidelity.py                  # ~12 min
    .venv-vllm/bin/python benchmarks/fidelity.py --short          # calibration only: a sane fit (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from frontdoor import Proc, child_pids, wait_ready

from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, run_bench
from ops.bench.results import RunResult
from ops.calibrate_engine import EnginePlan, EngineProbe, calibrate_engine, metric_sums
from ops.natsserver import free_port
from services.worker.engines.sim_profile import load_profile

MODEL = "tiny-llama"
WORKLOADS = {
    # kind, input tokens, output tokens, shared prefix tokens (per group), groups
    "distinct": ("random", "256", "64", 0, 0),
    "shared-prefix": ("shared-prefix", "64", "64", 512, 4),
}


def engine_argv(model_dir: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--enforce-eager"]


def sim_argv(profile: Path, port: int, args: argparse.Namespace, num_blocks: int) -> list[str]:
    pin = ["taskset", "-c", str(args.engine_cpu)] if args.engine_cpu is not None else []
    return [*pin, sys.executable, "-m", "ops.cli", "sim-server", "--profile", str(profile), "--model", MODEL,
            "--port", str(port), "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--num-kv-blocks", str(num_blocks), "--seed", str(args.seed)]


ENGINE_SUMS = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
               "vllm:request_decode_time_seconds_sum", "vllm:generation_tokens_total",
               "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum")


async def engine_sums(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url + "/metrics") as r:
            r.raise_for_status()
            return metric_sums(await r.text(), ENGINE_SUMS)


def engine_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The engine's own view of a run, from its metrics: mean TTFT from the request's arrival
    at the engine (``vllm:time_to_first_token_seconds``: no HTTP in it; vLLM's counts from
    its input processing, so its tokenizing and the hand-off to its engine core are in it)
    and mean decode time per output token after the first (TPOT likewise)."""
    d = {k: after[k] - before[k] for k in ENGINE_SUMS}
    count = d["vllm:time_to_first_token_seconds_count"]
    decoded = d["vllm:generation_tokens_total"] - count
    return {
        "engine_ttft_mean": d["vllm:time_to_first_token_seconds_sum"] / count * 1000 if count else None,
        # scheduled by the engine to first token, plus its queue (vLLM's from its engine core's receipt)
        "engine_queue_prefill_mean": (d["vllm:request_queue_time_seconds_sum"]
                                      + d["vllm:request_prefill_time_seconds_sum"]) / count * 1000 if count else None,
        "engine_tpot_mean": d["vllm:request_decode_time_seconds_sum"] / decoded * 1000 if decoded > 0 else None,
    }


async def run_rate(url: str, tokenizer: str, workload: str, rate: float,
                   args: argparse.Namespace) -> tuple[RunResult, dict[str, float | None]]:
    kind, inp, out, prefix, groups = WORKLOADS[workload]
    config = BenchConfig(
        endpoints=[EndpointConfig(url + "/v1", label=url, api="completions", model=MODEL)],
        workload=WorkloadConfig(kind=kind, input_tokens=inp, output_tokens=out, prefix_tokens=prefix,
                                prefix_groups=groups or 4, tokenizer=tokenizer),
        rates=[rate], num_requests=max(20, int(rate * args.duration)), seed=args.seed, request_timeout=120.0,
    )
    before = await engine_sums(url)
    result = await run_bench(config)
    await asyncio.sleep(0.5)  # a finished request's metrics can trail its response
    return result.runs[0], engine_means(before, await engine_sums(url))


def knee(rows: list[dict[str, Any]], target: str, factor: float) -> float | None:
    """Highest offered rate the target still served: throughput within 10 % of the
    offered rate (a run's throughput counts its drain, a few % for 20 s runs) and TTFT p90
    under ``factor`` × the lightest rate's (every lower rate too)."""
    best = None
    base = rows[0][target]["ttft_p90"] if rows else None
    for row in rows:
        r = row[target]
        if base is None or r["ttft_p90"] is None or r["served"] < 0.9 * row["rate"] or r["ttft_p90"] > factor * base:
            break
        best = row["rate"]
    return best


def _err(sim: float | None, ref: float | None) -> str:
    if sim is None or not ref:
        return "-"
    return f"{sim / ref - 1:+.0%}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} req/s"


def _ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(workload: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"**{workload}**", "",
             "| offered req/s | served vLLM / sim | TTFT p50 vLLM / sim ms | error | TTFT p90 vLLM / sim | error "
             "| TPOT p50 vLLM / sim ms | error | TPOT p90 vLLM / sim | error "
             "| engine TTFT mean vLLM / sim | error | engine TPOT mean vLLM / sim | error |",
             "|" + " ---: |" * 14]
    for row in rows:
        v, s = row["vllm"], row["sim"]
        lines.append(
            f"| {row['rate']:.1f} | {v['served']:.1f} / {s['served']:.1f} "
            f"| {_ms(v['ttft_p50'])} / {_ms(s['ttft_p50'])} | {_err(s['ttft_p50'], v['ttft_p50'])} "
            f"| {_ms(v['ttft_p90'])} / {_ms(s['ttft_p90'])} | {_err(s['ttft_p90'], v['ttft_p90'])} "
            f"| {_ms(v['tpot_p50'])} / {_ms(s['tpot_p50'])} | {_err(s['tpot_p50'], v['tpot_p50'])} "
            f"| {_ms(v['tpot_p90'])} / {_ms(s['tpot_p90'])} | {_err(s['tpot_p90'], v['tpot_p90'])} "
            f"| {_ms(v['engine_ttft_mean'])} / {_ms(s['engine_ttft_mean'])} "
            f"| {_err(s['engine_ttft_mean'], v['engine_ttft_mean'])} "
            f"| {_ms(v['engine_tpot_mean'], 2)} / {_ms(s['engine_tpot_mean'], 2)} "
            f"| {_err(s['engine_tpot_mean'], v['engine_tpot_mean'])} |")
    return "\n".join(lines)


REFERENCE_CONTEXT = 64
REFERENCE_TOKENS = 32


async def reference_step(url: str) -> float:
    """vLLM's mean decode step, in ms, for one sequence of 64 prompt tokens (median of 3)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        probe = EngineProbe(session, url, MODEL, seed=7)
        times = [await probe.decode(1, REFERENCE_CONTEXT, REFERENCE_TOKENS) for _ in range(3)]
    return sorted(times)[1] * 1000


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (not its children) onto ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


def cpus_of_tree(pid: int) -> str:
    """Each process under ``pid``: its threads' allowed CPUs (to show the pinning took)."""
    out = []
    for p in [pid, *child_pids(pid, recursive=True)]:
        cpus: dict[str, int] = {}
        for status in Path(f"/proc/{p}/task").glob("*/status"):
            with contextlib.suppress(OSError):
                line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list"))
                key = line.split(":", 1)[1].strip()
                cpus[key] = cpus.get(key, 0) + 1
        out.append(f"pid {p}: " + ", ".join(f"{n} on {k}" for k, n in sorted(cpus.items())))
    return "; ".join(out)


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def figures(run: RunResult, engine: dict[str, float | None]) -> dict[str, Any]:
    s = run.summary
    return {**engine, "served": s.request_throughput, "ok": s.ok, "requests": s.requests, "errors": s.errors,
            "ttft_p50": s.ttft_ms.p50, "ttft_p90": s.ttft_ms.p90, "tpot_p50": s.tpot_ms.p50, "tpot_p90": s.tpot_ms.p90,
            "client_lagged": run.client.lagged}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model-dir", default=None, help="a model directory (default: make the tiny model)")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU build caches in 128-token blocks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--loads", default="0.2,0.4,0.6,0.8,1.0,1.2",
                        help="offered rates as fractions of the fitted profile's estimated capacity")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate and target")
    parser.add_argument("--knee-ttft-factor", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--short", action="store_true", help="calibrate and check the fit only (CI)")
    parser.add_argument("--out", default="results/fidelity.json")
    parser.add_argument("--engine-cpu", type=int, default=0 if (os.cpu_count() or 1) > 1 else None,
                        help="the CPU the model computes on alone (vLLM's worker process, the sim-server); the "
                             "client and the rest of vLLM take the others (default 0 where there are two or more)")
    parser.add_argument("--no-pin", dest="engine_cpu", action="store_const", const=None,
                        help="no pinning: vLLM's processes and the client share every CPU")
    args = parser.parse_args()
    if args.engine_cpu is not None:
        # vLLM's CPU build computes on the CPU: a load generator or an API server on its cores
        # slows its steps as load grows, which no GPU engine sees (its client is elsewhere)
        if not os.sched_getaffinity(0) - {args.engine_cpu} or shutil.which("taskset") is None:
            parser.error("--engine-cpu needs another CPU for the client and taskset (util-linux); use --no-pin")

    state = Path(tempfile.mkdtemp(prefix="meshserve-fidelity-"))
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        from ops.tiny_model import make_tiny_model  # needs torch: vLLM's venv has it

        model_dir = make_tiny_model(state / "tiny-llama")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_LOGGING_LEVEL": "WARNING",
           # vLLM's CPU build busy-polls between its processes; sleeping 100 µs instead leaves
           # the client and the sim their share of 2 cores (as the mesh's vLLM worker does)
           "MESHSERVE_VLLM_SPIN_SLEEP_S": "0.0001",
           # pinned below, one compute thread (vLLM's own binding keeps to the CPUs it inherits)
           **({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"} if args.engine_cpu is not None else {})}
    vllm_port, sim_port = free_port(), free_port()
    engine = Proc("vllm", engine_argv(model_dir, vllm_port, args), state, env)
    others = os.sched_getaffinity(0) - {args.engine_cpu}
    if args.engine_cpu is not None:
        os.sched_setaffinity(0, others)  # the client
    sim: Proc | None = None
    vllm_url, sim_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{sim_port}"
    try:
        await wait_ready(vllm_url + "/v1/models", engine, timeout=300)
        if args.engine_cpu is not None:
            # the model's compute alone on the engine's CPU: vLLM's worker process where it has
            # one (its engine core, scheduling and polling it, beside the API server), else
            # the engine core
            tree = child_pids(engine.proc.pid, recursive=True)  # the model may run in a grandchild
            compute = ([p for p in tree if "Worker" in process_name(p)]
                       or [p for p in tree if "EngineCore" in process_name(p)] or tree)
            for p in [engine.proc.pid, *tree]:
                pin_threads(p, {args.engine_cpu} if p in compute else others)
            print(f"vLLM's model on CPU {args.engine_cpu}; the client, its API server and engine core on CPU "
                  f"{','.join(map(str, sorted(others)))}", flush=True)
        print("vLLM's threads by CPU: " + cpus_of_tree(engine.proc.pid), flush=True)
        profile = await calibrate_engine(vllm_url, plan=EnginePlan(), max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens, name="tiny-llama-cpu")
        profile_path = state / "profile.json"
        profile_path.write_text(json.dumps(profile, indent=2))
        cal = profile["calibration"]
        step = profile["step"]
        print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in step.items())
              + f"; fit error median {cal['fit_error_median']:.1%}, worst {cal['fit_error_max']:.1%}", flush=True)
        if not (step["base_s"] > 0 and (step["per_prefill_token_s"] > 0 or step["per_decode_seq_s"] > 0)):
            raise SystemExit("the fitted profile is not sane: no positive step cost")
        if args.short:
            return
        costs = load_profile(profile_path).costs
        # vLLM's speed drifts on a shared machine: a one-sequence decode step, timed before
        # each rate, against the fitted profile's, shows how far it moved since calibration
        reference = costs.decode_tpot(1, REFERENCE_CONTEXT + REFERENCE_TOKENS // 2) * 1000
        sim = Proc("sim-server", sim_argv(profile_path, sim_port, args, profile["memory"]["hbm_bytes"]
                                          // args.block_size), state)
        await wait_ready(sim_url + "/health", sim)
        results: dict[str, Any] = {"profile": profile, "workloads": {}}
        for workload in args.workloads.split(","):
            _, inp, out, _, _ = WORKLOADS[workload]
            # a shared prefix is cached after its first request: each prefills its suffix
            capacity = costs.requests_per_s(float(inp), float(out), batch=args.max_num_seqs)
            rows = []
            for load in (float(x) for x in args.loads.split(",")):
                rate = load * capacity
                row: dict[str, Any] = {"load": load, "rate": rate, "vllm_step_ms": await reference_step(vllm_url)}
                for target, url, tokenizer in (("vllm", vllm_url, str(model_dir)), ("sim", sim_url, "byte")):
                    row[target] = figures(*await run_rate(url, tokenizer, workload, rate, args))
                print(f"{workload} {rate:.1f} req/s: vLLM TTFT p50 {_ms(row['vllm']['ttft_p50'])} ms, sim "
                      f"{_ms(row['sim']['ttft_p50'])} ms; TPOT p50 {_ms(row['vllm']['tpot_p50'])} / "
                      f"{_ms(row['sim']['tpot_p50'])} ms; vLLM's reference step {row['vllm_step_ms']:.2f} ms "
                      f"(calibrated {reference:.2f})", flush=True)
                rows.append(row)
            results["workloads"][workload] = {"capacity_estimate": capacity, "rows": rows,
                                              "knee": {t: knee(rows, t, args.knee_ttft_factor) for t in ("vllm", "sim")}}
        print()
        for workload, w in results["workloads"].items():
            print(table(workload, w["rows"]))
            k = w["knee"]
            peak = {t: max(r[t]["served"] for r in w["rows"]) for t in ("vllm", "sim")}
            steps = [r["vllm_step_ms"] for r in w["rows"]]
            print(f"\nsaturation: vLLM {_rate(k['vllm'])}, sim {_rate(k['sim'])} (profile's estimate "
                  f"{w['capacity_estimate']:.1f} req/s); most served: vLLM {peak['vllm']:.1f} req/s, sim "
                  f"{peak['sim']:.1f} req/s; vLLM's one-sequence decode step {min(steps):.2f}–{max(steps):.2f} ms "
                  f"over the rates, the profile's {reference:.2f} ms\n")
        print(f"rows: {await asyncio.to_thread(write_json, Path(args.out), results)}")
    finally:
        if sim is not None:
            sim.stop()
        engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
