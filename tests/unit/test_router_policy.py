"""Router policies: each policy, ties, stale gauges, capacity edge cases, models, LoRA."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from proto.hashing import block_hashes, pack_tokens
from proto.messages import GenerateRequest, SamplingParams
from proto.workers import BlockStored, KvEventBatch, WorkerGauge, WorkerInfo
from services.common.fleet import FleetView
from services.router.policy import (
    CascadeConfig,
    NoCapacity,
    PolicyConfig,
    RouteDecision,
    RouteQuery,
    Router,
    RouterConfig,
    adapter_home,
)

MODEL = "llama"


def make_view(n: int, model: str = MODEL, *, block_size: int = 16, loras: tuple[str, ...] = ()) -> FleetView:
    v = FleetView()
    add_workers(v, n, model, block_size=block_size, loras=loras)
    return v


def add_workers(
    v: FleetView,
    n: int,
    model: str = MODEL,
    *,
    block_size: int = 16,
    loras: tuple[str, ...] = (),
    start: int = 0,
) -> None:
    for i in range(start, start + n):
        v.update_worker(
            WorkerInfo(
                worker_id=f"{model}-{i}",
                model=model,
                engine="sim",
                state="ready",
                block_size=block_size,
                lora_adapters=list(loras),
            ),
            0.0,
        )


def set_load(
    v: FleetView,
    wid: str,
    queued: int = 0,
    running: int = 0,
    ts: float = 1.0,
    now: float = 0.0,
    **kw: Any,
) -> None:
    w = v.worker(wid)
    assert w is not None
    v.apply_gauge(
        WorkerGauge(
            worker_id=wid, model=w.model, ts=ts, queued_prefill_tokens=queued, running_tokens=running, **kw
        ),
        now,
    )


def cache(v: FleetView, wid: str, prompt: list[int], block_size: int = 16, salt: str = "") -> None:
    w = v.worker(wid)
    assert w is not None
    seq = w.kv_seq + 1
    v.apply_kv_events(
        KvEventBatch(
            worker_id=wid,
            model=w.model,
            seq=seq,
            ts=0.0,
            events=[BlockStored(block_hashes=block_hashes(prompt, block_size, salt), block_size=block_size)],
        ),
        0.0,
    )


def q(rid: str = "r", prompt: list[int] | None = None, model: str = MODEL, **kw: object) -> RouteQuery:
    return RouteQuery.of(rid, model, prompt if prompt is not None else list(range(64)), **kw)


def router(v: FleetView, policy: str = "prefix", seed: int = 0, **kw: object) -> Router:
    cfg = RouterConfig(default=PolicyConfig(policy=policy, **kw))  # type: ignore[arg-type]
    return Router(v, cfg, random.Random(seed))


def decided(result: RouteDecision | NoCapacity) -> RouteDecision:
    assert isinstance(result, RouteDecision), result
    return result


SYSTEM = list(range(5000, 5000 + 2048))


# ---- round robin / least load ----


def test_round_robin_cycles_and_skips_draining() -> None:
    v = make_view(3)
    r = router(v, "round_robin")
    picks = [decided(r.decide(q(f"r{i}"), 0.5)).worker_id for i in range(6)]
    assert picks == ["llama-0", "llama-1", "llama-2"] * 2
    set_load(v, "llama-1", draining=True)
    picks = [decided(r.decide(q(f"s{i}"), 0.5)).worker_id for i in range(4)]
    assert "llama-1" not in picks
    assert set(picks) == {"llama-0", "llama-2"}


def test_least_load_picks_fewest_outstanding_tokens() -> None:
    v = make_view(3)
    set_load(v, "llama-0", queued=1000, running=0)
    set_load(v, "llama-1", queued=100, running=800)  # 900 outstanding
    set_load(v, "llama-2", queued=0, running=1200)
    d = decided(router(v, "least_load").decide(q(), 0.5))
    assert d.worker_id == "llama-1"
    assert d.cost == 900
    assert d.policy == "least_load"


def test_ties_are_broken_by_the_injected_rng() -> None:
    v = make_view(4)
    by_seed = {
        seed: decided(router(v, "least_load", seed=seed).decide(q(), 0.5)).worker_id for seed in range(40)
    }
    # deterministic: the same seed gives the same pick
    assert all(
        decided(router(v, "least_load", seed=s).decide(q(), 0.5)).worker_id == w for s, w in by_seed.items()
    )
    # unbiased enough to reach every tied worker
    assert set(by_seed.values()) == {f"llama-{i}" for i in range(4)}


# ---- prefix ----


def test_prefix_prefers_the_holder_until_its_queue_outweighs_the_prefix() -> None:
    v = make_view(3)
    cache(v, "llama-2", SYSTEM)
    prompt = [*SYSTEM, *range(100)]  # 2148 tokens, 2048 cached on llama-2
    # the raw-cost rule; by default a holder also keeps short queues (test_router_runaway.py)
    r = router(v, "prefix", spill_wait_tokens=0)
    d = decided(r.decide(q(prompt=prompt), 0.5))
    assert (d.worker_id, d.cached_tokens, d.cost) == ("llama-2", 2048, 100)
    # queue of 2000 on the holder: 100 + 2000 < 2148, still the holder
    set_load(v, "llama-2", queued=2000)
    assert decided(r.decide(q(prompt=prompt), 0.5)).worker_id == "llama-2"
    # queue of 2100: 100 + 2100 > 2148, recomputing elsewhere is cheaper
    set_load(v, "llama-2", queued=2100, ts=2.0)
    d = decided(r.decide(q(prompt=prompt), 0.5))
    assert d.worker_id != "llama-2"
    assert d.cost == 2148
    assert d.cached_tokens == 0


def test_prefix_running_tokens_weigh_beta() -> None:
    v = make_view(2)
    set_load(v, "llama-0", running=1000)  # β·1000 = 500
    set_load(v, "llama-1", queued=600)
    assert decided(router(v, "prefix").decide(q(), 0.5)).worker_id == "llama-0"
    assert decided(router(v, "prefix", beta=1.0).decide(q(), 0.5)).worker_id == "llama-1"


def _hold_loads(v: FleetView, loads: dict[str, int], seconds: float = 30.0) -> None:
    """Gauges every second for ``seconds``: each worker's load average settles at its load."""
    for t in range(1, int(seconds) + 1):
        for wid, running in loads.items():
            set_load(v, wid, running=running, ts=float(t), now=float(t))


