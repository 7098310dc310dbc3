"""The admission service on a real nats-server: quotas through the gateway, reconciliation
from USAGE, SLO shedding order on an overloaded sim worker, fail-open/closed, leader lease."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
import openai
import pytest
from nats.aio.msg import Msg

from bus import Bus, BusSettings
from bus.client import error_reply_headers
from bus.keys import KeyStore
from ops.keys import create_key
from proto import (
    SUPERSEDED,
    AdmissionDecision,
    AdmissionRequest,
    CancelRequest,
    Placement,
    PoolDemand,
    RouteRequest,
    UsageEvent,
    decode,
    usage_dedup_id,
)
from services.admission.buckets import LimiterConfig
from services.admission.config import AdmissionConfig
from services.admission.service import AdmissionService
from services.gateway.apikeys import generate_key
from services.gateway.service import GatewayConfig, GatewayService
from services.gateway.upstream import UpstreamConfig
from services.router.service import RouterService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually, usage_events

MODEL = "sim-llama-8b"



class FrozenClock:
    """Wall clock for the buckets that only moves when told: no refill during a test."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


Factory = Callable[..., Awaitable[object]]


@pytest.fixture
async def mesh(bus_settings: BusSettings) -> AsyncIterator[dict[str, Callable[..., Awaitable[object]]]]:
    """Starters for in-process services; everything is stopped at the end (crashed ones too)."""
    started: list[object] = []

    async def worker(worker_id: str, **engine: object) -> WorkerService:
        options: dict[str, object] = {"speed": 50.0, "max_model_len": 8192, "num_kv_blocks": 4096}
        options.update(engine)
        w = WorkerService(SimEngine(model=MODEL, **options),  # type: ignore[arg-type]
                          WorkerConfig(worker_id=worker_id, gauge_interval_s=0.05, drain_timeout_s=10), bus_settings)
        await w.start()
        started.append(w)
        return w

    async def admission(config: AdmissionConfig | None = None, **kw: object) -> AdmissionService:
        a = AdmissionService(config or AdmissionConfig(), bus_settings, **kw)  # type: ignore[arg-type]
        await a.start()
        started.append(a)
        return a

    async def gateway(config: GatewayConfig | None = None) -> GatewayService:
        g = GatewayService(config or GatewayConfig(port=0), bus_settings)
        await g.start()
        started.append(g)
        return g

    async def router() -> RouterService:
        r = RouterService(settings=bus_settings)
        await r.start()
        started.append(r)
        return r

    yield {"worker": worker, "admission": admission, "gateway": gateway, "router": router}
    for service in reversed(started):
        if getattr(service, "crashed", False):
            with contextlib.suppress(Exception):
                await service.on_stop()  # type: ignore[attr-defined]
        elif not service.stopped.is_set():  # type: ignore[attr-defined]
            await service.drain_and_close()  # type: ignore[attr-defined]


async def wait_for_key(gateway: GatewayService, key_id: str) -> None:
    await eventually(lambda: key_id in gateway.keys.records, what="the gateway to see the new key")


def crash(service: AdmissionService) -> Awaitable[None]:
    """Like a kill -9: its loops stop and its connection drops, nothing is handed over."""
    service.crashed = True  # type: ignore[attr-defined]
    for task in service._loops:
        task.cancel()
    return service.bus.nc.close()


# ---- quota through the gateway ----------------------------------------------------------


async def test_quota_429_with_retry_after_through_the_gateway(bus: Bus, mesh: dict[str, Factory]) -> None:
    await mesh["worker"]("w1")
    clock = FrozenClock()
    admission = await mesh["admission"](clock=clock)
    gateway = await mesh["gateway"]()
    key, record = await create_key(bus, org="acme", tpm=250)
    await wait_for_key(gateway, record.key_id)  # type: ignore[arg-type]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key, max_retries=0)  # type: ignore[attr-defined]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "extra_body": {"ignore_eos": True}}
    for _ in range(2):  # each reserves prompt + 100 of the 250-token bucket
        done = await client.completions.create(**body)  # type: ignore[call-overload]
        assert done.usage is not None and done.usage.completion_tokens == 100
    with pytest.raises(openai.RateLimitError) as info:
        await client.completions.create(**body)  # type: ignore[call-overload]
    retry_after = float(info.value.response.headers["retry-after"])
    # the deficit over the refill rate (250 tokens a minute): several seconds, not a guess
    assert 1.0 < retry_after <= 60.0
    assert admission.stats()["rejected"] == {"quota_tokens": 1}  # type: ignore[attr-defined]
    await client.close()


