"""The worker service with the sim engine, on a real nats-server."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from bus import Bus, BusSettings
from proto import (
    ControlCommand,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    KvSnapshot,
    KvSnapshotRequest,
    RemoteError,
    SamplingParams,
    TokenChunk,
    WorkerGauge,
    pack_tokens,
)
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import usage_events

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-llama-8b"


class ChunkCollector:
    """Every token chunk of the test's requests, by request id, in arrival order."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self.finished: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def start(self) -> None:
        await self.bus.subscribe(self.bus.subjects.tokens_of_gateway("test-gw"), TokenChunk, self._on_chunk)

    async def _on_chunk(self, chunk: TokenChunk, msg: Msg) -> None:
        self.chunks[chunk.request_id].append(chunk)
        if chunk.finish_reason is not None:
            self.finished[chunk.request_id].set()

    async def wait(self, request_id: str, timeout: float = 30) -> list[TokenChunk]:
        await asyncio.wait_for(self.finished[request_id].wait(), timeout)
        return self.chunks[request_id]


def make_request(bus: Bus, request_id: str, prompt: list[int], max_tokens: int, model: str = MODEL, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, model=model, prompt=pack_tokens(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
        token_subject=bus.subjects.tokens("test-gw", request_id), org="org-a", key_id="k1", **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    engine = SimEngine(model=MODEL, speed=50.0, max_num_seqs=32, num_kv_blocks=2048, max_model_len=8192)
    service = WorkerService(engine, WorkerConfig(worker_id="w-test", gauge_interval_s=0.05, drain_timeout_s=20), bus_settings)
    await service.start()
    try:
        yield service
    finally:
        if not service.stopped.is_set():
            await service.drain_and_close()


@pytest.fixture
async def collector(bus: Bus) -> ChunkCollector:
    c = ChunkCollector(bus)
    await c.start()
    return c


def assert_complete(chunks: list[TokenChunk], max_tokens: int) -> None:
    assert [c.seq for c in chunks] == list(range(len(chunks))), "gap, duplicate or reordering"
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    tokens = sum(len(c.token_ids) for c in chunks)
    assert tokens == max_tokens == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]


async def test_64_concurrent_streams_complete_in_order(bus: Bus, worker: WorkerService, collector: ChunkCollector) -> None:
    requests = [make_request(bus, f"r{i}", list(range(100 + i)), max_tokens=40 + i % 7) for i in range(64)]
    replies = await asyncio.gather(*(bus.request(bus.subjects.worker_generate("w-test"), r, ControlReply, timeout=5) for r in requests))
    assert all(r.worker_id == "w-test" for r in replies)
    for r in requests:
        assert_complete(await collector.wait(r.request_id), r.sampling.max_tokens)
    # coalescing: far fewer messages than tokens
    total_tokens = sum(r.sampling.max_tokens for r in requests)
    assert worker.chunks_published < total_tokens
    # exactly one usage event per request, counts equal to what was streamed
    await asyncio.sleep(0.2)
    usage = await usage_events(bus)
    by_id = {u.request_id: u for u in usage}
    assert len(usage) == len(by_id) == 64
    for r in requests:
        streamed = sum(len(c.token_ids) for c in collector.chunks[r.request_id])
        event = by_id[r.request_id]
        assert event.completion_tokens == streamed and event.status == "length"
        assert event.prompt_tokens == len(r.prompt) // 4 and event.worker_id == "w-test"


async def test_cancel_frees_kv_blocks_by_next_gauge(bus: Bus, worker: WorkerService, collector: ChunkCollector) -> None:
    gauges: list[WorkerGauge] = []

    async def on_gauge(g: WorkerGauge, msg: Msg) -> None:
        gauges.append(g)

    await bus.subscribe(bus.subjects.gauges(MODEL, "w-test"), WorkerGauge, on_gauge)
    await asyncio.sleep(0.2)
    baseline = worker.engine.stats().kv_blocks_used
    request = make_request(bus, "long", list(range(3000)), max_tokens=4000)
    await bus.request(bus.subjects.worker_generate("w-test"), request, ControlReply)
    for _ in range(200):
        if collector.chunks["long"]:
            break
        await asyncio.sleep(0.02)
    assert worker.engine.stats().kv_blocks_used > baseline
    reply = await bus.request(bus.subjects.worker_cancel("w-test"), _cancel("long"), ControlReply)
    assert reply.message == "cancelled"
    chunks = await collector.wait("long")
    assert chunks[-1].finish_reason == "abort"
    gauges.clear()
    for _ in range(100):
        if gauges:
            break
        await asyncio.sleep(0.02)
    # freed blocks stay cached (prefix cache) but are no longer in use
    assert gauges[0].running == 0 and gauges[0].kv_blocks_used == baseline
    await asyncio.sleep(0.2)
    usage = {u.request_id: u for u in await usage_events(bus)}
    assert usage["long"].status == "cancelled"
    assert usage["long"].completion_tokens == sum(len(c.token_ids) for c in chunks)


async def test_gauges_name_the_requests_they_count(bus: Bus, worker: WorkerService, collector: ChunkCollector) -> None:
    # Admission and the router settle their optimistic count of a request when a gauge
    # names it: a gauge that names one must already count it (else the burst it belongs
    # to would vanish from both queues).
    gauges: list[WorkerGauge] = []

    async def on_gauge(g: WorkerGauge, msg: Msg) -> None:
        gauges.append(g)

    await bus.subscribe(bus.subjects.gauges(MODEL, "w-test"), WorkerGauge, on_gauge)
    await asyncio.sleep(0.3)
    assert gauges and all(g.arrived == [] for g in gauges)  # a worker that names arrivals names none yet
    ids = [f"named{i}" for i in range(4)]
    for rid in ids:
        await bus.request(bus.subjects.worker_generate("w-test"), make_request(bus, rid, list(range(2000)), max_tokens=50),
                          ControlReply)
    for rid in ids:
        await collector.wait(rid)
    await asyncio.sleep(0.3)
    for rid in ids:
        first = next(g for g in gauges if rid in (g.arrived or []))
        assert first.waiting + first.running >= 1, first
    assert all(len(set(g.arrived or [])) == len(g.arrived or []) for g in gauges)


async def test_a_burst_of_changes_is_carried_by_gauges_no_closer_than_the_floor(bus_settings: BusSettings, bus: Bus,
                                                                                 collector: ChunkCollector) -> None:
    # Every arrival and every end triggered a gauge of its own: at high request rates the
    # worker's gauges outnumbered its requests two to one, each decoded by three services.
    floor = 0.1
    engine = SimEngine(model=MODEL, speed=50.0, max_num_seqs=32, num_kv_blocks=2048, max_model_len=8192)
    service = WorkerService(engine, WorkerConfig(worker_id="w-floor", gauge_interval_s=1.0, gauge_min_interval_s=floor),
                            bus_settings)
    await service.start()
    gauges: list[WorkerGauge] = []

    async def on_gauge(g: WorkerGauge, msg: Msg) -> None:
        gauges.append(g)

    try:
        await bus.subscribe(bus.subjects.gauges(MODEL, "w-floor"), WorkerGauge, on_gauge)
        ids = [f"floor{i}" for i in range(12)]
        for rid in ids:  # a change every ~20 ms for a quarter of a second, then their ends
            await bus.request(bus.subjects.worker_generate("w-floor"), make_request(bus, rid, list(range(50)), max_tokens=8),
                              ControlReply)
            await asyncio.sleep(0.02)
        for rid in ids:
            await collector.wait(rid)
        await asyncio.sleep(floor * 2)
        serving = list(gauges)  # the last gauge, on stop, goes out at once
    finally:
        await service.drain_and_close()
    gaps = [later.ts - earlier.ts for earlier, later in itertools.pairwise(serving)]
    assert len(gaps) >= 2 and min(gaps) >= floor - 0.005, gaps  # 24 changes, none sooner than the floor
    assert {rid for g in gauges for rid in g.arrived or []} == set(ids)  # every arrival still named
    assert serving[-1].running == serving[-1].waiting == 0


def _cancel(request_id: str):  # type: ignore[no-untyped-def]
    from proto import CancelRequest

    return CancelRequest(request_id=request_id)


async def test_requests_it_cannot_serve_get_an_error_chunk(bus: Bus, worker: WorkerService, collector: ChunkCollector) -> None:
    wrong = make_request(bus, "wrong-model", [1, 2, 3], max_tokens=5, model="other-model")
    with pytest.raises(RemoteError) as info:
        await bus.request(bus.subjects.worker_generate("w-test"), wrong, ControlReply)
    assert info.value.code is ErrorCode.UNKNOWN_MODEL
    chunks = await collector.wait("wrong-model")
    assert chunks[-1].finish_reason == "error" and "other-model" in chunks[-1].error.message  # type: ignore[union-attr]

    too_long = make_request(bus, "too-long", list(range(8000)), max_tokens=500)
    with pytest.raises(RemoteError) as info:
        await bus.request(bus.subjects.worker_generate("w-test"), too_long, ControlReply)
    assert info.value.code is ErrorCode.PROMPT_TOO_LONG
    assert (await collector.wait("too-long"))[-1].error.code == "prompt_too_long"  # type: ignore[union-attr]

    # hostile bytes: a typed error reply, and the worker keeps serving
    raw = await bus.nc.request(bus.subjects.worker_generate("w-test"), os.urandom(300), timeout=2)
    assert raw.headers and "Nats-Service-Error" in raw.headers
    ok = make_request(bus, "after", [5, 6, 7], max_tokens=8)
    await bus.request(bus.subjects.worker_generate("w-test"), ok, ControlReply)
    assert_complete(await collector.wait("after"), 8)
    await asyncio.sleep(0.2)
    usage = {u.request_id: u for u in await usage_events(bus)}
    assert usage["wrong-model"].status == "failed" and usage["too-long"].status == "failed"


async def test_kv_snapshot_matches_engine_cache(bus: Bus, worker: WorkerService, collector: ChunkCollector) -> None:
    request = make_request(bus, "cached", list(range(64)), max_tokens=4)
    await bus.request(bus.subjects.worker_generate("w-test"), request, ControlReply)
    await collector.wait("cached")
    snapshot = await bus.request(bus.subjects.worker_kv_snapshot("w-test"), KvSnapshotRequest(worker_id="w-test"), KvSnapshot)
    from proto import block_hashes, prefix_salt

    # Salted with the request's org, as the gateway hashes that org's prompts.
    assert set(block_hashes(list(range(64)), snapshot.block_size, prefix_salt(None, request.org))) <= set(snapshot.block_hashes)


async def test_drain_command_refuses_new_work_and_finishes_in_flight(
    bus: Bus, worker: WorkerService, collector: ChunkCollector
) -> None:
    running = make_request(bus, "in-flight", list(range(50)), max_tokens=300)
    await bus.request(bus.subjects.worker_generate("w-test"), running, ControlReply)
    reply = await bus.request(bus.subjects.worker_control("w-test"), ControlCommand(command="drain", timeout_s=20), ControlReply)
    assert reply.state == "draining"
    late = make_request(bus, "late", [1, 2, 3], max_tokens=5)
    with pytest.raises(RemoteError) as info:
        await bus.request(bus.subjects.worker_generate("w-test"), late, ControlReply)
    assert info.value.code is ErrorCode.DRAINING and info.value.retryable
    drain = asyncio.create_task(worker.drain_and_close())
    assert_complete(await collector.wait("in-flight"), 300)
    assert await drain is True
    kv = await bus.js.key_value(bus.subjects.workers_bucket)
    with pytest.raises((KeyDeletedError, KeyNotFoundError)):  # deregistered
        await kv.get("w-test")


async def test_sigterm_during_load_lets_every_request_finish(bus: Bus, nats_url: str, collector: ChunkCollector) -> None:
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "serve", "worker", "--model", MODEL, "--worker-id", "w-proc", "--speed", "20"],
        env=env, cwd=ROOT,
    )
    try:
        for _ in range(150):
            try:
                await bus.request(bus.subjects.worker_control("w-proc"), ControlCommand(command="status"), ControlReply, timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        requests = [make_request(bus, f"t{i}", list(range(200)), max_tokens=200) for i in range(12)]
        for r in requests:
            await bus.request(bus.subjects.worker_generate("w-proc"), r, ControlReply, timeout=5)
        await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        for r in requests:
            assert_complete(await collector.wait(r.request_id, timeout=60), 200)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_prometheus_metrics_use_vllm_names(bus: Bus, bus_settings: BusSettings, collector: ChunkCollector) -> None:
    import aiohttp

    engine = SimEngine(model=MODEL, speed=50.0)
    service = WorkerService(engine, WorkerConfig(worker_id="w-metrics", metrics_port=0), bus_settings)
    await service.start()
    try:
        for i in range(3):
            r = make_request(bus, f"m{i}", list(range(40)), max_tokens=10)
            await bus.request(bus.subjects.worker_generate("w-metrics"), r, ControlReply)
            await collector.wait(f"m{i}")
        port = service._metrics_server.port  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as response:
            text = await response.text()
        labels = f'engine="sim",model_name="{MODEL}"'
        assert f"vllm:num_requests_running{{{labels}}} 0.0" in text
        assert f"vllm:num_requests_waiting{{{labels}}} 0.0" in text
        assert f"vllm:generation_tokens_total{{{labels}}} 30.0" in text
        assert f"vllm:prompt_tokens_total{{{labels}}} 120.0" in text
        assert f"vllm:time_to_first_token_seconds_count{{{labels}}} 3.0" in text
        assert "vllm:kv_cache_usage_perc" in text and "vllm:inter_token_latency_seconds_bucket" in text
    finally:
        await service.drain_and_close()


async def test_hosted_models_share_one_metrics_port(nats_url: str) -> None:
    """``serve worker --host-models a,b --metrics-port P`` runs one worker service per
    model in one process: they serve one page on P, each family once, each model's
    series labelled with its name (the second service failed to bind and the process
    exited)."""
    import aiohttp

    from ops.natsserver import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "serve", "worker", "--host-models", "host-a=1,host-b=1",
         "--metrics-port", str(port), "--nats-url", nats_url],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        text = ""
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                try:
                    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                        text = await response.text()
                except aiohttp.ClientError:
                    text = ""
                if 'model_name="host-a"' in text and 'model_name="host-b"' in text:
                    break
                await asyncio.sleep(0.1)
        for model in ("host-a", "host-b"):
            assert f'vllm:num_requests_running{{engine="sim",model_name="{model}"}} 0.0' in text, text
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1, text
        assert text.count("# TYPE vllm:request_success_total counter") == 1, text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]


