"""The KV prefix index: which workers of a pool hold which prompt blocks.

This is the reading of the KV event contract (``KvEventBatch``, ``KvSnapshot``), the
way ``proto.hashing`` is the reading of the block hash: every service that needs to know
where a prompt's prefix is cached (router, admission) keeps one ``KvIndex`` per pool and
feeds it the same events, so they agree without talking to each other. Pure and
synchronous: callers pass their own clock reading where time matters.

Layout. ``block hash → bitmask of worker slots``: one dict entry per distinct block, a
Python int as a bitset (a slot is a small integer handed out when a worker joins and
reused after it leaves). Entries held by a single worker share that worker's interned
mask object, so a fleet of mostly-private caches costs one dict slot per block. Each
worker (``KvHolder``) also keeps the set of hashes it holds, which makes AllCleared,
removal and snapshot replacement proportional to that worker's cache, not the pool's.
Finding every worker's longest cached prefix is one walk over the prompt's blocks,
AND-ing masks until no worker survives: O(prefix blocks) integer operations whatever
the pool size. From packed token ids the prompt is hashed lazily (an uncached prompt
costs one hash); from precomputed hashes (``AdmissionRequest.block_hashes``) nothing is
hashed at all.

Sequencing. Batches are numbered per worker. A gap (or joining a worker's stream
mid-way) marks the worker as needing a resync: the caller asks it for a ``KvSnapshot``
(``take_resync_requests``) and applies it (``apply_snapshot``). Until then events keep
being applied (a mostly-right index beats an empty one; a wrong entry only costs a
less-than-ideal placement) and are also buffered, so the snapshot, which is "as of seq
S", is brought forward by replaying the buffered batches after S. A short window of
recent batches is kept even when healthy, so an unrequested snapshot lands consistently
as well. A batch numbered 0 after later ones means the engine restarted: its cache is
gone. A gauge's ``kv_event_seq`` names the last batch published; one the index has not
seen a gauge period later was lost (``note_published_seq``), a gap nothing after it
would reveal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from proto.hashing import extend_block_hashes, root_hash
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KvIndexConfig:
    # Batches kept for replay on top of an unrequested snapshot (healthy stream) and the
    # cap while a resync is pending (oldest dropped first; a hole re-triggers a resync).
    replay_window: int = 32
    max_pending_batches: int = 4096
    # Blocks hashed per step of the lazy prefix walk; doubles each step up to the max.
    hash_chunk_blocks: int = 16
    hash_chunk_max: int = 1024


class KvApply(Enum):
    """What ``KvIndex.apply`` did with a batch."""

    APPLIED = "applied"  # in order
    DUPLICATE = "duplicate"  # seq already seen: ignored
    GAP = "gap"  # applied best-effort; the worker now needs a resync (new this batch)
    RESYNCING = "resyncing"  # applied best-effort and buffered; a resync is pending
    RESET = "reset"  # seq restarted at 0: the worker's engine restarted, index rebuilt


class HasBit(Protocol):
    @property
    def bit(self) -> int: ...


class KvHolder:
    """One worker's cache mirror and event sequencing. Only ``KvIndex`` writes it."""

    __slots__ = (
        "bit",
        "block_size",
        "block_size_pinned",
        "blocks",
        "needs_resync",
        "published_seq",
        "recent",
        "resync_requested_at",
        "seq",
        "slot",
        "worker_id",
    )

    def __init__(self, worker_id: str, slot: int, block_size: int) -> None:
        self.worker_id = worker_id
        self.slot = slot
        self.bit = 1 << slot  # interned: the single-holder mask shared by index entries
        self.block_size = block_size
        # True once the registry said the block size; events then cannot change it.
        self.block_size_pinned = False
        self.blocks: set[int] = set()
        self.seq = -1  # highest batch seq received (-1: none yet)
        self.needs_resync = False
        self.resync_requested_at: float | None = None
        self.recent: dict[int, KvEventBatch] = {}  # seq → batch, in seq order
        self.published_seq = -1  # the last gauge's kv_event_seq

    def __repr__(self) -> str:
        return f"KvHolder({self.worker_id!r}, slot={self.slot}, blocks={len(self.blocks)}, seq={self.seq})"


