"""JetStream unavailable while requests finish or start (issue 20, faults from the chaos soak).

The USAGE stream deleted and recreated seconds later stands in for an election that leaves
it without a leader (for longer than a worker's few quick publish attempts). Each request
is billed exactly once, with its right token counts, by either side alone: by its worker,
which retries in the background; or, when the worker died after its final chunk, by its
gateway, which publishes the usage event that chunk carries under the same dedup id. A
resumable request started while its record's bucket is unavailable waits for it instead
of failing with a 503.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from nats.aio.msg import Msg

from bus import Bus, BusSettings, cancel_and_wait
from bus.provision import StreamLimits, ensure_stream, requests_bucket, usage_stream_config
from ops.keys import create_key
from ops.nats.accounts import kv_stream
from proto import ControlReply, GenerateRequest, SamplingParams, TokenChunk, pack_tokens
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually, usage_events
from tests.sse import read_sse, sse_usage

MODEL = "sim-llama-8b"
# Longer than a worker's old three quick attempts (0.1 + 0.2 + 0.4 s apart).
OUTAGE_S = 1.5


async def _start_worker(bus_settings: BusSettings, worker_id: str) -> WorkerService:
    worker = WorkerService(SimEngine(model=MODEL, speed=50.0), WorkerConfig(worker_id=worker_id), bus_settings)
    await worker.start()
    return worker


async def _kill(worker: WorkerService) -> None:
    """What kill -9 leaves: nothing of the worker runs, its connection is gone."""
    await cancel_and_wait([*worker._tasks, *getattr(worker, "_loops", [])])
    await worker.bus.nc.close()
    await worker.engine.shutdown()


async def _recreate_usage(bus: Bus) -> None:
    await ensure_stream(bus.js, usage_stream_config(bus.subjects, StreamLimits(), 1))


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    service = await _start_worker(bus_settings, "w-outage")
    yield service
    if not service.bus.nc.is_closed:
        await service.drain_and_close()


@pytest.fixture
async def gateway(bus_settings: BusSettings) -> AsyncIterator[GatewayService]:
    service = GatewayService(GatewayConfig(port=0), bus_settings)
    await service.start()
    yield service
    await service.drain_and_close()


async def _post(http: aiohttp.ClientSession, gateway: GatewayService, key: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
    for _ in range(50):  # until the gateway's key watcher has the new key
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}", **(headers or {})}) as r:
            status, payload = r.status, await r.json()
        if status != 401:
            return status, payload
        await asyncio.sleep(0.1)
    return status, payload


def _one_each(events: list[Any], request_ids: set[str]) -> dict[str, Any]:
    by_id: dict[str, list[Any]] = defaultdict(list)
    for event in events:
        by_id[event.request_id].append(event)
    assert set(by_id) == request_ids, f"billed {sorted(by_id)}, expected {sorted(request_ids)}"
    assert all(len(v) == 1 for v in by_id.values()), {k: len(v) for k, v in by_id.items()}
    return {k: v[0] for k, v in by_id.items()}


async def test_worker_alone_bills_once_when_usage_comes_back(bus: Bus, worker: WorkerService) -> None:
    finals: dict[str, TokenChunk] = {}
    done = asyncio.Event()

    async def on_chunk(chunk: TokenChunk, msg: Msg) -> None:
        if chunk.finish_reason is not None:
            finals[chunk.request_id] = chunk
            if len(finals) == 3:
                done.set()

    await bus.subscribe(bus.subjects.tokens_of_gateway("test-gw"), TokenChunk, on_chunk)
    await bus.js.delete_stream(bus.subjects.usage_stream)
    requests = [
        GenerateRequest(request_id=f"r{i}", model=MODEL, prompt=pack_tokens(list(range(10 + i))),
                        sampling=SamplingParams(max_tokens=8 + i, ignore_eos=True), org="org-a", key_id="k1",
                        token_subject=bus.subjects.tokens("test-gw", f"r{i}"))
        for i in range(3)
    ]
    for request in requests:
        await bus.request(bus.subjects.worker_generate(worker.worker_id), request, ControlReply, timeout=5)
    await asyncio.wait_for(done.wait(), 30)
    for request in requests:  # the last chunk carries what the worker bills
        event = finals[request.request_id].usage_event
        assert event is not None and event.completion_tokens == request.sampling.max_tokens
    await asyncio.sleep(OUTAGE_S)
    await _recreate_usage(bus)

    await eventually(lambda: worker.in_flight == 0, timeout=30, what="the worker's usage publishes to end")
    billed = _one_each(await usage_events(bus), {r.request_id for r in requests})
    for request in requests:
        event = billed[request.request_id]
        assert (event.prompt_tokens, event.completion_tokens) == (10 + int(request.request_id[1:]), request.sampling.max_tokens)
        assert event.worker_id == worker.worker_id and event.status == "length"


async def test_gateway_alone_bills_once_when_the_worker_died_after_its_final_chunk(
    bus: Bus, worker: WorkerService, gateway: GatewayService
) -> None:
    key, _ = await create_key(bus, org="outage-org")
    await bus.js.delete_stream(bus.subjects.usage_stream)
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(
            _post(http, gateway, key, {"model": MODEL, "prompt": f"bill me {i}", "max_tokens": 5 + i, "ignore_eos": True})
            for i in range(2)
        ))
    assert all(status == 200 for status, _ in answers), answers
    await _kill(worker)  # after its final chunks, before USAGE could store its usage events
    await asyncio.sleep(OUTAGE_S)
    await _recreate_usage(bus)

    expected = {payload["id"].removeprefix("cmpl-"): payload["usage"] for _, payload in answers}
    await eventually(lambda: gateway.bus.js_publishes_waiting == 0 and gateway.in_flight == 0, timeout=30,
                     what="the gateway's usage publishes to end")
    billed = _one_each(await usage_events(bus), set(expected))
    for request_id, usage in expected.items():
        event = billed[request_id]
        assert (event.prompt_tokens, event.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert event.org == "outage-org" and event.worker_id == "w-outage"


async def test_gateway_bills_a_request_no_worker_took_once_when_usage_comes_back(
    bus: Bus, worker: WorkerService, gateway: GatewayService
) -> None:
    """A request no worker takes (its only worker refuses it as draining: nothing started
    there, so the worker bills nothing) is billed by its gateway alone, to release what
    admission reserved. During the outage the refusal is answered while that bill waits in
    the background, and USAGE stores it once, when it is back."""
    key, _ = await create_key(bus, org="refused-org")
    worker.state = "draining"  # refuses every request (its registry entry may still read ready)
    await bus.js.delete_stream(bus.subjects.usage_stream)
    async with aiohttp.ClientSession() as http:
        status, payload = await _post(http, gateway, key, {"model": MODEL, "prompt": "refuse me", "max_tokens": 4})
    assert status == 503, payload
    assert gateway.bus.js_publishes_waiting == 1  # the bill waits, the request path did not
    await asyncio.sleep(OUTAGE_S)
    await _recreate_usage(bus)

    await eventually(lambda: gateway.bus.js_publishes_waiting == 0 and gateway.in_flight == 0, timeout=30,
                     what="the gateway's usage publish to end")
    [event] = await usage_events(bus)
    assert (event.org, event.status, event.worker_id, event.completion_tokens) == ("refused-org", "rejected", "", 0)


async def test_resumable_request_waits_out_its_record_bucket(
    bus: Bus, worker: WorkerService, gateway: GatewayService
) -> None:
    key, _ = await create_key(bus, org="resume-org")
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
    body = {"model": MODEL, "prompt": "keep me", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def resumable(http: aiohttp.ClientSession) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}", "X-Meshserve-Resumable": "true"}
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, sse_usage(await read_sse(r)) if r.status == 200 else await r.text()

    async with aiohttp.ClientSession() as http:
        assert (await _post(http, gateway, key, {"model": MODEL, "prompt": "hello", "max_tokens": 1}))[0] == 200  # key known
        await bus.js.delete_stream(kv_stream(bus.subjects.requests_bucket))
        answer = asyncio.create_task(resumable(http))
        await asyncio.sleep(OUTAGE_S)
        assert not answer.done(), answer.result()
        await requests_bucket(bus.js, bus.subjects)
        status, usage = await answer
    assert status == 200, usage
    assert usage is not None and usage["completion_tokens"] == 6