def test_prefix_sends_to_an_underused_worker_despite_the_cache() -> None:
    v = make_view(4)
    for i in range(3):
        cache(v, f"llama-{i}", SYSTEM)
    _hold_loads(v, {"llama-0": 6000, "llama-1": 6000, "llama-2": 6000, "llama-3": 0})
    prompt = [*SYSTEM, *range(100)]
    # cost alone: a holder (100 + 0.1·6000 = 700) beats the cold one (2148)
    assert decided(router(v, balance_factor=0).decide(q(prompt=prompt), 31.0)).worker_id != "llama-3"
    d = decided(router(v).decide(q(prompt=prompt), 31.0))
    assert (d.worker_id, d.cached_tokens) == ("llama-3", 0)
    assert "llama-3 underused" in d.note
    # a refusal's retry (the cold one excluded) goes to a holder
    retry = decided(router(v).decide(q(prompt=prompt), 31.0, exclude={"llama-3"}))
    assert retry.worker_id in {"llama-0", "llama-1", "llama-2"} and retry.cached_tokens == 2048
    assert d.rebalanced and not d.hint
    # the rule stays within admission's slack: the cold replica's prefill breaks a tight one
    tight = decided(router(v).decide(q(prompt=prompt, prefer_worker="llama-1"), 31.0))
    assert tight.worker_id != "llama-3" and not tight.rebalanced
    loose = decided(router(v).decide(q(prompt=prompt, prefer_worker="llama-1", prefer_slack_tokens=4096), 31.0))
    assert (loose.worker_id, loose.hint, loose.rebalanced) == ("llama-3", "moved", True)


def test_underused_needs_a_low_average_and_a_low_current_load() -> None:
    v = make_view(4)
    for i in range(3):
        cache(v, f"llama-{i}", SYSTEM)
    prompt = [*SYSTEM, *range(100)]
    # an idle pool needs no balancing: the mean load average is under balance_min_tokens
    _hold_loads(v, {"llama-0": 1500, "llama-1": 1500, "llama-2": 1500, "llama-3": 0})
    assert decided(router(v).decide(q(prompt=prompt), 31.0)).worker_id != "llama-3"
    # a low average but a burst placed on it right now: not underused any more
    v = make_view(4)
    for i in range(3):
        cache(v, f"llama-{i}", SYSTEM)
    _hold_loads(v, {"llama-0": 6000, "llama-1": 6000, "llama-2": 6000, "llama-3": 0})
    r = router(v)
    first = decided(r.place(q("a", prompt=prompt), 31.0))
    assert first.worker_id == "llama-3"
    # after the second one its current load (2 × 4312 tokens) is above the pool's mean
    assert decided(r.place(q("b", prompt=prompt), 31.0)).worker_id == "llama-3"
    later = [decided(r.place(q(f"c{i}", prompt=prompt), 31.0)).worker_id for i in range(3)]
    assert "llama-3" not in later


def test_prefix_places_within_admissions_slack() -> None:
    v = make_view(3)
    set_load(v, "llama-0", running=20_000)  # prefill work 64, cost 64 + 2000
    set_load(v, "llama-1", queued=500)  # prefill work 564, cost 564: the cost's best
    set_load(v, "llama-2", queued=9000)  # prefill work 9064
    r = router(v)
    # no slack: only replicas with no more prefill work than admission's replica qualify
    d = decided(r.decide(q(prefer_worker="llama-0"), 0.5))
    assert (d.worker_id, d.hint) == ("llama-0", "kept")
    # slack enough for llama-1's queue: the cost decides among the two
    d = decided(r.decide(q(prefer_worker="llama-0", prefer_slack_tokens=1000), 0.5))
    assert (d.worker_id, d.hint) == ("llama-1", "moved")
    # a hint never makes a placement worse than admission's replica
    d = decided(r.decide(q(prefer_worker="llama-2"), 0.5))
    assert (d.worker_id, d.hint) == ("llama-1", "moved")
    # hints off, unknown, or not eligible: the cost alone
    d = decided(router(v, admission_hints=False).decide(q(prefer_worker="llama-0"), 0.5))
    assert (d.worker_id, d.hint) == ("llama-1", "")
    assert decided(r.decide(q(prefer_worker="nope"), 0.5)).hint == "unavailable"
    set_load(v, "llama-0", running=20_000, ts=2.0, draining=True)
    d = decided(r.decide(q(prefer_worker="llama-0"), 0.5))
    assert (d.worker_id, d.hint) == ("llama-1", "unavailable")


