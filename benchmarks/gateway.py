"""The gateway's cost: added latency, and the token rate one gateway process relays.

1. Added latency: TTFT the client sees through the mesh (HTTP → gateway → admission
   path → router/placement → worker → TOKENS → gateway → SSE) minus the worker's own
   TTFT (its receipt of the request → its first token, from the final chunk's timings,
   read off NATS by request id). Sequential requests on an idle mesh, p50/p99.
   The same, over chat completions, for the features that add gateway work (issue 16),
   interleaved in one run so they meet the same machine: plain, tools (the template renders
   them; the output goes through the Hermes parser), a forced tool call (guided decoding,
   the call assembled from the output) and logprobs with ``top_logprobs=5``.
2. Relay throughput: closed-loop streams at 1, 64 and 512 concurrent, long outputs from
   fast sim workers, measured with ``meshserve bench``'s Python API; output tokens/s the
   one gateway delivered over SSE, and the gateway's CPU use; and at 64 streams with
   ``top_logprobs=5`` (each token then carries six candidates).

Everything shares this machine's cores (client, gateway, workers, nats-server), so the
relay figure is a floor for a gateway on its own host.

The added latency is broken down per hop: the gateway's own phases from its
``Server-Timing`` header (parse: body, validation, chat template and tokenizer; hash:
the prompt's block hashes; admission and route: the two NATS round trips; record: the
resume record a resumable request stores first), the worker's own TTFT, and the rest.
``--latency-only`` runs that part alone.

Run: ``.venv/bin/python benchmarks/gateway.py [--requests 200] [--latency-only]``; the request path
alone: ``.venv/bin/python benchmarks/gateway.py --request-path 100,200,400,800 --duration 15``
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from nats.aio.msg import Msg

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, run_bench
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto import TokenChunk, decode

MODEL = "sim-llama-8b"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    import os

    return ticks / os.sysconf("SC_CLK_TCK")


async def _observe_finals(mesh: Mesh) -> tuple[Bus, dict[str, TokenChunk]]:
    """A bus that keeps every request's final chunk (its timings: the worker's own TTFT)."""
    bus = await Bus.open(mesh.settings, "bench-observer", initial_attempts=10)
    finals: dict[str, TokenChunk] = {}

    async def on_chunk(msg: Msg) -> None:
        chunk = decode(msg.data, TokenChunk)
        if chunk.finish_reason is not None:
            finals[chunk.request_id] = chunk

    await bus.nc.subscribe(bus.subjects.tokens_all, cb=on_chunk)
    return bus, finals


async def _ttfts(http: aiohttp.ClientSession, path: str, body: dict[str, object], headers: dict[str, str],
                 not_first: bytes, finals: dict[str, TokenChunk],
                 phases: dict[str, list[float]] | None = None) -> tuple[float, float] | None:
    """(client TTFT, worker TTFT) of one streamed request: the client's first event is the
    first ``data:`` line without ``not_first`` (an empty text, the role delta). ``phases``
    collects the gateway's ``Server-Timing`` (ms per phase before the worker had it)."""
    start = time.perf_counter()
    first = None
    async with http.post(path, json=body, headers=headers) as r:
        request_id = r.headers["X-Request-Id"]
        if phases is not None:
            for part in r.headers.get("Server-Timing", "").split(","):
                name, _, ms = part.strip().partition(";dur=")
                if ms:
                    phases.setdefault(name, []).append(float(ms))
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and not_first not in line:
                first = time.perf_counter() - start
    for _ in range(100):
        if request_id in finals:
            break
        await asyncio.sleep(0.01)
    t = finals[request_id].timings
    if first is None or t is None:
        return None
    return first, t.first_token - t.arrival


