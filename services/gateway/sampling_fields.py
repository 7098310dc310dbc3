"""The sampling fields chat and completions share, checked: request → ``SamplingParams``
keyword arguments (everything but ``max_tokens``), and the small checks every field uses.

Pure, like the rest of validation (``validation`` calls ``check_common`` for both kinds
of request); every refusal is an ``ApiError`` 400 that names its parameter.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from proto.messages import StructuredOutput
from services.common.structured import (
    StructuredOutputError,
    from_guided_fields,
    from_response_format,
    from_structured_outputs,
)

from .errors import bad_request, clip
from .models import ModelLimits
from .openai_api import SamplingFields

MAX_KEY_CHARS = 256  # user / session_id: session keys, not documents
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def invalid(param: str, message: str, code: str = "invalid_value") -> NoReturn:
    raise bad_request(f"Invalid '{param}': {message}", param, code)


def unsupported(param: str, message: str) -> NoReturn:
    raise bad_request(message, param, "unsupported_parameter")


def float_in(param: str, value: float, low: float, high: float, *, low_open: bool = False) -> float:
    if not math.isfinite(value) or value > high or (value <= low if low_open else value < low):
        bracket = "(" if low_open else "["
        invalid(param, f"{value} is not in the range {bracket}{low}, {high}].")
    return value


MAX_METADATA_KEYS = 16  # OpenAI's limits on ``metadata``
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: Any) -> str:
    """vLLM's ``cache_salt``: a non-empty string (as vLLM requires), or absent."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        invalid("cache_salt", "must be a non-empty string.")
    if len(value) > MAX_CACHE_SALT_CHARS:
        invalid("cache_salt", f"must be at most {MAX_CACHE_SALT_CHARS} characters.")
    return value


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, str]:
    if not metadata:
        return {}
    if len(metadata) > MAX_METADATA_KEYS:
        invalid("metadata", f"at most {MAX_METADATA_KEYS} keys are allowed.")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            invalid("metadata", f"keys are limited to {MAX_METADATA_KEY_CHARS} characters.")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            invalid(f"metadata.{clip(key)}", f"values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters.")
    return dict(metadata)