@pytest.mark.parametrize("seed", range(20))
def test_prefix_holder_is_always_a_candidate_in_a_large_pool(seed: int) -> None:
    v = make_view(64)
    cache(v, "llama-37", SYSTEM)
    for i in range(64):
        set_load(v, f"llama-{i}", queued=50)
    d = decided(router(v, "prefix", seed=seed).decide(q(prompt=[*SYSTEM, 1, 2, 3]), 0.5))
    assert d.worker_id == "llama-37"


def test_prefix_samples_d_candidates_in_a_large_pool() -> None:
    """Without a prefix, the winner is the best of d random workers, not the global minimum."""
    v = make_view(64)
    for i in range(64):
        set_load(v, f"llama-{i}", queued=1000 + i)
    wins = Counter(decided(router(v, "prefix", seed=s).decide(q(), 0.5)).worker_id for s in range(200))
    assert len(wins) > 20  # spread: many routers sharing a stale view do not herd
    assert wins.most_common(1)[0][1] < 40
    # the full-scan threshold scans everything: then the global minimum always wins
    full = router(v, "prefix", full_scan_max=64)
    assert decided(full.decide(q(), 0.5)).worker_id == "llama-0"


def test_many_holders_are_capped_by_sampling() -> None:
    v = make_view(40)
    for i in range(40):
        cache(v, f"llama-{i}", SYSTEM)
        set_load(v, f"llama-{i}", queued=10 * i)
    prompt = [*SYSTEM, 9]
    d = decided(router(v, "prefix", max_prefix_candidates=8, seed=1).decide(q(prompt=prompt), 0.5))
    assert d.cached_tokens == 2048
    wins = {
        decided(router(v, "prefix", max_prefix_candidates=8, seed=s).decide(q(prompt=prompt), 0.5)).worker_id
        for s in range(30)
    }
    assert len(wins) > 3  # not always the single global minimum


def test_stale_gauges_do_not_herd_a_burst() -> None:
    """Between two gauges a burst spreads, because each placement counts at once."""
    v = make_view(4)
    r = router(v, "prefix")
    for i in range(4):
        set_load(v, f"llama-{i}", queued=0, ts=1.0)
    placed = Counter(
        decided(r.place(q(f"b{i}", prompt=list(range(i * 1000, i * 1000 + 512))), 0.5)).worker_id
        for i in range(40)
    )
    assert sorted(placed.values()) == [10, 10, 10, 10]
    # the next gauges (which include the burst) replace the optimistic additions
    for i in range(4):
        set_load(v, f"llama-{i}", queued=10, ts=2.0, now=1.0)
    for i in range(4):
        w = v.worker(f"llama-{i}")
        assert w is not None
        assert w.outstanding_tokens == 10


def test_least_load_burst_spreads_too() -> None:
    v = make_view(3)
    r = router(v, "least_load")
    placed = Counter(decided(r.place(q(f"b{i}"), 0.5)).worker_id for i in range(30))
    assert sorted(placed.values()) == [10, 10, 10]


# ---- capacity edge cases ----


def test_unknown_model_and_empty_pool() -> None:
    v = make_view(1)
    res = router(v).decide(q(model="nope"), 0.5)
    assert isinstance(res, NoCapacity)
    assert res.reason == "unknown_model"
    assert not res.retryable
    cfg = RouterConfig(models={"gpt-big": PolicyConfig()})
    res = Router(v, cfg).decide(q(model="gpt-big"), 0.5)
    assert isinstance(res, NoCapacity)
    assert res.reason == "empty_pool"
    assert res.retryable
    # a pool whose last worker went away is empty, not unknown
    v.remove_worker("llama-0")
    res = router(v).decide(q(), 0.5)
    assert isinstance(res, NoCapacity)
    assert (res.reason, res.retryable) == ("empty_pool", True)


def test_pool_of_one() -> None:
    v = make_view(1)
    for policy in ("round_robin", "least_load", "prefix", "session"):
        d = decided(router(v, policy).decide(q(session_key="u1"), 0.5))
        assert d.worker_id == "llama-0"
        # its refusal leaves nothing to retry on
        assert isinstance(router(v, policy).decide(q(session_key="u1"), 0.5, exclude={"llama-0"}), NoCapacity)


def test_never_draining_starting_or_expired_and_exclude_honoured() -> None:
    v = make_view(4)
    set_load(v, "llama-0", draining=True)
    v.update_worker(WorkerInfo(worker_id="llama-1", model=MODEL, engine="sim", state="starting"), 0.0)
    v.update_worker(WorkerInfo(worker_id="llama-2", model=MODEL, engine="sim", state="ready"), -100.0)
    w2 = v.worker("llama-2")
    assert w2 is not None
    w2.last_seen = -100.0  # silent for 100 s: expired even before the shell removes it
    for policy in ("round_robin", "least_load", "prefix", "session"):
        r = router(v, policy)
        for i in range(10):
            assert decided(r.decide(q(f"r{i}", session_key=f"u{i}"), 0.5)).worker_id == "llama-3"
        res = r.decide(q(session_key="u"), 0.5, exclude={"llama-3"})
        assert isinstance(res, NoCapacity)
        assert res.reason == "no_eligible_worker"
        assert res.retryable


