"""A worker drained (SIGTERM, as a scale-down does) while its requests outlast its drain
timeout: they continue on another replica, as after a crash, and end complete; the client
sees no error (they ended with "drain timeout" errors mid-stream, where a kill -9 of the
same worker lost nothing). Real processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus
from ops.up import Mesh
from proto.metering import UsageQuery, UsageReport
from tests.conftest import ledger_total, running_mesh
from tests.sse import check_continued_stream, read_sse, sse_text

MODEL = "sim-llama-8b"
TOKENS = 3000
REQUESTS = 6


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, speed=2.0, worker_args=["--drain-timeout", "1"]) as m:
        yield m


def test_requests_outlasting_a_drain_continue_on_another_replica(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _stream(http: aiohttp.ClientSession, key: str, seed: int) -> list[tuple[str, str]]:
    body = {"model": MODEL, "prompt": f"request {seed}", "max_tokens": TOKENS, "seed": seed, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        return await read_sse(r)


async def _run(mesh: Mesh) -> None:
    async with aiohttp.ClientSession(mesh.gateway_url, timeout=aiohttp.ClientTimeout(total=180)) as http:
        reference = dict(zip(range(2), [sse_text(e) for e in await asyncio.gather(
            *(_stream(http, mesh.dev_key, seed) for seed in range(2)))], strict=True))
        tasks = [asyncio.create_task(_stream(http, mesh.dev_key, i % 2)) for i in range(REQUESTS)]
        await asyncio.sleep(1.0)  # every stream under way, far from its end (3,000 tokens: ~10 s)
        victim = next(p for p in mesh.processes if p.label == "worker-1")
        started = time.monotonic()
        victim.terminate()  # SIGTERM: drain, which its requests outlast
        results = await asyncio.gather(*tasks)
        assert victim.wait(30) == 0  # it drained and exited cleanly
        assert time.monotonic() - started < 30
        assert "drain timeout: handing" in victim.log_file.read_text()  # the drain did outlast its timeout

    for i, events in enumerate(results):
        check_continued_stream(events, reference[i % 2], TOKENS, f"request {i}")

    bus = await Bus.open(mesh.settings, "drain-check", initial_attempts=10)
    try:
        expected = (2 + REQUESTS) * TOKENS  # each token billed once, whichever worker made it
        total = await ledger_total(bus, completion_tokens=expected)
        assert total.completion_tokens == expected and total.requests == 2 + REQUESTS
        by_status = await bus.request(bus.subjects.metering_usage, UsageQuery(org="dev", group_by=["status"]),
                                      UsageReport, timeout=5)
        statuses = {row.status: sum(row.by_status.values()) for row in by_status.rows}
        assert statuses.get("migrated", 0) >= 1 and "failed" not in statuses, statuses
    finally:
        await bus.close()
