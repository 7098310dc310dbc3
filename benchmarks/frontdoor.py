"""The front door side by side (issue 18, part 3): what meshserve's gateway, vllm-router as a
plain proxy and LiteLLM's proxy add on top of the same engine, in one run.

- **direct**: a ``meshserve sim-server`` (the sim engine behind vLLM's HTTP surface), called
  straight: the baseline every other path is set against.
- **vllm-router**: the same sim-server behind vllm-router (``round_robin`` over one
  backend: a plain proxy), retries off.
- **litellm**: the same sim-server behind LiteLLM's proxy (an ``openai/`` model entry, no
  database).
- **meshserve**: the whole mesh (gateway, admission, router, one sim worker with the same
  engine, profile and speed; NATS between them), called with a key of the ``batch`` tier
  (``--meshserve-tier``): its 10 s TTFT SLO admits everything the proxies pass on, so
  every path serves the same requests. With the development key (premium, 1 s) admission
  refuses requests whose predicted TTFT passes 1 s, which the closed loop's bursts make.

Added latency = TTFT through the path − TTFT direct, as medians and 99th percentiles of
streamed completions at 1 (sequential) and 64 concurrent streams, every path measured
in turn within each round so they meet the same machine. The 64 streams ask for outputs
of 128-384 tokens (uniform), so the closed loop is bound by decoding 64 streams at once
and few prompts queue behind another. With short outputs (16 tokens, the first version)
it saturated the engine's prefill: each path's TTFT was then its queue (direct 632 ms at
the median; a proxy that holds requests back reads faster than the engine it fronts), and
meshserve's admission refused what would miss the development key's SLO. With outputs all
of one length the 64 streams end in the same step and arrive again together: 64 prompts
at once, up to 1.2 s of queued prefill each round. Requests that failed are counted per
path.

A closed loop cannot tell a proxy's cost from a slower loop (a path that adds time lowers
the request rate, the engine's queue shortens, and its TTFT can read under direct's), so a
second table takes it request by request: the client's TTFT less the engine's own (its
receipt of the request → its first token), matched by the response id (the sim-server's
``--request-log``; for meshserve, its worker's final chunk on the bus). Direct's figure is
the client's and the sim-server's HTTP; a path's added cost is its figure less direct's.

Relay: closed-loop streams of
long outputs from a fast sim (speed 50) through each path: output tokens/s delivered, and
the proxy process's CPU per 1,000 tokens (meshserve: the gateway, the only process on the
token path besides NATS).

Everything shares this machine's cores (client, proxies, engines), so absolute figures are
a floor; the comparison is what matters.

    make peers                                                    # vllm-router and LiteLLM
    .venv/bin/python benchmarks/frontdoor.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from gateway import Observer, _cpu_seconds

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, run_bench
from ops.keys import create_key
from ops.natsserver import free_port
from ops.processes import child_pids
from ops.simserver.app import RequestLogLine
from ops.up import Mesh, MeshConfig
from services.gateway.openai_api import completion_id

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".venv-tools"
MODEL = "sim-llama-8b"
PATHS = ("direct", "vllm-router", "litellm", "meshserve")
LITELLM_KEY = "sk-meshserve-frontdoor"  # LiteLLM refuses to start without a master key


class Proc:
    def __init__(self, name: str, argv: list[str], state: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        log = (state / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def cpu(self) -> float:
        """CPU seconds of the process and its children (LiteLLM runs uvicorn workers)."""
        total = _cpu_seconds(self.proc.pid)
        for pid in child_pids(self.proc.pid):
            try:
                total += _cpu_seconds(pid)
            except (OSError, ValueError):
                pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def wait_ready(url: str, proc: Proc, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}); see its log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not ready at {url} after {timeout:.0f} s")
            await asyncio.sleep(0.3)


class Fleet:
    """One sim-server and the proxies in front of it; the mesh beside them."""

    def __init__(self, speed: float, state: Path, tier: str) -> None:
        self.speed, self.state, self.tier = speed, state, tier
        self.procs: list[Proc] = []
        self.urls: dict[str, str] = {}
        self.cpu_of: dict[str, Proc] = {}
        self.mesh: Mesh | None = None
        self.observer: Observer | None = None  # the mesh worker's final chunks: its own timings
        self.request_log = state / "sim-server-requests.jsonl"
        self.key = "unused"

    async def start(self, paths: list[str]) -> None:
        port = free_port()
        sim = Proc("sim-server", [sys.executable, "-m", "ops.cli", "sim-server", "--port", str(port), "--model", MODEL,
                                  "--speed", str(self.speed), "--max-num-seqs", "512",
                                  "--request-log", str(self.request_log)], self.state)
        self.procs.append(sim)
        backend = f"http://127.0.0.1:{port}"
        await wait_ready(backend + "/health", sim)
        self.urls["direct"] = backend
        if "vllm-router" in paths:
            rport = free_port()
            router = Proc("vllm-router", [str(TOOLS / "peers/bin/vllm-router"), "--host", "127.0.0.1", "--port",
                                          str(rport), "--worker-urls", backend, "--policy", "round_robin",
                                          "--worker-startup-check-interval", "1", "--disable-retries",
                                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                          "--log-level", "warning"], self.state)
            self.procs.append(router)
            self.urls["vllm-router"] = f"http://127.0.0.1:{rport}"
            self.cpu_of["vllm-router"] = router
            await wait_ready(self.urls["vllm-router"] + "/v1/models", router)
        if "litellm" in paths:
            lport = free_port()
            config = self.state / "litellm.yaml"
            config.write_text(
                "model_list:\n"
                f"  - model_name: {MODEL}\n"
                "    litellm_params:\n"
                f"      model: openai/{MODEL}\n"
                f"      api_base: {backend}/v1\n"
                "      api_key: unused\n"
                "litellm_settings:\n"
                "  drop_params: false\n"
                "general_settings:\n"
                f"  master_key: {LITELLM_KEY}\n"
            )
            env = {**os.environ, "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true"}
            lite = Proc("litellm", [str(TOOLS / "litellm/bin/litellm"), "--config", str(config), "--host", "127.0.0.1",
                                    "--port", str(lport), "--num_workers", "1"], self.state, env)
            self.procs.append(lite)
            self.urls["litellm"] = f"http://127.0.0.1:{lport}"
            self.cpu_of["litellm"] = lite
            await wait_ready(self.urls["litellm"] + "/health/liveliness", lite)
        if "meshserve" in paths:
            self.mesh = Mesh(MeshConfig(state_dir=self.state / "mesh", nats_port=0, http_port=free_port(), model=MODEL,
                                        workers=1, speed=self.speed, worker_args=["--max-num-seqs", "512"]))
            await self.mesh.start(timeout=120)
            self.urls["meshserve"] = self.mesh.gateway_url
            self.key = self.mesh.dev_key
            if self.tier != "premium":  # the development key's tier
                bus = await Bus.open(self.mesh.settings, "frontdoor-keys", initial_attempts=10)
                try:
                    self.key, _ = await create_key(bus, org="frontdoor", tier=self.tier, name="frontdoor")
                finally:
                    await bus.close()
            self.observer = await Observer.open(self.mesh)

    def engine_ttfts_ms(self, path: str) -> dict[str, float]:
        """The engine's own TTFT (its receipt → its first token) of every request it served
        on ``path`` so far, by the response id the client saw."""
        if path == "meshserve":
            assert self.observer is not None
            return {completion_id(rid): (c.timings.first_token - c.timings.arrival) * 1000
                    for rid, c in self.observer.finals.items() if c.timings and c.timings.first_token}
        lines = (msgspec.json.decode(line, type=RequestLogLine) for line in self.request_log.read_bytes().splitlines())
        return {e.id: (e.first_token - e.arrival) * 1000 for e in lines if e.first_token}

    def gateway_cpu(self) -> float:
        assert self.mesh is not None
        gw = next(p for p in self.mesh.processes if p.name == "gateway")
        assert gw.proc is not None
        return _cpu_seconds(gw.proc.pid)

    def cpu(self, path: str) -> float | None:
        if path == "meshserve":
            return self.gateway_cpu()
        proc = self.cpu_of.get(path)
        return proc.cpu() if proc is not None else None

    async def stop(self) -> None:
        if self.observer is not None:
            await self.observer.bus.close()
        if self.mesh is not None:
            self.mesh.stop(timeout=30)
        for p in reversed(self.procs):
            p.stop()


def endpoint(fleet: Fleet, path: str) -> EndpointConfig:
    key = {"meshserve": fleet.key, "litellm": LITELLM_KEY}.get(path, "unused")
    return EndpointConfig(fleet.urls[path] + "/v1", label=path, api="completions", model=MODEL, api_key=key)


async def ttfts(fleet: Fleet, path: str, concurrency: int, requests: int, seed: int,
                output_tokens: str) -> tuple[list[tuple[float, str | None]], int]:
    """TTFTs (ms, with each response's id) of ``requests`` streamed completions at
    ``concurrency`` (closed loop), and how many failed."""
    config = BenchConfig(endpoints=[endpoint(fleet, path)],
                         workload=WorkloadConfig(kind="random", input_tokens="256", output_tokens=output_tokens),
                         concurrency=[concurrency], num_requests=requests, seed=seed, request_timeout=60)
    result = await run_bench(config)
    run = result.runs[0]
    return ([(r.ttft_s * 1000, r.response_id) for r in run.requests if r.ttft_s is not None],
            sum(run.summary.errors.values()))


def pct(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(int(q * len(ranked)), len(ranked) - 1)]


async def latency(fleet: Fleet, paths: list[str], concurrency: int, requests: int, rounds: int,
                  output_tokens: str, base_seed: int) -> tuple[dict[str, list[tuple[float, str | None]]], dict[str, int]]:
    out: dict[str, list[tuple[float, str | None]]] = {p: [] for p in paths}
    failed = dict.fromkeys(paths, 0)
    for r in range(rounds):
        for path in paths if r % 2 == 0 else list(reversed(paths)):
            # Prompts of their own for each path and round: the proxies share one sim-server,
            # whose prefix cache would otherwise serve every path after the first from cache.
            seed = base_seed * 100_000 + 1000 * r + PATHS.index(path)
            got, errors = await ttfts(fleet, path, concurrency, requests, seed, output_tokens)
            out[path].extend(got)
            failed[path] += errors
    return out, failed


async def relay(fleet: Fleet, path: str, concurrency: int, duration: float) -> tuple[float, float | None, str]:
    cpu0 = fleet.cpu(path)
    config = BenchConfig(endpoints=[endpoint(fleet, path)],
                         workload=WorkloadConfig(kind="random", input_tokens="64", output_tokens="2000"),
                         concurrency=[concurrency], duration=duration, num_requests=None, request_timeout=120,
                         drain_timeout=30, seed=1)
    result = await run_bench(config)
    cpu1 = fleet.cpu(path)
    run = result.runs[0]
    summary = run.summary
    tokens = summary.output_token_throughput
    outcome = f"{summary.ok} ok" + "".join(f", {n} {code}" for code, n in sorted(summary.errors.items()))
    # The proxy's CPU over every token it relayed in the window, the drain's included
    relayed = sum(sum(r.chunk_tokens) for r in run.requests)
    per_k = None
    if cpu0 is not None and cpu1 is not None and relayed:
        per_k = (cpu1 - cpu0) / (relayed / 1000)
    return tokens, per_k, outcome


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--requests", type=int, default=100, help="sequential requests per path and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--relay-streams", type=int, default=256)
    ap.add_argument("--relay-duration", type=float, default=20.0)
    ap.add_argument("--relay-only", action="store_true", help="the relay alone (no latency rounds)")
    ap.add_argument("--seed", type=int, default=0, help="draws another set of prompts (each path and round has its own)")
    ap.add_argument("--meshserve-tier", default="batch",
                    help="admission tier of meshserve's key (premium: the development key's)")
    ap.add_argument("--streams-output-tokens", default="uniform:128:384",
                    help="output tokens of each request at 64 streams, a distribution as for meshserve bench "
                         "(1 stream: 16)")
    args = ap.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if bad := [p for p in paths if p not in PATHS]:
        ap.error(f"unknown path(s) {', '.join(bad)}; choose from {', '.join(PATHS)}")
    if "direct" not in paths:
        paths.insert(0, "direct")
    for p, binary in (("vllm-router", TOOLS / "peers/bin/vllm-router"), ("litellm", TOOLS / "litellm/bin/litellm")):
        if p in paths and not binary.exists():
            ap.error(f"{binary} not found: run `make peers`")
    state = Path(tempfile.mkdtemp(prefix="meshserve-frontdoor-"))
    rows: dict[str, dict[str, Any]] = {p: {} for p in paths}
    if not args.relay_only:
        fleet = Fleet(1.0, state / "latency", args.meshserve_tier)
        (state / "latency").mkdir()
        try:
            await fleet.start(paths)
            for concurrency, n, out_tokens in ((1, args.requests, "16"), (64, args.requests * 4, args.streams_output_tokens)):
                # Prompts of their own for each concurrency and for the warm-ups: with shared
                # seeds a measured round's first prompts were in the sim-server's prefix cache.
                seed = args.seed * 1000 + concurrency
                await latency(fleet, paths, concurrency, 20 if concurrency == 1 else 64, 1, out_tokens,
                              base_seed=seed + 500)
                got, failed = await latency(fleet, paths, concurrency, n, args.rounds, out_tokens, base_seed=seed)
                ttft = {p: [t for t, _ in got[p]] for p in paths}
                base50, base99 = pct(ttft["direct"], 0.5), pct(ttft["direct"], 0.99)
                for p in paths:
                    # Request by request: the client's TTFT less the engine's own, for the
                    # requests whose id the engine's record names (a proxy may rename them).
                    engine = fleet.engine_ttfts_ms(p)
                    overhead = [t - engine[rid] for t, rid in got[p] if rid is not None and rid in engine]
                    rows[p][f"c{concurrency}"] = (pct(ttft[p], 0.5) - base50, pct(ttft[p], 0.99) - base99,
                                                  statistics.median(ttft[p]), failed[p])
                    rows[p][f"o{concurrency}"] = overhead, len(got[p])
        finally:
            await fleet.stop()
    fast = Fleet(50.0, state / "relay", args.meshserve_tier)
    (state / "relay").mkdir()
    try:
        await fast.start(paths)
        for p in paths:
            rows[p]["relay"] = await relay(fast, p, args.relay_streams, args.relay_duration)
    finally:
        await fast.stop()
    if args.relay_only:
        print(f"\nrelay: {args.relay_streams} closed-loop streams of 2000-token outputs, sim at speed 50\n")
        print("| path | relay tokens/s | relay streams | proxy CPU s per 1k tokens |\n| --- | ---: | --- | ---: |")
        for p in paths:
            tokens, per_k, outcome = rows[p]["relay"]
            print(f"| {p} | {tokens:,.0f} | {outcome} | {'—' if per_k is None else f'{per_k:.4f}'} |")
        return
    print("\nadded latency = TTFT through the path − TTFT direct (ms; p50 of each minus p50 direct, p99 likewise; "
          f"64 streams of {args.streams_output_tokens} output tokens); "
          f"relay: {args.relay_streams} closed-loop streams of 2000-token outputs, sim at speed 50\n")
    print("| path | added p50 ms (1 stream) | added p99 ms (1) | added p50 ms (64 streams) | added p99 ms (64) "
          "| failed (1 / 64) | relay tokens/s | relay streams | proxy CPU s per 1k tokens |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |")
    for p in paths:
        c1, c64 = rows[p]["c1"], rows[p]["c64"]
        tokens, per_k, outcome = rows[p]["relay"]
        print(f"| {p} | {c1[0]:.2f} | {c1[1]:.2f} | {c64[0]:.2f} | {c64[1]:.2f} | {c1[3]} / {c64[3]} | {tokens:,.0f} "
              f"| {outcome} | {'—' if per_k is None else f'{per_k:.4f}'} |")
    print(f"\ndirect TTFT p50: {rows['direct']['c1'][2]:.2f} ms (1 stream), {rows['direct']['c64'][2]:.2f} ms (64)")
    print("\nrequest by request: the client's TTFT − the engine's own (its receipt → its first token), ms; "
          "added = a path's less direct's (the client's and the sim-server's HTTP)\n")
    print("| path | p50 (1 stream) | p99 (1) | added p50 (1) | p50 (64 streams) | p99 (64) | added p50 (64) "
          "| added p99 (64) | requests matched (1 / 64) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for p in paths:
        cells: list[str] = []
        for c in (1, 64):
            overhead, _ = rows[p][f"o{c}"]
            base, _ = rows["direct"][f"o{c}"]
            if not overhead or not base:
                cells += ["—"] * (3 if c == 1 else 4)
                continue
            cells += [f"{pct(overhead, 0.5):.2f}", f"{pct(overhead, 0.99):.2f}",
                         f"{pct(overhead, 0.5) - pct(base, 0.5):.2f}"]
            if c == 64:
                cells.append(f"{pct(overhead, 0.99) - pct(base, 0.99):.2f}")
        matched = " / ".join(f"{len(rows[p][f'o{c}'][0])} of {rows[p][f'o{c}'][1]}" for c in (1, 64))
        print(f"| {p} | {' | '.join(cells)} | {matched} |")


if __name__ == "__main__":
    asyncio.run(main())