def test_a_retry_releases_the_refusal_and_places_on_the_next_best() -> None:
    """What the shell does when a worker refuses: release, decide again without it."""
    v = make_view(3)
    set_load(v, "llama-0", queued=10)
    set_load(v, "llama-1", queued=20)
    set_load(v, "llama-2", queued=30)
    r = router(v, "prefix")
    d = decided(r.place(q("x"), 0.5))
    assert d.worker_id == "llama-0"
    assert r.release("x")
    retry = decided(r.place(q("x"), 0.6, exclude={"llama-0"}))
    assert retry.worker_id == "llama-1"  # the optimistic load moved from llama-0 to llama-1
    w0, w1 = v.worker("llama-0"), v.worker("llama-1")
    assert w0 is not None and w1 is not None
    assert w0.outstanding_tokens == 10
    assert w1.outstanding_tokens == 20 + 64 + 64 + 16
    assert r.release("x")
    assert w1.outstanding_tokens == 20


def test_decide_is_pure_over_the_view() -> None:
    v = make_view(2)
    r = router(v, "prefix")
    r.decide(q(), 0.5)
    assert all(w.outstanding_tokens == 0 for w in v.pool(MODEL) or [])
    d = decided(r.place(q(max_tokens=100), 0.5))
    w = v.worker(d.worker_id)
    assert w is not None
    assert (w.queued_prefill_tokens, w.running_tokens) == (64, 164)
    assert d.to_placement().worker_id == d.worker_id


def test_optimistic_prefill_is_only_the_uncached_part() -> None:
    v = make_view(1)
    cache(v, "llama-0", SYSTEM)
    d = decided(router(v).place(q(prompt=[*SYSTEM, *range(52)], max_tokens=10), 0.5))
    w = v.worker("llama-0")
    assert w is not None
    assert d.cached_tokens == 2048
    assert (w.queued_prefill_tokens, w.running_tokens) == (52, 2048 + 52 + 10)


# ---- session affinity ----


def test_session_is_sticky_and_spread() -> None:
    v = make_view(8)
    r = router(v, "session")
    first = {
        f"user{k}": decided(r.decide(q(f"a{k}", session_key=f"user{k}"), 0.5)).worker_id for k in range(200)
    }
    again = {
        f"user{k}": decided(r.decide(q(f"b{k}", session_key=f"user{k}"), 0.5)).worker_id for k in range(200)
    }
    assert first == again
    counts = Counter(first.values())
    assert len(counts) == 8
    assert max(counts.values()) < 3 * 200 / 8


def test_session_consistent_hashing_moves_only_the_lost_workers_keys() -> None:
    v = make_view(8)
    r = router(v, "session")
    keys = [f"user{k}" for k in range(400)]
    before = {k: decided(r.decide(q(session_key=k), 0.5)).worker_id for k in keys}
    v.remove_worker("llama-3")
    after = {k: decided(r.decide(q(session_key=k), 0.5)).worker_id for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "llama-3"}
    # adding a worker takes keys only onto the new worker
    add_workers(v, 1, start=8)
    again = {k: decided(r.decide(q(session_key=k), 0.5)).worker_id for k in keys}
    assert all(again[k] in (after[k], "llama-8") for k in keys)
    assert sum(again[k] == "llama-8" for k in keys) > 10


def test_session_draining_target_moves_to_the_next_on_the_ring_and_back() -> None:
    v = make_view(4)
    r = router(v, "session")
    d = decided(r.decide(q(session_key="alice"), 0.5))
    set_load(v, d.worker_id, draining=True)
    moved = decided(r.decide(q(session_key="alice"), 0.5))
    assert moved.worker_id != d.worker_id
    # the next worker on the ring: the one a refusal's retry (the target excluded) takes
    set_load(v, d.worker_id, draining=False, ts=1.5)
    assert moved.worker_id == decided(r.decide(q(session_key="alice"), 0.5, exclude={d.worker_id})).worker_id
    set_load(v, d.worker_id, draining=False, ts=2.0)
    assert decided(r.decide(q(session_key="alice"), 0.5)).worker_id == d.worker_id


def test_session_overloaded_target_falls_back_to_prefix() -> None:
    v = make_view(4)
    r = router(v, "session", session_overload_factor=1.5, session_overload_min_tokens=1000)
    target = decided(r.decide(q(session_key="bob"), 0.5)).worker_id
    for i in range(4):
        set_load(v, f"llama-{i}", queued=1000)
    set_load(v, target, queued=1400, ts=2.0)  # above the mean, not overloaded
    d = decided(r.decide(q(session_key="bob"), 0.5))
    assert (d.worker_id, d.policy) == (target, "session")
    set_load(v, target, queued=6000, ts=3.0)  # 6000 > 1.5 × 2250 and 3750 above the mean
    d = decided(r.decide(q(session_key="bob"), 0.5))
    assert d.policy == "prefix"
    assert d.worker_id != target
    assert "overloaded" in d.note
    set_load(v, target, queued=0, kv_usage=0.97, ts=4.0)  # KV nearly full
    assert decided(r.decide(q(session_key="bob"), 0.5)).policy == "prefix"


