"""Request validation and normalisation: raw OpenAI body bytes → ``NormalizedRequest``.

The gateway's HTTP, WebSocket and NATS front doors all funnel through
``parse_chat_request`` / ``parse_completion_request``. They decode strictly, check
every field against the model's ``ModelLimits``, render chat messages with the model's
chat template and tokenize exactly once, so admission, router and worker all see the
same token ids and counts.

Contract (fuzzed in tests): for any input bytes the parsers return a
``NormalizedRequest`` or raise ``ApiError`` with a 4xx status — never another
exception. The one exception to "4xx" is a server fault the client cannot cause or fix:
a broken operator chat template or a failing tokenizer gives ``ApiError`` 500.
``ApiError`` and its builders live in ``errors``: this module is "request in".
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any, NoReturn

import msgspec
from msgspec import Struct

from proto.hashing import pack_tokens
from proto.messages import GenerateRequest, SamplingParams

from .chat_template import ChatTemplateError
from .errors import ApiError, bad_request, clip, invalid_json, model_not_found
from .models import ModelLimits, ModelSpec
from .openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestKind,
    SamplingFields,
    WsChatRequest,
    WsClientMessage,
    WsCompletionRequest,
    chat_request_decoder,
    completion_request_decoder,
    ws_client_decoder,
)

Body = bytes | bytearray | memoryview | str | msgspec.Raw

MAX_KEY_CHARS = 256  # user / session_id: session keys, not documents
MAX_WS_ID_CHARS = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_ROLES = {"system", "developer", "user", "assistant"}

# ------------------------------------------------------------------- normalised request


class NormalizedRequest(Struct, kw_only=True):
    """A validated request: what the gateway sends on (admission, router, worker).

    ``model`` is the canonical name, ``requested_model`` the name the client used (echo
    it in responses). ``sampling.max_tokens`` is resolved: explicit or defaulted, and
    ``prompt_tokens + max_tokens <= max_model_len`` holds.
    """

    kind: RequestKind
    model: str
    requested_model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    session_key: str | None = None
    user: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def reserved_tokens(self) -> int:
        """The pessimistic cost admission reserves: prompt plus every allowed output token."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    def generate_request(
        self,
        *,
        request_id: str,
        token_subject: str,
        gateway_id: str = "",
        org: str = "",
        key_id: str = "",
        tier: str = "standard",
        priority: int = 0,
        arrival_time: float = 0.0,
        deadline: float | None = None,
        reserved_tokens: int = 0,
    ) -> GenerateRequest:
        """The ``GenerateRequest`` for this request (prompt packed 4 bytes a token)."""
        return GenerateRequest(
            request_id=request_id,
            model=self.model,
            prompt=pack_tokens(self.prompt_token_ids),
            sampling=self.sampling,
            token_subject=token_subject,
            gateway_id=gateway_id,
            org=org,
            key_id=key_id,
            tier=tier,
            priority=priority,
            arrival_time=arrival_time,
            deadline=deadline,
            session_key=self.session_key,
            reserved_tokens=reserved_tokens,
        )


# ------------------------------------------------------------------------- decoding

# msgspec ValidationError messages end in " - at `$.path`".
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")


def _from_validation_error(exc: msgspec.ValidationError) -> ApiError:
    text = str(exc)
    at = _AT_PATH.search(text)
    path = at.group("path") if at else ""
    detail = text[: at.start()] if at else text
    missing = _MISSING.match(detail)
    if missing:
        field_path = f"{path}.{missing.group('field')}".lstrip(".")
        return bad_request(f"Missing required parameter: '{field_path}'.", field_path, "missing_required_parameter")
    param = path.lstrip(".")
    if not param:
        return bad_request(f"Invalid request body: {clip(detail)}.", None, "invalid_type")
    return bad_request(f"Invalid value for '{param}': {clip(detail)}.", param, "invalid_type")