async def test_probe_tells_queued_from_running_and_unknown(bus: Bus, bus_settings: BusSettings,
                                                          collector: ChunkCollector) -> None:
    """What the gateway asks before it calls a silent request stalled."""
    from proto import CancelRequest, RequestProbe, RequestProbeReply

    engine = SimEngine(model=MODEL, speed=1.0, max_num_seqs=1, num_kv_blocks=2048, max_model_len=8192)
    service = WorkerService(engine, WorkerConfig(worker_id="w-probe", gauge_interval_s=0.05), bus_settings)
    await service.start()
    subject = bus.subjects.worker_probe("w-probe")

    async def probe(request_id: str) -> RequestProbeReply:
        return await bus.request(subject, RequestProbe(request_id=request_id), RequestProbeReply)

    try:
        idle = await probe("nothing")
        assert (idle.state, idle.engine_idle_s) == ("unknown", 0.0)  # an idle worker is not a hung one
        for rid in ("first", "second"):  # one sequence at a time: second waits for first
            await bus.request(bus.subjects.worker_generate("w-probe"), make_request(bus, rid, list(range(50)), 4000),
                              ControlReply)
        for _ in range(250):
            if collector.chunks["first"]:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        first, second = await probe("first"), await probe("second")
        assert first.state == "running" and first.since_output_s < 0.3
        assert second.state == "waiting" and second.since_output_s >= 0.3  # waiting since it arrived
        assert second.engine_idle_s < 0.3  # the engine serves first meanwhile
        assert (await probe("nothing")).state == "unknown"
    finally:
        for rid in ("first", "second"):
            await bus.request(bus.subjects.worker_cancel("w-probe"), CancelRequest(request_id=rid), ControlReply)
        await service.drain_and_close()
    assert service.book.empty  # nothing kept for ended requests