def test_session_without_key_uses_prefix() -> None:
    v = make_view(3)
    cache(v, "llama-1", SYSTEM)
    d = decided(router(v, "session").decide(q(prompt=[*SYSTEM, 1]), 0.5))
    assert (d.worker_id, d.policy) == ("llama-1", "prefix")


# ---- model resolution ----


def test_alias_resolves_to_its_pool() -> None:
    v = make_view(2)
    cfg = RouterConfig(aliases={"default": MODEL, "chat": "default"})
    d = decided(Router(v, cfg).decide(q(model="chat"), 0.5))
    assert d.model == MODEL
    assert d.requested_model == "chat"
    assert "alias" in d.note


def cascade_router(v: FleetView, **kw: object) -> Router:
    cc = CascadeConfig(small="small", large="large", max_prompt_tokens=100, **kw)  # type: ignore[arg-type]
    return Router(v, RouterConfig(cascades={"auto": cc}, aliases={"smart": "auto"}), random.Random(0))


def test_cascade_by_prompt_length_and_output() -> None:
    v = make_view(1, "small")
    add_workers(v, 1, "large")
    r = cascade_router(v, max_output_tokens=500)
    assert decided(r.decide(q(model="auto", prompt=list(range(50))), 0.5)).model == "small"
    assert decided(r.decide(q(model="auto", prompt=list(range(101))), 0.5)).model == "large"
    assert decided(r.decide(q(model="smart", prompt=list(range(50)), max_tokens=800), 0.5)).model == "large"


def test_cascade_keywords_in_text_and_tokens() -> None:
    v = make_view(1, "small")
    add_workers(v, 1, "large")
    r = cascade_router(v, hard_keywords=("prove",), hard_keyword_tokens=((777, 778),))
    easy = list(range(10))
    assert decided(r.decide(q(model="auto", prompt=easy, text="say hi"), 0.5)).model == "small"
    assert decided(r.decide(q(model="auto", prompt=easy, text="Please PROVE it"), 0.5)).model == "large"
    assert decided(r.decide(q(model="auto", prompt=[1, 777, 778, 2]), 0.5)).model == "large"
    # the keyword's bytes straddling two tokens is not a match
    straddle = pack_tokens([777, 778])[2:6]
    tricky = RouteQuery("t", "auto", pack_tokens([1]) + b"\x00\x00" + straddle + b"\x00\x00", max_tokens=4)
    assert len(tricky.prompt) % 4 == 0
    assert decided(r.decide(tricky, 0.5)).model == "small"


def test_cascade_falls_back_when_the_chosen_pool_is_empty() -> None:
    v = make_view(1, "large")
    d = decided(cascade_router(v).decide(q(model="auto", prompt=[1, 2]), 0.5))
    assert d.model == "large"
    assert "small had no capacity" in d.note
    v2 = make_view(1, "small")
    res = Router(
        v2,
        RouterConfig(cascades={"auto": CascadeConfig("small", "large", max_prompt_tokens=1, fallback=False)}),
    ).decide(q(model="auto", prompt=[1, 2]), 0.5)
    assert isinstance(res, NoCapacity)


# ---- LoRA and block sizes ----


def test_lora_only_on_workers_with_the_adapter() -> None:
    v = make_view(2)
    add_workers(v, 2, loras=("sql",), start=2)
    r = router(v, "least_load")
    for i in range(10):
        assert decided(r.place(q(f"l{i}", lora="sql"), 0.5)).worker_id in ("llama-2", "llama-3")
    res = r.decide(q(lora="other"), 0.5)
    assert isinstance(res, NoCapacity)


def dynamic_view(n: int, max_loras: int = 2) -> FleetView:
    """``n`` workers that load adapters at run time: 1 GB/s from storage, 10 GB/s from host
    memory, prefilling 10,000 tokens/s."""
    v = FleetView()
    for i in range(n):
        v.update_worker(WorkerInfo(worker_id=f"{MODEL}-{i}", model=MODEL, engine="sim", state="ready",
                                   max_loras=max_loras, lora_load_gb_per_s=1.0, lora_host_gb_per_s=10.0), 0.0)
    return v


def adapters(v: FleetView, wid: str, resident: list[str], cached: list[str] = (), queued: int = 0) -> None:  # type: ignore[assignment]
    set_load(v, wid, queued=queued, prefill_tokens_per_s=10_000, lora_adapters=resident, lora_cached=list(cached))


