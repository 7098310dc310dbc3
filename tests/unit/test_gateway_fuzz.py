"""Fuzz: any body yields a NormalizedRequest or an ApiError with a 4xx status, nothing else.

Three generators: arbitrary JSON documents, bodies shaped like real requests whose
field values are drawn from everything JSON can hold (wrong types, huge numbers, odd
unicode, nesting), and raw or corrupted bytes. Successful parses must satisfy the
invariants the rest of the mesh relies on.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proto import GenerateRequest, decode, encode
from services.common.tokenizer import ByteTokenizer
from services.gateway.errors import ApiError
from services.gateway.models import ModelLimits, ModelSpec
from services.gateway.normalized import parse_ws_message
from services.gateway.validation import parse_request

BYTE = ByteTokenizer()
MODELS = {
    "sim": ModelSpec("sim", BYTE, ModelLimits(max_model_len=512, max_top_k=50)),
    "tiny": ModelSpec("tiny", BYTE, ModelLimits(max_model_len=40, max_tokens_cap=8)),
}

FUZZ = settings(
    max_examples=500,
    deadline=None,
    database=None,  # the tree is shared: no .hypothesis writes
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

huge_ints = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 2**63 - 1])
odd_text = st.text(
    alphabet=st.characters(codec="utf-8") | st.sampled_from(["\x00", "\u202e", "\ufeff", "🙂", "é"]),
    max_size=24,
)
leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-300, max_value=600)
    | huge_ints
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(min_value=-3, max_value=3)
    | odd_text
)
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=12,
)

text_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""])}, optional={"text": odd_text | json_values}),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""]) | json_values,
            "content": odd_text | text_parts | st.none() | json_values,
            "name": odd_text | json_values,
        },
    ),
    max_size=4,
)
numbers = st.integers(min_value=-5, max_value=600) | huge_ints | st.floats(min_value=-5, max_value=5) | json_values

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": messages | json_values,
    "prompt": odd_text
    | st.lists(st.integers(min_value=-3, max_value=300), max_size=8)
    | st.lists(odd_text | st.lists(st.integers(min_value=0, max_value=300), max_size=4), max_size=2)
    | json_values,
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_tokens": numbers,
    "n": numbers,
    "seed": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "stop": odd_text | st.lists(odd_text, max_size=6) | json_values,
    "stop_token_ids": st.lists(st.integers(min_value=-2, max_value=300), max_size=4) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "user": odd_text | json_values,
    "session_id": odd_text | json_values,
    "logprobs": st.booleans() | numbers,
    "echo": st.booleans() | json_values,
    "best_of": numbers,
    "tools": json_values,
    "tool_choice": json_values,
    "response_format": st.just({"type": "text"}) | json_values,
    "logit_bias": json_values,
    "suffix": odd_text | json_values,
    "top_logprobs": numbers,
    "parallel_tool_calls": st.booleans() | json_values,
    "min_p": numbers,
    "prompt_logprobs": numbers,
    "truncate_prompt_tokens": numbers,
    "skip_special_tokens": st.booleans() | json_values,
    "include_stop_str_in_output": st.booleans() | json_values,
    "guided_json": json_values,
    "guided_regex": odd_text | json_values,
    "guided_choice": json_values,
    "guided_grammar": odd_text | json_values,
    "structured_outputs": json_values,
    "metadata": json_values,
    "chat_template_kwargs": json_values,
    "continue_final_message": st.booleans() | json_values,
    "reasoning_effort": odd_text | json_values,
}

wild_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["sim", "tiny"]) | odd_text | json_values},
    optional=FIELDS,
)


def mostly(valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any] = json_values) -> st.SearchStrategy[Any]:
    """``valid`` 29 times in 30: bodies must get past the type checks to reach the range,
    context-length, template and tokenizer code, with a dozen fields each at risk."""
    return st.integers(min_value=0, max_value=29).flatmap(lambda i: wild if i == 0 else valid)


valid_text = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["system", "developer", "user", "assistant"])),
            "content": mostly(valid_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}),
                                                    min_size=1, max_size=3)),
        }
    ),
    min_size=1,
    max_size=3,
)
valid_prompt = mostly(
    valid_text
    | st.lists(st.integers(min_value=0, max_value=258), min_size=1, max_size=50)
    | st.lists(valid_text, min_size=1, max_size=1)
    | st.lists(st.lists(st.integers(min_value=0, max_value=258), min_size=1, max_size=10), min_size=1, max_size=1)
)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": mostly(st.integers(min_value=0, max_value=600) | huge_ints),
    "max_completion_tokens": mostly(st.integers(min_value=0, max_value=600)),
    "temperature": mostly(st.floats(min_value=0, max_value=2.2)),
    "top_p": mostly(st.floats(min_value=0, max_value=1.1)),
    "top_k": mostly(st.integers(min_value=-2, max_value=300) | huge_ints),
    "min_tokens": mostly(st.integers(min_value=-1, max_value=20)),
    "n": mostly(st.sampled_from([1, 1, 1, 0, 2])),
    "seed": mostly(st.integers(min_value=-1000, max_value=1000) | huge_ints),
    "presence_penalty": mostly(st.floats(min_value=-2.5, max_value=2.5)),
    "frequency_penalty": mostly(st.floats(min_value=-2.5, max_value=2.5)),
    "repetition_penalty": mostly(st.floats(min_value=0, max_value=2.5)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": mostly(valid_text | st.lists(valid_text, max_size=5)),
    "stop_token_ids": mostly(st.lists(st.integers(min_value=-1, max_value=300), max_size=4)),
    "ignore_eos": mostly(st.booleans()),
    "user": mostly(odd_text),
    "session_id": mostly(odd_text),
    "logprobs": mostly(st.booleans() | st.integers(min_value=-1, max_value=25)),
    "top_logprobs": mostly(st.integers(min_value=-1, max_value=25)),
    "echo": mostly(st.booleans()),
    "logit_bias": mostly(st.dictionaries(st.integers(min_value=-5, max_value=300).map(str),
                                         st.floats(min_value=-120, max_value=120), max_size=3)),
    "min_p": mostly(st.floats(min_value=-0.1, max_value=1.1)),
    "truncate_prompt_tokens": mostly(st.integers(min_value=-2, max_value=600)),
    "tools": mostly(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "get_weather", "bad name"])},
        optional={"parameters": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}},
                                                 {"type": "nonsense"}, {}])})}), min_size=1, max_size=2)),
    "tool_choice": mostly(st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])),
    "response_format": mostly(st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ])),
    "guided_regex": mostly(st.sampled_from([r"\d+", "(unclosed", "[a-z]{2,4}"])),
    "guided_choice": mostly(st.lists(valid_text, max_size=3)),
    "metadata": mostly(st.dictionaries(odd_text, odd_text | st.integers(), max_size=3)),
}
plausible_model = mostly(st.sampled_from(["sim", "tiny"]), odd_text)
plausible_requests = st.tuples(
    st.just("chat"), st.fixed_dictionaries({"model": plausible_model, "messages": valid_messages}, optional=PLAUSIBLE)
) | st.tuples(
    st.just("completion"), st.fixed_dictionaries({"model": plausible_model, "prompt": valid_prompt}, optional=PLAUSIBLE)
)
request_bodies = wild_bodies | plausible_requests.map(lambda kind_body: kind_body[1])


def _encode(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")


def _check(kind: str, body: bytes) -> None:
    try:
        req = parse_request(kind, body, MODELS)  # type: ignore[arg-type]
    except ApiError as err:
        assert 400 <= err.status < 500, (err, body[:200])
        assert err.message
        err.to_json()
        return
    limits = MODELS[req.requested_model].limits
    assert req.prompt_token_ids, body
    assert all(0 <= t < BYTE.vocab_size for t in req.prompt_token_ids)
    # 0 only where vLLM allows it: a completion that echoes its prompt and generates nothing
    assert 1 <= req.max_tokens or (req.max_tokens == 0 and kind == "completion" and req.output.echo is not None)
    assert req.prompt_tokens + req.max_tokens <= limits.max_model_len
    assert 0 <= req.sampling.min_tokens <= req.max_tokens
    assert 1 <= req.sampling.n <= limits.max_n and req.output.n == req.sampling.n
    assert req.sampling.logprobs is None or 0 <= req.sampling.logprobs <= limits.max_logprobs
    assert all(0 <= t < BYTE.vocab_size and -100 <= b <= 100 for t, b in req.sampling.logit_bias.items())
    # everything must survive the wire to the worker
    gen = req.generate_request(request_id="r", token_subject="mesh.tokens.g.r")
    assert decode(encode(gen), GenerateRequest).sampling == req.sampling


@settings(FUZZ, max_examples=1500)
@given(request=plausible_requests, ascii_only=st.booleans())
@example(("completion", {"model": "sim", "prompt": "0", "echo": True, "max_tokens": 0}), False)  # the prompt alone
@example(("chat", {"model": "sim", "messages": [{"role": "user", "content": "0"}], "max_tokens": 0}), False)  # a 400
def test_plausible_bodies(request: tuple[str, dict[str, Any]], ascii_only: bool) -> None:
    kind, body = request
    _check(kind, _encode(body, ascii_only))


@settings(FUZZ, max_examples=600)
@given(kind=st.sampled_from(["chat", "completion"]), body=wild_bodies, ascii_only=st.booleans())
def test_wild_bodies(kind: str, body: dict[str, Any], ascii_only: bool) -> None:
    _check(kind, _encode(body, ascii_only))


@settings(FUZZ, max_examples=600)
@given(kind=st.sampled_from(["chat", "completion"]), value=json_values)
def test_arbitrary_json(kind: str, value: Any) -> None:
    _check(kind, _encode(value, True))


@settings(FUZZ, max_examples=600)
@given(
    kind=st.sampled_from(["chat", "completion"]),
    body=request_bodies,
    cut=st.integers(min_value=0, max_value=400),
    junk=st.binary(max_size=4),
)
def test_corrupted_bytes(kind: str, body: dict[str, Any], cut: int, junk: bytes) -> None:
    raw = _encode(body, False)
    cut = min(cut, len(raw))
    _check(kind, raw[:cut] + junk + raw[cut + len(junk):])


@settings(FUZZ, max_examples=300)
@given(kind=st.sampled_from(["chat", "completion"]), raw=st.binary(max_size=64))
def test_raw_bytes(kind: str, raw: bytes) -> None:
    _check(kind, raw)


@settings(FUZZ, max_examples=300)
@given(
    msg=st.fixed_dictionaries(
        {"type": st.sampled_from(["auth", "chat.completion", "completion", "cancel"]) | odd_text | json_values},
        optional={"id": odd_text | json_values, "body": request_bodies | json_values, "api_key": odd_text | json_values},
    )
)
def test_ws_messages(msg: dict[str, Any]) -> None:
    try:
        parse_ws_message(_encode(msg, False))
    except ApiError as err:
        assert 400 <= err.status < 500


def test_pathological_inputs() -> None:
    deep = b"[" * 50_000 + b"]" * 50_000
    for kind in ("chat", "completion"):
        for body in (
            deep,
            b'{"model":"sim","messages":[{"role":"user","content":' + deep + b"}]}",
            b'{"model":"sim","prompt":' + deep + b"}",
            b'{"model":"sim","unknown":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
            b'{"model":"sim","prompt":"\\ud800"}',  # lone surrogate escape
            b'{"model":"sim","prompt":"x","temperature":1e999}',
            b'{"model":"sim","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
            b"\xef\xbb\xbf{}",  # UTF-8 BOM
            b"{}" * 1000,
        ):
            _check(kind, body)
