"""Prefill and decode apart, on real processes: two sim workers and a prefill worker
(``meshserve up --prefill-workers 1``'s machinery), the router, admission and the gateway,
the stock ``openai`` client.

A long prompt is computed on the prefill worker and decoded where the router placed it,
with the same text a worker computing it itself gives (the same seeded request, served
once each way); a short prompt stays where it is placed; a prefill worker that stops
answering (SIGSTOP) costs its requests the wait, never the request; a client gone while
its prompt waits there is billed, and its request never starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bus import Bus
from ops.up import Mesh
from tests.conftest import running_mesh, usage_events
from tests.integration.test_router_mesh import stats, until

MODEL = "sim-llama-8b"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, prefill_workers=1, speed=20.0,
                      worker_args=["--remote-prefill-timeout", "3"],
                      services=("worker", "gateway", "router", "admission")) as m:
        yield m


def _sum(found: list[dict[str, Any]], key: str) -> int:
    return sum(int(s.get(key, 0)) for s in found)


async def _cancelled(bus: Bus) -> bool:
    return _sum(await stats(bus, "worker"), "remote_prefills_cancelled") == 1


def test_long_prompts_prefill_on_the_prefill_worker(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _run(mesh: Mesh) -> None:
    client = openai.AsyncOpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0)
    bus = await Bus.open(mesh.settings, "test", initial_attempts=20)
    try:
        roles = {w.worker_id: w.role for w in mesh.workers}
        assert sorted(roles.values()) == ["both", "both", "prefill"], roles

        long_a = "Chapter one of a long report on prefill and decode. " * 40  # ~2,000 tokens
        first = await client.completions.create(model=MODEL, prompt=long_a, max_tokens=24, seed=7)
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None and first.usage.completion_tokens == 24
        router = (await stats(bus, "router"))[0]
        assert router["remote_prefills"] == 1, router
        workers = await stats(bus, "worker")
        assert _sum(workers, "prefills_served") == 1
        assert _sum(workers, "remote_prefills") == 1
        served_by = next(s for s in workers if s.get("remote_prefills"))["worker_id"]
        assert roles[served_by] == "both"  # decoded where the router placed it, not on the prefill worker

        # A short prompt is computed where it is placed.
        # (ignore_eos: unseeded, the sim samples an early EOS now and then; it failed CI once)
        short = await client.completions.create(model=MODEL, prompt="Hello there, a short one.", max_tokens=8,
                                                extra_body={"ignore_eos": True})
        assert short.usage is not None and short.usage.completion_tokens == 8
        assert (await stats(bus, "router"))[0]["remote_prefills"] == 1

        # The same seeded request, now held whole by the worker that decoded it (its cache
        # took the loaded blocks): computed there, the same text as when prefilled apart.
        await asyncio.sleep(1.0)  # the router has that worker's KV events
        again = await client.completions.create(model=MODEL, prompt=long_a, max_tokens=24, seed=7)
        assert again.choices[0].text == first.choices[0].text
        assert (await stats(bus, "router"))[0]["remote_prefills"] == 1

        # A prefill worker that stops answering: the decode worker waits its timeout (3 s),
        # then computes the prompt itself.
        prefill = next(p for p in mesh.processes if p.label == "prefill-1")
        assert prefill.proc is not None
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            long_b = "Appendix B, another long document nobody has sent yet. " * 40
            late = await client.completions.create(model=MODEL, prompt=long_b, max_tokens=24, seed=11)
            assert late.usage is not None and late.usage.completion_tokens == 24
            workers = [s for s in await stats(bus, "worker") if s]  # the paused one does not answer
            assert _sum(workers, "remote_prefill_fallbacks") == 1, workers

            # A client gone while its prompt waits there: the serving worker stops waiting,
            # never starts it, and bills it (cancelled, no output).
            long_d = "Chapter D: a prompt whose client leaves before it is computed. " * 32
            stream = await client.completions.create(model=MODEL, prompt=long_d, max_tokens=24, stream=True)
            await asyncio.sleep(1.0)
            await stream.response.aclose()
            await until(lambda: _cancelled(bus))  # the serving worker stopped waiting
            events = [e for e in await usage_events(bus) if e.prompt_tokens and e.status == "cancelled"]
            assert len(events) == 1 and events[0].completion_tokens == 0, events
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        # Back, the prefill worker computes a new long prompt again; the text of B is B's.
        long_c = "Part C of the long report, a third prompt for the prefill worker. " * 30
        await client.completions.create(model=MODEL, prompt=long_c, max_tokens=8)
        await asyncio.sleep(0.5)
        assert _sum(await stats(bus, "worker"), "prefills_served") >= 2
        repeat = await client.completions.create(model=MODEL, prompt=long_b, max_tokens=24, seed=11)
        assert repeat.choices[0].text == late.choices[0].text
    finally:
        await client.close()
        await bus.close()