def test_an_adapter_load_costs_its_seconds_in_prefill_tokens() -> None:
    """Resident: free. In host memory: size / host bandwidth × prefill rate. From storage:
    size / storage bandwidth × rate, and half again when every slot is taken (an eviction)."""
    v = dynamic_view(4)
    adapters(v, f"{MODEL}-0", ["sql"])
    adapters(v, f"{MODEL}-1", [], cached=["sql"])
    adapters(v, f"{MODEL}-2", [])
    adapters(v, f"{MODEL}-3", ["a", "b"])  # both slots taken
    r = router(v, "least_load")
    size = 100_000_000  # 100 MB: 0.1 s from storage, 0.01 s from host memory
    costs = {}
    for wid in (f"{MODEL}-{i}" for i in range(4)):
        others = [f"{MODEL}-{i}" for i in range(4) if f"{MODEL}-{i}" != wid]
        d = decided(r.decide(q(lora="sql", lora_size_bytes=size), 0.5, exclude=others))
        costs[wid] = d.cost
    assert costs == {f"{MODEL}-0": 0, f"{MODEL}-1": pytest.approx(100), f"{MODEL}-2": pytest.approx(1000),
                     f"{MODEL}-3": pytest.approx(1500)}
    # unknown size: the configured penalty stands in for the load
    assert decided(r.decide(q(lora="sql"), 0.5, exclude=[f"{MODEL}-{i}" for i in (0, 1, 3)])).cost == 2048


def test_an_adapter_loads_at_its_home_at_the_plain_price_and_elsewhere_at_three_times_it() -> None:
    v = dynamic_view(4)
    for i in range(4):
        adapters(v, f"{MODEL}-{i}", [])
    size = 100_000_000  # 1,000 prefill tokens from storage
    home = adapter_home("sql", list(v))
    assert home is not None and home is adapter_home("sql", list(reversed(list(v))))  # order-free
    homes = {adapter_home(f"a{k}", list(v)).worker_id for k in range(40)}  # type: ignore[union-attr]
    assert len(homes) == 4  # adapters spread over the workers
    d = decided(router(v, "prefix").decide(q(lora="sql", lora_size_bytes=size), 0.5))
    assert d.worker_id == home.worker_id and d.cost == pytest.approx(1000 + 64)
    away = next(w.worker_id for w in v if w is not home)
    d = decided(router(v, "prefix").decide(q(lora="sql", lora_size_bytes=size), 0.5,
                                           exclude=[w.worker_id for w in v if w.worker_id not in (away, home.worker_id)]))
    assert d.worker_id == home.worker_id
    adapters(v, home.worker_id, [], queued=2_500)  # a busy home: a dearer load elsewhere wins
    d = decided(router(v, "prefix").decide(q(lora="sql", lora_size_bytes=size), 0.5))
    assert d.worker_id != home.worker_id and d.cost == pytest.approx(3000 + 64)


def test_a_hot_adapter_spreads_once_its_holders_queue_costs_more_than_a_load() -> None:
    v = dynamic_view(3)
    adapters(v, f"{MODEL}-0", ["hot"], queued=500)
    adapters(v, f"{MODEL}-1", [])
    adapters(v, f"{MODEL}-2", [])
    r = router(v, "prefix")
    size = 100_000_000  # a load costs 1,000 prefill tokens here
    assert decided(r.decide(q(lora="hot", lora_size_bytes=size), 0.5)).worker_id == f"{MODEL}-0"
    adapters(v, f"{MODEL}-0", ["hot"], queued=5_000)  # its queue now outweighs a load elsewhere
    assert decided(r.decide(q(lora="hot", lora_size_bytes=size), 0.5)).worker_id != f"{MODEL}-0"
    # workers without runtime loading and without the adapter never take it
    static = make_view(2)
    assert isinstance(router(static).decide(q(lora="hot", lora_size_bytes=size), 0.5), NoCapacity)


def test_the_underused_rule_never_forces_a_costly_load() -> None:
    """A worker left underused is sent requests its load average asks for, but never one
    it must first make a costly load for (a model, in seconds) that the cheapest worker
    needs not: a hot-swap fleet's plain LRU lost a fifth of its SLO to such loads in
    benchmarks/hotswap_sim.py. A cheap load (an adapter's, tens of ms) may warm it."""
    v = dynamic_view(4)
    for t in range(1, 31):
        for i in range(3):
            set_load(v, f"{MODEL}-{i}", running=6000, ts=float(t), now=float(t), prefill_tokens_per_s=10_000,
                     lora_adapters=["hot"])
        set_load(v, f"{MODEL}-3", ts=float(t), now=float(t), prefill_tokens_per_s=10_000)
    big = 2_000_000_000  # 2 s from storage: 20,000 prefill tokens (60,000 away from home)
    d = decided(router(v).decide(q(lora="hot", lora_size_bytes=big), 31.0))
    assert d.worker_id != f"{MODEL}-3" and not d.rebalanced
    small = 100_000_000  # 1,000 prefill tokens (3,000 away from home)
    d = decided(router(v).decide(q(lora="hot", lora_size_bytes=small), 31.0))
    assert (d.worker_id, d.rebalanced) == (f"{MODEL}-3", True)
    # bound 0: no load at all
    d = decided(router(v, balance_max_load_tokens=0).decide(q(lora="hot", lora_size_bytes=small), 31.0))
    assert d.worker_id != f"{MODEL}-3"


def test_lora_prefix_uses_the_adapter_salt() -> None:
    v = make_view(2, loras=("sql",))
    cache(v, "llama-0", SYSTEM)  # base-model prefix
    cache(v, "llama-1", SYSTEM, salt="sql")
    d = decided(router(v).decide(q(prompt=[*SYSTEM, 1], lora="sql"), 0.5))
    assert (d.worker_id, d.cached_tokens) == ("llama-1", 2048)


