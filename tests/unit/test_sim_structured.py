"""The sim core's sampler surface (issue 16): structured outputs, log probabilities,
logit_bias, include_stop_str_in_output and special-token text."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from proto.messages import SamplingParams, StructuredOutput
from services.common.structured import from_json_schema
from services.common.tokenizer import ByteTokenizer
from services.worker.engines.base import EngineOutput, EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_core import SimCore
from services.worker.engines.sim_profile import SimConfig
from services.worker.engines.sim_sequence import EOS

TOK = ByteTokenizer()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
JSON_SO = from_json_schema(SCHEMA, "response_format.json_schema.schema")


def prompt(n: int) -> list[int]:
    return [3 + 32 + (i * 7 % 90) for i in range(n)]


def run(*reqs: EngineRequest, max_steps: int = 100_000, **core: object) -> dict[str, list[EngineOutput]]:
    """Every request to completion on one core; outputs per request id."""
    c = SimCore(SimConfig.build("tiny-test", **core))  # type: ignore[arg-type]
    outs: dict[str, list[EngineOutput]] = {}
    now = 0.0
    for r in reqs:
        rejected = c.add_request(r, now)
        if rejected is not None:
            outs[r.request_id] = [rejected]
    for _ in range(max_steps):
        res = c.step(now)
        if res is None:
            return outs
        now = res.end
        for o in res.outputs:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("did not finish")


def one(
    rid: str = "r", p: list[int] | None = None, offset: int = 0, **sampling: object
) -> list[EngineOutput]:
    r = EngineRequest(
        request_id=rid,
        prompt_token_ids=p if p is not None else prompt(12),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        output_offset=offset,
    )
    return run(r)[rid]


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# ---------------------------------------------------------------- structured outputs


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4, 5])
def test_a_json_schema_request_spells_a_valid_instance_then_eos(seed: int | None) -> None:
    outs = one(rid=f"j{seed}", seed=seed, max_tokens=500, structured=JSON_SO)
    body = text(outs)
    jsonschema.validate(json.loads(body), SCHEMA)
    assert outs[-1].finish_reason == "stop"
    assert tokens(outs) == [*TOK.encode(body), EOS]


def test_structured_regex_choice_grammar_and_json_object() -> None:
    cases: list[tuple[StructuredOutput, object]] = [
        (StructuredOutput(regex=r"[A-Z]{2}-\d{3,5}"), lambda s: re.fullmatch(r"[A-Z]{2}-\d{3,5}", s)),
        (StructuredOutput(choice=["yes", "no", "déjà vu"]), lambda s: s in {"yes", "no", "déjà vu"}),
        (
            StructuredOutput(grammar='root ::= "(" [a-c]+ ")" | "none"'),
            lambda s: re.fullmatch(r"\([a-c]+\)|none", s),
        ),
        (StructuredOutput(json_object=True), lambda s: isinstance(json.loads(s), dict)),
    ]
    for i, (so, ok) in enumerate(cases):
        for seed in range(8):
            outs = one(rid=f"s{i}", seed=seed, max_tokens=400, structured=so)
            assert ok(text(outs)), (so, text(outs))  # type: ignore[operator]
            assert outs[-1].finish_reason == "stop"


def test_non_ascii_choices_are_utf8_bytes_and_whole_characters_in_the_text() -> None:
    so = StructuredOutput(choice=["naïve café ☕"])
    outs = one(max_tokens=100, structured=so)
    assert text(outs) == "naïve café ☕"
    assert tokens(outs)[:-1] == TOK.encode("naïve café ☕")
    assert all("\ufffd" not in o.text for o in outs)


def test_max_tokens_cuts_an_instance_with_length() -> None:
    full = one(seed=3, max_tokens=500, structured=JSON_SO)
    cut = one(seed=3, max_tokens=10, structured=JSON_SO)
    assert cut[-1].finish_reason == "length"
    assert text(cut) == text(full)[:10]


def test_stop_strings_still_apply_to_an_instance() -> None:
    outs = one(seed=3, max_tokens=500, structured=JSON_SO, stop=['"age"'])
    assert outs[-1].finish_reason == "stop"
    full = text(one(seed=3, max_tokens=500, structured=JSON_SO))
    assert text(outs) == full[: full.index('"age"')]


@pytest.mark.parametrize("k", [1, 7, 20])
def test_a_migrated_structured_request_continues_the_same_instance(k: int) -> None:
    p = prompt(15)
    full = one(p=p, max_tokens=500, structured=StructuredOutput(choice=["αβγ-déjà-vu-ωψ"]), seed=9)
    toks = tokens(full)
    # The previous worker died after k tokens (possibly inside a multi-byte character).
    cont = one(
        p=p + toks[:k],
        offset=k,
        max_tokens=500,
        structured=StructuredOutput(choice=["αβγ-déjà-vu-ωψ"]),
        seed=9,
    )
    assert tokens(cont) == toks[k:]
    prior = TOK.decode_bytes(toks[:k]).decode("utf-8", errors="ignore")
    assert prior + text(cont) == "αβγ-déjà-vu-ωψ"
    body = one(p=p, seed=5, max_tokens=500, structured=JSON_SO)
    jt = tokens(body)
    cont2 = one(p=p + jt[:k], offset=k, seed=5, max_tokens=500, structured=JSON_SO)
    assert tokens(cont2) == jt[k:]
    json.loads(TOK.decode(jt[:k]) + text(cont2))


def test_a_structured_output_the_sim_cannot_build_is_an_error_output() -> None:
    outs = one(structured=StructuredOutput(regex="("))
    assert outs[-1].finish_reason == "error"
    assert outs[-1].error and "structured output" in outs[-1].error


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutput(regex="a{100000000}"),
        StructuredOutput(grammar='root ::= "ab"{5000}'),
        from_json_schema({"type": "array", "minItems": 10**9}, "p"),
        from_json_schema({"type": "string", "minLength": 10**9}, "p"),
    ],
)
def test_an_instance_far_beyond_max_model_len_is_spelt_until_max_tokens(so: StructuredOutput) -> None:
    # tiny-test's max_model_len is 1024: the instance could never be emitted whole. A real
    # engine spells its start until max_tokens cuts it; so does the sim (not a 500, not a stall).
    outs = one(structured=so, max_tokens=10)
    assert outs[-1].finish_reason == "length" and len(text(outs)) == 10
    assert outs == one(structured=so, max_tokens=10)  # deterministic, like any instance


@pytest.mark.parametrize("so", [
    from_json_schema({"type": "array", "minItems": 10**9, "items": {"type": "array", "minItems": 10**9}}, "p"),
    StructuredOutput(grammar='root ::= ("ab"{10000}){10000}'),
])
def test_nested_huge_minimums_are_spelt_until_max_tokens_too(so: StructuredOutput) -> None:
    # Cut to max_model_len each, 1024 × 1024 items are beyond the work budget: the cut
    # shrinks until the text fits (an error here was a 500 for the client).
    outs = one(structured=so, max_tokens=10)
    assert outs[-1].finish_reason == "length" and len(text(outs)) == 10
    assert outs == one(structured=so, max_tokens=10)


def test_a_long_instance_within_max_model_len_is_cut_by_max_tokens() -> None:
    outs = one(structured=StructuredOutput(regex="[ab]{900}"), max_tokens=50)
    assert outs[-1].finish_reason == "length" and len(text(outs)) == 50


# ---------------------------------------------------------------------- log probabilities


def test_logprobs_only_when_asked_one_per_token() -> None:
    plain = one(seed=1, max_tokens=40)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    asked = one(seed=1, max_tokens=40, logprobs=5)
    assert tokens(asked) == tokens(plain)  # asking changes nothing else
    for o in asked:
        assert o.logprobs is not None
        assert [lp.token_id for lp in o.logprobs] == o.new_token_ids
        for lp in o.logprobs:
            assert lp.logprob < 0
            assert len(lp.top) == 5
            values = [t.logprob for t in lp.top]
            assert values == sorted(values, reverse=True) and len(set(values)) == 5
            assert sum(math.exp(v) for v in values) <= 1.0
            assert len({t.token_id for t in lp.top}) == 5
            mine = [t for t in lp.top if t.token_id == lp.token_id]
            assert len(mine) == 1 and mine[0].logprob == lp.logprob  # the chosen is among its top-k
            assert lp.token == (TOK.decode([lp.token_id]) or "</s>")
    assert asked == one(seed=1, max_tokens=40, logprobs=5)  # deterministic


def test_logprobs_zero_gives_the_chosen_token_only_and_greedy_is_top_one() -> None:
    zero = one(seed=2, max_tokens=30, logprobs=0)
    assert all(lp.top == [] for o in zero for lp in o.logprobs or [])
    greedy = one(seed=2, max_tokens=60, logprobs=3, temperature=0.0)
    for o in greedy:
        for lp in o.logprobs or []:
            assert lp.top[0].token_id == lp.token_id
    sampled = one(seed=2, max_tokens=60, logprobs=3)
    ranks = [
        next(i for i, t in enumerate(lp.top) if t.token_id == lp.token_id)
        for o in sampled
        for lp in o.logprobs or []
    ]
    assert any(r > 0 for r in ranks)  # not always the most likely when sampling
    min_p = one(seed=2, max_tokens=60, logprobs=3, min_p=0.9)
    for o in min_p:
        for lp in o.logprobs or []:
            assert lp.logprob >= math.log(0.9) + lp.top[0].logprob - 1e-12


def test_an_aborted_request_that_asked_for_logprobs_ends_with_an_empty_list() -> None:
    c = SimCore(SimConfig.build("tiny-test"))
    r = EngineRequest(request_id="a", prompt_token_ids=prompt(5), sampling=SamplingParams(logprobs=1))
    assert c.add_request(r, 0.0) is None
    out = c.abort("a", 0.0)
    assert out is not None and out.finish_reason == "abort" and out.logprobs == []


def test_structured_tokens_have_logprobs_too() -> None:
    outs = one(seed=4, max_tokens=500, structured=JSON_SO, logprobs=2)
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps] == tokens(outs)


def test_logprobs_of_a_migrated_request_match_the_uninterrupted_run() -> None:
    p = prompt(9)
    full = one(p=p, seed=6, max_tokens=30, logprobs=3)
    toks = tokens(full)
    cont = one(p=p + toks[:11], offset=11, seed=6, max_tokens=30, logprobs=3)
    tail = [lp for o in cont for lp in o.logprobs or []]
    assert len(tail) == len(toks) - 11 > 0
    assert tail == [lp for o in full for lp in o.logprobs or []][11:]


def test_prompt_logprobs_on_the_first_output_only() -> None:
    p = prompt(20)
    outs = one(p=p, seed=1, max_tokens=10, prompt_logprobs=2)
    first, rest = outs[0], outs[1:]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(p)
    assert first.prompt_logprobs[0] is None
    for tok, lp in zip(p[1:], first.prompt_logprobs[1:], strict=True):
        assert lp is not None and lp.token_id == tok and lp.logprob < 0 and len(lp.top) == 2
    assert all(o.prompt_logprobs is None for o in rest)
    assert all(o.logprobs is None for o in outs)


# --------------------------------------------------------------------------- logit_bias

X = TOK.encode("x")[0]
E = TOK.encode("e")[0]
SPACE = TOK.encode(" ")[0]


def test_a_bias_of_100_forces_its_token() -> None:
    outs = one(seed=1, max_tokens=25, logit_bias={X: 100.0}, logprobs=1)
    assert text(outs) == "x" * 25 and outs[-1].finish_reason == "length"
    assert all(lp.top[0].token_id == X for o in outs for lp in o.logprobs or [])
    # Between two forced tokens, the larger bias wins.
    assert set(text(one(seed=1, max_tokens=25, logit_bias={X: 100.0, E: 100.5}))) == {"e"}


def test_a_bias_of_minus_100_bans_its_token() -> None:
    plain = text(one(seed=1, max_tokens=200, ignore_eos=True))
    assert "e" in plain and " " in plain
    banned = one(seed=1, max_tokens=200, ignore_eos=True, logit_bias={E: -100.0, SPACE: -100})
    body = text(banned)
    assert len(tokens(banned)) == 200 and "e" not in body and " " not in body
    for o in one(seed=1, max_tokens=50, ignore_eos=True, logit_bias={E: -100.0}, logprobs=20):
        assert all(t.token_id != E for lp in o.logprobs or [] for t in lp.top)


def test_banning_eos_runs_to_max_tokens_and_forcing_it_stops_at_once() -> None:
    assert one(seed=1, max_tokens=120)[-1].finish_reason == "stop"  # this seed ends at 45 tokens
    no_eos = one(seed=1, max_tokens=120, logit_bias={EOS: -100.0})
    assert no_eos[-1].finish_reason == "length" and EOS not in tokens(no_eos)
    forced = one(seed=1, max_tokens=50, logit_bias={EOS: 100.0})
    assert tokens(forced) == [EOS] and forced[-1].finish_reason == "stop"
    # min_tokens masks EOS even when forced, as vLLM's sampler does.
    held = one(seed=1, max_tokens=50, min_tokens=4, logit_bias={EOS: 100.0})
    assert len(tokens(held)) == 5 and tokens(held)[-1] == EOS


def test_small_biases_change_nothing() -> None:
    assert tokens(one(seed=3, max_tokens=40, logit_bias={X: 5.0, E: -5.0})) == tokens(
        one(seed=3, max_tokens=40)
    )


# ---------------------------------------------------- stop strings and special tokens


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    plain = text(one(seed=2, max_tokens=200, ignore_eos=True))
    stop = plain.split()[3]
    cut = plain.index(stop)
    without = one(seed=2, max_tokens=200, ignore_eos=True, stop=[stop])
    kept = one(seed=2, max_tokens=200, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert text(without) == plain[:cut]
    assert text(kept) == plain[: cut + len(stop)]
    assert tokens(kept) == tokens(without)
    assert kept[-1].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_a_stop_tokens_text() -> None:
    stop_tok = X
    outs = one(
        seed=2,
        max_tokens=30,
        stop_token_ids=[stop_tok],
        logit_bias={X: 100.0},
        include_stop_str_in_output=True,
    )
    assert tokens(outs) == [X] and text(outs) == "x"
    assert text(one(seed=2, max_tokens=30, stop_token_ids=[stop_tok], logit_bias={X: 100.0})) == ""


def test_special_tokens_have_text_only_when_not_skipped() -> None:
    bos = ByteTokenizer.BOS
    skipped = one(seed=1, max_tokens=3, logit_bias={bos: 100.0})
    assert tokens(skipped) == [bos] * 3 and text(skipped) == ""
    spaced = one(seed=1, max_tokens=3, logit_bias={bos: 100.0}, skip_special_tokens=False)
    assert text(spaced) == "<s> <s> <s>"
    tight = one(
        seed=1,
        max_tokens=3,
        logit_bias={bos: 100.0},
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert text(tight) == "<s><s><s>"
    eos_kept = one(
        seed=1,
        max_tokens=5,
        logit_bias={EOS: 100.0},
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert text(eos_kept) == "</s>"


async def test_the_engine_streams_a_structured_instance_with_its_logprobs() -> None:
    r = EngineRequest(
        request_id="e",
        prompt_token_ids=prompt(10),
        sampling=SamplingParams(max_tokens=300, seed=8, structured=JSON_SO, logprobs=2, prompt_logprobs=1),
    )
    async with SimEngine(profile="tiny-test", speed=200.0) as eng:
        outs = [o async for o in eng.generate(r)]
    jsonschema.validate(json.loads(text(outs)), SCHEMA)
    assert [lp.token_id for o in outs for lp in o.logprobs or []] == tokens(outs)
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == 10
    assert tokens(outs) == tokens(run(r)["e"])  # the shell spells what the core does


def vllm_stop_cut(full: str, stops: list[str]) -> int | None:
    """vLLM's rule: the stop string that completes earliest wins, ties in list order."""
    best: tuple[int, int] | None = None
    for s in stops:
        at = full.find(s)
        if at >= 0 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at)
    return None if best is None else best[1]