def _decode(decoder: msgspec.json.Decoder[Any], body: Body) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:  # before DecodeError: it is a subclass
        raise _from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid_json(str(exc)) from None
    except RecursionError:
        raise invalid_json("JSON nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a body that is not bytes-like
        raise invalid_json(str(exc)) from None


def parse_ws_message(data: Body) -> WsClientMessage:
    """Decode one client WebSocket message; ApiError 400 when malformed.

    Request bodies stay raw (``msgspec.Raw``): pass them to ``parse_ws_request`` or the
    ``parse_*_request`` functions.
    """
    message = _decode(ws_client_decoder, data)
    request_id: str | None = getattr(message, "id", None)
    if request_id is not None and not 0 < len(request_id) <= MAX_WS_ID_CHARS:
        raise bad_request(f"'id' must be 1 to {MAX_WS_ID_CHARS} characters.", "id", "invalid_value")
    return message


# ------------------------------------------------------------------ field validation


def _invalid(param: str, message: str, code: str = "invalid_value") -> NoReturn:
    raise bad_request(f"Invalid '{param}': {message}", param, code)


def _unsupported(param: str, message: str) -> NoReturn:
    raise bad_request(message, param, "unsupported_parameter")


def _float_in(param: str, value: float, low: float, high: float, *, low_open: bool = False) -> float:
    if not math.isfinite(value) or value > high or (value <= low if low_open else value < low):
        bracket = "(" if low_open else "["
        _invalid(param, f"{value} is not in the range {bracket}{low}, {high}].")
    return value


def _resolve_model(name: str, models: Mapping[str, ModelSpec], allowed: Collection[str] | None) -> ModelSpec:
    if not name:
        raise bad_request("You must provide a model parameter.", "model", "missing_required_parameter")
    spec = models.get(name)
    # ``allowed`` is ApiKeyRecord.models: empty means every model. A forbidden model
    # answers like a missing one (404), as OpenAI does, so keys cannot probe the catalog.
    if spec is None or (allowed and name not in allowed and spec.name not in allowed):
        raise model_not_found(name)
    return spec


def _check_common(req: SamplingFields, limits: ModelLimits, vocab_size: int) -> dict[str, Any]:
    """Sampling fields shared by chat and completions → SamplingParams kwargs (no max_tokens)."""
    if req.n is not None and req.n != 1:
        _unsupported("n", f"n={req.n} is not supported: meshserve returns one choice per request.")
    if req.logit_bias:
        _unsupported("logit_bias", "logit_bias is not supported.")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options", "invalid_value"
        )
    out: dict[str, Any] = {
        "temperature": limits.default_temperature,
        "top_p": limits.default_top_p,
    }
    if req.temperature is not None:
        out["temperature"] = _float_in("temperature", req.temperature, 0.0, limits.max_temperature)
    if req.top_p is not None:
        out["top_p"] = _float_in("top_p", req.top_p, 0.0, 1.0, low_open=True)
    if req.presence_penalty is not None:
        out["presence_penalty"] = _float_in("presence_penalty", req.presence_penalty, -2.0, 2.0)
    if req.frequency_penalty is not None:
        out["frequency_penalty"] = _float_in("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.repetition_penalty is not None:
        out["repetition_penalty"] = _float_in("repetition_penalty", req.repetition_penalty, 0.0, 2.0, low_open=True)
    if req.top_k is not None:
        top_k = req.top_k
        if top_k < -1:
            _invalid("top_k", f"{top_k} is not allowed: use -1 (or 0) to disable top-k, or a positive number.")
        if limits.max_top_k is not None and top_k > limits.max_top_k:
            _invalid("top_k", f"{top_k} exceeds this model's limit of {limits.max_top_k}.")
        # 0 means disabled (vLLM); k >= vocab keeps every token, i.e. disabled too, and
        # clamping keeps absurd values (10**30) off the msgpack wire.
        out["top_k"] = -1 if top_k in (0, -1) or top_k >= vocab_size else top_k
    if req.seed is not None:
        if not _INT64_MIN <= req.seed <= _INT64_MAX:
            _invalid("seed", "must fit in a signed 64-bit integer.")
        out["seed"] = req.seed
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if len(stops) > limits.max_stop_sequences:
            _invalid("stop", f"at most {limits.max_stop_sequences} stop sequences are allowed, got {len(stops)}.")
        for s in stops:
            if not s:
                _invalid("stop", "stop sequences must not be empty.")
            if len(s) > limits.max_stop_chars:
                _invalid("stop", f"stop sequences are limited to {limits.max_stop_chars} characters.")
        out["stop"] = list(stops)
    if req.stop_token_ids is not None:
        if len(req.stop_token_ids) > limits.max_stop_token_ids:
            _invalid("stop_token_ids", f"at most {limits.max_stop_token_ids} stop token ids are allowed.")
        for t in req.stop_token_ids:
            if not 0 <= t < vocab_size:
                _invalid("stop_token_ids", f"token id {t} is outside this model's vocabulary (0..{vocab_size - 1}).")
        out["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        out["ignore_eos"] = True
    for name, value in (("user", req.user), ("session_id", req.session_id)):
        if value is not None and len(value) > MAX_KEY_CHARS:
            _invalid(name, f"must be at most {MAX_KEY_CHARS} characters.")
    return out


def _check_max_tokens(param: str, value: int | None, limits: ModelLimits) -> int | None:
    if value is None:
        return None
    if value < 1:
        _invalid(param, f"integer below minimum value. Expected a value >= 1, but got {value} instead.",
                 "integer_below_min_value")
    if limits.max_tokens_cap is not None and value > limits.max_tokens_cap:
        _invalid(
            param,
            f"{param} is too large: {value}. This model supports at most {limits.max_tokens_cap}"
            f" completion tokens, whereas you provided {value}.",
        )
    return value


def _resolve_max_tokens(
    kind: RequestKind, param: str, requested: int | None, prompt_tokens: int, limits: ModelLimits
) -> int:
    """max_tokens after the context-length check (OpenAI's wording for the error)."""
    n = limits.max_model_len
    where = "in the messages" if kind == "chat" else "in the prompt"
    field_name = "messages" if kind == "chat" else "prompt"
    if requested is not None:
        total = prompt_tokens + requested
        if total > n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, you requested {total} tokens"
                f" ({prompt_tokens} {where}, {requested} in the completion). Please reduce the length of"
                f" the {field_name} or completion.",
                field_name,
                "context_length_exceeded",
            )
        return requested
    if prompt_tokens >= n:  # not even one output token fits
        raise bad_request(
            f"This model's maximum context length is {n} tokens. However, your {field_name} resulted in"
            f" {prompt_tokens} tokens. Please reduce the length of the {field_name}.",
            field_name,
            "context_length_exceeded",
        )
    room = n - prompt_tokens
    default = limits.default_max_tokens if kind == "chat" else limits.default_completion_max_tokens
    resolved = room if default is None else min(default, room)
    if limits.max_tokens_cap is not None:
        resolved = min(resolved, limits.max_tokens_cap)
    return resolved


def _finish(
    kind: RequestKind,
    req: SamplingFields,
    spec: ModelSpec,
    prompt: list[int],
    common: dict[str, Any],
    max_param: str,
    requested_max: int | None,
) -> NormalizedRequest:
    if not prompt:
        raise bad_request("The prompt is empty after tokenization.", "messages" if kind == "chat" else "prompt",
                          "invalid_value")
    max_tokens = _resolve_max_tokens(kind, max_param, requested_max, len(prompt), spec.limits)
    min_tokens = req.min_tokens
    if min_tokens is not None:
        if min_tokens < 0:
            _invalid("min_tokens", f"must be >= 0, got {min_tokens}.")
        if min_tokens > max_tokens:
            _invalid("min_tokens", f"{min_tokens} exceeds max_tokens ({max_tokens}).")
        common["min_tokens"] = min_tokens
    session = req.session_id or req.user or None
    return NormalizedRequest(
        kind=kind,
        model=spec.name,
        requested_model=req.model,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **common),
        stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options is not None and req.stream_options.include_usage),
        session_key=session,
        user=req.user,
    )


