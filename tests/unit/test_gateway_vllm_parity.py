"""The gateway's side of the vLLM 0.32 audit, pure: completions ``echo`` text (the prompt
as written; token ids decoded with their special tokens), ``max_tokens: 0`` with
``echo``, the model's generation-config defaults for omitted fields, ``stop_reason`` in
the answers, and the worker's reading of ``generation_config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ops.tiny_model import BOS, build_tokenizer_json, tokenizer_config
from proto import OutputOptions, TokenChunk, TokenLogprob, Usage
from proto.messages import FinishReason
from proto.workers import SamplingDefaults
from services.common.tokenizer import ByteTokenizer, HFTokenizer
from services.gateway.chat_request import parse_chat_request
from services.gateway.errors import ApiError
from services.gateway.models import ModelLimits, ModelSpec, with_model_defaults
from services.gateway.output import ChoiceAssembler
from services.gateway.validation import parse_completion_request
from services.worker.engines.generation_config import read_sampling_defaults
from services.worker.engines.hosted import HostedEngine, ModelHost
from services.worker.engines.vllm import VllmEngine
from services.worker.engines.vllm_args import is_validation_error

BYTE = ModelSpec("sim", ByteTokenizer(), ModelLimits(max_model_len=256))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))
    return ModelSpec("tiny", HFTokenizer(directory), ModelLimits(max_model_len=4096))


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


# ----------------------------------------------------------------------------- echo


def test_a_text_prompt_with_special_tokens_echoes_as_written(tiny: ModelSpec) -> None:
    text = BOS + "abc"
    req = parse_completion_request(body(model="tiny", prompt=text, echo=True, logprobs=1), {"tiny": tiny})
    assert req.prompt_token_ids[0] == 0  # the special token is one token
    assert req.output.echo == text  # not "abc": the special token was dropped before
    assert req.output.echo_first_token == BOS  # the logprobs' first token (text_offset 0 .. len(BOS))


def test_token_id_prompts_echo_with_their_special_tokens(tiny: ModelSpec) -> None:
    ids = tiny.tokenizer.encode(BOS + "abc")
    req = parse_completion_request(body(model="tiny", prompt=ids, echo=True), {"tiny": tiny})
    assert req.output.echo == BOS + "abc"
    # The byte tokenizer's specials have text too (as its exported tokenizer.json decodes them).
    byte_ids = [1, *ByteTokenizer().encode("abc")]
    req = parse_completion_request(body(model="sim", prompt=byte_ids, echo=True, logprobs=0), {"sim": BYTE})
    assert req.output.echo == ByteTokenizer().decode(byte_ids, skip_special_tokens=False) != "abc"
    assert req.output.echo.endswith("abc") and req.output.echo_first_token == req.output.echo[:-3]
    text_req = parse_completion_request(body(model="sim", prompt="a\u00e9", echo=True), {"sim": BYTE})
    assert text_req.output.echo == "a\u00e9"


def test_echoed_text_and_logprob_offsets_agree(tiny: ModelSpec) -> None:
    text = BOS + "abc"
    req = parse_completion_request(body(model="tiny", prompt=text, echo=True, logprobs=0), {"tiny": tiny})
    ids = req.prompt_token_ids
    pieces = [tiny.tokenizer.decode([t]) for t in ids[1:]]
    asm = ChoiceAssembler("completion", "r", "tiny", 0, req.output)
    prompt_lps: list[TokenLogprob | None] = [None, *(TokenLogprob(t, p, -1.0) for t, p in zip(ids[1:], pieces,
                                                                                             strict=True))]
    asm.deltas(TokenChunk(request_id="r", seq=0, prompt_logprobs=prompt_lps))
    asm.deltas(TokenChunk(request_id="r", seq=1, finish_reason="length"))
    choice = json.loads(asm.response(Usage(prompt_tokens=len(ids), completion_tokens=1)))["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text == "".join(lp["tokens"])
    assert [text[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)] == lp["tokens"]


# --------------------------------------------------------------- max_tokens 0 with echo


def test_max_tokens_0_is_allowed_only_with_echo() -> None:
    req = parse_completion_request(body(model="sim", prompt="hello world", max_tokens=0, echo=True, logprobs=0),
                                   {"sim": BYTE})
    assert req.sampling.max_tokens == 0 and req.sampling.prompt_logprobs == 0
    assert req.output.echo == "hello world"
    for fields in ({"echo": False}, {}):
        with pytest.raises(ApiError) as info:
            parse_completion_request(body(model="sim", prompt="x", max_tokens=0, **fields), {"sim": BYTE})
        assert info.value.status == 400 and info.value.param == "max_tokens"
    with pytest.raises(ApiError):
        parse_chat_request(body(model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=0),
                           {"sim": BYTE})


# ----------------------------------------------------------- generation-config defaults


def test_model_defaults_fill_only_omitted_fields() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.1, max_tokens=7)
    spec = ModelSpec("sim", ByteTokenizer(), with_model_defaults(ModelLimits(max_model_len=256), defaults))
    chat = parse_chat_request(body(model="sim", messages=[{"role": "user", "content": "x"}], top_p=0.5),
                              {"sim": spec}).sampling
    assert (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty, chat.max_tokens) == (
        0.6, 0.5, 20, 0.1, 1.1, 7)
    # Completions keep their own default of 16 tokens, as vLLM's (its request model sets it).
    completion = parse_completion_request(body(model="sim", prompt="x", temperature=0.0, top_k=0), {"sim": spec})
    assert (completion.sampling.temperature, completion.sampling.top_k, completion.sampling.max_tokens) == (0.0, -1, 16)
    # An operator's default wins over the model's; a model's top_k past the vocabulary is "off".
    limits = with_model_defaults(ModelLimits(max_model_len=256, default_temperature=0.3),
                                 SamplingDefaults(temperature=0.6, top_k=10_000))
    assert (limits.default_temperature, limits.default_top_k) == (0.3, 10_000)
    plain = parse_completion_request(body(model="sim", prompt="x"), {"sim": ModelSpec("sim", ByteTokenizer(), limits)})
    assert (plain.sampling.temperature, plain.sampling.top_k) == (0.3, -1)
    # No defaults: vLLM's neutral ones.
    neutral = parse_completion_request(body(model="sim", prompt="x"), {"sim": BYTE}).sampling
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p, neutral.repetition_penalty) == (
        1.0, 1.0, -1, 0.0, 1.0)


def test_an_override_lowers_every_max_tokens_silently() -> None:
    """vLLM's get_max_tokens: min(the request's max_tokens or the default, the override);
    the context check stays on what the client asked for."""
    limits = with_model_defaults(ModelLimits(max_model_len=256),
                                 SamplingDefaults(max_tokens=5, max_tokens_override=5))
    spec = {"sim": ModelSpec("sim", ByteTokenizer(), limits)}
    chat = [{"role": "user", "content": "x"}]
    assert parse_chat_request(body(model="sim", messages=chat, max_tokens=20), spec).max_tokens == 5
    assert parse_chat_request(body(model="sim", messages=chat, max_tokens=3), spec).max_tokens == 3
    assert parse_chat_request(body(model="sim", messages=chat), spec).max_tokens == 5
    assert parse_completion_request(body(model="sim", prompt="x"), spec).max_tokens == 5  # its 16, lowered
    assert parse_completion_request(body(model="sim", prompt="x", max_tokens=0, echo=True), spec).max_tokens == 0
    with pytest.raises(ApiError, match="maximum context length"):
        parse_completion_request(body(model="sim", prompt="x", max_tokens=256), spec)
    # Without an override (auto), the model's max_new_tokens is only a default.
    auto = {"sim": ModelSpec("sim", ByteTokenizer(), with_model_defaults(ModelLimits(max_model_len=256),
                                                                         SamplingDefaults(max_tokens=5)))}
    assert parse_chat_request(body(model="sim", messages=chat, max_tokens=20), auto).max_tokens == 20


def test_generation_config_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert read_sampling_defaults("auto", str(model)) is None  # no file
    (model / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "max_new_tokens": 3, "do_sample": True,
        "eos_token_id": [1, 2]}))
    assert read_sampling_defaults("auto", str(model)) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20,
                                                                          max_tokens=3)
    assert read_sampling_defaults("vllm", str(model)) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.2, "temperature": 1}))
    found = read_sampling_defaults(str(other), str(model))
    assert found == SamplingDefaults(repetition_penalty=1.2, temperature=1.0)
    assert found is not None and isinstance(found.temperature, float)
    # A directory's max_new_tokens also caps explicit max_tokens (vLLM's override_max_tokens).
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    assert read_sampling_defaults(str(other), str(model)) == SamplingDefaults(max_tokens=5, max_tokens_override=5)
    (other / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation config"):
        read_sampling_defaults(str(other), str(model))


def test_a_hot_swap_model_not_loaded_yet_advertises_its_defaults(tmp_path: Path) -> None:
    """A vLLM model of a hot-swap host registers before its first load: its entry carries
    the defaults that load will read (vLLM itself is not needed to build the engine)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "max_new_tokens": 4}))
    cold = HostedEngine(ModelHost("host", 10.0), lambda: VllmEngine(model=str(model)), footprint_gib=1.0, load_s=1.0)
    assert cold.residency == "cold"
    assert cold.sampling_defaults == SamplingDefaults(temperature=0.6, max_tokens=4)
    assert VllmEngine(model=str(model), generation_config="vllm").sampling_defaults is None
    assert VllmEngine(model=str(model), generation_config=str(model)).sampling_defaults == SamplingDefaults(
        temperature=0.6, max_tokens=4, max_tokens_override=4)


