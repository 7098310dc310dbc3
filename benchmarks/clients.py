"""Independent measuring clients (issue 18, part 5): ``meshserve bench``, guidellm and
aiperf against the same endpoint at the same fixed rate; their TTFT and TPOT medians must
agree within 5 %.

One mesh like ``make up``'s (nats-server, ``--workers`` sim workers at ``--speed``, gateway,
router, admission, metering; a premium development key), warmed up, then each client in
turn for ``--duration`` seconds of Poisson arrivals at ``--rate``: chat completions,
streamed, ``--prompt-tokens`` synthetic prompt tokens and exactly ``--output-tokens``
output tokens (ignore_eos), with the tokenizer ``meshserve tokenizer export`` writes.
The order is repeated backwards (``--rounds 2``: A B C C B A) so a drift of the shared
machine weighs on every client alike; each client's figure is the median of its rounds.

Definitions, as each tool documents them: TTFT is request sent → first token. TPOT is
(E2E − TTFT) / (output tokens − 1) in meshserve bench (vLLM's) and aiperf (its
``inter_token_latency``); guidellm's ``inter_token_latency_ms`` is the same quantity
(its ``time_per_output_token_ms`` divides E2E by all output tokens, TTFT included, and
is not compared).

    make bench-tools                                   # guidellm and aiperf in .venv-tools/
    .venv/bin/python benchmarks/clients.py             # rate 4, 60 s per client and round
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, run_bench
from ops.cli import main as cli_main
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig

ROOT = Path(__file__).resolve().parent.parent
TOOLS_VENV = ROOT / ".venv-tools"
MODEL = "sim-llama-8b"
CLIENTS = ("meshserve", "guidellm", "aiperf")


def find_tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(TOOLS_VENV / name / "bin"))


async def run_meshserve(mesh: Mesh, args: argparse.Namespace, out: Path) -> dict[str, float]:
    config = BenchConfig(
        endpoints=[EndpointConfig(mesh.gateway_url + "/v1", label="meshserve", api="chat", model=MODEL,
                                  api_key=mesh.dev_key)],
        workload=WorkloadConfig(kind="random", input_tokens=str(args.prompt_tokens),
                                output_tokens=str(args.output_tokens)),
        rates=[args.rate], duration=args.duration, num_requests=None, seed=args.seed, label="clients",
    )
    result = await run_bench(config)
    s = result.runs[0].summary
    return {"ttft_ms": s.ttft_ms.p50 or 0.0, "tpot_ms": s.tpot_ms.p50 or 0.0, "requests": float(s.ok),
            "errors": float(sum(s.errors.values()))}


def run_guidellm(mesh: Mesh, args: argparse.Namespace, tokenizer: Path, out: Path) -> dict[str, float]:
    tool = find_tool("guidellm")
    assert tool is not None
    path = out / "guidellm.json"
    _run([tool, "run",
          "--backend", f"kind=openai_http,target={mesh.gateway_url},model={MODEL},api_key={mesh.dev_key}",
          "--profile", f"kind=poisson,rate={args.rate}",
          "--constraint", f"kind=max_duration,seconds={args.duration:g}",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
          "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
          "--seed", f"kind=static,value={args.seed}",
          "--output", f"kind=json,path={path}", "--disable-console-interactive"],
         {**os.environ, "HF_HUB_OFFLINE": "1"}, out)
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]
    return {"ttft_ms": _median(metrics["time_to_first_token_ms"]), "tpot_ms": _median(metrics["inter_token_latency_ms"]),
            "requests": float(totals["successful"]), "errors": float(totals["errored"])}


def run_aiperf(mesh: Mesh, args: argparse.Namespace, tokenizer: Path, out: Path) -> dict[str, float]:
    tool = find_tool("aiperf")
    assert tool is not None
    artifacts = out / "aiperf"
    _run([tool, "profile", "--model", MODEL, "--url", mesh.gateway_url, "--endpoint-type", "chat", "--streaming",
          "--api-key", mesh.dev_key, "--tokenizer", str(tokenizer), "--isl", str(args.prompt_tokens),
          "--osl", str(args.output_tokens), "--extra-inputs", "ignore_eos:true", "--request-rate", str(args.rate),
          "--arrival-pattern", "poisson", "--benchmark-duration", f"{args.duration:g}",
          # aiperf cycles through 100 prompts by default: past them every prompt is a cache
          # hit (a first run measured TTFT 17 ms against the others' 36 with 60 % of the
          # prompt tokens cached); as many distinct prompts as requests, as the others send
          "--num-dataset-entries", str(int(args.rate * args.duration * 1.5) + 100), "--random-seed", str(args.seed),
          "--artifact-dir", str(artifacts), "--ui-type", "none"], dict(os.environ), out)
    result = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    return {"ttft_ms": float(result["time_to_first_token"]["p50"]),
            "tpot_ms": float(result["inter_token_latency"]["p50"]),
            "requests": float(result["request_count"]["avg"]), "errors": float(len(result["error_summary"]))}


def _median(metric: dict[str, Any]) -> float:
    """guidellm's distribution summary of the successful requests."""
    successful = metric.get("successful", metric)
    return float(successful["median"])


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-2000:]}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s, Poisson")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per client and round")
    ap.add_argument("--rounds", type=int, default=2, help="A B C, then C B A, ...")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--speed", type=float, default=1.0, help="sim speed (1.0: real time)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    args = ap.parse_args()
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if bad := [c for c in clients if c not in CLIENTS]:
        ap.error(f"unknown client(s) {', '.join(bad)}; choose from {', '.join(CLIENTS)}")
    if missing := [c for c in clients if c != "meshserve" and find_tool(c) is None]:
        ap.error(f"{', '.join(missing)} not installed: run `make bench-tools`")
    state = Path(tempfile.mkdtemp(prefix="meshserve-clients-"))
    mesh = Mesh(MeshConfig(state_dir=state / "mesh", nats_port=0, http_port=free_port(), model=MODEL, workers=args.workers,
                           speed=args.speed))
    await mesh.start(timeout=120)
    results: dict[str, list[dict[str, float]]] = {c: [] for c in clients}
    try:
        tokenizer = state / "tokenizer"
        code = await asyncio.to_thread(cli_main, ["tokenizer", "export", str(tokenizer), "--model", MODEL,
                                                  "--nats-url", mesh.nats_url])
        if code != 0:
            raise RuntimeError("meshserve tokenizer export failed")
        # warm-up: the first requests pay for connections and caches, in no client's figures
        warm = argparse.Namespace(**{**vars(args), "duration": 5.0, "seed": args.seed + 999})
        await run_meshserve(mesh, warm, state)
        for r in range(args.rounds):
            for client in clients if r % 2 == 0 else list(reversed(clients)):
                out = state / f"{client}-{r}"
                out.mkdir()
                # a seed per run: a prompt the mesh has seen is a cache hit, and a client
                # repeating the last round's prompts measured half the TTFT
                run = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * r + 100 * CLIENTS.index(client)})
                if client == "meshserve":
                    res = await run_meshserve(mesh, run, out)
                elif client == "guidellm":
                    res = await asyncio.to_thread(run_guidellm, mesh, run, tokenizer, out)
                else:
                    res = await asyncio.to_thread(run_aiperf, mesh, run, tokenizer, out)
                results[client].append(res)
                print(f"round {r + 1} {client}: TTFT p50 {res['ttft_ms']:.2f} ms, TPOT p50 {res['tpot_ms']:.3f} ms, "
                      f"{res['requests']:.0f} requests, {res['errors']:.0f} errors", flush=True)
    finally:
        mesh.stop(timeout=30)
    ref = {k: statistics.median(r[k] for r in results[clients[0]]) for k in ("ttft_ms", "tpot_ms")}
    print(f"\nrate {args.rate:g}/s Poisson, {args.prompt_tokens} prompt + {args.output_tokens} output tokens, chat, "
          f"streamed; {args.workers} sim workers at speed {args.speed:g}; {args.duration:g} s per client and round, "
          f"{args.rounds} rounds; medians of the rounds, and the ratio to {clients[0]}'s\n")
    print("| client | TTFT p50 ms | ratio | TPOT p50 ms | ratio | requests | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    worst = 0.0
    for client in clients:
        med = {k: statistics.median(r[k] for r in results[client]) for k in ("ttft_ms", "tpot_ms", "requests")}
        errors = sum(r["errors"] for r in results[client])
        rt, rp = med["ttft_ms"] / ref["ttft_ms"], med["tpot_ms"] / ref["tpot_ms"]
        worst = max(worst, abs(rt - 1), abs(rp - 1))
        print(f"| {client} | {med['ttft_ms']:.2f} | {rt:.3f} | {med['tpot_ms']:.3f} | {rp:.3f} | "
              f"{med['requests']:.0f} | {errors:.0f} |")
    print(f"\nlargest disagreement: {worst:.1%} (target: within 5 %)")
    if worst > 0.05:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
