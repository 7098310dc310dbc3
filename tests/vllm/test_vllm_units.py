"""The vLLM engine's pure parts: KV-event bridge, cache predictor, stats tracker, options.

These run without vLLM (stand-in events with vLLM's field names); where vLLM is
installed, its own msgspec event structs go through the bridge too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest

from proto.hashing import block_hashes, extend_block_hashes, prefix_salt, root_hash
from proto.workers import AllCleared, BlockRemoved, BlockStored
from services.worker.engines.vllm_kv import KvEventBridge, KvPredictor
from services.worker.engines.vllm_stats import VllmStatsTracker, record_step

B = 4  # block size of these tests
def vllm_installed() -> bool:
    """vLLM itself, not this test folder (``tests/`` is on sys.path, so ``tests/vllm``
    would pass for a namespace package called ``vllm``)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None



# Stand-ins with the class names and fields of vllm.distributed.kv_events.
@dataclass
class BlockStoredV:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    group_idx: int | None = None
    medium: str | None = "GPU"
    extra_keys: list[Any] | None = None


@dataclass
class BlockRemovedV:
    block_hashes: list[Any]
    group_idx: int | None = None


@dataclass
class AllBlocksClearedV:
    pass


for cls, name in ((BlockStoredV, "BlockStored"), (BlockRemovedV, "BlockRemoved"), (AllBlocksClearedV, "AllBlocksCleared")):
    cls.__name__ = name


def engine_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """vLLM's own kind of hash (sha256 of parent and tokens): never meshserve's."""
    return hashlib.sha256((parent or b"root") + repr(tokens).encode()).digest()