def _check_logit_bias(bias: dict[str, Any], limits: ModelLimits, vocab_size: int) -> dict[int, float]:
    if len(bias) > limits.max_logit_bias:
        invalid("logit_bias", f"at most {limits.max_logit_bias} entries are allowed.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            invalid("logit_bias", f"keys must be token ids, got {clip(key)!r}.")
        if not 0 <= token < vocab_size:
            invalid("logit_bias", f"token id {token} is outside this model's vocabulary (0..{vocab_size - 1}).")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            invalid("logit_bias", f"the bias of token {token} must be a number from -100 to 100.")
        out[token] = float(value)
    return out


def check_count(param: str, value: int, high: int, low: int = 0) -> int:
    if not low <= value <= high:
        invalid(param, f"{value} is not in the range [{low}, {high}].")
    return value


def _check_structured(req: SamplingFields) -> StructuredOutput | None:
    """response_format, vLLM's structured_outputs and guided_* fields: at most one."""
    try:
        found: list[tuple[str, StructuredOutput]] = []
        if req.response_format is not None:
            rf = from_response_format(req.response_format)
            if rf is not None:
                found.append(("response_format", rf))
        if req.structured_outputs is not None:
            found.append(("structured_outputs", from_structured_outputs(req.structured_outputs)))
        guided = from_guided_fields({"guided_json": req.guided_json, "guided_regex": req.guided_regex,
                                     "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar})
        if guided is not None:
            found.append(("guided_*", guided))
    except StructuredOutputError as exc:
        raise bad_request(str(exc), exc.param, "invalid_value") from None
    if len(found) > 1:
        invalid(found[1][0], f"only one structured output may be set; {found[0][0]} is set too.")
    return found[0][1] if found else None


def _disabled_top_k(top_k: int, vocab_size: int) -> int:
    # 0 means disabled (vLLM); k >= vocab keeps every token, i.e. disabled too, and
    # clamping keeps absurd values (10**30) off the msgpack wire.
    return -1 if top_k in (0, -1) or top_k >= vocab_size else top_k


def _model_defaults(out: dict[str, Any], limits: ModelLimits, vocab_size: int) -> None:
    """The defaults of fields a request omits (the operator's, else the model's generation
    config: ``ModelLimits``); the request's own values replace them after."""
    if limits.default_temperature is not None:
        out["temperature"] = limits.default_temperature
    if limits.default_top_p is not None:
        out["top_p"] = limits.default_top_p
    if limits.default_top_k is not None and limits.default_top_k >= -1:
        out["top_k"] = _disabled_top_k(limits.default_top_k, vocab_size)
    if limits.default_min_p is not None:
        out["min_p"] = limits.default_min_p
    if limits.default_repetition_penalty is not None:
        out["repetition_penalty"] = limits.default_repetition_penalty


# vLLM's request fields meshserve does not serve → (the values that ask for nothing, what to
# say). Any other value is refused by name: each changes the answer vLLM would give.
_NOTHING: tuple[Any, ...] = (None,)
VLLM_UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), "Beam search is not supported: use n for several sampled choices."),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not supported."),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: use logit_bias, structured_outputs or"
                                   " response_format to constrain the output."),
    "bad_words": ((None, []), "bad_words is not supported: use logit_bias or stop."),
    "logprob_token_ids": (_NOTHING, "logprob_token_ids is not supported: use logprobs with top_logprobs."),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported."),
    "return_token_ids": ((None, False), "return_token_ids is not supported over HTTP: the WebSocket API's events"
                                        " carry each chunk's token_ids."),
    "return_token_offsets": ((None, False), "return_token_offsets is not supported."),
    "truncation_side": ((None, "left"), "Only truncation_side 'left' (the prompt's start is cut) is supported."),
    "thinking_token_budget": (_NOTHING, "thinking_token_budget is not supported: use max_tokens."),
    "repetition_detection": (_NOTHING, "repetition_detection is not supported: use repetition_penalty."),
    "watermarking": ((None, False), "Watermarking is not supported."),
    "vllm_xargs": ((None, {}), "vllm_xargs (arguments for a vLLM server's custom logits processors) is not"
                               " supported."),
    "kv_transfer_params": (_NOTHING, "kv_transfer_params is not supported: the mesh places prefill and decode"
                                     " itself."),
    "ec_transfer_params": (_NOTHING, "ec_transfer_params is not supported."),
    "return_mm_kwargs": ((None, False), "Multimodal inputs are not supported."),
    "routed_experts_prompt_start": ((None, 0), "routed_experts_prompt_start is not supported."),
    # chat only
    "chat_template": (_NOTHING, "A request's own chat_template is not accepted (vLLM refuses it too unless"
                                " started with --trust-request-chat-template): the model's template renders."),
    "documents": ((None, []), "documents is not supported: put the documents in the messages."),
    "include_reasoning": ((None, True), "include_reasoning false is not supported: the reasoning comes back in"
                                        " its own field, which a client may ignore."),
    "return_prompt_text": ((None, False), "return_prompt_text is not supported."),
    "mm_processor_kwargs": ((None, {}), "Multimodal inputs are not supported."),
    "media_io_kwargs": ((None, {}), "Multimodal inputs are not supported."),
    # completions only
    "prompt_embeds": ((None, []), "prompt_embeds is not supported: send the prompt as text or token ids."),
}


def check_vllm_unserved(req: SamplingFields, *, add_special_tokens: bool) -> None:
    """Refuse any of vLLM's fields meshserve does not serve (``VLLM_UNSERVED``) set to ask
    for something; ``add_special_tokens``: vLLM's default for this kind (chat False: the
    template adds them; completions True)."""
    for name, (nothing, message) in VLLM_UNSERVED.items():
        value = getattr(req, name, None)
        if value is None:  # the usual case, on every request: nothing more to look at
            continue
        # ``==`` as vLLM's pydantic reads them: 0 is False, 1.0 is 1 (a string is not).
        if not any(isinstance(value, str) == isinstance(v, str) and value == v for v in nothing if v is not None):
            unsupported(name, message)
    if req.add_special_tokens not in (None, add_special_tokens):
        unsupported("add_special_tokens", f"Only add_special_tokens {str(add_special_tokens).lower()} (vLLM's"
                                          " default for this endpoint) is supported.")


