"""The KV block pool of the modelled replica (vLLM v1's ``block_pool.py``): a fixed
number of blocks, a free queue in LRU eviction order, the block hash → cached block map,
reference counts, and the KV events every change means. :class:`.sim_core.SimCore`
allocates from it; see the module doc there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent


class KVBlock:
    """One KV cache block. ``block_hash`` is set while the block is in the cache map."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """vLLM's block pool: free queue (LRU head first), hash → block map, refcounts.

    Every block with ``ref_cnt == 0`` sits in the free queue, cached or not; allocation
    takes from the head and evicts the block's hash if it had one. Freeing appends to
    the tail, so the least recently freed cached block is evicted first. The pool also
    records the KV events (stored with parent hash / removed / cleared) its changes mean.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict keyed by block id: O(1) pop from the head, append to the tail and
        # removal from the middle (a cache hit on a free block), like vLLM's linked list.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self._events: list[KvEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[KVBlock] = []
        removed: list[int] = []
        for _ in range(n):
            _, blk = self._free.popitem(last=False)
            if blk.block_hash is not None:
                del self._cached[blk.block_hash]
                removed.append(blk.block_hash)
                blk.block_hash = None
            blk.ref_cnt = 1
            out.append(blk)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail in the given order,
        so callers pass a sequence's blocks last-first: its tail is evicted before the
        prefix other requests are more likely to share."""
        for blk in ordered:
            blk.ref_cnt -= 1
            if blk.ref_cnt < 0:
                raise RuntimeError(f"block {blk.block_id} freed more often than taken")
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[int],
        start: int,
        end: int,
        block_size: int,
        lora: str | None,
    ) -> None:
        """Enter ``blocks[start:end]`` (now full of computed tokens) into the cache map.

        A hash already cached by another block (two identical prompts prefilled in the
        same step) leaves this block uncached: one block per hash keeps the map, the
        events and the snapshot in exact agreement.
        """
        run: list[int] = []
        parent: int | None = None
        for j in range(start, end):
            blk, h = blocks[j], hashes[j]
            if blk.block_hash is not None or h in self._cached:
                self._flush_stored(run, parent, block_size, lora)
                run = []
                continue
            blk.block_hash = h
            self._cached[h] = blk
            if not run:
                parent = hashes[j - 1] if j > 0 else None
            run.append(h)
        self._flush_stored(run, parent, block_size, lora)

    def _flush_stored(self, run: list[int], parent: int | None, block_size: int, lora: str | None) -> None:
        if run:
            self._events.append(
                BlockStored(block_hashes=run, parent_hash=parent, block_size=block_size, lora=lora)
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use (as in vLLM)."""
        if self.num_used:
            return False
        for blk in self._cached.values():
            blk.block_hash = None
        self._cached.clear()
        self._events.append(AllCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's structures disagree (tests, debugging)."""
        free_ids = set(self._free)
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, blk
            assert (blk.ref_cnt == 0) == (blk.block_id in free_ids), blk
            if blk.block_hash is not None:
                assert self._cached.get(blk.block_hash) is blk, blk
        assert all(b.block_hash == h for h, b in self._cached.items())
