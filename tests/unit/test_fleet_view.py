"""FleetView: prefix index, KV event sequencing and resync, optimistic accounting (router and admission read it)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from proto.hashing import block_hashes, pack_tokens
from proto.messages import WorkerState
from proto.workers import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    WorkerGauge,
    WorkerInfo,
)
from services.common.fleet import FleetConfig, FleetView, KvApply, Pool

MODEL = "m"


def info(
    wid: str, *, state: WorkerState = "ready", block_size: int = 16, started_at: float = 1.0
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid, model=MODEL, engine="sim", state=state, block_size=block_size, started_at=started_at
    )


def batch(wid: str, seq: int, *events: object) -> KvEventBatch:
    return KvEventBatch(worker_id=wid, model=MODEL, seq=seq, ts=float(seq), events=list(events))  # type: ignore[arg-type]


def stored(hashes: list[int], block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=hashes, block_size=block_size)


def gauge(wid: str, ts: float, **kw: object) -> WorkerGauge:
    return WorkerGauge(worker_id=wid, model=MODEL, ts=ts, **kw)  # type: ignore[arg-type]


def prefix_tokens(view: FleetView, prompt: list[int], salt: str = "") -> dict[str, int]:
    pool = view.pool(MODEL)
    assert pool is not None
    by_slot = pool.cached_prefix_blocks(pack_tokens(prompt), salt, pool.mask_of(pool))
    return {pool.at(s).worker_id: n * pool.at(s).block_size for s, n in by_slot.items()}


def check_index(pool: Pool) -> None:
    """The index is exactly the union of the workers' block sets, bit for bit."""
    expect: dict[int, int] = {}
    for w in pool:
        for h in w.blocks:
            expect[h] = expect.get(h, 0) | w.bit
    assert pool.index == expect


PROMPT = list(range(1000, 1000 + 16 * 10))  # 10 full blocks
HASHES = block_hashes(PROMPT, 16)


def two_workers() -> FleetView:
    v = FleetView()
    v.update_worker(info("a"), 0.0)
    v.update_worker(info("b"), 0.0)
    return v


# ---- prefix index ----


def test_longest_prefix_counts_leading_blocks_only() -> None:
    v = two_workers()
    assert v.apply_kv_events(batch("a", 0, stored(HASHES[:6])), 0.0) is KvApply.APPLIED
    # b holds blocks 0,1 and 3..9 but not 2: its prefix stops at the hole
    v.apply_kv_events(batch("b", 0, stored(HASHES[:2] + HASHES[3:])), 0.0)
    assert prefix_tokens(v, PROMPT) == {"a": 96, "b": 32}
    # a prompt extending past the cached blocks, and one diverging at block 4
    assert prefix_tokens(v, [*PROMPT, 1, 2, 3]) == {"a": 96, "b": 32}
    assert prefix_tokens(v, PROMPT[:64] + [7] * 96) == {"a": 64, "b": 32}
    assert prefix_tokens(v, [5] * 160) == {}


def test_prompt_fully_cached_counts_every_full_block() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES)), 0.0)
    assert prefix_tokens(v, [*PROMPT, 9, 9]) == {"a": 160}  # the partial block is never cached


def test_salt_separates_lora_namespaces() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(block_hashes(PROMPT, 16, salt="sql-lora"))), 0.0)
    assert prefix_tokens(v, PROMPT) == {}
    assert prefix_tokens(v, PROMPT, salt="sql-lora") == {"a": 160}


def test_block_size_128_pool() -> None:
    v = FleetView()
    v.update_worker(info("c", block_size=128), 0.0)
    prompt = list(range(300))
    v.apply_kv_events(batch("c", 0, stored(block_hashes(prompt, 128), 128)), 0.0)
    assert prefix_tokens(v, prompt) == {"c": 256}


def test_removed_and_cleared() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES)), 0.0)
    v.apply_kv_events(batch("b", 0, stored(HASHES)), 0.0)
    v.apply_kv_events(batch("a", 1, BlockRemoved(block_hashes=HASHES[5:])), 0.0)
    assert prefix_tokens(v, PROMPT) == {"a": 80, "b": 160}
    v.apply_kv_events(batch("b", 1, AllCleared()), 0.0)
    assert prefix_tokens(v, PROMPT) == {"a": 80}
    pool = v.pool(MODEL)
    assert pool is not None
    check_index(pool)
    assert len(pool.index) == 5