def test_cpu_pool_block_size_128() -> None:
    v = make_view(2, "cpu", block_size=128)
    prompt = list(range(1000))
    cache(v, "cpu-1", prompt, block_size=128)
    d = decided(router(v).decide(q(model="cpu", prompt=prompt), 0.5))
    assert (d.worker_id, d.cached_tokens) == ("cpu-1", 896)


def test_from_generate_request() -> None:
    req = GenerateRequest(
        request_id="g",
        model=MODEL,
        prompt=pack_tokens([1, 2, 3]),
        prior_output=pack_tokens([4]),
        sampling=SamplingParams(max_tokens=9),
        token_subject="t",
        session_key="s",
    )
    rq = RouteQuery.from_generate(req)
    assert (rq.prompt_tokens, rq.max_tokens, rq.session_key, rq.expected_total_tokens) == (4, 9, "s", 13)


def test_from_generate_keeps_the_gateways_hashes_only_for_the_prompt_they_hash() -> None:
    req = GenerateRequest(request_id="g", model=MODEL, prompt=pack_tokens(SYSTEM), token_subject="t")
    hashes = block_hashes(SYSTEM, 16)
    rq = RouteQuery.from_generate(req, block_hashes=hashes, block_size=16)
    assert (list(rq.block_hashes), rq.block_size) == (hashes, 16)
    # a migrated segment's prompt has grown by its output: the hashes no longer describe it
    moved = RouteQuery.from_generate(GenerateRequest(request_id="g", model=MODEL, prompt=pack_tokens(SYSTEM),
                                                     prior_output=pack_tokens([1]), token_subject="t"),
                                     block_hashes=hashes, block_size=16)
    assert (list(moved.block_hashes), moved.block_size) == ([], 0)


def test_the_gateways_hashes_give_the_decisions_of_hashing_the_prompt() -> None:
    """Same fleet, same queries: walking the gateway's hashes places every request where
    hashing the prompt in the router does, with the same cached tokens, for each block
    size of a mixed pool (the other size is still hashed from the prompt)."""
    rng = random.Random(5)
    docs = [[rng.randrange(50_000) for _ in range(512)] for _ in range(6)]

    def fleet() -> FleetView:
        v = make_view(6)
        add_workers(v, 2, block_size=32, start=6)
        for i in range(8):
            for d in rng_pick[i]:
                cache(v, f"{MODEL}-{i}", docs[d], block_size=32 if i >= 6 else 16)
        return v

    rng_pick = [random.Random(i).sample(range(6), 2) for i in range(8)]
    plain, hashed = router(fleet(), seed=3), router(fleet(), seed=3)
    hits = 0
    for k in range(60):
        prompt = [*docs[k % 6][: 128 + 16 * (k % 20)], k, k + 1, k + 2]
        a = decided(plain.place(q(f"r{k}", prompt), 0.5))
        b = decided(hashed.place(q(f"r{k}", prompt, block_hashes=block_hashes(prompt, 16), block_size=16), 0.5))
        assert (a.worker_id, a.cached_tokens, a.cost) == (b.worker_id, b.cached_tokens, b.cost)
        hits += a.cached_tokens > 0
    assert hits > 30  # the walks found cached prefixes, in both block sizes' workers


def test_bad_policy_name_is_rejected() -> None:
    with pytest.raises(ValueError):
        PolicyConfig(policy="fastest")  # type: ignore[arg-type]


def test_near_ties_rotate_by_last_placement_and_never_give_up_cache_or_a_clear_gap() -> None:
    """Load figures within ``tie_tokens`` are noise: the least recently placed of them wins,
    so each worker's arrivals are spaced as round robin spaces them (distinct prompts:
    p90 TTFT 176 → 162 ms in router_sim). A worker clearly busier, or holding less of
    the prompt than the cheapest, is never part of the rotation."""
    v = make_view(4)
    for wid, running in (("llama-0", 0), ("llama-1", 1000), ("llama-2", 2000)):
        set_load(v, wid, running=running)  # β · running: 0, 100, 200 tokens apart
    set_load(v, "llama-3", queued=3000)  # beyond the tie (tie_tokens_uncached: nobody holds these prompts)
    r = router(v)
    placed = [decided(r.place(q(f"r{i}", list(range(100 * i, 100 * i + 64)), max_tokens=16), 0.1 * (i + 1))).worker_id
              for i in range(6)]
    # the cheapest first, then the two never placed on (in either order), then the same
    # rotation; llama-3, 3,000 tokens busier, never
    assert placed[0] == "llama-0" and set(placed[:3]) == {"llama-0", "llama-1", "llama-2"} and placed[3:] == placed[:3]
    strict = make_view(4)
    for wid, running in (("llama-0", 0), ("llama-1", 1000), ("llama-2", 2000)):
        set_load(strict, wid, running=running)
    set_load(strict, "llama-3", queued=3000)
    r0 = router(strict, tie_tokens=0, tie_tokens_uncached=0)
    first = [decided(r0.place(q(f"r{i}", list(range(100 * i, 100 * i + 64)), max_tokens=16), 0.1 * (i + 1))).worker_id
             for i in range(3)]
    assert first[:2] == ["llama-0"] * 2  # the strict minimum piles on the worker that reads lowest
    # a holder of the prompt is not rotated away from while it is the cheapest
    held = make_view(3)
    cache(held, "llama-1", SYSTEM)
    rh = router(held)
    for i in range(3):
        assert decided(rh.place(q(f"h{i}", SYSTEM + [9000 + i] * 16), 0.1 * (i + 1))).worker_id == "llama-1"


