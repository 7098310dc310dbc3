"""How long a large request's checks hold the gateway's event loop: requests carrying a
JSON schema at OpenAI's limit (5,000 properties), parsed on the loop (``parse_request``,
as every request was) and through ``parse_request_off_loop`` (a thread for bodies of
64 KB or more), while a 1 ms ticker on the same loop stands for every other client.

Run: ``.venv/bin/python benchmarks/parse_stall.py [--requests 3] [--properties 5000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from services.common.tokenizer import ByteTokenizer
from services.gateway import validation
from services.gateway.models import ModelLimits, ModelSpec

MODELS = {"sim": ModelSpec("sim", ByteTokenizer(), ModelLimits(max_model_len=4096))}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--properties", type=int, default=5000)
    args = parser.parse_args()
    print("| parsed | requests | properties each | parse s | event loop's longest pause ms |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("on the loop", "off the loop"):
        took, pause = asyncio.run(measure(mode, args.requests, args.properties))
        print(f"| {mode} | {args.requests} | {args.properties:,} | {took:.2f} | {pause * 1000:.0f} |")


if __name__ == "__main__":
    main()
