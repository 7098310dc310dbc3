"""vLLM's prefix cache in meshserve's block-hash space: an event bridge and a predictor.

vLLM hashes its KV blocks its own way (sha256 of pickled keys by default, folded to
64-bit ints or kept as bytes), while the router indexes every worker's cache by the
shared chain hash of ``proto.hashing``. Nothing outside the worker should ever see an
engine hash, so:

- ``KvEventBridge`` translates vLLM's KV events (``BlockStored`` with the token ids
  of the blocks and the engine hash of their parent, ``BlockRemoved``,
  ``AllBlocksCleared``) into ``proto`` events. It recomputes each stored block's hash
  from its token ids with ``proto.hashing.extend_block_hashes``, chained onto the
  meshserve hash of the parent block (looked up in its map engine hash → meshserve
  hash), with the LoRA adapter's name and the cache salt (the org) as the salt of a
  sequence's root (proto.hashing.prefix_salt). Several engine blocks can share one
  meshserve hash (KV cache groups of hybrid models, the same text under equal keys), so
  a meshserve hash is removed only when the last engine block carrying it goes.
- ``KvPredictor`` is the fallback for a vLLM that publishes no events: it models an
  LRU prefix cache of the engine's size from what the worker served (the full blocks
  of each request's prompt and output), so the router still routes by prefix; the
  worker's gauges then say ``kv_events_mode="predicted"``.

Both are plain synchronous classes with no vLLM import: the engine shell feeds them,
the unit tests drive them with stand-in events. Events are read by duck typing (class
name and attributes), so vLLM's own msgspec structs and test doubles both work.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from proto.hashing import extend_block_hashes, prefix_salt, root_hash
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

EngineKey = tuple[int, Hashable]  # (KV cache group, engine block hash: int or bytes)


def _cache_salt(ev: Any, lora: str | None) -> str:
    """The ``cache_salt`` of the request that stored a chain from its root: vLLM lists it
    among the first block's extra keys, untagged, after the LoRA name (when the event has
    one) and the multimodal ``(id, offset)`` pairs; prompt-embedding digests are bytes."""
    extra = getattr(ev, "extra_keys", None)
    keys = extra[0] if extra else None
    if not keys:
        return ""
    for key in keys:  # the tagged form vLLM's block hash uses, should events move to it
        if isinstance(key, (tuple, list)) and len(key) == 2 and key[0] == "cache_salt" and isinstance(key[1], str):
            return key[1]
    names = [k for k in keys if isinstance(k, str)]
    if lora and names:
        names = names[1:]  # the adapter's name comes first
    return names[0] if names else ""


class KvEventBridge:
    """Engine KV events → ``proto`` KV events in the ``proto.hashing`` space."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._mesh_of: dict[EngineKey, int] = {}  # engine block → meshserve hash
        self._refs: dict[int, int] = {}  # meshserve hash → engine blocks carrying it
        self.unresolved = 0  # stored blocks dropped: parent never seen (events lost)
        self.events_in = 0

    def __len__(self) -> int:
        return len(self._refs)

    def snapshot(self) -> list[int]:
        """Every meshserve hash the engine's cache holds, per the events so far."""
        return list(self._refs)

    def mesh_hash(self, engine_hash: Hashable, group: int = 0) -> int | None:
        return self._mesh_of.get((group, engine_hash))

    def translate(self, events: Iterable[Any]) -> list[KvEvent]:
        out: list[KvEvent] = []
        for ev in events:
            self.events_in += 1
            kind = type(ev).__name__
            if kind == "BlockStored":
                stored = self._stored(ev)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                removed = self._removed(ev)
                if removed is not None:
                    out.append(removed)
            elif kind in ("AllBlocksCleared", "AllCleared"):
                self._mesh_of.clear()
                self._refs.clear()
                out.append(AllCleared())
            else:
                log.debug("ignoring KV event %s", kind)
        return out

    def _stored(self, ev: Any) -> BlockStored | None:
        group = int(getattr(ev, "group_idx", None) or 0)
        lora = getattr(ev, "lora_name", None) or None
        engine_hashes: Sequence[Hashable] = list(ev.block_hashes)
        token_ids: Sequence[int] = list(ev.token_ids)
        block_size = int(getattr(ev, "block_size", 0) or self.block_size)
        parent_engine = getattr(ev, "parent_block_hash", None)
        if parent_engine is None:
            parent = root_hash(prefix_salt(lora, _cache_salt(ev, lora)))
            parent_out: int | None = None
        else:
            found = self._mesh_of.get((group, parent_engine))
            if found is None:
                # Without the parent's meshserve hash the chain cannot be continued;
                # the router learns these blocks at the next snapshot resync.
                self.unresolved += len(engine_hashes)
                return None
            parent = parent_out = found
        usable = min(len(engine_hashes), len(token_ids) // block_size)
        if usable < len(engine_hashes):
            log.warning("KV event with %d hashes but %d tokens of block size %d: keeping %d",
                        len(engine_hashes), len(token_ids), block_size, usable)
        if usable == 0:
            return None
        mesh = extend_block_hashes(parent, token_ids[: usable * block_size], block_size)
        for engine_hash, mesh_hash in zip(engine_hashes[:usable], mesh, strict=True):
            key = (group, engine_hash)
            previous = self._mesh_of.get(key)
            if previous == mesh_hash:
                continue  # re-announced (a prefix-cache hit), already counted
            if previous is not None:
                self._release(previous)
            self._mesh_of[key] = mesh_hash
            self._refs[mesh_hash] = self._refs.get(mesh_hash, 0) + 1
        return BlockStored(block_hashes=mesh, parent_hash=parent_out, block_size=block_size, lora=lora)

    def _removed(self, ev: Any) -> BlockRemoved | None:
        group = int(getattr(ev, "group_idx", None) or 0)
        gone: list[int] = []
        for engine_hash in ev.block_hashes:
            mesh_hash = self._mesh_of.pop((group, engine_hash), None)
            if mesh_hash is not None and self._release(mesh_hash):
                gone.append(mesh_hash)
        return BlockRemoved(block_hashes=gone) if gone else None

    def _release(self, mesh_hash: int) -> bool:
        """Drop one reference; True when the meshserve hash is gone from the cache."""
        n = self._refs.get(mesh_hash, 0) - 1
        if n > 0:
            self._refs[mesh_hash] = n
            return False
        self._refs.pop(mesh_hash, None)
        return True


class KvPredictor:
    """An LRU model of the engine's prefix cache, fed with what the worker served.

    ``observe`` records a sequence's full blocks as cached (its prompt once prefilled,
    prompt and output when it ends) and returns the events that change: blocks new to
    the model, and the least recently used blocks evicted to stay within
    ``num_blocks``. Within a sequence, later blocks are evicted before earlier ones,
    as vLLM frees a finished request's blocks tail first.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def snapshot(self) -> list[int]:
        return list(self._lru)

    def observe(self, token_ids: Sequence[int], lora: str | None = None, cache_salt: str = "") -> list[KvEvent]:
        hashes = extend_block_hashes(root_hash(prefix_salt(lora, cache_salt)), list(token_ids), self.block_size)
        if not hashes:
            return []
        hashes = hashes[: self.num_blocks]
        new_from = next((i for i, h in enumerate(hashes) if h not in self._lru), len(hashes))
        for h in reversed(hashes):  # the first block ends up most recently used
            self._lru[h] = None
            self._lru.move_to_end(h)
        out: list[KvEvent] = []
        evicted: list[int] = []
        while len(self._lru) > self.num_blocks:
            h, _ = self._lru.popitem(last=False)
            evicted.append(h)
        if new_from < len(hashes):
            parent = hashes[new_from - 1] if new_from else None
            out.append(BlockStored(block_hashes=hashes[new_from:], parent_hash=parent, block_size=self.block_size,
                                   lora=lora or None))
        if evicted:
            out.append(BlockRemoved(block_hashes=evicted))
        return out

    def clear(self) -> list[KvEvent]:
        self._lru.clear()
        return [AllCleared()]
