"""The router's live view of its pools: who is there, how loaded, and what they cache.

Everything here is synchronous and driven by the async shell, which feeds it registry
entries, gauges, KV event batches and snapshots, always with the router's own clock
reading ``now``. Worker timestamps are only compared with other timestamps of the same
worker (gauge ordering), never with the router's clock, so clock skew between hosts
cannot make a worker look dead or a gauge look fresh.

Prefix index. Per pool, ``block hash → bitmask of worker slots``: one dict entry per
distinct block, a Python int as a bitset (a slot is a small integer handed out when a
worker joins and reused after it leaves). Entries held by a single worker share one
interned mask object, so a fleet of mostly-private caches costs one dict slot per block.
Each worker also keeps the set of hashes it holds, which makes AllCleared, removal
and snapshot replacement proportional to that worker's cache, not to the pool's.
Finding every worker's longest cached prefix is one walk over the prompt's blocks,
AND-ing masks until no worker survives: O(prefix blocks) integer operations whatever
the pool size, and the prompt is hashed lazily so an uncached prompt costs one hash.

KV events are sequenced per worker. A gap (or joining a worker's stream mid-way) marks
the worker as needing a resync: the shell asks it for a ``KvSnapshot`` and calls
``apply_snapshot``. Until then events keep being applied (a mostly-right index beats an
empty one; a wrong entry only costs a less-than-ideal placement) and are also buffered,
so the snapshot, which is "as of seq S", can be brought forward by replaying the
buffered batches after S. A short window of recent batches is kept even when healthy,
so an unrequested snapshot (e.g. at router start) lands consistently as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from proto.hashing import extend_block_hashes, pack_tokens, root_hash
from proto.messages import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    WorkerGauge,
    WorkerInfo,
)

DEFAULT_BLOCK_SIZE = 16

# Pool generations come from one counter so that a pool dropped and re-created never
# repeats a generation a consumer has cached.
_generations = itertools.count(1)


@dataclass(frozen=True, slots=True)
class ViewConfig:
    # A worker not heard from (registry put, gauge or KV batch) for this long is
    # treated as expired: never placed on, and dropped by ``expire``. The registry's
    # KV TTL normally removes it first; this is the backstop if that delete is missed.
    stale_after_s: float = 15.0
    # A gauge received at least this long after a placement is taken to include it.
    # Compared on the router's clock only: the request needs one hop to reach the
    # worker and the gauge one hop back, both far below this on a LAN.
    placement_settle_s: float = 0.02
    # Optimistic additions older than this are dropped even without a new gauge, so a
    # worker whose gauges stop does not look busy forever.
    placement_max_age_s: float = 30.0
    # Batches kept for replay on top of an unrequested snapshot (healthy stream) and the
    # cap while a resync is pending (oldest dropped first; a hole re-triggers a resync).
    replay_window: int = 32
    max_pending_batches: int = 4096
    # Blocks hashed per step of the lazy prefix walk; doubles each step up to the max.
    hash_chunk_blocks: int = 16
    hash_chunk_max: int = 1024


class KvApply(Enum):
    """What ``apply_kv_events`` did with a batch."""

    APPLIED = "applied"  # in order
    DUPLICATE = "duplicate"  # seq already seen: ignored
    GAP = "gap"  # applied best-effort; the worker now needs a resync (new this batch)
    RESYNCING = "resyncing"  # applied best-effort and buffered; a resync is pending
    RESET = "reset"  # seq restarted at 0: the worker's engine restarted, index rebuilt


@dataclass(slots=True)
class _Placement:
    worker_id: str
    placed_at: float
    prefill_tokens: int
    total_tokens: int


@dataclass(eq=False, slots=True)
class WorkerView:
    """One worker as the router sees it. Policies read it; only ``RouterView`` writes."""

    worker_id: str
    model: str
    slot: int
    bit: int  # 1 << slot, interned: the single-holder mask shared by index entries
    info: WorkerInfo | None = None
    gauge: WorkerGauge | None = None
    last_seen: float = 0.0
    gauge_received_at: float = float("-inf")
    block_size: int = DEFAULT_BLOCK_SIZE
    # optimistic accounting: placements not yet reflected by a gauge, oldest first
    placements: dict[str, _Placement] = field(default_factory=dict)
    opt_prefill_tokens: int = 0
    opt_running_tokens: int = 0
    # KV cache mirror
    blocks: set[int] = field(default_factory=set)
    kv_seq: int = -1  # highest batch seq received (-1: none yet)
    needs_resync: bool = False
    resync_requested_at: float | None = None
    recent_batches: dict[int, KvEventBatch] = field(default_factory=dict)  # seq → batch
    prev_gauge_kv_seq: int = -1

    # ---- load, gauge plus what this router placed since that gauge ----
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
        return self.queued_prefill_tokens + self.running_tokens

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
    def cached_blocks(self) -> int:
        return len(self.blocks)


class Pool:
    """The workers serving one model, and their shared prefix index."""

    __slots__ = ("_bs_masks", "_free_slots", "_slots", "config", "generation", "index", "model", "workers")

    def __init__(self, model: str, config: ViewConfig) -> None:
        self.model = model
        self.config = config
        self.workers: dict[str, WorkerView] = {}
        self.index: dict[int, int] = {}  # block hash → bitmask of slots holding it
        self._slots: list[WorkerView | None] = []
        self._free_slots: list[int] = []
        self._bs_masks: dict[int, int] = {}  # block size → slots with that block size
        # Changes when membership changes; consumers (the session ring) rebuild on it.
        self.generation = next(_generations)

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[WorkerView]:
        return iter(self.workers.values())

    @property
    def block_sizes(self) -> list[int]:
        return sorted(bs for bs, mask in self._bs_masks.items() if mask)

    def at(self, slot: int) -> WorkerView:
        """The worker in ``slot`` (as returned by ``cached_prefix_blocks``)."""
        w = self._slots[slot]
        if w is None:
            raise KeyError(slot)
        return w

    # ---- membership ----
    def _add(self, worker_id: str) -> WorkerView:
        if self._free_slots:
            slot = min(self._free_slots)  # low slots keep masks small
            self._free_slots.remove(slot)
        else:
            slot = len(self._slots)
            self._slots.append(None)
        w = WorkerView(worker_id=worker_id, model=self.model, slot=slot, bit=1 << slot)
        self._slots[slot] = w
        self.workers[worker_id] = w
        self._bs_masks[w.block_size] = self._bs_masks.get(w.block_size, 0) | w.bit
        self.generation = next(_generations)
        return w

    def _remove(self, w: WorkerView) -> None:
        self._clear_blocks(w)
        self._bs_masks[w.block_size] &= ~w.bit
        self._slots[w.slot] = None
        self._free_slots.append(w.slot)
        del self.workers[w.worker_id]
        self.generation = next(_generations)

    def _set_block_size(self, w: WorkerView, block_size: int) -> None:
        if block_size <= 0 or block_size == w.block_size:
            return
        # Hashes of another block size are meaningless for the new one.
        self._clear_blocks(w)
        self._bs_masks[w.block_size] &= ~w.bit
        w.block_size = block_size
        self._bs_masks[block_size] = self._bs_masks.get(block_size, 0) | w.bit

    # ---- prefix index maintenance ----
    def _store(self, w: WorkerView, hashes: Iterable[int]) -> None:
        index, blocks, bit = self.index, w.blocks, w.bit
        for h in hashes:
            if h in blocks:
                continue
            blocks.add(h)
            m = index.get(h)
            index[h] = bit if m is None else (m | bit)

    def _drop(self, w: WorkerView, hashes: Iterable[int]) -> None:
        index, blocks, notbit = self.index, w.blocks, ~w.bit
        for h in hashes:
            if h not in blocks:
                continue
            blocks.discard(h)
            m = index[h] & notbit
            if m:
                index[h] = m
            else:
                del index[h]

    def _clear_blocks(self, w: WorkerView) -> None:
        index, notbit = self.index, ~w.bit
        for h in w.blocks:
            m = index[h] & notbit
            if m:
                index[h] = m
            else:
                del index[h]
        w.blocks = set()

    def _replace_blocks(self, w: WorkerView, hashes: Iterable[int]) -> None:
        new = set(hashes)
        self._drop(w, [h for h in w.blocks if h not in new])
        self._store(w, new)

    # ---- queries ----
    def mask_of(self, workers: Iterable[WorkerView]) -> int:
        m = 0
        for w in workers:
            m |= w.bit
        return m

    def cached_prefix_blocks(self, prompt: bytes, salt: str, mask: int) -> dict[int, int]:
        """Leading prompt blocks each worker in ``mask`` holds, as ``{slot: blocks}``.

        Workers holding no leading block are absent. ``prompt`` is packed token ids.
        The prompt is hashed per block size present among ``mask``'s workers.
        """
        out: dict[int, int] = {}
        for bs, bs_mask in self._bs_masks.items():
            alive = mask & bs_mask
            if alive:
                self._walk(prompt, bs, salt, alive, out)
        return out

    def _walk(self, data: bytes, block_size: int, salt: str, alive: int, out: dict[int, int]) -> None:
        stride = 4 * block_size
        nblocks = len(data) // stride
        index_get = self.index.get
        parent = root_hash(salt)
        chunk = self.config.hash_chunk_blocks
        i = 0
        while alive and i < nblocks:
            end = min(nblocks, i + chunk)
            hashes = extend_block_hashes(parent, data[i * stride : end * stride], block_size)
            for h in hashes:
                m = index_get(h, 0) & alive
                if m != alive:
                    lost = alive & ~m
                    if i:
                        while lost:
                            low = lost & -lost
                            out[low.bit_length() - 1] = i
                            lost ^= low
                    alive = m
                    if not alive:
                        return
                i += 1
            parent = hashes[-1]
            chunk = min(chunk * 2, self.config.hash_chunk_max)
        while alive:  # survivors hold every full block of the prompt
            low = alive & -alive
            out[low.bit_length() - 1] = i
            alive ^= low


class RouterView:
    """All pools the router knows, keyed by model name."""

    def __init__(self, config: ViewConfig | None = None) -> None:
        self.config = config or ViewConfig()
        self.pools: dict[str, Pool] = {}
        # Every model a worker has ever served: a pool that lost its last worker is
        # "empty" (retry later), not "unknown".
        self.models_seen: set[str] = set()
        self._where: dict[str, Pool] = {}  # worker id → its pool
        self._placement_owner: dict[str, WorkerView] = {}  # request id → worker

    # ---- lookups ----
    def pool(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def worker(self, worker_id: str) -> WorkerView | None:
        pool = self._where.get(worker_id)
        return pool.workers.get(worker_id) if pool is not None else None

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._where

    def is_live(self, w: WorkerView, now: float) -> bool:
        return now - w.last_seen <= self.config.stale_after_s

    def placeable(self, w: WorkerView, now: float) -> bool:
        """Ready, not draining, not expired: the only workers a policy may choose."""
        return w.ready and self.is_live(w, now)

    def placeable_in(self, pool: Pool, now: float, exclude: Collection[str] = ()) -> list[WorkerView]:
        """``placeable`` workers of ``pool`` not in ``exclude``, in pool order (inlined: hot)."""
        horizon = now - self.config.stale_after_s
        out: list[WorkerView] = []
        for w in pool.workers.values():
            info = w.info
            if info is None or info.state != "ready" or w.last_seen < horizon:
                continue
            g = w.gauge
            if (g is not None and g.draining) or (exclude and w.worker_id in exclude):
                continue
            out.append(w)
        return out

    def _ensure(self, worker_id: str, model: str) -> tuple[Pool, WorkerView]:
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
    def update_worker(self, info: WorkerInfo, now: float) -> WorkerView:
        """A registry put (new worker or heartbeat)."""
        pool, w = self._ensure(info.worker_id, info.model)
        if w.info is not None and info.started_at and w.info.started_at != info.started_at:
            # Same id, new process: its KV cache and in-flight work are gone.
            self._reset_worker(pool, w)
        w.info = info
        pool._set_block_size(w, info.block_size)
        w.last_seen = max(w.last_seen, now)
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

    def _reset_worker(self, pool: Pool, w: WorkerView) -> None:
        pool._clear_blocks(w)
        w.kv_seq = -1
        w.needs_resync = False
        w.resync_requested_at = None
        w.recent_batches.clear()
        w.prev_gauge_kv_seq = -1
        w.gauge = None
        self._drop_placements(w, len(w.placements))

    # ---- gauges and optimistic accounting ----
    def apply_gauge(self, gauge: WorkerGauge, now: float) -> bool:
        """A new load report. Returns False for one older than the gauge already held."""
        _, w = self._ensure(gauge.worker_id, gauge.model)
        w.last_seen = max(w.last_seen, now)
        if w.gauge is not None and gauge.ts < w.gauge.ts:
            return False  # reordered delivery: the newer gauge stays
        w.gauge = gauge
        w.gauge_received_at = now
        # The gauge now carries every placement made long enough before it arrived.
        cutoff = now - self.config.placement_settle_s
        n = 0
        for p in w.placements.values():
            if p.placed_at > cutoff:
                break
            n += 1
        self._drop_placements(w, n)
        # A gauge names the last KV batch its worker published. If the previous gauge
        # named a batch we still have not seen a whole gauge period later, that batch
        # was lost (a gap nothing after it would reveal, e.g. the last before idling).
        if gauge.kv_event_seq >= 0:
            if w.prev_gauge_kv_seq > w.kv_seq and not w.needs_resync:
                self._start_resync(w)
            w.prev_gauge_kv_seq = gauge.kv_event_seq
        return True

    def record_placement(
        self, worker_id: str, request_id: str, prefill_tokens: int, total_tokens: int, now: float
    ) -> None:
        """Count a placement on the worker at once, until a gauge includes it."""
        w = self.worker(worker_id)
        if w is None:
            raise KeyError(worker_id)
        self.release_placement(request_id)  # a retry moves the request
        w.placements[request_id] = _Placement(worker_id, now, prefill_tokens, total_tokens)
        w.opt_prefill_tokens += prefill_tokens
        w.opt_running_tokens += total_tokens
        self._placement_owner[request_id] = w
        self._age_out(w, now)

    def release_placement(self, request_id: str) -> bool:
        """Undo the optimistic addition of a request the worker refused or never got."""
        w = self._placement_owner.pop(request_id, None)
        if w is None:
            return False
        p = w.placements.pop(request_id)
        w.opt_prefill_tokens -= p.prefill_tokens
        w.opt_running_tokens -= p.total_tokens
        return True

    def _age_out(self, w: WorkerView, now: float) -> None:
        cutoff = now - self.config.placement_max_age_s
        n = 0
        for p in w.placements.values():
            if p.placed_at >= cutoff:
                break
            n += 1
        self._drop_placements(w, n)

    def _drop_placements(self, w: WorkerView, n: int) -> None:
        """Drop the ``n`` oldest optimistic placements of ``w``."""
        if n <= 0:
            return
        if n >= len(w.placements):
            for rid in w.placements:
                self._placement_owner.pop(rid, None)
            w.placements.clear()
            w.opt_prefill_tokens = 0
            w.opt_running_tokens = 0
            return
        for rid in list(w.placements)[:n]:
            p = w.placements.pop(rid)
            self._placement_owner.pop(rid, None)
            w.opt_prefill_tokens -= p.prefill_tokens
            w.opt_running_tokens -= p.total_tokens

    # ---- KV events ----
    def apply_kv_events(self, batch: KvEventBatch, now: float) -> KvApply:
        pool, w = self._ensure(batch.worker_id, batch.model)
        w.last_seen = max(w.last_seen, now)
        seq = batch.seq
        if seq == 0 and w.kv_seq > 0:
            # The worker's event counter restarted: a new engine, an empty cache.
            self._reset_kv(pool, w)
            self._apply_batch(pool, w, batch)
            w.kv_seq = 0
            return KvApply.RESET
        if seq <= w.kv_seq or seq in w.recent_batches:
            return KvApply.DUPLICATE  # already seen, or older than an applied snapshot
        self._apply_batch(pool, w, batch)
        expected = w.kv_seq + 1
        w.kv_seq = seq
        if w.needs_resync:
            return KvApply.RESYNCING
        if seq == expected:
            return KvApply.APPLIED
        # A gap, or a stream joined mid-way (first batch seen is not seq 0).
        self._start_resync(w)
        return KvApply.GAP

    def _reset_kv(self, pool: Pool, w: WorkerView) -> None:
        pool._clear_blocks(w)
        w.kv_seq = -1
        w.needs_resync = False
        w.resync_requested_at = None
        w.recent_batches.clear()
        w.prev_gauge_kv_seq = -1

    def _start_resync(self, w: WorkerView) -> None:
        w.needs_resync = True
        w.resync_requested_at = None

    def _apply_batch(self, pool: Pool, w: WorkerView, batch: KvEventBatch) -> None:
        self._replay(pool, w, batch)
        recent = w.recent_batches
        recent[batch.seq] = batch
        limit = self.config.max_pending_batches if w.needs_resync else self.config.replay_window
        while len(recent) > limit:
            del recent[next(iter(recent))]  # inserted in seq order: the first is the oldest

    @staticmethod
    def _replay(pool: Pool, w: WorkerView, batch: KvEventBatch) -> None:
        for ev in batch.events:
            match ev:
                case BlockStored():
                    if w.info is None and ev.block_size != w.block_size:
                        pool._set_block_size(w, ev.block_size)  # learnt before the registry entry
                    pool._store(w, ev.block_hashes)
                case BlockRemoved():
                    pool._drop(w, ev.block_hashes)
                case AllCleared():
                    pool._clear_blocks(w)

    def take_resync_requests(self, now: float, retry_after_s: float = 2.0) -> list[str]:
        """Workers whose snapshot the shell should request now (marks them requested).

        A worker is returned again if its snapshot has not arrived ``retry_after_s``
        after the last request (request or reply lost).
        """
        out: list[str] = []
        for pool in self.pools.values():
            for w in pool:
                if not w.needs_resync:
                    continue
                if w.resync_requested_at is None or now - w.resync_requested_at >= retry_after_s:
                    w.resync_requested_at = now
                    out.append(w.worker_id)
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
        w.last_seen = max(w.last_seen, now)
        if w.info is None:
            pool._set_block_size(w, snap.block_size)
        pool._replace_blocks(w, snap.block_hashes)
        last = snap.seq
        recent = w.recent_batches
        for s in sorted(s for s in recent if s > snap.seq):
            if s != last + 1:
                break
            self._replay(pool, w, recent[s])
            last = s
        consistent = last >= w.kv_seq
        if not consistent:
            # A batch after the snapshot is missing. The ones beyond the hole are still
            # true events: apply them best-effort and keep them for the next snapshot.
            for s in sorted(s for s in recent if s > last):
                self._replay(pool, w, recent[s])
        w.kv_seq = max(w.kv_seq, last)
        for s in [s for s in recent if s <= last]:
            if s < last - self.config.replay_window:
                del recent[s]
        if consistent:
            w.needs_resync = False
            w.resync_requested_at = None
            while len(recent) > self.config.replay_window:
                del recent[next(iter(recent))]
        else:
            w.needs_resync = True
        return consistent


def pack_prompt(prompt: bytes | Iterable[int]) -> bytes:
    """Packed token ids (the wire form) from either form."""
    return prompt if isinstance(prompt, bytes) else pack_tokens(list(prompt))
