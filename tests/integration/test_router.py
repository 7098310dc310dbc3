"""The router service on a real nats-server, with sim workers (and a gateway) in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from ops.keys import create_key
from proto import (
    SUPERSEDED,
    CancelRequest,
    ControlCommand,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    MeshError,
    Placement,
    RemoteError,
    RouteRequest,
    SamplingParams,
    TokenChunk,
    UsageEvent,
    pack_tokens,
)
from services.common.fleet import FleetConfig
from services.gateway.service import GatewayConfig, GatewayService
from services.gateway.upstream import UpstreamConfig
from services.router.policy import PolicyConfig, RouterConfig
from services.router.service import RouterService, RouterServiceConfig
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually

MODEL = "sim-llama-8b"



class Chunks:
    """Token chunks of the test's requests (gateway id ``test-gw``)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self.done: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def start(self) -> Chunks:
        await self.bus.subscribe(self.bus.subjects.tokens_of_gateway("test-gw"), TokenChunk, self._on)
        return self

    async def _on(self, chunk: TokenChunk, msg: Msg) -> None:
        self.chunks[chunk.request_id].append(chunk)
        if chunk.finish_reason is not None:
            self.done[chunk.request_id].set()

    async def final(self, request_id: str, timeout: float = 20.0) -> TokenChunk:
        await asyncio.wait_for(self.done[request_id].wait(), timeout)
        return self.chunks[request_id][-1]


def generate(bus: Bus, request_id: str, prompt: list[int], max_tokens: int = 4, model: str = MODEL) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, model=model, prompt=pack_tokens(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1),
        token_subject=bus.subjects.tokens("test-gw", request_id), org="org", key_id="k",
    )


async def route(bus: Bus, request: GenerateRequest, timeout: float = 10.0) -> Placement:
    return await bus.request(bus.subjects.router_route, RouteRequest(request=request), Placement, timeout=timeout)


def long_prompt(seed: int, tokens: int = 1024) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(tokens)]


WorkerFactory = Callable[..., Awaitable[WorkerService]]
RouterFactory = Callable[..., Awaitable[RouterService]]


@pytest.fixture
async def start_worker(bus_settings: BusSettings) -> AsyncIterator[WorkerFactory]:
    started: list[WorkerService] = []

    async def start(worker_id: str, *, prepare: Callable[[WorkerService], None] | None = None, region: str = "",
                    **engine: object) -> WorkerService:
        """``prepare``: change the worker before it starts (its endpoints bind its handlers then)."""
        options: dict[str, object] = {"speed": 50.0, "max_model_len": 8192, "num_kv_blocks": 4096}
        options.update(engine)
        service = WorkerService(
            SimEngine(model=MODEL, **options),  # type: ignore[arg-type]
            WorkerConfig(worker_id=worker_id, gauge_interval_s=0.05, drain_timeout_s=5, region=region),
            bus_settings,
        )
        if prepare is not None:
            prepare(service)
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        if not service.stopped.is_set():
            await service.drain_and_close()


@pytest.fixture
async def start_router(bus_settings: BusSettings) -> AsyncIterator[RouterFactory]:
    started: list[RouterService] = []

    async def start(policy: str = "prefix", *, view: FleetConfig | None = None, **router: object) -> RouterService:
        config = RouterServiceConfig(
            router=RouterConfig(default=PolicyConfig(policy=policy), **router),  # type: ignore[arg-type]
            view=view or FleetConfig(), seed=3, maintenance_interval_s=0.1,
        )
        service = RouterService(config, bus_settings)
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        if not service.stopped.is_set():
            await service.drain_and_close()


async def placeable(router: RouterService, n: int) -> None:
    await eventually(lambda: router.stats()["placeable"] == n, what=f"{n} placeable workers")


