"""The worker's message rate against its token rate (the coalescing ratio).

A worker with the sim engine (8B/H100 profile, real time) serves batches of 1, 8, 32 and
128 concurrent requests; the worker publishes the first token of each request at once,
then one chunk per request every ``--coalesce-ms`` or ``--coalesce-tokens``, the
interval widened at large batches to stay under ``--max-messages-per-s``. Printed:
tokens/s and chunk messages/s the worker published, and tokens per message.

Run: ``.venv/bin/python benchmarks/worker_coalescing.py``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import uvloop
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from ops.natsserver import NatsServer
from proto import ControlReply, GenerateRequest, SamplingParams, TokenChunk, decode, pack_tokens
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService


async def run(batch: int, tokens: int, settings: BusSettings, coalesce_ms: float, coalesce_tokens: int,
              budget: float) -> tuple[float, float]:
    engine = SimEngine(model="sim-llama-8b", speed=1.0)
    worker = WorkerService(engine, WorkerConfig(worker_id=f"w{batch}", coalesce_interval_s=coalesce_ms / 1000,
                                                coalesce_max_tokens=coalesce_tokens, max_messages_per_s=budget), settings)
    await worker.start()
    client = await Bus.open(settings, "coalescing-bench", initial_attempts=10)
    done = asyncio.Event()
    finished = 0

    async def on_chunk(msg: Msg) -> None:
        nonlocal finished
        if decode(msg.data, TokenChunk).finish_reason is not None:
            finished += 1
            if finished == batch:
                done.set()

    await client.nc.subscribe(client.subjects.tokens_of_gateway("bench"), cb=on_chunk)
    start = time.perf_counter()
    for i in range(batch):
        request = GenerateRequest(request_id=f"b{batch}-{i}", model="sim-llama-8b", prompt=pack_tokens(list(range(128))),
                                  sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
                                  token_subject=client.subjects.tokens("bench", f"b{batch}-{i}"))
        await client.request(client.subjects.worker_generate(f"w{batch}"), request, ControlReply)
    await done.wait()
    elapsed = time.perf_counter() - start
    result = worker.tokens_published / elapsed, worker.chunks_published / elapsed
    await client.close()
    await worker.drain_and_close()
    return result


async def main(tokens: int, coalesce_ms: float, coalesce_tokens: int, budget: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp)).start()
        try:
            settings = BusSettings(servers=(server.url,))
            print(f"coalescing: first token at once, then a chunk every {coalesce_ms:g} ms or {coalesce_tokens} tokens, "
                  f"the interval widened to keep the worker under {budget:g} messages/s\n")
            print("| batch | tokens/s | messages/s | tokens per message |\n|---:|---:|---:|---:|")
            for batch in (1, 8, 32, 128):
                tps, mps = await run(batch, tokens, settings, coalesce_ms, coalesce_tokens, budget)
                print(f"| {batch} | {tps:,.0f} | {mps:,.0f} | {tps / mps:.1f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--coalesce-ms", type=float, default=20.0)
    parser.add_argument("--coalesce-tokens", type=int, default=16)
    parser.add_argument("--max-messages-per-s", type=float, default=1000.0)
    args = parser.parse_args()
    uvloop.run(main(args.tokens, args.coalesce_ms, args.coalesce_tokens, args.max_messages_per_s))
