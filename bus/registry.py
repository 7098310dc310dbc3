"""A live, local copy of the worker registry (the ``mesh_workers`` KV bucket).

Gateway, router, admission and autoscaler all need to know which workers exist, their
model, limits and state. Each keeps one ``WorkerRegistry``: a KV watcher fills it, and
entries whose heartbeat is older than the bucket TTL are dropped even if the expiry
marker was missed (a partitioned client must not keep placing on a dead worker).

A worker whose NATS connection closed and did not come back within a grace (the
server's disconnect advisories, ``bus.connections``) is dropped at once, not when its
heartbeat expires: a killed worker is gone from every service within about a second.
The heartbeat stays the fallback for a worker that hangs while connected, and for a NATS
server that publishes no advisories. The entry it left is ignored until a newer
heartbeat (a restarted or reconnected worker) arrives.

When every heartbeat goes stale at once, the bucket is what failed (a NATS node died and
the bucket has no leader, so no heartbeat is stored), not every worker: no worker expires
until ``OUTAGE_TTLS`` TTLs have passed (``expired_heartbeats``). A silent worker among
live ones still expires at one TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from proto.codec import decode
from proto.errors import DecodeError
from proto.workers import WorkerInfo

from .client import Bus
from .connections import ConnectionWatch, parse_advisory
from .mirror import sync_point, synced_at_marker
from .provision import StreamLimits, workers_bucket
from .tasks import cancel_and_wait

log = logging.getLogger(__name__)

Listener = Callable[[str, WorkerInfo | None], None]

# How many TTLs every heartbeat may be stale at once before workers expire: a JetStream
# leader election takes seconds, but a bucket left without a leader for a while (a node
# restarting) must not drop the whole fleet, whose requests would then all migrate.
OUTAGE_TTLS = 3.0


def expired_heartbeats(heartbeats: dict[str, float], now: float, ttl_s: float,
                       outage_ttls: float = OUTAGE_TTLS) -> list[str]:
    """The workers whose heartbeat (``worker id → heartbeat_at``, 0 = none yet) has expired.

    Workers heartbeat every ttl/4 (staggered), so while the bucket stores heartbeats the
    newest is younger than ttl/2: then a heartbeat older than ``ttl_s`` expires. When none
    is that young, heartbeats stopped being stored (not every worker died at once), and
    only those older than ``outage_ttls`` TTLs expire.
    """
    beats = {worker_id: at for worker_id, at in heartbeats.items() if at}
    if not beats:
        return []
    stored = now - max(beats.values()) < ttl_s / 2
    limit = ttl_s if stored else ttl_s * outage_ttls
    return [worker_id for worker_id, at in beats.items() if now - at > limit]


class WorkerRegistry:
    def __init__(self, bus: Bus, *, ttl_s: float | None = None, clock: Callable[[], float] = time.time,
                 disconnect_grace_s: float = 0.75) -> None:
        self.bus = bus
        self.ttl_s = ttl_s if ttl_s is not None else StreamLimits().workers_ttl_s
        self.clock = clock
        self.workers: dict[str, WorkerInfo] = {}
        self.connections = ConnectionWatch(disconnect_grace_s)
        # Workers dropped for a closed connection → the heartbeat they left: an entry no
        # newer than that (a watch restarted, replaying the bucket) does not bring them back.
        self._dead: dict[str, float] = {}
        self.disconnect_deaths = 0
        self._stopped = False
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        self._synced = asyncio.Event()
        self._last_entry_at = time.monotonic()  # any watch update; workers heartbeat every ttl/4
        # The current watch has replayed the bucket: until then the heartbeats held here may
        # be as old as the silence that restarted it, and no worker is reaped for them.
        self._replayed = False
        self._watch_started_at = clock()
        self._heartbeats_stalled = False  # every heartbeat stale at once: logged once

    def on_change(self, listener: Listener) -> None:
        """``listener(worker_id, info)``; ``info`` is None when the worker is gone."""
        self._listeners.append(listener)

    async def start(self) -> None:
        self._kv = await workers_bucket(self.bus.js, self.bus.subjects, replicas=self.bus.settings.js_replicas)
        self._task = asyncio.create_task(self._watch(), name="registry-watch")
        self._reaper = asyncio.create_task(self._reap(), name="registry-reaper")
        self.bus.reconnect_listeners.append(self.restart_watch)
        for subject in (self.bus.subjects.client_connected, self.bus.subjects.client_disconnected):
            await self.bus.nc.subscribe(subject, cb=self._on_connection_advisory)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), 5.0)

    async def stop(self) -> None:
        self._stopped = True  # pending expiry checks do nothing
        await cancel_and_wait(t for t in (self._task, self._reaper) if t is not None)

    @property
    def synced(self) -> bool:
        """The bucket's entries have been read once since start: until then an empty view
        means "not known yet", not "no workers"."""
        return self._synced.is_set()

    def ready_workers(self, model: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.state == "ready" and (model is None or w.model == model)]

    def models(self) -> dict[str, list[WorkerInfo]]:
        out: dict[str, list[WorkerInfo]] = {}
        for w in self.workers.values():
            if w.state in ("ready", "draining"):
                out.setdefault(w.model, []).append(w)
        return out

    def _set(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is None:
            if self.workers.pop(worker_id, None) is None:
                return
        else:
            self.workers[worker_id] = info
        for listener in self._listeners:
            try:
                listener(worker_id, info)
            except Exception:
                log.exception("registry listener failed")

    async def _watch(self) -> None:
        assert self._kv is not None
        while True:
            try:
                synced_at = await sync_point(self._kv)
                watcher = await self._kv.watchall()
                try:
                    async for entry in watcher:
                        self._last_entry_at = time.monotonic()
                        if entry is None:  # nothing more to replay: synced if the bucket holds nothing
                            self._replayed = True
                            if not self._synced.is_set() and await synced_at_marker(self._kv, synced_at):
                                self._synced.set()
                            continue
                        self._apply(entry)
                        if entry.revision >= synced_at:
                            self._synced.set()
                finally:
                    # A watch left subscribed (one per restart) kept the connection's drain
                    # waiting its whole timeout at shutdown: a supervisor's stop then killed it.
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnects, consumer loss: watch again
                log.warning("registry watch restarting: %r", exc)
                await asyncio.sleep(0.5)

    def _apply(self, entry: KeyValue.Entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._dead.pop(entry.key, None)
            self._set(entry.key, None)
            return
        try:
            info = decode(entry.value, WorkerInfo)
        except DecodeError as exc:
            log.warning("ignoring bad registry entry %s: %s", entry.key, exc)
            return
        if entry.key in self._dead:
            if info.heartbeat_at <= self._dead[entry.key]:
                return  # the entry a dead worker left behind
            del self._dead[entry.key]
        self._set(entry.key, info)

    # ---- connection advisories -----------------------------------------------------------
    async def _on_connection_advisory(self, msg: Msg) -> None:
        event = parse_advisory(msg.data)
        if event is None or event.name not in self.workers:
            return  # only workers' connections matter (and only they are remembered)
        self.connections.observe(event, time.monotonic())
        if event.kind == "disconnect":
            # Check once its grace has passed (a reconnect meanwhile cancels the verdict).
            self._check_in(self.connections.grace_s)

    def _check_in(self, delay_s: float) -> None:
        asyncio.get_running_loop().call_later(delay_s, self._expire_after, None)

    def _expire_after(self, _: None) -> None:
        if self._stopped:
            return
        self.expire_disconnected()
        # A timer can fire a little before the grace has passed by the watch's clock (uvloop
        # rounds to milliseconds): whatever still waits is looked at again when it is due.
        wait = self.connections.next_due(time.monotonic())
        if wait is not None:
            self._check_in(wait + 0.01)

    def expire_disconnected(self) -> list[str]:
        """Drop the workers whose connection closed a grace ago and did not come back."""
        gone = [name for name in self.connections.due(time.monotonic()) if name in self.workers]
        for worker_id in gone:
            info = self.workers[worker_id]
            log.warning("worker %s: its NATS connection closed and did not come back; treating it as dead", worker_id)
            self._dead[worker_id] = info.heartbeat_at
            self.disconnect_deaths += 1
            self._set(worker_id, None)
        return gone

    def restart_watch(self) -> None:
        """Start a fresh watch (after a reconnect, or when the current one went quiet)."""
        if self._task is not None:
            self._task.cancel()
        self._replayed = False
        self._watch_started_at = self.clock()
        self._last_entry_at = time.monotonic()
        self._task = asyncio.create_task(self._watch(), name="registry-watch")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.ttl_s / 4))
            if self.workers and time.monotonic() - self._last_entry_at > self.ttl_s / 2:
                # Live workers heartbeat every ttl/4: silence means our watch is stuck (a NATS
                # failover can leave nats-py's ordered consumer dead), not that every worker died.
                log.warning("worker registry watch silent for %.0fs; restarting it", time.monotonic() - self._last_entry_at)
                self.restart_watch()
                continue
            self.reap()

    def reap(self) -> list[str]:
        """Drop the workers whose heartbeat expired (``expired_heartbeats``); their ids. None
        while a restarted watch has not replayed the bucket (its entries are newer), unless
        it has not for as long as a bucket outage may last (then it is one)."""
        now = self.clock()
        if not self._replayed and now - self._watch_started_at < self.ttl_s * OUTAGE_TTLS:
            return []
        newest = max((info.heartbeat_at for info in self.workers.values()), default=0.0)
        stalled = bool(newest) and now - newest >= self.ttl_s / 2
        if stalled and not self._heartbeats_stalled:
            log.warning("no worker heartbeat stored for %.0fs (the bucket may have no leader): "
                        "workers expire only after %.0fs", now - newest, self.ttl_s * OUTAGE_TTLS)
        self._heartbeats_stalled = stalled
        gone = expired_heartbeats({w: info.heartbeat_at for w, info in self.workers.items()}, now, self.ttl_s)
        for worker_id in gone:
            log.info("worker %s heartbeat expired (%.0fs old)", worker_id, now - self.workers[worker_id].heartbeat_at)
            self._set(worker_id, None)
        return gone