def check_common(req: SamplingFields, limits: ModelLimits, vocab_size: int) -> dict[str, Any]:
    """Sampling fields shared by chat and completions → SamplingParams kwargs (no max_tokens)."""
    out: dict[str, Any] = {}
    if req.n is not None:
        out["n"] = check_count("n", req.n, limits.max_n, low=1)
    if req.logit_bias:
        out["logit_bias"] = _check_logit_bias(req.logit_bias, limits, vocab_size)
    _model_defaults(out, limits, vocab_size)
    if req.min_p is not None:
        out["min_p"] = float_in("min_p", req.min_p, 0.0, 1.0)
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.prompt_logprobs is not None:
        if req.stream:
            invalid("prompt_logprobs", "prompt logprobs are not available when 'stream' is true.")
        out["prompt_logprobs"] = check_count("prompt_logprobs", req.prompt_logprobs, limits.max_logprobs)
    structured = _check_structured(req)
    if structured is not None:
        out["structured"] = structured
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options", "invalid_value"
        )
    if req.temperature is not None:
        out["temperature"] = float_in("temperature", req.temperature, 0.0, limits.max_temperature)
    if req.top_p is not None:
        out["top_p"] = float_in("top_p", req.top_p, 0.0, 1.0, low_open=True)
    if req.presence_penalty is not None:
        out["presence_penalty"] = float_in("presence_penalty", req.presence_penalty, -2.0, 2.0)
    if req.frequency_penalty is not None:
        out["frequency_penalty"] = float_in("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.repetition_penalty is not None:
        # vLLM bounds it below only (> 0); above 2 it is rare, not wrong.
        out["repetition_penalty"] = float_in("repetition_penalty", req.repetition_penalty, 0.0, math.inf, low_open=True)
    if req.top_k is not None:
        top_k = req.top_k
        if top_k < -1:
            invalid("top_k", f"{top_k} is not allowed: use -1 (or 0) to disable top-k, or a positive number.")
        if limits.max_top_k is not None and top_k > limits.max_top_k:
            invalid("top_k", f"{top_k} exceeds this model's limit of {limits.max_top_k}.")
        out["top_k"] = _disabled_top_k(top_k, vocab_size)
    if req.seed is not None:
        if not _INT64_MIN <= req.seed <= _INT64_MAX:
            invalid("seed", "must fit in a signed 64-bit integer.")
        out["seed"] = req.seed
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if len(stops) > limits.max_stop_sequences:
            invalid("stop", f"at most {limits.max_stop_sequences} stop sequences are allowed, got {len(stops)}.")
        for s in stops:
            if not s:
                invalid("stop", "stop sequences must not be empty.")
            if len(s) > limits.max_stop_chars:
                invalid("stop", f"stop sequences are limited to {limits.max_stop_chars} characters.")
        out["stop"] = list(stops)
    if req.stop_token_ids is not None:
        if len(req.stop_token_ids) > limits.max_stop_token_ids:
            invalid("stop_token_ids", f"at most {limits.max_stop_token_ids} stop token ids are allowed.")
        for t in req.stop_token_ids:
            if not 0 <= t < vocab_size:
                invalid("stop_token_ids", f"token id {t} is outside this model's vocabulary (0..{vocab_size - 1}).")
        out["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        out["ignore_eos"] = True
    if req.service_tier not in (None, "auto", "default"):
        unsupported("service_tier", f"service_tier {clip(req.service_tier)!r} is not offered: the API key's tier"
                                     " decides how a request is scheduled.")
    for name, value in (("user", req.user), ("session_id", req.session_id), ("prompt_cache_key", req.prompt_cache_key),
                        ("safety_identifier", req.safety_identifier)):
        if value is not None and len(value) > MAX_KEY_CHARS:
            invalid(name, f"must be at most {MAX_KEY_CHARS} characters.")
    return out
