"""Admission after its single nats-server is killed (-9) and started again on the same
port and store: the lease bucket is in memory, so it is gone after the restart. Admission
must provision it again and lead again, or every request is a 503 once the gateways'
fail-open grace is over.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bus import Bus, BusSettings, provision
from ops.natsserver import NatsServer
from proto import AdmissionDecision, AdmissionRequest
from services.admission.config import AdmissionConfig
from services.admission.lease import LEASE_KEY, lease_bucket_name
from services.admission.service import AdmissionService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-llama-8b"


@pytest.fixture
async def admissions(request: pytest.FixtureRequest, bus: Bus,
                     bus_settings: BusSettings) -> AsyncIterator[list[AdmissionService]]:
    await provision(bus.js, bus.subjects)
    started: list[AdmissionService] = []
    for i in range(request.param):  # 1: alone (as under meshserve up); 2: a leader and a standby
        service = AdmissionService(AdmissionConfig(), bus_settings, instance_id=f"adm-{i}")
        await service.start()
        started.append(service)
    yield started
    for service in started:
        if not service.stopped.is_set():
            await service.drain_and_close()


@pytest.fixture
async def worker(bus: Bus, bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    service = WorkerService(SimEngine(model=MODEL, speed=50.0), WorkerConfig(worker_id="w-restart"), bus_settings)
    await service.start()
    yield service
    if not service.stopped.is_set():
        await service.drain_and_close()


async def _check(bus: Bus, i: int) -> AdmissionDecision | None:
    request = AdmissionRequest(request_id=f"r{i}", org="org", key_id="k", model=MODEL, prompt_tokens=10,
                               max_tokens=10)
    try:
        return await bus.request(bus.subjects.admission_check, request, AdmissionDecision, timeout=2)
    except Exception:
        return None


async def _lease_holder(bus: Bus) -> str:
    try:
        kv = await bus.js.key_value(lease_bucket_name(bus.subjects))
        entry = await kv.get(LEASE_KEY)
    except Exception:
        return ""
    return (entry.value or b"").decode()


@pytest.mark.parametrize(("admissions", "down_s"), [(1, 1.0), (1, 5.0), (2, 1.0), (2, 5.0)],
                         indirect=["admissions"], ids=["alone-1s", "alone-5s", "standby-1s", "standby-5s"])
async def test_admission_leads_again_after_its_nats_server_restarts(
    nats_server: NatsServer, bus: Bus, admissions: list[AdmissionService], worker: WorkerService, down_s: float
) -> None:
    await eventually(lambda: sum(a.leading for a in admissions) == 1, timeout=20, what="an admission leader")
    await eventually(lambda: all(a.feed.registry_synced and len(a.book) == 1 for a in admissions), timeout=20,
                     what="admission to see the worker")
    assert (decision := await _check(bus, 0)) is not None and decision.admitted, decision

    both_led = False

    async def watch_leaders() -> None:
        nonlocal both_led
        while True:
            both_led = both_led or sum(a.leading for a in admissions) > 1
            await asyncio.sleep(0.01)

    watching = asyncio.create_task(watch_leaders())
    try:
        nats_server.kill()  # kill -9: JetStream's memory storage (the lease bucket) is lost
        await asyncio.sleep(down_s)
        nats_server.start()

        # The lease is held again (in a bucket provisioned again), by an instance that serves.
        holder = ""
        for _ in range(90):
            holder = await _lease_holder(bus)
            if holder and any(a.leading and a.instance_id == holder for a in admissions):
                break
            await asyncio.sleep(0.5)
        assert holder, "nobody holds the admission lease after the NATS restart"
        await asyncio.sleep(2 * AdmissionConfig().lease_ttl_s)  # and keeps it: renewals work
        assert await _lease_holder(bus) == holder
        assert [a.instance_id for a in admissions if a.leading] == [holder]
        answered = [await _check(bus, i) for i in range(1, 4)]
        assert all(d is not None and d.admitted for d in answered), answered
    finally:
        watching.cancel()
    assert not both_led, "two admission instances served at once"


async def test_a_worker_alone_stores_its_heartbeat_again_after_a_nats_restart(
    nats_server: NatsServer, bus: Bus, worker: WorkerService
) -> None:
    """Without admission (which also provisions it), the worker makes the registry bucket
    again: its heartbeats were refused for good (no stream) and every service lost it."""
    registry = await bus.js.key_value(bus.subjects.workers_bucket)
    assert await registry.get("w-restart")
    nats_server.kill()
    await asyncio.sleep(1.0)
    nats_server.start()
    found = False
    for _ in range(60):
        try:
            kv = await bus.js.key_value(bus.subjects.workers_bucket)
            found = bool((await kv.get("w-restart")).value)
        except Exception:
            found = False
        if found:
            break
        await asyncio.sleep(0.5)
    assert found, "the worker's heartbeat never reached a registry again"
