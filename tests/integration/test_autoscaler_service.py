"""The autoscaler shell on a real nats-server, with a recording driver and hand-made workers.

The "workers" here are registry entries, gauges and a control endpoint the test writes
itself, so every path is deterministic and fast: scale up from gauges, scale down by a
drain that is acknowledged and ends with deregistration, the forced stop of a drain that
outlives its timeout, a drain nobody acknowledges (never followed by a kill), a failing
driver (reported, backed off), status over NATS and ``meshserve status``, /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from bus import Bus, BusSettings
from bus.provision import workers_bucket
from ops.status import fetch_status, print_status
from proto import ControlCommand, ControlReply, PoolDemand, WorkerGauge, WorkerInfo, encode
from services.autoscaler.control import PoolPolicy
from services.autoscaler.drivers import Driver, Launch, WorkerRef
from services.autoscaler.service import AutoscalerConfig, AutoscalerService
from tests.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]
POOL = "org/test-model"


class RecordingDriver(Driver):
    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.fail_starts = False
        self._n = 0

    async def start(self, pool: str, count: int) -> Launch:
        self.calls.append(("start", pool, count))
        if self.fail_starts:
            raise self.fail("max_reached", f"no room for {count} more {pool}")
        ids = []
        for _ in range(count):
            self._n += 1
            ids.append(f"new-{self._n}")
        self.succeeded()
        return Launch(count, tuple(ids))

    async def stop(self, ref: WorkerRef) -> None:
        self.calls.append(("stop", ref))

    async def stopped(self, ref: WorkerRef) -> None:
        self.calls.append(("stopped", ref))

    def describe(self) -> str:
        return "recording"

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


class FakeWorkers:
    """Registry entries, gauges and control endpoints for workers that do not exist."""

    def __init__(self, bus: Bus, kv: KeyValue) -> None:
        self.bus = bus
        self.kv = kv
        self.info: dict[str, WorkerInfo] = {}
        self.load: dict[str, dict[str, Any]] = {}
        self.commands: list[tuple[str, ControlCommand]] = []
        self.answer_control = True
        self._task: asyncio.Task[None] | None = None

    async def add(self, worker_id: str, *, host: str = "", **load: Any) -> None:
        info = WorkerInfo(worker_id=worker_id, model=POOL, engine="sim", state="ready", host=host or f"host-{worker_id}",
                          pid=1234, heartbeat_at=time.time())
        self.info[worker_id] = info
        self.load[worker_id] = dict(load)
        await self.kv.put(worker_id, encode(info))

        async def on_control(msg: Msg) -> None:
            from proto import decode

            command = decode(msg.data, ControlCommand)
            self.commands.append((worker_id, command))
            if not self.answer_control:
                return  # a hung worker: the request times out
            if command.command == "drain":
                await self.set_state(worker_id, "draining")
            await msg.respond(encode(ControlReply(worker_id=worker_id, state="draining", in_flight=2)))

        await self.bus.nc.subscribe(self.bus.subjects.worker_control(worker_id), cb=on_control)

    async def set_state(self, worker_id: str, state: str) -> None:
        info = self.info[worker_id]
        info.state = state  # type: ignore[assignment]
        info.heartbeat_at = time.time()
        await self.kv.put(worker_id, encode(info))

    async def deregister(self, worker_id: str) -> None:
        self.info.pop(worker_id)
        self.load.pop(worker_id)
        await self.kv.delete(worker_id)

    async def publish_gauges(self) -> None:
        for worker_id, info in list(self.info.items()):
            gauge = WorkerGauge(worker_id=worker_id, model=POOL, ts=time.time(), draining=info.state != "ready",
                                **self.load.get(worker_id, {}))
            await self.bus.publish(self.bus.subjects.gauges(POOL, worker_id), gauge)

    async def heartbeat(self) -> None:
        for worker_id in list(self.info):
            await self.set_state(worker_id, self.info[worker_id].state)

    def run(self) -> None:
        async def loop() -> None:
            n = 0
            while True:
                await self.publish_gauges()
                n += 1
                if n % 8 == 0:
                    await self.heartbeat()
                await asyncio.sleep(0.1)

        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


SATURATED: dict[str, Any] = {"waiting": 6, "running": 4, "queued_prefill_tokens": 6000, "running_tokens": 2000, "kv_usage": 0.5}
IDLE: dict[str, Any] = {}


@pytest.fixture
async def workers(bus: Bus) -> AsyncIterator[FakeWorkers]:
    kv = await workers_bucket(bus.js, bus.subjects)
    fake = FakeWorkers(bus, kv)
    fake.run()
    try:
        yield fake
    finally:
        await fake.stop()


def make_service(bus_settings: BusSettings, driver: Driver, **overrides: Any) -> AutoscalerService:
    policy: dict[str, Any] = dict(pool=POOL, min_replicas=1, max_replicas=4, scale_down_cooldown_s=1.0, drain_ack_timeout_s=2.0)
    config: dict[str, Any] = dict(tick_s=0.2, warmup_s=0.5, drain_timeout_s=1.0, drain_grace_s=0.5, control_timeout_s=0.5,
                                  start_backoff_s=30.0)
    for key in list(overrides):
        if key in policy or key in ("target_utilization", "initial_replica_token_capacity"):
            policy[key] = overrides.pop(key)
    config.update(overrides)
    return AutoscalerService(AutoscalerConfig(pools=(PoolPolicy(**policy),), **config), driver, bus_settings)


@pytest.fixture
async def started() -> AsyncIterator[Callable[[AutoscalerService], Any]]:
    services: list[AutoscalerService] = []

    async def start(service: AutoscalerService) -> AutoscalerService:
        await service.start()
        services.append(service)
        return service

    yield start
    for service in services:
        await service.drain_and_close()



async def test_scale_up_from_gauges_then_down_by_drain(
    bus_settings: BusSettings, workers: FakeWorkers, started: Any
) -> None:
    await workers.add("w1", **SATURATED)
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver))
    # 8000 tokens of load, saturated at 2000 held per replica, at 75 %: 6 needed, max 4.
    await eventually(lambda: driver.of("start") == [("start", POOL, 3)], what="scale up to 4")
    await eventually(lambda: service.status().pools[0].starting == 3, what="3 starting")
    (pool,) = service.status().pools
    assert pool.current == 4 and pool.desired == 4 and pool.ready == 1
    up = [d for d in pool.decisions if d.action == "scale_up"]
    assert len(up) == 1 and "scale up 1 → 4" in up[0].reason and up[0].outcome == "started 3 (new-1, new-2, new-3)"

    # The launched workers come up: starting is redeemed by their first gauges, no new start.
    for worker_id in ("new-1", "new-2", "new-3"):
        await workers.add(worker_id, **IDLE)
    await eventually(lambda: (p := service.status().pools[0]).ready == 4 and p.starting == 0, what="4 ready")
    assert len(driver.of("start")) == 1

    # Load goes away: after the cooldown one replica at a time is drained, never killed.
    workers.load["w1"] = {"running": 1, "running_tokens": 100}
    await eventually(lambda: len(workers.commands) >= 1, what="first drain")
    victim, command = workers.commands[0]
    assert victim in ("new-1", "new-2", "new-3")  # an idle one, not w1 which holds a request
    assert command.command == "drain" and command.timeout_s == 1.0 and "scale down 4 → 3" in command.reason
    # tracked as soon as it is sent; the worker's acknowledgement follows over NATS
    await eventually(lambda: any(d.acknowledged for d in service.status().pools[0].drains), what="drain acknowledged")
    (drain,) = service.status().pools[0].drains
    assert drain.worker_id == victim and drain.acknowledged and drain.in_flight == 2
    await asyncio.sleep(0.6)
    assert len(workers.commands) == 1  # one drain at a time, the next waits for this one
    assert driver.of("stopped") == [] and driver.of("stop") == []

    await workers.deregister(victim)  # its requests done, the worker leaves
    await eventually(lambda: len(driver.of("stopped")) == 1, what="stopped after deregistration")
    assert driver.of("stopped")[0][1] == WorkerRef(victim, POOL, host=f"host-{victim}", pid=1234)
    assert driver.of("stop") == []
    await eventually(lambda: len(workers.commands) == 2, what="second drain")
    assert workers.commands[1][0] != victim
    assert service.metrics.drains.labels(pool=POOL, outcome="finished")._value.get() == 1


async def test_drain_that_outlives_its_timeout_is_forced(bus_settings: BusSettings, workers: FakeWorkers, started: Any) -> None:
    await workers.add("w1", **IDLE)
    await workers.add("w2", **IDLE)
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver))
    await eventually(lambda: len(workers.commands) == 1, what="drain")
    victim = workers.commands[0][0]
    issued = time.monotonic()
    # Acknowledged, then hangs: still registered past drain timeout (1 s) + grace (0.5 s).
    await eventually(lambda: bool(driver.of("stop")), what="forced stop")
    assert time.monotonic() - issued >= 1.4
    assert driver.calls[-2:] == [("stop", WorkerRef(victim, POOL, host=f"host-{victim}", pid=1234)),
                                 ("stopped", WorkerRef(victim, POOL, host=f"host-{victim}", pid=1234))]
    # The retired worker's lingering registry entry and gauges no longer count.
    status = service.status()
    assert {w.worker_id: w.state for w in status.pools[0].workers}[victim] == "retired"
    assert service.metrics.drains.labels(pool=POOL, outcome="forced")._value.get() == 1


async def test_unacknowledged_drain_is_never_followed_by_a_kill(
    bus_settings: BusSettings, workers: FakeWorkers, started: Any
) -> None:
    await workers.add("w1", **IDLE)
    await workers.add("w2", **IDLE)
    workers.answer_control = False
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver))
    await eventually(lambda: len(workers.commands) >= 1, what="drain attempt")
    await eventually(
        lambda: any("not acknowledged" in d.outcome for d in service.status().pools[0].decisions), what="outcome"
    )
    await asyncio.sleep(2.0)  # well past drain timeout + grace
    assert driver.of("stop") == [] and driver.of("stopped") == []
    assert service.metrics.drains.labels(pool=POOL, outcome="unacknowledged")._value.get() >= 1


async def test_failing_driver_is_reported_and_backed_off(bus_settings: BusSettings, workers: FakeWorkers, started: Any) -> None:
    await workers.add("w1", **SATURATED)
    driver = RecordingDriver()
    driver.fail_starts = True
    service = await started(make_service(bus_settings, driver))
    await eventually(lambda: len(driver.of("start")) == 1, what="start attempt")
    await asyncio.sleep(1.0)  # five ticks that still want to scale up
    assert len(driver.of("start")) == 1  # backing off, not hammering the driver
    status = service.status()
    assert not status.driver.ok and "no room for 3" in status.driver.message
    assert status.driver.errors == {"max_reached": 1}
    outcomes = [d.outcome for d in status.pools[0].decisions if d.action == "scale_up"]
    assert outcomes[0] == "not started: no room for 3 more org/test-model"
    assert service.metrics.driver_errors.labels(driver="recording", reason="max_reached")._value.get() == 1


async def test_gauges_of_unregistered_workers_do_not_count(bus: Bus, bus_settings: BusSettings, workers: FakeWorkers,
                                                           started: Any) -> None:
    await workers.add("w1", **IDLE)
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver, min_replicas=2))
    ghost = WorkerGauge(worker_id="ghost", model=POOL, ts=time.time())
    for _ in range(5):
        await bus.publish(bus.subjects.gauges(POOL, "ghost"), ghost)
        await asyncio.sleep(0.1)
    await eventually(lambda: bool(driver.of("start")), what="start to the minimum")
    assert driver.of("start") == [("start", POOL, 1)]
    assert service.status().pools[0].ready == 1


async def test_status_over_nats_cli_and_metrics(bus: Bus, bus_settings: BusSettings, workers: FakeWorkers,
                                                started: Any, nats_url: str) -> None:
    await workers.add("w1", **SATURATED)
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver, metrics_port=0))
    await eventually(lambda: bool(driver.of("start")), what="a decision")
    status = await fetch_status(bus, decisions=5)
    (pool,) = status.pools
    assert pool.pool == POOL and pool.desired == 4 and pool.signals is not None
    assert pool.signals.capacity_source == "saturated" and pool.signals.replica_token_capacity == 2000
    assert [w.worker_id for w in pool.workers] == ["w1"] and pool.workers[0].waiting == 6
    assert status.driver.name == "recording" and status.driver.ok

    from rich.console import Console

    console = Console(record=True, width=200)
    print_status(status, console)
    text = console.export_text()
    assert POOL in text and "scale up 1 → 4" in text and "driver recording" in text

    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url}
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "ops.cli", "status", "--json", "--decisions", "1"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["pools"][0]["pool"] == POOL and len(data["pools"][0]["decisions"]) == 1
    # every field, zeros too: the wire format leaves defaults out, and a script reading
    # pool["draining"] failed exactly when it was 0
    assert data["pools"][0]["draining"] == 0 and data["pools"][0]["pending_requests"] == 0
    unknown = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "ops.cli", "status", "--pool", "nope"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert unknown.returncode == 1 and unknown.stderr.startswith("meshserve status: the autoscaler has no pool 'nope'")

    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{service.metrics_port}/metrics") as r:
        body = await r.text()
    assert 'meshserve:autoscaler_replicas_desired{pool="org/test-model"} 4.0' in body
    assert 'meshserve:autoscaler_decisions_total{action="scale_up",pool="org/test-model"} 1.0' in body


async def test_status_cli_without_autoscaler(nats_url: str) -> None:
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url}
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "ops.cli", "status", "--timeout", "0.5"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and "no autoscaler answered" in out.stderr



async def test_demand_admission_refused_scales_the_pool(bus: Bus, bus_settings: BusSettings, workers: FakeWorkers,
                                                         started: Any) -> None:
    """Admission's shedding keeps the queues short: a pool refusing most of its traffic read
    "at target" and never grew. What it refused for want of capacity is load too."""
    await workers.add("w1", **IDLE)
    driver = RecordingDriver()
    service = await started(make_service(bus_settings, driver, initial_replica_token_capacity=2000.0))
    await asyncio.sleep(1.0)
    assert driver.of("start") == []  # idle: nothing to do
    # 40 requests of 400 prompt tokens refused: 16,000 tokens / 75 % / 2,000 per replica → max 4
    await bus.publish(bus.subjects.autoscaler_demand,
                      PoolDemand(pool=POOL, source="a1", requests=40, tokens=16_000, window_s=5.0))
    await eventually(lambda: driver.of("start") == [("start", POOL, 3)], what="scale up to 4 on refused demand")
    (pool,) = service.status().pools
    assert pool.pending_requests == 40
    await bus.publish(bus.subjects.autoscaler_demand, PoolDemand(pool=POOL, source="a1"))  # refusals stopped
    await eventually(lambda: service.status().pools[0].pending_requests == 0, what="the demand to clear")
