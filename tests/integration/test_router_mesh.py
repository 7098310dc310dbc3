"""Router and admission as real processes (``meshserve serve router|admission``) in a mesh:
the gateway places through the router, admission reconciles from USAGE, and a standby
admission process takes over when the leader is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bus import Bus
from ops.up import Mesh, ServiceProcess
from proto import TtftObservation
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, speed=50.0,
                      services=("worker", "gateway", "router", "admission")) as m:
        yield m


async def stats(bus: Bus, service: str) -> list[dict[str, Any]]:
    """``$SRV.STATS`` of every instance of a service ({} for one with no endpoint: an
    admission standby serves none, so it reports no figures)."""
    return await bus.every_service_stats(service, wait=0.3)


async def until(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.2)


def test_router_and_admission_processes(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _run(mesh: Mesh) -> None:
    client = openai.AsyncOpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0)
    bus = await Bus.open(mesh.settings, "test", initial_attempts=20)
    try:
        observed: list[TtftObservation] = []

        async def on_ttft(obs: TtftObservation, _msg: Any) -> None:
            observed.append(obs)

        await bus.subscribe(bus.subjects.admission_ttft, TtftObservation, on_ttft)
        prompt = "A long shared document about routing. " * 60
        first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert first.usage is not None
        # once the router has the KV events and an idle gauge of the first worker
        await asyncio.sleep(1.0)
        second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0
        (router,) = await stats(bus, "router")
        assert router["placements"] == 2 and router["prefix_hit_tokens"] > 0
        assert (await bus.service_stats("router"))["placements"] == 2  # Bus's one-instance view
        # admission named its replica (and its slack) for each request; the router placed
        # there or within the slack, never ignoring it
        hints = router["admission_hints"]
        assert sum(hints.values()) == 2 and set(hints) <= {"kept", "moved"}, hints
        # the gateway reported each admitted request's TTFT to admission at its first token
        async def both_reported() -> bool:
            return len(observed) == 2

        await until(both_reported)
        assert {f"cmpl-{o.request_id}" for o in observed} == {first.id, second.id}
        assert all(o.tier in ("premium", "standard", "batch") and 0 < o.ttft_s < 30 for o in observed), observed

        async def reconciled() -> bool:
            (adm,) = await stats(bus, "admission")
            return bool(adm["leading"] and adm["admitted"] == 2 and adm["reconciled"] == 2)

        await until(reconciled)

        # A standby process, then the leader dies without handing over.
        leader = next(p for p in mesh.processes if p.name == "admission")
        mesh.add_process(ServiceProcess("admission", "admission-2", [], mesh.log_dir / "admission-2.log"))

        async def two_instances() -> bool:
            return len(await stats(bus, "admission")) == 2

        await until(two_instances)
        assert sorted(s.get("leading", False) for s in await stats(bus, "admission")) == [False, True]
        leader.kill()
        leader.wait(10)

        async def standby_leads() -> bool:
            found = await stats(bus, "admission")
            return len(found) == 1 and found[0].get("leading", False)

        await until(standby_leads)
        third = await client.completions.create(model=MODEL, prompt="after the failover", max_tokens=3,
                                                 extra_body={"ignore_eos": True})
        assert third.usage is not None and third.usage.completion_tokens == 3
        (adm,) = await stats(bus, "admission")
        assert adm["admitted"] == 1 and adm["takeovers"] == 1
    finally:
        await bus.close()
        await client.close()
