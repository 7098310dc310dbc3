"""Messages on the bus per request: what one streamed completion costs NATS, subject by subject.

Issue 19's request path spends most of its CPU in the event loop and socket writes, not in
any one function: every message is a write, a server route and a wake-up somewhere. This
starts a mesh as ``meshserve up`` does (one sim worker at speed 100, so a request takes
milliseconds), warms it, then listens on ``>`` (every subject; JetStream deliveries to
a consumer show under the stream's subject) while it sends ``--requests`` sequential
streamed completions, and prints per request how many messages each subject family
carried and their mean size. Periodic traffic (gauges, heartbeats) shows too, divided
over the requests of the window: a longer window between requests makes it larger.

Run: ``.venv/bin/python benchmarks/bus_messages.py [--requests 100]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import Counter
from pathlib import Path

import aiohttp
import nats
from nats.aio.msg import Msg

from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig

MODEL = "sim-llama-8b"


def family(subject: str) -> str:
    """The subject with its per-request and per-process tokens (ids, sequence numbers,
    inboxes) folded into ``#``, so that one family counts all its instances."""
    return ".".join("#" if any(c.isdigit() for c in part) or len(part) > 16 else part for part in subject.split("."))


async def run(requests: int) -> None:
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
                for i in range(requests):
                    await one(100 + i)
                await asyncio.sleep(0.7)  # the last requests' background publishes (the usage copy waits 0.5 s)
                listening = False
            await nc.drain()
        finally:
            mesh.stop()
    total = sum(counts.values())
    print(f"\n{requests} sequential streamed completions (4 tokens), one sim worker; messages seen on the bus\n")
    print("| subject | per request | mean bytes |\n| --- | ---: | ---: |")
    for name, n in counts.most_common():
        print(f"| `{name}` | {n / requests:.2f} | {sizes[name] / n:,.0f} |")
    print(f"| **all** | **{total / requests:.1f}** | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be ≥ 1")
    asyncio.run(run(args.requests))


if __name__ == "__main__":
    main()
