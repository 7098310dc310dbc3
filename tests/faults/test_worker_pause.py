"""A worker paused (SIGSTOP) while the other is killed (-9): the killed worker's requests
must migrate onto the paused one once it resumes, within ``--migration-wait``.

Each placement try of the migrating segment on the paused worker times out, and its placer
tells the worker that copy is superseded. The worker, resumed, must refuse only those
tries, not the gateway's next one of the same segment (it used to refuse the whole
segment as "superseded", and the client got an error though a replica was back).
Checked on real processes: every stream completes, its text equal to an uninterrupted
run with the same seed, no SSE event id twice, every token billed once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus
from ops.up import Mesh
from tests.conftest import ledger_total, running_mesh
from tests.sse import check_continued_stream, read_sse, sse_text

MODEL = "sim-llama-8b"
TOKENS = 1000
REQUESTS = 8
SEEDS = 2


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    # Default stall timeout (30 s): the paused worker's own requests wait for it, as they
    # should; the killed worker's move at once (its disconnect), onto the paused one.
    with running_mesh(tmp_path / "mesh", workers=2, speed=1.0) as m:
        yield m


def test_requests_of_a_killed_worker_migrate_onto_a_worker_that_resumes(mesh: Mesh) -> None:
    asyncio.run(_run(mesh, kill="worker-2", pause=5.0))


def test_requests_survive_both_workers_paused_past_their_heartbeat(mesh: Mesh) -> None:
    # Both paused 20 s: the registry drops them (10 s heartbeat), every stream migrates and
    # waits for a replica, and each placement try that reached a paused worker timed out.
    asyncio.run(_run(mesh, kill="", pause=20.0))


async def _stream(http: aiohttp.ClientSession, key: str, seed: int) -> list[tuple[str, str]]:
    body = {"model": MODEL, "prompt": f"paused {seed}", "max_tokens": TOKENS, "seed": seed, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        return await read_sse(r)


def _worker(mesh: Mesh, label: str) -> int:
    process = next(p for p in mesh.processes if p.label == label)
    assert process.proc is not None
    return process.proc.pid


async def _run(mesh: Mesh, *, kill: str, pause: float) -> None:
    key = mesh.dev_key
    async with aiohttp.ClientSession(mesh.gateway_url, timeout=aiohttp.ClientTimeout(total=300)) as http:
        references = await asyncio.gather(*(_stream(http, key, seed) for seed in range(SEEDS)))
        reference = {seed: sse_text(events) for seed, events in enumerate(references)}

        tasks = [asyncio.create_task(_stream(http, key, i % SEEDS)) for i in range(REQUESTS)]
        await asyncio.sleep(3.0)  # every stream is under way, on both workers
        paused = [_worker(mesh, label) for label in ("worker-1", "worker-2") if label != kill]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            if kill:
                next(p for p in mesh.processes if p.label == kill).kill()
            # Requests that must move try a paused worker (each try times out) until it resumes.
            await asyncio.sleep(pause)
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        results = await asyncio.gather(*tasks)

    for i, events in enumerate(results):
        check_continued_stream(events, reference[i % SEEDS], TOKENS, f"request {i}")

    bus = await Bus.open(mesh.settings, "fault-check", initial_attempts=10)
    try:
        # The ledger counts each token once: no superseded copy billed anything.
        expected = (SEEDS + REQUESTS) * TOKENS
        assert (await ledger_total(bus, completion_tokens=expected, settle_s=0.5)).completion_tokens == expected
    finally:
        await bus.close()
