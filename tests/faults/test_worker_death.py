"""A worker killed (-9) mid-stream: its requests migrate and finish; no token lost or repeated.
Requests with n = 2 choices migrate too: each choice continues where it was.

Invariants checked on real processes: every request ends complete; the text of each
equals an uninterrupted run with the same seed; SSE event ids never repeat; the ledger
counts each token exactly once (the lost worker's segment billed by the gateway, the
rest by the worker that took over); the surviving worker's KV usage returns to baseline.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus
from ops.up import Mesh
from proto import WorkerGauge, decode
from proto.metering import UsageQuery, UsageReport
from tests.conftest import ledger_total, running_mesh
from tests.sse import check_continued_stream, read_sse, sse_text, sse_usage

MODEL = "sim-llama-8b"
TOKENS = 600
REQUESTS = 12
CHOICE_REQUESTS = 4  # with n = 2


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, speed=2.0, gateway_args=["--stall-timeout", "2"]) as m:
        yield m


def test_killed_worker_requests_migrate_and_finish_identically(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _stream(http: aiohttp.ClientSession, key: str, seed: int, n: int = 1
                  ) -> tuple[str, list[tuple[str, str]], float]:
    body = {"model": MODEL, "prompt": f"request {seed}", "max_tokens": TOKENS, "seed": seed, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "n": n}
    start = time.perf_counter()
    async with http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        events = await read_sse(r)
        return r.headers["X-Request-Id"], events, time.perf_counter() - start


async def _run(mesh: Mesh) -> None:
    key = mesh.dev_key
    async with aiohttp.ClientSession(mesh.gateway_url, timeout=aiohttp.ClientTimeout(total=180)) as http:
        # Uninterrupted reference texts (seeded: any worker produces the same text).
        reference = {seed: sse_text((await _stream(http, key, seed))[1]) for seed in range(3)}
        reference_n = (await _stream(http, key, 7, n=2))[1]

        tasks = [asyncio.create_task(_stream(http, key, seed % 3)) for seed in range(REQUESTS)]
        tasks_n = [asyncio.create_task(_stream(http, key, 7, n=2)) for _ in range(CHOICE_REQUESTS)]
        await asyncio.sleep(1.0)  # every stream is under way
        victim = next(p for p in mesh.processes if p.label == "worker-1")
        victim.kill()  # kill -9: no drain, no goodbye
        results = await asyncio.gather(*tasks)
        results_n = await asyncio.gather(*tasks_n)

    for _, events, _ in results_n:
        ids = [e for e, _ in events]
        assert len(ids) == len(set(ids)), "an event id repeated"
        for index in (0, 1):  # each choice equals its uninterrupted run (seeds 7 and 8)
            assert sse_text(events, index) == sse_text(reference_n, index), f"choice {index} differs"
        usage = sse_usage(events)
        assert usage is not None and usage["completion_tokens"] == 2 * TOKENS

    for i, (_, events, _) in enumerate(results):
        check_continued_stream(events, reference[i % 3], TOKENS, f"request {i}")

    bus = await Bus.open(mesh.settings, "fault-check", initial_attempts=10)
    try:
        # The ledger counts each token once, migrated or not.
        expected = (3 + REQUESTS + 2 * (1 + CHOICE_REQUESTS)) * TOKENS
        assert (await ledger_total(bus, completion_tokens=expected)).completion_tokens == expected
        by_status = await bus.request(bus.subjects.metering_usage, UsageQuery(org="dev", group_by=["status"]), UsageReport, timeout=5)
        statuses = {row.status: row.requests for row in by_status.rows}
        assert statuses.get("migrated", 0) >= 1, statuses  # some requests did move

        # The survivor holds no blocks for finished requests.
        gauges: list[WorkerGauge] = []
        sub = await bus.nc.subscribe(bus.subjects.gauges(MODEL, f"{MODEL}-w2"), cb=functools.partial(_append, gauges))
        for _ in range(50):
            if gauges:
                break
            await asyncio.sleep(0.1)
        await sub.unsubscribe()
        assert gauges and gauges[-1].running == 0 and gauges[-1].kv_blocks_used == 0
    finally:
        await bus.close()


async def _append(gauges: list[WorkerGauge], msg) -> None:  # type: ignore[no-untyped-def]
    gauges.append(decode(msg.data, WorkerGauge))


def test_a_resumed_stream_moves_the_request_off_a_killed_worker(mesh: Mesh) -> None:
    asyncio.run(_resume_after_worker_death(mesh))


async def _resume_after_worker_death(mesh: Mesh) -> None:
    # The client of a resumable request leaves; its gateway stops watching the worker. The
    # worker dies; the client resumes: the resumed stream notices the silence, moves the
    # request and ends complete, identical to an uninterrupted run, billed once.
    key = mesh.dev_key
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "resume across a death", "max_tokens": TOKENS, "seed": 21, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    bus = await Bus.open(mesh.settings, "resume-check", initial_attempts=10)
    try:
        async with aiohttp.ClientSession(mesh.gateway_url, timeout=aiohttp.ClientTimeout(total=180)) as http:
            async with http.post("/v1/completions", json=body, headers=headers) as r:
                reference = await read_sse(r)
            async with http.post("/v1/completions", json=body, headers={**headers, "X-Meshserve-Resumable": "true"}) as r:
                request_id = r.headers["X-Request-Id"]
                got = await read_sse(r, limit=5)
            # the worker serving it, from its chunks in TOKENS
            from services.gateway.streams import TokenDispatcher

            first = None
            async for chunk in TokenDispatcher(bus, "observer").replay(bus.subjects.tokens_of_request(request_id),
                                                                        idle_timeout_s=5):
                first = chunk
                break
            assert first is not None and first.worker_id
            victim = next(p for p in mesh.processes if p.label == f"worker-{first.worker_id.rsplit('-w', 1)[1]}")
            victim.kill()
            async with http.get(f"/v1/requests/{request_id}/stream",
                                headers={**headers, "Last-Event-ID": got[-1][0]}) as r:
                assert r.status == 200
                rest = await read_sse(r)
        joined = got + rest
        ids = [i for i, _ in joined]
        assert len(ids) == len(set(ids)), "an event id repeated"
        assert rest[-1][1] == "[DONE]"
        assert sse_text(joined) == sse_text(reference) and len(sse_text(joined)) > 0
        usage = sse_usage(joined)
        assert usage is not None and usage["completion_tokens"] == TOKENS
        expected = 2 * TOKENS  # the reference and the moved request, each token once
        assert (await ledger_total(bus, completion_tokens=expected, settle_s=0.5)).completion_tokens == expected
    finally:
        await bus.close()


def test_requests_wait_for_a_restarting_worker_when_no_other_can_take_them(tmp_path: Path) -> None:
    # A 1-worker pool: its worker dies mid-stream and nothing else can take the requests.
    # They wait (--migration-wait) for the worker to come back, then finish identically.
    with running_mesh(tmp_path / "mesh", workers=1, speed=2.0,
                      gateway_args=["--stall-timeout", "2", "--migration-wait", "60"]) as mesh:
        asyncio.run(_wait_for_restart(mesh))


async def _wait_for_restart(mesh: Mesh) -> None:
    key = mesh.dev_key
    gateway_log = mesh.log_dir / "gateway.log"
    async with aiohttp.ClientSession(mesh.gateway_url, timeout=aiohttp.ClientTimeout(total=180)) as http:
        reference = {seed: sse_text((await _stream(http, key, seed))[1]) for seed in range(2)}
        tasks = [asyncio.create_task(_stream(http, key, seed % 2)) for seed in range(4)]
        await asyncio.sleep(1.0)  # every stream is under way
        victim = next(p for p in mesh.processes if p.label == "worker-1")
        victim.kill()
        # The requests find no replica: wait until the gateway says they wait for one (without
        # the wait they fail at once), then the worker comes back (a new process, a new id).
        deadline = time.monotonic() + 60
        while "no replica can take it over" not in gateway_log.read_text() and not all(t.done() for t in tasks):
            assert time.monotonic() < deadline, "the gateway never waited for a replica"
            await asyncio.sleep(0.1)
        mesh.add_process(mesh.worker_process(2))
        results = await asyncio.gather(*tasks)

    for i, (_, events, _) in enumerate(results):
        check_continued_stream(events, reference[i % 2], TOKENS, f"request {i}")
