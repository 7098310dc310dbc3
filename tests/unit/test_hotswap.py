"""Hot-swap (issue 21, part 2): the eviction rule, a host of sim models loading and
evicting on demand, and the router's pricing of loads."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from proto.messages import SamplingParams
from proto.workers import AllCleared, KvEvent, WorkerGauge, WorkerInfo
from services.common.fleet import FleetView
from services.common.residency import (
    PIN_PATIENCE_S,
    ResidentModel,
    busiest,
    idle_expired,
    pins_honoured,
    swap_costs,
    victims,
)
from services.router.hotswap import Demand
from services.router.policy import PolicyConfig, RouteDecision, RouteQuery, Router, RouterConfig
from services.worker.engines.base import EngineOutput, EngineRequest
from services.worker.engines.hosted import HostedEngine, ModelHost
from services.worker.engines.sim import SimEngine
from tests.conftest import eventually

SPEED = 200.0


# ---- the rule --------------------------------------------------------------------------
def test_victims_are_the_least_recently_used_idle_unpinned_models() -> None:
    resident = [ResidentModel("a", 10, busy=False, idle_s=5), ResidentModel("b", 10, busy=False, idle_s=50),
                ResidentModel("c", 10, busy=True, idle_s=0)]
    assert victims(resident, 10, 40) == []  # fits in what is free
    assert victims(resident, 10, 30) == ["b"]  # the least recently used
    assert victims(resident, 10, 30, pinned=["b"]) == ["a"]  # a pinned one stays
    assert victims(resident, 20, 30) == ["b", "a"]
    assert victims(resident, 20, 30, pinned=["a"]) is None  # c is busy, a pinned: no room now
    assert victims(resident, 31, 30) is None  # never fits


def test_a_host_waiting_for_room_names_the_busy_models_to_go_and_patience_ends_pins() -> None:
    resident = [ResidentModel("a", 10, busy=True, idle_s=0), ResidentModel("b", 10, busy=True, idle_s=0),
                ResidentModel("c", 10, busy=False, idle_s=1, loading=True)]
    assert victims(resident, 10, 30) is None
    assert victims(resident, 10, 30, allow_busy=True) == ["a"]  # never the loading one
    assert victims(resident, 10, 30, pinned=["a", "b"], allow_busy=True) is None
    assert pins_honoured(["a"], 1.0) == ["a"]
    assert pins_honoured(["a"], PIN_PATIENCE_S) == []  # waited long enough: pins do not starve it


def test_idle_models_unload_unless_pinned_and_the_busiest_are_ranked() -> None:
    resident = [ResidentModel("a", 1, busy=False, idle_s=120), ResidentModel("b", 1, busy=False, idle_s=10),
                ResidentModel("c", 1, busy=True, idle_s=0), ResidentModel("d", 1, busy=False, idle_s=300)]
    assert idle_expired(resident, 60) == ["a", "d"]
    assert idle_expired(resident, 60, pinned=["d"]) == ["a"]
    assert idle_expired(resident, 0) == []  # 0: only evictions
    assert busiest({"a": 1.0, "b": 3.0, "c": 3.0, "d": 0.0}, 2) == ["b", "c"]
    assert busiest({"a": 1.0}, 0) == []
    demand = Demand(window_s=10.0)
    for _ in range(5):
        demand.add("hot", 0.0)
    demand.add("cold", 0.0)
    assert demand.busiest(1, 1.0) == ["hot"]
    assert demand.busiest(1, 1.0, among=["cold"]) == ["cold"]
    assert demand.rates(100.0)["hot"] < 1e-3  # decays


# ---- a host of sim engines ---------------------------------------------------------------
def host_of(memory_gib: float, *models: str, load_s: float = 0.05, idle_unload_s: float = 0.0,
            speed: float = SPEED, pin_patience_s: float = PIN_PATIENCE_S) -> dict[str, HostedEngine]:
    host = ModelHost("h1", memory_gib, idle_unload_s=idle_unload_s, pin_patience_s=pin_patience_s)
    return {m: HostedEngine(host, lambda m=m: SimEngine(model=m, profile="tiny-test", speed=speed),  # type: ignore[misc]
                            footprint_gib=10, load_s=load_s, extra_load_s=load_s) for m in models}


def request(rid: str, n: int = 8, max_tokens: int = 4, pinned: list[str] | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[40 + i % 50 for i in range(n)],
                         sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), pinned_models=pinned or [])


async def run(engine: HostedEngine, r: EngineRequest) -> list[EngineOutput]:
    async with contextlib.aclosing(engine.generate(r)) as stream:
        return [o async for o in stream]


async def test_a_cold_model_loads_on_demand_and_the_least_recently_used_one_is_evicted() -> None:
    e = host_of(20, "a", "b", "c")
    host = e["a"].host
    for m in e.values():
        await m.start()
    events: list[list[KvEvent]] = []

    async def collect_a() -> None:
        async for batch in e["a"].kv_events():
            events.append(batch)

    consumer = asyncio.create_task(collect_a())
    try:
        assert e["a"].stats().residency == "cold"
        stream = e["a"].generate(request("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        s = e["a"].stats()  # the request waits, counted, while its model loads
        assert (s.residency, s.waiting, s.queued_prefill_tokens) == ("loading", 1, 8)
        assert 0 < s.load_remaining_s <= 0.05
        outs = [await first] + [o async for o in stream]
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4
        assert e["a"].stats().residency == "resident"
        await asyncio.sleep(0.01)
        assert (await run(e["b"], request("r2")))[-1].finish_reason == "length"
        assert (host.loads, host.evictions) == (2, 0)
        # c needs room: a is the least recently used
        assert (await run(e["c"], request("r3")))[-1].finish_reason == "length"
        assert [m for m, x in e.items() if x.residency == "resident"] == ["b", "c"]
        assert (host.loads, host.evictions) == (3, 1)
        await asyncio.sleep(0.01)
        assert any(isinstance(ev, AllCleared) for batch in events for ev in batch)  # a's cache went with it
        assert e["a"].kv_snapshot() == []
        # pinned c: loading a evicts b although c was used last... and b was used before c
        await asyncio.sleep(0.01)
        assert (await run(e["b"], request("r4")))[-1].finish_reason == "length"  # b is now the most recent
        assert (await run(e["a"], request("r5", pinned=["b"])))[-1].finish_reason == "length"
        assert [m for m, x in e.items() if x.residency == "resident"] == ["a", "b"]
    finally:
        for m in e.values():
            await m.shutdown()
        await consumer


async def test_a_model_in_use_is_not_evicted_under_its_requests() -> None:
    e = host_of(10, "a", "b", speed=1.0)  # room for one; real time: a's request takes ~0.5 s
    for m in e.values():
        await m.start()
    try:
        long = asyncio.create_task(run(e["a"], request("long", max_tokens=400)))
        await eventually(lambda: e["a"].stats().running == 1, what="a's request running")
        short = asyncio.create_task(run(e["b"], request("b1")))
        await asyncio.sleep(0.1)
        assert not long.done() and not short.done() and e["b"].stats().waiting == 1  # waits for a to go idle
        assert e["a"].stats().residency == "evicting"  # and a takes no new work meanwhile (the router's reading)
        assert (await long)[-1].finish_reason == "length"  # a finished whole
        assert (await short)[-1].finish_reason == "length"
        assert e["a"].residency == "cold" and e["b"].residency == "resident"
    finally:
        for m in e.values():
            await m.shutdown()


async def test_a_pinned_model_is_kept_until_a_load_has_waited_past_the_patience() -> None:
    e = host_of(10, "a", "b", pin_patience_s=0.3)  # room for one
    for m in e.values():
        await m.start()
    try:
        await run(e["a"], request("r1"))
        e["a"].host.pinned = ["a"]
        t0 = asyncio.get_running_loop().time()
        out = await run(e["b"], request("r2", pinned=["a"]))
        assert out[-1].finish_reason == "length"
        assert asyncio.get_running_loop().time() - t0 >= 0.3  # a stayed while the pin was honoured
        assert e["a"].residency == "cold" and e["b"].residency == "resident"
    finally:
        for m in e.values():
            await m.shutdown()


async def test_idle_models_unload_a_failed_load_fails_its_request_and_aborts_reach_waiters() -> None:
    e = host_of(20, "a", "b", idle_unload_s=0.2)
    for m in e.values():
        await m.start()
    try:
        await run(e["a"], request("r1"))
        assert e["a"].residency == "resident"
        await eventually(lambda: e["a"].residency == "cold", what="a unloaded")  # scaled to zero

        def broken() -> SimEngine:
            raise RuntimeError("weights missing")

        e["b"]._factory = broken
        e["b"].inner = SimEngine(model="b", profile="tiny-test", speed=SPEED)
        e["b"].inner.start = broken  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError):
            e["b"]._factory()
        out = await run(e["b"], request("r2"))
        assert out[-1].finish_reason == "error" and "loading b failed" in (out[-1].error or "")
        assert (await run(e["a"], request("r3")))[-1].finish_reason == "length"  # the host serves on
        # an abort reaches a request waiting for its load
        e2 = host_of(20, "x", load_s=0.5)
        await e2["x"].start()
        task = asyncio.create_task(run(e2["x"], request("w1")))
        await asyncio.sleep(0.05)
        await e2["x"].abort("w1")
        assert (await task)[-1].finish_reason == "abort"
        await e2["x"].shutdown()
    finally:
        e["b"]._factory = lambda: SimEngine(model="b", profile="tiny-test", speed=SPEED)
        for m in e.values():
            await m.shutdown()


# ---- the router ----------------------------------------------------------------------------
def hosted(view: FleetView, wid: str, model: str, host: str, residency: str, *, busy: int = 0, idle_s: float = 0.0,
           queued: int = 0, load_s: float = 2.0) -> None:
    view.update_worker(WorkerInfo(worker_id=wid, model=model, engine="sim", state="ready", block_size=16,
                                  host_id=host, host_memory_gib=20, footprint_gib=10, load_s=load_s), 0.0)
    view.apply_gauge(WorkerGauge(worker_id=wid, model=model, ts=1.0, running=busy, queued_prefill_tokens=queued,
                                 prefill_tokens_per_s=10_000, residency=residency, idle_s=idle_s), 0.0)


def query(rid: str, model: str) -> RouteQuery:
    return RouteQuery.of(rid, model, [40 + i for i in range(64)], max_tokens=8)


def test_the_router_prices_loads_and_never_evicts_a_pinned_or_busy_model() -> None:
    view = FleetView()
    # host h1 holds a and b; h2 holds c and is half empty; each may hold a, b, c or d
    for m, state1, state2 in (("a", "resident", "cold"), ("b", "resident", "cold"), ("c", "cold", "resident"),
                              ("d", "cold", "cold")):
        hosted(view, f"h1-{m}", m, "h1", state1, idle_s=30 if m == "a" else 5)
        hosted(view, f"h2-{m}", m, "h2", state2, idle_s=1)
    router = Router(view, RouterConfig(default=PolicyConfig(policy="prefix"), pin_top=1))
    d = router.decide(query("r1", "a"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id == "h1-a" and d.load_tokens == 0  # resident: no load
    # d is cold everywhere: h2 has room (a load without an eviction) and wins over h1 (must evict)
    costs = swap_costs([w for w in view.pool("d") or []], view, [])
    assert costs.costs == {"h1-d": pytest.approx(2.0 * 10_000 * 1.5), "h2-d": pytest.approx(2.0 * 10_000)}
    d = router.decide(query("r2", "d"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id == "h2-d" and d.load_tokens == pytest.approx(20_000)
    # with h2 full of busy work, d goes to h1, which evicts a model: b pinned, so a would go
    hosted(view, "h2-d", "d", "h2", "cold")
    hosted(view, "h2-c", "c", "h2", "resident", busy=3)
    view.update_worker(WorkerInfo(worker_id="h2-c", model="c", engine="sim", state="ready", block_size=16, host_id="h2",
                                  host_memory_gib=10, footprint_gib=10, load_s=2.0), 0.0)
    view.update_worker(WorkerInfo(worker_id="h2-d", model="d", engine="sim", state="ready", block_size=16, host_id="h2",
                                  host_memory_gib=10, footprint_gib=10, load_s=2.0), 0.0)
    costs = swap_costs([w for w in view.pool("d") or []], view, ["b"])
    # c is busy: h2 makes room only once c's requests end (c then takes no new work)
    assert costs.blocked == frozenset() and costs.costs["h2-d"] == pytest.approx(2.0 * 10_000 * 1.5 * 2)
    assert swap_costs([w for w in view.pool("d") or []], view, ["c"]).blocked == frozenset({"h2-d"})  # c pinned
    for _ in range(5):
        router.commit(RouteDecision("x", "b", "h1-b", "prefix", 0, 0.0, 64, 72), 1.0)
    assert router.pinned(1.0) == ["b"]
    d = router.decide(query("r3", "d"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id == "h1-d" and d.pinned_models == ("b",)
    # every candidate blocked: the request still goes somewhere (it waits there), priced high
    hosted(view, "h1-a", "a", "h1", "resident", busy=1)
    hosted(view, "h1-b", "b", "h1", "resident", busy=1)
    d = router.decide(query("r4", "d"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id in ("h1-d", "h2-d")


def test_a_pinned_model_is_kept_on_one_host_and_loads_queue_behind_a_hosts_load() -> None:
    view = FleetView()
    for host in ("h1", "h2"):
        hosted(view, f"{host}-a", "a", host, "resident", idle_s=100)
        hosted(view, f"{host}-b", "b", host, "cold")
    hosted(view, "h3-a", "a", "h3", "cold")
    hosted(view, "h3-b", "b", "h3", "cold")
    hosted(view, "h3-c", "c", "h3", "loading")
    pool_b = list(view.pool("b") or [])
    costs = swap_costs(pool_b, view, ["a"])
    assert costs.pins == {"h1": ("a",)}  # a's copy on h2 may go
    # h1 and h2 have room for b beside a; h3 must first finish loading c (2 s, its gauge says 0 left: placements none)
    assert costs.costs["h1-b"] == costs.costs["h2-b"] == pytest.approx(2.0 * 10_000)
    hosted(view, "h3-c", "c", "h3", "cold", queued=64)  # requests wait for c: a load is due there
    view.apply_gauge(WorkerGauge(worker_id="h3-c", model="c", ts=2.0, waiting=1, queued_prefill_tokens=64,
                                 prefill_tokens_per_s=10_000, residency="cold"), 0.0)
    costs = swap_costs(pool_b, view, ["a"])
    assert costs.costs["h3-b"] == pytest.approx((2.0 + 2.0) * 10_000)  # behind c's whole load


def test_a_cold_replica_takes_traffic_once_the_resident_ones_queue_more_than_a_load() -> None:
    view = FleetView()
    hosted(view, "h1-a", "a", "h1", "resident", queued=5_000)
    hosted(view, "h2-a", "a", "h2", "cold", load_s=1.0)
    router = Router(view, RouterConfig(default=PolicyConfig(policy="prefix", balance_factor=0)))
    d = router.decide(query("r1", "a"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id == "h1-a"  # 5k queued < a 10k-token load
    hosted(view, "h1-a", "a", "h1", "resident", queued=20_000)
    d = router.decide(query("r2", "a"), 1.0)
    assert isinstance(d, RouteDecision) and d.worker_id == "h2-a"  # the hot model spreads


# ---- the command line --------------------------------------------------------------------
def test_serve_worker_host_models_builds_one_entry_per_model_sharing_one_host() -> None:
    import argparse

    from services.worker.main import add_arguments, host_engines

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--host-models", "small=8,big=30", "--host-memory-gib", "40", "--load-gb-per-s", "2",
                              "--load-overhead-s", "1", "--speed", "10", "--worker-id", "gpu0", "--preload", "small"])
    entries = dict(host_engines(args))
    assert list(entries) == ["gpu0-small", "gpu0-big"]
    small, big = entries["gpu0-small"], entries["gpu0-big"]
    assert small.host is big.host and small.host.memory_gib == 40
    assert small.hosting == {"host_id": "gpu0", "host_memory_gib": 40.0, "footprint_gib": 8.0,
                             "load_s": pytest.approx((8 * (1 << 30) / 2e9 + 1) / 10)}
    assert small.preload and not big.preload and small.model == "small"
    for bad in (["--host-models", "a,a"], ["--host-models", "a=x"], ["--host-models", "a=50", "--host-memory-gib", "40"],
                ["--host-models", "a", "--preload", "b"], ["--host-models", "a", "--load-gb-per-s", "0"]):
        with pytest.raises(SystemExit):
            host_engines(parser.parse_args(bad))


def test_a_pool_counts_its_hot_swap_members_as_they_come_and_go() -> None:
    view = FleetView()
    hosted(view, "h1-a", "a", "h1", "resident")
    view.update_worker(WorkerInfo(worker_id="d1", model="a", engine="sim", state="ready"), 0.0)
    pool = view.pool("a")
    assert pool is not None and pool.hosted == 1
    hosted(view, "h1-a", "a", "h1", "resident")  # a heartbeat changes nothing
    assert pool.hosted == 1
    view.remove_worker("h1-a")
    assert pool.hosted == 0


def test_by_default_the_models_asked_for_once_per_load_time_are_pinned_up_to_the_slots() -> None:
    view = FleetView()
    for host in ("h1", "h2"):  # 2 hosts of 2 slots (20 GiB, 10 each): 4 slots
        for m in ("a", "b", "c", "d", "e", "f"):
            hosted(view, f"{host}-{m}", m, host, "cold", load_s=2.0)
    router = Router(view, RouterConfig(default=PolicyConfig(policy="prefix")))
    window = router.demand.window_s
    for model, per_s in (("a", 3.0), ("b", 2.0), ("c", 1.0), ("d", 0.7), ("e", 0.6), ("f", 0.1)):
        for _ in range(int(per_s * window)):
            router.demand.add(model, 0.0)
    # every model asked for at least once per 2 s is due; the slots (4) cap the pins
    assert router.pinned(0.0) == ["a", "b", "c", "d"]
    router.demand = Demand(window)
    for _ in range(int(0.2 * window)):
        router.demand.add("a", 0.0)
    assert router.pinned(0.0) == []  # a quiet model is not pinned
    assert Router(view, RouterConfig(pin_top=0)).pinned(0.0) == []  # plain LRU