@dataclass
class FakeEngineCache:
    """Emits events like vLLM's block pool: one BlockStored per newly full run of blocks."""

    chains: dict[tuple[int, ...], bytes] = field(default_factory=dict)

    def store(self, tokens: list[int], start_block: int = 0, lora: str | None = None) -> BlockStoredV:
        parent = self.chains.get(tuple(tokens[: start_block * B])) if start_block else None
        hashes = []
        h = parent
        for i in range(start_block, len(tokens) // B):
            h = engine_hash(h, tokens[i * B:(i + 1) * B])
            self.chains[tuple(tokens[: (i + 1) * B])] = h
            hashes.append(h)
        return BlockStoredV(hashes, parent, tokens[start_block * B: len(tokens) // B * B], B, lora_name=lora)


def test_bridge_rehashes_into_the_shared_space() -> None:
    cache, bridge = FakeEngineCache(), KvEventBridge(B)
    tokens = list(range(100, 118))  # 4 full blocks and 2 tokens
    out = bridge.translate([cache.store(tokens[:8])])  # prefill: blocks 0-1
    assert out == [BlockStored(block_hashes=block_hashes(tokens[:8], B), parent_hash=None, block_size=B)]
    out = bridge.translate([cache.store(tokens, start_block=2)])  # decode fills blocks 2-3
    expected = block_hashes(tokens, B)
    assert out == [BlockStored(block_hashes=expected[2:], parent_hash=expected[1], block_size=B)]
    assert sorted(bridge.snapshot()) == sorted(expected)


def test_bridge_lora_salt_removal_and_clear() -> None:
    cache, bridge = FakeEngineCache(), KvEventBridge(B)
    tokens = list(range(8))
    stored = cache.store(tokens, lora="sql")
    (event,) = bridge.translate([stored])
    assert isinstance(event, BlockStored) and event.lora == "sql"
    assert event.block_hashes == extend_block_hashes(root_hash("sql"), tokens, B) == block_hashes(tokens, B, salt="sql")
    out = bridge.translate([BlockRemovedV([stored.block_hashes[1]]), BlockRemovedV([b"unknown"])])
    assert out == [BlockRemoved(block_hashes=[event.block_hashes[1]])]
    assert bridge.snapshot() == [event.block_hashes[0]]
    assert bridge.translate([AllBlocksClearedV()]) == [AllCleared()] and bridge.snapshot() == []


def test_bridge_reannounced_blocks_and_shared_hashes_are_counted_once() -> None:
    cache, bridge = FakeEngineCache(), KvEventBridge(B)
    tokens = list(range(8))
    stored = cache.store(tokens)
    first = bridge.translate([stored])
    again = bridge.translate([stored])  # vLLM re-announces prefix-cache hits
    assert first == again and len(bridge) == 2
    # A second KV cache group holding the same tokens: one meshserve hash, two engine blocks.
    other = BlockStoredV([b"g1-a", b"g1-b"], None, tokens, B, group_idx=1)
    bridge.translate([other])
    assert len(bridge) == 2
    assert bridge.translate([BlockRemovedV(list(stored.block_hashes))]) == []  # group 1 still holds them
    assert bridge.translate([BlockRemovedV([b"g1-a", b"g1-b"], group_idx=1)]) == [BlockRemoved(block_hashes=first[0].block_hashes)]  # type: ignore[union-attr]


def test_bridge_drops_blocks_whose_parent_it_never_saw() -> None:
    bridge = KvEventBridge(B)
    orphan = BlockStoredV([b"x"], b"missing-parent", [1, 2, 3, 4], B)
    assert bridge.translate([orphan]) == [] and bridge.unresolved == 1 and bridge.snapshot() == []


def test_bridge_int_hashes_and_partial_token_runs() -> None:
    bridge = KvEventBridge(B)
    # vLLM folds hashes to 64-bit ints by default; a block run shorter than announced keeps what it can.
    out = bridge.translate([BlockStoredV([11, 12, 13], None, list(range(10)), B)])
    assert out == [BlockStored(block_hashes=block_hashes(list(range(8)), B), block_size=B)]
    assert bridge.mesh_hash(12) == block_hashes(list(range(8)), B)[1] and bridge.mesh_hash(13) is None


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_bridge_reads_vllms_own_event_structs() -> None:
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored

    tokens = list(range(50, 58))
    batch = KVEventBatch(ts=1.0, events=[
        VBlockStored(block_hashes=[111, 222], parent_block_hash=None, token_ids=tokens, block_size=B, lora_id=None,
                     medium="GPU", lora_name=None),
        VBlockRemoved(block_hashes=[222], medium="GPU"),
        AllBlocksCleared(),
    ])
    # As the ZMQ publisher sends it: msgpack, decoded with vLLM's batch type.
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    out = KvEventBridge(B).translate(decoded.events)
    hashes = block_hashes(tokens, B)
    assert out == [BlockStored(block_hashes=hashes, block_size=B), BlockRemoved(block_hashes=[hashes[1]]), AllCleared()]


def _salted_events(stored: Any) -> list[Any]:
    tokens = list(range(70, 78))
    return [
        stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=B, lora_name=None,
               extra_keys=[("org-a",), None]),
        stored(block_hashes=[3, 4], parent_block_hash=None, token_ids=tokens, block_size=B, lora_name="sql",
               extra_keys=[("sql", "org-a"), ("sql",)]),
        stored(block_hashes=[5, 6], parent_block_hash=None, token_ids=tokens, block_size=B, lora_name="sql",
               extra_keys=[("sql",), ("sql",)]),
        stored(block_hashes=[7, 8], parent_block_hash=None, token_ids=tokens, block_size=B, lora_name=None,
               extra_keys=[(("cache_salt", "org-a"),), None]),  # the tagged form, should events move to it
    ]


def _check_salted(out: list[Any]) -> None:
    tokens = list(range(70, 78))
    assert [e.block_hashes for e in out if isinstance(e, BlockStored)] == [
        block_hashes(tokens, B, prefix_salt(None, "org-a")), block_hashes(tokens, B, prefix_salt("sql", "org-a")),
        block_hashes(tokens, B, "sql"), block_hashes(tokens, B, prefix_salt(None, "org-a"))]


def test_bridge_salts_a_chain_with_its_requests_cache_salt() -> None:
    """vLLM lists a request's ``cache_salt`` (the worker passes the org) among the first
    block's extra keys, after the LoRA name: the chain's meshserve hashes are salted with
    both (proto.hashing.prefix_salt), as the gateway hashes that org's prompts."""
    _check_salted(KvEventBridge(B).translate(_salted_events(BlockStoredV)))
    predictor = KvPredictor(block_size=B, num_blocks=8)
    tokens = list(range(70, 78))
    assert predictor.observe(tokens, "sql", "org-a")[0] == BlockStored(
        block_hashes=block_hashes(tokens, B, prefix_salt("sql", "org-a")), parent_hash=None, block_size=B, lora="sql")


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_bridge_reads_the_cache_salt_of_vllms_own_event_structs() -> None:
    from vllm.distributed.kv_events import BlockStored as VBlockStored

    def stored(**fields: Any) -> Any:
        return VBlockStored(lora_id=1 if fields.get("lora_name") else None, medium="GPU", **fields)

    _check_salted(KvEventBridge(B).translate(_salted_events(stored)))


def test_predictor_stores_prefixes_and_evicts_lru_tail_first() -> None:
    p = KvPredictor(block_size=B, num_blocks=4)
    a = list(range(12))  # 3 blocks
    ha = block_hashes(a, B)
    assert p.observe(a) == [BlockStored(block_hashes=ha, parent_hash=None, block_size=B)]
    assert p.observe(a) == []  # nothing new
    longer = [*a, 20, 21, 22, 23]
    assert p.observe(longer) == [BlockStored(block_hashes=block_hashes(longer, B)[3:], parent_hash=ha[2], block_size=B)]
    b = [7] * 8  # 2 new blocks: over capacity, the least recently used tail goes
    events = p.observe(b)
    assert events[0] == BlockStored(block_hashes=block_hashes(b, B), parent_hash=None, block_size=B)
    assert isinstance(events[1], BlockRemoved) and set(events[1].block_hashes) == set(block_hashes(longer, B)[2:])
    assert set(p.snapshot()) == {*ha[:2], *block_hashes(b, B)}
    assert p.clear() == [AllCleared()] and len(p) == 0


def test_stats_tracker_gauges() -> None:
    t = VllmStatsTracker(kv_blocks_total=100, rate_window_s=2.0, kv_events_mode="engine", lora_adapters=["sql"],
                         max_num_batched_tokens=512)
    t.add("a", 300)
    t.add("b", 50)
    s = t.snapshot(0.0)
    # No engine step yet: both wait, all their prompt tokens are queued prefill.
    assert (s.waiting, s.running, s.queued_prefill_tokens, s.running_tokens) == (2, 0, 350, 0)
    t.on_scheduler(running=1, waiting=1, kv_usage=0.05, prefix_requests=1, prefix_queries=300, prefix_hits=0)
    t.on_iteration(1.0, prompt_tokens=300, generation_tokens=1)
    t.progress("a", 1)
    s = t.snapshot(1.0)
    assert (s.waiting, s.running, s.queued_prefill_tokens, s.running_tokens) == (1, 1, 50, 301)
    assert s.kv_blocks_used == 5 and s.kv_usage == 0.05 and s.lora_adapters == ["sql"] and s.kv_events_mode == "engine"
    t.on_scheduler(running=2, waiting=0, kv_usage=0.06, prefix_requests=1, prefix_queries=50, prefix_hits=32)
    t.on_iteration(1.05, prompt_tokens=18, generation_tokens=2, preempted=1)
    t.progress("b", 1)
    t.progress("a", 1)
    s = t.snapshot(1.5)
    assert (s.waiting, s.running, s.queued_prefill_tokens) == (0, 2, 0)
    assert s.prefix_hit_rate == pytest.approx(32 / 350) and s.preemptions == 1
    # No step with a known duration filled the step budget: the capacity is not known yet.
    # Decode is per busy second of the timed steps (the first step's duration is unknown:
    # the gap before it held idle time), as the sim reports it.
    assert s.prefill_tokens_per_s == 0.0 and s.decode_tokens_per_s == pytest.approx(2 / 0.05)
    assert s.step_time_s == pytest.approx(0.05)
    t.finish("a")
    t.finish("b")
    s = t.snapshot(10.0)  # idle: speeds hold their last value; stale scheduler counts never exceed what is in flight
    assert (s.waiting, s.running, s.prefill_tokens_per_s) == (0, 0, 0.0)
    assert s.decode_tokens_per_s == pytest.approx(40.0) and s.step_time_s == pytest.approx(0.05)
    t.on_scheduler(running=0, waiting=0, kv_usage=0.0, prefix_reset=True)
    assert t.snapshot(10.0).prefix_hit_rate == 0.0
    assert t.snapshot(10.0).prefill_tokens_total == 318  # every computed prompt token, timed steps or not


def test_a_vllm_worker_names_its_accelerator_without_touching_cuda() -> None:
    from services.worker.engines.vllm import VllmEngine

    engine = VllmEngine(model="m", model_dir="/models/m", tensor_parallel_size=2)
    assert engine.accelerator == ("cpu", 2)  # vLLM's CPU build: its platform says so (NVML on GPUs)


def test_a_steps_stats_are_read_by_attribute_and_missing_fields_read_as_zero() -> None:
    from types import SimpleNamespace as NS

    t = VllmStatsTracker(kv_blocks_total=100, rate_window_s=2.0)
    t.add("a", 40)
    t.add("b", 10)
    # vLLM's names (SchedulerStats, IterationStats), with the newer fields present
    sched = NS(num_running_reqs=1, num_waiting_reqs=0, num_skipped_waiting_reqs=1, kv_cache_usage=0.1,
               prefix_cache_stats=NS(requests=1, queries=40, hits=16, reset=False),
               iteration_details=NS(elapsed_ms=20.0))
    record_step(t, sched, NS(prompt_token_stats=NS(computed=24), num_prompt_tokens=40, num_generation_tokens=1,
                             num_preempted_reqs=0), now=1.0)
    t.progress("a", 1)
    s = t.snapshot(1.0)
    assert (s.running, s.waiting, s.kv_blocks_used) == (1, 1, 10)
    assert s.prefix_hit_rate == pytest.approx(16 / 40) and s.step_time_s == pytest.approx(0.02)
    # An older vLLM: no skipped-waiting count, prefix stats, step details or computed tokens
    record_step(t, NS(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.2),
                NS(num_prompt_tokens=10, num_generation_tokens=2), now=1.05)
    record_step(t, None, None, now=1.1)  # a step without either report changes nothing
    t.progress("b", 1)
    s = t.snapshot(1.1)
    assert (s.running, s.waiting, s.kv_blocks_used, s.preemptions) == (2, 0, 20, 0)


def test_stats_tracker_prefill_rate_is_a_capacity() -> None:
    t = VllmStatsTracker(kv_blocks_total=100, rate_window_s=5.0, max_num_batched_tokens=2048)
    # Light load: one short prompt a second, 10 ms steps. Tokens over wall time would say
    # ~500 tokens/s, tokens per step second 50k; neither is how fast a queue drains.
    for i in range(5):
        t.on_scheduler(running=1, waiting=0, kv_usage=0.01)
        t.on_iteration(float(i), prompt_tokens=500, generation_tokens=1, elapsed_s=0.01)
    assert t.snapshot(4.5).prefill_tokens_per_s == 0.0  # not measured: admission uses its default
    # Busy: full steps back to back (no elapsed figure: the gap after a step that left
    # work behind is the step); the first one's gap holds idle time and is not counted.
    for i in range(6):
        t.on_scheduler(running=3, waiting=5, kv_usage=0.2)
        t.on_iteration(10.0 + 0.2 * i, prompt_tokens=2000, generation_tokens=3)
    assert t.snapshot(11.0).prefill_tokens_per_s == pytest.approx(2000 / 0.2)
    # Idle again, then light load: the capacity holds
    for i in range(3):
        t.on_scheduler(running=0, waiting=0, kv_usage=0.0)
        t.on_iteration(30.0 + i, prompt_tokens=20, generation_tokens=1, elapsed_s=0.007)
    assert t.snapshot(40.0).prefill_tokens_per_s == pytest.approx(2000 / 0.2)
    # The budget is known only once vLLM has started (the engine sets it then): from that
    # moment on, short-prompt steps no longer count as the capacity either.
    late = VllmStatsTracker(kv_blocks_total=100, rate_window_s=5.0)
    late.max_num_batched_tokens = 2048
    for i in range(5):
        late.on_scheduler(running=1, waiting=0, kv_usage=0.01)
        late.on_iteration(float(i), prompt_tokens=500, generation_tokens=1, elapsed_s=0.01)
    assert late.snapshot(4.5).prefill_tokens_per_s == 0.0


def test_worker_cli_passes_vllm_engine_arguments(tmp_path: Any) -> None:
    from services.worker.main import add_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = tmp_path / "engine.toml"
    config.write_text('model = "/models/llama"\nswap_space = 4\nmax_num_seqs = 64\n')
    args = parser.parse_args([
        "--engine", "vllm", "--model", "llama", "--engine-config", str(config),
        "--max-num-seqs", "128", "--max-num-batched-tokens", "4096", "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.85", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2",
        "--no-enable-prefix-caching", "--block-size", "32", "--enforce-eager", "--max-loras", "2",
        "--max-lora-rank", "32", "--lora-adapters", "sql=/a/sql,chat=/a/chat", "--engine-arg", "disable_cascade_attn=true",
        "--kv-events", "predicted", "--cpu-kvcache-space", "2",
    ])
    options = engine_options(args)
    assert options == {
        "model": "llama", "model_dir": "/models/llama", "max_num_seqs": 128, "max_num_batched_tokens": 4096,
        "max_model_len": 8192, "gpu_memory_utilization": 0.85, "kv_cache_dtype": "fp8", "tensor_parallel_size": 2,
        "enable_prefix_caching": False, "block_size": 32, "enforce_eager": True, "max_loras": 2, "max_lora_rank": 32,
        "lora_adapters": "sql=/a/sql,chat=/a/chat", "kv_events": "predicted", "cpu_kvcache_space_gib": 2,
        "engine_args": {"swap_space": 4, "disable_cascade_attn": True},
    }
    # The sim engine still gets only its own options (names of name=path adapters).
    sim = engine_options(parser.parse_args(["--model", "m", "--speed", "20", "--lora-adapters", "sql=/a/sql,chat"]))
    assert sim == {"model": "m", "speed": 20.0, "lora_adapters": ["sql", "chat"]}


def test_kv_transfer_settings_and_params_are_vllms() -> None:
    from services.worker.engines.base import EngineRequest
    from services.worker.engines.vllm_args import REMOTE_DECODE, kv_transfer_params, parse_kv_transfer_config
    from services.worker.main import add_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    args = parser.parse_args(["--engine", "vllm", "--model", "m", "--kv-transfer-config", spec])
    assert engine_options(args)["kv_transfer_config"] == spec
    assert parse_kv_transfer_config(spec) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert parse_kv_transfer_config(None) is None and parse_kv_transfer_config("") is None
    for bad in ("{not json", '{"kv_role": "kv_both"}', "[1]"):
        with pytest.raises(ValueError):
            parse_kv_transfer_config(bad)
    # What vLLM's disaggregated proxy sends: a prefill keeps its KV, a decode loads the answer.
    plain = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    assert kv_transfer_params(plain) is None
    assert kv_transfer_params(EngineRequest(request_id="r", prompt_token_ids=[1], hold_kv=True)) == REMOTE_DECODE
    answer = {"remote_engine_id": "e1", "remote_block_ids": [4, 5], "remote_host": "10.0.0.2", "remote_port": 5600,
              "do_remote_prefill": True, "do_remote_decode": False}
    assert kv_transfer_params(EngineRequest(request_id="r", prompt_token_ids=[1], kv_transfer=answer)) == answer
    # an answer naming nothing (a connector that finds the KV by the prompt): nothing to pass
    assert kv_transfer_params(EngineRequest(request_id="r", prompt_token_ids=[1], kv_transfer={})) is None
    # the sim is the only engine a prefill worker runs without a connector
    from services.worker.main import run

    for argv in (["--engine", "vllm", "--model", "m", "--role", "prefill"], ["--engine", "echo", "--role", "prefill"]):
        with pytest.raises(SystemExit, match="--role prefill"):
            run(parser.parse_args(argv))


def test_engine_arguments_keep_vllm_names() -> None:
    from services.worker.engines.vllm_args import engine_arguments, parse_lora_adapters, resolve_model

    assert resolve_model("/models/tiny-llama", None, None) == ("/models/tiny-llama", "/models/tiny-llama")
    assert resolve_model("meta-llama/Llama-3.1-8B-Instruct", None, None) == ("meta-llama/Llama-3.1-8B-Instruct",) * 2
    assert resolve_model("tiny", "/models/x", None) == ("tiny", "/models/x")
    assert resolve_model("/models/x", None, "served") == ("served", "/models/x")
    assert parse_lora_adapters("a=/p/a, b") == {"a": "/p/a", "b": "b"}
    assert parse_lora_adapters({"a": "/p"}) == {"a": "/p"} and parse_lora_adapters(None) == {}
    args = engine_arguments(model_dir="/m", served_model_name="m", options={"max_num_seqs": 4, "block_size": None},
                            extra={"swap_space": 1}, enable_lora=True)
    assert args == {"model": "/m", "tokenizer": "/m", "served_model_name": "m", "disable_log_stats": True,
                    "max_num_seqs": 4, "enable_lora": True, "swap_space": 1}


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_sampling_parameters_map_one_to_one() -> None:
    from vllm.sampling_params import RequestOutputKind

    from proto.messages import SamplingParams
    from services.worker.engines.base import EngineRequest
    from services.worker.engines.vllm import VllmEngine

    engine = VllmEngine(model="/nonexistent/tiny")
    sampling = SamplingParams(max_tokens=50, min_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=["\n\n"],
                              stop_token_ids=[7], ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.25,
                              repetition_penalty=1.1)
    p = engine.sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling))
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (1, 50, 5, 0.7, 0.9, 40, 3)
    assert p.stop == ["\n\n"] and p.stop_token_ids == [7] and p.ignore_eos
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.output_kind == RequestOutputKind.DELTA
    # A migrated request continues: output already streamed counts toward the limits.
    resumed = engine.sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling,
                                                   output_offset=20))
    assert (resumed.max_tokens, resumed.min_tokens) == (30, 0)
    assert engine.sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams())).top_k == 0


