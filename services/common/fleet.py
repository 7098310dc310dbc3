"""The fleet view: who serves which model, how loaded, and what they cache.

One view, read by the router (placement), admission (the SLO check's replicas) and the
autoscaler (each pool's gauges), so that every service applies the same rules to the
same feeds (DESIGN.md, Layout):

- Identity. A worker id reused for another model starts over in that model's pool; the
  same id with a new ``started_at`` is a restarted process: its KV cache, gauge, load
  average and optimistic placements are gone.
- Membership. The registry adds and removes workers (``update_worker``,
  ``remove_worker``). With ``registry_only=False`` (router, autoscaler) a gauge or KV
  batch of a worker the view does not hold adds it too (the feed has checked that the
  registry lists it); with ``registry_only=True`` (admission) those are ignored until the
  registry entry arrives, and the gap they leave is resynced from a snapshot.
- Gauges. One older than the gauge held (reordered delivery) is dropped. A gauge
  received ``placement_settle_s`` after a placement is taken to include it, so the
  optimistic additions made before then are dropped; older than ``placement_max_age_s``
  they are dropped anyway. Each gauge feeds the worker's load average.
- KV events. Per pool, a ``services.common.kvindex.KvIndex`` (block hash → bitmask of
  worker slots, per-worker sequencing, gap detection, snapshot replay). A gap makes
  ``take_resync_requests`` name the worker; the feed asks it for a ``KvSnapshot`` and
  hands it to ``apply_snapshot``. A gauge names the last batch published, which reveals
  a lost last batch.

Everything here is synchronous and driven by an async shell (``services.common.feed``)
with the consumer's own clock reading ``now``. Worker timestamps are only compared with
other timestamps of the same worker (gauge ordering), never with that clock, so clock
skew between hosts cannot make a worker look dead or a gauge look fresh.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from proto.hashing import pack_tokens
from proto.workers import KvEventBatch, KvSnapshot, WorkerGauge, WorkerInfo

from .kvindex import DEFAULT_BLOCK_SIZE, KvApply, KvHolder, KvIndex, KvIndexConfig
from .smoothing import ewma

__all__ = ["DEFAULT_BLOCK_SIZE", "FleetConfig", "FleetView", "FleetWorker", "KvApply", "Pool", "pack_prompt"]

# Pool generations come from one counter so that a pool dropped and re-created never
# repeats a generation a consumer has cached.
_generations = itertools.count(1)


@dataclass(frozen=True, slots=True)
class FleetConfig(KvIndexConfig):
    """The view's settings; the prefix index's (``KvIndexConfig``) are among them."""

    # A worker not heard from (registry put, gauge or KV batch) for this long is
    # treated as expired: never placed on, and dropped by ``expire``. The registry's
    # KV TTL normally removes it first; this is the backstop if that delete is missed.
    stale_after_s: float = 15.0
    # A gauge that names the requests its worker took in (``WorkerGauge.arrived``) settles
    # exactly those placements; one not named for this long never reached its worker.
    placement_unseen_s: float = 5.0
    # For a worker that names none: a gauge received at least this long after a placement
    # is taken to include it. On a loaded machine the request can take longer than this
    # to reach the worker, and the placement is then dropped too early.
    placement_settle_s: float = 0.02
    # Optimistic additions older than this are dropped even without a new gauge, so a
    # worker whose gauges stop does not look busy forever.
    placement_max_age_s: float = 30.0
    # Time constant of each worker's load average (outstanding tokens, from its gauges):
    # long enough to smooth one request's arrival and departure, short enough to see a
    # worker that a cache-affine policy has left idle within a few seconds.
    load_avg_window_s: float = 10.0


@dataclass(slots=True)
class Placement:
    """Work counted on a worker before its gauges can show it."""

    worker_id: str
    placed_at: float
    prefill_tokens: int
    total_tokens: int


@dataclass(eq=False, slots=True)
class FleetWorker:
    """One worker as the fleet view sees it. Consumers read it; only ``FleetView`` writes."""

    worker_id: str
    model: str
    kv: KvHolder  # its cache mirror in the pool's prefix index
    pool: Pool  # the pool it is a member of
    slot: int  # kv.slot and kv.bit, fixed for the holder's life: read on hot paths
    bit: int
    info: WorkerInfo | None = None
    gauge: WorkerGauge | None = None
    last_seen: float = 0.0
    gauge_received_at: float = float("-inf")
    # optimistic accounting: placements not yet reflected by a gauge, oldest first
    placements: dict[str, Placement] = field(default_factory=dict)
    opt_prefill_tokens: int = 0
    opt_running_tokens: int = 0
    # exponentially weighted mean of the gauges' outstanding tokens (None: no gauge yet)
    load_avg: float | None = None
    last_placed_at: float = float("-inf")  # this view's newest placement here (rotation among near ties)

    # ---- KV cache mirror (held by the pool's KvIndex) ----
    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def blocks(self) -> set[int]:
        return self.kv.blocks

    @property
    def kv_seq(self) -> int:
        return self.kv.seq

    @property
    def needs_resync(self) -> bool:
        return self.kv.needs_resync

    @property
    def recent_batches(self) -> dict[int, KvEventBatch]:
        return self.kv.recent

    # ---- load, gauge plus what was placed since that gauge ----
    @property
    def queued_prefill_tokens(self) -> int:
        base = self.gauge.queued_prefill_tokens if self.gauge is not None else 0
        return base + self.opt_prefill_tokens

    @property
    def running_tokens(self) -> int:
        base = self.gauge.running_tokens if self.gauge is not None else 0
        return base + self.opt_running_tokens

    @property
    def outstanding_tokens(self) -> int:
        g = self.gauge  # inlined: read for every worker of a pool on each placement
        base = g.queued_prefill_tokens + g.running_tokens if g is not None else 0
        return base + self.opt_prefill_tokens + self.opt_running_tokens

    @property
    def requests(self) -> int:
        """Requests running or waiting here: the gauge's, plus those placed since."""
        g = self.gauge
        return (g.running + g.waiting if g is not None else 0) + len(self.placements)

    @property
    def kv_usage(self) -> float:
        return self.gauge.kv_usage if self.gauge is not None else 0.0

    @property
    def draining(self) -> bool:
        if self.info is not None and self.info.state == "draining":
            return True
        return self.gauge is not None and self.gauge.draining

    @property
    def ready(self) -> bool:
        """Registered as ready and not draining (liveness is checked against ``now``)."""
        return self.info is not None and self.info.state == "ready" and not self.draining

    @property
    def lora_adapters(self) -> frozenset[str]:
        names: set[str] = set()
        if self.info is not None:
            names.update(self.info.lora_adapters)
        if self.gauge is not None:
            names.update(self.gauge.lora_adapters)
        return frozenset(names)

    @property
    def lora_cached(self) -> frozenset[str]:
        """Adapters in host memory only: a fast load."""
        return frozenset(self.gauge.lora_cached) if self.gauge is not None else frozenset()

    @property
    def max_loras(self) -> int:
        """GPU slots for adapters loaded at run time (0: only its start-up adapters)."""
        return self.info.max_loras if self.info is not None else 0

    @property
    def cached_blocks(self) -> int:
        return len(self.blocks)


