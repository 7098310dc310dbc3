"""Validation: every error case's status/param/code, context length, exact token counts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto import AdmissionDecision, ErrorCode, GenerateRequest, decode, encode, unpack_tokens
from services.common.tokenizer import ByteTokenizer, HFTokenizer
from services.gateway.chat_request import parse_chat_request
from services.gateway.chat_template import ChatTemplate
from services.gateway.errors import (
    ApiError,
    from_admission,
    from_mesh_error,
    invalid_api_key,
    missing_api_key,
    payload_too_large,
    rate_limited,
)
from services.gateway.models import ModelLimits, ModelSpec
from services.gateway.normalized import NormalizedRequest, parse_ws_message
from services.gateway.openai_api import RequestKind
from services.gateway.validation import parse_completion_request, parse_request, parse_ws_request

BYTE = ByteTokenizer()
LIMITS = ModelLimits(max_model_len=256, max_tokens_cap=200, max_top_k=100)
MODELS = {
    "sim": ModelSpec("sim", BYTE, LIMITS),
    "sim-alias": ModelSpec("sim", BYTE, LIMITS),
    "other": ModelSpec("other", BYTE, ModelLimits(max_model_len=64)),
}
# The default ChatML template around one user message, in bytes = byte-tokenizer tokens.
CHATML_OVERHEAD = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")


def chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


def completion(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "sim", "prompt": "hi"}
    body.update(fields)
    return json.dumps(body).encode()


def error_of(fn: Any, body: bytes | str, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body, MODELS, **kw)
    return info.value


# ------------------------------------------------------------------------ happy paths


def test_chat_normalises_and_tokenizes_once() -> None:
    req = parse_chat_request(
        chat(max_tokens=10, temperature=0.0, top_p=0.5, top_k=5, seed=3, stop="END", stream=True,
             stream_options={"include_usage": True}, user="alice", min_tokens=2, ignore_eos=True,
             repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5, stop_token_ids=[2]),
        MODELS,
    )
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert req.prompt_token_ids == BYTE.encode(rendered)
    assert req.kind == "chat" and req.model == "sim" and req.requested_model == "sim"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.min_tokens) == (10, 0.0, 0.5, 5, 3, ["END"], 2)
    assert (s.ignore_eos, s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.stop_token_ids) == (
        True, 1.2, 0.5, -0.5, [2]
    )
    assert req.stream and req.include_usage
    assert req.session_key == "alice" and req.user == "alice"
    assert req.reserved_tokens == len(rendered) + 10


def test_token_counts_are_exact_with_the_byte_tokenizer() -> None:
    content = "héllo wörld ✓ 🙂"
    req = parse_chat_request(chat(messages=[{"role": "user", "content": content}]), MODELS)
    assert req.prompt_tokens == CHATML_OVERHEAD + len(content.encode("utf-8"))
    req = parse_completion_request(completion(prompt=content), MODELS)
    assert req.prompt_token_ids == [b + 3 for b in content.encode("utf-8")]


def test_content_parts_developer_role_and_alias() -> None:
    req = parse_chat_request(
        chat(
            model="sim-alias",
            messages=[
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
        ),
        MODELS,
    )
    text = BYTE.decode(req.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n")
    assert "<|im_start|>assistant\n<|im_end|>" in text
    assert req.model == "sim" and req.requested_model == "sim-alias"


def test_defaults_come_from_the_model_limits() -> None:
    limits = ModelLimits(max_model_len=100, default_temperature=0.7, default_top_p=0.8)
    models = {"m": ModelSpec("m", BYTE, limits)}
    req = parse_chat_request(chat(model="m"), models)
    assert req.sampling.temperature == 0.7 and req.sampling.top_p == 0.8
    assert req.max_tokens == 100 - req.prompt_tokens  # chat: the rest of the context
    assert not req.stream and not req.include_usage and req.session_key is None
    capped = {"m": ModelSpec("m", BYTE, ModelLimits(max_model_len=100, max_tokens_cap=7))}
    assert parse_chat_request(chat(model="m"), capped).max_tokens == 7
    dflt = {"m": ModelSpec("m", BYTE, ModelLimits(max_model_len=100, default_max_tokens=20))}
    assert parse_chat_request(chat(model="m"), dflt).max_tokens == 20
    # legacy completions default to 16, clamped to what fits
    assert parse_completion_request(completion(model="m"), models).max_tokens == 16
    assert parse_completion_request(completion(model="m", prompt="x" * 95), models).max_tokens == 5


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat_request(chat(max_tokens=50, max_completion_tokens=9), MODELS).max_tokens == 9


def test_session_id_wins_over_user() -> None:
    req = parse_chat_request(chat(user="u", session_id="s"), MODELS)
    assert req.session_key == "s" and req.user == "u"


def test_top_k_zero_or_beyond_vocab_means_disabled() -> None:
    models = {"m": ModelSpec("m", BYTE, ModelLimits())}
    assert parse_chat_request(chat(model="m", top_k=0), models).sampling.top_k == -1
    assert parse_chat_request(chat(model="m", top_k=10**30), models).sampling.top_k == -1
    assert parse_chat_request(chat(model="m", top_k=BYTE.vocab_size - 1), models).sampling.top_k == BYTE.vocab_size - 1


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [
        ([5, 6, 7], [5, 6, 7]),
        ([[5, 6]], [5, 6]),
        (["ab"], [100, 101]),
        ([0, 258], [0, 258]),
    ],
)
def test_completion_prompt_shapes(prompt: Any, ids: list[int]) -> None:
    assert parse_completion_request(completion(prompt=prompt), MODELS).prompt_token_ids == ids


def test_body_may_be_str_bytearray_memoryview() -> None:
    raw = completion()
    for body in (raw.decode(), bytearray(raw), memoryview(raw)):
        assert parse_completion_request(body, MODELS).prompt_tokens == 2


def test_generate_request_packs_the_prompt() -> None:
    req = parse_chat_request(chat(max_tokens=4, session_id="s"), MODELS)
    gen = req.generate_request(request_id="r1", token_subject="mesh.tokens.g.r1", gateway_id="g", org="acme",
                               key_id="k", tier="premium", arrival_time=1.5, reserved_tokens=req.reserved_tokens)
    back = decode(encode(gen), GenerateRequest)
    assert unpack_tokens(back.prompt) == req.prompt_token_ids
    assert back.sampling.max_tokens == 4 and back.session_key == "s" and back.tier == "premium"
    assert back.reserved_tokens == req.reserved_tokens


def test_ws_messages_and_requests() -> None:
    msg = parse_ws_message(b'{"type":"chat.completion","id":"c1","body":' + chat(max_tokens=3) + b"}")
    req = parse_ws_request(msg, MODELS)  # type: ignore[arg-type]
    assert req.stream and req.kind == "chat" and req.max_tokens == 3
    msg = parse_ws_message(b'{"type":"completion","id":"c2","body":' + completion() + b"}")
    assert parse_ws_request(msg, MODELS).kind == "completion"  # type: ignore[arg-type]
    # The socket always streams, so the body is checked as a streamed one: stream_options
    # without "stream" is fine, and prompt_logprobs (which a stream cannot carry, and the
    # socket's frames had no field for: computed, then dropped) is vLLM's 400.
    msg = parse_ws_message(b'{"type":"completion","id":"c3","body":'
                           + completion(stream_options={"include_usage": True}) + b"}")
    assert parse_ws_request(msg, MODELS).include_usage  # type: ignore[arg-type]
    msg = parse_ws_message(b'{"type":"completion","id":"c4","body":' + completion(prompt_logprobs=2) + b"}")
    with pytest.raises(ApiError) as info:
        parse_ws_request(msg, MODELS)  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, "prompt_logprobs")
    for bad, param in [
        (b'{"type":"cancel","id":""}', "id"),
        (b'{"type":"cancel","id":"' + b"x" * 200 + b'"}', "id"),
        (b'{"type":"launch","id":"x"}', "type"),
        (b'{"type":"auth"}', "api_key"),
    ]:
        with pytest.raises(ApiError) as info:
            parse_ws_message(bad)
        assert info.value.status == 400 and info.value.param == param
    with pytest.raises(ApiError) as info:
        parse_ws_message(b"not json")
    assert info.value.code == "invalid_json"


# ------------------------------------------------------------------------ error cases

CHAT_ERRORS: list[tuple[str, bytes, int, str | None, str | None]] = [
    ("malformed json", b'{"model": "sim",', 400, None, "invalid_json"),
    ("empty body", b"", 400, None, "invalid_json"),
    ("not utf-8", b'{"model": "\xff"}', 400, None, "invalid_json"),
    ("not an object", b"[1, 2]", 400, None, "invalid_type"),
    ("missing model", b'{"messages": []}', 400, "model", "missing_required_parameter"),
    ("missing messages", b'{"model": "sim"}', 400, "messages", "missing_required_parameter"),
    ("empty model", chat(model=""), 400, "model", "missing_required_parameter"),
    ("unknown model", chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("wrong type", chat(max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("float for int", chat(max_tokens=5.0), 400, "max_tokens", "invalid_type"),
    ("bool for int", chat(n=True), 400, "n", "invalid_type"),
    ("nested wrong type", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "invalid_type"),
    ("missing role", chat(messages=[{"content": "x"}]), 400, "messages[0].role", "missing_required_parameter"),
    ("empty messages", chat(messages=[]), 400, "messages", "invalid_value"),
    ("tool message without its call id", chat(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].tool_call_id", "missing_required_parameter"),
    ("unknown role", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "unsupported_value"),
    ("no content", chat(messages=[{"role": "user"}]), 400, "messages[0].content", "missing_required_parameter"),
    ("image part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content[0].type", "unsupported_value"),
    ("text part without text", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     400, "messages[0].content[0].text", "missing_required_parameter"),
    ("temperature high", chat(temperature=2.5), 400, "temperature", "invalid_value"),
    ("temperature negative", chat(temperature=-0.1), 400, "temperature", "invalid_value"),
    ("top_p zero", chat(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p above one", chat(top_p=1.01), 400, "top_p", "invalid_value"),
    ("presence penalty", chat(presence_penalty=2.5), 400, "presence_penalty", "invalid_value"),
    ("frequency penalty", chat(frequency_penalty=-3), 400, "frequency_penalty", "invalid_value"),
    ("repetition penalty", chat(repetition_penalty=0), 400, "repetition_penalty", "invalid_value"),
    ("top_k negative", chat(top_k=-2), 400, "top_k", "invalid_value"),
    ("top_k over cap", chat(top_k=101), 400, "top_k", "invalid_value"),
    ("max_tokens zero", chat(max_tokens=0), 400, "max_tokens", "integer_below_min_value"),
    ("max_tokens over cap", chat(max_tokens=201), 400, "max_tokens", "invalid_value"),
    ("max_completion_tokens zero", chat(max_completion_tokens=0), 400, "max_completion_tokens", "integer_below_min_value"),
    ("huge max_tokens", chat(max_tokens=10**30), 400, "max_tokens", "invalid_value"),
    ("min_tokens negative", chat(min_tokens=-1), 400, "min_tokens", "invalid_value"),
    ("min over max", chat(max_tokens=5, min_tokens=6), 400, "min_tokens", "invalid_value"),
    ("n above the limit", chat(n=17), 400, "n", "invalid_value"),
    ("n zero", chat(n=0), 400, "n", "invalid_value"),
    ("seed too big", chat(seed=2**63), 400, "seed", "invalid_value"),
    ("too many stops", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    ("empty stop", chat(stop=""), 400, "stop", "invalid_value"),
    ("long stop", chat(stop="x" * 257), 400, "stop", "invalid_value"),
    ("stop token out of vocab", chat(stop_token_ids=[259]), 400, "stop_token_ids", "invalid_value"),
    ("stream_options without stream", chat(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value"),
    ("top_logprobs without logprobs", chat(top_logprobs=3), 400, "top_logprobs", "invalid_value"),
    ("top_logprobs above the limit", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    ("tools auto without a parser", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
     "unsupported_value"),
    ("tool_choice without tools", chat(tool_choice="auto"), 400, "tool_choice", "invalid_value"),
    ("unknown response_format", chat(response_format={"type": "xml"}), 400, "response_format.type", "invalid_value"),
    ("bad json schema", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}), 400, "response_format.json_schema.schema", "invalid_value"),
    ("bad guided regex", chat(guided_regex="(x"), 400, "guided_regex", "invalid_value"),
    ("two structured outputs", chat(guided_choice=["a"], response_format={"type": "json_object"}), 400, "guided_*",
     "invalid_value"),
    ("logit_bias outside the vocabulary", chat(logit_bias={"50256000": -100}), 400, "logit_bias", "invalid_value"),
    ("logit_bias beyond 100", chat(logit_bias={"5": 101}), 400, "logit_bias", "invalid_value"),
    ("min_p above 1", chat(min_p=1.5), 400, "min_p", "invalid_value"),
    ("metadata value not a string", chat(metadata={"k": 1}), 400, "metadata.k", "invalid_value"),
    ("legacy functions", chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    ("flex service tier", chat(service_tier="flex"), 400, "service_tier", "unsupported_parameter"),
    ("verbosity high", chat(verbosity="high"), 400, "verbosity", "unsupported_parameter"),
    ("truncate to zero", chat(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens", "invalid_value"),
    ("audio modality", chat(modalities=["text", "audio"]), 400, "modalities", "unsupported_parameter"),
    ("long user", chat(user="u" * 257), 400, "user", "invalid_value"),
    ("deep nesting", b'{"model":"sim","messages":[],"tools":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     "invalid_json"),
]


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), CHAT_ERRORS, ids=[c[0] for c in CHAT_ERRORS])
def test_chat_errors(name: str, body: bytes, status: int, param: str | None, code: str | None) -> None:
    err = error_of(parse_chat_request, body)
    assert (err.status, err.param, err.code) == (status, param, code), err.message
    assert err.type == "invalid_request_error"
    assert err.message


def test_supported_values_of_unsupported_fields_pass() -> None:
    req = parse_chat_request(
        chat(logprobs=False, tool_choice="none", response_format={"type": "text"},
             modalities=["text"], logit_bias={}, n=1, best_of=1),
        MODELS,
    )
    assert req.prompt_tokens > 0


COMPLETION_ERRORS: list[tuple[str, bytes, int, str | None, str | None]] = [
    ("missing prompt", b'{"model":"sim"}', 400, "prompt", "missing_required_parameter"),
    ("empty string", completion(prompt=""), 400, "prompt", "invalid_value"),
    ("empty list", completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("empty inner list", completion(prompt=[[]]), 400, "prompt", "invalid_value"),
    ("token out of vocab", completion(prompt=[1, 259]), 400, "prompt", "invalid_value"),
    ("negative token", completion(prompt=[-1]), 400, "prompt", "invalid_value"),
    ("batch of strings", completion(prompt=["a", "b"]), 400, "prompt", "unsupported_value"),
    ("batch of token lists", completion(prompt=[[1], [2]]), 400, "prompt", "unsupported_value"),
    ("mixed list", completion(prompt=["a", 1]), 400, "prompt", "invalid_type"),
    ("bool in prompt", completion(prompt=[True]), 400, "prompt[0]", "invalid_type"),
    ("best_of", completion(best_of=2), 400, "best_of", "unsupported_parameter"),
    ("logprobs above the limit", completion(logprobs=21), 400, "logprobs", "invalid_value"),
    ("suffix", completion(suffix="end"), 400, "suffix", "unsupported_parameter"),
    ("n above the limit", completion(n=100), 400, "n", "invalid_value"),
    ("unknown model", completion(model="nope"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), COMPLETION_ERRORS,
                         ids=[c[0] for c in COMPLETION_ERRORS])
def test_completion_errors(name: str, body: bytes, status: int, param: str | None, code: str | None) -> None:
    err = error_of(parse_completion_request, body)
    assert (err.status, err.param, err.code) == (status, param, code), err.message


def test_key_model_allow_list_answers_404() -> None:
    assert error_of(parse_chat_request, chat(), allowed_models=["other"]).status == 404
    assert parse_chat_request(chat(model="sim-alias"), MODELS, allowed_models=["sim"]).model == "sim"
    assert parse_chat_request(chat(), MODELS, allowed_models=[]).model == "sim"  # empty: all models


def test_long_model_names_are_clipped_in_messages() -> None:
    err = error_of(parse_chat_request, chat(model="m" * 100_000))
    assert err.status == 404 and len(err.message) < 400


# ------------------------------------------------------------------ context length


def test_context_length_boundary_chat() -> None:
    # "other": max_model_len 64; the prompt is CHATML_OVERHEAD + len(content) tokens
    content = "x" * 10
    prompt = CHATML_OVERHEAD + 10
    room = 64 - prompt
    ok = parse_chat_request(chat(model="other", messages=[{"role": "user", "content": content}], max_tokens=room), MODELS)
    assert ok.prompt_tokens + ok.max_tokens == 64
    err = error_of(parse_chat_request, chat(model="other", messages=[{"role": "user", "content": content}],
                                            max_tokens=room + 1))
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert err.message == (
        f"This model's maximum context length is 64 tokens. However, you requested 65 tokens ({prompt} in the"
        f" messages, {room + 1} in the completion). Please reduce the length of the messages or completion."
    )


def test_truncating_to_the_model_leaves_room_for_the_output_asked_for() -> None:
    """``truncate_prompt_tokens: -1`` (and Responses' truncation "auto", which sends it)
    kept the model's whole length, so a conversation longer than the model was cut to a
    prompt that left no output token: the same 400 as without truncation."""
    long = [{"role": "user", "content": "x" * 500}]
    cut = parse_chat_request(chat(model="other", messages=long, truncate_prompt_tokens=-1, max_tokens=10), MODELS)
    assert (cut.prompt_tokens, cut.max_tokens) == (54, 10)
    bare = parse_chat_request(chat(model="other", messages=long, truncate_prompt_tokens=-1), MODELS)
    assert bare.prompt_tokens == 63 and bare.max_tokens == 1
    short = parse_chat_request(chat(model="other", truncate_prompt_tokens=-1, max_tokens=10), MODELS)
    assert short.prompt_tokens == CHATML_OVERHEAD + 2  # a prompt that fits is untouched
    done = parse_completion_request(completion(model="other", prompt="y" * 500, truncate_prompt_tokens=-1,
                                               max_tokens=4), MODELS)
    assert (done.prompt_tokens, done.max_tokens) == (60, 4)


def test_context_length_prompt_alone_too_long() -> None:
    err = error_of(parse_chat_request, chat(model="other", messages=[{"role": "user", "content": "x" * 64}]))
    assert err.code == "context_length_exceeded"
    assert f"your messages resulted in {CHATML_OVERHEAD + 64} tokens" in err.message
    # a prompt exactly one token short of the limit still gets one output token
    req = parse_completion_request(completion(model="other", prompt="x" * 63), MODELS)
    assert req.max_tokens == 1
    err = error_of(parse_completion_request, completion(model="other", prompt="x" * 64))
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")


def test_context_length_completion_message() -> None:
    err = error_of(parse_completion_request, completion(model="other", prompt=[5] * 60, max_tokens=10))
    assert "(60 in the prompt, 10 in the completion)" in err.message


# ------------------------------------------------------------- templates in validation


def test_template_rejection_is_400_and_broken_template_is_500() -> None:
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    broken = ChatTemplate("{{ messages[0].nope.deeper }}")
    models = {"strict": ModelSpec("strict", BYTE, template=strict), "broken": ModelSpec("broken", BYTE, template=broken)}
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat(model="strict", messages=[{"role": "assistant", "content": "x"}]), models)
    assert (info.value.status, info.value.message, info.value.param) == (400, "user first", "messages")
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat(model="broken"), models)
    assert (info.value.status, info.value.type, info.value.code) == (500, "server_error", "chat_template_error")


def test_a_template_failing_on_the_clients_own_variables_is_a_400() -> None:
    # Llama 3.1's template adds "Today Date: " + date_string: a number there was a 500
    # ("the model's chat template is broken"); vLLM answers 400.
    dated = ChatTemplate("{{ 'Today Date: ' + date_string }}{{ messages[0].content }}")
    models = {"dated": ModelSpec("dated", BYTE, template=dated)}
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat(model="dated", chat_template_kwargs={"date_string": 20240101}), models)
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")
    assert "TypeError" in info.value.message
    assert parse_chat_request(chat(model="dated", chat_template_kwargs={"date_string": "1 Jan 2024"}), models).prompt_token_ids


def test_template_output_limit_is_context_length_exceeded() -> None:
    small = ChatTemplate(max_output_chars=100)
    models = {"m": ModelSpec("m", BYTE, template=small)}
    err = error_of(lambda b, _m: parse_chat_request(b, models), chat(model="m", messages=[{"role": "user", "content": "x" * 200}]))
    assert (err.status, err.code) == (400, "context_length_exceeded")


def test_empty_rendered_prompt_is_refused() -> None:
    models = {"m": ModelSpec("m", BYTE, template=ChatTemplate(""))}
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat(model="m"), models)
    assert (info.value.status, info.value.param) == (400, "messages")


def _tiny_hf_tokenizer(directory: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}",
    }))
    return HFTokenizer(directory)


def test_hf_tokenizer_and_its_template(tmp_path: Path) -> None:
    tok = _tiny_hf_tokenizer(tmp_path)
    spec = ModelSpec("hf", tok, ModelLimits(max_model_len=512), template=ChatTemplate.for_tokenizer(tok, bos_token="<s>"))
    req = parse_chat_request(chat(model="hf", messages=[{"role": "user", "content": "hello world"}]), {"hf": spec})
    expected = tok.encode("<s>[user] hello world\n[assistant] ")
    assert req.prompt_token_ids == expected
    assert req.prompt_token_ids[0] == tok.bos_token_id  # the special token text became its id
    err = error_of(lambda b, _m: parse_completion_request(b, {"hf": spec}), completion(model="hf", prompt=[tok.vocab_size]))
    assert err.param == "prompt"


# ----------------------------------------------------------------- error builders


def test_api_error_serialisations() -> None:
    err = rate_limited("Rate limit reached for requests per minute.", 1.2)
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type == "requests"
    assert err.headers() == {"Retry-After": "2"}
    assert json.loads(err.to_json()) == {
        "error": {"message": "Rate limit reached for requests per minute.", "type": "requests", "param": None,
                  "code": "rate_limit_exceeded"}
    }
    ws = json.loads(err.to_ws("c1"))
    assert ws["type"] == "error" and ws["id"] == "c1" and ws["status"] == 429 and ws["retry_after"] == 1.2
    assert payload_too_large(1024, 4096).status == 413
    assert missing_api_key().status == 401 and invalid_api_key("msk-abc-***").code == "invalid_api_key"
    assert "msk-abc-***" in invalid_api_key("msk-abc-***").message
    assert missing_api_key().headers() == {}


@pytest.mark.parametrize(
    ("reason", "status", "type_", "code"),
    [
        ("quota_tokens", 429, "tokens", "rate_limit_exceeded"),
        ("quota_requests", 429, "requests", "rate_limit_exceeded"),
        ("slo", 429, "server_error", "slo_overloaded"),
        ("no_capacity", 503, "server_error", "no_capacity"),
    ],
)
def test_from_admission(reason: str, status: int, type_: str, code: str) -> None:
    err = from_admission(AdmissionDecision(request_id="r", admitted=False, reason=reason, retry_after=2.5))  # type: ignore[arg-type]
    assert (err.status, err.type, err.code, err.retry_after) == (status, type_, code, 2.5)
    assert err.headers() == {"Retry-After": "3"}
    assert "2.5s" in err.message


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.BAD_REQUEST, 400),
        (ErrorCode.PROMPT_TOO_LONG, 400),
        (ErrorCode.UNKNOWN_MODEL, 404),
        (ErrorCode.UNAUTHORIZED, 401),
        (ErrorCode.QUOTA_TOKENS, 429),
        (ErrorCode.NO_CAPACITY, 503),
        (ErrorCode.DRAINING, 503),
        (ErrorCode.TIMEOUT, 504),
        (ErrorCode.WORKER_LOST, 502),
        (ErrorCode.INTERNAL, 500),
        ("something_new", 500),
    ],
)
def test_from_mesh_error(code: str, status: int) -> None:
    err = from_mesh_error(code, "msg", retry_after=1.0)
    assert err.status == status and err.message == "msg"
    if code == ErrorCode.PROMPT_TOO_LONG:
        assert err.code == "context_length_exceeded"
    if status == 429:
        assert err.code == "rate_limit_exceeded"


def test_model_limits_decode_from_config_and_reject_nonsense() -> None:
    limits = msgspec.json.decode(b'{"max_model_len": 8192, "max_tokens_cap": 1024}', type=ModelLimits)
    assert limits.max_model_len == 8192 and limits.default_completion_max_tokens == 16
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"max_model_len": 1}', type=ModelLimits)


def test_parse_request_dispatches_by_kind() -> None:
    assert parse_request("chat", chat(), MODELS).kind == "chat"
    assert parse_request("completion", completion(), MODELS).kind == "completion"
    assert isinstance(parse_request("completion", completion(), MODELS), NormalizedRequest)


def test_priority_is_refused_unless_the_server_schedules_by_it() -> None:
    """vLLM's ``priority`` (lower first): the mesh schedules by the key's tier, so a
    client's priority is a clear 400, as vLLM gives it under first-come-first-served;
    0 (vLLM's default, which some clients always send) passes."""
    cases: tuple[tuple[RequestKind, bytes], ...] = (("chat", chat(priority=3)),
                                                    ("completion", completion(priority=-1)))
    for kind, body in cases:
        with pytest.raises(ApiError) as info:
            parse_request(kind, body, MODELS)
        err = info.value
        assert (err.status, err.param, err.code) == (400, "priority", "unsupported_parameter"), err.message
        assert "tier" in err.message
    assert parse_request("chat", chat(priority=0), MODELS).priority == 0
    assert parse_request("completion", completion(priority=-2), MODELS, priority_scheduling=True).priority == -2
    with pytest.raises(ApiError) as info:
        parse_request("chat", chat(priority=2**40), MODELS, priority_scheduling=True)
    assert info.value.param == "priority"


def test_prompt_logprobs_past_what_one_response_carries_is_a_400() -> None:
    """130k prompt tokens × 21 log probabilities held a sim worker's loop 7 s and made a
    chunk no bus message can carry: the client heard nothing. Now refused up front."""
    big = {"big": ModelSpec("big", BYTE, ModelLimits(max_model_len=200_000))}
    body = json.dumps({"model": "big", "prompt": "a" * 12_000, "max_tokens": 1, "prompt_logprobs": 20}).encode()
    with pytest.raises(ApiError) as info:
        parse_request("completion", body, big)
    assert info.value.status == 400 and info.value.param == "prompt_logprobs"
    assert "252,000" in info.value.message
    fits = json.dumps({"model": "big", "prompt": "a" * 9_000, "max_tokens": 1, "prompt_logprobs": 20}).encode()
    assert parse_request("completion", fits, big).sampling.prompt_logprobs == 20


def test_output_options_carry_what_the_answer_is_built_with() -> None:
    """stream_options.continuous_usage_stats (only with include_usage, as vLLM), and
    parallel_tool_calls with tool_choice auto, reach the options the gateway answers by."""
    on = parse_chat_request(chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
                            MODELS)
    assert on.output.continuous_usage and on.output.prompt_tokens == on.prompt_tokens
    alone = parse_chat_request(chat(stream=True, stream_options={"continuous_usage_stats": True}), MODELS)
    assert not alone.output.continuous_usage
    text = parse_completion_request(completion(stream=True, stream_options={"include_usage": True,
                                                                           "continuous_usage_stats": True}), MODELS)
    assert text.output.continuous_usage and text.output.prompt_tokens == text.prompt_tokens
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    hermes = {"m": ModelSpec("m", BYTE, ModelLimits(max_model_len=4096), tool_parser="hermes")}
    single = parse_chat_request(chat(model="m", tools=tools, parallel_tool_calls=False), hermes)
    assert not single.output.parallel_tool_calls and not single.output.mistral_call_ids
    mistral = {"m": ModelSpec("m", BYTE, ModelLimits(max_model_len=4096), tool_parser="mistral")}
    assert parse_chat_request(chat(model="m", tools=tools, tool_choice="required"), mistral).output.mistral_call_ids


def test_top_logprobs_zero_needs_no_logprobs() -> None:
    """vLLM takes ``top_logprobs: 0`` without ``logprobs`` (nothing more is asked); more is a 400."""
    req = parse_chat_request(chat(logprobs=False, top_logprobs=0), MODELS)
    assert req.sampling.logprobs is None


def test_repetition_penalty_is_bounded_below_only_as_in_vllm() -> None:
    req = parse_chat_request(chat(repetition_penalty=3.5), MODELS)
    assert req.sampling.repetition_penalty == 3.5


def record_threads(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The threads ``validation.<name>`` runs on, call by call, from now on."""
    import threading

    from services.gateway import validation

    threads: list[int] = []
    real = getattr(validation, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, name, recording)
    return threads


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large request's checks (a 5,000-property schema: about a second of pure Python)
    ran on the event loop, and every other client of the gateway waited for them."""
    import threading

    from services.gateway import validation

    threads = record_threads(monkeypatch, "parse_request")
    small = chat(max_tokens=5)
    padding = {"type": "string", "description": "x" * validation.OFF_LOOP_BYTES}
    schema = {"type": "object", "properties": {"a": padding}}
    large = chat(max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert (await validation.parse_request_off_loop("chat", small, MODELS)).max_tokens == 5
    assert threads[-1] == threading.get_ident()  # small: inline, no thread hop
    assert (await validation.parse_request_off_loop("chat", large, MODELS)).max_tokens == 5
    assert threads[-1] != threading.get_ident()
    with pytest.raises(ApiError) as info:  # a 4xx still comes back as one, from the thread
        await validation.parse_request_off_loop("chat", large.replace(b'"sim"', b'"nope"', 1), MODELS)
    assert info.value.status == 404
    # Small but of many objects: 1,000 properties in 33 KB held the loop 0.19 s inline.
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    dense = chat(max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": many}})
    assert len(dense) < validation.OFF_LOOP_BYTES
    assert (await validation.parse_request_off_loop("chat", dense, MODELS)).max_tokens == 5
    assert threads[-1] != threading.get_ident()
    # An ordinary agent request (a conversation and a few tools) stays inline.
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}} for i in range(8)]
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(21)]
    ordinary = chat(max_tokens=5, messages=turns, tools=tools, tool_choice="required")
    assert validation.parse_cost(ordinary) < validation.OFF_LOOP_BYTES


async def test_a_cancelled_parse_keeps_its_slot_until_its_thread_ends() -> None:
    """A client that hangs up while its large body is parsed cancels the handler, not the
    thread: the slot was given to the next large body at once, so clients sending large
    bodies and hanging up ran as many CPU-bound parses at once as the executor has threads."""
    import threading
    import time

    from services.gateway import validation

    lock, active, peak = threading.Lock(), [0], [0]

    def slow(x: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        with lock:
            active[0] -= 1
        return x

    tasks = [asyncio.create_task(validation.off_loop(validation.OFF_LOOP_BYTES, slow, i)) for i in range(4)]
    for task in tasks:
        await asyncio.sleep(0.05)
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert await validation.off_loop(validation.OFF_LOOP_BYTES, slow, 9) == 9  # after the first thread's end
    assert peak[0] == 1


@pytest.mark.parametrize(("field", "value", "kinds"), [
    ("use_beam_search", True, "both"), ("length_penalty", 0.5, "both"), ("allowed_token_ids", [1, 2], "both"),
    ("bad_words", ["x"], "both"), ("logprob_token_ids", [3], "both"),
    ("return_tokens_as_token_ids", True, "both"), ("return_token_ids", True, "both"),
    ("return_token_offsets", True, "both"), ("truncation_side", "right", "both"),
    ("thinking_token_budget", 10, "both"), ("repetition_detection", {"max_pattern_size": 3}, "both"),
    ("watermarking", True, "both"), ("vllm_xargs", {"a": 1}, "both"), ("kv_transfer_params", {}, "both"),
    ("ec_transfer_params", {}, "both"), ("return_mm_kwargs", True, "both"), ("routed_experts_prompt_start", 2, "both"),
    ("use_beam_search", 1, "both"),  # true, as vLLM reads 1
    ("chat_template", "{{ messages }}", "chat"), ("documents", [{"text": "d"}], "chat"),
    ("include_reasoning", False, "chat"), ("return_prompt_text", True, "chat"), ("mm_processor_kwargs", {"a": 1}, "chat"),
    ("media_io_kwargs", {"image": {}}, "chat"), ("add_special_tokens", True, "chat"),
    ("prompt_embeds", "AAAA", "completion"), ("add_special_tokens", False, "completion"),
])
def test_vllms_fields_that_would_change_the_answer_are_refused_by_name(field: str, value: Any, kinds: str) -> None:
    """vLLM's fields meshserve does not serve were dropped: ``use_beam_search`` answered
    n greedy copies as if they were beams (a differential run against vLLM's server)."""
    for kind, make in (("chat", chat), ("completion", completion)):
        if kinds not in ("both", kind):
            continue
        parse = parse_chat_request if kind == "chat" else parse_completion_request
        error = error_of(parse, make(**{field: value}))
        assert (error.status, error.param, error.code) == (400, field, "unsupported_parameter"), (kind, error.message)


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", False), ("length_penalty", 1.0), ("allowed_token_ids", None), ("bad_words", []),
    ("return_token_ids", False), ("truncation_side", "left"), ("vllm_xargs", {}), ("routed_experts_prompt_start", 0),
    ("watermarking", None), ("request_id", "abc"), ("stream_interval", 4),
    ("use_beam_search", 0), ("routed_experts_prompt_start", 0.0), ("length_penalty", 1),  # as vLLM reads them
])
def test_vllms_fields_at_their_defaults_are_accepted(field: str, value: Any) -> None:
    assert parse_chat_request(chat(**{field: value}), MODELS).max_tokens > 0
    assert parse_completion_request(completion(**{field: value}), MODELS).max_tokens > 0
    assert parse_chat_request(chat(add_special_tokens=False, include_reasoning=True), MODELS)
    assert parse_completion_request(completion(add_special_tokens=True), MODELS)