def test_single_holder_entries_share_one_mask_object() -> None:
    v = two_workers()
    v.apply_kv_events(batch("b", 0, stored(HASHES)), 0.0)
    pool = v.pool(MODEL)
    assert pool is not None
    masks = {id(m) for m in pool.index.values()}
    assert len(masks) == 1  # b's interned bit, not one int object per block


def test_remove_worker_drops_its_entries_and_slot_reuse_is_clean() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES)), 0.0)
    v.apply_kv_events(batch("b", 0, stored(HASHES[:3])), 0.0)
    assert v.remove_worker("a")
    assert not v.remove_worker("a")
    assert prefix_tokens(v, PROMPT) == {"b": 48}
    v.update_worker(info("c"), 1.0)  # takes a's freed slot
    assert prefix_tokens(v, PROMPT) == {"b": 48}
    pool = v.pool(MODEL)
    assert pool is not None
    check_index(pool)
    v.remove_worker("b")
    v.remove_worker("c")
    assert v.pool(MODEL) is None


def test_expire_drops_silent_workers() -> None:
    v = FleetView(FleetConfig(stale_after_s=10.0))
    v.update_worker(info("a"), 0.0)
    v.update_worker(info("b"), 0.0)
    v.apply_gauge(gauge("b", 8.0), 8.0)  # gauges count as signs of life
    assert v.expire(12.0) == ["a"]
    assert "a" not in v
    assert "b" in v


# ---- KV sequencing and resync ----


def test_gap_marks_resync_and_requests_are_throttled() -> None:
    v = two_workers()
    assert v.apply_kv_events(batch("a", 0, stored(HASHES[:2])), 0.0) is KvApply.APPLIED
    assert v.apply_kv_events(batch("a", 1, stored(HASHES[2:3])), 0.0) is KvApply.APPLIED
    assert v.apply_kv_events(batch("a", 1, stored(HASHES[2:3])), 0.0) is KvApply.DUPLICATE
    assert not v.needs_resync("a")
    assert v.apply_kv_events(batch("a", 3, stored(HASHES[4:5])), 0.0) is KvApply.GAP
    assert v.needs_resync("a")
    assert v.take_resync_requests(1.0, retry_after_s=2.0) == ["a"]
    assert v.take_resync_requests(2.0, retry_after_s=2.0) == []  # already asked
    assert v.take_resync_requests(3.0, retry_after_s=2.0) == ["a"]  # no answer: ask again
    # events keep flowing into the index while the snapshot is pending
    assert v.apply_kv_events(batch("a", 4, stored(HASHES[3:4])), 0.0) is KvApply.RESYNCING
    assert prefix_tokens(v, PROMPT)["a"] == 80


def test_stream_joined_midway_needs_resync() -> None:
    v = two_workers()
    assert v.apply_kv_events(batch("a", 57, stored(HASHES[:1])), 0.0) is KvApply.GAP
    assert v.needs_resync("a")


def test_snapshot_replaces_then_replays_later_batches() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored([111, 222])), 0.0)
    # seq 1 (stores HASHES[:3]) is lost; 2 and 3 arrive
    assert v.apply_kv_events(batch("a", 2, BlockRemoved(block_hashes=[111])), 0.0) is KvApply.GAP
    v.apply_kv_events(batch("a", 3, stored(HASHES[3:5])), 0.0)
    # The snapshot is as of seq 2: it holds 222 and HASHES[:3]; seq 3 must be replayed on it.
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=2, block_size=16, block_hashes=[222, *HASHES[:3]])
    assert v.apply_snapshot(snap, 1.0)
    assert not v.needs_resync("a")
    w = v.worker("a")
    assert w is not None
    assert w.blocks == {222, *HASHES[:5]}
    assert prefix_tokens(v, PROMPT) == {"a": 80}
    pool = v.pool(MODEL)
    assert pool is not None
    check_index(pool)
    # the stream goes on from 3; a stale batch from before the snapshot is ignored
    assert v.apply_kv_events(batch("a", 2, stored([999])), 1.0) is KvApply.DUPLICATE
    assert v.apply_kv_events(batch("a", 4, stored(HASHES[5:6])), 1.0) is KvApply.APPLIED