async def test_a_keys_requests_in_flight_are_capped_through_the_gateway(bus: Bus, mesh: dict[str, Factory]) -> None:
    await mesh["worker"]("w1", speed=1.0)  # a 200-token stream takes seconds
    admission = await mesh["admission"]()
    gateway = await mesh["gateway"]()
    key, record = await create_key(bus, org="acme", max_concurrent=1)
    await wait_for_key(gateway, record.key_id)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{gateway.bound_port}/v1"  # type: ignore[attr-defined]
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        long = await client.completions.create(model=MODEL, prompt="hello", max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True})
        first = await long.__anext__()  # running
        assert first.choices
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
        assert "concurrency limit reached: the key has 1 requests in flight, its limit is 1" in info.value.message
        assert info.value.response.headers["retry-after"] == "1"
        async for _ in long:  # the stream ends: its slot is the next request's
            pass
        for _ in range(5):  # back to back: each finds the slot its predecessor freed
            done = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
            assert done.usage is not None and done.usage.completion_tokens == 3
    assert admission.stats()["rejected"] == {"quota_requests": 1}  # type: ignore[attr-defined]


async def test_a_batch_refused_midway_cancels_the_prompts_already_running(bus: Bus, mesh: dict[str, Factory]) -> None:
    worker: WorkerService = await mesh["worker"]("w1", speed=1.0)  # type: ignore[assignment]
    await mesh["admission"]()
    gateway = await mesh["gateway"]()
    key, record = await create_key(bus, org="acme", rpm=1)
    await wait_for_key(gateway, record.key_id)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{gateway.bound_port}/v1"  # type: ignore[attr-defined]
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        with pytest.raises(openai.RateLimitError):  # the second prompt is past the key's one request a minute
            await client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4000,
                                            extra_body={"ignore_eos": True})
    # The first prompt's request was cancelled, not left generating for nobody.
    stats = worker.engine.stats
    await eventually(lambda: stats().running + stats().waiting == 0 and stats().kv_blocks_used == 0,
                     what="the first prompt's request to be cancelled, its KV blocks freed")


async def test_a_batch_larger_than_its_keys_concurrency_runs_a_slot_at_a_time(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    """A batch of more prompts than the key may run at once was refused by the key's own
    limit on every try (and each try billed the prompts it had started)."""
    await mesh["worker"]("w1")
    admission: AdmissionService = await mesh["admission"]()  # type: ignore[assignment]
    gateway = await mesh["gateway"]()
    key, record = await create_key(bus, org="acme", max_concurrent=2)
    await wait_for_key(gateway, record.key_id)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{gateway.bound_port}/v1"  # type: ignore[attr-defined]
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        reply = await client.completions.create(model=MODEL, prompt=[f"prompt {i}" for i in range(7)], max_tokens=4)
    assert [c.index for c in reply.choices] == list(range(7))
    assert admission.stats()["rejected"] == {}  # type: ignore[attr-defined]


async def test_a_client_gone_during_admission_frees_its_keys_slot(bus: Bus, mesh: dict[str, Factory]) -> None:
    """A check waiting for a slot whose client gave up was admitted once the slot freed, and
    nothing ever settled it: the key's one slot stayed taken for the reservation's 15 minutes."""
    await mesh["worker"]("w1", speed=1.0)
    admission: AdmissionService = await mesh["admission"]()  # type: ignore[assignment]
    gateway = await mesh["gateway"]()
    await mesh["router"]()
    key, record = await create_key(bus, org="acme", max_concurrent=1)
    await wait_for_key(gateway, record.key_id)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{gateway.bound_port}/v1"  # type: ignore[attr-defined]
    in_flight = admission.policy.limiter.in_flight
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)  # the gateway has seen the router
        await eventually(lambda: in_flight(record.key_id) == 0, what="the warm-up's slot to be freed")
        long = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2000, stream=True,
                                               extra_body={"ignore_eos": True})
        await long.__anext__()
        waiting = asyncio.create_task(client.completions.create(model=MODEL, prompt="b", max_tokens=3))
        await eventually(lambda: admission.slot_waits == 1, what="the second request to wait for a slot")
        waiting.cancel()  # its client gives up while it waits
        await asyncio.sleep(0.02)
        await long.close()  # the first request's client goes too: the slot frees, the waiter takes it
        await eventually(lambda: in_flight(record.key_id) == 0, what="every slot of the key to be free again")
        done = await client.completions.create(model=MODEL, prompt="c", max_tokens=3)
        assert done.usage is not None and done.usage.completion_tokens == 3