def test_new_sampling_fields_map_onto_vllm_names() -> None:
    from proto.messages import SamplingParams, StructuredOutput
    from services.worker.engines.vllm_args import sampling_kwargs

    sampling = SamplingParams(max_tokens=20, min_p=0.05, logit_bias={5: -100.0, 9: 2.5}, logprobs=3, prompt_logprobs=1,
                              skip_special_tokens=False, spaces_between_special_tokens=False,
                              include_stop_str_in_output=True, n=3, structured=StructuredOutput(regex="a+"))
    kw = sampling_kwargs(sampling)
    assert kw["n"] == 1  # the worker fans n choices out; vLLM sees one sequence each
    assert (kw["min_p"], kw["logit_bias"], kw["logprobs"], kw["prompt_logprobs"]) == (0.05, {5: -100.0, 9: 2.5}, 3, 1)
    assert (kw["skip_special_tokens"], kw["spaces_between_special_tokens"], kw["include_stop_str_in_output"]) == (
        False, False, True)
    assert "structured_outputs" not in kw and "output_kind" not in kw  # vLLM objects, built by the engine
    # Defaults stay vLLM's: no bias, no logprobs.
    plain = sampling_kwargs(SamplingParams())
    assert (plain["logit_bias"], plain["logprobs"], plain["prompt_logprobs"], plain["min_p"]) == (None, None, None, 0.0)
    assert plain["skip_special_tokens"] and plain["spaces_between_special_tokens"]
    assert not plain["include_stop_str_in_output"]
    # A migrated continuation: its prompt holds output, and the prompt's logprobs went out already.
    assert sampling_kwargs(sampling, output_offset=4)["prompt_logprobs"] is None
    assert sampling_kwargs(sampling, output_offset=4)["logprobs"] == 3


