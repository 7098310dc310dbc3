"""Thousands of requests through the whole mesh while metering is killed twice: exact totals."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus import Bus
from ops.up import Mesh, ServiceProcess
from proto.metering import UsageQuery, UsageReport
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"
REQUESTS = 2000


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, speed=50.0, worker_args=["--max-num-seqs", "256"]) as m:
        yield m


def test_ledger_totals_are_exact_across_two_metering_crashes(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _run(mesh: Mesh) -> None:
    nc = await nats.connect(mesh.nats_url)
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    rng = random.Random(5)
    streamed = {"requests": 0, "prompt": 0, "completion": 0}
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": "p" * rng.randint(1, 64), "max_tokens": rng.randint(1, 24), "ignore_eos": True}
        async with sem:
            reply = await nc.request("mesh.api.v1.completions", json.dumps(body).encode(), headers=headers, timeout=60)
        usage = json.loads(reply.data)["usage"]
        streamed["requests"] += 1
        streamed["prompt"] += usage["prompt_tokens"]
        streamed["completion"] += usage["completion_tokens"]

    async def chaos() -> None:
        for _ in range(2):
            await asyncio.sleep(1.5)
            metering = next(p for p in mesh.processes if p.name == "metering" and p.running())
            metering.kill()  # kill -9
            await asyncio.sleep(0.5)
            mesh.add_process(ServiceProcess("metering", "metering", metering.argv, metering.log_file))

    try:
        await asyncio.gather(chaos(), *(one(i) for i in range(REQUESTS)))
        assert streamed["requests"] == REQUESTS
        bus = await Bus.open(mesh.settings, "ledger-check", initial_attempts=10)
        try:
            report = None
            for _ in range(150):  # the restarted metering catches up from the durable consumer
                try:
                    report = await bus.request(bus.subjects.metering_usage, UsageQuery(org="dev", group_by=[]), UsageReport, timeout=5)
                except Exception:
                    report = None
                if report and report.rows and report.rows[0].requests >= REQUESTS:
                    break
                await asyncio.sleep(0.2)
            assert report is not None and report.rows
            total = report.rows[0]
            assert total.requests == REQUESTS
            assert total.prompt_tokens == streamed["prompt"]
            assert total.completion_tokens == streamed["completion"]
        finally:
            await bus.close()
    finally:
        await nc.close()
