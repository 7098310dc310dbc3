"""``/tokenize`` and ``/detokenize`` (``services.gateway.tokenize_api``), the pure part.

The tiny model's expected ids, token strings and text were recorded with transformers 5
(``AutoTokenizer`` on the same files, in ``.venv-vllm``), doing what vLLM's
``ServingTokenization`` does: ``encode(prompt)`` (special tokens added) for the completion
form, ``apply_chat_template`` then ``encode(..., add_special_tokens=False)`` for the chat
form, ``convert_ids_to_tokens`` for ``token_strs`` and ``decode`` for ``/detokenize``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ops.tiny_model import build_tokenizer_json, tokenizer_config
from ops.tokenizer_cli import export_tokenizer
from services.common.tokenizer import ByteTokenizer, HFTokenizer
from services.gateway.chat_request import parse_chat_request
from services.gateway.chat_template import ChatTemplate
from services.gateway.errors import ApiError
from services.gateway.models import ModelLimits, ModelSpec
from services.gateway.tokenize_api import detokenize, tokenize

PROMPT = "The cache of the model is warm."
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is the cache warm?"}]
# recorded (see the module docstring)
PROMPT_IDS = [56, 76, 73, 490, 315, 73, 314, 74, 372, 269, 337, 391, 225, 338, 268, 292, 81, 18]
PROMPT_STRS = ["T", "h", "e", "Ġca", "ch", "e", "Ġo", "f", "Ġthe", "Ġm", "od", "el", "Ġ", "is", "Ġw", "ar", "m", "."]
CHAT_IDS = [0, 2, 87, 93, 294, 430, 3, 203, 203, 38, 73, 275, 86, 77, 73, 74, 18, 4, 2, 396, 261, 3, 203, 203, 45, 87,
            372, 490, 315, 73, 268, 292, 81, 35, 4, 2, 349, 87, 77, 294, 448, 3, 203, 203]
CHAT_STRS = ["<|begin_of_text|>", "<|start_header_id|>", "s", "y", "st", "em", "<|end_header_id|>", "Ċ", "Ċ", "B", "e",
             "Ġb", "r", "i", "e", "f", ".", "<|eot_id|>", "<|start_header_id|>", "us", "er", "<|end_header_id|>", "Ċ",
             "Ċ", "I", "s", "Ġthe", "Ġca", "ch", "e", "Ġw", "ar", "m", "?", "<|eot_id|>", "<|start_header_id|>", "as",
             "s", "i", "st", "ant", "<|end_header_id|>", "Ċ", "Ċ"]
CHAT_IDS_WITHOUT_GENERATION_PROMPT = CHAT_IDS[:35]
CHAT_TEXT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
             "<|end_header_id|>\n\nIs the cache warm?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))
    tok = HFTokenizer(directory)
    return ModelSpec("tiny", tok, ModelLimits(max_model_len=4096), template=ChatTemplate.for_tokenizer(tok))


SIM = ModelSpec("sim", ByteTokenizer(), ModelLimits(max_model_len=2048))


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def error(fn: Any, payload: bytes | str, models: dict[str, ModelSpec], **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(payload, models, **kw)
    return info.value


def test_completion_form_is_vllms(tiny: ModelSpec) -> None:
    answer = tokenize(body(model="tiny", prompt=PROMPT, return_token_strs=True), {"tiny": tiny})
    assert (answer.tokens, answer.token_strs, answer.count, answer.max_model_len) == \
        (PROMPT_IDS, PROMPT_STRS, len(PROMPT_IDS), 4096)
    assert tokenize(body(model="tiny", prompt=PROMPT), {"tiny": tiny}).token_strs is None


def test_chat_form_is_vllms(tiny: ModelSpec) -> None:
    answer = tokenize(body(model="tiny", messages=CONVERSATION, return_token_strs=True), {"tiny": tiny})
    assert (answer.tokens, answer.token_strs, answer.count) == (CHAT_IDS, CHAT_STRS, len(CHAT_IDS))
    plain = tokenize(body(model="tiny", messages=CONVERSATION, add_generation_prompt=False), {"tiny": tiny})
    assert plain.tokens == CHAT_IDS_WITHOUT_GENERATION_PROMPT


def test_detokenize_keeps_special_tokens_as_vllm_does(tiny: ModelSpec) -> None:
    assert detokenize(body(model="tiny", tokens=CHAT_IDS), {"tiny": tiny}).prompt == CHAT_TEXT
    assert detokenize(body(model="tiny", tokens=[]), {"tiny": tiny}).prompt == ""


def test_chat_form_counts_what_the_chat_path_sends() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}}]
    history = [*CONVERSATION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"}, {"role": "developer", "content": "Go on."}]
    chat = parse_chat_request(body(model="sim", messages=history, tools=tools, tool_choice="none"), {"sim": SIM})
    counted = tokenize(body(model="sim", messages=history, tools=tools), {"sim": SIM})
    assert counted.tokens == chat.prompt_token_ids and counted.count == len(chat.prompt_token_ids)
    assert "<tool_call>" in SIM.tokenizer.decode(counted.tokens)  # type: ignore[attr-defined]


def test_byte_token_strings_are_the_exported_tokenizers(tmp_path: Path) -> None:
    exported = Tokenizer.from_file(str(export_tokenizer(tmp_path / "tok", "byte") / "tokenizer.json"))
    answer = tokenize(body(prompt="héllo wörld 🙂", return_token_strs=True), {"sim": SIM})
    assert answer.token_strs == [exported.id_to_token(t) for t in answer.tokens]
    ids = [ByteTokenizer.BOS, *answer.tokens, ByteTokenizer.EOS]
    assert detokenize(body(tokens=ids), {"sim": SIM}).prompt == exported.decode(ids, skip_special_tokens=False) == \
        "<|bos|>héllo wörld 🙂<|eos|>"


def test_continue_final_message(tiny: ModelSpec) -> None:
    messages = [*CONVERSATION, {"role": "assistant", "content": "Yes, it"}]
    answer = tokenize(body(model="tiny", messages=messages, continue_final_message=True, add_generation_prompt=False),
                      {"tiny": tiny})
    assert tiny.tokenizer.decode(answer.tokens).endswith("assistant\n\nYes, it")  # type: ignore[attr-defined]
    err = error(tokenize, body(model="tiny", messages=messages, continue_final_message=True), {"tiny": tiny})
    assert err.param == "continue_final_message"


def test_model_may_be_left_out_when_only_one_is_usable(tiny: ModelSpec) -> None:
    assert tokenize(body(prompt="ab"), {"sim": SIM, "sim-alias": SIM}).tokens == [100, 101]
    both = {"sim": SIM, "tiny": tiny}
    err = error(tokenize, body(prompt="ab"), both)
    assert (err.status, err.param, err.code) == (400, "model", "missing_required_parameter")
    assert "sim, tiny" in err.message
    assert tokenize(body(prompt="ab"), both, allowed_models=["sim"]).tokens == [100, 101]
    assert detokenize(body(tokens=[100]), both, allowed_models=["sim"]).prompt == "a"


@pytest.mark.parametrize(("payload", "status", "param"), [
    (body(model="nope", prompt="x"), 404, "model"),
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (body(model="sim"), 400, "prompt"),
    (body(model="sim", prompt=5), 400, "prompt"),
    (body(model="sim", prompt=["a"]), 400, "prompt"),
    (body(model="sim", prompt="x", add_special_tokens="yes"), 400, "add_special_tokens"),
    (body(model="sim", prompt="x", messages=[]), 400, "prompt"),
    (body(model="sim", messages="hi"), 400, "messages"),
    (body(model="sim", messages=[]), 400, "messages"),
    (body(model="sim", messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    (body(model="sim", messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].tool_call_id"),
    (body(model="sim", messages=CONVERSATION, tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools[0].function.name"),
    (body(model="sim", messages=CONVERSATION, chat_template="{{ 'x' }}"), 400, "chat_template"),
    (body(model="sim", messages=CONVERSATION, chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs.messages"),
])
def test_tokenize_errors(payload: bytes, status: int, param: str | None) -> None:
    err = error(tokenize, payload, {"sim": SIM})
    assert (err.status, err.param) == (status, param), err.message


@pytest.mark.parametrize(("payload", "status", "param"), [
    (body(model="sim", tokens=[3, 259]), 400, "tokens"),
    (body(model="sim", tokens=[-1]), 400, "tokens"),
    (body(model="sim", tokens="abc"), 400, "tokens"),
    (body(model="sim"), 400, "tokens"),
    (body(model="nope", tokens=[3]), 404, "model"),
])
def test_detokenize_errors(payload: bytes, status: int, param: str | None) -> None:
    err = error(detokenize, payload, {"sim": SIM})
    assert (err.status, err.param) == (status, param), err.message


def test_chat_template_kwargs_count_as_the_chat_path_renders_them() -> None:
    """vLLM's /tokenize takes chat_template_kwargs: a client counts `enable_thinking: false`."""
    template = ChatTemplate("{% if enable_thinking is false %}no-think {% endif %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    models = {"t": ModelSpec("t", ByteTokenizer(), ModelLimits(max_model_len=2048), template=template)}
    kwargs = {"enable_thinking": False}
    off = tokenize(body(model="t", messages=CONVERSATION, chat_template_kwargs=kwargs), models)
    on = tokenize(body(model="t", messages=CONVERSATION), models)
    assert off.count == on.count + len("no-think ")
    chat = parse_chat_request(body(model="t", messages=CONVERSATION, chat_template_kwargs=kwargs), models)
    assert chat.prompt_token_ids == off.tokens


def test_a_tokenizer_failure_is_a_500_not_a_traceback() -> None:
    class Broken(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            raise RuntimeError("boom")

    err = error(tokenize, body(prompt="x"), {"b": ModelSpec("b", Broken())})
    assert (err.status, err.code) == (500, "tokenizer_error")


_leaves = st.none() | st.booleans() | st.integers(-5, 2**64) | st.floats(allow_nan=False) | st.text(max_size=12)
_json = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=12)
_fields = st.sampled_from(["model", "prompt", "messages", "tokens", "add_special_tokens", "return_token_strs",
                           "add_generation_prompt", "continue_final_message", "tools", "chat_template"])
_bodies = st.dictionaries(_fields, _json | st.just("sim") | st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "x"])}, optional={"content": _json, "tool_calls": _json,
                                                                           "tool_call_id": _json}), max_size=3),
    max_size=5).map(lambda d: json.dumps(d).encode()) | st.binary(max_size=40)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_bodies)
def test_any_body_gives_an_answer_or_a_4xx(payload: bytes) -> None:
    for fn in (tokenize, detokenize):
        try:
            answer = fn(payload, {"sim": SIM})
        except ApiError as exc:
            assert 400 <= exc.status < 500, exc
        else:
            assert answer is not None