def test_structured_outputs_take_exactly_one_constraint() -> None:
    from proto.messages import StructuredOutput
    from services.worker.engines.vllm_args import structured_kwargs

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    assert structured_kwargs(None) is None
    assert structured_kwargs(StructuredOutput()) is None
    assert structured_kwargs(StructuredOutput(json=schema)) == {"json": schema}
    assert structured_kwargs(StructuredOutput(json_object=True)) == {"json_object": True}
    assert structured_kwargs(StructuredOutput(regex=r"\d+")) == {"regex": r"\d+"}
    assert structured_kwargs(StructuredOutput(choice=["yes", "no"])) == {"choice": ["yes", "no"]}
    assert structured_kwargs(StructuredOutput(grammar='root ::= "a"')) == {"grammar": 'root ::= "a"'}
    with pytest.raises(ValueError, match="json, regex"):
        structured_kwargs(StructuredOutput(json=schema, regex="a"))


@dataclass
class LogprobV:
    """vllm.logprobs.Logprob's fields."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_logprobs_from_vllm_positions() -> None:
    from proto.messages import TokenLogprob, TopLogprob
    from services.worker.engines.vllm_args import prompt_logprobs, sample_logprobs

    def decode(token_id: int) -> str:
        return f"<{token_id}>"

    # vLLM's dict per position: the sampled token first, then the top k by rank.
    outside = {9: LogprobV(-5.0, 7, "z"), 1: LogprobV(-0.5, 1, "a"), 2: LogprobV(-1.0, 2, "b")}  # k=2, sampled rank 7
    inside = {2: LogprobV(-1.0, 2, "b"), 1: LogprobV(-0.5, 1, "a")}  # k=2, sampled rank 2
    masked = {3: LogprobV(float("-inf"), 1, None)}  # k=0, no decoded text, -inf (masked by a bias)
    assert sample_logprobs([9, 2], [outside, inside], 2, decode) == [
        TokenLogprob(9, "z", -5.0, [TopLogprob(1, "a", -0.5), TopLogprob(2, "b", -1.0)], rank=7),
        TokenLogprob(2, "b", -1.0, [TopLogprob(1, "a", -0.5), TopLogprob(2, "b", -1.0)], rank=2),
    ]
    assert sample_logprobs([3], [masked], 0, decode) == [TokenLogprob(3, "<3>", -9999.0, [], rank=1)]
    assert sample_logprobs([9], [outside], 0, decode)[0].top == []
    with pytest.raises(ValueError, match="token 4"):
        sample_logprobs([4], [outside], 2, decode)
    with pytest.raises(ValueError):
        sample_logprobs([9, 2], [outside], 2, decode)  # one dict per token, never fewer
    # The prompt's first token has none (nothing precedes it).
    assert prompt_logprobs([5, 9], [None, outside], 1, decode) == [
        None, TokenLogprob(9, "z", -5.0, [TopLogprob(1, "a", -0.5)], rank=7)]


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_logprobs_from_vllm_own_containers() -> None:
    """The dict order assumed above is the one vLLM's own logprobs processor builds (list and flat)."""
    from vllm.logprobs import (
        append_logprobs_for_next_position,
        create_prompt_logprobs,
        create_sample_logprobs,
    )

    from proto.messages import TokenLogprob, TopLogprob
    from services.worker.engines.vllm_args import prompt_logprobs, sample_logprobs

    for flat in (False, True):
        sample = create_sample_logprobs(flat)
        # As the sampler hands them over: the sampled token, then the top k (k=2).
        append_logprobs_for_next_position(sample, [9, 1, 2], [-5.0, -0.5, -1.0], ["z", "a", "b"], 7, 2)
        append_logprobs_for_next_position(sample, [2, 1, 2], [-1.0, -0.5, -1.0], ["b", "a", "b"], 2, 2)
        assert sample_logprobs([9, 2], list(sample), 2, str) == [
            TokenLogprob(9, "z", -5.0, [TopLogprob(1, "a", -0.5), TopLogprob(2, "b", -1.0)], rank=7),
            TokenLogprob(2, "b", -1.0, [TopLogprob(1, "a", -0.5), TopLogprob(2, "b", -1.0)], rank=2),
        ]
        prompt = create_prompt_logprobs(flat)
        append_logprobs_for_next_position(prompt, [4, 4], [-0.1, -0.1], ["d", "d"], 1, 1)
        assert prompt_logprobs([8, 4], list(prompt), 1, str) == [
            None, TokenLogprob(4, "d", -0.1, [TopLogprob(4, "d", -0.1)], rank=1)]


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_new_sampling_fields_reach_vllm_sampling_params() -> None:
    from proto.messages import SamplingParams, StructuredOutput
    from services.worker.engines.base import EngineRequest
    from services.worker.engines.vllm import VllmEngine

    engine = VllmEngine(model="/nonexistent/tiny")

    def params(**fields: Any) -> Any:
        return engine.sampling_params(EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                                    sampling=SamplingParams(max_tokens=8, **fields)))

    p = params(min_p=0.1, logit_bias={5: -100.0}, logprobs=2, prompt_logprobs=0, skip_special_tokens=False,
               spaces_between_special_tokens=False, include_stop_str_in_output=True, n=4, seed=1)
    assert (p.n, p.min_p, p.logit_bias, p.logprobs, p.prompt_logprobs) == (1, 0.1, {5: -100.0}, 2, 0)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.include_stop_str_in_output) == (False, False, True)
    assert p.structured_outputs is None and params().logit_bias is None
    schema = '{"type": "object"}'
    for structured, field_name, value in (
        (StructuredOutput(json=schema), "json", schema), (StructuredOutput(json_object=True), "json_object", True),
        (StructuredOutput(regex="[ab]+"), "regex", "[ab]+"), (StructuredOutput(choice=["x", "y"]), "choice", ["x", "y"]),
        (StructuredOutput(grammar='root ::= "a"'), "grammar", 'root ::= "a"'),
    ):
        so = params(structured=structured).structured_outputs
        assert getattr(so, field_name) == value, field_name
        assert so.all_constraints_none() is False


