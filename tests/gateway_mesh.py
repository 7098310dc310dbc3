"""The gateway's HTTP tests' mesh: one sim worker and one gateway as tasks in this
process, on the test's nats-server, and a key the gateway already knows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from bus import Bus, BusSettings
from ops.keys import create_key
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService

MODEL = "sim-llama-8b"


@asynccontextmanager
async def sim_worker(
    bus_settings: BusSettings, *, speed: float = 20.0, max_model_len: int = 2048
) -> AsyncIterator[WorkerService]:
    service = WorkerService(
        SimEngine(model=MODEL, speed=speed, max_model_len=max_model_len),
        WorkerConfig(worker_id="w1"),
        bus_settings,
    )
    await service.start()
    try:
        yield service
    finally:
        await service.drain_and_close()


@asynccontextmanager
async def gateway_service(
    bus_settings: BusSettings, config: GatewayConfig | None = None
) -> AsyncIterator[GatewayService]:
    service = GatewayService(config or GatewayConfig(port=0), bus_settings)
    await service.start()
    try:
        yield service
    finally:
        await service.drain_and_close()


async def known_key(bus: Bus, gateway: GatewayService, org: str) -> str:
    """A new key of ``org``, once the gateway knows it and serves a model."""
    made, _ = await create_key(bus, org=org)
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            async with http.get(
                f"{gateway.http_url}/v1/models", headers={"Authorization": f"Bearer {made}"}
            ) as r:
                if r.status == 200 and (await r.json())["data"]:
                    return made
            await asyncio.sleep(0.1)
    pytest.fail("the gateway never accepted the new key or saw the worker")