def test_snapshot_newer_than_every_batch_received() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 5, stored([1])), 0.0)  # joined mid-way
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=9, block_size=16, block_hashes=HASHES[:4])
    assert v.apply_snapshot(snap, 0.5)
    assert prefix_tokens(v, PROMPT) == {"a": 64}
    # batches 6..9 were in flight when the snapshot was taken: already included
    assert v.apply_kv_events(batch("a", 8, stored([2])), 0.6) is KvApply.DUPLICATE
    assert v.apply_kv_events(batch("a", 10, stored(HASHES[4:5])), 0.6) is KvApply.APPLIED
    assert prefix_tokens(v, PROMPT) == {"a": 80}


def test_snapshot_older_than_a_hole_keeps_resync_pending() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored([1])), 0.0)
    v.apply_kv_events(batch("a", 3, stored(HASHES[:1])), 0.0)  # 1 and 2 lost
    v.apply_kv_events(batch("a", 5, stored(HASHES[1:2])), 0.0)  # 4 lost too
    # a snapshot as of 3 covers 1..3, but 4 is still missing
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=3, block_size=16, block_hashes=[1, HASHES[0]])
    assert not v.apply_snapshot(snap, 1.0)
    assert v.needs_resync("a")
    w = v.worker("a")
    assert w is not None
    assert w.blocks == {1, HASHES[0], HASHES[1]}  # batch 5 still applied, best effort
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=5, block_size=16, block_hashes=HASHES[:3])
    assert v.apply_snapshot(snap, 2.0)
    assert not v.needs_resync("a")
    assert w.blocks == set(HASHES[:3])


def test_unrequested_snapshot_on_a_healthy_stream_stays_consistent() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES[:2])), 0.0)
    v.apply_kv_events(batch("a", 1, stored(HASHES[2:3])), 0.0)
    v.apply_kv_events(batch("a", 2, BlockRemoved(block_hashes=HASHES[:1])), 0.0)
    # a snapshot taken at seq 1 arrives after batch 2: batch 2 is replayed on top
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=1, block_size=16, block_hashes=HASHES[:3])
    assert v.apply_snapshot(snap, 1.0)
    w = v.worker("a")
    assert w is not None
    assert w.blocks == set(HASHES[1:3])


def test_snapshot_for_a_removed_worker_is_dropped() -> None:
    v = two_workers()
    v.remove_worker("a")
    snap = KvSnapshot(worker_id="a", model=MODEL, seq=1, block_size=16, block_hashes=HASHES)
    assert not v.apply_snapshot(snap, 0.0)
    assert "a" not in v


def test_seq_restart_resets_the_workers_index() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES[:4])), 0.0)
    v.apply_kv_events(batch("a", 1, stored(HASHES[4:6])), 0.0)
    assert v.apply_kv_events(batch("a", 0, stored(HASHES[:1])), 1.0) is KvApply.RESET
    assert prefix_tokens(v, PROMPT) == {"a": 16}
    assert v.apply_kv_events(batch("a", 1, stored(HASHES[1:2])), 1.0) is KvApply.APPLIED


def test_new_process_with_same_id_forgets_cache_and_load() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES)), 0.0)
    v.record_placement("a", "r1", 100, 200, 0.0)
    v.update_worker(info("a", started_at=50.0), 1.0)
    w = v.worker("a")
    assert w is not None
    assert w.blocks == set()
    assert w.outstanding_tokens == 0
    assert w.kv_seq == -1


def test_lost_trailing_batch_is_caught_by_gauges() -> None:
    v = two_workers()
    v.apply_kv_events(batch("a", 0, stored(HASHES[:1])), 0.0)
    # batch 1 is lost and the worker then goes quiet: no later batch reveals the gap
    v.apply_gauge(gauge("a", 1.0, kv_event_seq=1), 1.0)
    assert not v.needs_resync("a")  # it may still be in flight
    v.apply_gauge(gauge("a", 2.0, kv_event_seq=1), 2.0)
    assert v.needs_resync("a")


def test_gauge_matching_received_batches_triggers_nothing() -> None:
    v = two_workers()
    for seq in range(3):
        v.apply_kv_events(batch("a", seq, stored([seq])), float(seq))
        v.apply_gauge(gauge("a", float(seq), kv_event_seq=seq), float(seq))
    assert not v.needs_resync("a")