def test_cpu_build_kv_cache_default_is_bounded_by_free_memory() -> None:
    from services.worker.engines.vllm_args import default_cpu_kvcache_gib

    gib = 1 << 30
    assert default_cpu_kvcache_gib(2 * gib) == 1  # never below one GiB
    assert default_cpu_kvcache_gib(13 * gib) == 3  # a quarter of what is free
    assert default_cpu_kvcache_gib(200 * gib) == 4  # never more than 4 GiB on a laptop's CPU build


# ---- the CPU build's busy wait (services/worker/engines/vllm_plugin.py) ------------------
class FakeSpinCondition:
    """vLLM's SpinCondition as the patch sees it: a reader, its last read, its busy window."""

    is_reader = True
    busy_loop_s = 1.0

    def __init__(self, last_read: float) -> None:
        self.last_read = last_read
        self.idle_waits: list[int | None] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.idle_waits.append(timeout_ms)


def test_the_busy_wait_sleeps_instead_of_yielding_and_the_idle_wait_stays_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from services.worker.engines import vllm_plugin

    class Condition(FakeSpinCondition):
        pass

    vllm_plugin.patch_spin_condition(Condition, 0.0002)
    slept: list[float] = []
    monkeypatch.setattr(vllm_plugin.time, "sleep", slept.append)
    busy = Condition(last_read=time.monotonic())  # read just now: inside the busy window
    busy.wait(50)
    assert slept == [0.0002] and busy.idle_waits == []
    idle = Condition(last_read=time.monotonic() - 5.0)  # past it: vLLM's own wait on its notify socket
    idle.wait(50)
    assert slept == [0.0002] and idle.idle_waits == [50]
    assert Condition.meshserve_spin_sleep_s == 0.0002  # type: ignore[attr-defined]


