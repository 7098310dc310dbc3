"""Structured outputs: check what a client asks for and build ``proto.StructuredOutput``.

The gateway calls these on ``response_format`` and vLLM's ``structured_outputs`` (or the
legacy ``guided_*`` fields); the engines enforce the result (vLLM through its guided
decoding, the sim by spelling an instance, ``services.worker.engines.guided``). Every
check happens here, before any engine sees the request, so a bad schema, regex or
grammar is a 400 naming the parameter rather than an engine failure.

Pure and synchronous. Grammars are parsed by ``services.common.gbnf``: the gateway
rejects garbage with it and the sim engine walks the same parse tree to generate.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from proto.messages import StructuredOutput

from .gbnf import GrammarError, parse_grammar

MAX_SCHEMA_DEPTH = 64  # deeper is hostile, not a real schema (and would exhaust the stack)
MAX_CHOICES = 1024
# OpenAI's Structured Outputs limits, per schema. Checking a schema is pure Python (~0.2 ms
# a subschema), so the subschemas of a request's schemas together are bounded too (128 real
# tools of 20 parameters hold ~2,700): unbounded, one tool of 40,000 parameters held the
# gateway's event loop, and every other client, for over a minute.
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_ENUM_VALUES = 1000
MAX_SCHEMA_STRING_CHARS = 120_000  # property and definition names, enum, const and pattern strings
MAX_REQUEST_SUBSCHEMAS = 20_000
# Compiling a pattern, and the engines' automata of it, grow with its length.
MAX_REGEX_CHARS = 8192
MAX_GRAMMAR_CHARS = 65536
_CHECKED_CACHE = 1024  # schemas checked lately (agents send the same tools every call)


class StructuredOutputError(ValueError):
    """A structured-output request the engines cannot take; ``param`` is the OpenAI
    parameter path to name in the 400 (e.g. ``response_format.json_schema.schema``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# ------------------------------------------------------------------------- JSON Schema


class SchemaSize:
    """The subschemas a request's schemas hold together (``MAX_REQUEST_SUBSCHEMAS``)."""

    __slots__ = ("subschemas",)

    def __init__(self) -> None:
        self.subschemas = 0


def _check_size(schema: dict[str, Any], param: str, size: SchemaSize) -> None:
    """OpenAI's limits on ``schema``, and its subschemas counted into the request's ``size``
    (every object the walk reaches: properties, items, anyOf branches, $defs alike)."""
    properties = enum_values = chars = subschemas = 0
    stack: list[object] = [schema]
    while stack:  # no recursion: _check_depth bounds nesting only after this
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        subschemas += 1
        for key, value in node.items():
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                    and isinstance(value, dict):
                if key == "properties":
                    properties += len(value)
                chars += sum(len(name) for name in value)
                stack.extend(value.values())  # subschemas: their names are not keywords
                continue
            if key == "enum" and isinstance(value, list):
                enum_values += len(value)
                chars += sum(len(v) for v in value if isinstance(v, str))
            elif key in ("const", "pattern") and isinstance(value, str):
                chars += len(value)
            stack.append(value)
    for count, limit, what in ((properties, MAX_SCHEMA_PROPERTIES, "object properties"),
                               (enum_values, MAX_SCHEMA_ENUM_VALUES, "enum values"),
                               (chars, MAX_SCHEMA_STRING_CHARS, "characters of names, enum, const and pattern values")):
        if count > limit:
            raise StructuredOutputError(f"{param} has {count:,} {what}, more than the {limit:,} allowed.", param)
    size.subschemas += subschemas
    if size.subschemas > MAX_REQUEST_SUBSCHEMAS:
        raise StructuredOutputError(f"{param}: the request's schemas hold {size.subschemas:,} subschemas, more than"
                                    f" the {MAX_REQUEST_SUBSCHEMAS:,} allowed.", param)


def check_json_schema(schema: object, param: str, size: SchemaSize | None = None) -> str:
    """Check ``schema`` (a dict, or JSON text of one) is a valid JSON Schema whose local
    ``$ref``s resolve, within the limits (its subschemas counted into ``size``, the
    request's, when it has several); return it as compact JSON text (``StructuredOutput.json``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise StructuredOutputError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{param} must be a JSON Schema object.", param)
    _check_size(schema, param, size or SchemaSize())
    _check_depth(schema, param)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()  # the cache holds no schema text
    with _checked_lock:  # large requests are parsed on threads (services/gateway/validation.py)
        if digest in _checked:
            _checked.move_to_end(digest)
            return text
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        at = f" at '{where}'" if where else ""
        raise StructuredOutputError(f"{param} is not a valid JSON Schema{at}: {exc.message}", param) from None
    except RecursionError:  # pragma: no cover - _check_depth bounds this first
        raise StructuredOutputError(f"{param} is nested too deeply.", param) from None
    except (OverflowError, re.error) as exc:  # a pattern's format check: re.compile("a{4294967296}")
        raise StructuredOutputError(f"{param} is not a valid JSON Schema: a pattern cannot be compiled: {exc}",
                                    param) from None
    _check_refs(schema, schema, param)
    with _checked_lock:
        _checked[digest] = None
        if len(_checked) > _CHECKED_CACHE:
            _checked.popitem(last=False)
    return text


def check_combined_schema(schema: dict[str, Any], param: str) -> str:
    """``check_json_schema`` for a schema the gateway assembled from parts it checked
    already (the tools' parameters under one wrapper): only what combining can break, the
    nesting and the ``$ref``s; compact JSON text."""
    _check_depth(schema, param)
    _check_refs(schema, schema, param)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


_checked: OrderedDict[bytes, None] = OrderedDict()  # valid schemas by a digest of their text, oldest first
_checked_lock = threading.Lock()


def _check_depth(node: object, param: str) -> None:
    if nested_deeper_than(node, MAX_SCHEMA_DEPTH):
        raise StructuredOutputError(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels.", param)


def nested_deeper_than(node: object, limit: int) -> bool:
    """Whether JSON data (dicts and lists) nests more than ``limit`` levels, found without
    recursion: what a recursive reader (jsonschema, a template's ``tojson``) would run
    out of stack on."""
    stack: list[tuple[object, int]] = [(node, 0)]
    while stack:
        cur, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(cur, dict):
            stack.extend((v, depth + 1) for v in cur.values())
        elif isinstance(cur, list):
            stack.extend((v, depth + 1) for v in cur)
    return False


def resolve_pointer(root: object, ref: str) -> object:
    """The node a local ``$ref`` (``#``, ``#/$defs/x``) names; KeyError if none."""
    if ref == "#" or ref == "":
        return root
    if not ref.startswith("#/"):
        raise KeyError(ref)
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def _check_refs(node: object, root: object, param: str) -> None:
    """Every ``$ref`` must be local and resolve: neither engine fetches remote schemas."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            ref = cur.get("$ref")
            if isinstance(ref, str):
                if not (ref == "#" or ref.startswith("#/")):
                    raise StructuredOutputError(
                        f"{param}: only local $ref ('#/...') is supported, not {ref!r}.", param
                    )
                try:
                    resolve_pointer(root, ref)
                except KeyError:
                    raise StructuredOutputError(f"{param}: $ref {ref!r} does not resolve.", param) from None
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)


def from_json_schema(schema: object, param: str) -> StructuredOutput:
    return StructuredOutput(json=check_json_schema(schema, param))


# ------------------------------------------------------------------------------ regex

# Constructs the guided-decoding backends compile to automata cannot express.
_REGEX_UNSUPPORTED = {
    "GROUPREF": "backreferences",
    "GROUPREF_EXISTS": "conditional groups",
    "ASSERT": "lookaround assertions",
    "ASSERT_NOT": "lookaround assertions",
}


def check_regex(pattern: object, param: str) -> str:
    """``pattern`` must be a string that compiles and uses no backreference or
    lookaround (which regex-to-automaton backends reject)."""
    if not isinstance(pattern, str) or not pattern:
        raise StructuredOutputError(f"{param} must be a non-empty string.", param)
    if len(pattern) > MAX_REGEX_CHARS:
        raise StructuredOutputError(f"{param} is {len(pattern):,} characters long, more than the {MAX_REGEX_CHARS:,}"
                                    " allowed.", param)
    try:
        re.compile(pattern)
        parsed = parse_regex(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise StructuredOutputError(f"{param} is not a valid regular expression: {exc}", param) from None
    stack: list[Any] = [parsed]
    while stack:
        cur = stack.pop()
        if isinstance(cur, (list, tuple)) or type(cur).__name__ == "SubPattern":
            for item in cur:
                stack.append(item)
            continue
        name = str(cur)
        if name in _REGEX_UNSUPPORTED:
            raise StructuredOutputError(f"{param}: {_REGEX_UNSUPPORTED[name]} are not supported.", param)
    return pattern


def parse_regex(pattern: str) -> Any:
    """The stdlib's own parse of a pattern (``re._parser``; ``sre_parse`` before 3.11)."""
    try:
        from re import _parser  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - Python < 3.11
        import sre_parse as _parser
    return _parser.parse(pattern)


def from_regex(pattern: object, param: str) -> StructuredOutput:
    return StructuredOutput(regex=check_regex(pattern, param))


# ----------------------------------------------------------------------------- choice


def check_choice(choices: object, param: str) -> list[str]:
    if not isinstance(choices, list) or not choices:
        raise StructuredOutputError(f"{param} must be a non-empty list of strings.", param)
    if len(choices) > MAX_CHOICES:
        raise StructuredOutputError(f"{param} has more than {MAX_CHOICES} choices.", param)
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise StructuredOutputError(f"{param}[{i}] must be a non-empty string.", param)
    return list(choices)


def from_choice(choices: object, param: str) -> StructuredOutput:
    return StructuredOutput(choice=check_choice(choices, param))


def check_grammar(grammar: object, param: str) -> str:
    if not isinstance(grammar, str) or not grammar.strip():
        raise StructuredOutputError(f"{param} must be a non-empty grammar string.", param)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(f"{param} is {len(grammar):,} characters long, more than the"
                                    f" {MAX_GRAMMAR_CHARS:,} allowed.", param)
    try:
        parse_grammar(grammar)
    except GrammarError as exc:
        raise StructuredOutputError(f"{param} is not a valid grammar: {exc}", param) from None
    return grammar


def from_grammar(grammar: object, param: str) -> StructuredOutput:
    return StructuredOutput(grammar=check_grammar(grammar, param))


# ----------------------------------------------------------------- request fields


def from_response_format(response_format: object, param: str = "response_format") -> StructuredOutput | None:
    """OpenAI ``response_format``: ``text`` → None, ``json_object``, or ``json_schema``
    with ``{"name", "schema", "strict"?, "description"?}``."""
    if not isinstance(response_format, dict):
        raise StructuredOutputError(f"{param} must be an object.", param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise StructuredOutputError(
            f"{param}.type must be 'text', 'json_object' or 'json_schema', not {kind!r}.", f"{param}.type"
        )
    js = response_format.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(js, dict):
        raise StructuredOutputError(f"{where} must be an object with 'name' and 'schema'.", where)
    name = js.get("name")
    if not isinstance(name, str) or not name:
        # OpenAI also restricts the characters; vLLM takes any name, and so do we.
        raise StructuredOutputError(f"{where}.name must be a non-empty string.", f"{where}.name")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise StructuredOutputError(f"{where}.strict must be a boolean.", f"{where}.strict")
    if "description" in js and not isinstance(js["description"], (str, type(None))):
        raise StructuredOutputError(f"{where}.description must be a string.", f"{where}.description")
    if "schema" not in js:
        raise StructuredOutputError(f"{where}.schema is required.", f"{where}.schema")
    return from_json_schema(js["schema"], f"{where}.schema")


_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options, accepted at their defaults (false, null): clients
# that serialize a whole params object send them; a set one would change the output.
_DEFAULT_OFF_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def from_structured_outputs(value: object, param: str = "structured_outputs") -> StructuredOutput:
    """vLLM's ``structured_outputs`` object: exactly one of json, regex, choice,
    grammar, json_object (``structural_tag`` and set whitespace options are refused)."""
    if not isinstance(value, dict):
        raise StructuredOutputError(f"{param} must be an object.", param)
    for key in value:
        if key in _DEFAULT_OFF_OPTIONS and value[key] in (None, False):
            continue
        if key not in _FIELDS and value[key] is not None:
            detail = " (only its default, false or null, is)" if key in _DEFAULT_OFF_OPTIONS else ""
            raise StructuredOutputError(f"{param}.{key} is not supported{detail}.", f"{param}.{key}")
    given = [k for k in _FIELDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise StructuredOutputError(
            f"{param} must set exactly one of {', '.join(_FIELDS)} (got {len(given)}).", param
        )
    key = given[0]
    where = f"{param}.{key}"
    if key == "json":
        return from_json_schema(value[key], where)
    if key == "regex":
        return from_regex(value[key], where)
    if key == "choice":
        return from_choice(value[key], where)
    if key == "grammar":
        return from_grammar(value[key], where)
    if value[key] is not True:
        raise StructuredOutputError(f"{where} must be true.", where)
    return StructuredOutput(json_object=True)


def from_guided_fields(fields: Mapping[str, object]) -> StructuredOutput | None:
    """The legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` fields (None values are absent); at most one may be set."""
    present = {k: v for k, v in fields.items() if v is not None}
    if not present:
        return None
    if len(present) > 1:
        names = sorted(present)
        raise StructuredOutputError(f"Only one of {', '.join(names)} may be set.", names[1])
    key, value = next(iter(present.items()))
    if key == "guided_json":
        return from_json_schema(value, key)
    if key == "guided_regex":
        return from_regex(value, key)
    if key == "guided_choice":
        return from_choice(value, key)
    if key == "guided_grammar":
        return from_grammar(value, key)
    raise StructuredOutputError(f"{key} is not a guided decoding field.", key)
