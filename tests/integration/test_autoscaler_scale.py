"""The autoscaler end to end: real sim workers started by the local driver, real load.

A pool of ``meshserve serve worker --engine sim`` processes (min 1, max 3) on a real
nats-server. Load is offered straight to the workers' generate subjects, as the
gateway's direct placement does (round robin over ready workers, a draining worker's
refusal retried on another):

1. cold start: the autoscaler brings the empty pool to its minimum of one replica;
2. step up: 40 requests outstanding saturate it → replicas rise to the maximum;
3. the step ends; a trickle of long requests keeps every replica busy → after the 3 s
   cooldown a replica is drained while it still holds a request;
4. no load → the pool drains back to one replica.

Every request must end with ``stop`` or ``length``: a scale-down that aborted one would
end it with ``error``. Every drained worker must have exited by itself (code 0).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from bus.registry import WorkerRegistry
from proto import (
    ControlReply,
    ErrorCode,
    GenerateRequest,
    NoResponders,
    RemoteError,
    RequestTimeout,
    SamplingParams,
    TokenChunk,
    decode,
    pack_tokens,
)
from proto.autoscaler import AutoscalerStatusRequest
from services.autoscaler.control import PoolPolicy
from services.autoscaler.drivers import LocalDriver
from services.autoscaler.service import AutoscalerConfig, AutoscalerService

ROOT = Path(__file__).resolve().parents[2]
POOL = "sim-autoscale"
GATEWAY = "test-load"

pytestmark = pytest.mark.slow


class Load:
    """Open-ended load placed directly on ready workers; tracks every request's end."""

    def __init__(self, bus: Bus, registry: WorkerRegistry) -> None:
        self.bus = bus
        self.registry = registry
        self.accepted: dict[str, str] = {}  # request id → worker
        self.final: dict[str, TokenChunk] = {}
        self.refused_draining = 0
        self._ids = itertools.count()
        self._rr = itertools.count()

    async def listen(self) -> None:
        async def on_chunk(msg: Msg) -> None:
            chunk = decode(msg.data, TokenChunk)
            if chunk.finish_reason is not None:
                self.final[chunk.request_id] = chunk

        await self.bus.nc.subscribe(self.bus.subjects.tokens_of_gateway(GATEWAY), cb=on_chunk)

    @property
    def in_flight(self) -> int:
        return len(self.accepted) - len(self.final)

    def busy(self, worker_id: str) -> int:
        return sum(1 for rid, w in self.accepted.items() if w == worker_id and rid not in self.final)

    async def submit(self, max_tokens: int, only: str | None = None) -> bool:
        workers = sorted(w.worker_id for w in self.registry.ready_workers(POOL)) if only is None else [only]
        start = next(self._rr)
        rid = f"r{next(self._ids)}"
        request = GenerateRequest(
            request_id=rid, model=POOL, prompt=pack_tokens([(7 * i + len(rid)) % 30000 + 1 for i in range(128)]),
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            token_subject=self.bus.subjects.tokens(GATEWAY, rid), gateway_id=GATEWAY, arrival_time=time.time(),
        )
        for i in range(len(workers)):
            worker_id = workers[(start + i) % len(workers)]
            try:
                await self.bus.request(self.bus.subjects.worker_generate(worker_id), request, ControlReply, timeout=5.0)
            except RemoteError as exc:
                if exc.code is not ErrorCode.DRAINING:
                    raise
                self.refused_draining += 1  # never started there: nothing lost, try the next
                continue
            except (NoResponders, RequestTimeout):
                continue
            self.accepted[rid] = worker_id
            return True
        return False

    async def keep_each_busy(self, max_tokens: int, until: Callable[[], bool], timeout: float) -> None:
        """At least one request in flight on every ready replica until ``until()``."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError("load phase did not reach its goal in time")
            for worker in self.registry.ready_workers(POOL):
                if self.busy(worker.worker_id) == 0:
                    await self.submit(max_tokens, only=worker.worker_id)
            await asyncio.sleep(0.02)

    async def hold(self, outstanding: int, max_tokens: int, until: Callable[[], bool], timeout: float) -> None:
        """Keep ``outstanding`` requests in flight until ``until()`` (or fail after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError("load phase did not reach its goal in time")
            while self.in_flight < outstanding and await self.submit(max_tokens):
                pass
            await asyncio.sleep(0.05)


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.1)


