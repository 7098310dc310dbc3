"""The NATS API front door's promises: a requester that goes away cancels its request, a
client may cancel (``mesh.api.v1.cancel``) or give a deadline (``Meshserve-Timeout``), every
stream ends with ``Meshserve-Done``, errors carry NATS micro's error headers and replies the
request id. A sim worker and the gateway run as tasks in this process, on a real nats-server;
the client is a separate nats-py connection, as an application's would be."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from ops.keys import create_key
from ops.nats.accounts import inbox_prefix, render_accounts
from proto import UsageEvent
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually, usage_events
from tests.deploy.natsauth import API_CLIENTS, PASSWORDS, AuthNatsServer, settings_for
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

LONG = 1500  # tokens: far more than a test lets run before it goes away or cancels


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings, speed=5.0) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


@pytest.fixture
async def key(bus: Bus, gateway: GatewayService) -> str:
    return await known_key(bus, gateway, "nats-api-org")


@pytest.fixture
async def client(bus_settings: BusSettings) -> AsyncIterator[Client]:
    nc = await nats.connect(list(bus_settings.servers))
    yield nc
    await nc.close()


class Stream:
    """A streamed NATS API reply, read as the README's client reads it."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []
        self.done = asyncio.Event()
        self.some = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        self.messages.append(msg)
        if len(self.messages) >= 3:
            self.some.set()
        headers = msg.headers or {}
        if headers.get("Meshserve-Done") or headers.get("Nats-Service-Error-Code"):
            self.done.set()

    @property
    def request_id(self) -> str:
        return (self.messages[0].headers or {})["Meshserve-Request-Id"]

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(m.data) for m in self.messages if m.data]


async def _stream(nc: Client, subject: str, body: dict[str, Any], key: str) -> tuple[Stream, Any]:
    stream = Stream()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=stream.on_message)
    await nc.publish(subject, json.dumps({**body, "stream": True}).encode(), reply=inbox,
                     headers={"Authorization": f"Bearer {key}"})
    return stream, sub


