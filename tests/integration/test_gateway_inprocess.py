"""Gateway behaviours tested with the services as tasks in this process: TLS, proxies, traces."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import trustme

from bus import Bus, BusSettings
from ops.keys import create_key
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService

MODEL = "sim-llama-8b"


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    service = WorkerService(SimEngine(model=MODEL, speed=50.0), WorkerConfig(worker_id="w1"), bus_settings)
    await service.start()
    yield service
    await service.drain_and_close()


async def _gateway(bus_settings: BusSettings, config: GatewayConfig) -> GatewayService:
    gateway = GatewayService(config, bus_settings)
    await gateway.start()
    return gateway


async def test_https_with_verification(bus_settings: BusSettings, bus: Bus, worker: WorkerService, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    gateway = await _gateway(bus_settings, GatewayConfig(port=0, tls_cert=str(cert_file), tls_key=str(key_file)))
    try:
        key, _ = await create_key(bus, org="tls-org")
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
        body = {"model": MODEL, "prompt": "secure", "max_tokens": 5, "ignore_eos": True}
        async with aiohttp.ClientSession() as http:
            for _ in range(30):  # the key watcher sees the new key
                async with http.post(f"https://127.0.0.1:{gateway.bound_port}/v1/completions", json=body, ssl=client_ctx,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    status, payload = r.status, await r.json()
                if status != 401:
                    break
            assert status == 200 and payload["usage"]["completion_tokens"] == 5
            # plain verification without our CA fails: the certificate really is checked
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.get(f"https://127.0.0.1:{gateway.bound_port}/healthz", ssl=ssl.create_default_context())
    finally:
        await gateway.drain_and_close()


async def test_forwarded_for_only_from_trusted_proxies(bus_settings: BusSettings, worker: WorkerService) -> None:
    gateway = await _gateway(bus_settings, GatewayConfig(port=0, trusted_proxies=("127.0.0.0/8",)))
    try:
        from aiohttp.test_utils import make_mocked_request

        trusted = make_mocked_request("GET", "/", headers={"X-Forwarded-For": "203.0.113.9, 10.0.0.2"})
        trusted._transport_peername = ("127.0.0.1", 5555)  # type: ignore[attr-defined]
        assert gateway.client_address(trusted) == "10.0.0.2"  # nearest hop that is not a trusted proxy
        untrusted_gateway = replace(gateway.config, trusted_proxies=())
        gateway2 = GatewayService(untrusted_gateway, bus_settings)
        assert gateway2.client_address(trusted) == "127.0.0.1"
    finally:
        await gateway.drain_and_close()


async def test_request_queued_past_the_stall_timeout_stays_on_its_live_worker(
    bus_settings: BusSettings, bus: Bus
) -> None:
    """One sequence at a time: the second request waits longer than --stall-timeout behind the
    first. The worker's probe says it is queued on a live engine, so it is not migrated (with
    one worker, a migration would end it with worker_lost)."""
    import asyncio

    engine = SimEngine(model=MODEL, speed=1.0, max_num_seqs=1)
    worker = WorkerService(engine, WorkerConfig(worker_id="w-one"), bus_settings)
    await worker.start()
    gateway = await _gateway(bus_settings, GatewayConfig(port=0, stall_timeout_s=1.0))
    try:
        key, _ = await create_key(bus, org="queue-org")
        url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"

        async def complete(http: aiohttp.ClientSession, max_tokens: int) -> tuple[int, dict]:  # type: ignore[type-arg]
            body = {"model": MODEL, "prompt": "queued", "max_tokens": max_tokens, "ignore_eos": True}
            for _ in range(30):  # the key watcher sees the new key
                async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    status, payload = r.status, await r.json()
                if status != 401:
                    break
                await asyncio.sleep(0.1)
            return status, payload

        async with aiohttp.ClientSession() as http:
            assert (await complete(http, 1))[0] == 200
            loop = asyncio.get_running_loop()
            started = loop.time()
            first = asyncio.create_task(complete(http, 600))
            await asyncio.sleep(0.2)
            second = await complete(http, 5)
            waited = loop.time() - started
            assert second[0] == 200, second
            assert second[1]["usage"]["completion_tokens"] == 5
            assert (await first)[0] == 200
        assert waited > 2 * gateway.config.stall_timeout_s, f"the second request waited only {waited:.1f}s: no stall to test"
        probes = {s.labels["outcome"]: s.value for m in gateway.metrics.stall_probes.collect() for s in m.samples
                  if s.name.endswith("_total")}
        assert probes.get("queued", 0) >= 1 and probes.get("stalled", 0) == 0
        assert gateway.metrics.migrations._value.get() == 0
    finally:
        await gateway.drain_and_close()
        await worker.drain_and_close()
