"""SimEngine, the async shell: streaming, abort, KV events, stats, the factory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import time

import msgspec
import pytest

from proto.codec import decode, encode
from proto.messages import SamplingParams
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent, WorkerGauge
from services.common.tokenizer import load_tokenizer
from services.worker.engines import Engine, EngineOutput, EngineRequest, EngineStats, create_engine
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_core import SimCore
from services.worker.engines.sim_profile import SimConfig

SPEED = 200.0


def prompt(n: int, base: int = 0) -> list[int]:
    return [3 + 32 + ((base * 7 + i) % 90) for i in range(n)]


def req(rid: str, tokens: list[int], **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def engine(**options: object) -> SimEngine:
    opts: dict[str, object] = {"profile": "tiny-test", "speed": SPEED}
    opts.update(options)
    return SimEngine(**opts)  # type: ignore[arg-type]


async def collect(eng: Engine, r: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(r)]


def core_tokens(r: EngineRequest, **options: object) -> list[int]:
    """What the pure core generates for ``r`` alone: the shell must not change it."""
    core = SimCore(SimConfig.build("tiny-test", **options))  # type: ignore[arg-type]
    assert core.add_request(r, 0.0) is None
    now, toks = 0.0, []
    while (res := core.step(now)) is not None:
        now = res.end
        toks += [t for o in res.outputs for t in o.new_token_ids]
    return toks


def apply(state: set[int], events: list[KvEvent]) -> None:
    for ev in events:
        match ev:
            case BlockStored(block_hashes=hs):
                state.update(hs)
            case BlockRemoved(block_hashes=hs):
                state.difference_update(hs)
            case AllCleared():
                state.clear()


async def test_generate_streams_tokens_text_and_wall_clock_timings() -> None:
    async with engine() as eng:
        before = time.time()
        r = req("g", prompt(40), max_tokens=30, ignore_eos=True, seed=1)
        outs = await collect(eng, r)
        after = time.time()
    assert [o.finish_reason for o in outs] == [None] * 29 + ["length"]
    assert all(len(o.new_token_ids) == 1 for o in outs)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == core_tokens(req("g", prompt(40), max_tokens=30, ignore_eos=True, seed=1))
    assert "".join(o.text for o in outs) == load_tokenizer(eng.tokenizer_spec).decode(tokens)
    final = outs[-1]
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (40, 30, 0)
    t = final.timings
    assert t.arrival == r.arrival_time
    assert before <= t.arrival <= t.scheduled < t.first_token < t.finished <= after + 1e-3
    # Every output carries the timings reached so far.
    assert outs[0].timings.first_token == t.first_token and outs[0].timings.finished == 0.0


async def test_concurrent_requests_share_steps_and_keep_their_text() -> None:
    async with engine() as eng:
        reqs = [req(f"c{i}", prompt(20 + 9 * i, base=i), max_tokens=25, ignore_eos=True) for i in range(8)]
        results = await asyncio.gather(*(collect(eng, r) for r in reqs))
        steps = eng.steps
    for r, outs in zip(reqs, results, strict=True):
        assert outs[-1].finish_reason == "length"
        fresh = req(r.request_id, r.prompt_token_ids, max_tokens=25, ignore_eos=True)
        assert [t for o in outs for t in o.new_token_ids] == core_tokens(fresh)
    assert steps < 8 * 25  # batched, not one request after another


async def test_abort_ends_the_stream_and_frees_blocks() -> None:
    async with engine() as eng:
        rid = "long"
        outs: list[EngineOutput] = []
        async for out in eng.generate(req(rid, prompt(100), max_tokens=900, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 5:
                assert eng.stats().kv_blocks_used > 0
                await eng.abort(rid)
        assert outs[-1].finish_reason == "abort"
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].timings.finished > 0
        s = eng.stats()
        assert (s.running, s.waiting, s.kv_blocks_used) == (0, 0, 0)
        assert eng.core.request_ids() == []
        await eng.abort(rid)  # unknown now: ignored
        await eng.abort("never-existed")


async def test_consumer_leaving_aborts_the_request() -> None:
    async with engine() as eng:
        async with contextlib.aclosing(
            eng.generate(req("gone", prompt(100), max_tokens=900, ignore_eos=True))
        ) as gen:
            n = 0
            async for _ in gen:
                n += 1
                if n == 3:
                    break
        s = eng.stats()
        assert (s.running, s.waiting, s.kv_blocks_used) == (0, 0, 0)
        # The id is free again and the engine keeps serving.
        outs = await collect(eng, req("gone", prompt(10), max_tokens=2, ignore_eos=True))
        assert outs[-1].finish_reason == "length"


async def test_invalid_requests_yield_one_error_output() -> None:
    async with engine() as eng:
        outs = await collect(eng, req("big", prompt(eng.max_model_len + 1)))
        assert len(outs) == 1 and outs[0].finish_reason == "error" and outs[0].error
        assert outs[0].timings.arrival > 0 and outs[0].timings.finished > 0
        r = req("lora", prompt(5))
        r.lora = "missing"
        outs = await collect(eng, r)
        assert outs[0].finish_reason == "error"


async def test_duplicate_request_id_raises() -> None:
    async with engine() as eng:
        first = eng.generate(req("dup", prompt(50), max_tokens=500, ignore_eos=True))
        await anext(first)
        with pytest.raises(ValueError, match="already in flight"):
            await collect(eng, req("dup", prompt(5)))
        await first.aclose()
        assert eng.stats().kv_blocks_used == 0


async def test_kv_events_replay_to_the_snapshot() -> None:
    eng = engine(num_kv_blocks=16, max_model_len=256)
    await eng.start()
    state: set[int] = set()
    batches: list[list[KvEvent]] = []

    async def consume() -> None:
        async for batch in eng.kv_events():
            batches.append(batch)
            apply(state, batch)

    consumer = asyncio.create_task(consume())
    reqs = [req(f"k{i}", prompt(60 + 10 * i, base=i % 4), max_tokens=30, ignore_eos=True) for i in range(10)]
    await asyncio.gather(*(collect(eng, r) for r in reqs))
    snapshot = set(eng.kv_snapshot())
    await eng.shutdown()
    await asyncio.wait_for(consumer, 5)  # ends after shutdown
    assert state == snapshot and snapshot
    assert any(isinstance(ev, BlockRemoved) for b in batches for ev in b)  # 16 blocks: evictions


async def test_kv_event_backlog_collapses_into_a_resync_batch() -> None:
    eng = engine(kv_event_buffer=2)
    await eng.start()
    for i in range(6):  # nobody consumes the events meanwhile
        await collect(eng, req(f"b{i}", prompt(40, base=i), max_tokens=3, ignore_eos=True))
    await eng.shutdown()
    batches = [b async for b in eng.kv_events()]
    assert len(batches) <= 3
    assert isinstance(batches[0][0], AllCleared)
    state: set[int] = {12345}  # whatever the consumer held before is cleared
    for b in batches:
        apply(state, b)
    assert state == set(eng.kv_snapshot())


async def test_shutdown_aborts_in_flight_requests() -> None:
    eng = engine()
    await eng.start()
    gen = eng.generate(req("s", prompt(10), max_tokens=900, ignore_eos=True))
    first = await anext(gen)
    assert first.finish_reason is None

    async def rest() -> list[EngineOutput]:
        return [o async for o in gen]

    task = asyncio.create_task(rest())
    await eng.shutdown()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason == "abort"
    await eng.shutdown()  # idempotent
    with pytest.raises(RuntimeError):
        await collect(eng, req("late", prompt(5)))


async def test_a_failing_step_errors_requests_and_the_engine_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with engine() as eng:
        gen = eng.generate(req("victim", prompt(30), max_tokens=500, ignore_eos=True))
        await anext(gen)
        broken = eng.core

        def explode(now: float) -> None:
            raise RuntimeError("bookkeeping bug")

        broken.step = explode  # type: ignore[method-assign]
        outs = [o async for o in gen]
        assert outs[-1].finish_reason == "error" and "bookkeeping bug" in (outs[-1].error or "")
        assert eng.core is not broken and "sim engine step failed" in caplog.text
        assert eng.kv_snapshot() == []
        after = await collect(eng, req("next", prompt(30), max_tokens=3, ignore_eos=True))
        assert after[-1].finish_reason == "length"


async def test_stats_are_gauge_fields_in_wall_clock_units() -> None:
    names = {f.name for f in dataclasses.fields(EngineStats)}
    assert names <= set(WorkerGauge.__struct_fields__)
    assert names == {
        "waiting", "running", "queued_prefill_tokens", "running_tokens", "kv_blocks_total",
        "kv_blocks_used", "kv_usage", "prefix_hit_rate", "prefill_tokens_per_s",
        "decode_tokens_per_s", "step_time_s", "preemptions", "prefill_tokens_total", "lora_adapters", "lora_cached",
        "kv_events_mode",
        "residency", "load_remaining_s", "idle_s",
    }  # fmt: skip
    rates = {}
    for speed in (50.0, 100.0):
        async with engine(speed=speed, lora_adapters=["a"]) as eng:
            await collect(eng, req("r", prompt(200), max_tokens=20, ignore_eos=True))
            s = eng.stats()
            rates[speed] = s
            gauge = WorkerGauge(worker_id="w1", model=eng.model, ts=1.0, **s.gauge_fields())
            assert decode(encode(gauge), WorkerGauge) == gauge
            assert gauge.lora_adapters == ["a"] and gauge.kv_blocks_total == eng.kv_blocks_total
    # Same simulated work, twice the speed: twice the wall-clock rates, half the step time.
    assert rates[100.0].decode_tokens_per_s == pytest.approx(2 * rates[50.0].decode_tokens_per_s)
    assert rates[100.0].prefill_tokens_per_s == pytest.approx(2 * rates[50.0].prefill_tokens_per_s)
    assert rates[100.0].step_time_s == pytest.approx(rates[50.0].step_time_s / 2)
    # a count, not a rate: the 200 prompt tokens computed, at any speed
    assert rates[50.0].prefill_tokens_total == rates[100.0].prefill_tokens_total == 200


async def test_factory_and_properties() -> None:
    eng = create_engine(
        "sim", profile="tiny-test", speed=10.0, model="m", max_num_seqs=4, lora_adapters=["x"]
    )
    assert isinstance(eng, SimEngine) and isinstance(eng, Engine)
    assert (eng.engine_name, eng.model, eng.tokenizer_spec) == ("sim", "m", "byte")
    assert (eng.block_size, eng.kv_blocks_total, eng.max_model_len) == (16, 64, 1024)
    assert (eng.max_num_seqs, eng.max_num_batched_tokens) == (4, 256)
    assert create_engine("sim").model == "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(ValueError, match="unknown engine"):
        create_engine("tgi")
    with pytest.raises(TypeError):
        create_engine("sim", no_such_option=1)
    with pytest.raises(ValueError):
        create_engine("sim", speed=0)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match="not available"):
            create_engine("vllm")


async def test_engine_output_is_plain_data() -> None:
    out = EngineOutput(request_id="x", new_token_ids=[5], text="b", finish_reason="stop")
    assert out.finished and not EngineOutput(request_id="y").finished
    # Timings are the wire struct, ready for a TokenChunk.
    assert msgspec.structs.asdict(out.timings) == {
        "arrival": 0.0,
        "scheduled": 0.0,
        "first_token": 0.0,
        "finished": 0.0,
    }
