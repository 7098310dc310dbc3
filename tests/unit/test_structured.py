"""Structured outputs: what the gateway accepts (services/common/structured.py) and the
instances the sim spells for it (services/worker/engines/guided.py)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.messages import StructuredOutput
from services.common import regex_match
from services.common.gbnf import Alt, CharClass, Expr, GrammarError, Lit, Ref, Repeat, Seq, parse_grammar
from services.common.structured import (
    StructuredOutputError,
    check_grammar,
    from_choice,
    from_grammar,
    from_guided_fields,
    from_json_schema,
    from_regex,
    from_response_format,
    from_structured_outputs,
)
from services.worker.engines import guided, guided_text

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

# ------------------------------------------------------------------ validation errors


def raises_param(param: str, fn: Any, *args: Any) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        fn(*args)
    assert info.value.param == param, info.value
    assert isinstance(info.value, ValueError)
    assert str(info.value)
    return info.value


def rf_schema(schema: object, **extra: object) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "objekt"},
        {"type": "object", "properties": {"a": {"type": 5}}},
        {"type": "string", "pattern": "("},  # a schema's pattern must itself compile
        {"type": "string", "pattern": "a{4294967296}"},  # re: OverflowError, once a 500
        {"patternProperties": {"a{4294967296}": {}}},
        {"propertyNames": {"pattern": "a{4294967296}"}},
        {"type": "array", "minItems": -1},
        {"$ref": "#/$defs/missing"},
        {"$ref": "https://example.com/schema.json"},
        "not a schema",
        ["type", "object"],
        7,
    ],
)
def test_a_bad_json_schema_names_the_schema_parameter(schema: object) -> None:
    err = raises_param("response_format.json_schema.schema", from_response_format, rf_schema(schema))
    assert "response_format.json_schema.schema" in str(err)


def test_a_schema_nested_past_the_limit_is_refused_not_a_crash() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    raises_param("guided_json", from_guided_fields, {"guided_json": deep})
    raises_param("guided_json", from_guided_fields, {"guided_json": "[" * 100_000})


def wide_schema(properties: int, name_chars: int = 1) -> dict[str, Any]:
    return {"type": "object", "properties": {f"{'p' * name_chars}{i}": {"type": "string"} for i in range(properties)}}


@pytest.mark.parametrize(("schema", "why"), [
    (wide_schema(5001), "5,001 object properties, more than the 5,000 allowed"),
    ({"type": "string", "enum": [str(i) for i in range(1001)]}, "1,001 enum values, more than the 1,000 allowed"),
    (wide_schema(200, name_chars=700), "characters of names, enum, const and pattern values, more than the 120,000"),
    ({"type": "string", "pattern": "a" * 120_001}, "more than the 120,000"),
    # No properties at all: subschemas anywhere count (8,000 anyOf branches took 1.5 s).
    ({"anyOf": [{"type": "string", "minLength": i} for i in range(20_001)]}, "20,002 subschemas, more than the 20,000"),
])
def test_a_schema_past_openais_limits_is_refused_before_it_is_checked(schema: dict[str, Any], why: str) -> None:
    """Checking a schema is pure Python on the gateway's event loop (~0.2 ms a property):
    a 40,000-property schema held every other client for seconds (a tool's, tens of them)."""
    err = raises_param("guided_json", from_guided_fields, {"guided_json": schema})
    assert why in str(err)
    assert from_guided_fields({"guided_json": wide_schema(5000)}) is not None  # the limit itself is served


def test_a_property_named_like_a_keyword_is_a_name_not_a_keyword() -> None:
    schema = {"type": "object", "properties": {"enum": {"type": "string"}, "pattern": {"type": "string"}}}
    assert from_guided_fields({"guided_json": schema}) is not None


def test_a_valid_schema_is_checked_once_and_a_bad_one_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents send the same tools with every call: their schemas are checked once."""
    from services.common import structured

    calls: list[object] = []
    real = jsonschema.Draft202012Validator.check_schema

    def counting(schema: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(schema)
        real(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", counting)
    schema = wide_schema(3) | {"title": f"once-{random.random()}"}
    assert not any(isinstance(k, str) for k in structured._checked)  # digests: no schema text held
    for _ in range(3):
        assert structured.check_json_schema(schema, "x") == json.dumps(schema, separators=(",", ":"))
    assert len(calls) == 1
    bad = {"type": "strin", "title": f"bad-{random.random()}"}
    for _ in range(2):
        with pytest.raises(StructuredOutputError):
            structured.check_json_schema(bad, "x")
    assert len(calls) == 3


def test_long_regexes_and_grammars_are_refused() -> None:
    err = raises_param("guided_regex", from_guided_fields, {"guided_regex": "(a|aa|a?)*" * 1000})
    assert "10,000 characters long, more than the 8,192 allowed" in str(err)
    grammar = "root ::= " + " | ".join(f'"{i}"' for i in range(20_000))
    err = raises_param("guided_grammar", from_guided_fields, {"guided_grammar": grammar})
    assert "more than the 65,536 allowed" in str(err)


@pytest.mark.parametrize(
    ("rf", "param"),
    [
        ("json_object", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        (rf_schema({}, strict="yes"), "response_format.json_schema.strict"),
    ],
)
def test_response_format_shape_errors_name_the_field(rf: object, param: str) -> None:
    raises_param(param, from_response_format, rf)


def test_good_response_formats() -> None:
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutput(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = from_response_format(rf_schema(schema, strict=True))
    assert out is not None and out.json is not None
    assert json.loads(out.json) == schema
    # JSON text is accepted too (vLLM's structured_outputs.json takes either).
    assert from_json_schema(json.dumps(schema), "p") == out


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(", "valid regular expression"),
        ("a{2,1}", "valid regular expression"),
        (r"(a)\1", "backreferences"),
        (r"(?=a)a", "lookaround"),
        (r"(?<!a)b", "lookaround"),
        ("", "non-empty"),
        (42, "non-empty"),
    ],
)
def test_a_bad_regex_names_guided_regex(pattern: object, why: str) -> None:
    err = raises_param("guided_regex", from_guided_fields, {"guided_regex": pattern})
    assert why in str(err)


@pytest.mark.parametrize(
    ("choices", "param"),
    [
        ([], "guided_choice"),
        ("yes", "guided_choice"),
        (["a", 1], "guided_choice"),
        (["a", ""], "guided_choice"),
    ],
)
def test_bad_choices(choices: object, param: str) -> None:
    raises_param(param, from_guided_fields, {"guided_choice": choices})


@pytest.mark.parametrize(
    ("grammar", "why"),
    [
        ("hello world", "not an EBNF"),
        ('start: "a"', "not an EBNF"),  # Lark
        ('expr ::= "a"', "no 'root' rule"),
        ("root ::= value", "undefined rule 'value'"),
        ('root ::= "a" root', "can never finish"),
        ('root ::= "abc', "unterminated string"),
        ("root ::= [z-a]", "out of order"),
        ('root ::= ("a" | "b"', "missing ')'"),
        ('root ::= "a"{3,1}', "repetition"),
        ('root ::= "a" | ', "empty alternative"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ("root ::= @", "unexpected"),
        ("", "non-empty"),
    ],
)
def test_a_bad_grammar_names_guided_grammar(grammar: str, why: str) -> None:
    err = raises_param("guided_grammar", from_guided_fields, {"guided_grammar": grammar})
    assert why in str(err), err


def test_grammar_errors_say_where() -> None:
    with pytest.raises(GrammarError, match="line 2, column 13"):
        parse_grammar('root ::= a\na ::= "x" | ]')


def test_structured_outputs_takes_exactly_one_constraint() -> None:
    raises_param("structured_outputs", from_structured_outputs, {"regex": "a", "choice": ["a"]})
    raises_param("structured_outputs", from_structured_outputs, {})
    raises_param("structured_outputs", from_structured_outputs, [])
    raises_param("structured_outputs.structural_tag", from_structured_outputs, {"structural_tag": "{}"})
    raises_param("structured_outputs.json", from_structured_outputs, {"json": {"type": "nope"}})
    raises_param("structured_outputs.regex", from_structured_outputs, {"regex": "("})
    raises_param("structured_outputs.json_object", from_structured_outputs, {"json_object": "yes"})
    assert from_structured_outputs({"choice": ["a", "b"]}) == StructuredOutput(choice=["a", "b"])
    assert from_structured_outputs({"json_object": True, "regex": None}) == StructuredOutput(json_object=True)
    # A whole vLLM StructuredOutputsParams, its options at their defaults.
    whole = {"choice": ["a"], "disable_any_whitespace": False, "disable_additional_properties": False,
             "disable_fallback": False, "whitespace_pattern": None}
    assert from_structured_outputs(whole) == StructuredOutput(choice=["a"])
    raises_param("structured_outputs.disable_any_whitespace", from_structured_outputs,
                 {"choice": ["a"], "disable_any_whitespace": True})
    raises_param("guided_regex", from_guided_fields, {"guided_json": {}, "guided_regex": "a"})
    assert from_guided_fields({"guided_json": None}) is None


def test_good_grammar_forms_parse() -> None:
    grammar = r"""
    # comments and newlines anywhere
    root   ::= greeting (", " name)? "!"{1,3}
    greeting ::= "hello" | 'hi'
    name   ::= [A-Z] [a-z\-]* | "\u00e9t\x41"
    """
    g = parse_grammar(grammar)
    assert set(g.rules) == {"root", "greeting", "name"}
    assert g.min_len["root"] == 3  # "hi!"
    assert from_grammar(grammar, "g") == StructuredOutput(grammar=grammar)


# ----------------------------------------------------------------- generated instances


def test_instances_cover_the_schema_features() -> None:
    schema = {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 50, "multipleOf": 0.25},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "when": {"type": "string", "format": "date-time"},
            "email": {"type": "string", "format": "email"},
            "status": {"enum": ["open", "closed"]},
            "version": {"const": 2},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
            "kind": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
            "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                               {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
        },
        "required": ["id", "when", "email", "status", "version", "items", "note", "kind", "both"],
        "additionalProperties": False,
    }  # fmt: skip
    so = from_json_schema(schema, "p")
    for seed in range(60):
        text = guided.generate(so, random.Random(seed))
        assert text.isascii()
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


def test_recursive_schemas_end() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                  "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "children"]}},
        "$ref": "#/$defs/node",
    }  # fmt: skip
    for seed in range(30):
        text = guided.generate(from_json_schema(schema, "p"), random.Random(seed))
        jsonschema.validate(json.loads(text), schema)
        assert len(text) < 20_000


def test_json_object_and_choice_and_determinism() -> None:
    for seed in range(20):
        obj = json.loads(guided.generate(StructuredOutput(json_object=True), random.Random(seed)))
        assert isinstance(obj, dict) and obj
        assert guided.generate(StructuredOutput(choice=["x", "y", "zé"]), random.Random(seed)) in {
            "x",
            "y",
            "zé",
        }
    so = StructuredOutput(regex=r"[a-z]{3,9}\d+")
    assert guided.generate(so, random.Random(7)) == guided.generate(so, random.Random(7))


# JSON Schemas built from the features the generator models.
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 50),
    ),
    st.builds(
        lambda lo, span, excl: {
            "type": "number",
            ("exclusiveMinimum" if excl else "minimum"): lo,
            "maximum": lo + span,
        },
        st.integers(-100, 100),
        st.integers(1, 30),
        st.booleans(),
    ),
    st.builds(lambda m: {"type": "integer", "multipleOf": m}, st.integers(1, 12)),
    st.builds(
        lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
        st.integers(0, 10),
        st.integers(0, 10),
    ),
    st.builds(
        lambda vals: {"enum": vals}, st.lists(st.one_of(st.integers(), st.text(max_size=5)), min_size=1)
    ),
    st.builds(lambda v: {"const": v}, st.one_of(st.integers(), st.text(max_size=5), st.booleans())),
    st.sampled_from(
        [
            {"type": "string", "format": f}
            for f in ("date", "time", "date-time", "email", "ipv4", "ipv6", "uuid")
        ]
    ),
    st.just({"type": "string", "pattern": "^[a-f0-9]{2,6}$"}),
    st.just({}),
    # Names only the patterns give (closed: no other name may stand), and a count of them.
    st.builds(lambda lo, closed: {"type": "object", "patternProperties": {"^x_[a-z]{2}$": {"type": "integer"}},
                                  "minProperties": lo, "additionalProperties": not closed},
              st.integers(0, 3), st.booleans()),
)

_names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any], data: st.DataObject, closed: bool) -> dict[str, Any]:
        required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
        if closed:
            schema["additionalProperties"] = False
        return schema

    return st.builds(build, st.dictionaries(_names, children, max_size=4), st.data(), st.booleans())


def _array(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
        children,
        st.integers(0, 3),
        st.integers(0, 3),
    )


_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        _array(children),
        st.builds(lambda opts: {"anyOf": opts}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda t: {"type": t}, st.just(["string", "integer", "null"])),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas, seed=st.integers(0, 2**32))
def test_every_json_instance_validates(schema: dict[str, Any], seed: int) -> None:
    wrapped = {"$defs": {"s": schema}, "$ref": "#/$defs/s"}  # every schema also through $ref
    for s in (schema, wrapped):
        so = from_json_schema(s, "guided_json")
        text = guided.generate(so, random.Random(seed))
        jsonschema.validate(json.loads(text), s, format_checker=FORMATS)


# Regexes built from the constructs guided decoding takes (no backreference, no lookaround).
_atom = st.one_of(
    st.sampled_from(
        ["a", "b", "x", r"\.", r"\d", r"\w", r"\s", ".", "[a-z]", "[^a-z]", "[0-9A-F]", r"[\-_]", "é"]
    ),
    st.text(alphabet="abcXYZ019 ", min_size=1, max_size=3).map(re.escape),
)
_regexes = st.recursive(
    _atom,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{2,}", "*?"])).map(
            lambda t: f"(?:{t[0]}){t[1]}"
        ),
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(pattern=_regexes, seed=st.integers(0, 2**32))
def test_every_regex_instance_fullmatches(pattern: str, seed: int) -> None:
    so = from_regex(pattern, "guided_regex")
    text = guided.generate(so, random.Random(seed))
    # Matched without backtracking (a nested repeat such as (?:(?:a)*)+ makes
    # re.fullmatch exponential); test_regex_match holds that matcher against re.
    assert regex_match.fullmatch(pattern, text), (pattern, text)


@settings(max_examples=100, deadline=None)
@given(choices=st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=6), seed=st.integers(0, 2**32))
def test_every_choice_instance_is_a_choice(choices: list[str], seed: int) -> None:
    assert guided.generate(from_choice(choices, "guided_choice"), random.Random(seed)) in choices


# Grammars: random non-recursive rule sets, each generated sentence checked against the
# parse tree by a matcher of our own, plus a recursive one checked by hand. The tree was
# once translated into a Python regex (GBNF without recursion is one), but nested
# repeats such as ((x)*)+ make the backtracking engine exponential: a run of the random
# rules hung CI for ten minutes and more in `re.fullmatch`.


def _matches(root: Expr, rules: dict[str, Expr], text: str) -> bool:
    """Whether ``text`` is a sentence of ``root``: the set of positions each expression can
    end at from each start, computed once per (expression, start): polynomial whatever
    the nesting of repeats."""
    memo: dict[tuple[int, int], frozenset[int]] = {}

    def ends(expr: Expr, i: int) -> frozenset[int]:
        key = (id(expr), i)
        if key in memo:
            return memo[key]
        out: set[int] = set()
        if isinstance(expr, Lit):
            if text.startswith(expr.text, i):
                out.add(i + len(expr.text))
        elif isinstance(expr, CharClass):
            if i < len(text) and any(lo <= ord(text[i]) <= hi for lo, hi in expr.ranges) != expr.negated:
                out.add(i + 1)
        elif isinstance(expr, Ref):
            out = set(ends(rules[expr.name], i))
        elif isinstance(expr, Seq):
            out = {i}
            for item in expr.items:
                out = {e for j in out for e in ends(item, j)}
        elif isinstance(expr, Alt):
            out = {e for option in expr.options for e in ends(option, i)}
        else:
            assert isinstance(expr, Repeat)
            level, k = {i}, 0  # level: the ends after exactly k repetitions
            seen: set[int] = set()
            if expr.min == 0:
                out.add(i)
            while level and (expr.max is None or k < expr.max):
                level = {e for j in level for e in ends(expr.item, j)}
                k += 1
                if k >= expr.min:
                    out |= level
                    if expr.max is None:  # past the minimum only new ends can lead anywhere new
                        level -= seen
                        seen |= level
        memo[key] = frozenset(out)
        return memo[key]

    return len(text) in ends(root, 0)


def test_the_grammar_matcher_is_not_fooled_by_nested_repeats() -> None:
    g = parse_grammar('root ::= (("a")*)+ "a" ("b" | "a"{2})')
    root = g.rules["root"]
    assert _matches(root, g.rules, "a" * 40 + "b") and _matches(root, g.rules, "a" * 3)
    assert not _matches(root, g.rules, "a" * 40 + "c") and not _matches(root, g.rules, "b")
    digits = parse_grammar("root ::= [1-9] [0-9]{0,2} [^0-9]?")
    assert [_matches(digits.rules["root"], digits.rules, t) for t in ("1", "109x", "1000", "0", "12\n")] == [
        True, True, False, False, True]


_g_atom = st.one_of(
    st.text(alphabet='ab c"\\\n{é', min_size=0, max_size=4).map(lambda s: json.dumps(s, ensure_ascii=False)),
    st.sampled_from(["[a-z]", "[^0-9]", "[0-9A-F]", r"[\n\t ]", "[é-ë]"]),
)
_g_expr = st.recursive(
    _g_atom,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(" ".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,}"])).map(
            lambda t: f"({t[0]}){t[1]}"
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(bodies=st.lists(_g_expr, min_size=1, max_size=3), seed=st.integers(0, 2**32))
def test_every_grammar_instance_is_a_sentence(bodies: list[str], seed: int) -> None:
    # root ::= r1 r2 ...; rule i may also refer to the rules after it (no recursion).
    names = [f"r{i}" for i in range(len(bodies))]
    lines = [f"root ::= {' '.join(names)}"]
    for i, body in enumerate(bodies):
        ref = f" {names[i + 1]}?" if i + 1 < len(names) else ""
        lines.append(f"{names[i]} ::= {body}{ref}")
    text = "\n".join(lines)
    check_grammar(text, "guided_grammar")
    g = parse_grammar(text)
    sentence = guided.generate(StructuredOutput(grammar=text), random.Random(seed))
    assert _matches(g.rules["root"], g.rules, sentence), (text, sentence)


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor ("*" factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def test_recursive_grammar_instances_are_sentences() -> None:
    g = parse_grammar(ARITH)
    for seed in range(200):
        sentence = guided_text.grammar_instance(g, random.Random(seed))
        assert re.fullmatch(r"[0-9+\-*()]+", sentence)
        assert eval(sentence, {"__builtins__": {}}) is not None  # parses as arithmetic


def test_shortest_lengths_and_heights_of_rules() -> None:
    n = 300  # a chain defined root-first: each rule settles only after the next one
    chain = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "x" | "yy" r{i + 1}' for i in range(n))
    g = parse_grammar(chain + f'\nr{n} ::= "a" | "b"{{3}} r0')
    assert g.min_len["root"] == n + 1 and g.height["root"] == n + 1
    assert g.min_len[f"r{n}"] == 1 and g.height[f"r{n}"] == 0
    g = parse_grammar('root ::= (a | "long literal") b{2}\na ::= "xyz" | a "q"\nb ::= [0-9]? "-"')
    assert g.min_len == {"root": 3 + 2, "a": 3, "b": 1}
    assert g.height == {"root": 1, "a": 0, "b": 0}


def test_mutually_recursive_alternatives_still_end() -> None:
    # Equal shortest lengths through a cycle: the walk must descend by derivation height.
    g = parse_grammar('root ::= a\na ::= b | "xy"\nb ::= a | "x"')
    for seed in range(50):
        assert guided_text.grammar_instance(g, random.Random(seed)) in {"x", "xy"}


def test_a_grammar_nested_by_postfix_operators_is_refused_not_a_crash() -> None:
    # Each operator nests a repeat: 5,000 of them ran the parse's walks out of stack (a
    # RecursionError, a 500). Parentheses were bounded; operators were not.
    err = raises_param("guided_grammar", from_guided_fields, {"guided_grammar": 'root ::= "a"' + "+" * 5000})
    assert "nested too deeply" in str(err)
    assert parse_grammar('root ::= ("a"+)*?').rules  # a few operators are a grammar
