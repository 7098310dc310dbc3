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

import re
from collections.abc import Collection, Mapping
from typing import Any

import msgspec
from msgspec import Struct

from proto.hashing import pack_tokens
from proto.messages import GenerateRequest, SamplingParams
from proto.records import OutputOptions

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
from .sampling_fields import check_common, check_count, check_metadata, invalid, unsupported
from .tools import ToolPlan, history_fields, plan_tools

Body = bytes | bytearray | memoryview | str | msgspec.Raw

MAX_WS_ID_CHARS = 128
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ROLES = {"system", "developer", "user", "assistant", "tool"}

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
    metadata: dict[str, str] = {}
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    tools: list[dict[str, Any]] | None = None  # as the chat template was given them
    lora: str | None = None  # the adapter ``requested_model`` names (``model`` is its base)
    lora_path: str = ""
    lora_size_bytes: int = 0
    priority: int = 0  # vLLM's sense: lower runs first (see parse_request)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def reserved_tokens(self) -> int:
        """The pessimistic cost admission reserves: prompt plus every allowed output token
        of every choice."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens * max(self.sampling.n, 1)

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
            user=self.user or "",
            metadata=self.metadata,
            lora=self.lora,
            lora_path=self.lora_path,
            lora_size_bytes=self.lora_size_bytes,
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


def _resolve_model(name: str, models: Mapping[str, ModelSpec], allowed: Collection[str] | None) -> ModelSpec:
    if not name:
        raise bad_request("You must provide a model parameter.", "model", "missing_required_parameter")
    spec = models.get(name)
    # ``allowed`` is ApiKeyRecord.models: empty means every model. A forbidden model
    # answers like a missing one (404), as OpenAI does, so keys cannot probe the catalog.
    if spec is None or (allowed and name not in allowed and spec.name not in allowed):
        raise model_not_found(name)
    return spec


def _check_max_tokens(param: str, value: int | None, limits: ModelLimits) -> int | None:
    if value is None:
        return None
    if value < 1:
        invalid(param, f"integer below minimum value. Expected a value >= 1, but got {value} instead.",
                 "integer_below_min_value")
    if limits.max_tokens_cap is not None and value > limits.max_tokens_cap:
        invalid(
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


def _truncate(req: SamplingFields, spec: ModelSpec, prompt: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last k prompt tokens (-1: the model's length)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return prompt
    if k == -1:
        k = spec.limits.max_model_len
    if k < 1:
        invalid("truncate_prompt_tokens", f"must be -1 or at least 1, got {k}.")
    if k > spec.limits.max_model_len:
        invalid("truncate_prompt_tokens", f"{k} exceeds this model's context length ({spec.limits.max_model_len}).")
    return prompt[-k:]


def _finish(
    kind: RequestKind,
    req: SamplingFields,
    spec: ModelSpec,
    prompt: list[int],
    common: dict[str, Any],
    max_param: str,
    requested_max: int | None,
    output: OutputOptions,
) -> NormalizedRequest:
    if kind == "chat":
        prompt = _truncate(req, spec, prompt)
    if not prompt:
        raise bad_request("The prompt is empty after tokenization.", "messages" if kind == "chat" else "prompt",
                          "invalid_value")
    max_tokens = _resolve_max_tokens(kind, max_param, requested_max, len(prompt), spec.limits)
    min_tokens = req.min_tokens
    if min_tokens is not None:
        if min_tokens < 0:
            invalid("min_tokens", f"must be >= 0, got {min_tokens}.")
        if min_tokens > max_tokens:
            invalid("min_tokens", f"{min_tokens} exceeds max_tokens ({max_tokens}).")
        common["min_tokens"] = min_tokens
    session = req.session_id or req.prompt_cache_key or req.user or req.safety_identifier or None
    return NormalizedRequest(
        kind=kind,
        model=spec.name,
        requested_model=req.model,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **common),
        stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options is not None and req.stream_options.include_usage),
        session_key=session,
        user=req.user or req.safety_identifier,
        metadata=check_metadata(req.metadata),
        output=output,
        lora=spec.lora,
        lora_path=spec.lora_path,
        lora_size_bytes=spec.lora_size_bytes,
        priority=req.priority or 0,
    )


def _encode(spec: ModelSpec, text: str) -> list[int]:
    try:
        return spec.tokenizer.encode(text)
    except Exception as exc:  # a tokenizer bug is ours, not the client's
        raise ApiError(500, f"The tokenizer failed: {type(exc).__name__}", "server_error", None, "tokenizer_error") from None


# ----------------------------------------------------------------------------- chat


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as template input: plain-string content, ``developer`` folded into
    ``system``, tool calls and tool results in the shape chat templates expect."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message.", "messages", "invalid_value")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(
                f"Invalid value for 'messages[{i}].role': {clip(m.role)!r} is not supported; use system,"
                " developer, user, assistant or tool.",
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
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        message.update(history_fields(m, i))
        out.append(message)
    return out


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.functions:
        unsupported("functions", "The deprecated 'functions' parameter is not supported: use 'tools'.")
    if req.function_call is not None and req.function_call != "none":
        unsupported("function_call", "The deprecated 'function_call' parameter is not supported: use 'tool_choice'.")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        unsupported("modalities", "Only the text modality is supported.")
    if req.audio is not None:
        unsupported("audio", "Audio output is not supported.")
    if req.prediction is not None:
        unsupported("prediction", "Predicted outputs are not supported.")
    if req.web_search_options is not None:
        unsupported("web_search_options", "Web search is not supported.")
    if req.reasoning_effort is not None and req.reasoning_effort not in ("minimal", "low", "medium", "high"):
        invalid("reasoning_effort", "must be one of 'minimal', 'low', 'medium' or 'high'.")
    if req.verbosity not in (None, "medium"):
        unsupported("verbosity", "Only verbosity 'medium' (the model's own) is supported.")


def _chat_output(req: ChatCompletionRequest, spec: ModelSpec, plan: ToolPlan, common: dict[str, Any]) -> OutputOptions:
    """Logprobs and tool settings of a chat request → what the worker samples and how the
    gateway builds the answer."""
    top = 0
    if req.top_logprobs is not None:
        if not req.logprobs:
            invalid("top_logprobs", "requires 'logprobs' to be true.")
        top = check_count("top_logprobs", req.top_logprobs, spec.limits.max_logprobs)
    if req.logprobs:
        common["logprobs"] = top
    if plan.choice == "auto" and spec.tool_parser == "mistral":
        # Its [TOOL_CALLS] marker is a special token: the parser must see it (vLLM does the same).
        common["skip_special_tokens"] = False
    if plan.structured is not None:
        if "structured" in common:
            invalid("tool_choice", "a forced tool call cannot be combined with response_format or guided decoding.")
        common["structured"] = plan.structured
    end_token_id = None
    thinking = True
    if spec.reasoning_parser:
        ids = _encode(spec, "</think>")
        end_token_id = ids[0] if len(ids) == 1 else None
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking") is not False
    return OutputOptions(
        n=common.get("n", 1), logprobs=bool(req.logprobs), top_logprobs=top,
        prompt_logprobs="prompt_logprobs" in common,
        tool_choice="function" if plan.choice == "named" else plan.choice, tool_name=plan.function_name or "",
        tool_parser=spec.tool_parser if plan.choice == "auto" else "", reasoning_parser=spec.reasoning_parser,
        thinking=thinking, reasoning_end_token_id=end_token_id,
    )


_RESERVED_TEMPLATE_KEYS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM): extra template variables, e.g. ``enable_thinking``;
    ``reasoning_effort`` goes in as a variable too, as vLLM passes it (templates that
    know it, such as gpt-oss's, set the effort in the prompt)."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KEYS:
            invalid(f"chat_template_kwargs.{key}", "is set by the request itself, not a template variable.")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def _render(spec: ModelSpec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            add_generation_prompt: bool = True, continue_final_message: bool = False,
            extra_context: dict[str, Any] | None = None) -> str:
    try:
        return spec.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    continue_final_message=continue_final_message, extra_context=extra_context)
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
    common = check_common(req, spec.limits, spec.tokenizer.vocab_size)
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = _check_max_tokens(
        max_param, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, spec.limits
    )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser=spec.tool_parser)
    output = _chat_output(req, spec, plan, common)
    messages = _chat_messages(req)
    if req.continue_final_message and req.add_generation_prompt:
        invalid("continue_final_message", "cannot be combined with add_generation_prompt: true.")
    if req.continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        invalid("continue_final_message", "the last message must be the assistant's message to continue.")
    add_generation_prompt = req.add_generation_prompt is not False and not req.continue_final_message
    prompt = _encode(spec, _render(spec, messages, plan.tools, add_generation_prompt,
                                   bool(req.continue_final_message), _template_kwargs(req)))
    normalized = _finish("chat", req, spec, prompt, common, max_param, requested, output)
    normalized.tools = plan.tools
    return normalized


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
    # vLLM 0.1x dropped best_of from its V1 engine too; n is the way to ask for choices.
    if req.best_of is not None and req.best_of != (req.n or 1):
        unsupported("best_of", f"best_of={req.best_of} is not supported: use n for several choices.")
    if req.suffix:
        unsupported("suffix", "suffix (insertion) is not supported.")


def _completion_output(req: CompletionRequest, spec: ModelSpec, prompt: list[int], common: dict[str, Any]
                       ) -> OutputOptions:
    top = 0
    if req.logprobs is not None:
        top = check_count("logprobs", req.logprobs, spec.limits.max_logprobs)
        common["logprobs"] = top
    echo = None
    if req.echo:
        try:
            echo = spec.tokenizer.decode(prompt)
        except Exception as exc:  # a tokenizer bug is ours, not the client's
            raise ApiError(500, f"The tokenizer failed: {type(exc).__name__}", "server_error", None,
                           "tokenizer_error") from None
    first_token = ""
    if echo is not None and req.logprobs is not None:
        common["prompt_logprobs"] = max(top, common.get("prompt_logprobs", 0))
        first_token = spec.tokenizer.decode(prompt[:1])
    # vLLM answers prompt_logprobs whenever the engine computed them (echo with logprobs too)
    return OutputOptions(n=common.get("n", 1), logprobs=req.logprobs is not None, top_logprobs=top, echo=echo,
                         echo_first_token=first_token, prompt_logprobs="prompt_logprobs" in common and not req.stream)


def parse_completion_request(
    body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
) -> NormalizedRequest:
    """Validate a ``/v1/completions`` body; tokenize a string prompt or check token ids.

    Same contract as ``parse_chat_request``.
    """
    req: CompletionRequest = _decode(completion_request_decoder, body)
    spec = _resolve_model(req.model, models, allowed_models)
    _check_completion_unsupported(req)
    common = check_common(req, spec.limits, spec.tokenizer.vocab_size)
    requested = _check_max_tokens("max_tokens", req.max_tokens, spec.limits)
    prompt = _truncate(req, spec, _completion_prompt(spec, req.prompt))
    output = _completion_output(req, spec, prompt, common)
    return _finish("completion", req, spec, prompt, common, "max_tokens", requested, output)


def parse_request(
    kind: RequestKind, body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None,
    priority_scheduling: bool = False,
) -> NormalizedRequest:
    """``parse_chat_request`` or ``parse_completion_request`` by ``kind``. A non-zero
    ``priority`` (vLLM's) is refused unless the server schedules by it, as vLLM does under
    fcfs: the mesh schedules by the key's tier, and dropping it silently would hide that."""
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    request = parse(body, models, allowed_models=allowed_models)
    if request.priority:
        if not priority_scheduling:
            unsupported("priority", f"priority {request.priority} is not offered: this server does not schedule by a"
                                    " request's priority (on meshserve the API key's tier decides).")
        if not _INT32_MIN <= request.priority <= _INT32_MAX:
            invalid("priority", "must fit in a signed 32-bit integer.")
    return request


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