async def test_a_check_at_the_concurrency_limit_waits_for_a_slot_then_is_refused(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    # A request that has just ended is settled by its usage event on USAGE, which can come
    # after the client's next request: that request waits for the slot, not a false 429.
    await mesh["worker"]("w1")
    admission: AdmissionService = await mesh["admission"](AdmissionConfig(slot_wait_s=3.0))  # type: ignore[assignment]

    def capped(i: int) -> AdmissionRequest:
        return msgspec.structs.replace(check(i), tpm_limit=None, concurrency_limit=1)

    assert (await ask(bus, capped(1))).admitted
    waiting = asyncio.create_task(ask(bus, capped(2), timeout=10))
    await eventually(lambda: admission.slot_waits == 1, what="the check to wait for a slot")
    assert not waiting.done()
    ev = UsageEvent(request_id="r1", org="org", key_id="k1", model=MODEL, prompt_tokens=10, completion_tokens=10)
    await bus.js_publish(bus.subjects.usage("org"), ev, msg_id=usage_dedup_id("r1"))
    assert (await waiting).admitted
    refused = await ask(bus, capped(3), timeout=10)  # r2 never ends: refused once the wait is over
    assert not refused.admitted and refused.reason == "quota_requests" and refused.retry_after == 1.0
    assert "its limit is 1" in refused.message
    assert (await ask(bus, capped(2))).admitted  # r2 asked again (a retried call) is the one in flight


async def test_a_key_stored_with_a_negative_limit_gets_403_and_the_others_are_served(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    # A record written past `meshserve keys create` (an old CLI, a script, a hand edit):
    # admission used to raise on it and the gateway answered 500 on every request.
    await mesh["worker"]("w1")
    admission = await mesh["admission"]()
    gateway = await mesh["gateway"]()
    bad_key, bad = generate_key(org="acme", rpm=-5, tpm=1000)
    await (await KeyStore(bus).open()).put(bad)
    good_key, good = await create_key(bus, org="acme", rpm=100)
    await wait_for_key(gateway, bad.key_id)  # type: ignore[arg-type]
    await wait_for_key(gateway, good.key_id)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{gateway.bound_port}/v1"  # type: ignore[attr-defined]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
    async with openai.AsyncOpenAI(base_url=url, api_key=bad_key, max_retries=0) as client:
        for _ in range(2):
            with pytest.raises(openai.PermissionDeniedError) as info:
                await client.completions.create(**body)  # type: ignore[call-overload]
            assert info.value.status_code == 403
            assert f"key acme/{bad.key_id} has an invalid limit: rpm -5; recreate the key" in info.value.message
    async with openai.AsyncOpenAI(base_url=url, api_key=good_key, max_retries=0) as client:
        done = await client.completions.create(**body)  # type: ignore[call-overload]
        assert done.usage is not None and done.usage.completion_tokens > 0
    assert admission.stats()["rejected"] == {"invalid_limits": 2}  # type: ignore[attr-defined]
    assert admission.stats()["admitted"] == 1  # type: ignore[attr-defined]


async def test_cancelled_and_failed_requests_leave_the_bucket_where_streamed_tokens_say(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    worker = await mesh["worker"]("w1", speed=20.0)
    clock = FrozenClock()
    admission: AdmissionService = await mesh["admission"](clock=clock)  # type: ignore[assignment]
    gateway: GatewayService = await mesh["gateway"]()  # type: ignore[assignment]
    tpm, rpm = 100_000, 1_000
    key, record = await create_key(bus, org="burst-org", tpm=tpm, rpm=rpm)
    await wait_for_key(gateway, record.key_id)
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
    headers = {"Authorization": f"Bearer {key}"}
    rng = random.Random(5)

    async def cancelled(i: int) -> None:
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(200 + 10 * i))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as r:
            assert r.status == 200
            events = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    events += 1
                    if events >= 2 + i % 3:
                        break  # leave mid-stream: the gateway cancels the worker
    await asyncio.gather(*(cancelled(i) for i in range(8)))
    await eventually(lambda: len(admission.policy.limiter) == 0, what="every cancelled request's usage")

    # Then the worker stops answering while it still looks alive: admitted, then failed.
    for task in worker._loops:  # type: ignore[attr-defined]
        task.cancel()
    await worker.stop_endpoints()  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            body = {"model": MODEL, "prompt": f"failing {i}", "max_tokens": 500}
            async with http.post(url, json=body, headers=headers) as r:
                assert r.status == 503, await r.text()
    await eventually(lambda: len(admission.policy.limiter) == 0, what="the failed requests' rejected usage")

    events = [e for e in await usage_events(bus) if e.key_id == record.key_id]
    cancelled_events = [e for e in events if e.status == "cancelled"]
    assert len(cancelled_events) == 8 and all(0 < e.completion_tokens < 3000 for e in cancelled_events)
    assert len([e for e in events if e.status == "rejected"]) == 3
    spent = sum(e.prompt_tokens + e.completion_tokens for e in cancelled_events)
    tokens = admission.policy.limiter.bucket(f"key:{record.key_id}:tpm")
    requests = admission.policy.limiter.bucket(f"key:{record.key_id}:rpm")
    assert tokens is not None and requests is not None
    assert tokens.tokens == pytest.approx(tpm - spent)  # reserved 3000+ each, refunded to what streamed
    assert requests.tokens == pytest.approx(rpm - 8)  # the failed three were refunded their request too


# ---- SLO shedding order --------------------------------------------------------------------


async def test_slo_sheds_standard_while_premium_is_kept(bus: Bus, mesh: dict[str, Factory]) -> None:
    # One slow replica (a quarter of real time, small prefill chunks): its queue grows fast.
    await mesh["worker"]("slow", speed=0.5, max_num_batched_tokens=512)
    admission: AdmissionService = await mesh["admission"](AdmissionConfig(demand_interval_s=0.2))  # type: ignore[assignment]
    gateway: GatewayService = await mesh["gateway"]()  # type: ignore[assignment]
    # What it sheds is reported to the autoscalers as demand (the queues never show it).
    reports: list[PoolDemand] = []

    async def on_demand(demand: PoolDemand, _msg: object) -> None:
        reports.append(demand)

    await bus.subscribe(bus.subjects.autoscaler_demand, PoolDemand, on_demand)
    standard, std_rec = await create_key(bus, org="o", tier="standard")
    premium, prem_rec = await create_key(bus, org="o", tier="premium")
    await wait_for_key(gateway, std_rec.key_id)
    await wait_for_key(gateway, prem_rec.key_id)
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
    rng = random.Random(11)

    async def send(http: aiohttp.ClientSession, key: str, size: int = 1500) -> tuple[int, str]:
        # distinct prompts: a cached prefix would (rightly) make them cheap
        prompt = "".join(rng.choice("abcdefghijklmnop ") for _ in range(size))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            data = await r.json()
            code = data.get("error", {}).get("code", "") if r.status != 200 else ""
            return r.status, code

    async with aiohttp.ClientSession() as http:
        flood = [asyncio.create_task(send(http, standard)) for _ in range(24)]
        await eventually(lambda: admission.rejected.get("slo", 0) >= 3, what="standard shedding")
        # While standard is being shed, premium arriving at the same moment is admitted:
        # it waits only for premium work, which runs first on the worker. (Smaller prompts:
        # three 1500-token prompts at once would take ~0.8 s of prefill on this replica,
        # at the edge of premium's own 1 s SLO.)
        both = await asyncio.gather(*(send(http, premium, 400) for _ in range(3)),
                                    *(send(http, standard) for _ in range(3)))
        premium_results, late_standard = both[:3], both[3:]
        standard_results = await asyncio.gather(*flood)
    assert all(status == 200 for status, _ in premium_results), premium_results
    shed = [r for r in standard_results if r[0] == 429]
    assert shed and all(code == "slo_overloaded" for _, code in shed)
    assert any(status == 200 for status, _ in standard_results)  # shed the excess, not everything
    # The queue is at standard's threshold: at most one of the three fits before it is over again.
    assert late_standard.count((429, "slo_overloaded")) >= 2, late_standard
    stats = admission.stats()  # every decision saw the fleet: none was admitted on quota alone
    assert stats["registry_synced"] and stats["slo_skipped"] == 0, stats
    await eventually(lambda: any(r.pool == MODEL and r.requests >= len(shed) for r in reports),
                     what="the shed requests reported as demand")
    peak = max(r.requests for r in reports)
    assert max(r.tokens for r in reports) >= 1500 * peak and {r.source for r in reports} == {admission.instance_id}


# ---- admit and place in one trip ------------------------------------------------------------


async def test_admission_sends_admitted_requests_on_to_the_router_and_refused_ones_reach_none(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    await mesh["worker"]("w1")
    await mesh["router"]()
    admission: AdmissionService = await mesh["admission"](clock=FrozenClock())  # type: ignore[assignment]
    gateway: GatewayService = await mesh["gateway"]()  # type: ignore[assignment]
    routed: list[tuple[str, str]] = []  # (request id, where its placement goes), as the router sees them

    async def on_route(msg: Msg) -> None:
        routed.append((decode(msg.data, RouteRequest).request.request_id, msg.reply))

    await bus.nc.subscribe(bus.subjects.router_route, cb=on_route)
    await bus.nc.flush()
    key, record = await create_key(bus, org="acme", tpm=350)
    await wait_for_key(gateway, record.key_id)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key, max_retries=0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "extra_body": {"ignore_eos": True}}
    for _ in range(3):  # each reserves prompt + 100 of the 350-token bucket
        done = await client.completions.create(**body)  # type: ignore[call-overload]
        assert done.usage is not None and done.usage.completion_tokens == 100
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(**body)  # type: ignore[call-overload]
    await client.close()
    # The first went the gateway's way (no router seen yet), the next two on from admission,
    # their placements to this gateway's subject; the refused one reached no router.
    assert len(routed) == 3, routed
    assert routed[0][1].startswith("_INBOX.")
    assert all(reply == bus.subjects.placement(gateway.gateway_id, rid) for rid, reply in routed[1:]), routed
    assert admission.forwarded == 2 and gateway.upstream.forwarded_placements == 2
    assert gateway.upstream.late_placements == 0


async def test_a_forward_to_a_router_gone_is_placed_by_the_gateway_after_its_deadline(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    await mesh["worker"]("w1")
    router: RouterService = await mesh["router"]()  # type: ignore[assignment]
    admission: AdmissionService = await mesh["admission"]()  # type: ignore[assignment]
    upstream = UpstreamConfig(route_timeout_s=1.0)
    gateway: GatewayService = await mesh["gateway"](GatewayConfig(port=0, upstream=upstream))  # type: ignore[assignment]
    key, record = await create_key(bus, org="o")
    await wait_for_key(gateway, record.key_id)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key, max_retries=0)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "extra_body": {"ignore_eos": True}}
    await client.completions.create(**body)  # type: ignore[call-overload]
    assert gateway.upstream.router_seen
    await router.drain_and_close()
    # Admission forwards it to nobody: at its deadline no worker holds it, so the gateway
    # places it itself, and from then on asks the router directly (told "no router" at once).
    done = await client.completions.create(**body)  # type: ignore[call-overload]
    assert done.choices[0].finish_reason == "length"
    assert admission.forwarded == 1 and gateway.upstream.router_timeouts == 1
    assert gateway.upstream.direct_placements == 1 and not gateway.upstream.router_seen
    await client.completions.create(**body)  # type: ignore[call-overload]
    assert admission.forwarded == 1 and gateway.upstream.direct_placements == 2
    await client.close()


async def test_a_placement_nobody_waits_for_has_its_copy_stopped(bus: Bus, mesh: dict[str, Factory]) -> None:
    gateway: GatewayService = await mesh["gateway"]()  # type: ignore[assignment]
    cancels: asyncio.Queue[CancelRequest] = asyncio.Queue()

    async def on_cancel(msg: Msg) -> None:
        cancels.put_nowait(decode(msg.data, CancelRequest))

    await bus.nc.subscribe(bus.subjects.worker_cancel("w9"), cb=on_cancel)
    # A placement for a request this gateway no longer relays (its client went away while
    # admission's forward was on its way): the copy on w9 is told it is superseded.
    late = Placement(request_id="gone-1", worker_id="w9", model=MODEL)
    await bus.publish(bus.subjects.placement(gateway.gateway_id, "gone-1"), late)
    cancel = await asyncio.wait_for(cancels.get(), timeout=5)
    assert (cancel.request_id, cancel.reason) == ("gone-1", SUPERSEDED)
    assert gateway.upstream.late_placements == 1
    # An error reply placed nothing anywhere: nothing to stop.
    await bus.nc.publish(bus.subjects.placement(gateway.gateway_id, "gone-2"), b"{}",
                         headers=error_reply_headers("no_capacity", "no worker"))
    await eventually(lambda: gateway.upstream.late_placements == 2, what="the error reply counted")
    await asyncio.sleep(0.2)
    assert cancels.empty()


# ---- admission unreachable ----------------------------------------------------------------


async def test_waiting_checks_are_served_first_come_first_served_capped_and_answered_on_drain(
    bus: Bus, mesh: dict[str, Factory]
) -> None:
    await mesh["worker"]("w1")
    config = AdmissionConfig(slot_wait_s=5.0, slot_waiters_per_key=2)
    admission: AdmissionService = await mesh["admission"](config)  # type: ignore[assignment]

    def capped(i: int) -> AdmissionRequest:
        return msgspec.structs.replace(check(i), tpm_limit=None, concurrency_limit=1)

    async def finish(rid: str) -> None:
        ev = UsageEvent(request_id=rid, org="org", key_id="k1", model=MODEL, prompt_tokens=1, completion_tokens=1)
        await bus.js_publish(bus.subjects.usage("org"), ev, msg_id=usage_dedup_id(rid))

    assert (await ask(bus, capped(1))).admitted
    first = asyncio.create_task(ask(bus, capped(2), timeout=10))
    await eventually(lambda: admission.slot_waits == 1, what="the first waiter")
    second = asyncio.create_task(ask(bus, capped(3), timeout=10))
    await eventually(lambda: admission.slot_waits == 2, what="the second waiter")
    # A third is past the key's cap on waiting checks: refused at once, not queued.
    third = await ask(bus, capped(4), timeout=2)
    assert not third.admitted and admission.slot_waits == 2
    await finish("r1")  # one slot: the first to wait takes it, the second waits on
    assert (await first).admitted
    await asyncio.sleep(0.2)
    assert not second.done()
    # Draining, the leader answers the check still waiting (refused: r2 holds the slot)
    # rather than leave its gateway to time out and fail open.
    await admission.drain_and_close()  # type: ignore[attr-defined]
    answered = await second
    assert not answered.admitted and answered.reason == "quota_requests"


async def test_gateway_fails_open_within_its_grace_then_closed(bus: Bus, mesh: dict[str, Factory]) -> None:
    await mesh["worker"]("w1")
    admission: AdmissionService = await mesh["admission"]()  # type: ignore[assignment]
    upstream = UpstreamConfig(admission_timeout_s=0.5, admission_unreachable="grace", admission_grace_s=1.0)
    gateway: GatewayService = await mesh["gateway"](GatewayConfig(port=0, upstream=upstream))  # type: ignore[assignment]
    key, record = await create_key(bus, org="o")
    await wait_for_key(gateway, record.key_id)
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers) as r:
            assert r.status == 200
        assert admission.admitted == 1
        await admission.drain_and_close()
        async with http.post(url, json=body, headers=headers) as r:
            assert r.status == 200  # within the grace window: open
        assert gateway.upstream.admission_fail_open == 1
        await asyncio.sleep(1.1)
        async with http.post(url, json=body, headers=headers) as r:
            assert r.status == 503  # grace over: closed
            assert "admission" in (await r.json())["error"]["message"]
        assert gateway.upstream.admission_fail_closed == 1


