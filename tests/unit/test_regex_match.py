"""The backtracking-free regex matcher the sim's guided decoding checks its text with,
held against ``re.fullmatch`` where ``re`` finishes, and on patterns where it does not."""

from __future__ import annotations

import random
import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.common.regex_match import fullmatch, search
from services.worker.engines import guided, guided_text

_atom = st.one_of(
    st.sampled_from(
        [
            "a",
            "b",
            "A",
            r"\.",
            r"\d",
            r"\w",
            r"\W",
            r"\s",
            ".",
            "[a-c]",
            "[^a-c]",
            "[0-9A-F]",
            r"[\-_ ]",
            "\n",
            "^",
            "$",
            r"\A",
            r"\Z",
            r"\b",
            r"\B",
            "(?i:a)",
            "(?i:[b-c])",
            "(?s:.)",
            "(?m:^)",
            "(?m:$)",
        ]
    ),
    st.text(alphabet="abAB01 ", min_size=1, max_size=2).map(re.escape),
)
_patterns = st.recursive(
    _atom,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        st.tuples(
            inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,3}", "{2,}", "*?", "+?", "{1,2}?"])
        ).map(lambda t: f"(?:{t[0]}){t[1]}"),
    ),
    max_leaves=6,
)
# Short texts over the atoms' own characters, so matches are common and re stays quick.
_texts = st.text(alphabet="abcAB01 _.-\n", max_size=8)


@settings(max_examples=600, deadline=None)
@given(pattern=_patterns, text=_texts)
def test_it_agrees_with_re_on_random_patterns_and_texts(pattern: str, text: str) -> None:
    assert fullmatch(pattern, text) == (re.fullmatch(pattern, text) is not None), (pattern, text)


@settings(max_examples=400, deadline=None)
@given(pattern=_patterns, text=_texts)
def test_its_search_agrees_with_re_search(pattern: str, text: str) -> None:
    assert search(pattern, text) == (re.search(pattern, text) is not None), (pattern, text)


@settings(max_examples=300, deadline=None)
@given(pattern=_patterns, seed=st.integers(0, 2**32))
def test_it_agrees_with_re_on_the_sims_own_instances(pattern: str, seed: int) -> None:
    # The generator's texts match far more often than random ones: both answers get tested.
    text = guided_text.regex_instance(pattern, random.Random(seed))
    if len(text) <= 12:  # re's backtracking stays small on texts this short
        assert fullmatch(pattern, text) == (re.fullmatch(pattern, text) is not None), (pattern, text)


def test_nested_repeats_that_re_cannot_finish_are_answered() -> None:
    # re.fullmatch tries every split of the a's among the groups before it can say no: for
    # this pattern on ~130 a's that is more splits than it could try in a lifetime.
    pattern = r"(?:a{10,}){10,}$!"
    assert fullmatch(pattern, "a" * 130 + "!") is False
    assert fullmatch(r"(?:a{10,}){10,}!", "a" * 130 + "!") is True
    assert fullmatch(r"(?:(?:a)*)+c", "a" * 3000) is False
    assert fullmatch(r"(a|a)*b", "a" * 3000 + "b") is True


def test_the_sim_generates_for_such_a_pattern_without_hanging() -> None:
    # Before the matcher, the sim checked each of its 8 attempts with re.fullmatch: this
    # pattern can never match ("$" before "!"), so every check backtracked without end
    # and the worker's event loop with it (pytest's timeout would end this test).
    text = guided_text.regex_instance(r"(?:a{10,}){10,}$!", random.Random(1))
    assert text.startswith("a" * 100) and text.endswith("!")


def test_what_it_cannot_answer_is_none() -> None:
    assert fullmatch(r"(a)\1", "aa") is None  # a backreference
    assert fullmatch(r"a(?=b)b", "ab") is None  # a lookahead
    assert fullmatch(r"(?>a+)a", "aa") is None  # an atomic group
    assert fullmatch(r"a++", "aa") is None  # a possessive repeat
    # Counted repeats nested three deep on a long text: past the step budget.
    assert fullmatch(r"(?:(?:(?:a|b){0,50}){0,50}){0,50}c", "ab" * 400, max_steps=10_000) is None
    assert fullmatch(r"(?:(?:(?:a|b){0,50}){0,50}){0,50}c", "ab" * 400) is False


def test_anchors_and_flags_read_as_re_reads_them() -> None:
    cases = [
        ("a$", "a\n"),
        ("a$\n", "a\n"),
        ("a\\Z\n", "a\n"),
        ("(?m)a$\nb", "a\nb"),
        ("a$\nb", "a\nb"),
        ("(?m)a\n^b", "a\nb"),
        ("a\n^b", "a\nb"),
        (r"\bab\b", "ab"),
        (r"a\Bb", "ab"),
        (r"a\b b", "a b"),
        ("(?i)AbC", "aBc"),
        ("(?i)[a-c]+", "ABC"),
        ("(?i:a)A", "aa"),
        ("(?s).", "\n"),
        (".", "\n"),
        (r"(?a)\w", "é"),
        (r"\w", "é"),
        ("a{0}b", "b"),
        ("(?:a?){5}", ""),
        ("(?:){3,}", ""),
    ]
    for pattern, text in cases:
        assert fullmatch(pattern, text) == (re.fullmatch(pattern, text) is not None), (pattern, text)