class Pool:
    """The workers serving one model, and their shared prefix index."""

    __slots__ = ("_by_slot", "_placeable", "config", "epoch", "generation", "hosted", "kv", "model", "opt_tokens",
                 "workers")

    def __init__(self, model: str, config: FleetConfig) -> None:
        self.model = model
        self.config = config
        self.workers: dict[str, FleetWorker] = {}
        self.kv = KvIndex(config)
        self._by_slot: list[FleetWorker | None] = []  # index slot → worker
        # Changes when membership changes; consumers (the session ring) rebuild on it.
        self.generation = next(_generations)
        self.hosted = 0  # members that are hot-swap entries (WorkerInfo.host_id): a placement prices loads
        self.opt_tokens = 0  # Σ members' optimistic tokens (prefill + running): the pool's load without a pass
        # Changes with anything a placement's eligibility or load average reads (a member's
        # info, gauge, a stale member heard from again): the placeable set is kept between.
        self.epoch = 0
        # (epoch, computed at, valid until, the placeable members, their mask, the placeable
        # prefill workers): see FleetView.placeable_in
        self._placeable: tuple[int, float, float, list[FleetWorker], int, list[FleetWorker]] | None = None

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[FleetWorker]:
        return iter(self.workers.values())

    @property
    def index(self) -> dict[int, int]:
        """Block hash → bitmask of the slots holding it."""
        return self.kv.index

    @property
    def block_sizes(self) -> list[int]:
        return self.kv.block_sizes

    def at(self, slot: int) -> FleetWorker:
        """The worker in ``slot`` (as returned by ``cached_prefix_blocks``)."""
        w = self._by_slot[slot] if slot < len(self._by_slot) else None
        if w is None:
            raise KeyError(slot)
        return w

    # ---- membership ----
    def _add(self, worker_id: str) -> FleetWorker:
        h = self.kv.add(worker_id)
        w = FleetWorker(worker_id=worker_id, model=self.model, kv=h, pool=self, slot=h.slot, bit=h.bit)
        while len(self._by_slot) <= h.slot:
            self._by_slot.append(None)
        self._by_slot[h.slot] = w
        self.workers[worker_id] = w
        self.generation = next(_generations)
        self.epoch += 1
        return w

    def _remove(self, w: FleetWorker) -> None:
        if w.info is not None and w.info.host_id:
            self.hosted -= 1
        self.kv.remove(w.worker_id)
        self.opt_tokens -= w.opt_prefill_tokens + w.opt_running_tokens
        self._by_slot[w.slot] = None
        del self.workers[w.worker_id]
        self.generation = next(_generations)
        self.epoch += 1

    # ---- queries ----
    def mask_of(self, workers: Iterable[FleetWorker]) -> int:
        placeable = self._placeable
        if placeable is not None and workers is placeable[3]:
            return placeable[4]  # the placeable set's, computed with it
        m = 0
        for w in workers:
            m |= w.bit
        return m

    def cached_prefix_blocks(
        self, prompt: bytes, salt: str, mask: int, hashed: tuple[int, Sequence[int]] | None = None
    ) -> dict[int, int]:
        """Leading prompt blocks each worker in ``mask`` holds, as ``{slot: blocks}``.

        Workers holding no leading block are absent. ``prompt`` is packed token ids.
        The prompt is hashed per block size present among ``mask``'s workers, except
        the size of ``hashed`` (block size, the prompt's hashes in it with ``salt``).
        """
        return self.kv.cached_prefix_blocks(prompt, salt, mask, hashed)


