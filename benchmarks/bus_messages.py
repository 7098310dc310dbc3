"""Messages on the bus per request: what one streamed completion costs NATS, subject by subject.

Issue 19's request path spends most of its CPU in the event loop and socket writes, not in
any one function: every message is a write, a server route and a wake-up somewhere. This
starts a mesh as ``meshserve up`` does (one sim worker at speed 100, so a request takes
milliseconds), warms it, then listens on ``>`` (every subject; JetStream deliveries to
a consumer show under the stream's subject) while it sends ``--requests`` streamed
completions, ``--concurrency`` at a time (1: sequential), and prints per request how many
messages each subject family carried, their mean size and the bytes per request.
Periodic traffic (gauges, heartbeats) shows too, divided over the requests of the
window: a longer window between requests makes it larger.

``--gauge-cost`` prints instead what one gauge costs each service that reads it (the
router, admission, the autoscaler): msgspec's decode and ``FleetView.apply_gauge``, for a
gauge naming few and many arrivals.

Run: ``.venv/bin/python benchmarks/bus_messages.py [--requests 100] [--concurrency 1] [--gauge-cost]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec
import nats
from nats.aio.msg import Msg

from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto.workers import WorkerGauge, WorkerInfo
from services.common.fleet import FleetView

MODEL = "sim-llama-8b"


def family(subject: str) -> str:
    """The subject with its per-request and per-process tokens (ids, sequence numbers,
    inboxes) folded into ``#``, so that one family counts all its instances."""
    return ".".join("#" if any(c.isdigit() for c in part) or len(part) > 16 else part for part in subject.split("."))


async def run(requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "m", nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                               speed=100.0))
        await mesh.start()
        try:
            nc = await nats.connect(mesh.nats_url)
            counts: Counter[str] = Counter()
            sizes: Counter[str] = Counter()
            listening = False

            async def seen(msg: Msg) -> None:
                if listening:
                    name = family(msg.subject)
                    counts[name] += 1
                    sizes[name] += len(msg.data)

            await nc.subscribe(">", cb=seen)
            headers = {"Authorization": f"Bearer {mesh.dev_key}"}
            async with aiohttp.ClientSession(mesh.gateway_url) as http:
                async def one(seed: int) -> None:
                    body = {"model": MODEL, "prompt": "x" * 64, "max_tokens": 4, "stream": True, "seed": seed}
                    async with http.post("/v1/completions", json=body, headers=headers) as response:
                        response.raise_for_status()
                        await response.read()

                for i in range(10):  # warm-up: connections, caches, the first calibration
                    await one(i)
                await asyncio.sleep(1.0)  # the warm-up's background publishes (usage copies) settle
                listening = True
                seeds = iter(range(100, 100 + requests))

                async def stream() -> None:
                    for seed in seeds:  # shared: each seed is taken once
                        await one(seed)

                await asyncio.gather(*(stream() for _ in range(concurrency)))
                await asyncio.sleep(0.7)  # the last requests' background publishes (the usage copy waits 0.5 s)
                listening = False
            await nc.drain()
        finally:
            mesh.stop()
    total = sum(counts.values())
    how = "sequential" if concurrency == 1 else f"{concurrency} at a time"
    print(f"\n{requests} streamed completions (4 tokens), {how}, one sim worker; messages seen on the bus\n")
    print("| subject | per request | mean bytes | bytes per request |\n| --- | ---: | ---: | ---: |")
    for name, n in counts.most_common():
        print(f"| `{name}` | {n / requests:.2f} | {sizes[name] / n:,.0f} | {sizes[name] / requests:,.0f} |")
    print(f"| **all** | **{total / requests:.1f}** | | **{sum(sizes.values()) / requests:,.0f}** |")


def gauge_cost(reps: int = 20_000) -> None:
    decoder = msgspec.msgpack.Decoder(WorkerGauge)
    print("| arrivals named | gauge bytes | decode + apply_gauge µs |\n| ---: | ---: | ---: |")
    for named in (8, 64, 256):
        view = FleetView()
        view.update_worker(WorkerInfo(worker_id="w", model=MODEL, engine="sim", state="ready", block_size=16,
                                      started_at=1.0), 0.0)
        raw = msgspec.msgpack.encode(WorkerGauge(
            worker_id="w", model=MODEL, ts=0.0, running=5, waiting=3, queued_prefill_tokens=900, running_tokens=3000,
            arrived=[f"cmpl-{uuid.uuid4().hex}" for _ in range(named)]))
        started = time.perf_counter()
        for i in range(reps):
            gauge = decoder.decode(raw)
            gauge.ts = float(i)  # each newer than the last, as a worker's are
            view.apply_gauge(gauge, float(i))
        print(f"| {named} | {len(raw):,} | {(time.perf_counter() - started) / reps * 1e6:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=1, help="streams at a time (1: sequential)")
    parser.add_argument("--gauge-cost", action="store_true", help="only what one gauge costs a service that reads it")
    args = parser.parse_args()
    if args.gauge_cost:
        gauge_cost()
        return
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be ≥ 1")
    asyncio.run(run(args.requests, args.concurrency))


if __name__ == "__main__":
    main()
