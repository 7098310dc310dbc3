"""services.common.kvindex: the shared KV prefix index, queried from packed prompts or from hashes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from proto.hashing import block_hashes, pack_tokens
from proto.workers import BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from services.common.kvindex import KvApply, KvIndex

PROMPT = list(range(500, 500 + 16 * 8))  # 8 full blocks
HASHES = block_hashes(PROMPT, 16)


def batch(wid: str, seq: int, hashes: list[int], block_size: int = 16) -> KvEventBatch:
    return KvEventBatch(worker_id=wid, model="m", seq=seq, ts=0.0,
                        events=[BlockStored(block_hashes=hashes, block_size=block_size)])


def test_hashes_and_prompt_give_the_same_prefixes() -> None:
    idx = KvIndex()
    idx.add("a", 16)
    idx.add("b", 16)
    idx.apply(batch("a", 0, HASHES[:5]))
    idx.apply(batch("b", 0, HASHES[:2] + HASHES[3:]))
    assert idx.prefix_tokens(HASHES, 16) == {"a": 80, "b": 32}
    assert idx.cached_prefix_tokens(pack_tokens(PROMPT)) == {"a": 80, "b": 32}
    # a mask narrows the walk to some workers
    b = idx.get("b")
    assert b is not None
    assert idx.prefix_tokens(HASHES, 16, mask=b.bit) == {"b": 32}


def test_hashes_of_another_block_size_never_match() -> None:
    idx = KvIndex()
    idx.add("cpu", 128)
    prompt = list(range(300))
    idx.apply(batch("cpu", 0, block_hashes(prompt, 128), 128))
    assert idx.prefix_tokens(block_hashes(prompt, 128), 128) == {"cpu": 256}
    assert idx.prefix_tokens(block_hashes(prompt, 16), 16) == {}


def test_a_prompt_shorter_than_a_block_matches_nobody() -> None:
    idx = KvIndex()
    idx.add("a")
    idx.apply(batch("a", 0, HASHES))
    assert idx.cached_prefix_tokens(pack_tokens(PROMPT[:10])) == {}
    assert idx.prefix_tokens([], 16) == {}


def test_events_set_the_block_size_until_the_registry_pins_it() -> None:
    idx = KvIndex()
    idx.apply(batch("a", 0, [1, 2], block_size=64))  # before any registry entry
    a = idx.get("a")
    assert a is not None and a.block_size == 64 and a.blocks == {1, 2}
    idx.set_block_size(a, 16)  # the registry: hashes of the old size mean nothing now
    assert a.block_size == 16 and a.blocks == set() and a.block_size_pinned
    idx.apply(batch("a", 1, [3], block_size=64))
    assert a.block_size == 16 and a.blocks == {3}


def test_slots_are_reused_and_masks_stay_small() -> None:
    idx = KvIndex()
    for wid in "abc":
        idx.add(wid)
    idx.apply(batch("b", 0, HASHES))
    assert idx.remove("a") and not idx.remove("a")
    d = idx.add("d")
    assert d.slot == 0 and idx.at(0) is d
    assert idx.prefix_tokens(HASHES, 16) == {"b": 128}


def test_lost_trailing_batch_found_through_published_seq() -> None:
    idx = KvIndex()
    a = idx.add("a")
    assert idx.apply(batch("a", 0, HASHES[:1])) is KvApply.APPLIED
    assert not idx.note_published_seq(a, 1)  # batch 1 may still be in flight
    assert idx.note_published_seq(a, 1)  # a gauge period later it is lost
    assert idx.take_resync_requests(0.0) == ["a"]
    assert idx.apply_snapshot(KvSnapshot(worker_id="a", model="m", seq=1, block_size=16, block_hashes=HASHES[:2]))
    assert idx.prefix_tokens(HASHES, 16) == {"a": 32} and not idx.needs_resync("a")


def test_reset_forgets_cache_and_numbering() -> None:
    idx = KvIndex()
    a = idx.add("a")
    idx.apply(batch("a", 0, HASHES))
    idx.apply(batch("a", 1, [7]))
    idx.reset(a)
    assert a.blocks == set() and a.seq == -1 and idx.index == {}
    assert idx.apply(batch("a", 0, HASHES[:1])) is KvApply.APPLIED


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6))
def test_prompt_walk_equals_hash_walk(seed: int, workers: int) -> None:
    rng = random.Random(seed)
    idx = KvIndex()
    tokens = [rng.randrange(1000) for _ in range(16 * 40)]
    hashes = block_hashes(tokens, 16)
    for w in range(workers):
        idx.add(f"w{w}")
        held = [h for h in hashes[: rng.randrange(41)] if rng.random() < 0.9]
        idx.apply(batch(f"w{w}", 0, held))
    cut = rng.randrange(len(tokens) + 1)
    assert idx.cached_prefix_tokens(pack_tokens(tokens[:cut])) == idx.prefix_tokens(block_hashes(tokens[:cut], 16), 16)


def test_blocks_held_by_the_same_workers_share_one_mask_object() -> None:
    # A walk along a shared prompt then reads one mask from memory, not one per block
    # (benchmarks/router_decision.py: the walk is bound by memory reads).
    idx = KvIndex()
    for i in range(12):  # slots past 8: masks above 256, which Python does not cache itself
        idx.add(f"w{i}", 16)
    for wid in ("a", "b", "c"):
        idx.add(wid, 16)
        idx.apply(batch(wid, 0, HASHES))
    masks = [idx.index[h] for h in HASHES]
    assert all(m is masks[0] for m in masks)
    idx.apply(KvEventBatch(worker_id="c", model="m", seq=1, ts=0.0, events=[BlockRemoved(block_hashes=HASHES[4:])]))
    tail = [idx.index[h] for h in HASHES[4:]]
    assert all(m is tail[0] for m in tail) and tail[0] != masks[0]
    assert idx.prefix_tokens(HASHES, 16) == {"a": 128, "b": 128, "c": 64}
