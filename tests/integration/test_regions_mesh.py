"""Regions on a real NATS supercluster: two JetStream servers, each its own cluster ("eu",
"us"), joined by NATS gateways (``ops.natsserver.supercluster``). The eu side runs the
gateway, router, admission and one sim worker; the us side two sim workers only, each
process told its region (``MeshConfig.region``: ``MESHSERVE_REGION``). The stock ``openai`` client talks to the
eu gateway.

One request at a time stays in eu. A burst of long prompts more than the eu worker can
start soon spills to us, and the usage events say where each ran. A key held to eu
(``keys create --regions eu``) never leaves it, whatever the burst; one held to a region
with no worker is refused with a 503 that names the region, and nothing is lost. When eu's
only worker dies, eu's requests are served in us, and the key held to eu is refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bus import Bus
from ops.keys import create_key
from ops.natsserver import NatsServer, supercluster
from ops.up import Mesh
from proto import UsageEvent
from tests.conftest import running_mesh, usage_events
from tests.integration.test_router_mesh import stats, until

MODEL = "sim-llama-8b"
WHOLE = {"ignore_eos": True}  # vLLM's: every answer runs to max_tokens (the sim samples an early EOS now and then)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[tuple[Mesh, list[NatsServer]]]:
    nodes = supercluster(tmp_path / "nats", ["eu", "us"])
    for node in nodes:
        node.log_file = tmp_path / f"{node.server_name}.log"
        node.start()
    try:
        with running_mesh(tmp_path / "eu", nats_url=nodes[0].url, workers=1, region="eu",
                          services=("worker", "gateway", "router", "admission")) as eu, \
             running_mesh(tmp_path / "us", nats_url=nodes[1].url, workers=2, region="us",
                          services=("worker",), dev_key=False):
            yield eu, nodes
    finally:
        for node in nodes:
            node.stop()


def test_requests_stay_home_spill_under_a_burst_and_keep_their_keys_regions(
    regions: tuple[Mesh, list[NatsServer]],
) -> None:
    asyncio.run(_run(*regions))


def _prompt(i: int) -> str:
    return f"Document {i}: a long report nobody else sent, part {i} of the region test. " * 26  # ~1,950 tokens


async def _burst(client: openai.AsyncOpenAI, first: int, n: int) -> None:
    answers = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=4,
                                                               extra_body=WHOLE)
                                     for i in range(first, first + n)))
    assert all(a.usage is not None and a.usage.completion_tokens == 4 for a in answers), answers


async def _run(eu: Mesh, nodes: list[NatsServer]) -> None:
    bus = await Bus.open(eu.settings, "test", initial_attempts=20)
    # The batch tier (a 10 s TTFT SLO): admission lets the bursts in, the placement is what is tested.
    key, _ = await create_key(bus, org="acme", tier="batch")
    client = openai.AsyncOpenAI(base_url=eu.gateway_url + "/v1", api_key=key, max_retries=0)
    try:
        await until(lambda: _registered(bus, 3))
        await until(lambda: _key_works(client))
        # One at a time: every request is served at home.
        for i in range(3):
            await client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=4, extra_body=WHOLE)
        router = (await stats(bus, "router"))[0]
        assert router["outside_region"] == 0, router
        home = await until(lambda: _long_events(bus, "acme", 3))
        assert {e.region for e in home} == {"eu"}, home

        # A burst of prompts the eu worker would queue for: some run in us.
        await _burst(client, 10, 10)
        router = (await stats(bus, "router"))[0]
        spilled = router["outside_region"]
        assert 1 <= spilled < 10, router
        # usage events are published as requests end, beside the answer: wait for all 13
        events = await until(lambda: _long_events(bus, "acme", 13))
        assert sum(e.region == "us" for e in events) == spilled

        # A key held to eu: the same burst never leaves eu.
        eu_key, _ = await create_key(bus, org="acme-eu", tier="batch", regions=["eu"])
        resident = openai.AsyncOpenAI(base_url=eu.gateway_url + "/v1", api_key=eu_key, max_retries=0)
        try:
            await until(lambda: _key_works(resident))
            await _burst(resident, 30, 10)
        finally:
            await resident.close()
        acme = await until(lambda: _long_events(bus, "acme-eu", 10))
        assert {e.region for e in acme} == {"eu"}, acme
        assert (await stats(bus, "router"))[0]["outside_region"] == spilled

        # A key held to a region with no worker: a 503 that says so; nothing runs anywhere.
        ap_key, _ = await create_key(bus, org="acme-ap", regions=["ap"])
        nowhere = openai.AsyncOpenAI(base_url=eu.gateway_url + "/v1", api_key=ap_key, max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as refused:
                await until(lambda: _refused(nowhere), timeout=10)
                raise AssertionError("unreachable")
        finally:
            await nowhere.close()
        assert refused.value.status_code == 503 and "region ap" in str(refused.value.message), refused.value
        assert not [e for e in await usage_events(bus) if e.org == "acme-ap" and e.completion_tokens]

        # eu's only worker dies: eu's requests are served in us, a key held to eu is refused.
        worker = next(p for p in eu.processes if p.label == "worker-1")
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGKILL)
        await until(lambda: _registered(bus, 2, exactly=True))
        moved = await client.completions.create(model=MODEL, prompt=_prompt(50), max_tokens=4, user="after-eu",
                                                extra_body=WHOLE)
        assert moved.usage is not None and moved.usage.completion_tokens == 4, moved
        events = await until(lambda: _long_events(bus, "acme", 14))
        assert [e.region for e in events if e.user == "after-eu"] == ["us"], events
        resident = openai.AsyncOpenAI(base_url=eu.gateway_url + "/v1", api_key=eu_key, max_retries=0)
        try:
            with pytest.raises(openai.APIStatusError) as held:
                await resident.completions.create(model=MODEL, prompt="hello", max_tokens=1)
        finally:
            await resident.close()
        assert held.value.status_code == 503 and "region eu" in str(held.value.message), held.value
    finally:
        await client.close()
        await bus.close()


async def _long_events(bus: Bus, org: str, n: int) -> list[UsageEvent]:
    """The usage events of ``org``'s long prompts, once there are ``n`` ([] until then)."""
    events = [e for e in await usage_events(bus) if e.org == org and e.prompt_tokens > 100]
    assert len(events) <= n, events
    return events if len(events) == n else []


async def _registered(bus: Bus, n: int, exactly: bool = False) -> bool:
    workers = [s for s in await stats(bus, "worker") if s]
    return len(workers) == n if exactly else len(workers) >= n


async def _key_works(client: openai.AsyncOpenAI) -> bool:
    try:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    except openai.AuthenticationError:
        return False  # the gateway has not seen the new key yet
    return True


async def _refused(client: openai.AsyncOpenAI) -> bool:
    try:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    except openai.AuthenticationError:
        return False
    return True