async def added_latency(mesh: Mesh, requests: int,
                        phases: dict[str, list[float]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Client and worker TTFT (s) of sequential requests; ``phases`` collects the gateway's
    Server-Timing per request (ms), for the per-hop breakdown."""
    bus, finals = await _observe_finals(mesh)
    client_ttft, worker_ttft = [], []
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "x" * 256, "max_tokens": 4, "stream": True, "ignore_eos": True}
    seen: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for i in range(requests + 10):
            one: dict[str, list[float]] = {}
            ttfts = await _ttfts(http, "/v1/completions", {**body, "seed": i}, headers, b'"text":""', finals, one)
            if i >= 10 and ttfts is not None:  # the first ten warm things up
                client_ttft.append(ttfts[0])
                worker_ttft.append(ttfts[1])
                for name, values in one.items():
                    seen.setdefault(name, []).extend(values)
    await bus.close()
    if phases is not None:
        phases.update(seen)
    return np.array(client_ttft), np.array(worker_ttft)


def breakdown(client: np.ndarray, worker: np.ndarray, phases: dict[str, list[float]]) -> list[tuple[str, np.ndarray]]:
    """Per hop, ms per request: the gateway's phases (Server-Timing), the worker's own TTFT,
    and the rest (HTTP in and out, the router's forward to the worker, the first chunk's
    trip back through NATS, the SSE write)."""
    rows = [(f"gateway: {name}", np.array(values)) for name, values in phases.items() if len(values) == len(client)]
    gateway_ms = np.sum([values for _, values in rows], axis=0) if rows else np.zeros(len(client))
    worker_ms = worker * 1000
    return [*rows, ("worker: receipt → first token", worker_ms),
            ("rest: HTTP, forward to the worker, first chunk back, SSE", client * 1000 - gateway_ms - worker_ms)]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FEATURES: dict[str, dict[str, object]] = {
    "plain": {},
    "tools (auto, parsed)": {"tools": [TOOL]},
    "forced tool call": {"tools": [TOOL], "tool_choice": "required"},
    "logprobs, top 5": {"logprobs": True, "top_logprobs": 5},
}


async def feature_latency(mesh: Mesh, requests: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Client and worker TTFT per feature, chat completions, the features interleaved."""
    bus, finals = await _observe_finals(mesh)
    seen: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in FEATURES}
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for i in range(requests + 10):
            for name, extra in FEATURES.items():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 4,
                        "stream": True, "seed": i, **extra}
                # the first event after the role delta: content, a tool call or logprobs
                ttfts = await _ttfts(http, "/v1/chat/completions", body, headers, b'"role":"assistant"', finals)
                if i >= 10 and ttfts is not None:
                    seen[name][0].append(ttfts[0])
                    seen[name][1].append(ttfts[1])
    await bus.close()
    return {name: (np.array(c), np.array(w)) for name, (c, w) in seen.items()}


async def relay(mesh: Mesh, concurrency: int, duration: float,
                extra_body: dict[str, object] | None = None) -> tuple[float, float, float]:
    gateway = next(p for p in mesh.processes if p.name == "gateway")
    assert gateway.proc is not None
    cpu0, t0 = _cpu_seconds(gateway.proc.pid), time.monotonic()
    config = BenchConfig(
        endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", api="completions", model=MODEL, api_key=mesh.dev_key)],
        workload=WorkloadConfig(kind="random", input_tokens="64", output_tokens="2000"),
        concurrency=[concurrency], duration=duration, num_requests=10**6, request_timeout=120, drain_timeout=30, seed=1,
        extra_body=dict(extra_body or {}),
    )
    result = await run_bench(config)
    cpu = (_cpu_seconds(gateway.proc.pid) - cpu0) / (time.monotonic() - t0)
    run = result.runs[0]
    return run.summary.output_token_throughput, cpu, run.summary.itl_ms.p50 or 0.0