async def test_replicas_follow_load_and_scale_down_aborts_nothing(
    tmp_path: Path, bus: Bus, bus_settings: BusSettings, nats_url: str
) -> None:
    driver = LocalDriver(
        log_dir=tmp_path / "logs",
        # The sim replica: Llama-8B-on-H100 step times at twice real time, 8 sequences at once
        # so a few dozen requests saturate it.
        worker_args=["--engine", "sim", "--speed", "2", "--max-num-seqs", "8", "--gauge-interval", "0.25",
                     "--drain-timeout", "10"],
        max_workers=3,
        env={**os.environ, "MESHSERVE_NATS_URL": nats_url, "PYTHONPATH": str(ROOT)},
        close_timeout_s=20.0,
    )
    # Utilisation 1.0: the trickle of phase 3 (three long requests) must need fewer than 3
    # replicas whatever capacity the step measured.
    policy = PoolPolicy(pool=POOL, min_replicas=1, max_replicas=3, scale_down_cooldown_s=3.0, target_utilization=1.0)
    config = AutoscalerConfig(pools=(policy,), tick_s=0.5, warmup_s=1.0, drain_timeout_s=30.0, drain_grace_s=5.0)
    service = AutoscalerService(config, driver, bus_settings)
    registry = WorkerRegistry(bus)
    load = Load(bus, registry)
    timeline: list[tuple[float, int, int, int, int]] = []  # (t, current, ready, desired, draining)
    t0 = time.monotonic()

    async def watch() -> None:
        while True:
            (p,) = service.status().pools
            timeline.append((time.monotonic() - t0, p.current, p.ready, p.desired, p.draining))
            await asyncio.sleep(0.25)

    def pool() -> tuple[int, int, int]:
        (p,) = service.status().pools
        return p.current, p.ready, p.draining

    await service.start()
    await registry.start()
    await load.listen()
    watcher = asyncio.create_task(watch())
    try:
        # 1. Cold start to the minimum.
        await wait_until(lambda: pool()[1] == 1 and len(registry.ready_workers(POOL)) == 1, 60, "cold start to 1")
        t_ready = time.monotonic() - t0

        # 2. Step up: saturate → the pool grows to its maximum, and the new replicas serve.
        await load.hold(40, 600, until=lambda: pool()[1] == 3 and len(registry.ready_workers(POOL)) == 3, timeout=60)
        t_peak = time.monotonic() - t0
        await load.hold(40, 600, until=lambda: len(set(load.accepted.values())) == 3, timeout=30)

        # 3. The step ends; a trickle of long requests keeps every replica busy, so whichever
        #    replica is drained after the cooldown still holds a request.
        await load.keep_each_busy(1500, until=lambda: pool()[0] < 3 and pool()[2] == 0, timeout=60)
        t_first_down = time.monotonic() - t0

        # 4. No load: back to the minimum, one drain at a time.
        await wait_until(lambda: pool() == (1, 1, 0) and len(registry.ready_workers(POOL)) == 1, 60, "scale down to 1")
        t_min = time.monotonic() - t0
        await wait_until(lambda: load.in_flight == 0, 30, "every request ended")
        await wait_until(lambda: len(driver.alive()) == 1, 20, "drained workers exited")
    finally:
        watcher.cancel()
        status = service.status(AutoscalerStatusRequest(decisions=50))
        await service.drain_and_close()  # drains the last worker (SIGTERM) and waits for it
        await registry.stop()

    (p,) = status.pools
    decisions = p.decisions
    print(f"\nready at {t_ready:.1f}s, peak at {t_peak:.1f}s, first scale-down done {t_first_down:.1f}s, "
          f"back to 1 at {t_min:.1f}s; {len(load.accepted)} requests, {load.refused_draining} draining refusals")
    if p.signals is not None:
        print(f"capacity {p.signals.replica_token_capacity:,.0f} tokens/replica ({p.signals.capacity_source})")
    for r in decisions:
        print(f"  {r.action:10s} {r.current}→{r.desired}  {r.reason[:110]}  [{r.outcome}]")

    # Replicas followed the load: up to the maximum, then back to the minimum.
    assert max(ready for _, _, ready, _, _ in timeline) == 3
    ups = [r for r in decisions if r.action == "scale_up"]
    downs = [r for r in decisions if r.action == "scale_down"]
    assert ups[0].cold_start and ups[0].outcome.startswith("started 1")
    assert sum(r.count for r in ups) == 3
    assert len(downs) == 2 and all(r.drain_worker for r in downs)
    # Scale-down drained replicas that still held requests, and aborted none of them.
    held = [int(m.group(1)) for r in downs if (m := re.search(r"\((\d+) in flight", r.outcome))]
    assert len(held) == 2 and held[0] >= 1, downs
    reasons = {rid: chunk.finish_reason for rid, chunk in load.final.items()}
    assert set(reasons) == set(load.accepted) and len(reasons) >= 43  # the step's 40 and the trickle's 3 at least
    assert set(reasons.values()) <= {"length", "stop"}, {r: c for r, c in reasons.items() if c not in ("length", "stop")}
    # Drained workers left by themselves: no crash, no forced stop, no driver error.
    assert driver.status().errors == {}
    assert service.metrics.drains.labels(pool=POOL, outcome="finished")._value.get() == 2
    assert service.metrics.drains.labels(pool=POOL, outcome="forced")._value.get() == 0
    assert not driver.alive()
