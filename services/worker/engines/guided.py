"""Instances of a structured output, for the sim engine's guided decoding.

``generate(structured, rng)`` returns text that is a valid instance of a
``proto.StructuredOutput``: JSON valid against the schema (or any JSON object), a string
that fully matches the regex, one of the choices, or a sentence of the GBNF grammar.
Deterministic for a given ``random.Random`` state; outputs are kept short (a few
properties, items and characters) because the request's ``max_tokens`` may cut them,
as it would on a real engine. JSON is ASCII (non-ASCII escaped); regex, choice and
grammar text may hold any Unicode, which the sim's byte tokenizer spells as UTF-8.
This module is the entry point and the JSON Schema generator; regex and grammar
instances, and the work budget every generator spends, are :mod:`.guided_text`.

JSON Schema support: ``type`` (one or a list), ``properties``/``required``,
``additionalProperties`` (false respected, a schema used for ``minProperties``),
``enum``/``const``, arrays (``items``, ``prefixItems``, ``minItems``/``maxItems``,
``uniqueItems``, ``contains``), nested objects, ``anyOf``/``oneOf``/``allOf``,
``$ref`` (local)/``$defs``, strings (``minLength``/``maxLength``, ``pattern``, the
common ``format``s), numbers and integers with bounds and ``multipleOf``. The instance
is checked with ``jsonschema`` and regenerated (up to a few times) when a combination
the generator does not model (``not``, overlapping ``oneOf`` branches, ...) made it
invalid; past that the last attempt is returned, as a best effort.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from typing import Any

import jsonschema
import jsonschema.validators

from proto.messages import StructuredOutput
from services.common import regex_match
from services.common.gbnf import parse_grammar
from services.common.structured import resolve_pointer

from .guided_text import (
    EXTRA_ITEMS,
    MAX_ATTEMPTS,
    MAX_DEPTH,
    MAX_WORK,
    SAFE,
    Budget,
    GuidedError,
    grammar_instance,
    regex_instance,
)

HARD_DEPTH = 8 * MAX_DEPTH  # past this a schema can have no finite instance: give up
_WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "green", "paper")


def generate(
    structured: StructuredOutput, rng: random.Random, max_work: int = MAX_WORK, prefix_cap: int | None = None
) -> str:
    """A valid instance of ``structured`` (exactly one of its fields is set); GuidedError
    if it is malformed or needs more than ``max_work`` steps (about characters).

    ``prefix_cap``: cut every minimum count (minItems, minLength, ``{n,}``, grammar
    repetitions) to it. The text is then no instance, but its first ``prefix_cap``
    characters are the start of one: what an engine spells before max_tokens cuts an
    instance too long to finish (the sim's answer to ``a{100000000}``, as vLLM's is)."""
    try:
        return _generate(structured, rng, Budget(max_work, prefix_cap))
    except GuidedError:
        raise
    except (re.error, KeyError, TypeError, AttributeError, RecursionError, ValueError, OverflowError,
            ZeroDivisionError) as exc:
        raise GuidedError(f"{type(exc).__name__}: {exc}") from exc


def _generate(structured: StructuredOutput, rng: random.Random, budget: Budget) -> str:
    if structured.choice is not None:
        return rng.choice(structured.choice)
    if structured.regex is not None:
        return regex_instance(structured.regex, rng, budget)
    if structured.grammar is not None:
        return grammar_instance(parse_grammar(structured.grammar), rng, budget)
    if structured.json is not None:
        return json_instance(json.loads(structured.json), rng, budget)
    if structured.json_object:
        return json.dumps(_JsonGen({}, rng).any_object(0), separators=(",", ":"))
    raise ValueError("empty StructuredOutput")


# ------------------------------------------------------------------------ JSON Schema


def json_instance(schema: Any, rng: random.Random, budget: Budget | None = None) -> str:
    """JSON text valid against ``schema`` (checked; best effort after MAX_ATTEMPTS)."""
    budget = budget or Budget()
    gen = _JsonGen(schema, rng)
    if isinstance(schema, dict):
        cls = _searching_patterns(
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        )
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    value: Any = None
    for _ in range(MAX_ATTEMPTS):
        gen.budget = budget.fresh()
        value = gen.value(schema, 0)
        if not isinstance(schema, dict) or budget.cap is not None or validator.is_valid(value):
            break  # (a prefix-mode text is no instance: nothing to check)
    return json.dumps(value, separators=(",", ":"))


@functools.cache
def _searching_patterns(cls: Any) -> Any:
    """``cls`` with its regex keywords (``pattern``, ``patternProperties``,
    ``additionalProperties``, ``unevaluatedProperties``) searched without backtracking: jsonschema's own
    ``re.search`` on a client's nested repeats (``^(?:a{8,}){8,}$!``) never returns, on
    the worker's event loop. A pattern the matcher cannot answer for counts as found."""

    def pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "string") and not _found(pattern, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    def pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        for regex, subschema in patterns.items():
            for key, value in instance.items():
                if _found(regex, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=regex)

    def additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        named = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extras = [k for k in instance if k not in named and not any(_found(p, k) for p in patterns)]
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif not extra and extras:
            yield jsonschema.ValidationError(
                f"Additional properties are not allowed ({', '.join(map(repr, extras))})"
            )

    def unevaluated_properties(validator: Any, uneval: Any, instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        evaluated = _evaluated_keys(validator, instance, schema)
        bad = [k for k in instance if k not in evaluated and any(validator.descend(instance[k], uneval, path=k))]
        if bad:
            yield jsonschema.ValidationError(f"Unevaluated properties are not allowed or not valid ({', '.join(map(repr, bad))})")

    keywords = {
        "pattern": pattern,
        "patternProperties": pattern_properties,
        "additionalProperties": additional_properties,
    }
    # Draft 2020-12's walk (draft 2019-09 has its own, with $recursiveRef: left as it is)
    if cls.VALIDATORS.get("unevaluatedProperties") is jsonschema.Draft202012Validator.VALIDATORS["unevaluatedProperties"]:
        keywords["unevaluatedProperties"] = unevaluated_properties
    return jsonschema.validators.extend(cls, keywords)


def _evaluated_keys(validator: Any, instance: dict[str, Any], schema: Any) -> set[str]:
    """The keys of ``instance`` that ``schema`` evaluates, as jsonschema's draft 2020-12
    ``find_evaluated_property_keys_by_schema`` finds them, with ``patternProperties``
    searched by the matcher (jsonschema's ``re.search`` there backtracks on a client's
    ``^(a+)+$`` against a near-miss key: 3 s at 26 characters, doubling with each)."""
    if not isinstance(schema, dict):
        return set()
    keys: set[str] = set()
    for ref_keyword in ("$ref", "$dynamicRef"):
        ref = schema.get(ref_keyword)
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            keys |= _evaluated_keys(validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                                    instance, resolved.contents)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        keys |= properties.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        subschema = schema.get(keyword)
        if subschema is not None:
            keys |= {k for k, v in instance.items() if not any(validator.descend(v, subschema))}
    for regex in schema.get("patternProperties", {}):
        keys |= {k for k in instance if _found(regex, k)}
    for name, subschema in schema.get("dependentSchemas", {}).items():
        if name in instance:
            keys |= _evaluated_keys(validator, instance, subschema)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if not any(validator.descend(instance, subschema)):
                keys |= _evaluated_keys(validator, instance, subschema)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys |= _evaluated_keys(validator, instance, schema["if"])
            if "then" in schema:
                keys |= _evaluated_keys(validator, instance, schema["then"])
        elif "else" in schema:
            keys |= _evaluated_keys(validator, instance, schema["else"])
    return keys


def _found(pattern: str, text: str) -> bool:
    try:
        return regex_match.search(pattern, text) is not False
    except (re.error, RecursionError, OverflowError):
        return True  # the gateway refuses a schema whose pattern re cannot read


class _JsonGen:
    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.budget = Budget()

    def value(self, schema: Any, depth: int) -> Any:
        rng = self.rng
        if self.budget.spent:
            return None  # a prefix's text has ended: what follows is past max_tokens
        self.budget.spend()
        if depth > HARD_DEPTH:
            return None  # a schema that requires itself forever: no finite instance
        if schema is True or schema == {}:
            return self.any_value(depth)
        if not isinstance(schema, dict):
            return None  # false: nothing is valid
        ref = schema.get("$ref")
        if isinstance(ref, str):
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            target = resolve_pointer(self.root, ref)
            if _is_schema_only_annotations(rest):
                return self.value(target, depth + 1)
            return self.value({"allOf": [target, rest]}, depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return rng.choice(schema["enum"])
        if isinstance(schema.get("allOf"), list) and schema["allOf"]:
            merged = dict(schema)
            del merged["allOf"]
            for part in schema["allOf"]:
                merged = _merge(merged, self._deref(part))
            return self.value(merged, depth + 1)
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                if depth >= MAX_DEPTH:  # shallow branches end recursive schemas
                    branches = sorted(branches, key=lambda b: len(json.dumps(b)))[:1]
                rest = {k: v for k, v in schema.items() if k != key}
                branch = rng.choice(branches)
                return self.value(_merge(rest, self._deref(branch)) if rest else branch, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if isinstance(k, str)] or ["null"]
            if depth >= MAX_DEPTH and "null" in kinds:
                kind = "null"
            else:
                kind = rng.choice(kinds)
        if kind is None:
            kind = _infer_type(schema)
        if kind == "object":
            return self.obj(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        return self.any_value(depth)

    def _deref(self, schema: Any) -> Any:
        seen = 0
        while (
            isinstance(schema, dict)
            and isinstance(schema.get("$ref"), str)
            and len(schema) == 1
            and seen < 32
        ):
            schema = resolve_pointer(self.root, schema["$ref"])
            seen += 1
        return schema

    def any_value(self, depth: int) -> Any:
        pick = self.rng.randrange(4 if depth < MAX_DEPTH else 3)
        if pick == 0:
            return self.rng.randrange(100)
        if pick == 1:
            return self.rng.choice(_WORDS)
        if pick == 2:
            return self.rng.random() < 0.5
        return self.any_object(depth + 1)

    def any_object(self, depth: int) -> dict[str, Any]:
        keys = self.rng.sample(_WORDS, self.rng.randint(1, 3))
        return {k: (self.any_value(depth + 1) if depth < MAX_DEPTH else None) for k in keys}

    def obj(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        rng = self.rng
        raw_props = schema.get("properties")
        props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
        required = (
            [r for r in schema.get("required", []) if isinstance(r, str)]
            if isinstance(schema.get("required"), list)
            else []
        )
        out: dict[str, Any] = {}
        # Declared order (xgrammar emits properties in schema order); optional ones at
        # random, fewer as the nesting deepens so recursive schemas end.
        keep_optional = 0.5 if depth < MAX_DEPTH else 0.0
        for name, sub in props.items():
            if name in required or rng.random() < keep_optional:
                out[name] = self.value(sub, depth + 1)
        additional = schema.get("additionalProperties", True)
        for name in required:
            if name not in out:
                out[name] = self.value(additional if isinstance(additional, dict) else True, depth + 1)
        want = schema.get("minProperties", 0)
        if isinstance(want, int):
            for name, sub in props.items():
                if len(out) >= want:
                    break
                if name not in out:
                    out[name] = self.value(sub, depth + 1)
            # Then names the patterns allow (with their schema), else any names additional
            # properties may have: a schema of only patternProperties still gets its count.
            patterns = schema.get("patternProperties")
            pattern_items = list(patterns.items()) if isinstance(patterns, dict) else []
            i = 0
            while len(out) < want and (pattern_items or additional is not False) and i < 1000:
                i += 1
                if pattern_items and (additional is False or rng.random() < 0.5):
                    regex, sub = rng.choice(pattern_items)
                    key = regex_instance(regex, rng, self.budget)
                    if key not in out and key not in props:
                        out[key] = self.value(sub, depth + 1)
                    continue
                key = f"{rng.choice(_WORDS)}{i}"
                if key not in out:
                    out[key] = self.value(additional if isinstance(additional, dict) else True, depth + 1)
        most = schema.get("maxProperties")
        if isinstance(most, int) and len(out) > most:
            for name in [k for k in out if k not in required][: len(out) - most]:
                del out[name]
        return out

    def array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        rng = self.rng
        prefix = schema.get("prefixItems")
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        lo = self.budget.count(schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0)
        hi = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
        n = max(lo, len(prefix))
        if items is not False and depth < MAX_DEPTH:
            n += rng.randint(0, EXTRA_ITEMS)
        if items is False:
            n = max(lo, min(n, len(prefix)))
        if hi is not None:
            n = min(n, hi)
        self.budget.spend(n)  # items cost at least one step each: refuse a huge count at once
        out: list[Any] = []
        unique = schema.get("uniqueItems") is True
        for i in range(n):
            sub = prefix[i] if i < len(prefix) else items
            v = self.value(sub, depth + 1)
            for _ in range(MAX_ATTEMPTS):
                if not unique or v not in out:
                    break
                v = self.value(sub, depth + 1)
            out.append(v)
        contains = schema.get("contains")
        if contains is not None:
            v = self.value(contains, depth + 1)
            if hi is None or len(out) < hi:
                out.append(v)
            elif len(out) > len(prefix):
                out[-1] = v
        return out

    def string(self, schema: dict[str, Any]) -> str:
        rng = self.rng
        lo = self.budget.count(schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0)
        hi = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            for _ in range(MAX_ATTEMPTS):
                s = regex_instance(pattern, rng, self.budget)
                if len(s) >= lo and (hi is None or len(s) <= hi):
                    return s
            return s
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            s = _FORMATS[fmt](rng)
            if len(s) >= lo and (hi is None or len(s) <= hi):
                return s
        shortest = max(lo, 1) if hi is None or hi >= 1 else 0  # prefer non-empty strings
        longest = max(shortest, lo + 8 if hi is None else min(hi, lo + 8))
        n = rng.randint(shortest, longest)
        self.budget.spend(n)
        return "".join(rng.choice(SAFE) for _ in range(n))

    def integer(self, schema: dict[str, Any]) -> int:
        lo, hi = _bounds(schema, integer=True)
        a = math.ceil(lo) if lo is not None else (math.floor(hi) - 100 if hi is not None else 0)
        b = math.floor(hi) if hi is not None else a + 100
        mult = schema.get("multipleOf")
        if isinstance(mult, (int, float)) and not isinstance(mult, bool) and mult > 0:
            v = _multiple(self.rng, mult, a, b)
            if v is not None and float(v).is_integer():
                return int(v)
        return a if a > b else self.rng.randint(a, min(b, a + 1000))

    def number(self, schema: dict[str, Any]) -> float | int:
        lo, hi = _bounds(schema, integer=False)
        a = lo if lo is not None else (hi - 100 if hi is not None else 0.0)
        b = hi if hi is not None else a + 100
        mult = schema.get("multipleOf")
        if isinstance(mult, (int, float)) and not isinstance(mult, bool) and mult > 0:
            m = _multiple(self.rng, mult, a, b)
            if m is not None:
                return m
        if a > b:
            return a
        v = round(self.rng.uniform(a, b), 2)
        return v if a <= v <= b else (a + b) / 2  # rounding may step over a bound


def _multiple(rng: random.Random, mult: float, a: float, b: float) -> float | int | None:
    """A multiple of ``mult`` in [a, b] whose quotient is exact in floating point (as
    jsonschema checks it: 0.3 / 0.1 is not an integer there); None if none is found."""
    qa, qb = a / mult, b / mult  # infinite when the range spans more multiples than a float holds
    if not math.isfinite(qa) and not math.isfinite(qb):
        return 0 if a <= 0 <= b else None
    if not math.isfinite(qb):
        first = math.ceil(qa)
        last = first + 20
    elif not math.isfinite(qa):
        last = math.floor(qb)
        first = last - 20
    else:
        first, last = math.ceil(qa), math.floor(qb)
    if first > last:
        return None
    for _ in range(MAX_ATTEMPTS):
        k = rng.randint(first, min(last, first + 20))
        for v in (round(k * mult, 10), k * mult):  # the short spelling when it is exact
            q = v / mult
            if a <= v <= b and math.isfinite(q) and q == int(q):
                return v
    return 0 if a <= 0 <= b else None


def _is_schema_only_annotations(rest: dict[str, Any]) -> bool:
    return all(k in ("description", "title", "$comment", "default", "examples") for k in rest)


def _merge(a: Any, b: Any) -> Any:
    """Both schemas at once, roughly (allOf): properties merged per key, required and
    type intersected/united; the retry loop catches what this misses."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False  # one of them is false: nothing satisfies both
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k == "properties" and isinstance(v, dict) and isinstance(out[k], dict):
            props = dict(out[k])
            for name, sub in v.items():
                props[name] = _merge(props[name], sub) if name in props else sub
            out[k] = props
        elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "type":
            ta = out[k] if isinstance(out[k], list) else [out[k]]
            tb = v if isinstance(v, list) else [v]
            both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
            both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
            out[k] = both[0] if len(both) == 1 else (both or v)
        elif k in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
            if isinstance(v, (int, float)) and isinstance(out[k], (int, float)):
                out[k] = max(out[k], v)
        elif k in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
            if isinstance(v, (int, float)) and isinstance(out[k], (int, float)):
                out[k] = min(out[k], v)
        else:
            out[k] = v
    return out


def _infer_type(schema: dict[str, Any]) -> str | None:
    if any(k in schema for k in ("properties", "required", "additionalProperties", "minProperties")):
        return "object"
    if any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems", "contains")):
        return "array"
    if any(k in schema for k in ("pattern", "minLength", "maxLength", "format")):
        return "string"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        return "number"
    return None


def _exclusive(schema: dict[str, Any], side: str) -> bool:
    key = "exclusiveMinimum" if side == "min" else "exclusiveMaximum"
    return key in schema and schema[key] is not False


def _bounds(schema: dict[str, Any], *, integer: bool) -> tuple[float | None, float | None]:
    """Inclusive bounds (for integers: exclusive bounds moved by one; for numbers: by a
    small step, enough for the two decimals the generator writes)."""
    step = 1.0 if integer else 0.01
    lo = schema.get("minimum")
    hi = schema.get("maximum")
    lo = float(lo) if isinstance(lo, (int, float)) and not isinstance(lo, bool) else None
    hi = float(hi) if isinstance(hi, (int, float)) and not isinstance(hi, bool) else None
    emin, emax = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if emin is True and lo is not None:  # draft 4: a flag on minimum
        lo += step
    elif isinstance(emin, (int, float)) and not isinstance(emin, bool):
        lo = max(lo, emin + step) if lo is not None else emin + step
    if emax is True and hi is not None:
        hi -= step
    elif isinstance(emax, (int, float)) and not isinstance(emax, bool):
        hi = min(hi, emax - step) if hi is not None else emax - step
    return lo, hi


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


_FORMATS = {
    "date-time": lambda r: (
        f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T"
        f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z"
    ),
    "date": lambda r: f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z",
    "email": lambda r: f"{r.choice(_WORDS)}@{r.choice(_WORDS)}.example",
    "hostname": lambda r: f"{r.choice(_WORDS)}.example",
    "uri": lambda r: f"https://{r.choice(_WORDS)}.example/{r.choice(_WORDS)}",
    "ipv4": lambda r: ".".join(str(r.randint(0, 255)) for _ in range(4)),
    "ipv6": lambda r: ":".join(_hex(r, 4) for _ in range(8)),
    "uuid": lambda r: f"{_hex(r, 8)}-{_hex(r, 4)}-4{_hex(r, 3)}-a{_hex(r, 3)}-{_hex(r, 12)}",
}