@mypyc_attr(allow_interpreted_subclasses=True)  # admission's ReplicaBook extends it (services/common/native.py)
class FleetView:
    """All pools the consumer knows, keyed by model name."""

    def __init__(self, config: FleetConfig | None = None, *, registry_only: bool = False) -> None:
        self.config = config or FleetConfig()
        # True: only the registry adds workers; feeds of unknown workers are ignored.
        self.registry_only = registry_only
        self.pools: dict[str, Pool] = {}
        # Every model a worker has ever served: a pool that lost its last worker is
        # "empty" (retry later), not "unknown".
        self.models_seen: set[str] = set()
        self._where: dict[str, Pool] = {}  # worker id → its pool
        self._placement_owner: dict[str, FleetWorker] = {}  # request id → worker

    # ---- lookups ----
    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[FleetWorker]:
        for pool in self.pools.values():
            yield from pool

    def pool(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def worker(self, worker_id: str) -> FleetWorker | None:
        pool = self._where.get(worker_id)
        return pool.workers.get(worker_id) if pool is not None else None

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._where

    def is_live(self, w: FleetWorker, now: float) -> bool:
        return now - w.last_seen <= self.config.stale_after_s

    def placeable(self, w: FleetWorker, now: float) -> bool:
        """Ready, not draining, not expired: the only workers a policy may choose."""
        return w.ready and self.is_live(w, now)

    def placeable_in(self, pool: Pool, now: float, exclude: Collection[str] = ()) -> list[FleetWorker]:
        """``placeable`` workers of ``pool`` not in ``exclude``, in pool order; prefill
        workers (``WorkerInfo.role``) are not among them: they take no request of their own.

        Read on every placement, so the set is kept between changes: it is recomputed when
        the pool's epoch moved (a member's info or gauge changed, a stale member was heard
        from again), when its earliest member goes stale, or when ``now`` is before the
        time it was computed at. The list returned is shared: callers must not change it.
        """
        placeable = self._placeable_sets(pool, now)[3]
        if exclude:
            return [w for w in placeable if w.worker_id not in exclude]
        return placeable

    def prefill_placeable_in(self, pool: Pool, now: float) -> list[FleetWorker]:
        """The prefill workers of ``pool`` that could take a prompt now (``placeable``)."""
        return self._placeable_sets(pool, now)[5]

    def _placeable_sets(self, pool: Pool, now: float) -> tuple[int, float, float, list[FleetWorker], int, list[FleetWorker]]:
        cached = pool._placeable
        if cached is None or cached[0] != pool.epoch or not cached[1] <= now <= cached[2]:
            stale_after = self.config.stale_after_s
            horizon = now - stale_after
            out: list[FleetWorker] = []
            prefill: list[FleetWorker] = []
            oldest = math.inf
            mask = 0
            for w in pool.workers.values():
                info = w.info
                if info is None or info.state != "ready" or w.last_seen < horizon:
                    continue
                g = w.gauge
                if g is not None and g.draining:
                    continue
                oldest = min(oldest, w.last_seen)
                if info.role == "prefill":
                    prefill.append(w)
                    continue
                out.append(w)
                mask |= w.bit
            cached = pool._placeable = (pool.epoch, now, oldest + stale_after, out, mask, prefill)
        return cached

    def _heard_from(self, pool: Pool, w: FleetWorker, now: float) -> None:
        """``w`` spoke at ``now``: a member that had gone stale is placeable again."""
        if w.last_seen < now - self.config.stale_after_s:
            pool.epoch += 1
        w.last_seen = max(w.last_seen, now)

    def _fed(self, worker_id: str, model: str) -> tuple[Pool, FleetWorker] | None:
        """The worker a gauge or KV batch is about; None when the view does not take it."""
        if not self.registry_only:
            return self._ensure(worker_id, model)
        pool = self._where.get(worker_id)
        if pool is None or pool.model != model:
            return None  # not registered (yet, or any more), or for another model
        return pool, pool.workers[worker_id]

    def _ensure(self, worker_id: str, model: str) -> tuple[Pool, FleetWorker]:
        pool = self._where.get(worker_id)
        if pool is not None and pool.model != model:
            # A worker id reused for another model: start it over in the right pool.
            self.remove_worker(worker_id)
            pool = None
        if pool is None:
            pool = self.pools.get(model)
            if pool is None:
                pool = self.pools[model] = Pool(model, self.config)
                self.models_seen.add(model)
            self._where[worker_id] = pool
            return pool, pool._add(worker_id)
        return pool, pool.workers[worker_id]

    # ---- registry ----
    def update_worker(self, info: WorkerInfo, now: float) -> FleetWorker:
        """A registry put (new worker or heartbeat)."""
        pool, w = self._ensure(info.worker_id, info.model)
        if w.info is not None and info.started_at and w.info.started_at != info.started_at:
            # Same id, new process: its KV cache and in-flight work are gone.
            self._reset_worker(pool, w)
        pool.hosted += bool(info.host_id) - bool(w.info is not None and w.info.host_id)
        if w.info is None or w.info.state != info.state or w.info.role != info.role:
            pool.epoch += 1
        w.info = info
        pool.kv.set_block_size(w.kv, info.block_size)
        self._heard_from(pool, w, now)
        return w

    def remove_worker(self, worker_id: str) -> bool:
        """Heartbeat expired or registry delete: forget the worker and its index entries."""
        pool = self._where.pop(worker_id, None)
        if pool is None:
            return False
        w = pool.workers[worker_id]
        for rid in w.placements:
            self._placement_owner.pop(rid, None)
        pool._remove(w)
        if not pool.workers:
            del self.pools[pool.model]
        return True

    def expire(self, now: float) -> list[str]:
        """Remove every worker not heard from within ``stale_after_s``; return their ids."""
        dead = [w.worker_id for pool in self.pools.values() for w in pool if not self.is_live(w, now)]
        for wid in dead:
            self.remove_worker(wid)
        return dead

    def _reset_worker(self, pool: Pool, w: FleetWorker) -> None:
        pool.kv.reset(w.kv)
        w.gauge = None
        w.load_avg = None
        pool.epoch += 1
        self._drop_placements(w, len(w.placements))

    # ---- gauges and optimistic accounting ----
    def apply_gauge(self, gauge: WorkerGauge, now: float) -> bool:
        """A new load report. False for one older than the gauge already held, or one
        the view does not take (``registry_only`` and the worker not registered)."""
        fed = self._fed(gauge.worker_id, gauge.model)
        if fed is None:
            return False
        pool, w = fed
        self._heard_from(pool, w, now)
        if w.gauge is not None and gauge.ts < w.gauge.ts:
            return False  # reordered delivery: the newer gauge stays
        pool.epoch += 1  # its load average and draining flag
        w.load_avg = ewma(w.load_avg, w.gauge_received_at if w.gauge is not None else None,
                          float(gauge.queued_prefill_tokens + gauge.running_tokens), now, self.config.load_avg_window_s)
        w.gauge = gauge
        w.gauge_received_at = now
        if gauge.arrived is not None:
            # The gauge counts the requests it names, wherever they were counted (admission
            # counts one on the replica it predicted for; the router may place it elsewhere).
            for request_id in gauge.arrived:
                self.release_placement(request_id)
            # One no gauge has named for this long never reached its worker.
            self._drop_placements(w, _count_placed_before(w, now - self.config.placement_unseen_s))
        else:
            # A worker that names no arrivals: take the gauge to carry every placement made
            # long enough before it arrived.
            self._drop_placements(w, _count_placed_before(w, now - self.config.placement_settle_s))
        # A gauge names the last KV batch its worker published: a batch still unseen a
        # gauge period later was lost (e.g. the last one before the worker idled).
        pool.kv.note_published_seq(w.kv, gauge.kv_event_seq)
        return True

    def record_placement(
        self, worker_id: str, request_id: str, prefill_tokens: int, total_tokens: int, now: float
    ) -> None:
        """Count a placement on the worker at once, until a gauge includes it."""
        w = self.worker(worker_id)
        if w is None:
            raise KeyError(worker_id)
        self.release_placement(request_id)  # a retry moves the request
        w.placements[request_id] = Placement(worker_id, now, prefill_tokens, total_tokens)
        w.last_placed_at = now
        _count_optimistic(w, prefill_tokens, total_tokens)
        self._placement_owner[request_id] = w
        self.age_out(w, now)

    def release_placement(self, request_id: str) -> bool:
        """Undo the optimistic addition of a request the worker refused or never got."""
        w = self._placement_owner.pop(request_id, None)
        if w is None:
            return False
        p = w.placements.pop(request_id)
        _count_optimistic(w, -p.prefill_tokens, -p.total_tokens)
        return True

    def age_out(self, w: FleetWorker, now: float) -> None:
        """Drop ``w``'s placements older than ``placement_max_age_s``."""
        self._drop_placements(w, _count_placed_before(w, now - self.config.placement_max_age_s))

    def _drop_placements(self, w: FleetWorker, n: int) -> None:
        """Drop the ``n`` oldest optimistic placements of ``w``."""
        if n <= 0:
            return
        if n >= len(w.placements):
            for rid in w.placements:
                self._placement_owner.pop(rid, None)
            w.placements.clear()
            _count_optimistic(w, -w.opt_prefill_tokens, -w.opt_running_tokens)
            return
        for rid in list(w.placements)[:n]:
            p = w.placements.pop(rid)
            self._placement_owner.pop(rid, None)
            _count_optimistic(w, -p.prefill_tokens, -p.total_tokens)

    # ---- KV events ----
    def apply_kv_events(self, batch: KvEventBatch, now: float) -> KvApply | None:
        """None when the view does not take the worker's events (``registry_only``)."""
        fed = self._fed(batch.worker_id, batch.model)
        if fed is None:
            return None
        pool, w = fed
        self._heard_from(pool, w, now)
        return pool.kv.apply(batch)

    def take_resync_requests(self, now: float, retry_after_s: float = 2.0) -> list[str]:
        """Workers whose snapshot the shell should request now (marks them requested).

        A worker is returned again if its snapshot has not arrived ``retry_after_s``
        after the last request (request or reply lost).
        """
        out: list[str] = []
        for pool in self.pools.values():
            out.extend(pool.kv.take_resync_requests(now, retry_after_s))
        return out

    def needs_resync(self, worker_id: str) -> bool:
        w = self.worker(worker_id)
        return w is not None and w.needs_resync

    def apply_snapshot(self, snap: KvSnapshot, now: float) -> bool:
        """Replace a worker's index entries by its snapshot, then replay newer batches.

        Returns True when the worker is consistent again; False when a batch between the
        snapshot and the newest one received is missing (the resync stays pending) or the
        worker is unknown (removed meanwhile: the snapshot is dropped).
        """
        pool = self._where.get(snap.worker_id)
        if pool is None or pool.model != snap.model:
            return False
        w = pool.workers[snap.worker_id]
        self._heard_from(pool, w, now)
        return pool.kv.apply_snapshot(snap)


def pack_prompt(prompt: bytes | Iterable[int]) -> bytes:
    """Packed token ids (the wire form) from either form."""
    return prompt if isinstance(prompt, bytes) else pack_tokens(list(prompt))


def _count_optimistic(w: FleetWorker, prefill_tokens: int, total_tokens: int) -> None:
    """Add (or, negative, take away) a placement's tokens on ``w`` and its pool's sum."""
    w.opt_prefill_tokens += prefill_tokens
    w.opt_running_tokens += total_tokens
    w.pool.opt_tokens += prefill_tokens + total_tokens


def _count_placed_before(w: FleetWorker, cutoff: float) -> int:
    """How many of ``w``'s placements (oldest first) were made before ``cutoff``."""
    n = 0
    for p in w.placements.values():
        if p.placed_at >= cutoff:
            break
        n += 1
    return n
