"""The floor under the mesh's added latency on this machine: what NATS hops between
Python processes cost when the handlers do nothing.

The mesh's request path is three processes deep before the worker starts (gateway →
admission → gateway → router → worker), and the first chunk comes back one more hop.
This measures the same shapes with raw nats-py (uvloop) processes whose handlers only
answer or forward the bytes they got, on a private nats-server, sequential requests:

- ``round trip``: requester → responder → requester (another process), the cost of one
  request-reply such as the gateway's to admission;
- ``two round trips``: two of those in sequence, to two processes (admission, then router);
- ``forwarded``: requester → forwarder → responder, which answers the requester directly
  (the router's forward of a request to a worker, as far as the worker's receipt);
- ``mesh shape``: a round trip, then a forwarded request (the mesh's path before the
  worker has the request, with no work in any hop);
- ``HTTP/SSE``: an aiohttp client POSTs a 300-byte JSON body to an aiohttp server in
  another process, which reads it and answers with an SSE stream; the time to the first
  event (the client's and the gateway's HTTP ends, with no work between them);
- ``one way``: a message published by one process until another receives it (the first
  chunk's trip from the worker to the gateway), from the time each side stamps.

A payload of 1 KiB stands for a request with its prompt's token ids. The figures are the
least the mesh can add here: what the real path costs above them is its own work.

Run: ``.venv/bin/python benchmarks/hop_floor.py [--requests 3000]``
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import nats
import numpy as np
import uvloop
from aiohttp import web
from nats.aio.msg import Msg

from ops.natsserver import NatsServer, free_port

PAYLOAD = b"x" * 1024


async def serve(role: str, url: str, subject: str, forward_to: str) -> None:
    """One process: ``echo`` answers on ``subject``; ``forward`` passes each request on
    to ``forward_to`` with the original reply subject (its answerer replies directly);
    ``stamp`` publishes its wall clock on ``forward_to`` for each request; ``http`` serves
    SSE on port ``subject``."""
    if role == "http":
        await serve_http(int(subject))
        return
    nc = await nats.connect(url)

    async def echo(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    async def forward(msg: Msg) -> None:
        await nc.publish(forward_to, msg.data, reply=msg.reply)

    async def stamp(msg: Msg) -> None:
        await nc.publish(forward_to, repr(time.time()).encode())

    await nc.subscribe(subject, cb={"echo": echo, "forward": forward, "stamp": stamp}[role])
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_http(port: int) -> None:
    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b'data: {"text": "first"}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/sse", sse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure_http(port: int, requests: int, gap_s: float = 0.0) -> np.ndarray:
    body = {"model": "m", "prompt": "x" * 256, "max_tokens": 4, "stream": True}
    times = []
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        for i in range(requests + 100):
            if gap_s:
                await asyncio.sleep(gap_s)
            start = time.perf_counter()
            async with http.post("/sse", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        if i >= 100:
                            times.append((time.perf_counter() - start) * 1000)
                        break
    return np.array(times)


async def measure_one_way(url: str, requests: int) -> np.ndarray:
    """``stamp`` answers each ping by publishing its clock: receipt time minus that."""
    nc = await nats.connect(url)
    got: asyncio.Queue[float] = asyncio.Queue()

    async def on_stamp(msg: Msg) -> None:
        got.put_nowait((time.time() - float(msg.data)) * 1000)

    await nc.subscribe("stamped", cb=on_stamp)
    await nc.flush()
    times = []
    for i in range(requests + 100):
        await nc.publish("stamp", b"")
        ms = await asyncio.wait_for(got.get(), 5.0)
        if i >= 100:
            times.append(ms)
    await nc.close()
    return np.array(times)


def _spawn(url: str, role: str, subject: str, forward_to: str = "") -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", role, url, subject, forward_to],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"{role} process did not start")
    return proc


async def measure(url: str, requests: int, gap_s: float = 0.0) -> dict[str, np.ndarray]:
    nc = await nats.connect(url)
    shapes = {
        "round trip": ("admission",),
        "two round trips": ("admission", "router"),
        "forwarded": ("forward",),
        "mesh shape": ("admission", "forward"),
    }
    results: dict[str, list[float]] = {name: [] for name in shapes}
    for i in range(requests + 100):
        for name, hops in shapes.items():  # interleaved: each shape meets the same machine
            if gap_s:  # every process idle first, as between a mesh's requests at a low rate
                await asyncio.sleep(gap_s)
            start = time.perf_counter()
            for subject in hops:
                await nc.request(subject, PAYLOAD, timeout=5.0)
            if i >= 100:  # the first hundred warm up
                results[name].append((time.perf_counter() - start) * 1000)
    await nc.close()
    return {name: np.array(values) for name, values in results.items()}


async def main(requests: int, gap_s: float = 0.0) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats").start()
        procs = []
        try:
            port = free_port()
            procs = [_spawn(server.url, "echo", "admission"), _spawn(server.url, "echo", "router"),
                     _spawn(server.url, "echo", "worker"), _spawn(server.url, "forward", "forward", "worker"),
                     _spawn(server.url, "stamp", "stamp", "stamped"), _spawn("", "http", str(port))]
            results = await measure(server.url, requests, gap_s)
            results["one way"] = await measure_one_way(server.url, requests)
            results["HTTP/SSE"] = await measure_http(port, requests, gap_s)
        finally:
            for proc in procs:
                proc.kill()
            server.stop()
    gap = f", {gap_s * 1000:g} ms idle before each (one way: none)" if gap_s else ""
    print(f"### NATS hops between Python processes, handlers that do nothing ({requests} sequential each{gap})\n")
    print("| shape | p50 ms | p90 ms | p99 ms |\n|---|---:|---:|---:|")
    for name, values in results.items():
        print(f"| {name} | {np.percentile(values, 50):.3f} | {np.percentile(values, 90):.3f} "
              f"| {np.percentile(values, 99):.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        uvloop.run(serve(*sys.argv[2:6]))
    else:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--requests", type=int, default=3000)
        parser.add_argument("--gap-ms", type=float, default=0.0,
                            help="idle time before each measured request (0: back to back)")
        args = parser.parse_args()
        uvloop.run(main(args.requests, args.gap_ms / 1000))