async def _usage_of(bus: Bus, request_id: str) -> UsageEvent:
    for _ in range(300):
        events = [e for e in await usage_events(bus) if e.request_id == request_id and e.status != "migrated"]
        if events:
            return events[-1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no usage event for {request_id}")


def _chat(max_tokens: int = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens,
            "ignore_eos": True, **extra}


async def test_a_streaming_requester_that_goes_away_cancels_its_request(
        bus: Bus, gateway: GatewayService, key: str, client: Client) -> None:
    stream, sub = await _stream(client, bus.subjects.api_chat, _chat(), key)
    await asyncio.wait_for(stream.some.wait(), 30)
    await sub.unsubscribe()  # the requester leaves: nobody listens on its inbox any more
    usage = await _usage_of(bus, stream.request_id)
    assert usage.status == "cancelled" and usage.completion_tokens < LONG, usage
    assert gateway.streams_in_flight == 0


async def test_a_client_cancels_its_own_streaming_request_and_no_one_elses(
        bus: Bus, gateway: GatewayService, key: str, client: Client) -> None:
    stream, _ = await _stream(client, bus.subjects.api_chat, _chat(stream_options={"include_usage": True}), key)
    await asyncio.wait_for(stream.some.wait(), 30)
    request_id = stream.request_id

    other = await known_key(bus, gateway, "nats-api-other-org")
    refused = await client.request(bus.subjects.api_cancel, b"", timeout=10, headers={
        "Authorization": f"Bearer {other}", "Meshserve-Request-Id": request_id})
    assert (refused.headers or {}).get("Nats-Service-Error-Code") == "404", refused
    unknown = await client.request(bus.subjects.api_cancel, json.dumps({"id": "0" * 24}).encode(), timeout=10,
                                   headers={"Authorization": f"Bearer {key}"})
    assert (unknown.headers or {}).get("Nats-Service-Error-Code") == "404"
    keyless = await client.request(bus.subjects.api_cancel, b"", timeout=10, headers={"Meshserve-Request-Id": request_id})
    assert (keyless.headers or {}).get("Nats-Service-Error-Code") == "401"
    assert not stream.done.is_set()

    ack = await client.request(bus.subjects.api_cancel, json.dumps({"id": request_id}).encode(), timeout=10,
                               headers={"Authorization": f"Bearer {key}"})
    assert json.loads(ack.data) == {"id": request_id, "object": "request.cancel", "cancelled": True}, ack.data
    await asyncio.wait_for(stream.done.wait(), 30)
    chunks = stream.chunks()
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] == "abort"
    # The sim's tokens are one character each.
    streamed = sum(len(c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    assert chunks[-1]["usage"]["completion_tokens"] == streamed < LONG  # what was streamed, was billed
    assert (await _usage_of(bus, request_id)).completion_tokens == streamed


async def test_a_missing_key_is_explained_in_nats_terms(bus: Bus, gateway: GatewayService, client: Client) -> None:
    reply = await client.request(bus.subjects.api_chat, json.dumps(_chat(2)).encode(), timeout=10)
    error = json.loads(reply.data)["error"]
    assert (reply.headers or {}).get("Nats-Service-Error-Code") == "401" and error["code"] == "missing_api_key"
    assert "header" in error["message"] and "WebSocket" not in error["message"], error


@pytest.mark.parametrize("target", ["$KV.mesh_responses.victim.resp_1", "mesh.usage.victim-org", "$JS.API.STREAM.LIST"])
async def test_the_gateway_answers_only_on_an_inbox(bus: Bus, gateway: GatewayService, key: str, client: Client,
                                                      target: str) -> None:
    """A client names the subject a reply goes to: it could have the gateway (which may
    write the mesh's KV buckets, usage and worker subjects) publish its answer onto another
    tenant's stored response. Subjects under ``$`` and the mesh's root get no answer."""
    seen: list[Msg] = []

    async def on_message(msg: Msg) -> None:
        seen.append(msg)

    watch = await bus.nc.subscribe(target, cb=on_message)
    body = json.dumps(_chat(2)).encode()
    for subject in (bus.subjects.api_chat, bus.subjects.api_cancel):
        await client.publish(subject, body, reply=target, headers={"Authorization": f"Bearer {key}"})
    # A request after them, answered: the gateway has read theirs by then (one connection, in order).
    reply = await client.request(bus.subjects.api_chat, body, timeout=30, headers={"Authorization": f"Bearer {key}"})
    assert json.loads(reply.data)["usage"]["completion_tokens"] == 2
    await bus.nc.flush()
    await asyncio.sleep(0.5)  # a relayed answer would follow its request's own round trip
    await watch.unsubscribe()
    assert seen == []


async def test_a_reply_carries_the_request_id(bus: Bus, gateway: GatewayService, key: str, client: Client) -> None:
    reply = await client.request(bus.subjects.api_chat, json.dumps(_chat(3)).encode(), timeout=30,
                                 headers={"Authorization": f"Bearer {key}"})
    assert json.loads(reply.data)["usage"]["completion_tokens"] == 3
    assert len((reply.headers or {}).get("Meshserve-Request-Id", "")) == 24, reply.headers


async def test_a_deadline_cancels_a_request(bus: Bus, gateway: GatewayService, key: str, client: Client) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    late = await client.request(bus.subjects.api_chat, json.dumps(_chat()).encode(), timeout=30,
                                headers={**headers, "Meshserve-Timeout": "1.5"})
    late_headers = late.headers or {}
    assert late_headers.get("Nats-Service-Error-Code") == "504", late.data
    assert json.loads(late.data)["error"]["code"] == "timeout"
    usage = await _usage_of(bus, late_headers["Meshserve-Request-Id"])
    assert usage.status == "cancelled" and usage.completion_tokens < LONG, usage

    bad = await client.request(bus.subjects.api_chat, json.dumps(_chat(3)).encode(), timeout=10,
                               headers={**headers, "Meshserve-Timeout": "soon"})
    assert (bad.headers or {}).get("Nats-Service-Error-Code") == "400"


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_a_stream_of_several_choices_without_usage_still_ends_with_done(
        bus: Bus, gateway: GatewayService, key: str, client: Client, api: str) -> None:
    if api == "chat":
        subject, body = bus.subjects.api_chat, _chat(4, n=2)
    else:
        subject = bus.subjects.api_completions
        body = {"model": MODEL, "prompt": "count", "max_tokens": 4, "ignore_eos": True, "n": 2}
    stream, _ = await _stream(client, subject, body, key)
    await asyncio.wait_for(stream.done.wait(), 30)
    last = stream.messages[-1].headers or {}
    assert last.get("Meshserve-Done") == "1" and "Nats-Service-Error-Code" not in last
    finished = {c["choices"][0]["index"] for c in stream.chunks() if c["choices"][0].get("finish_reason")}
    assert finished == {0, 1}


async def test_an_error_mid_stream_carries_the_nats_error_headers(bus_settings: BusSettings, bus: Bus) -> None:
    """Its worker lost, with no migration allowed: the stream ends with worker_lost."""
    config = GatewayConfig(port=0, max_migrations=0, stall_timeout_s=1.0)
    worker = WorkerService(SimEngine(model=MODEL, speed=2.0), WorkerConfig(worker_id="w-lost"), bus_settings)
    await worker.start()
    try:
        async with gateway_service(bus_settings, config) as gateway:
            key = await known_key(bus, gateway, "nats-api-lost-org")
            nc = await nats.connect(list(bus_settings.servers))
            try:
                stream, _ = await _stream(nc, bus.subjects.api_chat, _chat(), key)
                await asyncio.wait_for(stream.some.wait(), 30)
                await worker.bus.nc.close()  # the worker vanishes mid-stream
                await asyncio.wait_for(stream.done.wait(), 60)
            finally:
                await nc.close()
    finally:
        with contextlib.suppress(Exception):  # its connection is gone: the drain fails part way
            await asyncio.wait_for(worker.drain_and_close(), 10)
    last = stream.messages[-1]
    headers = last.headers or {}
    assert headers.get("Nats-Service-Error-Code") == "502" and headers.get("Nats-Service-Error"), headers
    assert headers.get("Meshserve-Done") == "1"
    assert json.loads(last.data)["error"]["code"] == "worker_lost"


async def test_under_nats_permissions_a_cancel_reaches_the_gateway_relaying_the_request(
        tmp_path: Path) -> None:
    """The API client user of ops/nats/accounts.py may cancel; the gateway its cancel reaches
    is not the one relaying the request (that one drains: its endpoints are stopped), so the
    cancel goes on to it over the gateways' own subject. No permission is violated."""
    server = AuthNatsServer(store_dir=tmp_path / "nats-auth", log_file=tmp_path / "nats-auth.log",
                            accounts=render_accounts("mesh", passwords=PASSWORDS, api_clients=API_CLIENTS))
    server.start()
    started: list[Any] = []
    try:
        worker = WorkerService(SimEngine(model=MODEL, speed=5.0), WorkerConfig(worker_id="w1"),
                               settings_for(server, "worker"))
        gateways = [GatewayService(GatewayConfig(port=0, gateway_id=f"gw-{i}"), settings_for(server, "gateway"))
                    for i in (1, 2)]
        for service in (worker, *gateways):
            await service.start()
            started.append(service)
        ops = await Bus.open(settings_for(server, "ops"), "ops-test", initial_attempts=20)
        started.append(ops)
        key, record = await create_key(ops, org="nats-api-perm-org")
        for g in gateways:
            def ready(g: GatewayService = g) -> bool:
                return record.key_id in g.auth.records and bool(g.registry.ready_workers(MODEL))

            await eventually(ready, what="the key and the worker at both gateways")
        app = await nats.connect(server.url, user="app", password=PASSWORDS["app"], inbox_prefix=inbox_prefix("app"))
        try:
            stream, _ = await _stream(app, ops.subjects.api_chat, _chat(), key)
            await asyncio.wait_for(stream.some.wait(), 30)
            owner = next(g for g in gateways if stream.request_id in g.dispatcher.streams)
            await owner.stop_endpoints()  # as in a drain: it relays on, no new request or cancel reaches it
            ack = await app.request(ops.subjects.api_cancel, b"", timeout=10, headers={
                "Authorization": f"Bearer {key}", "Meshserve-Request-Id": stream.request_id})
            assert json.loads(ack.data)["cancelled"] is True, ack.data
            await asyncio.wait_for(stream.done.wait(), 30)
            assert [c for c in stream.chunks() if c.get("choices")][-1]["choices"][0]["finish_reason"] == "abort"
        finally:
            await app.close()
        assert server.violations() == []
    finally:
        for service in reversed(started):
            with contextlib.suppress(Exception):
                await (service.close() if isinstance(service, Bus) else service.drain_and_close())
        server.stop()
