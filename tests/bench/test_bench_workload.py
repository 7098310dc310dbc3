"""Workloads: exact token lengths, determinism, shared prefixes, sessions, traces."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from ops.bench.bodies import build_body
from ops.bench.config import BenchConfig, EndpointConfig, WorkloadConfig
from ops.bench.runner import LazyPlan, arrival_offsets, plan_sessions, planned_turns
from ops.bench.workload import (
    MAX_LENGTH,
    LengthDist,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    TextFactory,
    TraceWorkload,
    parse_trace,
)
from services.common.tokenizer import HFTokenizer

BYTE = TextFactory("byte")


def test_length_dist_parse_and_sample() -> None:
    g = np.random.default_rng(0)
    assert LengthDist.parse("512").sample_int(g) == 512
    assert LengthDist.parse("fixed:7").sample_int(g) == 7
    u = [LengthDist.parse("uniform:10:12").sample_int(g) for _ in range(300)]
    assert set(u) == {10, 11, 12}
    n = np.array([LengthDist.parse("normal:500:50").sample_int(g) for _ in range(4000)])
    assert n.mean() == pytest.approx(500, rel=0.02) and n.std() == pytest.approx(50, rel=0.08)
    ln = np.array([LengthDist.parse("lognormal:300:0.6").sample_int(g) for _ in range(8000)])
    assert ln.mean() == pytest.approx(300, rel=0.04)  # the given mean is the arithmetic mean
    assert LengthDist.parse("normal:1:50").sample_int(g, lo=1) >= 1
    assert LengthDist.parse("exponential:2").sample_time(g) >= 0
    for bad in ("uniform:5", "zipf:1:2", "normal:a:b", "uniform:9:3", "nan", "normal:inf:1", "uniform:1:inf",
                "normal:512:nan"):
        with pytest.raises(ValueError, match=f"bad distribution '{bad}'"):
            LengthDist.parse(bad)
    # A tail past float range (lognormal sigma 40) is clamped, never an OverflowError.
    assert LengthDist.parse("lognormal:512:40").sample_int(g, hi=1000) <= 1000
    assert max(LengthDist.parse("lognormal:512:40").sample_int(g) for _ in range(200)) <= MAX_LENGTH
    assert str(LengthDist.parse("uniform:1:2")) == "uniform:1:2"


@pytest.mark.parametrize("n", [0, 1, 2, 5, 16, 127, 512, 3000])
def test_byte_text_is_exact(n: int) -> None:
    text = BYTE.text(n, np.random.default_rng(n))
    assert len(text.encode()) == n == BYTE.count(text)


def test_random_workload_exact_and_deterministic() -> None:
    wl = RandomWorkload(BYTE, LengthDist.parse("uniform:1:400"), LengthDist.parse("normal:64:16"), seed=3)
    again = RandomWorkload(BYTE, LengthDist.parse("uniform:1:400"), LengthDist.parse("normal:64:16"), seed=3)
    sessions = [wl.session(i) for i in range(60)]
    for s in sessions:
        (t,) = s.turns
        assert t.user_tokens == len(t.user.encode()) and 1 <= t.user_tokens <= 400
        assert s.input_tokens(0) == t.user_tokens
    assert again.session(42) == sessions[42]  # independent of order and of what came before
    assert len({s.turns[0].user for s in sessions}) == 60  # distinct prompts
    assert len({s.seed for s in sessions}) == 60
    other = RandomWorkload(BYTE, LengthDist.parse("uniform:1:400"), LengthDist.parse("normal:64:16"), seed=4)
    assert other.session(0) != sessions[0]


def test_shared_prefix_workload() -> None:
    wl = SharedPrefixWorkload(BYTE, groups=3, prefix_tokens=LengthDist.parse("100"), input_tokens=LengthDist.parse("20"),
                              output_tokens=LengthDist.parse("8"), seed=1)
    sessions = [wl.session(i) for i in range(40)]
    prefixes = {s.system for s in sessions}
    assert len(prefixes) == 3 and all(len(p.encode()) == 100 for p in prefixes)
    assert {s.group for s in sessions} == {0, 1, 2}
    for s in sessions:
        assert s.system_tokens == 100 and s.input_tokens(0) == 120
        assert s.group is not None and s.system == wl.prefix(s.group)[0]
    assert len({s.turns[0].user for s in sessions}) == 40  # distinct suffixes
    body = build_body("completions", "m", sessions[0], 0)
    assert len(body["prompt"].encode()) == 120 and body["prompt"].startswith(sessions[0].system)


def test_shared_prefix_lengths_drawn_once_per_group() -> None:
    wl = WorkloadConfig(kind="shared-prefix", prefix_groups=6, prefix_tokens="uniform:50:150",
                        input_tokens="10", output_tokens="4").build(seed=3)
    assert isinstance(wl, SharedPrefixWorkload)
    lengths = {s.group: s.system_tokens for s in (wl.session(i) for i in range(80))}
    assert len(lengths) == 6 and all(50 <= n <= 150 for n in lengths.values())
    assert len(set(lengths.values())) > 1  # the groups differ
    again = WorkloadConfig(kind="shared-prefix", prefix_groups=6, prefix_tokens="uniform:50:150",
                           input_tokens="10", output_tokens="4").build(seed=3)
    assert isinstance(again, SharedPrefixWorkload)
    # reproducible per seed (a None group could not be left out unnoticed: the dicts would differ)
    assert {g: again.prefix(g)[1] for g in lengths if g is not None} == lengths
    with pytest.raises(ValueError, match="fixed"):
        WorkloadConfig(kind="multi-turn", prefix_tokens="uniform:1:9").build(seed=0)


def test_multi_turn_sessions_and_bodies() -> None:
    wl = MultiTurnWorkload(BYTE, turns=LengthDist.parse("3"), input_tokens=LengthDist.parse("10"),
                           output_tokens=LengthDist.parse("4"), think_time=LengthDist.parse("0.5"),
                           system_tokens=6, seed=2)
    s = wl.session(0)
    assert len(s.turns) == 3
    assert [t.think_time for t in s.turns] == [0.0, 0.5, 0.5]
    assert [t.reply_tokens for t in s.turns] == [4, 4, 0]
    assert [s.input_tokens(k) for k in range(3)] == [16, 30, 44]
    body = build_body("chat", "m", s, 2)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert sum(len(m["content"].encode()) for m in body["messages"]) == 44
    assert body["seed"] == s.seed + 2 and body["max_tokens"] == 4
    real = build_body("chat", "m", s, 2, history=["REAL", None])
    assert real["messages"][2]["content"] == "REAL" and real["messages"][4]["content"] == s.turns[1].reply
    comp = build_body("completions", "m", s, 1, extra={"temperature": 0})
    assert len(comp["prompt"].encode()) == 30 and comp["temperature"] == 0
    assert comp["stream"] is True and comp["ignore_eos"] is True
    assert comp["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in build_body("chat", "m", s, 0, ignore_eos=False)
    assert build_body("chat", "m", s, 0, continuous_usage=True)["stream_options"]["continuous_usage_stats"]


def test_plan_counts_requests_not_sessions() -> None:
    wl = MultiTurnWorkload(BYTE, turns=LengthDist.parse("3"), input_tokens=LengthDist.parse("5"),
                           output_tokens=LengthDist.parse("2"), think_time=LengthDist.parse("0"))
    plan = plan_sessions(wl, [0.0, 1.0, 2.0, 3.0], max_requests=7)
    assert [p.n_turns for p in plan] == [3, 3, 1]
    assert [p.offset for p in plan] == [0.0, 1.0, 2.0]
    assert len(plan_sessions(wl, [0.0, 1.0], max_requests=100)) == 2  # offsets run out first
    closed = plan_sessions(wl, None, max_requests=4)
    assert [p.n_turns for p in closed] == [3, 1]
    # A closed loop bounded by its duration alone is planned as it runs, the same sessions
    lazy = LazyPlan(wl, None)
    assert planned_turns(lazy) is None and planned_turns(closed) == 4
    assert [p.session for p in itertools.islice(lazy, 2)] == [p.session for p in closed]
    with pytest.raises(ValueError, match="bounded workload"):
        plan_sessions(wl, None, max_requests=None)


def test_parse_trace_spellings_units_and_errors() -> None:
    lines = [
        "# a comment",
        json.dumps({"timestamp": 2000, "input_length": 30, "output_length": 5, "hash_ids": [1, 2]}),
        "",
        json.dumps({"timestamp": 1000, "input_tokens": 10, "output_tokens": 3}),
        json.dumps({"time": 1500, "prompt": "hello", "max_tokens": 2}),
    ]
    entries = parse_trace(lines, time_unit="ms")
    assert [e.timestamp for e in entries] == [1.0, 1.5, 2.0]  # sorted, in seconds
    assert entries[0].input_tokens == 10 and entries[0].output_tokens == 3
    assert entries[1].text == "hello" and entries[1].input_tokens is None
    assert entries[2].hash_ids == (1, 2)
    for bad in ('{"input_tokens": 1, "output_tokens": 1}', '{"timestamp": 0, "input_tokens": 1}',
                '{"timestamp": 0, "output_tokens": 1}', "not json", "[1]",
                '{"timestamp": 0, "input_tokens": 1, "output_tokens": 0}'):
        with pytest.raises(ValueError, match="line 1"):
            parse_trace([bad])
    with pytest.raises(ValueError):
        parse_trace([], time_unit="h")


def test_trace_workload_lengths_and_shared_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0.0, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]},
        {"timestamp": 0.5, "input_length": 16, "output_length": 4, "hash_ids": [7, 9]},
        {"timestamp": 1.0, "input_length": 40, "output_length": 4, "hash_ids": [7]},
        {"timestamp": 2.0, "input_tokens": 12, "output_tokens": 6},
        {"timestamp": 3.0, "text": "héllo", "output_tokens": 1},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = WorkloadConfig(kind="trace", trace=str(path), trace_block_size=10)
    wl = cfg.build(seed=0)
    assert isinstance(wl, TraceWorkload) and wl.size == 5
    s = [wl.session(i) for i in range(5)]
    assert [x.turns[0].user_tokens for x in s] == [20, 16, 40, 12, 6]
    assert [x.turns[0].output_tokens for x in s] == [4, 4, 4, 6, 1]
    # Equal hash ids, equal text: the first block (10 tokens) is shared.
    assert s[0].turns[0].user[:10] == s[1].turns[0].user[:10] == s[2].turns[0].user[:10]
    assert s[0].turns[0].user[10:16] != s[1].turns[0].user[10:16]
    assert s[4].turns[0].user == "héllo"
    bench = BenchConfig(endpoints=[EndpointConfig("http://x/v1")], workload=cfg, num_requests=4)
    assert bench.arrival_kind == "trace"
    assert arrival_offsets(bench, wl, None).tolist() == [0.0, 0.5, 1.0, 2.0, 3.0]
    # native mean rate 4 gaps / 3 s; at 2 req/s the trace runs 1.5x faster
    assert arrival_offsets(bench, wl, 2.0).tolist() == pytest.approx([0, 1 / 3, 2 / 3, 4 / 3, 2.0])
    assert len(plan_sessions(wl, arrival_offsets(bench, wl, None), 4)) == 4


def _tiny_bpe(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ops.bench.workload import WORDS

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    g = np.random.default_rng(0)
    corpus = [" ".join(g.choice(WORDS, size=20)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_text_is_exact(tmp_path: Path) -> None:
    tf = TextFactory(HFTokenizer(_tiny_bpe(tmp_path)))
    g = np.random.default_rng(5)
    for n in (1, 3, 17, 64, 300):
        text = tf.text(n, g)
        assert len(tf.tokenizer.encode(text)) == n
