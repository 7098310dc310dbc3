"""A pool with no worker for a moment (both workers restarting, a rolling restart) is not a
model that does not exist: the gateway keeps listing it and answers its requests 503
``no_capacity`` with a Retry-After, which the OpenAI SDK retries (a 404 it takes as final);
a model never served is still a 404. Workers paused (SIGSTOP: they take nothing and answer
nothing) give a 503 with a Retry-After too. Real nats-server, services as tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from proto import GenerateRequest
from services.gateway.service import GatewayConfig, GatewayService
from services.router.service import RouterService, RouterServiceConfig
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually
from tests.gateway_mesh import gateway_service, known_key

MODEL = "sim-llama-8b"


@contextlib.asynccontextmanager
async def worker(bus_settings: BusSettings, worker_id: str, *, paused: asyncio.Event | None = None
                 ) -> AsyncIterator[WorkerService]:
    """A sim worker; ``paused``: its generate endpoint answers nothing until that is set (as
    a SIGSTOPped worker, whose registry entry lives on until its heartbeat expires)."""
    service = WorkerService(SimEngine(model=MODEL, speed=50.0, max_model_len=2048),
                            WorkerConfig(worker_id=worker_id), bus_settings)
    if paused is not None:
        handle = service.handle_generate

        async def stopped(request: GenerateRequest, msg: Msg) -> None:
            await paused.wait()
            await handle(request, msg)

        service.handle_generate = stopped  # type: ignore[method-assign]
    await service.start()
    try:
        yield service
    finally:
        if paused is not None:
            paused.set()  # nothing left waiting for the drain to wait out
        await service.drain_and_close()


async def post(http: aiohttp.ClientSession, gateway: GatewayService, key: str, model: str = MODEL
               ) -> tuple[int, dict[str, Any], str | None]:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    async with http.post(f"{gateway.http_url}/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json(), r.headers.get("Retry-After")


async def test_a_pool_with_no_worker_for_a_moment_answers_503_with_retry_after_and_stays_listed(
    bus: Bus, bus_settings: BusSettings
) -> None:
    async with gateway_service(bus_settings) as gateway, aiohttp.ClientSession() as http:
        headers = {"Authorization": "Bearer "}
        async with worker(bus_settings, "w1"):
            key = await known_key(bus, gateway, "acme")
            headers = {"Authorization": f"Bearer {key}"}
            status, data, _ = await post(http, gateway, key)
            assert status == 200, data
        # Its only worker is gone (stopped, as in a restart): the registry lists none.
        await eventually(lambda: not gateway.registry.workers, what="the worker to leave the registry")

        status, data, retry_after = await post(http, gateway, key)
        assert status == 503, data
        assert data["error"]["code"] == "no_capacity" and data["error"]["type"] == "server_error"
        assert retry_after is not None and int(retry_after) >= 1
        async with http.get(f"{gateway.http_url}/v1/models", headers=headers) as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        async with http.get(f"{gateway.http_url}/v1/models/{MODEL}", headers=headers) as r:
            assert r.status == 200
        status, data, _ = await post(http, gateway, key, model="never-served")
        assert status == 404 and data["error"]["code"] == "model_not_found"

        # The stock SDK retries the 503 (after its Retry-After) and gets the answer once a
        # worker is back; a 404 would have been final.
        client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=5)
        try:
            answer = asyncio.create_task(client.completions.create(model=MODEL, prompt="hello", max_tokens=3,
                                                                   extra_body={"ignore_eos": True}))
            await asyncio.sleep(0.5)  # its first try is answered 503
            assert not answer.done()
            async with worker(bus_settings, "w2"):
                completion = await answer
                assert completion.usage is not None and completion.usage.completion_tokens == 3
        finally:
            await client.close()


async def test_paused_workers_refusing_a_request_give_503_with_retry_after(
    bus: Bus, bus_settings: BusSettings
) -> None:
    paused = asyncio.Event()
    router = RouterService(RouterServiceConfig(), bus_settings)
    await router.start()
    try:
        async with (worker(bus_settings, "w1", paused=paused), worker(bus_settings, "w2", paused=paused),
                    gateway_service(bus_settings, GatewayConfig(port=0)) as gateway, aiohttp.ClientSession() as http):
            await eventually(lambda: router.stats()["placeable"] == 2, what="both workers placeable")
            key = await known_key(bus, gateway, "acme")
            status, data, retry_after = await post(http, gateway, key)
            assert status == 503, data
            assert "refused" in data["error"]["message"], data
            assert data["error"]["code"] == "no_capacity"
            assert retry_after is not None and int(retry_after) >= 1
            paused.set()  # SIGCONT: they answer again
            status, data, _ = await post(http, gateway, key)
            assert status == 200, data
    finally:
        await router.drain_and_close()

