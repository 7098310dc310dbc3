"""EchoEngine: the prompt streamed back at a fixed rate, in outputs of several tokens."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from proto.messages import SamplingParams, StructuredOutput
from services.common.tokenizer import load_tokenizer
from services.worker.engines import EngineOutput, EngineRequest, create_engine
from services.worker.engines.echo import EchoEngine
from services.worker.main import add_arguments, engine_option_problem, engine_options

BYTE = load_tokenizer("byte")


def req(rid: str, text: str = "hello world, ", **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=BYTE.encode(text), sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


async def collect(eng: EchoEngine, r: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(r)]


async def test_streams_the_prompt_back_in_multi_token_outputs() -> None:
    async with EchoEngine(tokens_per_s=4000, interval_s=0.01) as eng:
        r = req("a", max_tokens=200)
        outs = await collect(eng, r)
    tokens = [t for o in outs for t in o.new_token_ids]
    prompt = r.prompt_token_ids
    assert tokens == [prompt[i % len(prompt)] for i in range(200)]
    assert "".join(o.text for o in outs) == BYTE.decode(tokens)
    assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + ["length"]
    # the first token at once, then the tokens due per tick: ~40 an output at 4000/s and 10 ms
    assert len(outs[0].new_token_ids) == 1 and len(outs) < 30
    assert max(len(o.new_token_ids) for o in outs) >= 20
    final = outs[-1]
    assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), 200)
    t = final.timings
    assert t.arrival <= t.scheduled <= t.first_token < t.finished


async def test_a_continued_request_goes_on_where_its_output_ended() -> None:
    async with EchoEngine(tokens_per_s=10_000) as eng:
        first = [t for o in await collect(eng, req("a", "abc", max_tokens=5)) for t in o.new_token_ids]
        assert BYTE.decode(first) == "abcab"
        cont = EngineRequest(request_id="a2", prompt_token_ids=BYTE.encode("abc") + first[:2], output_offset=2,
                             sampling=SamplingParams(max_tokens=5))
        rest = [t for o in await collect(eng, cont) for t in o.new_token_ids]
    assert first[:2] + rest == first


async def test_requests_beyond_max_num_seqs_wait_for_a_slot() -> None:
    async with EchoEngine(tokens_per_s=500, max_num_seqs=1) as eng:
        a = asyncio.create_task(collect(eng, req("a", max_tokens=20)))
        b = asyncio.create_task(collect(eng, req("b", max_tokens=20)))
        for _ in range(3):  # both requests enter the engine (no time passes: a runs 40 ms)
            await asyncio.sleep(0)
        s = eng.stats()
        assert (s.running, s.waiting) == (1, 1) and s.queued_prefill_tokens == len(req("b").prompt_token_ids)
        outs_a, outs_b = await asyncio.gather(a, b)
        assert eng.stats().running == 0 and eng.stats().decode_tokens_per_s > 0
    assert outs_b[-1].timings.scheduled >= outs_a[-1].timings.finished


async def test_abort_and_a_consumer_leaving_free_the_slot() -> None:
    async with EchoEngine(tokens_per_s=100, max_num_seqs=1) as eng:
        gen = eng.generate(req("a", max_tokens=1000))
        first = await anext(gen)
        assert first.new_token_ids and eng.stats().running == 1
        await eng.abort("a")
        rest = [o async for o in gen]
        assert rest[-1].finish_reason == "abort" and eng.stats().running == 0
        gen2 = eng.generate(req("b", max_tokens=1000))
        await anext(gen2)
        await gen2.aclose()
        assert eng.stats().running == 0
        with pytest.raises(ValueError, match="already in flight"):
            gen3 = eng.generate(req("c", max_tokens=1000))
            await anext(gen3)
            await anext(eng.generate(req("c")))
        await gen3.aclose()


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (EngineRequest(request_id="e", prompt_token_ids=[], sampling=SamplingParams()), "prompt is empty"),
        (EngineRequest(request_id="e", prompt_token_ids=[40] * 100, sampling=SamplingParams()), "max_model_len"),
        (req("e", structured=StructuredOutput(json_object=True)), "structured outputs"),
        (EngineRequest(request_id="e", prompt_token_ids=[40], sampling=SamplingParams(), lora="x"), "LoRA"),
    ],
)
async def test_what_it_cannot_do_is_refused_as_the_clients_error(request_: EngineRequest, error: str) -> None:
    async with EchoEngine(max_model_len=64) as eng:
        (out,) = await collect(eng, request_)
    assert out.finish_reason == "error" and out.rejected and error in (out.error or "")


async def test_logprobs_one_per_token_and_the_factory() -> None:
    eng = create_engine("echo", tokens_per_s=5000)
    assert isinstance(eng, EchoEngine) and eng.engine_name == "echo"
    async with eng:
        outs = await collect(eng, req("l", "xy", max_tokens=7, logprobs=1))
        gen = eng.kv_events()
        pending = asyncio.ensure_future(anext(gen))
    assert eng.kv_snapshot() == []
    with pytest.raises(StopAsyncIteration):
        await pending  # the event stream ends with the engine
    for o in outs:
        assert o.logprobs is not None and [lp.token_id for lp in o.logprobs] == o.new_token_ids
        assert all(lp.logprob == 0.0 and lp.top[0].token_id == lp.token_id for lp in o.logprobs)


def test_worker_flags_build_its_options_and_refuse_bad_values() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "echo", "--model", "echo", "--echo-tokens-per-s", "2500",
                              "--echo-interval-ms", "5", "--max-num-seqs", "64"])
    assert engine_options(args) == {"model": "echo", "tokens_per_s": 2500.0, "interval_s": 0.005, "max_num_seqs": 64}
    # The sim's options would change nothing here: the worker refuses them.
    assert engine_option_problem(args) is None
    assert engine_option_problem(parser.parse_args(["--engine", "echo", "--speed", "50"])) == (
        "--speed is for --engine sim: --engine echo does not read it")
    with pytest.raises(SystemExit):  # the parser's refusal (exit 2, the flag named)
        parser.parse_args(["--engine", "echo", "--echo-tokens-per-s", "0"])