async def test_prefix_policy_sends_a_repeated_prompt_to_the_worker_that_cached_it(
    bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory
) -> None:
    workers = {wid: await start_worker(wid) for wid in ("w1", "w2", "w3")}
    router = await start_router("prefix")
    await placeable(router, 3)
    chunks = await Chunks(bus).start()
    for k in range(3):  # three documents: the holder is not luck
        prompt = long_prompt(k)
        first = await route(bus, generate(bus, f"a{k}", prompt))
        assert first.policy == "prefix" and first.cached_tokens == 0
        await chunks.final(f"a{k}")
        holder = router.view.worker(first.worker_id)
        assert holder is not None
        # Its KV events are in, and a gauge says it is idle again (a gauge taken while it
        # prefilled would rightly make it look busier than an empty worker).
        await eventually(lambda h=holder: len(h.blocks) >= 64 and h.outstanding_tokens == 0,  # type: ignore[misc]
                         what="the first request's KV events and an idle gauge")
        again = await route(bus, generate(bus, f"b{k}", [*prompt, 7, 8, 9]))
        assert again.worker_id == first.worker_id
        assert again.cached_tokens == 1024  # every full block of the shared part
        final = await chunks.final(f"b{k}")
        assert final.usage is not None and final.usage.cached_tokens >= 1024 - 16
    hit_rates = {wid: w.engine.stats().prefix_hit_rate for wid, w in workers.items()}
    assert max(hit_rates.values()) > 0
    stats = router.stats()
    assert stats["placements"] == 6 and stats["prefix_hit_tokens"] == 3 * 1024
    assert sum(stats["placements_by_worker"].values()) == 6


async def test_draining_workers_get_nothing(bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory) -> None:
    for wid in ("w1", "w2", "w3"):
        await start_worker(wid)
    router = await start_router("round_robin")
    await placeable(router, 3)
    reply = await bus.request(bus.subjects.worker_control("w2"), ControlCommand(command="drain", timeout_s=30), ControlReply)
    assert reply.state == "draining"
    await placeable(router, 2)
    chunks = await Chunks(bus).start()
    placements = [await route(bus, generate(bus, f"r{i}", long_prompt(i, 64))) for i in range(12)]
    assert {p.worker_id for p in placements} == {"w1", "w3"}
    for p in placements:
        await chunks.final(p.request_id)
    assert router.stats()["retries"] == 0  # skipped, not tried and refused


@pytest.mark.parametrize("refusal", ["draining", "no_responders"])
async def test_a_refusing_worker_costs_one_retry_elsewhere(
    bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory, refusal: str
) -> None:
    w1 = await start_worker("w1")
    w2 = await start_worker("w2")
    router = await start_router("round_robin")
    await placeable(router, 2)
    # w1 goes bad without the router hearing of it: its heartbeat and gauges stop first.
    for task in w1._loops:
        task.cancel()
    if refusal == "draining":
        w1.state = "draining"  # answers generate with a retryable DRAINING error
    else:
        await w1.stop_endpoints()  # nobody listens on its generate subject
    chunks = await Chunks(bus).start()
    placements = [await route(bus, generate(bus, f"r{i}", long_prompt(i, 64))) for i in range(4)]
    assert {p.worker_id for p in placements} == {"w2"}
    for p in placements:
        assert (await chunks.final(p.request_id)).finish_reason == "length"
    assert router.stats()["retries"] >= 1
    # both refuse: a typed, retryable error
    for task in w2._loops:
        task.cancel()
    w2.state = "draining"
    with pytest.raises(RemoteError) as info:
        await route(bus, generate(bus, "nope", long_prompt(9, 64)))
    assert info.value.code is ErrorCode.NO_CAPACITY


async def test_unknown_model_is_not_retryable(bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory) -> None:
    await start_worker("w1")
    router = await start_router("prefix")
    await placeable(router, 1)
    with pytest.raises(RemoteError) as info:
        await route(bus, generate(bus, "x", [1, 2, 3], model="no-such-model"))
    assert info.value.code is ErrorCode.UNKNOWN_MODEL