def _encode(spec: ModelSpec, text: str) -> list[int]:
    try:
        return spec.tokenizer.encode(text)
    except Exception as exc:  # a tokenizer bug is ours, not the client's
        raise ApiError(500, f"The tokenizer failed: {type(exc).__name__}", "server_error", None, "tokenizer_error") from None


# ----------------------------------------------------------------------------- chat


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as template input: plain-string content, ``developer`` folded into ``system``."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "invalid_value")
    out: list[dict[str, str]] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(
                f"Invalid value for 'messages[{i}].role': {clip(m.role)!r} is not supported; use system,"
                " developer, user or assistant (tool calling is not supported).",
                f"messages[{i}].role",
                "unsupported_value",
            )
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise bad_request(
                    f"Missing required parameter: 'messages[{i}].content'.",
                    f"messages[{i}].content",
                    "missing_required_parameter",
                )
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad_request(
                        f"Content part type {clip(part.type)!r} is not supported: this model takes text only.",
                        f"messages[{i}].content[{j}].type",
                        "unsupported_value",
                    )
                if part.text is None:
                    raise bad_request(
                        f"Missing required parameter: 'messages[{i}].content[{j}].text'.",
                        f"messages[{i}].content[{j}].text",
                        "missing_required_parameter",
                    )
                texts.append(part.text)
            # vLLM joins text parts with newlines; matching it keeps prompts identical.
            text = "\n".join(texts)
        message = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.logprobs:
        _unsupported("logprobs", "logprobs are not supported.")
    if req.top_logprobs:
        _unsupported("top_logprobs", "top_logprobs are not supported.")
    if req.tools:
        _unsupported("tools", "Tool calling is not supported.")
    if req.functions:
        _unsupported("functions", "Function calling is not supported.")
    if req.tool_choice is not None and req.tool_choice != "none":
        _unsupported("tool_choice", "Tool calling is not supported.")
    if req.function_call is not None and req.function_call != "none":
        _unsupported("function_call", "Function calling is not supported.")
    if req.response_format is not None and req.response_format.get("type") != "text":
        _unsupported("response_format", "Only response_format {\"type\": \"text\"} is supported.")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        _unsupported("modalities", "Only the text modality is supported.")
    if req.audio is not None:
        _unsupported("audio", "Audio output is not supported.")