@pytest.mark.parametrize("seed", range(1, 9))
def test_among_stop_strings_the_earliest_to_complete_wins_ties_in_list_order(seed: int) -> None:
    plain = text(one(seed=seed, max_tokens=300, ignore_eos=True))
    words = plain.split()
    # Candidates ending at the same character (a suffix and the longer string), and one
    # that starts earlier but completes later.
    pair = words[4] + " " + words[5]
    for stops in (
        [words[5], pair],
        [pair, words[5]],
        [words[4] + " " + words[5][:1], words[5]],
        [plain[5:40], "zz"],
    ):
        cut = vllm_stop_cut(plain, stops)
        assert cut is not None
        outs = one(seed=seed, max_tokens=300, ignore_eos=True, stop=stops)
        assert text(outs) == plain[:cut], stops


def test_a_hostile_nested_minimum_costs_two_bounded_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    # minItems 10⁹ of minItems 10⁹ with a long context: one attempt at a whole instance
    # (fails at its work bound), then one prefix whose spent budget ends the text. Retrying
    # with ever smaller cuts took a worker's event loop for 20 s and more per request, and
    # the migrations that followed took every other worker down with it.
    from services.worker.engines import guided
    from services.worker.engines.sim_sequence import GuidedStream

    calls: list[int | None] = []
    real = guided.generate

    def counted(*args: object, **kwargs: object) -> str:
        calls.append(kwargs.get("prefix_cap"))  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(guided, "generate", counted)
    nested = from_json_schema({"type": "array", "minItems": 10**9, "items": {"type": "array", "minItems": 10**9}}, "p")
    stream = GuidedStream(b"k" * 16, nested, 131072)
    assert calls == [None, 131072] and stream.prefix_only
    assert len(stream.text) >= 131072  # long enough to be cut by any max_tokens