async def test_a_router_started_late_resyncs_the_index_from_snapshots(
    bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory
) -> None:
    """KV batches published before the router existed are a gap: it asks for a snapshot."""
    await start_worker("w1")
    await start_worker("w2")
    chunks = await Chunks(bus).start()
    prompt = long_prompt(42)
    reply = await bus.request(bus.subjects.worker_generate("w2"), generate(bus, "warm", prompt), ControlReply)
    assert reply.worker_id == "w2"
    await chunks.final("warm")
    router = await start_router("prefix")
    await placeable(router, 2)
    w2 = router.view.worker("w2")
    assert w2 is not None
    await eventually(lambda: len(w2.blocks) >= 64 and not w2.needs_resync, what="the snapshot of w2")
    assert router.stats()["resyncs_applied"] >= 1
    placement = await route(bus, generate(bus, "again", prompt))
    assert placement.worker_id == "w2" and placement.cached_tokens == 1024
    await chunks.final("again")


async def test_a_silent_worker_is_expired(bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory) -> None:
    w1 = await start_worker("w1")
    await start_worker("w2")
    router = await start_router("round_robin", view=FleetConfig(stale_after_s=0.5))
    await placeable(router, 2)
    for task in w1._loops:  # hung: no heartbeat, no gauge (its registry entry outlives it)
        task.cancel()
    await eventually(lambda: "w1" not in router.view, what="w1 expired")
    chunks = await Chunks(bus).start()
    placements = [await route(bus, generate(bus, f"r{i}", long_prompt(i, 32))) for i in range(4)]
    assert {p.worker_id for p in placements} == {"w2"}
    for p in placements:
        await chunks.final(p.request_id)


async def test_alias_is_rewritten_to_the_pool_model(bus: Bus, start_worker: WorkerFactory, start_router: RouterFactory) -> None:
    await start_worker("w1")
    router = await start_router("least_load", aliases={"fast": MODEL})
    await placeable(router, 1)
    chunks = await Chunks(bus).start()
    placement = await route(bus, generate(bus, "al", long_prompt(1, 40), model="fast"))
    assert placement.model == MODEL and placement.worker_id == "w1"
    # the worker only serves MODEL: it took the request, so the model was rewritten
    assert (await chunks.final("al")).finish_reason == "length"