def test_vllm_validation_errors_are_the_clients() -> None:
    class VLLMError(Exception):
        pass

    class VLLMClientError(VLLMError):
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    assert is_validation_error(VLLMValidationError("Failed to transform json schema into a grammar"))
    assert is_validation_error(ValueError("bad regex"))
    assert not is_validation_error(RuntimeError("engine dead"))
    assert not is_validation_error(VLLMError("server side"))


# ---------------------------------------------------------------------------- stop_reason


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stop_reason_reaches_every_choice_and_the_finishing_chunk(kind: Any) -> None:
    asm = ChoiceAssembler(kind, "r", "m", 0, OutputOptions(n=2))
    chunks = [
        TokenChunk(request_id="r", seq=0, index=0, token_ids=[40], text="a"),
        TokenChunk(request_id="r", seq=1, index=0, token_ids=[35], choice_finish_reason="stop", stop_reason=35),
        TokenChunk(request_id="r", seq=2, index=1, token_ids=[40], text="ab", choice_finish_reason="stop",
                   stop_reason="b"),
        TokenChunk(request_id="r", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3)),
    ]
    streamed = [json.loads(c) for chunk in chunks for d in asm.deltas(chunk) for c in asm.chunk_json(d)]
    ends = {c["index"]: c["stop_reason"] for e in streamed for c in e["choices"] if c["finish_reason"]}
    assert ends == {0: 35, 1: "b"}
    others = [c for e in streamed for c in e["choices"] if not c["finish_reason"]]
    if kind == "chat":
        assert all("stop_reason" not in c for c in others)
    else:
        assert all(c["stop_reason"] is None for c in others)
    whole = json.loads(asm.response(Usage(prompt_tokens=1, completion_tokens=3)))
    assert [c["stop_reason"] for c in whole["choices"]] == [35, "b"]


def test_stop_reason_is_null_for_length_and_eos() -> None:
    cases: tuple[tuple[FinishReason, None], ...] = (("length", None), ("stop", None))
    for finish, reason in cases:
        asm = ChoiceAssembler("chat", "r", "m", 0, OutputOptions())
        asm.deltas(TokenChunk(request_id="r", seq=0, token_ids=[40], text="a", finish_reason=finish,
                              stop_reason=reason))
        choice = json.loads(asm.response(Usage()))["choices"][0]
        assert "stop_reason" in choice and choice["stop_reason"] is None
