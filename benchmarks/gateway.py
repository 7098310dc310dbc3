"""The gateway's cost: added latency, and the token rate one gateway process relays.

1. Added latency: TTFT the client sees through the mesh (HTTP → gateway → admission
   path → router/placement → worker → TOKENS → gateway → SSE) minus the worker's own
   TTFT (its receipt of the request → its first token, from the final chunk's timings,
   read off NATS by request id). Sequential requests on an idle mesh, p50/p99.
2. Relay throughput: closed-loop streams at 1, 64 and 512 concurrent, long outputs from
   fast sim workers, measured with ``meshserve bench``'s Python API; output tokens/s the
   one gateway delivered over SSE, and the gateway's CPU use.

Everything shares this machine's cores (client, gateway, workers, nats-server), so the
relay figure is a floor for a gateway on its own host.

Run: ``.venv/bin/python benchmarks/gateway.py [--requests 200]``
"""

from __future__ import annotations

import argparse
import asyncio
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


async def added_latency(mesh: Mesh, requests: int) -> tuple[np.ndarray, np.ndarray]:
    bus = await Bus.open(mesh.settings, "bench-observer", initial_attempts=10)
    finals: dict[str, TokenChunk] = {}

    async def on_chunk(msg: Msg) -> None:
        chunk = decode(msg.data, TokenChunk)
        if chunk.finish_reason is not None:
            finals[chunk.request_id] = chunk

    await bus.nc.subscribe(bus.subjects.tokens_all, cb=on_chunk)
    client_ttft, worker_ttft = [], []
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "x" * 256, "max_tokens": 4, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for i in range(requests + 10):
            start = time.perf_counter()
            first = None
            async with http.post("/v1/completions", json={**body, "seed": i}, headers=headers) as r:
                request_id = r.headers["X-Request-Id"]
                async for line in r.content:
                    if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                        first = time.perf_counter() - start
            for _ in range(100):
                if request_id in finals:
                    break
                await asyncio.sleep(0.01)
            t = finals[request_id].timings
            if i >= 10 and first is not None and t is not None:  # the first ten warm things up
                client_ttft.append(first)
                worker_ttft.append(t.first_token - t.arrival)
    await bus.close()
    return np.array(client_ttft), np.array(worker_ttft)


async def relay(mesh: Mesh, concurrency: int, duration: float) -> tuple[float, float, float]:
    gateway = next(p for p in mesh.processes if p.name == "gateway")
    assert gateway.proc is not None
    cpu0, t0 = _cpu_seconds(gateway.proc.pid), time.monotonic()
    config = BenchConfig(
        endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", api="completions", model=MODEL, api_key=mesh.dev_key)],
        workload=WorkloadConfig(kind="random", input_tokens="64", output_tokens="2000"),
        concurrency=[concurrency], duration=duration, num_requests=10**6, request_timeout=120, drain_timeout=30, seed=1,
    )
    result = await run_bench(config)
    cpu = (_cpu_seconds(gateway.proc.pid) - cpu0) / (time.monotonic() - t0)
    run = result.runs[0]
    return run.summary.output_token_throughput, cpu, run.summary.itl_ms.p50 or 0.0


async def main(requests: int, duration: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # Latency: real-time sim (speed 1) so the worker's TTFT is a realistic few ms.
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "a", nats_port=0, http_port=free_port(), model=MODEL, workers=1, speed=1.0))
        await mesh.start()
        try:
            client, worker = await added_latency(mesh, requests)
        finally:
            mesh.stop()
        added = (client - worker) * 1000
        print(f"### Added latency ({len(added)} sequential requests, 256-token prompts)\n")
        print("| | p50 ms | p90 ms | p99 ms |\n|---|---:|---:|---:|")
        for name, values in (("client TTFT", client * 1000), ("worker's own TTFT", worker * 1000), ("added by the mesh", added)):
            print(f"| {name} | {np.percentile(values, 50):.2f} | {np.percentile(values, 90):.2f} | {np.percentile(values, 99):.2f} |")

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
        finally:
            mesh.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    args = parser.parse_args()
    import uvloop

    uvloop.run(main(args.requests, args.duration))