# ---- leader lease -------------------------------------------------------------------------


def check(i: int, tokens: int = 100, key: str = "k1") -> AdmissionRequest:
    return AdmissionRequest(request_id=f"r{i}", org="org", key_id=key, model=MODEL,
                            prompt_tokens=tokens // 2, max_tokens=tokens - tokens // 2, tpm_limit=1000)


async def ask(bus: Bus, request: AdmissionRequest, timeout: float = 2) -> AdmissionDecision:
    return await bus.request(bus.subjects.admission_check, request, AdmissionDecision, timeout=timeout)


async def test_two_instances_share_one_budget_and_the_standby_takes_over(bus: Bus, mesh: dict[str, Factory]) -> None:
    await mesh["worker"]("w1")
    clock = FrozenClock()
    config = AdmissionConfig(limiter=LimiterConfig(), lease_ttl_s=1.5, lease_renew_s=0.3, checkpoint_interval_s=0.1)
    a1: AdmissionService = await mesh["admission"](config, clock=clock, instance_id="adm-1")  # type: ignore[assignment]
    a2: AdmissionService = await mesh["admission"](config, clock=clock, instance_id="adm-2")  # type: ignore[assignment]
    assert (a1.leading, a2.leading) == (True, False)
    # 25 checks of 100 tokens against a 1000-token budget, whoever answers: 10 admitted.
    decisions = await asyncio.gather(*(ask(bus, check(i)) for i in range(25)))
    admitted = [d.request_id for d in decisions if d.admitted]
    assert len(admitted) == 10
    assert all(d.reason == "quota_tokens" for d in decisions if not d.admitted)
    assert a2.admitted == 0 and sum(a2.rejected.values()) == 0  # the standby served nothing
    # Three admitted requests finish using 20 tokens each; one event is delivered twice.
    for rid in admitted[:3]:
        ev = UsageEvent(request_id=rid, org="org", key_id="k1", model=MODEL, prompt_tokens=10, completion_tokens=10)
        await bus.js_publish(bus.subjects.usage("org"), ev, msg_id=usage_dedup_id(rid))
    await eventually(lambda: a1.reconciled == 3, what="reconciliation on the leader")
    await eventually(lambda: a1.checkpoints >= 2, what="a checkpoint after it")
    await asyncio.sleep(0.3)

    await crash(a1)
    await eventually(lambda: a2.leading, timeout=10, what="the standby to take over")
    # The budget came along: 3 × 80 tokens refunded, nothing more.
    after = [await ask(bus, check(100 + i)) for i in range(4)]
    assert [d.admitted for d in after] == [True, True, False, False]
    # Reservations open at the hand-over are still reconciled, exactly once.
    rid = admitted[5]
    for _ in range(2):
        ev = UsageEvent(request_id=rid, org="org", key_id="k1", model=MODEL, prompt_tokens=50, completion_tokens=0)
        await bus.js_publish(bus.subjects.usage("org"), ev, msg_id=f"{rid}-{_}")  # two deliveries, same request
    await eventually(lambda: a2.reconciled == 1, what="reconciliation on the new leader")
    await asyncio.sleep(0.2)
    assert a2.reconciled == 1
    # 40 left + 50 refunded once = 90: three checks of 25 fit, a fourth does not
    refund = [await ask(bus, check(200 + i, tokens=25)) for i in range(4)]
    assert [d.admitted for d in refund] == [True, True, True, False]


async def test_prometheus_metrics(bus: Bus, mesh: dict[str, Factory]) -> None:
    await mesh["worker"]("w1")
    admission: AdmissionService = await mesh["admission"](AdmissionConfig(metrics_port=0))  # type: ignore[assignment]
    await eventually(lambda: len(admission.book) > 0, what="the worker in the replica book")
    assert (await ask(bus, check(1))).admitted
    assert not (await ask(bus, check(2, tokens=5000))).admitted  # more than the 1000-token budget holds
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{admission.metrics_port}/metrics") as r:
        text = await r.text()
    assert 'meshserve:admission_decisions_total{outcome="admitted",tier="standard"} 1.0' in text
    assert 'meshserve:admission_decisions_total{outcome="quota_tokens",tier="standard"} 1.0' in text
    assert "meshserve:admission_leader 1.0" in text
    assert "meshserve:admission_reservations_open 1.0" in text