def test_a_json_schema_pattern_is_searched_without_backtracking() -> None:
    # jsonschema checks "pattern" with re.search: on this one its check of the sim's own
    # instance never returned. The sim validates each JSON instance it generates.
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(?:a{8,}){8,}$!"}},
        "required": ["s"],
    }
    text = guided.json_instance(schema, random.Random(1))
    assert text.startswith('{"s":"aaaaaaaa')
    assert search(r"b(?:a{8,}){8,}$!", "x" + "a" * 80 + "!") is False
    assert search(r"a{3}", "xxaaax") is True and search(r"^a{3}", "xxaaax") is False


_key = st.text(alphabet="ab1_", min_size=1, max_size=4)
_object_schemas = st.fixed_dictionaries(
    {"type": st.just("object")},
    optional={
        "properties": st.dictionaries(_key, st.sampled_from([{"type": "integer"}, {"pattern": "^a"}]), max_size=3),
        "patternProperties": st.dictionaries(_patterns, st.sampled_from([{"type": "integer"}, {"type": "string"}])),
        "additionalProperties": st.sampled_from([False, True, {"type": "string"}]),
    },
)
_instances = st.dictionaries(_key, st.one_of(st.integers(0, 3), _texts), max_size=4)
# unevaluatedProperties looks through applicators and refs for the keys they evaluate;
# few key names, so that a subschema's properties name the instance's keys
_few_keys = st.sampled_from(["a", "b", "1", "ab", "ba"])
_small_objects = st.fixed_dictionaries(
    {"type": st.just("object")},
    optional={
        "properties": st.dictionaries(_few_keys, st.sampled_from([{"type": "integer"}, {}]), max_size=3),
        "patternProperties": st.dictionaries(_patterns, st.sampled_from([{"type": "integer"}, {}]), max_size=2),
    },
)
_small_instances = st.dictionaries(_few_keys, st.one_of(st.integers(0, 3), _texts), max_size=4)
_subschema = st.one_of(_small_objects, st.just({"$ref": "#/$defs/d"}))
_unevaluated_schemas = st.builds(
    lambda base, applicator, parts, uneval: {
        **base, "$defs": {"d": {"patternProperties": {"^b": {}}, "properties": {"1": {"type": "integer"}}}},
        **({applicator: parts} if applicator in ("allOf", "anyOf", "oneOf") else
           {"if": {"minProperties": 2}, "then": parts[0], "else": parts[-1]} if applicator == "if" else
           {"dependentSchemas": {"a": parts[0]}} if applicator == "dependentSchemas" else
           parts[0] if applicator == "$ref" else {}),
        "unevaluatedProperties": uneval,
    },
    _small_objects, st.sampled_from(["allOf", "anyOf", "oneOf", "if", "dependentSchemas", "$ref", ""]),
    st.lists(_subschema, min_size=1, max_size=2), st.sampled_from([False, {"type": "string"}]),
)


@settings(max_examples=400, deadline=None)
@given(schema=_object_schemas, instance=_instances)
def test_the_sims_validator_reads_regex_keywords_as_jsonschema_does(schema: dict, instance: dict) -> None:
    import jsonschema

    ours = guided._searching_patterns(jsonschema.Draft202012Validator)(schema)
    assert ours.is_valid(instance) == jsonschema.Draft202012Validator(schema).is_valid(instance)


@settings(max_examples=400, deadline=None)
@given(schema=_unevaluated_schemas, instance=_small_instances)
@example(schema={"if": {"minProperties": 2}, "then": {"properties": {"a": {}, "ab": {}}},
                 "else": {"patternProperties": {"^b": {}}}, "unevaluatedProperties": False},
         instance={"a": 1, "ab": 2})
@example(schema={"if": {"minProperties": 2}, "then": {"properties": {"a": {}, "ab": {}}},
                 "else": {"patternProperties": {"^b": {}}}, "unevaluatedProperties": False},
         instance={"ba": 1})
def test_the_sims_validator_reads_unevaluated_properties_as_jsonschema_does(schema: dict, instance: dict) -> None:
    import jsonschema

    ours = guided._searching_patterns(jsonschema.Draft202012Validator)(schema)
    assert ours.is_valid(instance) == jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_a_property_name_against_nested_repeats_is_searched_without_backtracking() -> None:
    # jsonschema matches every key against patternProperties (and, for
    # additionalProperties, against all of them) with re.search: 2^30 ways here.
    name = "a" * 30 + "!"
    schema = {
        "type": "object",
        "properties": {name: {"type": "integer"}},
        "required": [name],
        "patternProperties": {"^(a+)+$": {"type": "string"}},
        "additionalProperties": False,
    }
    text = guided.json_instance(schema, random.Random(1))
    assert text.startswith('{"' + name + '":')
    # The same through unevaluatedProperties (draft 2019-09 on), jsonschema's own walk of
    # the keys every applicator evaluates: 3 s at 26 characters, doubling with each.
    del schema["additionalProperties"]
    schema["unevaluatedProperties"] = False
    text = guided.json_instance(schema, random.Random(1))
    assert text.startswith('{"' + name + '":')
