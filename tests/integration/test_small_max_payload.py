"""A mesh on a NATS server with NATS's own 1 MB ``max_payload`` (an operator's server,
joined with ``--nats-url``), where an answer can outgrow what the bus carries: the
prompt log probabilities of a long prompt travel in one chunk (never streamed, as in
vLLM), and a non-streamed NATS API reply is one message. Each must end as a client error
naming what to change, with nothing left running and every run billed, never as a
stream that stops without an end or a caller left to its timeout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from ops.natsserver import NatsServer
from proto import ControlReply, GenerateRequest, SamplingParams, TokenChunk, UsageEvent, pack_tokens
from services.gateway.service import GatewayService
from services.worker.service import WorkerService
from tests.conftest import eventually, usage_events
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

NATS_DEFAULT_MAX_PAYLOAD = 1024 * 1024
ORG = "payload-org"


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
        key = await known_key(bus, gateway, ORG)
        yield worker, gateway, key


async def billed(bus: Bus, count: int) -> list[UsageEvent]:
    """The test org's usage events, once ``count`` are stored (or what there is after 10 s)."""
    events: list[UsageEvent] = []
    for _ in range(100):
        events = [e for e in await usage_events(bus) if e.org == ORG and e.prompt_tokens > 1_000]
        if len(events) >= count:
            break
        await asyncio.sleep(0.1)
    return events


async def test_the_gateway_sizes_prompt_logprobs_to_the_bus_it_is_on(
    bus: Bus, mesh: tuple[WorkerService, GatewayService, str], caplog: pytest.LogCaptureFixture,
) -> None:
    worker, gateway, key = mesh
    assert bus.max_payload == NATS_DEFAULT_MAX_PAYLOAD
    # Each service says at start-up that its NATS is smaller than meshserve's limits assume.
    assert any("allows messages of 1048576 bytes (max_payload)" in r.getMessage()
               for r in caplog.get_records("setup")), [r.getMessage() for r in caplog.get_records("setup")]
    # 6,000 tokens × 21 entries: within what one response carries on meshserve's 8 MiB bus
    # (200,000), past this one's share (25,000): refused before any engine works on it.
    body = {"model": MODEL, "prompt": "ab" * 3_000, "max_tokens": 4, "prompt_logprobs": 20}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(f"{gateway.http_url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
            status, payload = r.status, await r.json()
    assert status == 400 and payload["error"]["param"] == "prompt_logprobs", payload
    assert "one response carries at most 25,000" in payload["error"]["message"]
    assert worker.engine.stats().running == 0 and not await billed(bus, 0)


async def test_a_nats_api_reply_larger_than_a_message_is_an_error_reply_at_once(
    bus: Bus, mesh: tuple[WorkerService, GatewayService, str],
) -> None:
    """nats-py raised in the handler and the caller waited for its timeout. Here every
    chunk fits (16 tokens' candidates at most) and the reply, 6,000 tokens with 20
    candidates each as JSON, does not."""
    _, _, key = mesh
    body = json.dumps({"model": MODEL, "prompt": "ab" * 600, "max_tokens": 6_000, "ignore_eos": True,
                       "logprobs": 20}).encode()
    reply = await bus.nc.request(bus.subjects.api_completions, body, headers={"api-key": key}, timeout=60)
    assert (reply.headers or {}).get("Nats-Service-Error-Code") == "400", reply.data[:300]
    error = json.loads(reply.data)["error"]
    assert "more than one NATS message carries here" in error["message"] and error["code"] == "response_too_large"
    assert len(await billed(bus, 1)) == 1  # it ran, and was billed as any run is


def generate_request(bus: Bus, request_id: str, *, max_tokens: int, n: int = 1) -> GenerateRequest:
    # 6,000 prompt tokens with 20 candidates each: some MB in one chunk, more than this bus
    # carries. (Sent to the worker directly: the gateway refuses it, as above.)
    return GenerateRequest(
        request_id=request_id, model=MODEL, prompt=pack_tokens([97, 98] * 3_000),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7, prompt_logprobs=20, n=n),
        token_subject=bus.subjects.tokens("test-gw", request_id), org=ORG, key_id="k1",
    )


async def test_a_chunk_the_bus_cannot_carry_ends_its_request_as_a_client_error(
    bus: Bus, mesh: tuple[WorkerService, GatewayService, str],
) -> None:
    """The worker's own guard, for what the gateway cannot size exactly (a real
    tokenizer's long token texts): the stream fell silent, the gateway's stall timeout
    migrated it and the client got a 502 after ~45 s."""
    worker, _, _ = mesh
    finals: dict[str, TokenChunk] = {}
    got_all = asyncio.Event()
    cases = {"mid-stream": (4, 1), "scoring": (1, 1), "n2-mid-stream": (4, 2), "n2-scoring": (1, 2)}

    async def on_chunk(chunk: TokenChunk, msg: Msg) -> None:
        if chunk.finish_reason is not None:
            finals[chunk.request_id] = chunk
            if len(finals) == len(cases):
                got_all.set()

    await bus.subscribe(bus.subjects.tokens_of_gateway("test-gw"), TokenChunk, on_chunk)
    for request_id, (max_tokens, n) in cases.items():
        # "scoring": max_tokens 1, the engine has finished when the prompt's logprobs fail
        # to go, which must still fail the request, not answer without them
        await bus.request(bus.subjects.worker_generate(worker.worker_id),
                          generate_request(bus, request_id, max_tokens=max_tokens, n=n), ControlReply, timeout=10)
    await asyncio.wait_for(got_all.wait(), 60)
    for request_id, final in finals.items():
        assert final.finish_reason == "error" and final.error is not None, (request_id, final)
        assert final.error.code == "bad_request" and "does not fit one message on the bus" in final.error.message
        assert "prompt_logprobs" in final.error.message
    await eventually(lambda: not worker._requests, 10, "the worker to release the requests")
    stats = worker.engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    events = await billed(bus, len(cases))
    assert sorted(e.request_id for e in events) == sorted(cases) and all(e.status == "failed" for e in events)



async def test_when_one_choice_fails_its_siblings_stop(
    bus: Bus, mesh: tuple[WorkerService, GatewayService, str],
) -> None:
    """An error in any choice fails a request of n; its other choices ran to their end
    (here 2,000 tokens) for nobody, holding the engine and billing the org for them."""
    worker, _, _ = mesh
    ends: dict[int, TokenChunk] = {}
    final: asyncio.Future[TokenChunk] = asyncio.get_running_loop().create_future()

    async def on_chunk(chunk: TokenChunk, msg: Msg) -> None:
        if chunk.choice_finish_reason is not None:
            ends[chunk.index] = chunk
        if chunk.finish_reason is not None and not final.done():
            final.set_result(chunk)

    await bus.subscribe(bus.subjects.tokens_of_gateway("test-gw"), TokenChunk, on_chunk)
    # Choice 0 carries the prompt's logprobs, which the bus cannot: it fails at its first chunk.
    await bus.request(bus.subjects.worker_generate(worker.worker_id),
                      generate_request(bus, "n2-long", max_tokens=2_000, n=2), ControlReply, timeout=10)
    end = await asyncio.wait_for(final, 60)
    assert end.finish_reason == "error" and end.error is not None and end.error.code == "bad_request"
    assert ends[0].choice_finish_reason == "error"
    assert ends[1].choice_finish_reason == "abort", ends[1]
    [event] = await billed(bus, 1)
    assert event.status == "failed" and event.completion_tokens < 2_000, event
    await eventually(lambda: not worker._requests, 10, "the worker to release the request")
    assert worker.engine.stats().running == 0