def test_the_plugin_acts_only_when_the_worker_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.engines import vllm_plugin

    for value, expected in (("", 0.0), ("0", 0.0), ("-1", 0.0), ("junk", 0.0), ("0.0001", 0.0001)):
        monkeypatch.setenv(vllm_plugin.SPIN_SLEEP_ENV, value)
        assert vllm_plugin.spin_sleep_s() == expected
    monkeypatch.delenv(vllm_plugin.SPIN_SLEEP_ENV)
    patched: list[object] = []
    monkeypatch.setattr(vllm_plugin, "patch_spin_condition", lambda *a: patched.append(a))
    vllm_plugin.register()  # unset: vLLM as vLLM made it
    assert patched == []


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_vllm_loads_the_plugin_and_has_what_it_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point vLLM loads in each of its processes, and the SpinCondition fields
    the patch relies on (a vLLM that renamed them must fail here, not starve CPU meshes)."""
    import inspect
    from importlib.metadata import entry_points

    from vllm.distributed.device_communicators import shm_broadcast

    from services.worker.engines import vllm_plugin

    assert "services.worker.engines.vllm_plugin:register" in {e.value for e in entry_points(group="vllm.general_plugins")}
    condition = shm_broadcast.SpinCondition
    assert list(inspect.signature(condition.wait).parameters) == ["self", "timeout_ms"]
    source = inspect.getsource(condition)
    assert "self.last_read" in source and "self.busy_loop_s" in source and "sched_yield()" in source

    class Condition(condition):  # type: ignore[misc, valid-type]
        pass

    monkeypatch.setattr(shm_broadcast, "SpinCondition", Condition)
    monkeypatch.setenv(vllm_plugin.SPIN_SLEEP_ENV, "0.0001")
    vllm_plugin.register()
    assert Condition.meshserve_spin_sleep_s == 0.0001
    patched = Condition.wait
    assert patched.__qualname__.endswith("patch_spin_condition.<locals>.wait")
    vllm_plugin.register()  # loaded again in the same process: patched once
    assert Condition.wait is patched