class KvIndex:
    """The prefix index of one pool (one model): block hash → workers holding it."""

    __slots__ = ("_bs_masks", "_free_slots", "_masks", "_slots", "config", "holders", "index")

    def __init__(self, config: KvIndexConfig | None = None) -> None:
        self.config = config or KvIndexConfig()
        self.index: dict[int, int] = {}  # block hash → bitmask of slots holding it
        # One object per distinct mask (a shared prompt's blocks hold the same one), so a
        # walk along a prefix reads one mask from memory, not one per block.
        self._masks: dict[int, int] = {}
        self.holders: dict[str, KvHolder] = {}
        self._slots: list[KvHolder | None] = []
        self._free_slots: list[int] = []
        self._bs_masks: dict[int, int] = {}  # block size → slots with that block size

    def __len__(self) -> int:
        return len(self.holders)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.holders

    def get(self, worker_id: str) -> KvHolder | None:
        return self.holders.get(worker_id)

    def at(self, slot: int) -> KvHolder:
        h = self._slots[slot] if slot < len(self._slots) else None
        if h is None:
            raise KeyError(slot)
        return h

    @property
    def block_sizes(self) -> list[int]:
        return sorted(bs for bs, mask in self._bs_masks.items() if mask)

    def mask_of(self, items: Iterable[HasBit]) -> int:
        m = 0
        for x in items:
            m |= x.bit
        return m

    @property
    def all_mask(self) -> int:
        m = 0
        for bs_mask in self._bs_masks.values():
            m |= bs_mask
        return m

    # ---- membership ----
    def add(self, worker_id: str, block_size: int | None = None) -> KvHolder:
        """The worker's holder, created empty if new (``block_size`` pins it when given)."""
        h = self.holders.get(worker_id)
        if h is None:
            if self._free_slots:
                slot = min(self._free_slots)  # low slots keep masks small
                self._free_slots.remove(slot)
            else:
                slot = len(self._slots)
                self._slots.append(None)
            h = KvHolder(worker_id, slot, DEFAULT_BLOCK_SIZE)
            self._slots[slot] = h
            self.holders[worker_id] = h
            self._bs_masks[h.block_size] = self._bs_masks.get(h.block_size, 0) | h.bit
        if block_size is not None:
            self.set_block_size(h, block_size)
        return h

    def remove(self, worker_id: str) -> bool:
        """Forget a worker and every index entry it contributed; its slot is reused."""
        h = self.holders.pop(worker_id, None)
        if h is None:
            return False
        self._clear(h)
        self._bs_masks[h.block_size] &= ~h.bit
        self._slots[h.slot] = None
        self._free_slots.append(h.slot)
        return True

    def set_block_size(self, h: KvHolder, block_size: int, *, pin: bool = True) -> None:
        if pin:
            h.block_size_pinned = True
        if block_size <= 0 or block_size == h.block_size:
            return
        # Hashes of another block size are meaningless for the new one.
        self._clear(h)
        self._bs_masks[h.block_size] &= ~h.bit
        h.block_size = block_size
        self._bs_masks[block_size] = self._bs_masks.get(block_size, 0) | h.bit

    def reset(self, h: KvHolder) -> None:
        """The worker's engine is new (restart, same id): its cache and numbering are gone."""
        self._clear(h)
        h.seq = -1
        h.needs_resync = False
        h.resync_requested_at = None
        h.recent.clear()
        h.published_seq = -1

    # ---- index maintenance ----
    # The masks are handled as objects (Any) here: compiled (services/common/native.py),
    # an ``int`` below 2**62 would be unboxed and boxed anew on every store, unshared.
    def _store(self, h: KvHolder, hashes: Iterable[int]) -> None:
        index: dict[int, Any] = self.index
        masks: dict[Any, Any] = self._masks
        blocks, bit = h.blocks, h.bit
        for x in hashes:
            if x in blocks:
                continue
            blocks.add(x)
            m = index.get(x)
            m = bit if m is None else (m | bit)
            index[x] = masks.setdefault(m, m)
        if len(masks) > _MAX_SHARED_MASKS:
            masks.clear()

    def _drop(self, h: KvHolder, hashes: Iterable[int]) -> None:
        index: dict[int, Any] = self.index
        masks: dict[Any, Any] = self._masks
        blocks, notbit = h.blocks, ~h.bit
        for x in hashes:
            if x not in blocks:
                continue
            blocks.discard(x)
            m = index[x] & notbit
            if m:
                index[x] = masks.setdefault(m, m)
            else:
                del index[x]

    def _clear(self, h: KvHolder) -> None:
        self._drop(h, list(h.blocks))

    def _replace(self, h: KvHolder, hashes: Iterable[int]) -> None:
        new = set(hashes)
        self._drop(h, [x for x in h.blocks if x not in new])
        self._store(h, new)

    def _replay(self, h: KvHolder, batch: KvEventBatch) -> None:
        for ev in batch.events:
            match ev:
                case BlockStored():
                    if not h.block_size_pinned and ev.block_size != h.block_size:
                        # learnt from the events before the registry said it
                        self.set_block_size(h, ev.block_size, pin=False)
                    self._store(h, ev.block_hashes)
                case BlockRemoved():
                    self._drop(h, ev.block_hashes)
                case AllCleared():
                    self._clear(h)

    # ---- events ----
    def apply(self, batch: KvEventBatch) -> KvApply:
        """Apply one worker's batch (the worker is added if unknown)."""
        h = self.add(batch.worker_id)
        seq = batch.seq
        if seq == 0 and h.seq > 0:
            # The worker's event counter restarted: a new engine, an empty cache.
            self.reset(h)
            self._keep(h, batch)
            h.seq = 0
            return KvApply.RESET
        if seq <= h.seq or seq in h.recent:
            return KvApply.DUPLICATE  # already seen, or older than an applied snapshot
        self._keep(h, batch)
        expected = h.seq + 1
        h.seq = seq
        if h.needs_resync:
            return KvApply.RESYNCING
        if seq == expected:
            return KvApply.APPLIED
        # A gap, or a stream joined mid-way (first batch seen is not seq 0).
        self._start_resync(h)
        return KvApply.GAP

    def _keep(self, h: KvHolder, batch: KvEventBatch) -> None:
        self._replay(h, batch)
        recent = h.recent
        recent[batch.seq] = batch
        limit = self.config.max_pending_batches if h.needs_resync else self.config.replay_window
        while len(recent) > limit:
            del recent[next(iter(recent))]  # inserted in seq order: the first is the oldest

    @staticmethod
    def _start_resync(h: KvHolder) -> None:
        h.needs_resync = True
        h.resync_requested_at = None

    def note_published_seq(self, h: KvHolder, seq: int) -> bool:
        """A gauge says the worker's last published batch is ``seq``.

        If the previous gauge named a batch still unseen now, a gauge period later, that
        batch was lost: start a resync. Returns True when this call started one.
        """
        if seq < 0:
            return False
        started = h.published_seq > h.seq and not h.needs_resync
        if started:
            self._start_resync(h)
        h.published_seq = seq
        return started

    def needs_resync(self, worker_id: str) -> bool:
        h = self.holders.get(worker_id)
        return h is not None and h.needs_resync

    def take_resync_requests(self, now: float, retry_after_s: float = 2.0) -> list[str]:
        """Workers whose snapshot the caller should request now (marks them requested).

        A worker is returned again if its snapshot has not arrived ``retry_after_s``
        after the last request (request or reply lost).
        """
        out: list[str] = []
        for h in self.holders.values():
            if not h.needs_resync:
                continue
            if h.resync_requested_at is None or now - h.resync_requested_at >= retry_after_s:
                h.resync_requested_at = now
                out.append(h.worker_id)
        return out

    def apply_snapshot(self, snap: KvSnapshot) -> bool:
        """Replace a worker's entries by its snapshot, then replay newer batches.

        Returns True when the worker is consistent again; False when a batch between the
        snapshot and the newest one received is missing (the resync stays pending) or the
        worker is unknown (removed meanwhile: the snapshot is dropped).
        """
        h = self.holders.get(snap.worker_id)
        if h is None:
            return False
        if not h.block_size_pinned:
            self.set_block_size(h, snap.block_size, pin=False)
        self._replace(h, snap.block_hashes)
        last = snap.seq
        recent = h.recent
        for s in sorted(s for s in recent if s > snap.seq):
            if s != last + 1:
                break
            self._replay(h, recent[s])
            last = s
        consistent = last >= h.seq
        if not consistent:
            # A batch after the snapshot is missing. The ones beyond the hole are still
            # true events: apply them best-effort and keep them for the next snapshot.
            for s in sorted(s for s in recent if s > last):
                self._replay(h, recent[s])
        h.seq = max(h.seq, last)
        window = self.config.replay_window
        for s in [s for s in recent if s < last - window]:
            del recent[s]
        if consistent:
            h.needs_resync = False
            h.resync_requested_at = None
            while len(recent) > window:
                del recent[next(iter(recent))]
        else:
            h.needs_resync = True
        return consistent

    # ---- queries ----
    def cached_prefix_blocks(
        self, prompt: bytes, salt: str, mask: int, hashed: tuple[int, Sequence[int]] | None = None
    ) -> dict[int, int]:
        """Leading prompt blocks each worker in ``mask`` holds, as ``{slot: blocks}``.

        ``prompt`` is packed token ids (``proto.hashing.pack_tokens``); it is hashed
        lazily, per block size present among ``mask``'s workers, except for the block
        size of ``hashed`` (``(block_size, hashes)``: the same prompt and salt hashed
        by the caller), whose hashes are walked as they are. Workers holding no leading
        block are absent.
        """
        out: dict[int, int] = {}
        for bs, bs_mask in self._bs_masks.items():
            alive = mask & bs_mask
            if not alive:
                continue
            if hashed is not None and hashed[0] == bs:
                _flush(_walk(hashed[1], self.index, alive, 0, out), len(hashed[1]), out)
            else:
                self._walk_prompt(prompt, bs, salt, alive, out)
        return out

    def prefix_blocks(self, hashes: Sequence[int], block_size: int, mask: int | None = None) -> dict[int, int]:
        """Like ``cached_prefix_blocks`` for a prompt already hashed in ``block_size``.

        Only workers of that block size are considered: hashes of another size never match.
        """
        alive = self._bs_masks.get(block_size, 0)
        if mask is not None:
            alive &= mask
        out: dict[int, int] = {}
        if alive:
            _flush(_walk(hashes, self.index, alive, 0, out), len(hashes), out)
        return out

    def prefix_tokens(self, hashes: Sequence[int], block_size: int, mask: int | None = None) -> dict[str, int]:
        """``{worker id: cached prefix tokens}`` for a prompt hashed in ``block_size``."""
        slots = self._slots
        return {slots[s].worker_id: n * block_size for s, n in self.prefix_blocks(hashes, block_size, mask).items()}  # type: ignore[union-attr]

    def cached_prefix_tokens(self, prompt: bytes, salt: str = "", mask: int | None = None) -> dict[str, int]:
        """``{worker id: cached prefix tokens}`` for packed token ids."""
        by_slot = self.cached_prefix_blocks(prompt, salt, self.all_mask if mask is None else mask)
        out: dict[str, int] = {}
        for s, n in by_slot.items():
            h = self.at(s)
            out[h.worker_id] = n * h.block_size
        return out

    def _walk_prompt(self, data: bytes, block_size: int, salt: str, alive: int, out: dict[int, int]) -> None:
        stride = 4 * block_size
        nblocks = len(data) // stride
        index = self.index
        parent = root_hash(salt)
        chunk = self.config.hash_chunk_blocks
        i = 0
        while i < nblocks:
            end = min(nblocks, i + chunk)
            hashes = extend_block_hashes(parent, data[i * stride : end * stride], block_size)
            alive = _walk(hashes, index, alive, i, out)
            if not alive:
                return
            i = end
            parent = hashes[-1]
            chunk = min(chunk * 2, self.config.hash_chunk_max)
        _flush(alive, i, out)


_MAX_SHARED_MASKS = 1 << 16  # distinct masks kept for sharing; past it the set starts over


def _walk(hashes: Sequence[int], index: dict[int, int], alive: int, offset: int, out: dict[int, int]) -> int:
    """AND masks along ``hashes`` (blocks ``offset`` onwards), recording each worker that
    drops out with its prefix length. Returns the workers holding every block of
    ``hashes`` (0: none), not recorded yet: the caller walks on or flushes them."""
    i = offset
    for x in hashes:
        m = index.get(x, 0) & alive
        if m != alive:
            lost = alive & ~m
            if i:
                while lost:
                    low = lost & -lost
                    out[low.bit_length() - 1] = i
                    lost ^= low
            alive = m
            if not alive:
                return 0
        i += 1
    return alive


def _flush(alive: int, blocks: int, out: dict[int, int]) -> None:
    """Survivors hold every block walked."""
    if not blocks:
        return
    while alive:
        low = alive & -alive
        out[low.bit_length() - 1] = blocks
        alive ^= low