async def test_a_chunk_that_never_reached_tokens_is_sent_again(bus: Bus, worker: WorkerService,
                                                               collector: ChunkCollector) -> None:
    # A chunk published into a dying NATS node's socket reaches neither the gateway nor
    # TOKENS. Simulated here: a gateway-side stream is handed every chunk but seq 1, and
    # TOKENS loses the request's messages. The gateway's gap watch looks in TOKENS first,
    # then asks the worker, which publishes seq 1 again from what it kept.
    from services.gateway.streams import TokenDispatcher

    request = make_request(bus, "lossy", list(range(200)), max_tokens=300)
    await bus.request(bus.subjects.worker_generate("w-test"), request, ControlReply)
    chunks = list(await collector.wait("lossy"))  # a copy: the resent chunk reaches the collector too
    assert len(chunks) >= 3
    await bus.js.purge_stream(bus.subjects.tokens_stream, subject=request.token_subject)
    dispatcher = TokenDispatcher(bus, "test-gw", gap_fill_after_s=0.1)
    await dispatcher.start()
    try:
        stream = dispatcher.open("lossy")
        stream.worker_id = "w-test"
        for chunk in chunks:
            if chunk.seq != 1:
                stream.deliver(chunk)
        assert stream.missing() == (1, 1)
        received = [await stream.get(timeout=10) for _ in range(len(chunks))]
        assert [c.seq for c in received] == list(range(len(chunks)))
        assert received[1].token_ids == next(c for c in chunks if c.seq == 1).token_ids
        assert dispatcher.gap_fills >= 1 and dispatcher.resend_requests >= 1 and worker.chunks_resent >= 1
    finally:
        await dispatcher.stop()
