"""A mesh on a NATS server with NATS's own 1 MB ``max_payload`` (an operator's server,
joined with ``--nats-url``), where a response chunk can outgrow what the bus carries:
the prompt log probabilities of a long prompt travel in one chunk (never streamed, as
in vLLM). The request must end
with a client error naming what to change, billed, with nothing left running, never as
a stream that stops without an end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus, BusSettings
from ops.natsserver import NatsServer
from proto import UsageEvent
from services.gateway.service import GatewayService
from services.worker.service import WorkerService
from tests.conftest import eventually, usage_events
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

NATS_DEFAULT_MAX_PAYLOAD = 1024 * 1024


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log",
                        max_payload=NATS_DEFAULT_MAX_PAYLOAD).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def mesh(bus_settings: BusSettings, bus: Bus) -> AsyncIterator[tuple[WorkerService, GatewayService, str]]:
    async with sim_worker(bus_settings, speed=50.0, max_model_len=8192) as worker, \
            gateway_service(bus_settings) as gateway:
        key = await known_key(bus, gateway, "payload-org")
        yield worker, gateway, key


# 6,000 prompt tokens × 21 entries: within the gateway's bound (one response may carry
# 200,000), several MB of log probabilities: more than this server's 1 MB.
BODY = {"model": MODEL, "prompt": "ab" * 3_000, "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": 20}


async def test_prompt_logprobs_past_the_bus_limit_end_as_a_400_billed_and_released(
    bus: Bus, mesh: tuple[WorkerService, GatewayService, str], caplog: pytest.LogCaptureFixture,
) -> None:
    worker, gateway, key = mesh
    assert bus.max_payload == NATS_DEFAULT_MAX_PAYLOAD
    # Each service says at start-up that its NATS is smaller than meshserve's limits assume.
    assert any("allows messages of 1048576 bytes (max_payload)" in r.getMessage()
               for r in caplog.get_records("setup")), [r.getMessage() for r in caplog.get_records("setup")]
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{gateway.http_url}/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url, json=BODY, headers=headers) as r:
            status, payload = r.status, await r.json()
        assert status == 400, payload
        assert payload["error"]["type"] == "invalid_request_error"
        assert "does not fit one message on the bus" in payload["error"]["message"]
        assert "prompt_logprobs" in payload["error"]["message"]

        # The scoring call (max_tokens 1): the engine has finished when the prompt's log
        # probabilities fail to go, which must still fail the request, not answer without them.
        async with http.post(url, json={**BODY, "max_tokens": 1}, headers=headers) as r:
            status, payload = r.status, await r.json()
        assert status == 400 and "does not fit one message on the bus" in payload["error"]["message"], payload

        # n > 1: the choice carrying the prompt's log probabilities fails the request the same way.
        for max_tokens in (4, 1):  # mid-stream, and the choice's own end chunk after the engine finished
            async with http.post(url, json={**BODY, "n": 2, "max_tokens": max_tokens}, headers=headers) as r:
                status, payload = r.status, await r.json()
            assert status == 400 and "does not fit one message on the bus" in payload["error"]["message"], payload

        # The NATS API's non-streamed reply is the JSON body in one message, about twice
        # the worker's chunk: here the chunk fits and the reply does not. The caller gets an
        # error message at once (nats-py raised, and the caller waited for its timeout).
        body = json.dumps({**BODY, "prompt": "ab" * 1_500}).encode()
        reply = await bus.nc.request(bus.subjects.api_completions, body, headers={"api-key": key}, timeout=30)
        assert (reply.headers or {}).get("Nats-Service-Error-Code") == "400", reply.data[:300]
        error = json.loads(reply.data)["error"]
        assert "more than one NATS message carries here" in error["message"] and error["code"] == "response_too_large"

        # Nothing left behind: the worker holds no request, the engine no sequence, and
        # every request was billed once.
        await eventually(lambda: not worker._requests, 10, "the worker to release the requests")
        stats = worker.engine.stats()
        assert stats.running == 0 and stats.waiting == 0
        events_now: list[UsageEvent] = []

        async def billed() -> int:
            events_now[:] = [e for e in await usage_events(bus) if e.org == "payload-org" and e.prompt_tokens > 2_000]
            return len(events_now)

        for _ in range(100):
            if await billed() >= 5:
                break
            await asyncio.sleep(0.1)
        assert len(events_now) == 5, events_now
        assert sum(e.status == "failed" for e in events_now) == 4, events_now  # the NATS reply's was served

        # What fits is served as before.
        async with http.post(url, json={**BODY, "prompt": "ab" * 100}, headers=headers) as r:
            status, payload = r.status, await r.json()
        assert status == 200 and len(payload["choices"][0]["prompt_logprobs"]) == 200, payload
