"""compose/healthcheck.py, the images' HEALTHCHECK and the Nomad script checks."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

from bus import BusSettings
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.deploy.deployspec import COMPOSE_DIR


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("meshserve_healthcheck", COMPOSE_DIR / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load()


def fake_proc(tmp_path: Path, processes: dict[int, list[str]]) -> Path:
    for pid, argv in processes.items():
        (tmp_path / str(pid)).mkdir(parents=True)
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_finds_the_service_process(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {
        1: ["/sbin/docker-init", "--", "meshserve", "serve", "router", "--metrics-port", "9101"],
        7: ["/bin/sh", "-c", "meshserve-healthcheck"],
    })
    assert healthcheck.find_service(proc) == ("router", ["--metrics-port", "9101"])
    proc2 = fake_proc(tmp_path / "b", {12: ["/usr/bin/python3", "-m", "ops.cli", "serve", "worker", "--worker-id", "w1"]})
    assert healthcheck.find_service(proc2) == ("worker", ["--worker-id", "w1"])
    assert healthcheck.find_service(fake_proc(tmp_path / "c", {3: ["nats-server", "-c", "x.conf"]})) is None


def test_parses_with_the_service_parser() -> None:
    options = healthcheck.parse("gateway", ["--host", "0.0.0.0", "--port", "8080", "--gateway-id", "gw-1"])
    assert (options.port, options.gateway_id, options.host) == (8080, "gw-1", "0.0.0.0")
    assert healthcheck.local_address("0.0.0.0") == "127.0.0.1"
    assert healthcheck.instance_matches("worker-abc", "worker-abc", "ignored")
    assert not healthcheck.instance_matches("worker-abc", "worker-xyz", "abc")
    assert healthcheck.instance_matches("metering-3f2a9c1d0b7e-a1b2c3", "", "3f2a9c1d0b7e")


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    service = WorkerService(SimEngine(model="sim-llama-8b", speed=50.0), WorkerConfig(worker_id="hc-w1"), bus_settings)
    await service.start()
    yield service
    await service.drain_and_close()


async def test_healthy_and_unhealthy(nats_url: str, bus_settings: BusSettings, worker: WorkerService,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_NATS_URL", nats_url)
    ok = healthcheck.parse("worker", ["--worker-id", "hc-w1"])
    assert await asyncio.to_thread(healthcheck.check, "worker", ok) == []
    other = healthcheck.parse("worker", ["--worker-id", "somebody-else"])
    assert await asyncio.to_thread(healthcheck.check, "worker", other) == [
        "this worker does not answer $SRV.PING.meshserve-worker"]

    gateway = GatewayService(GatewayConfig(port=0, gateway_id="hc-gw"), bus_settings)
    await gateway.start()
    try:
        options = healthcheck.parse("gateway", ["--port", str(gateway.bound_port), "--gateway-id", "hc-gw"])
        assert await asyncio.to_thread(healthcheck.check, "gateway", options) == []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        wrong_port = healthcheck.parse("gateway", ["--port", str(closed), "--gateway-id", "hc-gw"])
        problems = await asyncio.to_thread(healthcheck.check, "gateway", wrong_port)
        assert problems == [f"gateway /healthz on port {closed} does not answer 200"]
    finally:
        await gateway.drain_and_close()


async def test_unreachable_nats_is_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MESHSERVE_NATS_URL", f"nats://127.0.0.1:{port}")
    problems = await asyncio.to_thread(healthcheck.check, "metering", healthcheck.parse("metering", []))
    assert len(problems) == 1 and problems[0].startswith("NATS:")
