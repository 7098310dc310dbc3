"""The bus's typed helpers against raw nats-py, side by side in one run.

Measures, on a private nats-server with uvloop:
- publish: messages/s a publisher pushes (typed ``Bus.publish`` of a TokenChunk vs raw
  ``nc.publish`` of the same pre-encoded bytes), flushed;
- subscribe-and-decode: messages/s a callback subscriber receives (``Bus.subscribe``,
  which decodes each TokenChunk, vs a raw callback that only counts);
- request-reply: sequential round trips/s (``Bus.request`` with typed encode/decode and
  trace headers vs raw ``nc.request``), and with 64 concurrent requesters.

Run: ``.venv/bin/python benchmarks/bus_throughput.py [--messages 200000]``
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
from proto import ControlCommand, ControlReply, TokenChunk, encode


async def _publish_rate(bus: Bus, n: int, typed: bool) -> float:
    chunk = TokenChunk(request_id="r" * 24, seq=1, token_ids=list(range(16)), text="sixteen tokens!!")
    data = encode(chunk)
    start = time.perf_counter()
    if typed:
        for _ in range(n):
            await bus.publish("bench.pub", chunk, trace=False)
    else:
        for _ in range(n):
            await bus.nc.publish("bench.pub", data)
    await bus.nc.flush()
    return n / (time.perf_counter() - start)


async def _subscribe_rate(sender: Bus, receiver: Bus, n: int, typed: bool) -> float:
    done = asyncio.Event()
    count = 0

    async def typed_cb(chunk: TokenChunk, msg: Msg) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    async def raw_cb(msg: Msg) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    subject = f"bench.sub.{typed}"
    if typed:
        sub = await receiver.subscribe(subject, TokenChunk, typed_cb)
    else:
        sub = await receiver.nc.subscribe(subject, cb=raw_cb)
    sub._pending_msgs_limit = n + 1  # measure decode cost, not slow-consumer drops
    sub._pending_bytes_limit = 1 << 30
    await receiver.nc.flush()
    data = encode(TokenChunk(request_id="r" * 24, seq=1, token_ids=list(range(16)), text="sixteen tokens!!"))
    start = time.perf_counter()
    for _ in range(n):
        await sender.nc.publish(subject, data)
    await sender.nc.flush()
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    return n / elapsed


async def _request_rate(client: Bus, n: int, typed: bool, concurrency: int) -> float:
    command = ControlCommand(command="status")
    data = encode(command)
    per_task = n // concurrency

    async def one_task() -> None:
        for _ in range(per_task):
            if typed:
                await client.request("bench.echo.typed", command, ControlReply, timeout=5)
            else:
                await client.nc.request("bench.echo.raw", data, timeout=5)

    start = time.perf_counter()
    await asyncio.gather(*(one_task() for _ in range(concurrency)))
    return per_task * concurrency / (time.perf_counter() - start)


async def main(messages: int, requests: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=Path(tmp)).start()
        try:
            settings = BusSettings(servers=(server.url,))
            a = await Bus.open(settings, "bench-a", initial_attempts=10)
            b = await Bus.open(settings, "bench-b", initial_attempts=10)
            reply = encode(ControlReply(worker_id="w", state="ready"))

            async def typed_echo(command: ControlCommand, msg: Msg) -> None:
                await b.respond(msg, ControlReply(worker_id="w", state="ready"))

            async def raw_echo(msg: Msg) -> None:
                await b.nc.publish(msg.reply, reply)

            await b.subscribe("bench.echo.typed", ControlCommand, typed_echo)
            await b.nc.subscribe("bench.echo.raw", cb=raw_echo)
            await b.nc.flush()

            rows = []
            raw = await _publish_rate(a, messages, typed=False)
            typed = await _publish_rate(a, messages, typed=True)
            rows.append(("publish (msgs/s)", raw, typed))
            raw = await _subscribe_rate(a, b, messages, typed=False)
            typed = await _subscribe_rate(a, b, messages, typed=True)
            rows.append(("subscribe + decode (msgs/s)", raw, typed))
            raw = await _request_rate(a, requests, typed=False, concurrency=1)
            typed = await _request_rate(a, requests, typed=True, concurrency=1)
            rows.append(("request-reply, 1 in flight (req/s)", raw, typed))
            raw = await _request_rate(a, requests * 4, typed=False, concurrency=64)
            typed = await _request_rate(a, requests * 4, typed=True, concurrency=64)
            rows.append(("request-reply, 64 in flight (req/s)", raw, typed))

            print("| operation | raw nats-py | meshserve bus | bus / raw |\n|---|---:|---:|---:|")
            for name, r, t in rows:
                print(f"| {name} | {r:,.0f} | {t:,.0f} | {t / r:.2f} |")
            await a.close()
            await b.close()
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=5_000)
    args = parser.parse_args()
    uvloop.run(main(args.messages, args.requests))