def test_prompts_nobody_holds_rotate_over_the_wider_band() -> None:
    """With nothing cached anywhere there is no cache to keep: workers within
    ``tie_tokens_uncached`` (2,048) of the cheapest take turns, where a held prompt's
    band is ``tie_tokens`` (1,024)."""
    v = make_view(2)
    set_load(v, "llama-1", queued=1500)  # inside 2,048, outside 1,024
    r = router(v)
    placed = [decided(r.place(q(f"r{i}", list(range(100 * i, 100 * i + 64)), max_tokens=16), 0.1 * (i + 1))).worker_id
              for i in range(4)]
    assert placed == ["llama-0", "llama-1", "llama-0", "llama-1"]
    narrow = make_view(2)
    set_load(narrow, "llama-1", queued=1500)
    rn = router(narrow, tie_tokens_uncached=1024)
    placed = [decided(rn.place(q(f"r{i}", list(range(100 * i, 100 * i + 64)), max_tokens=16), 0.1 * (i + 1))).worker_id
              for i in range(4)]
    assert placed == ["llama-0"] * 4


@pytest.mark.parametrize(("n", "holders"), [(64, 8), (64, 40), (10, 9), (3, 3)])
def test_the_random_others_are_uniform_distinct_and_never_the_holders(n: int, holders: int) -> None:
    # the candidates' random draw (policy._add_others): both its rejection draw (most of
    # the pool left) and its list draw (most of it picked), against random.sample's law
    from services.router.policy import _add_others

    view = FleetView()
    for i in range(n):
        view.update_worker(WorkerInfo(worker_id=f"w{i}", model="m", engine="sim", state="ready"), 0.0)
    pool = view.pool("m")
    assert pool is not None
    eligible = view.placeable_in(pool, 0.0)
    rng = random.Random(7)
    counts: Counter[str] = Counter()
    draws = 4000
    for _ in range(draws):
        pick = list(eligible[:holders])
        _add_others(rng, eligible, pick, 2)
        others = pick[holders:]
        assert len(others) == min(2, n - holders)
        assert len({w.worker_id for w in pick}) == len(pick)
        counts.update(w.worker_id for w in others)
    rest = n - holders
    if rest:
        expected = draws * min(2, rest) / rest
        assert set(counts) == {f"w{i}" for i in range(holders, n)}
        # chi-square against uniform, bounded at its mean + 5 standard deviations
        chi2 = sum((counts[f"w{i}"] - expected) ** 2 / expected for i in range(holders, n))
        df = rest - 1
        assert chi2 <= df + 5 * (2 * df) ** 0.5 + 1


def test_a_prompt_nobody_holds_goes_where_its_prefill_stalls_fewest_decodes() -> None:
    """With nothing cached anywhere the prefill costs the same wherever it runs, but it
    stalls every request decoding beside it for as long: its prompt, weighed by
    ``prefill_harm_weight`` (off by default: a trade of TTFT for TPOT), counts once per
    request running or waiting there (the gauge's and those placed since). A held prompt
    is not moved by it: its cache is worth more."""
    def load(v: FleetView, wid: str, requests: int, queued: int = 0) -> None:
        v.apply_gauge(WorkerGauge(worker_id=wid, model=MODEL, ts=1.0, running=requests, queued_prefill_tokens=queued,
                                  running_tokens=3000), 0.0)

    prompt = list(range(10_000, 11_000))  # 1,000 tokens, held by nobody
    v = make_view(2)
    load(v, "llama-0", 6)  # six decodes, nothing queued
    load(v, "llama-1", 1, queued=300)  # one decode and a queued prefill
    blind = router(v, tie_tokens_uncached=0)  # the default: no harm counted
    assert decided(blind.place(q("a", prompt), 0.1)).worker_id == "llama-0"  # 300 tokens less wait
    v = make_view(2)
    load(v, "llama-0", 6)
    load(v, "llama-1", 1, queued=300)
    r = router(v, prefill_harm_weight=0.5, tie_tokens_uncached=0)
    first = decided(r.place(q("b", prompt), 0.1))
    assert first.worker_id == "llama-1"  # 0.5 · 1,000 tokens · (6 − 1) requests outweigh 300 tokens of wait
    # what was placed since the gauge counts too: llama-1 now runs 2 and has 1,300 queued
    assert decided(r.place(q("c", list(range(20_000, 21_000))), 0.2)).worker_id == "llama-1"
    # a holder keeps the prompt however many decode there
    held = make_view(2)
    cache(held, "llama-0", SYSTEM)
    load(held, "llama-0", 6)
    load(held, "llama-1", 0)
    rh = router(held, prefill_harm_weight=0.5, tie_tokens_uncached=0)
    assert decided(rh.place(q("d", SYSTEM + [9000] * 16), 0.1)).worker_id == "llama-0"
    with pytest.raises(ValueError):
        PolicyConfig(prefill_harm_weight=-1)