async def request_path(rates: list[float], seconds: float) -> None:
    """Issue 19's request-path throughput: open-loop Poisson arrivals of tiny requests (16
    prompt tokens, 1 output token) through one gateway, one router and one admission, to
    two sim workers at speed 100 (their own TTFT, ~0.1 ms, is left in: it is noise here),
    rate after rate on one mesh; the client's TTFT p50/p99 and each service's CPU share."""
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "p", nats_port=0, http_port=free_port(), model=MODEL, workers=2,
                               speed=100.0, worker_args=["--max-num-seqs", "256"]))
        await mesh.start()
        pids = {p.name: p.proc.pid for p in mesh.processes if p.name in ("gateway", "router", "admission") and p.proc}
        rows = []
        try:
            for rate in rates:
                cpu0, t0 = {n: _cpu_seconds(pid) for n, pid in pids.items()}, time.monotonic()
                config = BenchConfig(
                    endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", api="completions", model=MODEL,
                                              api_key=mesh.dev_key)],
                    workload=WorkloadConfig(kind="random", input_tokens="16", output_tokens="1"),
                    rates=[rate], duration=seconds, request_timeout=30, seed=1,
                )
                run = (await run_bench(config)).runs[0]
                elapsed = time.monotonic() - t0
                cpu = {n: (_cpu_seconds(pid) - cpu0[n]) / elapsed for n, pid in pids.items()}
                rows.append((rate, run, cpu))
        finally:
            mesh.stop()
    print(f"\n### Request path: tiny requests through one gateway, router and admission ({seconds:.0f} s per rate)\n")
    print("| offered req/s | served req/s | errors | TTFT p50 ms | p99 ms | gateway CPU | router CPU | admission CPU "
          "| client lag p99 ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    best = None
    for rate, run, cpu in rows:
        s = run.summary
        p99 = s.ttft_ms.p99 or math.inf
        if p99 <= 5.0:
            best = rate
        print(f"| {rate:g} | {s.request_throughput:.0f} | {sum(s.errors.values())} | {s.ttft_ms.p50 or 0:.2f} | {p99:.2f} "
              f"| {cpu.get('gateway', 0):.0%} | {cpu.get('router', 0):.0%} | {cpu.get('admission', 0):.0%} "
              f"| {run.client.lag_ms.p99:.1f} |")
    print(f"\nhighest rate with TTFT p99 ≤ 5 ms: {best:g} req/s" if best else "\nno rate kept TTFT p99 ≤ 5 ms")


async def main(requests: int, duration: float, latency_only: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # Latency: real-time sim (speed 1) so the worker's TTFT is a realistic few ms.
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "a", nats_port=0, http_port=free_port(), model=MODEL, workers=1, speed=1.0))
        await mesh.start()
        phases: dict[str, list[float]] = {}
        try:
            client, worker = await added_latency(mesh, requests, phases)
        finally:
            mesh.stop()
        added = (client - worker) * 1000
        print(f"### Added latency ({len(added)} sequential requests, 256-token prompts)\n")
        print("| | p50 ms | p90 ms | p99 ms |\n|---|---:|---:|---:|")
        for name, values in (("client TTFT", client * 1000), ("worker's own TTFT", worker * 1000), ("added by the mesh", added)):
            print(f"| {name} | {np.percentile(values, 50):.2f} | {np.percentile(values, 90):.2f} | {np.percentile(values, 99):.2f} |")
        print("\n### Per-hop breakdown of the client TTFT (the same requests)\n")
        print("| hop | p50 ms | p99 ms | mean ms |\n|---|---:|---:|---:|")
        for name, values in breakdown(client, worker, phases):
            print(f"| {name} | {np.percentile(values, 50):.3f} | {np.percentile(values, 99):.3f} | {values.mean():.3f} |")
        if latency_only:
            return

        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "f", nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                               speed=1.0))
        await mesh.start()
        try:
            features = await feature_latency(mesh, requests // 2)
        finally:
            mesh.stop()
        print(f"\n### Added latency per feature ({requests // 2} sequential chat requests each, interleaved)\n")
        print("| request | added p50 ms | p90 ms | p99 ms | worker TTFT p50 ms |\n|---|---:|---:|---:|---:|")
        for name, (client_s, worker_s) in features.items():
            a = (client_s - worker_s) * 1000
            print(f"| {name} | {np.percentile(a, 50):.2f} | {np.percentile(a, 90):.2f} | {np.percentile(a, 99):.2f} "
                  f"| {np.percentile(worker_s * 1000, 50):.2f} |")

        # Relay: fast sim workers (speed 50), large batches, one gateway.
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "b", nats_port=0, http_port=free_port(), model=MODEL, workers=2,
                               speed=50.0, worker_args=["--max-num-seqs", "512", "--num-kv-blocks", "200000"]))
        await mesh.start()
        try:
            print(f"\n### Relay throughput ({duration:.0f} s closed loop per point, 2000-token outputs)\n")
            print("| concurrent streams | output tokens/s | gateway CPU (cores) | ITL p50 ms |\n|---:|---:|---:|---:|")
            for c in (1, 64, 512):
                tps, cpu, itl = await relay(mesh, c, duration)
                print(f"| {c} | {tps:,.0f} | {cpu:.2f} | {itl:.2f} |")
            tps, cpu, itl = await relay(mesh, 64, duration, {"logprobs": 5})
            print(f"| 64, logprobs 5 | {tps:,.0f} | {cpu:.2f} | {itl:.2f} |")
        finally:
            mesh.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--latency-only", action="store_true", help="the added latency and its breakdown alone")
    parser.add_argument("--request-path", default=None, metavar="RATES",
                        help="only the request-path throughput: comma-separated req/s of tiny requests, in turn")
    args = parser.parse_args()
    import uvloop

    if args.request_path:
        uvloop.run(request_path([float(r) for r in args.request_path.split(",")], args.duration))
    else:
        uvloop.run(main(args.requests, args.duration, args.latency_only))