def _doubling_grammar(levels: int) -> StructuredOutput:
    rules = "\n".join(f"a{i} ::= a{i + 1} a{i + 1}" for i in range(levels))
    return StructuredOutput(grammar=f'root ::= a0\n{rules}\na{levels} ::= "x"')


def _doubling_schema(levels: int) -> StructuredOutput:
    defs: dict[str, object] = {
        f"a{i}": {"type": "object", "required": ["x", "y"],
                  "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}, "y": {"$ref": f"#/$defs/a{i + 1}"}}}
        for i in range(levels)
    }
    defs[f"a{levels}"] = {"type": "integer"}
    return from_json_schema({"$defs": defs, "$ref": "#/$defs/a0"}, "p")


@pytest.mark.parametrize("so", [_doubling_grammar(28), _doubling_schema(28)], ids=["grammar", "json"])
def test_a_rule_that_doubles_at_each_level_is_spelt_until_max_tokens(so: StructuredOutput) -> None:
    # 2^28 leaves: in prefix mode a spent budget cut counts to 0 but a sequence or an
    # object's required properties went on expanding: minutes of a worker's event loop
    # (pytest's timeout ends this test without the fix), and gigabytes.
    outs = one(structured=so, max_tokens=10)
    assert outs[-1].finish_reason == "length" and len(text(outs)) == 10


def test_a_class_that_allows_no_printable_ascii_is_spelt_from_the_characters_it_allows() -> None:
    # [^\x00-\u2fff] leaves only code points from U+3000: each character scanned 12,000
    # code points below them (~19 s for 600 on a worker) and then fell back to a NUL,
    # which no attempt could match.
    outs = one(structured=StructuredOutput(regex="[^\\x00-\\u2fff]{100}"), max_tokens=1000)
    spelt = text(outs)
    assert outs[-1].finish_reason == "stop" and len(spelt) == 100 and all(ord(c) >= 0x3000 for c in spelt)


@pytest.mark.parametrize("schema", [
    {"type": "number", "minimum": 0, "maximum": 1e300, "multipleOf": 1e-300},
    {"type": "integer", "minimum": 0, "maximum": 1e300, "multipleOf": 1e-320},
    {"type": "number", "minimum": -1e300, "maximum": 5, "multipleOf": 1e-300},
])
def test_a_multiple_of_a_tiny_step_over_a_huge_range_is_an_instance(schema: dict[str, object]) -> None:
    # ceil(1e300 / 1e-300) is infinite: an OverflowError, a 500 for the client.
    outs = one(structured=from_json_schema(schema, "p"))
    assert outs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text(outs)), schema)


def test_a_prefix_is_not_checked_against_its_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    # (?:a{1000}){1000} is beyond any output: the sim spells a prefix, which can never
    # match. Checking each of 8 attempts took the matcher's whole step budget (~0.3 s of
    # the worker's loop each); one unchecked attempt is the answer.
    from services.common import regex_match
    from services.worker.engines.sim_sequence import GuidedStream

    checked: list[str] = []
    real = regex_match.fullmatch

    def counted(pattern: object, text: str, *args: object) -> bool | None:
        checked.append(text)
        return real(pattern, text, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(regex_match, "fullmatch", counted)
    stream = GuidedStream(b"k" * 16, StructuredOutput(regex="(?:a{1000}){1000}"), 8192)
    assert stream.prefix_only and stream.text.startswith("a" * 1000)
    assert checked == []  # the whole-instance attempt failed at its work bound, before any check
