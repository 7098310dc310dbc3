"""vLLM's KV cache events, as its ZMQ publisher sends them, from the sim engine's events.

The schema below is ``vllm/distributed/kv_events.py`` (vLLM 0.32) field for field and with
the same msgspec options, so vLLM's own structs (and vllm-router's ``kv_aware`` policy)
decode what we encode: a batch is ``array_like`` (``[ts, events, data_parallel_rank]``),
each event a map tagged with its class name (``{"type": "BlockStored", ...}``).

The sim engine's ``proto`` events carry block hashes only; vLLM's ``BlockStored`` also
carries the blocks' ``token_ids`` (routers recompute their own block keys from them).
``BlockLedger`` knows each block's tokens: the server feeds it every sequence's prompt and
output as they go, hashing full blocks exactly as the engine does (``proto.hashing``,
salted with the LoRA name). Pure and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from proto.hashing import extend_block_hashes, prefix_salt, root_hash
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent

MEDIUM_GPU = "GPU"


# ------------------------------------------------------------------ vLLM's structs

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events (tagged by class name)."""


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[VllmEvent]  # type: ignore[assignment]  # vLLM narrows the base's field the same way


batch_encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


# ------------------------------------------------------------------ block ledger

class BlockLedger:
    """Block hash → that block's own token ids, for the blocks sequences fill.

    Entries outlive their sequences (an event may be translated after its request ended)
    and are dropped least recently used past ``capacity``: size it above the engine's
    block count plus the blocks of requests in flight.
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size <= 0 or capacity <= 0:
            raise ValueError("block_size and capacity must be positive")
        self.block_size = block_size
        self.capacity = capacity
        self._tokens: OrderedDict[int, list[int]] = OrderedDict()
        self._seqs: dict[str, tuple[int, list[int]]] = {}  # id → (last full block's hash, partial tail)

    def __len__(self) -> int:
        return len(self._tokens)

    def start(self, seq_id: str, prompt: list[int], lora: str | None = None, cache_salt: str = "") -> None:
        """A sequence enters the engine with ``prompt``; its blocks hash as the engine's do,
        salted with its LoRA's name and its ``cache_salt`` (``proto.hashing.prefix_salt``)."""
        self._seqs[seq_id] = (root_hash(prefix_salt(lora, cache_salt)), [])
        self.extend(seq_id, prompt)

    def extend(self, seq_id: str, token_ids: list[int]) -> None:
        """Tokens appended to the sequence (its output, as the engine hands it out)."""
        state = self._seqs.get(seq_id)
        if state is None or not token_ids:
            return
        parent, tail = state
        tail = tail + token_ids
        bs = self.block_size
        full = len(tail) // bs * bs
        if full:
            hashes = extend_block_hashes(parent, tail[:full], bs)
            for i, h in enumerate(hashes):
                self._record(h, tail[i * bs:(i + 1) * bs])
            parent, tail = hashes[-1], tail[full:]
        self._seqs[seq_id] = (parent, tail)

    def end(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def open(self) -> int:
        """Sequences still running: while none is, a missing block's tokens will not come."""
        return len(self._seqs)

    def tokens(self, block_hash: int) -> list[int] | None:
        return self._tokens.get(block_hash)

    def _record(self, block_hash: int, token_ids: list[int]) -> None:
        self._tokens[block_hash] = token_ids
        self._tokens.move_to_end(block_hash)
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)

    # -------------------------------------------------------------- translation

    def missing(self, events: list[KvEvent]) -> int:
        """How many stored blocks of ``events`` have no known tokens (yet)."""
        return sum(1 for e in events if isinstance(e, BlockStored) for h in e.block_hashes if h not in self._tokens)

    def translate(self, events: list[KvEvent]) -> tuple[list[VllmEvent], int]:
        """vLLM's events for a batch of the engine's, and how many stored blocks were left
        out: one whose tokens are not known goes with the rest of its run (their chain
        breaks there); a router then misses a cache hint, better than a block it would key
        wrongly."""
        out: list[VllmEvent] = []
        dropped = 0
        for e in events:
            if isinstance(e, BlockStored):
                hashes: list[int | bytes] = []
                token_ids: list[int] = []
                for h in e.block_hashes:
                    block = self._tokens.get(h)
                    if block is None:
                        break
                    self._tokens.move_to_end(h)  # cached blocks stay known
                    hashes.append(h)
                    token_ids.extend(block)
                dropped += len(e.block_hashes) - len(hashes)
                if hashes:
                    out.append(VllmBlockStored(
                        block_hashes=hashes, parent_block_hash=e.parent_hash, token_ids=token_ids,
                        block_size=e.block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=e.lora))
            elif isinstance(e, BlockRemoved):
                out.append(VllmBlockRemoved(block_hashes=list(e.block_hashes), medium=MEDIUM_GPU))
            elif isinstance(e, AllCleared):
                out.append(VllmAllBlocksCleared())
        return out, dropped


def encode_batch(ts: float, events: list[VllmEvent], data_parallel_rank: int = 0) -> bytes:
    """One batch as vLLM's publisher sends it (its rank-0 publisher sets the rank to 0)."""
    return batch_encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=data_parallel_rank))
