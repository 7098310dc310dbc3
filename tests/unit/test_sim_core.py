"""The sim engine's pure core: scheduling, paged KV with prefix caching, text, events."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.hashing import block_hashes
from proto.messages import SamplingParams
from proto.workers import AllCleared, BlockRemoved, BlockStored, KvEvent
from services.common.tokenizer import ByteTokenizer
from services.worker.engines.base import EngineOutput, EngineRequest
from services.worker.engines.sim_core import SimCore, StepResult
from services.worker.engines.sim_profile import SimConfig, available_profiles, load_profile
from services.worker.engines.sim_sequence import EOS, WORDS

TOK = ByteTokenizer()


def make_core(profile: str = "tiny-test", **options: object) -> SimCore:
    return SimCore(SimConfig.build(profile, **options))  # type: ignore[arg-type]


def prompt(n: int, base: int = 0) -> list[int]:
    """``n`` printable byte tokens; different ``base`` values give disjoint prompts."""
    return [3 + 32 + ((base * 7 + i) % 90) for i in range(n)]


def req(rid: str, tokens: list[int], **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


class Run:
    """Drives a core to completion with the simulated clock, collecting everything."""

    def __init__(self, core: SimCore) -> None:
        self.core = core
        self.now = 0.0
        self.outputs: dict[str, list[EngineOutput]] = {}
        self.steps: list[StepResult] = []
        self.events: list[KvEvent] = []

    def add(self, r: EngineRequest) -> EngineOutput | None:
        out = self.core.add_request(r, self.now)
        if out is not None:
            self.outputs.setdefault(r.request_id, []).append(out)
        return out

    def step(self) -> StepResult | None:
        res = self.core.step(self.now)
        if res is None:
            return None
        self.now = res.end
        self.steps.append(res)
        self.events.extend(res.kv_events)
        for out in res.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)
        self.core.check_invariants()
        return res

    def until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("core did not go idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.outputs[rid])

    def final(self, rid: str) -> EngineOutput:
        finals = [o for o in self.outputs[rid] if o.finish_reason is not None]
        assert len(finals) == 1, finals
        assert self.outputs[rid][-1] is finals[0]
        return finals[0]


def apply_events(state: set[int], events: Iterable[KvEvent]) -> None:
    for ev in events:
        match ev:
            case BlockStored(block_hashes=hs):
                assert not state & set(hs), "stored a hash that was already cached"
                state.update(hs)
            case BlockRemoved(block_hashes=hs):
                assert set(hs) <= state, "removed a hash that was not cached"
                state.difference_update(hs)
            case AllCleared():
                state.clear()


def solo(core_options: dict[str, object], r: EngineRequest) -> Run:
    run = Run(make_core(**core_options))  # type: ignore[arg-type]
    run.add(r)
    run.until_idle()
    return run


# ------------------------------------------------------------------ prefix caching


def test_repeated_prompt_skips_its_cached_blocks() -> None:
    run = Run(make_core())
    p = prompt(100)  # 6 full blocks of 16 and 4 tokens
    run.add(req("a", p, max_tokens=4, ignore_eos=True))
    run.until_idle()
    first_prefill = run.steps[0].prefill_tokens
    assert run.final("a").cached_tokens == 0
    assert first_prefill == 100

    mark = len(run.steps)
    run.add(req("b", p, max_tokens=4, ignore_eos=True, seed=7))
    run.until_idle()
    assert run.final("b").cached_tokens == 96
    assert run.steps[mark].prefill_tokens == 4  # only the uncached tail is computed
    assert run.steps[mark].duration < run.steps[0].duration


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    # vLLM needs logits, so at least one token is computed: a 96-token prompt whose
    # 6 blocks are all cached reuses 5 and recomputes the last block.
    run = Run(make_core())
    p = prompt(96)
    run.add(req("a", p, max_tokens=2, ignore_eos=True))
    run.until_idle()
    mark = len(run.steps)
    run.add(req("b", p, max_tokens=2, ignore_eos=True))
    run.until_idle()
    assert run.final("b").cached_tokens == 80
    assert run.steps[mark].prefill_tokens == 16


def test_decode_filled_blocks_are_hashed_and_reusable() -> None:
    run = Run(make_core())
    p = prompt(20)
    run.add(req("a", p, max_tokens=30, ignore_eos=True))
    run.until_idle()
    out = run.tokens("a")
    # 50 tokens, 49 computed (the last sampled one never is): 3 full blocks.
    expected = block_hashes(p + out, 16)[:3]
    assert set(expected) <= set(run.core.kv_snapshot())
    # The next turn of the conversation (prompt + answer + more) hits all three.
    run.add(req("b", p + out + prompt(10, base=3), max_tokens=1))
    run.until_idle()
    assert run.final("b").cached_tokens == 48


def test_lora_blocks_hash_in_their_own_namespace() -> None:
    run = Run(make_core(lora_adapters=["sql"]))
    p = prompt(40)
    r = req("a", p, max_tokens=1)
    r.lora = "sql"
    run.add(r)
    run.until_idle()
    stored = [ev for ev in run.events if isinstance(ev, BlockStored)]
    assert [h for ev in stored for h in ev.block_hashes] == block_hashes(p, 16, salt="sql")
    assert all(ev.lora == "sql" for ev in stored)
    # The base model does not hit the adapter's blocks.
    run.add(req("b", p, max_tokens=1))
    run.until_idle()
    assert run.final("b").cached_tokens == 0


def test_prefix_caching_can_be_disabled() -> None:
    run = Run(make_core(enable_prefix_caching=False))
    p = prompt(64)
    for rid in ("a", "b"):
        run.add(req(rid, p, max_tokens=2, ignore_eos=True))
        run.until_idle()
    assert run.final("b").cached_tokens == 0
    assert run.events == []
    assert run.core.kv_snapshot() == []


# ---------------------------------------------------------------- scheduling


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    # Budget 64: a running decode keeps its token while a 600-token prompt is chunked.
    run = Run(make_core(max_num_batched_tokens=64))
    run.add(req("short", prompt(10), max_tokens=20, ignore_eos=True))
    run.step()
    run.add(req("long", prompt(600, base=1), max_tokens=1))
    prefill_steps = 0
    remaining = 600
    while run.core.has_work():
        short_running = not run.outputs["short"][-1].finish_reason
        res = run.step()
        assert res is not None
        assert res.prefill_tokens + res.decode_seqs <= 64
        if short_running:
            assert res.decode_seqs == 1  # the decode was not starved by the chunk
            assert res.prefill_tokens == min(63, remaining)  # the chunk got the rest
            prefill_steps += 1
        remaining -= res.prefill_tokens
    assert prefill_steps == 19 and remaining == 0
    assert run.final("short").completion_tokens == 20
    assert run.final("long").completion_tokens == 1


def test_max_num_seqs_caps_the_batch_and_priority_orders_admission() -> None:
    run = Run(make_core(max_num_seqs=2))
    for i in range(3):
        run.add(req(f"low{i}", prompt(8, base=i), max_tokens=3, ignore_eos=True))
    high = req("high", prompt(8, base=9), max_tokens=3, ignore_eos=True)
    high.priority = 5
    run.add(high)
    res = run.step()
    assert res is not None and res.num_scheduled == 2
    assert run.core.num_running == 2 and run.core.num_waiting == 2
    assert run.outputs["high"][0].timings.first_token == res.end  # admitted first
    assert "low1" not in run.outputs  # arrival order among equals: low0 went with high
    run.until_idle()
    assert all(run.final(f"low{i}").completion_tokens == 3 for i in range(3))


def test_preemption_under_pressure_and_preempted_requests_still_finish() -> None:
    # 16 blocks of 16 tokens; six requests of 40 + 60 tokens need 7 blocks each.
    options: dict[str, object] = {"num_kv_blocks": 16, "max_model_len": 256}
    run = Run(make_core(**options))  # type: ignore[arg-type]
    reqs = [req(f"r{i}", prompt(40, base=i), max_tokens=60, ignore_eos=True, seed=i) for i in range(6)]
    for r in reqs:
        run.add(r)
    peak = 0
    while run.core.has_work():
        run.step()
        peak = max(peak, run.core.pool.num_used)
    assert run.core.preemptions > 0
    assert sum(s.preempted for s in run.steps) == run.core.preemptions
    assert peak == 16
    assert run.core.pool.num_used == 0
    for r in reqs:
        final = run.final(r.request_id)
        assert final.finish_reason == "length" and final.completion_tokens == 60
        # Recompute preemption must not change what is generated.
        alone = solo(
            options,
            req(r.request_id, r.prompt_token_ids, max_tokens=60, ignore_eos=True, seed=int(r.request_id[1:])),
        )
        assert run.tokens(r.request_id) == alone.tokens(r.request_id)
        assert run.text(r.request_id) == alone.text(r.request_id)


def test_preemption_takes_the_newest_request_first() -> None:
    # vLLM's FCFS rule: the oldest running request keeps its blocks; newer ones yield.
    run = Run(make_core(num_kv_blocks=8, max_model_len=128))
    run.add(req("oldest", prompt(30), max_tokens=90, ignore_eos=True))
    run.step()
    for i in range(2):
        run.add(req(f"newer{i}", prompt(30, base=i + 1), max_tokens=90, ignore_eos=True))
    run.until_idle()
    assert run.core.preemptions > 0
    t = run.final("oldest").timings
    assert len([s for s in run.steps if t.first_token <= s.end <= t.finished]) == 90


def test_preemption_spares_the_higher_priority_request() -> None:
    # 8 blocks of 16 = 128 tokens; the important request alone grows to 120.
    run = Run(make_core(num_kv_blocks=8, max_model_len=128))
    important = req("important", prompt(30), max_tokens=90, ignore_eos=True)
    important.priority = 1
    run.add(important)
    run.step()
    for i in range(3):
        run.add(req(f"bulk{i}", prompt(30, base=i + 1), max_tokens=90, ignore_eos=True))
    run.until_idle()
    assert run.core.preemptions > 0
    # It got a token in every step from its first to its last: never the victim, even
    # though it is the oldest and the bulk requests were admitted after it.
    t = run.final("important").timings
    assert len([s for s in run.steps if t.first_token <= s.end <= t.finished]) == 90
    assert all(run.final(f"bulk{i}").completion_tokens == 90 for i in range(3))


ADD, ABORT, STEP = 0, 1, 2
# (kind, a, b, c, d): add = (prompt length, max_tokens, shared prefix, priority + 3·ignore_eos),
# abort = (which live request), step = (how many steps).
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just(ADD), st.integers(1, 70), st.integers(1, 60), st.integers(0, 3), st.integers(0, 5)),
        # Long, EOS-ignoring requests: memory pressure, so preemption is common.
        st.tuples(
            st.just(ADD), st.integers(20, 50), st.integers(30, 60), st.integers(0, 3), st.integers(3, 5)
        ),
        st.tuples(st.just(ABORT), st.integers(0, 1000), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just(STEP), st.integers(1, 6), st.just(0), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, num_blocks=st.integers(8, 16), caching=st.booleans())
def test_blocks_return_to_baseline_after_any_mix(
    ops: list[tuple[int, int, int, int, int]], num_blocks: int, caching: bool
) -> None:
    core = make_core(
        num_kv_blocks=num_blocks,
        block_size=8,
        max_model_len=num_blocks * 8,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        enable_prefix_caching=caching,
    )
    run = Run(core)
    prefixes = [prompt(40, base=b) for b in range(4)]
    added: list[str] = []
    aborted: set[str] = set()
    state: set[int] = set()
    for n, (kind, a, b, c, d) in enumerate(ops):
        if kind == ADD:
            tokens = (prefixes[c] + prompt(70, base=n + 5))[:a]
            r = req(f"q{n}", tokens, max_tokens=b, ignore_eos=d >= 3)
            r.priority = d % 3
            if run.add(r) is None:
                added.append(r.request_id)
        elif kind == ABORT:
            live = core.request_ids()
            if live:
                rid = live[a % len(live)]
                out = core.abort(rid, run.now)
                assert out is not None and out.finish_reason == "abort"
                run.outputs.setdefault(rid, []).append(out)
                aborted.add(rid)
                core.check_invariants()
        else:
            for _ in range(a):
                run.step()
        apply_events(state, run.events)
        run.events.clear()
        assert state == set(core.kv_snapshot())
    run.until_idle()
    apply_events(state, run.events)
    assert state == set(core.kv_snapshot())
    assert core.pool.num_used == 0
    assert all(blk.ref_cnt == 0 for blk in core.pool.blocks)
    assert core.pool.num_free == num_blocks
    assert not core.has_work() and core.request_ids() == []
    for rid in added:
        final = run.final(rid)  # exactly one final output each, preempted or not
        assert (final.finish_reason == "abort") == (rid in aborted)
        if rid not in aborted:
            assert final.finish_reason in ("stop", "length")


# ------------------------------------------------------------------ step times


def simulate_batch(batch: int, input_len: int = 128, output_len: int = 64) -> tuple[float, float]:
    """(output tokens/s over the run, mean TPOT in s) in simulated time."""
    run = Run(make_core("llama-3.1-8b-h100", num_kv_blocks=4096))
    for i in range(batch):
        run.add(req(f"b{i}", prompt(input_len, base=i), max_tokens=output_len, ignore_eos=True))
    run.until_idle()
    tpots = []
    for i in range(batch):
        t = run.final(f"b{i}").timings
        tpots.append((t.finished - t.first_token) / (output_len - 1))
    return batch * output_len / run.now, sum(tpots) / batch


def test_throughput_rises_and_tpot_worsens_with_batch_size() -> None:
    results = [simulate_batch(b) for b in (1, 8, 32, 128)]
    tputs = [r[0] for r in results]
    tpots = [r[1] for r in results]
    assert tputs == sorted(tputs) and len(set(tputs)) == 4
    assert tpots == sorted(tpots) and len(set(tpots)) == 4
    assert tputs[-1] > 10 * tputs[0]
    # Batch 1 decode is exactly the profile's formula: base + one sequence + its context.
    costs = load_profile("llama-3.1-8b-h100").costs
    mean_context = 128 + 64 / 2
    assert tpots[0] == pytest.approx(costs.decode_tpot(1, int(mean_context)), rel=0.01)


def test_step_time_follows_the_profile_formula() -> None:
    run = Run(make_core("llama-3.1-8b-h100", num_kv_blocks=1024))
    run.add(req("a", prompt(300), max_tokens=3, ignore_eos=True))
    first = run.step()
    second = run.step()
    assert first is not None and second is not None
    c = load_profile("llama-3.1-8b-h100").costs
    assert first.duration == pytest.approx(c.base_s + 300 * c.per_prefill_token_s + 300 * c.per_kv_token_s)
    assert second.duration == pytest.approx(c.base_s + c.per_decode_seq_s + 301 * c.per_kv_token_s)


# -------------------------------------------------------------------- text output


def test_text_is_readable_words_and_deterministic() -> None:
    a = solo({}, req("x", prompt(12), max_tokens=200, ignore_eos=True, seed=3))
    b = solo({}, req("other-id", prompt(12), max_tokens=200, ignore_eos=True, seed=3))
    c = solo({}, req("x", prompt(12), max_tokens=200, ignore_eos=True, seed=4))
    d = solo({}, req("x", prompt(12, base=2), max_tokens=200, ignore_eos=True, seed=3))
    text = a.text("x")
    assert re.fullmatch(r"[a-z ]+", text)
    assert set(text.split()[:-1]) <= set(WORDS)  # the last word may be cut by max_tokens
    assert "  " not in text
    assert a.tokens("x") == b.tokens("other-id")  # same seed, same prompt
    assert a.tokens("x") != c.tokens("x")  # another seed
    assert a.tokens("x") != d.tokens("x")  # another prompt
    assert TOK.decode(a.tokens("x")) == text
    # Without a seed the request id decides.
    e = solo({}, req("y", prompt(12), max_tokens=50, ignore_eos=True))
    f = solo({}, req("z", prompt(12), max_tokens=50, ignore_eos=True))
    assert e.tokens("y") != f.tokens("z")


def test_same_text_regardless_of_batching() -> None:
    target = req("t", prompt(50), max_tokens=120, seed=11)
    alone = solo({}, target)
    run = Run(make_core(max_num_batched_tokens=40))
    for i in range(8):
        run.add(req(f"n{i}", prompt(30 + 17 * i, base=i + 1), max_tokens=10 + 13 * i))
        if i == 3:
            run.add(req("t", prompt(50), max_tokens=120, seed=11))
        run.step()
    run.until_idle()
    assert run.tokens("t") == alone.tokens("t")
    assert run.text("t") == alone.text("t")
    assert run.final("t").finish_reason == alone.final("t").finish_reason


def test_eos_ends_generation_unless_ignored() -> None:
    run = solo({}, req("e", prompt(8), max_tokens=900, seed=5))
    final = run.final("e")
    toks = run.tokens("e")
    assert final.finish_reason == "stop"
    assert toks[-1] == EOS and EOS not in toks[:-1]
    assert final.completion_tokens == len(toks) < 900
    assert run.text("e") == TOK.decode(toks) and not run.text("e").endswith(" ")
    ignoring = solo({}, req("e", prompt(8), max_tokens=900, seed=5, ignore_eos=True))
    assert ignoring.final("e").finish_reason == "length"
    assert ignoring.final("e").completion_tokens == 900
    assert EOS not in ignoring.tokens("e")
    # Up to the EOS the two runs agree; there the ignoring run has a space.
    k = len(toks) - 1
    assert ignoring.tokens("e")[:k] == toks[:k]
    assert ignoring.tokens("e")[k] == ord(" ") + 3


def test_min_tokens_suppresses_early_eos() -> None:
    base = solo({}, req("m", prompt(8), max_tokens=900, seed=5))
    eos_at = len(base.tokens("m"))
    run = solo({}, req("m", prompt(8), max_tokens=900, seed=5, min_tokens=eos_at + 3))
    assert run.final("m").completion_tokens >= eos_at + 3
    assert EOS not in run.tokens("m")[: eos_at + 2]


def test_max_tokens_caps_output() -> None:
    for n in (1, 2, 37):
        run = solo({}, req("l", prompt(8), max_tokens=n, ignore_eos=True))
        assert run.final("l").finish_reason == "length"
        assert len(run.tokens("l")) == run.final("l").completion_tokens == n
        assert len(run.outputs["l"]) == n  # one output per step that produced a token


def test_stop_string_cuts_text_before_it_and_is_never_streamed() -> None:
    plain = solo({}, req("s", prompt(8), max_tokens=300, ignore_eos=True, seed=2))
    text = plain.text("s")
    words = text.split()
    stop = " " + words[6] + " " + words[7]
    cut = text.find(stop)
    assert cut > 0
    run = solo({}, req("s", prompt(8), max_tokens=300, ignore_eos=True, seed=2, stop=[stop, "zzz-never"]))
    final = run.final("s")
    assert final.finish_reason == "stop"
    assert run.text("s") == text[:cut]
    # Tokens include the stop string's (as vLLM's token ids do); text never showed it.
    assert TOK.decode(run.tokens("s")) == text[: cut + len(stop)]
    streamed = ""
    for o in run.outputs["s"]:
        streamed += o.text
        assert text[:cut].startswith(streamed)


def test_stop_token_ids_end_generation_without_their_text() -> None:
    plain = solo({}, req("s", prompt(8), max_tokens=100, ignore_eos=True, seed=9))
    toks = plain.tokens("s")
    stop_tok = toks[10]
    first = toks.index(stop_tok)
    run = solo({}, req("s", prompt(8), max_tokens=100, ignore_eos=True, seed=9, stop_token_ids=[stop_tok]))
    assert run.final("s").finish_reason == "stop"
    assert run.tokens("s") == toks[: first + 1]
    assert run.text("s") == TOK.decode(toks[:first])


def test_max_model_len_caps_generation() -> None:
    run = solo({"max_model_len": 64}, req("c", prompt(60), max_tokens=100, ignore_eos=True))
    assert run.final("c").finish_reason == "length"
    assert run.final("c").completion_tokens == 4


# ------------------------------------------------------------------- continuation


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 16, 33, 59])
def test_continuation_equals_an_uninterrupted_run(seed: int, k: int) -> None:
    p = prompt(21)
    full = solo({}, req("c", p, max_tokens=60, seed=seed, stop=["quiet light"]))
    toks = full.tokens("c")
    if k >= len(toks):
        k = len(toks) - 1
    cont_req = req("c", p + toks[:k], max_tokens=60, seed=seed, stop=["quiet light"])
    cont_req.output_offset = k
    cont = solo({}, cont_req)
    assert cont.tokens("c") == toks[k:]
    assert cont.final("c").finish_reason == full.final("c").finish_reason
    assert cont.final("c").completion_tokens == len(toks) - k
    assert cont.final("c").prompt_tokens == len(p) + k


def test_continuation_finds_a_stop_string_across_the_migration_point() -> None:
    p = prompt(10)
    plain = solo({}, req("c", p, max_tokens=200, ignore_eos=True, seed=4))
    text = plain.text("c")
    words = text.split()
    stop = words[4] + " " + words[5]
    at = text.find(stop)
    full = solo({}, req("c", p, max_tokens=200, ignore_eos=True, seed=4, stop=[stop]))
    end = at + len(stop)  # tokens up to the stop string's last character
    assert full.tokens("c") == plain.tokens("c")[:end]
    k = at + 2  # the previous worker died inside the stop string
    cont_req = req("c", p + plain.tokens("c")[:k], max_tokens=200, ignore_eos=True, seed=4, stop=[stop])
    cont_req.output_offset = k
    cont = solo({}, cont_req)
    assert cont.final("c").finish_reason == "stop"
    assert cont.tokens("c") == plain.tokens("c")[k:end]
    assert cont.text("c") == ""


def test_continuation_already_at_max_tokens_finishes_at_once() -> None:
    core = make_core()
    r = req("c", prompt(30), max_tokens=5)
    r.output_offset = 5
    out = core.add_request(r, 0.0)
    assert out is not None and out.finish_reason == "length" and out.new_token_ids == []
    assert not core.has_work()


# --------------------------------------------------------------------- rejection


def test_over_long_prompt_gets_an_error_output() -> None:
    core = make_core()  # 64 blocks of 16: max_model_len 1024
    assert core.config.max_model_len == 1024
    for n in (1025, 64 * 16 + 500):
        out = core.add_request(req(f"long{n}", prompt(n)), 0.0)
        assert out is not None and out.finish_reason == "error"
        assert out.error and "max_model_len" in out.error
        assert out.prompt_tokens == n
    assert not core.has_work() and core.pool.num_used == 0
    # The longest allowed prompt runs (it fills the whole cache) and stops at the cap.
    run = Run(core)
    run.add(req("max", prompt(1024), max_tokens=5))
    run.until_idle()
    assert run.final("max").finish_reason == "length" and run.final("max").completion_tokens == 1


def test_other_invalid_requests_get_error_outputs() -> None:
    core = make_core(lora_adapters=["a"])
    bad = [req("empty", [])]
    r = req("lora", prompt(5))
    r.lora = "nope"
    bad.append(r)
    bad.append(req("zero", prompt(5), max_tokens=0))
    r = req("offset", prompt(5))
    r.output_offset = 6
    bad.append(r)
    for b in bad:
        out = core.add_request(b, 1.0)
        assert out is not None and out.finish_reason == "error" and out.error, b.request_id
        assert out.timings.arrival == out.timings.finished == 1.0
    assert not core.has_work()


def test_duplicate_request_id_raises() -> None:
    core = make_core()
    assert core.add_request(req("d", prompt(5)), 0.0) is None
    with pytest.raises(ValueError):
        core.add_request(req("d", prompt(5)), 0.0)


def test_config_rejects_max_model_len_beyond_the_cache() -> None:
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        SimConfig.build("tiny-test", num_kv_blocks=4, max_model_len=65)


# --------------------------------------------------------------------- KV events


def test_kv_events_match_the_snapshot_through_evictions() -> None:
    run = Run(make_core(num_kv_blocks=12, max_model_len=192))
    state: set[int] = set()
    stored_parents: list[int | None] = []
    for i in range(10):
        run.add(req(f"k{i}", prompt(35 + 9 * i, base=i % 3), max_tokens=12, ignore_eos=True))
        for _ in range(3):
            run.step()
            apply_events(state, run.events)
            stored_parents += [ev.parent_hash for ev in run.events if isinstance(ev, BlockStored)]
            run.events.clear()
            assert state == set(run.core.kv_snapshot())
    run.until_idle()
    apply_events(state, run.events)
    assert state == set(run.core.kv_snapshot())
    removed = [
        h for s in run.steps for ev in s.kv_events if isinstance(ev, BlockRemoved) for h in ev.block_hashes
    ]
    assert removed, "the small pool must have evicted something"
    assert None in stored_parents and any(p is not None for p in stored_parents)


def test_block_stored_events_chain_like_proto_hashing() -> None:
    run = Run(make_core())
    p = prompt(300)  # two prefill chunks of the 256-token budget: two stored events
    run.add(req("h", p, max_tokens=1))
    run.until_idle()
    stored = [ev for ev in run.events if isinstance(ev, BlockStored)]
    hashes = block_hashes(p, 16)
    assert [h for ev in stored for h in ev.block_hashes] == hashes
    assert len(stored) == 2
    assert stored[0].parent_hash is None and stored[0].block_size == 16
    for ev in stored[1:]:
        assert ev.parent_hash == hashes[hashes.index(ev.block_hashes[0]) - 1]


def test_reset_prefix_cache_only_when_idle() -> None:
    run = Run(make_core())
    run.add(req("r", prompt(40), max_tokens=20, ignore_eos=True))
    run.step()
    assert not run.core.reset_prefix_cache()
    run.until_idle()
    assert run.core.kv_snapshot()
    assert run.core.reset_prefix_cache()
    assert run.core.kv_snapshot() == []
    assert run.core.take_kv_events() == [AllCleared()]


# -------------------------------------------------------------------------- stats


def test_stats_report_load_and_rates() -> None:
    core = make_core(max_num_seqs=2, max_num_batched_tokens=150)
    fresh = core.stats(0.0)
    assert fresh.prefill_tokens_per_s > 0 and fresh.decode_tokens_per_s > 0  # profile priors
    run = Run(core)
    for i in range(3):
        run.add(req(f"s{i}", prompt(100, base=i), max_tokens=50, ignore_eos=True))
    run.step()  # s0 prefilled whole (100), s1 a 50-token chunk, s2 waits for a slot
    s = core.stats(run.now)
    assert (s.running, s.waiting) == (2, 1)
    assert s.queued_prefill_tokens == 100 + 50
    assert s.kv_blocks_total == 64 and s.kv_blocks_used == 7 + 4
    assert s.kv_usage == pytest.approx(11 / 64)
    assert s.running_tokens == 101 + 100
    assert s.prefill_tokens_per_s == pytest.approx(150 / run.steps[0].duration)
    assert s.decode_tokens_per_s == pytest.approx(1 / run.steps[0].duration)
    assert s.step_time_s == pytest.approx(run.steps[0].duration)
    assert s.kv_events_mode == "engine" and s.preemptions == 0
    run.until_idle()
    # The same prompt again: 96 of its 100 tokens hit.
    run.add(req("again", prompt(100, base=0), max_tokens=1))
    run.until_idle()
    s = core.stats(run.now)
    assert s.prefix_hit_rate == pytest.approx(96 / 400)
    assert s.waiting == s.running == s.kv_blocks_used == s.queued_prefill_tokens == 0
    # Idle for longer than the window: the rates hold their last value.
    later = core.stats(run.now + 100.0)
    assert later.decode_tokens_per_s == s.decode_tokens_per_s
    assert later.prefill_tokens_per_s == s.prefill_tokens_per_s


def test_prefill_rate_is_the_capacity_not_the_speed_of_light_steps() -> None:
    # The 8B/H100 profile: 6.2 ms per step plus 70 us per prefill token, 8192-token budget.
    core = make_core("llama-3.1-8b-h100", max_num_batched_tokens=2048)
    costs = core.config.profile.costs
    capacity = core.stats(0.0).prefill_tokens_per_s
    assert capacity == pytest.approx(2048 / costs.step_time(2048, 0, 0))  # the profile's prior
    run = Run(core)
    # Light load: short, then fully cached prompts, one at a time. Their steps are mostly
    # the fixed per-step cost (a cached prompt prefills 1-2 tokens a step: ~300 tokens/s).
    for i in range(20):
        run.add(req(f"light{i}", prompt(64, base=i % 2), max_tokens=4, ignore_eos=True))
        run.until_idle()
    assert core.stats(run.now).prefill_tokens_per_s == capacity
    # Busy: a queue of long prompts fills every step's budget; the rate is measured there.
    for i in range(8):
        run.add(req(f"long{i}", prompt(4096, base=10 + i), max_tokens=2))
    for _ in range(6):
        run.step()
    busy = core.stats(run.now).prefill_tokens_per_s
    full_steps = [st for st in run.steps[-6:] if st.prefill_tokens >= 1024]
    assert busy == pytest.approx(sum(st.prefill_tokens for st in full_steps) / sum(st.duration for st in full_steps))
    assert 0.9 * capacity < busy <= capacity
    run.until_idle()
    # and light load after it keeps the measured figure
    for i in range(5):
        run.add(req(f"after{i}", prompt(64, base=i % 2), max_tokens=4, ignore_eos=True))
        run.until_idle()
    assert core.stats(run.now).prefill_tokens_per_s == pytest.approx(busy, rel=0.05)


def test_a_prefill_under_way_counts_as_queued_until_its_step_ends() -> None:
    # The core computes a step at its start; the shell sleeps its duration. A request
    # arriving meanwhile waits for it: the gauge says so, as vLLM's does (prompt tokens of
    # requests without a first token), or admission and the router see an idle replica.
    core = make_core("llama-3.1-8b-h100", max_num_batched_tokens=2048)
    run = Run(core)
    run.add(req("long", prompt(2048), max_tokens=2))
    start = run.now
    res = run.step()
    assert res is not None and res.prefill_tokens == 2048
    assert core.stats(start + res.duration / 2).queued_prefill_tokens == 2048
    assert core.stats(res.end).queued_prefill_tokens == 0


# ----------------------------------------------------------------------- profiles


def test_profiles_load_by_name_and_path(tmp_path: Path) -> None:
    assert {"llama-3.1-8b-h100", "tiny-test"} <= set(available_profiles())
    prof = load_profile("llama-3.1-8b-h100")
    assert prof.comment and len(prof.intended) == 4
    assert [p.batch for p in prof.intended] == [1, 8, 32, 128]
    assert prof.memory.num_blocks(16) == 28181
    # The intended points are what the coefficients give at the reference workload.
    for point in prof.intended:
        tpot = prof.costs.decode_tpot(point.batch, prof.reference_context)
        assert point.tpot_ms == pytest.approx(tpot * 1000, rel=0.02)
        assert point.output_tokens_per_s == pytest.approx(point.batch / tpot, rel=0.02)
    data = json.loads(
        (Path(__file__).parents[2] / "services/worker/engines/profiles/tiny-test.json").read_text()
    )
    data["name"] = "custom"
    data["step"]["base_s"] = 0.5
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(data))
    custom = load_profile(str(path))
    assert custom.name == "custom" and custom.costs.base_s == 0.5
    with pytest.raises(ValueError, match="unknown sim profile"):
        load_profile("no-such-profile")
    del data["step"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing 'step'"):
        load_profile(path)


def test_memory_budget_sets_the_block_count() -> None:
    cfg = SimConfig.build("llama-3.1-8b-h100", hbm_bytes=40 * 2**30)
    free = 40 * 2**30 - 16060522496 - 10737418240
    assert cfg.num_blocks == free // (131072 * 16)
    assert SimConfig.build("llama-3.1-8b-h100", num_kv_blocks=100).num_blocks == 100
    with pytest.raises(ValueError):
        SimConfig.build("llama-3.1-8b-h100", hbm_bytes=10 * 2**30)


def test_a_step_starting_from_idle_pays_the_wake_cost_and_a_busy_one_does_not() -> None:
    """Issue 18: vLLM's CPU build took 2.5 ms longer for a step after idle than for the same
    step on a busy engine; the profile's ``idle_wake_s`` models it, and only there."""
    import dataclasses

    base = load_profile("tiny-test")
    woken = dataclasses.replace(base, costs=dataclasses.replace(base.costs, idle_wake_s=0.004))
    plain, waking = Run(SimCore(SimConfig.build(base))), Run(SimCore(SimConfig.build(woken)))
    for run in (plain, waking):
        run.add(req("a", prompt(40), max_tokens=3, ignore_eos=True))
        while run.step() is not None:  # from idle, then busy
            pass
        run.now += 1.0  # idle again
        run.add(req("b", prompt(40, base=1), max_tokens=3, ignore_eos=True))
        while run.step() is not None:
            pass
    durations = [[s.end - s.start for s in run.steps] for run in (plain, waking)]
    assert len(durations[0]) == len(durations[1]) == 6
    extra = [w - p for p, w in zip(*durations, strict=True)]
    assert extra == pytest.approx([0.004, 0, 0, 0.004, 0, 0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0.0005, 0.4), st.integers(0, 3), st.sampled_from([0.0, 0.0, 0.0, 2.5])),
                min_size=1, max_size=200))
def test_the_hit_window_keeps_the_sums_a_recount_of_its_records_reads(steps: list[tuple[float, int, float]]) -> None:
    from services.worker.engines.sim_core import _HitRecord, _HitWindow

    win = _HitWindow(span=1.0)
    now = 0.0
    for duration, queries, idle in steps:
        now += idle + duration
        win.add(_HitRecord(now, queries, queries // 2))
        win.prune(now)
        assert all(h.t >= now - 1.0 for h in win.hits)
        assert (win.queries, win.query_hits) == (sum(h.queries for h in win.hits), sum(h.hits for h in win.hits))


def test_a_kv_cache_past_what_the_sim_can_hold_is_refused() -> None:
    """The sim keeps an object per block: --num-kv-blocks 10^10 ran the host out of memory."""
    from services.worker.engines.sim_profile import MAX_KV_BLOCKS, SimConfig

    with pytest.raises(ValueError, match="KV blocks"):
        SimConfig.build("tiny-test", num_kv_blocks=10**10)
    assert SimConfig.build("tiny-test", num_kv_blocks=4096).num_blocks == 4096
    assert SimConfig.build("tiny-test", hbm_bytes=10**15).num_blocks <= MAX_KV_BLOCKS  # a budget is clamped
