"""How long a large request's checks hold the gateway's event loop: requests carrying a
JSON schema at OpenAI's limit (5,000 properties), parsed on the loop (``parse_request``,
as every request was) and through ``parse_request_off_loop`` (a thread for bodies of
64 KB or more), while a 1 ms ticker on the same loop stands for every other client.

``--messages N`` measures instead what the thread costs a request it moves: a conversation
of N short messages (129 weighs just over the threshold) parsed inline and through the
thread, one at a time and 300 at once.

Run: ``.venv/bin/python benchmarks/parse_stall.py [--requests 3] [--properties 5000] [--messages N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from services.common.tokenizer import ByteTokenizer
from services.gateway import validation
from services.gateway.models import ModelLimits, ModelSpec

MODELS = {"sim": ModelSpec("sim", ByteTokenizer(), ModelLimits(max_model_len=1 << 20))}


def body(tag: str, properties: int) -> bytes:
    # Names differ per request: a schema seen before is not checked again (the cache).
    schema = {"type": "object", "properties": {f"{tag}_{j}": {"type": "string"} for j in range(properties)}}
    return json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).encode()


async def measure(mode: str, requests: int, properties: int) -> tuple[float, float]:
    """(seconds for the parses, the loop's longest pause in seconds)."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    bodies = [body(f"{mode}{i}", properties) for i in range(requests)]
    start = time.perf_counter()
    for b in bodies:
        if mode == "on the loop":
            validation.parse_request("chat", b, MODELS)
        else:
            await validation.parse_request_off_loop("chat", b, MODELS)
    took = time.perf_counter() - start
    stop.set()
    await task
    return took, max(gaps)


async def hop(messages: int, rounds: int = 300) -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello there, how are you"}
             for i in range(messages)]
    b = json.dumps({"model": "sim", "messages": turns, "max_tokens": 5}).encode()
    print(f"{messages} messages: {len(b) / 1024:.1f} KB, weighs {validation.parse_cost(b) / 1024:.0f} KB"
          f" against {validation.OFF_LOOP_BYTES // 1024} KB")
    print("| parsed | at once | µs per request |")
    print("|---|---:|---:|")
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(rounds):
            validation.parse_request("chat", b, MODELS)
        print(f"| inline | 1 | {(time.perf_counter() - start) / rounds * 1e6:.0f} |")
        start = time.perf_counter()
        for _ in range(rounds):
            await validation.off_loop(validation.OFF_LOOP_BYTES, validation.parse_request, "chat", b, MODELS)
        print(f"| thread | 1 | {(time.perf_counter() - start) / rounds * 1e6:.0f} |")
        start = time.perf_counter()
        await asyncio.gather(*(validation.off_loop(validation.OFF_LOOP_BYTES, validation.parse_request, "chat", b,
                                                   MODELS) for _ in range(rounds)))
        print(f"| thread | {rounds} | {(time.perf_counter() - start) / rounds * 1e6:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--properties", type=int, default=5000)
    parser.add_argument("--messages", type=int, default=0, help="measure the thread's cost per request instead")
    args = parser.parse_args()
    if args.messages:
        asyncio.run(hop(args.messages))
        return
    print("| parsed | requests | properties each | parse s | event loop's longest pause ms |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("on the loop", "off the loop"):
        took, pause = asyncio.run(measure(mode, args.requests, args.properties))
        print(f"| {mode} | {args.requests} | {args.properties:,} | {took:.2f} | {pause * 1000:.0f} |")


if __name__ == "__main__":
    main()