def test_resync_buffer_is_bounded() -> None:
    v = FleetView(FleetConfig(max_pending_batches=8, replay_window=4))
    v.update_worker(info("a"), 0.0)
    v.apply_kv_events(batch("a", 0, stored([0])), 0.0)
    for seq in range(2, 40):
        v.apply_kv_events(batch("a", seq, stored([seq])), 0.0)
    w = v.worker("a")
    assert w is not None
    assert len(w.recent_batches) == 8
    assert min(w.recent_batches) == 32
    # a snapshot older than the buffer cannot be brought forward
    assert not v.apply_snapshot(KvSnapshot(worker_id="a", model=MODEL, seq=20, block_size=16), 0.0)
    assert v.apply_snapshot(KvSnapshot(worker_id="a", model=MODEL, seq=31, block_size=16), 0.0)
    assert w.blocks == set(range(32, 40))


# ---- optimistic accounting ----


def test_placements_count_until_a_newer_gauge() -> None:
    v = FleetView(FleetConfig(placement_settle_s=0.02))
    v.update_worker(info("a"), 0.0)
    v.apply_gauge(gauge("a", 100.0, queued_prefill_tokens=10, running_tokens=50), 0.0)
    v.record_placement("a", "r1", 300, 400, 0.10)
    v.record_placement("a", "r2", 100, 150, 0.20)
    w = v.worker("a")
    assert w is not None
    assert (w.queued_prefill_tokens, w.running_tokens) == (410, 600)
    # a gauge that arrives right after r2 was sent cannot include r2 yet
    v.apply_gauge(gauge("a", 100.2, queued_prefill_tokens=310, running_tokens=450), 0.21)
    assert (w.queued_prefill_tokens, w.running_tokens) == (410, 600)
    # the next one includes both: the optimistic additions are dropped, not double counted
    v.apply_gauge(gauge("a", 100.3, queued_prefill_tokens=400, running_tokens=600), 0.30)
    assert (w.queued_prefill_tokens, w.running_tokens) == (400, 600)
    assert w.placements == {}


def test_reordered_older_gauge_is_ignored() -> None:
    v = FleetView()
    v.update_worker(info("a"), 0.0)
    assert v.apply_gauge(gauge("a", 10.0, queued_prefill_tokens=5), 1.0)
    assert not v.apply_gauge(gauge("a", 9.0, queued_prefill_tokens=999), 1.1)
    w = v.worker("a")
    assert w is not None
    assert w.queued_prefill_tokens == 5


def test_release_and_retry_move_the_optimistic_load() -> None:
    v = two_workers()
    v.record_placement("a", "r1", 100, 120, 0.0)
    v.record_placement("b", "r1", 100, 120, 0.0)  # retried on b: a no longer carries it
    a, b = v.worker("a"), v.worker("b")
    assert a is not None and b is not None
    assert (a.outstanding_tokens, b.outstanding_tokens) == (0, 220)
    assert v.release_placement("r1")
    assert not v.release_placement("r1")
    assert b.outstanding_tokens == 0


def test_optimistic_additions_age_out_without_gauges() -> None:
    v = FleetView(FleetConfig(placement_max_age_s=5.0))
    v.update_worker(info("a"), 0.0)
    v.record_placement("a", "r1", 100, 120, 0.0)
    v.record_placement("a", "r2", 10, 12, 6.0)
    w = v.worker("a")
    assert w is not None
    assert w.outstanding_tokens == 22


def test_a_gauge_that_names_its_arrivals_settles_exactly_those() -> None:
    # The timing rule would drop both at this gauge (received 100 ms after them); the
    # worker says it took in r1 only, so r2 (still on its way) stays counted.
    v = FleetView(FleetConfig(placement_settle_s=0.02, placement_unseen_s=5.0))
    v.update_worker(info("a"), 0.0)
    v.update_worker(info("b"), 0.0)
    v.record_placement("a", "r1", 100, 0, 0.10)
    v.record_placement("a", "r2", 50, 0, 0.11)
    v.record_placement("a", "r3", 70, 0, 0.12)
    a, b = v.worker("a"), v.worker("b")
    assert a is not None and b is not None
    assert a.queued_prefill_tokens == 220 and len(a.placements) == 3
    v.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=100, arrived=["r1"]), 0.20)
    assert a.queued_prefill_tokens == 100 + 50 + 70 and list(a.placements) == ["r2", "r3"]
    # r3 reached another worker (admission counts where it predicted, the router chose b)
    v.apply_gauge(gauge("b", 1.0, queued_prefill_tokens=70, arrived=["r3", "unknown"]), 0.25)
    assert list(a.placements) == ["r2"] and b.queued_prefill_tokens == 70
    # a placement no gauge names within placement_unseen_s never reached a worker
    v.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=0, arrived=[]), 5.0)
    assert list(a.placements) == ["r2"]
    v.apply_gauge(gauge("a", 3.0, queued_prefill_tokens=0, arrived=[]), 5.2)
    assert a.placements == {} and a.queued_prefill_tokens == 0