def _render(spec: ModelSpec, messages: list[dict[str, str]]) -> str:
    try:
        return spec.template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        if exc.reason == "raised":
            raise bad_request(exc.message, "messages", "invalid_value") from None
        if exc.reason == "too_long":
            raise bad_request(
                f"The conversation is too long: {exc.message}.", "messages", "context_length_exceeded"
            ) from None
        if exc.reason == "budget":
            raise bad_request(
                f"The conversation is too large for this model's chat template: {exc.message}.",
                "messages",
                "invalid_value",
            ) from None
        raise ApiError(500, f"The model's chat template is broken: {exc.message}", "server_error", None,
                       "chat_template_error") from None


def parse_chat_request(
    body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
) -> NormalizedRequest:
    """Validate a ``/v1/chat/completions`` body; render, tokenize, resolve max_tokens.

    ``models`` maps every servable name (aliases included) to its spec;
    ``allowed_models`` is the key's ``ApiKeyRecord.models`` (None or empty: all).
    Raises ``ApiError`` (4xx; 500 only for a broken template or tokenizer).
    """
    req: ChatCompletionRequest = _decode(chat_request_decoder, body)
    spec = _resolve_model(req.model, models, allowed_models)
    _check_chat_unsupported(req)
    common = _check_common(req, spec.limits, spec.tokenizer.vocab_size)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = _check_max_tokens(
        max_param, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, spec.limits
    )
    messages = _chat_messages(req)
    prompt = _encode(spec, _render(spec, messages))
    return _finish("chat", req, spec, prompt, common, max_param, requested)


# ---------------------------------------------------------------------- completions


def _completion_prompt(spec: ModelSpec, prompt: str | list[str | int | list[int]]) -> list[int]:
    vocab = spec.tokenizer.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        return _encode(spec, prompt)
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
    if all(isinstance(t, int) for t in prompt):
        ids: list[int] = prompt  # type: ignore[assignment]
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        return _completion_prompt(spec, prompt[0])
    elif len(prompt) == 1 and isinstance(prompt[0], list):
        ids = prompt[0]
        if not ids:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
    elif all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(
            f"Batched prompts ({len(prompt)} prompts in one request) are not supported; send one request per"
            " prompt.",
            "prompt",
            "unsupported_value",
        )
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list holding one of those.",
            "prompt",
            "invalid_type",
        )
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise bad_request(
                f"Invalid 'prompt': token id {t} at position {i} is outside this model's vocabulary"
                f" (0..{vocab - 1}).",
                "prompt",
                "invalid_value",
            )
    return list(ids)


def _check_completion_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        _unsupported("echo", "echo is not supported.")
    if req.best_of is not None and req.best_of != 1:
        _unsupported("best_of", f"best_of={req.best_of} is not supported: meshserve generates one sequence.")
    if req.logprobs is not None:
        _unsupported("logprobs", "logprobs are not supported.")
    if req.suffix:
        _unsupported("suffix", "suffix (insertion) is not supported.")


def parse_completion_request(
    body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
) -> NormalizedRequest:
    """Validate a ``/v1/completions`` body; tokenize a string prompt or check token ids.

    Same contract as ``parse_chat_request``.
    """
    req: CompletionRequest = _decode(completion_request_decoder, body)
    spec = _resolve_model(req.model, models, allowed_models)
    _check_completion_unsupported(req)
    common = _check_common(req, spec.limits, spec.tokenizer.vocab_size)
    requested = _check_max_tokens("max_tokens", req.max_tokens, spec.limits)
    prompt = _completion_prompt(spec, req.prompt)
    return _finish("completion", req, spec, prompt, common, "max_tokens", requested)


def parse_request(
    kind: RequestKind, body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
) -> NormalizedRequest:
    """``parse_chat_request`` or ``parse_completion_request`` by ``kind``."""
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    return parse(body, models, allowed_models=allowed_models)


def parse_ws_request(
    message: WsChatRequest | WsCompletionRequest,
    models: Mapping[str, ModelSpec],
    *,
    allowed_models: Collection[str] | None = None,
) -> NormalizedRequest:
    """Validate the body of a WebSocket request; the socket always streams."""
    kind: RequestKind = "chat" if isinstance(message, WsChatRequest) else "completion"
    request = parse_request(kind, message.body, models, allowed_models=allowed_models)
    request.stream = True
    return request