async def test_the_gateway_places_through_the_router(
    bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory, start_router: RouterFactory
) -> None:
    for wid in ("w1", "w2"):
        await start_worker(wid)
    router = await start_router("prefix")
    await placeable(router, 2)
    gateway = GatewayService(GatewayConfig(port=0), bus_settings)
    await gateway.start()
    try:
        key, _ = await create_key(bus, org="acme")
        text = "The quick brown fox jumps over the lazy dog. " * 40
        body = {"model": MODEL, "prompt": text, "max_tokens": 5, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {key}"}
        url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            for _ in range(50):  # the gateway's key watcher sees the new key
                async with http.post(url, json=body, headers=headers) as r:
                    status, first = r.status, await r.json()
                if status != 401:
                    break
                await asyncio.sleep(0.05)
            assert status == 200, first
            pool = router.view.pool(MODEL)
            assert pool is not None
            await eventually(lambda: any(len(w.blocks) >= 16 and w.outstanding_tokens == 0 for w in pool),
                             what="KV events and an idle gauge")
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 200
                second = await r.json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert router.stats()["placements"] == 2 and router.stats()["prefix_hit_tokens"] > 0
        assert router.stats()["prompts_hashed_by_gateway"] == 2  # the router hashed neither prompt
        assert gateway.upstream.direct_placements == 0
    finally:
        await gateway.drain_and_close()


async def test_stats_over_nats_micro(bus: Bus, start_router: RouterFactory) -> None:
    """``$SRV.STATS`` carries the router's own figures (``meshserve status`` reads them)."""
    await start_router("session")
    msg = await bus.nc.request("$SRV.STATS.meshserve-router", b"", timeout=2)
    data = json.loads(msg.data)
    assert data["name"] == "meshserve-router"
    figures = data["endpoints"][0]["data"]
    assert figures["placements"] == 0 and figures["workers"] == 0 and "prefix_hit_rate" in figures


async def test_prometheus_metrics(bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory) -> None:
    await start_worker("w1")
    router = RouterService(RouterServiceConfig(metrics_port=0, maintenance_interval_s=0.1), bus_settings)
    await router.start()
    try:
        await placeable(router, 1)
        chunks = await Chunks(bus).start()
        placement = await route(bus, generate(bus, "m1", long_prompt(3, 64)))
        await chunks.final(placement.request_id)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{router.metrics_port}/metrics") as r:
            text = await r.text()
        assert 'meshserve:router_placements_total{model="sim-llama-8b",policy="prefix",worker="w1"} 1.0' in text
        assert 'meshserve:router_prompt_tokens_total{model="sim-llama-8b"} 64.0' in text
        assert "meshserve:router_decision_seconds_count 1.0" in text
        assert 'meshserve:router_workers{state="placeable"} 1.0' in text
    finally:
        await router.drain_and_close()


Post = Callable[[dict[str, Any]], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


@contextlib.asynccontextmanager
async def http_gateway(bus: Bus, bus_settings: BusSettings, *, region: str = "", regions: list[str] | None = None,
                       **upstream: Any) -> AsyncIterator[tuple[GatewayService, Post]]:
    """A gateway (``upstream``: its ``UpstreamConfig``; ``region``: its own) and a completions
    POST with a new key (``regions``: the key's)."""
    gateway = GatewayService(GatewayConfig(port=0, region=region, upstream=UpstreamConfig(**upstream)), bus_settings)
    await gateway.start()
    try:
        key, _ = await create_key(bus, org="acme", regions=regions)
        headers = {"Authorization": f"Bearer {key}"}
        url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            async def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                for _ in range(50):  # the gateway's key watcher sees the new key
                    async with http.post(url, json=body, headers=headers) as r:
                        status, data = r.status, await r.json()
                    if status != 401:
                        break
                    await asyncio.sleep(0.05)
                return status, data

            yield gateway, post
    finally:
        await gateway.drain_and_close()


def count_runs(worker: WorkerService, runs: list[tuple[str, str]], hold: asyncio.Event | None = None) -> None:
    """Record (worker, request) for each request ``worker`` runs (``hold``: output waits for it)."""
    run = worker._stream

    async def counted(request: GenerateRequest, prompt: list[int], span: Any) -> None:
        runs.append((worker.worker_id, request.request_id))
        if hold is not None:
            await hold.wait()
        await run(request, prompt, span)

    worker._stream = counted  # type: ignore[method-assign]


@pytest.mark.parametrize("stall", ["before_forwarding", "after_forwarding", "after_forwarding_no_output_yet"])
async def test_a_router_that_never_answers_neither_loses_nor_doubles_the_request(
    bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory, start_router: RouterFactory, stall: str
) -> None:
    """A stalled router (SIGSTOP in the chaos soak) gives the gateway no placement. Past the
    request's ``place_by`` the gateway adopts the worker it was forwarded to (its chunks
    arrived, or a probe finds it holding the request) or places it itself; the router,
    waking up, forwards nothing, and no worker would take it."""
    runs: list[tuple[str, str]] = []
    output = asyncio.Event()  # the worker's output waits for it (the probe finds the request)
    for wid in ("w1", "w2"):
        await start_worker(wid, prepare=lambda w: count_runs(w, runs, output if stall.endswith("no_output_yet") else None))
    router = await start_router("round_robin")
    await placeable(router, 2)
    forward = router._forward
    wake = asyncio.Event()
    late_forward: list[str] = []  # how the router's forward ended

    async def stalled(decision: Any, request: GenerateRequest) -> None:
        if stall == "before_forwarding":
            await wake.wait()
        try:
            await forward(decision, request)
        except MeshError as exc:
            late_forward.append(exc.code.value)
            raise
        late_forward.append("forwarded")
        if stall != "before_forwarding":
            await wake.wait()  # never answers the gateway (until the test ends)

    router._forward = stalled  # type: ignore[method-assign]
    async with http_gateway(bus, bus_settings, route_timeout_s=1.0) as (gateway, post):
        body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 8,
                "ignore_eos": True}
        answer = asyncio.create_task(post(body))
        if not output.is_set() and stall.endswith("no_output_yet"):
            await eventually(lambda: gateway.upstream.adopted_placements > 0 or answer.done(), what="the adoption")
            output.set()
        status, data = await answer
        wake.set()  # the router wakes up
        await eventually(lambda: bool(late_forward), what="the router's late forward to end")
        assert status == 200, data
        assert data["usage"]["completion_tokens"] == 8 and data["choices"][0]["finish_reason"] == "length"
        assert len(runs) == 1, runs  # one worker ran it, once
        assert gateway.upstream.router_timeouts == 1
        if stall == "before_forwarding":
            assert late_forward == ["timeout"]  # past place_by: not forwarded
            assert gateway.upstream.direct_placements == 1 and gateway.upstream.adopted_placements == 0
        else:
            assert late_forward == ["forwarded"]
            assert gateway.upstream.adopted_placements == 1 and gateway.upstream.direct_placements == 0


async def test_a_worker_refuses_a_request_past_its_placement_deadline(bus: Bus, start_worker: WorkerFactory) -> None:
    runs: list[tuple[str, str]] = []
    await start_worker("w1", prepare=lambda w: count_runs(w, runs))
    late = msgspec.structs.replace(generate(bus, "late", [1, 2, 3]), place_by=time.time() - 1)
    with pytest.raises(RemoteError) as info:
        await bus.request(bus.subjects.worker_generate("w1"), late, ControlReply)
    assert info.value.code is ErrorCode.TIMEOUT and info.value.retryable
    chunks = await Chunks(bus).start()
    in_time = msgspec.structs.replace(generate(bus, "in-time", [1, 2, 3]), place_by=time.time() + 60)
    await bus.request(bus.subjects.worker_generate("w1"), in_time, ControlReply)
    assert (await chunks.final("in-time")).finish_reason == "length"
    assert runs == [("w1", "in-time")]


@pytest.mark.parametrize("refusal", [ErrorCode.DRAINING, ErrorCode.OVERLOADED, ErrorCode.TIMEOUT])
async def test_direct_placement_moves_on_from_a_refusing_worker(
    bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory, refusal: ErrorCode
) -> None:
    """No router: a worker that answers draining, overloaded or timeout (past ``place_by``)
    started nothing; the gateway places the request on the next worker."""
    refused: list[str] = []

    async def refuse(request: GenerateRequest, msg: Msg) -> None:
        refused.append(request.request_id)
        raise MeshError(f"w1 says {refusal.value}", code=refusal)

    await start_worker("w1", prepare=lambda w: setattr(w, "handle_generate", refuse))
    await start_worker("w2")
    async with http_gateway(bus, bus_settings) as (gateway, post):
        await eventually(lambda: len(gateway.registry.ready_workers(MODEL)) == 2, what="both workers in the registry")
        for i in range(4):  # round robin: w1 is asked first at least once
            status, data = await post({"model": MODEL, "prompt": f"request {i}", "max_tokens": 3, "ignore_eos": True})
            assert status == 200, data
            assert data["usage"]["completion_tokens"] == 3
        assert refused and gateway.upstream.direct_placements == 4


async def test_direct_placement_keeps_home_and_the_keys_regions(
    bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory
) -> None:
    """No router (DESIGN.md, Regions): the gateway places in its own region while a worker
    there is ready, and never outside the key's regions."""
    runs: list[tuple[str, str]] = []
    for wid, region in (("w-eu", "eu"), ("w-us", "us")):
        count_runs(await start_worker(wid, region=region), runs)
    async with http_gateway(bus, bus_settings, region="eu") as (gateway, post):
        await eventually(lambda: len(gateway.registry.ready_workers(MODEL)) == 2, what="both workers in the registry")
        for i in range(4):
            status, data = await post({"model": MODEL, "prompt": f"home {i}", "max_tokens": 2, "ignore_eos": True})
            assert status == 200, data
    assert {wid for wid, _ in runs} == {"w-eu"}, runs
    async with http_gateway(bus, bus_settings, region="eu", regions=["us"]) as (gateway, post):
        await eventually(lambda: len(gateway.registry.ready_workers(MODEL)) == 2, what="both workers in the registry")
        for i in range(2):
            status, data = await post({"model": MODEL, "prompt": f"held {i}", "max_tokens": 2, "ignore_eos": True})
            assert status == 200, data
    assert [wid for wid, _ in runs[4:]] == ["w-us", "w-us"], runs
    async with http_gateway(bus, bus_settings, region="eu", regions=["ap"]) as (gateway, post):
        await eventually(lambda: len(gateway.registry.ready_workers(MODEL)) == 2, what="both workers in the registry")
        status, data = await post({"model": MODEL, "prompt": "nowhere", "max_tokens": 2})
        assert status == 503 and "region ap" in data["error"]["message"], data
    assert len(runs) == 6


async def test_a_superseded_copy_is_refused_or_stops_and_streams_and_bills_nothing(
    bus: Bus, start_worker: WorkerFactory
) -> None:
    """A copy its placer gave up on (the router's timed-out forward): refused when its cancel
    comes first, stopped when running, with no final chunk and no usage either way (the copy
    that runs on reports the request); a later segment of the request is no stale copy."""
    finals: list[tuple[str, int]] = []  # (request, segment) of each final chunk published
    billed: list[tuple[str, int]] = []  # (request, segment) of each usage event

    def spy(w: WorkerService) -> None:
        publish_chunk, publish_usage = w._publish_chunk, w._publish_usage

        async def chunk(request: GenerateRequest, chunk: TokenChunk, *, ack: bool = False) -> None:
            if chunk.finish_reason is not None:
                finals.append((request.request_id, request.migrations))
            await publish_chunk(request, chunk, ack=ack)

        def usage(request: GenerateRequest, event: UsageEvent) -> None:
            billed.append((request.request_id, request.migrations))
            publish_usage(request, event)

        w._publish_chunk = chunk  # type: ignore[method-assign]
        w._publish_usage = usage  # type: ignore[method-assign]

    worker = await start_worker("w1", speed=20.0, prepare=spy)
    chunks = await Chunks(bus).start()

    async def send(request: GenerateRequest) -> ControlReply:
        return await bus.request(bus.subjects.worker_generate("w1"), request, ControlReply)

    async def supersede(request_id: str, migrations: int = 0) -> ControlReply:
        return await bus.request(bus.subjects.worker_cancel("w1"), CancelRequest(
            request_id=request_id, reason=SUPERSEDED, migrations=migrations), ControlReply)

    def segment(request_id: str, migrations: int, max_tokens: int) -> GenerateRequest:
        return msgspec.structs.replace(generate(bus, request_id, long_prompt(len(request_id), 64), max_tokens),
                                       migrations=migrations, first_seq=100 * migrations)

    # its cancel came first: refused; a later segment of it is not that copy
    assert (await supersede("early")).message == "unknown request"
    with pytest.raises(RemoteError) as info:
        await send(segment("early", 0, 3))
    assert info.value.code is ErrorCode.CANCELLED
    await send(segment("early", 1, 3))
    assert (await chunks.final("early")).finish_reason == "length"

    # running when its cancel comes: it stops, without a final chunk or usage
    await send(segment("running", 0, 400))
    await eventually(lambda: bool(chunks.chunks["running"]), what="the copy's first chunk")
    assert (await supersede("running")).message == "superseded"
    await eventually(lambda: "running" not in worker._requests, what="the stale copy to stop")

    # a later segment arriving while a stale copy runs: the copy stops, the segment runs
    await send(segment("moved", 0, 400))
    await eventually(lambda: bool(chunks.chunks["moved"]), what="the first segment's first chunk")
    await send(segment("moved", 1, 3))
    final = await chunks.final("moved")
    assert final.finish_reason == "length" and final.seq >= 100

    assert finals == [("early", 1), ("moved", 1)]
    # The usage event goes out once the final chunk is stored, a moment after the client saw it.
    await eventually(lambda: len(billed) >= 2, what="the moved request's usage event")
    assert billed == [("early", 1), ("moved", 1)]