def test_a_batch_of_prompts_splits_into_one_body_each() -> None:
    from services.gateway.validation import MAX_BATCH_PROMPTS, batch_prompts

    for single in (completion(prompt="a"), completion(prompt=[1, 2]), completion(prompt=["a"]),
                   completion(prompt=[[1, 2]]), b"{not json", chat(), completion(prompt=[1, "a"])):
        assert batch_prompts(single) is None  # the parser takes (or refuses) it as it is
    bodies = batch_prompts(completion(prompt=["a", [5, 6]], max_tokens=3, n=2))
    assert bodies is not None and [json.loads(b)["prompt"] for b in bodies] == ["a", [5, 6]]
    assert all(json.loads(b)["max_tokens"] == 3 and json.loads(b)["n"] == 2 for b in bodies)
    error = error_of(lambda body, _models: batch_prompts(body), completion(prompt=["a"] * (MAX_BATCH_PROMPTS + 1)))
    assert (error.status, error.param) == (400, "prompt")
    error = error_of(lambda body, _models: batch_prompts(body), completion(prompt=["a", "b"], stream=True))
    assert (error.status, error.param, error.code) == (400, "stream", "unsupported_parameter")


def test_cache_salt_is_a_non_empty_string_carried_to_the_generation() -> None:
    request = parse_chat_request(chat(cache_salt="user-7"), MODELS)
    assert request.cache_salt == "user-7"
    assert request.generate_request(request_id="r", token_subject="t", org="acme").cache_salt == "user-7"
    assert parse_completion_request(completion(), MODELS).cache_salt == ""
    for bad in ("", 7, "x" * 257):
        error = error_of(parse_chat_request, chat(cache_salt=bad))
        assert (error.status, error.param) == (400, "cache_salt"), bad


async def test_a_large_batch_is_split_and_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prompt's share of a large batch weighed under the threshold, so all of them were
    parsed inline back to back: 256 prompts of 15 KB held the loop 168 ms (review). Each
    prompt's parse repeats the body's other fields, so every batch goes to the thread."""
    import threading

    from services.gateway import validation

    threads = record_threads(monkeypatch, "parse_batch")
    small = completion(prompt=["a", "b"], max_tokens=2)
    large = completion(prompt=[[65] * 100] * 250, max_tokens=2)  # 84 KB
    assert validation.looks_batched(small) and validation.looks_batched(large)
    assert not validation.looks_batched(completion(prompt=[1, 2])) and not validation.looks_batched(b"[")
    assert [r.prompt_tokens for r in await validation.parse_batch_off_loop(small, MODELS) or []] == [1, 1]
    assert threads[-1] != threading.get_ident()
    parsed = await validation.parse_batch_off_loop(large, MODELS)
    assert parsed is not None and len(parsed) == 250 and threads[-1] != threading.get_ident()
    assert await validation.parse_batch_off_loop(completion(prompt=["one"]), MODELS) is None