def test_a_gauge_without_arrivals_settles_by_timing() -> None:
    # A worker that names no arrivals: a gauge received placement_settle_s after a
    # placement is taken to include it.
    v = FleetView(FleetConfig(placement_settle_s=0.02))
    v.update_worker(info("a"), 0.0)
    v.record_placement("a", "r1", 100, 0, 0.10)
    v.record_placement("a", "r2", 50, 0, 0.11)
    w = v.worker("a")
    assert w is not None
    v.apply_gauge(gauge("a", 1.0, queued_prefill_tokens=100), 0.125)
    assert list(w.placements) == ["r2"] and w.queued_prefill_tokens == 150
    v.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=150), 0.20)
    assert w.placements == {} and w.queued_prefill_tokens == 150


def test_registry_only_view_ignores_feeds_of_unregistered_workers() -> None:
    v = FleetView(registry_only=True)
    assert not v.apply_gauge(gauge("a", 1.0), 0.0)
    assert v.apply_kv_events(batch("a", 0, stored(block_hashes(list(range(16)), 16))), 0.0) is None
    assert "a" not in v
    v.update_worker(info("a"), 0.0)
    other = WorkerGauge(worker_id="a", model="another", ts=2.0)
    assert not v.apply_gauge(other, 0.1)  # the registry says which model it serves
    w = v.worker("a")
    assert w is not None and w.model == MODEL and w.gauge is None
    assert v.apply_gauge(gauge("a", 2.0, queued_prefill_tokens=7), 0.2)
    assert v.apply_kv_events(batch("a", 0, stored(block_hashes(list(range(16)), 16))), 0.3) is KvApply.APPLIED
    assert w.queued_prefill_tokens == 7 and w.cached_blocks == 1
    # the default view lets a feed add the worker (the feed has checked the registry)
    open_view = FleetView()
    assert open_view.apply_gauge(gauge("b", 1.0), 0.0) and "b" in open_view


def test_draining_and_state() -> None:
    v = two_workers()
    v.update_worker(info("c", state="starting"), 0.0)
    v.apply_gauge(gauge("b", 1.0, draining=True), 0.0)
    placeable = {w.worker_id for w in v.pool(MODEL) or [] if v.placeable(w, 0.0)}
    assert placeable == {"a"}
    assert not v.placeable(v.worker("a"), 100.0)  # type: ignore[arg-type]


# ---- index invariant under arbitrary event streams ----

