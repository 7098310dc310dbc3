"""What admission knows of every replica: registry state, latest gauge, its own recent
admissions, and the prefix each one caches (DESIGN.md, Admission).

Pure and synchronous, like the rest of admission: the shell feeds it registry entries,
gauges, KV event batches and snapshots with its own clock reading ``now`` (a local,
monotonic one: it is only compared with itself), and asks ``loads`` for the
``ReplicaLoad`` of a request's pool.

- Membership comes from the registry: a worker is counted when it is registered ready
  (draining ones are passed on marked ``draining``, which the SLO check skips), and
  its gauges are fresh. One registered but with no gauge yet (cold start) is counted
  with unmeasured rates (the SLO check then uses its defaults); one whose gauges stopped
  for ``gauge_stale_s`` is not counted: its queue is unknown, probably dead.
- Cached prefixes come from ``services.common.kvindex.KvIndex``, one per model, fed the same KV
  events the router sees; the request brings its block hashes in the pool's block size.
- Gauges are stale by up to a publish period, and a burst arrives within one: each
  admission adds its uncached prompt tokens to the queue of the replica its prediction
  used (the one the router's cost also favours) until a gauge taken after it arrives,
  so a burst cannot all be admitted against the same stale, empty queue.
- The worker drains that queue meanwhile: the queue a request meets is the gauge's,
  plus the admissions since, less what the replica's measured prefill rate has drained
  since (FIFO, from when each was counted). Without this a prompt prefilled in 40 ms
  counted for a whole gauge period, and on a light load doubled the next prediction.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from proto.messages import AdmissionRequest, KvEventBatch, KvSnapshot, WorkerGauge, WorkerInfo
from services.common.kvindex import KvApply, KvIndex, KvIndexConfig

from .slo import ReplicaLoad


@dataclass(frozen=True, slots=True)
class BookConfig:
    gauge_stale_s: float = 5.0
    # A gauge received at least this long after an admission is taken to include it.
    settle_s: float = 0.05
    # Optimistic additions older than this are dropped even without a gauge.
    pending_max_age_s: float = 10.0
    kv: KvIndexConfig = field(default_factory=KvIndexConfig)


@dataclass(slots=True)
class _Replica:
    worker_id: str
    model: str
    info: WorkerInfo | None = None
    gauge: WorkerGauge | None = None
    gauge_received_at: float = float("-inf")
    pending: deque[tuple[float, int]] = field(default_factory=deque)  # (admitted at, uncached tokens)
    pending_tokens: int = 0


class ReplicaBook:
    def __init__(self, config: BookConfig | None = None) -> None:
        self.config = config or BookConfig()
        self.replicas: dict[str, _Replica] = {}
        self.indexes: dict[str, KvIndex] = {}  # model → prefix index

    # ---- feeds ----
    def _replica(self, worker_id: str, model: str) -> _Replica:
        r = self.replicas.get(worker_id)
        if r is not None and r.model != model:
            self.remove_worker(worker_id)  # an id reused for another model: start over
            r = None
        if r is None:
            r = self.replicas[worker_id] = _Replica(worker_id, model)
        return r

    def index(self, model: str) -> KvIndex:
        idx = self.indexes.get(model)
        if idx is None:
            idx = self.indexes[model] = KvIndex(self.config.kv)
        return idx

    def update_worker(self, info: WorkerInfo) -> None:
        r = self._replica(info.worker_id, info.model)
        idx = self.index(info.model)
        h = idx.get(info.worker_id)
        if r.info is not None and info.started_at and r.info.started_at != info.started_at and h is not None:
            idx.reset(h)  # same id, new process: its cache is gone
            r.gauge = None
            r.pending.clear()
            r.pending_tokens = 0
        r.info = info
        idx.add(info.worker_id, info.block_size)

    def remove_worker(self, worker_id: str) -> None:
        r = self.replicas.pop(worker_id, None)
        if r is None:
            return
        idx = self.indexes.get(r.model)
        if idx is not None:
            idx.remove(worker_id)
            if not len(idx):
                del self.indexes[r.model]

    def apply_gauge(self, gauge: WorkerGauge, now: float) -> bool:
        """A new load report; False when older than the one held (reordered delivery)."""
        r = self.replicas.get(gauge.worker_id)
        if r is None or r.model != gauge.model:
            return False  # not registered (yet, or any more): the registry decides who exists
        if r.gauge is not None and gauge.ts < r.gauge.ts:
            return False
        r.gauge = gauge
        r.gauge_received_at = now
        cutoff = now - self.config.settle_s
        while r.pending and r.pending[0][0] <= cutoff:
            r.pending_tokens -= r.pending.popleft()[1]
        idx = self.indexes.get(r.model)
        h = idx.get(gauge.worker_id) if idx is not None else None
        if idx is not None and h is not None:
            idx.note_published_seq(h, gauge.kv_event_seq)
        return True

    def apply_kv_events(self, batch: KvEventBatch) -> KvApply | None:
        """None when the worker is not registered: its events wait for the registry entry
        (and the gap they leave is then resynced from a snapshot)."""
        r = self.replicas.get(batch.worker_id)
        if r is None or r.model != batch.model:
            return None
        return self.index(batch.model).apply(batch)

    def apply_snapshot(self, snap: KvSnapshot) -> bool:
        r = self.replicas.get(snap.worker_id)
        if r is None or r.model != snap.model:
            return False
        return self.index(snap.model).apply_snapshot(snap)

    def take_resync_requests(self, now: float, retry_after_s: float = 2.0) -> list[str]:
        out: list[str] = []
        for idx in self.indexes.values():
            out.extend(idx.take_resync_requests(now, retry_after_s))
        return out

    def note_admitted(self, worker_id: str | None, uncached_tokens: int, now: float) -> None:
        """Count an admission on the replica its prediction used, until a gauge includes it."""
        r = self.replicas.get(worker_id) if worker_id else None
        if r is None or uncached_tokens <= 0:
            return
        r.pending.append((now, uncached_tokens))
        r.pending_tokens += uncached_tokens

    def _age_out(self, r: _Replica, now: float) -> None:
        cutoff = now - self.config.pending_max_age_s
        while r.pending and r.pending[0][0] < cutoff:
            r.pending_tokens -= r.pending.popleft()[1]

    # ---- the query ----
    def loads(self, req: AdmissionRequest, now: float) -> list[ReplicaLoad]:
        """The request's pool as the SLO check sees it, cached prefixes included."""
        members: list[_Replica] = []
        stale = now - self.config.gauge_stale_s
        for r in self.replicas.values():
            info = r.info
            if r.model != req.model or info is None or info.state not in ("ready", "draining"):
                continue
            if r.gauge is not None and r.gauge_received_at < stale:
                continue
            members.append(r)
        if req.lora:
            # Prefer the replicas with the adapter loaded; if none has it the pool loads
            # adapters on demand, and every replica is a candidate.
            loaded = [r for r in members if req.lora in _adapters(r)]
            members = loaded or members
        cached: dict[str, int] = {}
        idx = self.indexes.get(req.model)
        if idx is not None and req.block_hashes and req.block_size:
            mask = idx.mask_of(h for r in members if (h := idx.get(r.worker_id)) is not None)
            cached = idx.prefix_tokens(req.block_hashes, req.block_size, mask)
        out: list[ReplicaLoad] = []
        for r in members:
            self._age_out(r, now)
            g = r.gauge
            draining = (r.info is not None and r.info.state == "draining") or (g is not None and g.draining)
            out.append(
                ReplicaLoad(
                    worker_id=r.worker_id,
                    queued_prefill_tokens=self._queue_now(r, now),
                    prefill_tokens_per_s=g.prefill_tokens_per_s if g is not None else 0.0,
                    step_time_s=g.step_time_s if g is not None else 0.0,
                    cached_tokens=min(cached.get(r.worker_id, 0), req.prompt_tokens),
                    draining=draining,
                )
            )
        return out


    @staticmethod
    def _queue_now(r: _Replica, now: float) -> int:
        """The gauge's queue plus the admissions since, drained at the gauge's prefill
        rate (none without a measured rate: the queue then only grows until a gauge)."""
        g = r.gauge
        backlog = float(g.queued_prefill_tokens) if g is not None else 0.0
        rate = g.prefill_tokens_per_s if g is not None else 0.0
        if rate <= 0:
            return int(backlog) + r.pending_tokens
        t = r.gauge_received_at
        for at, tokens in r.pending:  # in admission order
            if at > t:  # admitted before the gauge yet not in it: drains from the gauge on
                backlog = max(backlog - rate * (at - t), 0.0)
                t = at
            backlog += tokens
        return math.ceil(max(backlog - rate * max(now - t, 0.0), 0.0))


def _adapters(r: _Replica) -> set[str]:
    names: set[str] = set()
    if r.info is not None:
        names.update(r.info.lora_adapters)
    if r.gauge is not None:
        names.update(r.gauge.lora_adapters)
    return names
