"""The async shell that keeps a ``FleetView`` live: the one copy of the feed wiring.

``FleetFeed`` follows the worker registry (joins, heartbeats, state changes, deletes),
gauges (``mesh.gauges.>``) and, when asked, KV event batches (``mesh.kv.>``), and
requests the ``KvSnapshot`` of a worker whose index the view says needs a resync (a gap,
a stream joined mid-way, or a batch a gauge names that never came). Router, admission
and autoscaler each run one, on their own clock; the decisions stay in the view.

A gauge or batch from a worker the registry does not list (its last one, published on
the way out, or a straggler) is dropped, so it cannot resurrect the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from bus import Service, cancel_and_wait
from bus.registry import WorkerRegistry
from proto.errors import MeshError
from proto.workers import KvEventBatch, KvSnapshot, KvSnapshotRequest, WorkerGauge, WorkerInfo

from .fleet import FleetView
from .kvindex import KvApply

log = logging.getLogger(__name__)

RegistryHook = Callable[[str, WorkerInfo | None], None]
# "failed" (no snapshot came), "applied" (consistent again), "incomplete" (still a hole)
ResyncHook = Callable[[str, str], None]


class FleetFeed:
    def __init__(
        self,
        service: Service,
        view: FleetView,
        clock: Callable[[], float],
        *,
        kv_events: bool = True,
        resync_retry_s: float = 2.0,
        snapshot_timeout_s: float = 2.0,
        on_registry: RegistryHook | None = None,
        on_resync: ResyncHook | None = None,
    ) -> None:
        self.service = service
        self.view = view
        self.clock = clock
        self.kv_events = kv_events  # False: gauges only (the view's prefix index stays empty)
        self.resync_retry_s = resync_retry_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.on_registry = on_registry  # after the view took the change
        self.on_resync = on_resync
        self.registry: WorkerRegistry | None = None
        self.resyncs_requested = 0
        self.resyncs_applied = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """The registry's entries (empty before ``start``)."""
        return self.registry.workers if self.registry is not None else {}

    @property
    def registry_synced(self) -> bool:
        """The registry has been read since start (``WorkerRegistry.synced``)."""
        return self.registry is not None and self.registry.synced

    async def start(self) -> None:
        bus = self.service.bus
        self.registry = WorkerRegistry(bus)
        self.registry.on_change(self._on_registry)
        await self.registry.start()
        await self.service.subscribe(bus.subjects.gauges_all, WorkerGauge, self._on_gauge)
        if self.kv_events:
            await self.service.subscribe(bus.subjects.kv_events_all, KvEventBatch, self._on_kv_events)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.registry is not None:
            await self.registry.stop()

    # ---- feeds ------------------------------------------------------------------------
    def _on_registry(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is None:
            self.view.remove_worker(worker_id)
        else:
            self.view.update_worker(info, self.clock())
        if self.on_registry is not None:
            self.on_registry(worker_id, info)

    def _unlisted(self, worker_id: str) -> bool:
        return worker_id not in self.view and worker_id not in self.workers

    async def _on_gauge(self, gauge: WorkerGauge, _msg: Msg) -> None:
        if self._unlisted(gauge.worker_id):
            return
        self.view.apply_gauge(gauge, self.clock())
        if self.view.needs_resync(gauge.worker_id):
            self.request_resyncs()

    async def _on_kv_events(self, batch: KvEventBatch, _msg: Msg) -> None:
        if self._unlisted(batch.worker_id):
            return
        if self.view.apply_kv_events(batch, self.clock()) is KvApply.GAP:
            log.info("KV events of %s: gap before batch %d, resyncing", batch.worker_id, batch.seq)
            self.request_resyncs()

    # ---- resyncs ----------------------------------------------------------------------
    def request_resyncs(self) -> None:
        """Ask every worker the view needs a snapshot of (again after ``resync_retry_s``)."""
        if not self.kv_events:
            return
        for worker_id in self.view.take_resync_requests(self.clock(), self.resync_retry_s):
            self.resyncs_requested += 1
            task = asyncio.get_running_loop().create_task(self._resync(worker_id), name=f"resync-{worker_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resync(self, worker_id: str) -> None:
        bus = self.service.bus
        try:
            snap = await bus.request(
                bus.subjects.worker_kv_snapshot(worker_id), KvSnapshotRequest(worker_id=worker_id), KvSnapshot,
                timeout=self.snapshot_timeout_s,
            )
        except MeshError as exc:
            # take_resync_requests names the worker again after resync_retry_s.
            log.warning("KV snapshot of %s failed: %s (asked again later)", worker_id, exc)
            self._resynced(worker_id, "failed")
            return
        if self.view.apply_snapshot(snap, self.clock()):
            self.resyncs_applied += 1
            log.info("KV index of %s resynced from a snapshot at batch %d (%d blocks)", worker_id, snap.seq, len(snap.block_hashes))
            self._resynced(worker_id, "applied")
        else:
            self._resynced(worker_id, "incomplete")

    def _resynced(self, worker_id: str, outcome: str) -> None:
        if self.on_resync is not None:
            self.on_resync(worker_id, outcome)