op: st.SearchStrategy[tuple[str, int, list[int]]] = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.lists(st.integers(0, 30), max_size=8)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.lists(st.integers(0, 30), max_size=8)),
    st.tuples(st.just("clear"), st.integers(0, 3), st.just([])),
    st.tuples(st.just("drop_worker"), st.integers(0, 3), st.just([])),
    st.tuples(st.just("snapshot"), st.integers(0, 3), st.lists(st.integers(0, 30), max_size=12)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_index_matches_worker_block_sets(ops: list[tuple[str, int, list[int]]]) -> None:
    v = FleetView()
    seqs = dict.fromkeys(range(4), 0)
    shadow: dict[int, set[int]] = {i: set() for i in range(4)}
    for kind, wi, hashes in ops:
        wid = f"w{wi}"
        if wid not in v:
            v.update_worker(info(wid), 0.0)
            seqs[wi] = 0
            shadow[wi] = set()
        if kind == "drop_worker":
            v.remove_worker(wid)
            continue
        if kind == "snapshot":
            assert v.apply_snapshot(
                KvSnapshot(worker_id=wid, model=MODEL, seq=seqs[wi] - 1, block_size=16, block_hashes=hashes),
                0.0,
            )
            shadow[wi] = set(hashes)
            continue
        ev: BlockStored | BlockRemoved | AllCleared
        if kind == "store":
            ev = stored(hashes)
            shadow[wi] |= set(hashes)
        elif kind == "remove":
            ev = BlockRemoved(block_hashes=hashes)
            shadow[wi] -= set(hashes)
        else:
            ev = AllCleared()
            shadow[wi] = set()
        v.apply_kv_events(batch(wid, seqs[wi], ev), 0.0)
        seqs[wi] += 1
    pool = v.pool(MODEL)
    if pool is not None:
        check_index(pool)
        for w in pool:
            assert w.blocks == shadow[int(w.worker_id[1:])]


def test_full_caches_at_64_workers_fit_one_entry_per_distinct_block() -> None:
    v = FleetView()
    rng = random.Random(3)
    shared = [rng.getrandbits(64) for _ in range(500)]
    for i in range(64):
        wid = f"w{i}"
        v.update_worker(info(wid), 0.0)
        own = [rng.getrandbits(64) for _ in range(1500)]
        v.apply_kv_events(batch(wid, 0, stored(shared + own)), 0.0)
    pool = v.pool(MODEL)
    assert pool is not None
    assert len(pool.index) == 500 + 64 * 1500
    assert all(m == (1 << 64) - 1 for h, m in pool.index.items() if h in set(shared[:3]))


def _placeable_from_scratch(view: FleetView, pool: Pool, now: float) -> list[str]:
    return [w.worker_id for w in pool if view.placeable(w, now)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["info", "draining", "gauge", "kv", "place", "release", "time", "remove",
                                           "restart"]),
                          st.integers(0, 3), st.integers(0, 40)), max_size=60))
def test_the_placeable_set_and_the_pools_load_are_kept_exactly(ops: list[tuple[str, int, int]]) -> None:
    """The placeable set is kept between changes and the optimistic tokens summed per pool
    as placements come and go (a placement reads both): after any sequence of registry
    puts, gauges, KV batches, placements, releases, removals and the clock moving on
    (members going stale with nothing said), they equal what a pass over the pool gives."""
    view = FleetView(FleetConfig(stale_after_s=10.0))
    now, seq, ts = 0.0, dict.fromkeys(range(4), 0), 0.0
    for i in range(4):
        view.update_worker(info(f"w{i}"), now)
    placed: list[str] = []
    for op, who, x in ops:
        wid = f"w{who}"
        if op == "info":
            view.update_worker(info(wid, state="ready" if x % 3 else "starting"), now)
        elif op == "draining":
            ts += 1
            view.apply_gauge(gauge(wid, ts, draining=x % 2 == 0, queued_prefill_tokens=x, running_tokens=2 * x), now)
        elif op == "gauge":
            ts += 1
            view.apply_gauge(gauge(wid, ts, queued_prefill_tokens=x, running_tokens=x,
                                   arrived=placed[-x % 3:] if placed and x % 2 else None), now)
        elif op == "kv":
            seq[who] += 1
            view.apply_kv_events(batch(wid, seq[who], stored([x + 1])), now)
        elif op == "place" and view.worker(wid) is not None:
            rid = f"r{len(placed)}"
            view.record_placement(wid, rid, x, 2 * x, now)
            placed.append(rid)
        elif op == "release" and placed:
            view.release_placement(placed[x % len(placed)])
        elif op == "time":
            now += x / 2
        elif op == "remove":
            view.remove_worker(wid)
        elif op == "restart":
            view.update_worker(info(wid, started_at=2.0 + x), now)
        pool = view.pool(MODEL)
        if pool is None:
            continue
        for at in (now, now + 5.0):  # later too: a member goes stale with no event at all
            assert [w.worker_id for w in view.placeable_in(pool, at)] == _placeable_from_scratch(view, pool, at)
            assert [w.worker_id for w in view.placeable_in(pool, at, {"w1"})] == [
                w for w in _placeable_from_scratch(view, pool, at) if w != "w1"]
            assert pool.mask_of(view.placeable_in(pool, at)) == pool.mask_of(list(view.placeable_in(pool, at)))
        assert pool.opt_tokens == sum(w.opt_prefill_tokens + w.opt_running_tokens for w in pool)
