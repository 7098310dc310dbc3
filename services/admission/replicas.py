"""What admission knows of every replica: registry state, latest gauge, its own recent
admissions, and the prefix each one caches (DESIGN.md, Admission).

``ReplicaBook`` is the shared fleet view (``services.common.fleet.FleetView``, the one the
router and the autoscaler read, with the same identity, gauge and KV event rules) with
admission's reading on top: ``loads`` gives the SLO check the ``ReplicaLoad`` of a
request's pool. Pure and synchronous, like the rest of admission: ``FleetFeed`` feeds it
registry entries, gauges, KV event batches and snapshots with admission's own clock
reading ``now`` (a local, monotonic one: it is only compared with itself).

- Membership comes from the registry only (``registry_only``): a worker is counted when it is registered ready
  (draining ones are passed on marked ``draining``, which the SLO check skips), and
  its gauges are fresh. One registered but with no gauge yet (cold start) is counted
  with unmeasured rates (the SLO check then uses its defaults); one whose gauges stopped
  for ``gauge_stale_s`` is not counted: its queue is unknown, probably dead.
- Cached prefixes come from the view's ``KvIndex``, one per model, fed the same KV
  events the router sees; the request brings its block hashes in the pool's block size.
- Gauges are stale by up to a publish period, and a burst arrives within one: each
  admission adds its uncached prompt tokens to the queue of the replica its prediction
  used (the one the router's cost also favours) until a gauge names the request among
  those its engine took in (``WorkerGauge.arrived``), so a burst cannot all be admitted
  against the same stale, empty queue. Settling by timing instead (a gauge received
  50 ms after the admission) lost the whole burst on a loaded machine, where the
  requests took longer than that to reach the worker: the next gauge read an empty
  queue and admission let in three times what fitted.
- The worker drains that queue meanwhile: the queue a request meets is the gauge's,
  plus the admissions since, less what the replica's measured prefill rate has drained
  since (FIFO, from when each was counted). Without this a prompt prefilled in 40 ms
  counted for a whole gauge period, and on a light load doubled the next prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from proto.messages import AdmissionRequest
from services.common.fleet import FleetConfig, FleetView, FleetWorker
from services.common.kvindex import KvIndexConfig
from services.common.regions import RegionLatency
from services.common.residency import load_left, residency

from .slo import ReplicaLoad


@dataclass(frozen=True, slots=True)
class BookConfig:
    gauge_stale_s: float = 5.0
    # A gauge received at least this long after an admission is taken to include it.
    settle_s: float = 0.05
    # Optimistic additions older than this are dropped even without a gauge.
    pending_max_age_s: float = 10.0
    kv: KvIndexConfig = field(default_factory=KvIndexConfig)
    # Round trips between regions (``--region-rtt-ms``): added to a replica's prediction
    # outside the request's region.
    regions: RegionLatency = field(default_factory=RegionLatency)

    def fleet_config(self) -> FleetConfig:
        kv = {f.name: getattr(self.kv, f.name) for f in fields(KvIndexConfig)}
        return FleetConfig(placement_settle_s=self.settle_s, placement_max_age_s=self.pending_max_age_s, **kv)


class ReplicaBook(FleetView):
    def __init__(self, config: BookConfig | None = None) -> None:
        self.book_config = config or BookConfig()
        super().__init__(self.book_config.fleet_config(), registry_only=True)

    def note_admitted(self, request_id: str, worker_id: str | None, uncached_tokens: int, now: float) -> None:
        """Count an admission on the replica its prediction used, until a gauge names it
        (whichever worker's), or, from a worker that names none, includes it by timing."""
        if not worker_id or uncached_tokens <= 0 or worker_id not in self:
            return
        self.record_placement(worker_id, request_id, uncached_tokens, 0, now)

    # ---- the query ----
    def loads(self, req: AdmissionRequest, now: float) -> list[ReplicaLoad]:
        """The request's pool as the SLO check sees it, cached prefixes included."""
        pool = self.pool(req.model)
        if pool is None:
            return []
        stale = now - self.book_config.gauge_stale_s
        members: list[FleetWorker] = []
        for w in pool:
            info = w.info
            if info is None or info.state not in ("ready", "draining") or info.role == "prefill":
                continue  # a prefill worker takes no request: the TTFT is a serving replica's
            if w.gauge is not None and w.gauge_received_at < stale:
                continue
            if req.regions and info.region not in req.regions:
                continue  # data residency: never outside the key's regions
            members.append(w)
        if req.lora:
            # Prefer the replicas with the adapter loaded; if none has it the pool loads
            # adapters on demand, and every replica is a candidate.
            loaded = [w for w in members if req.lora in w.lora_adapters]
            members = loaded or members
        cached: dict[str, int] = {}
        if req.block_hashes and req.block_size:
            cached = pool.kv.prefix_tokens(req.block_hashes, req.block_size, pool.mask_of(members))
        out: list[ReplicaLoad] = []
        for w in members:
            self.age_out(w, now)
            g = w.gauge
            out.append(
                ReplicaLoad(
                    worker_id=w.worker_id,
                    queued_prefill_tokens=_queue_now(w, now),
                    prefill_tokens_per_s=g.prefill_tokens_per_s if g is not None else 0.0,
                    step_time_s=g.step_time_s if g is not None else 0.0,
                    cached_tokens=min(cached.get(w.worker_id, 0), req.prompt_tokens),
                    draining=w.draining,
                    load_s=_load_s(w),
                    network_s=self.book_config.regions.rtt(req.region, w.info.region if w.info is not None else ""),
                )
            )
        return out


def _load_s(w: FleetWorker) -> float:
    """Seconds before ``w``'s model is ready: a cold hot-swap entry's load, or what is
    left of one under way (0 on a dedicated worker or a resident model)."""
    state = residency(w)
    if state == "cold" and w.info is not None:
        return w.info.load_s
    if state == "loading":
        return load_left(w)
    return 0.0


def _queue_now(w: FleetWorker, now: float) -> int:
    """The gauge's queue plus the admissions since, drained at the gauge's prefill rate
    (none without a measured rate: the queue then only grows until a gauge)."""
    g = w.gauge
    backlog = float(g.queued_prefill_tokens) if g is not None else 0.0
    rate = g.prefill_tokens_per_s if g is not None else 0.0
    if rate <= 0:
        return int(backlog) + w.opt_prefill_tokens
    t = w.gauge_received_at
    for p in w.placements.values():  # in admission order
        if p.placed_at > t:  # admitted before the gauge yet not in it: drains from the gauge on
            backlog = max(backlog - rate * (p.placed_at - t), 0.0)
            t = p.placed_at
        backlog += p.prefill_tokens
    return math.ceil(max(backlog - rate * max(now - t, 0.0), 0.0))
