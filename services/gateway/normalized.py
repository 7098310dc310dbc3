"""The request the gateway sends on (``NormalizedRequest``) and what every front door's
parser shares to build it: strict decoding of the body into OpenAI's shapes, the model
and ``max_tokens`` checks, truncation, tokenizing, and the final assembly.

Contract (fuzzed in tests): for any input bytes the parsers return a
``NormalizedRequest`` or raise ``ApiError`` with a 4xx status — never another
exception. The one exception to "4xx" is a server fault the client cannot cause or fix:
a broken operator chat template or a failing tokenizer gives ``ApiError`` 500.
``ApiError`` and its builders live in ``errors``. The parsers themselves: chat in
``chat_request``, completions and the entry points in ``validation``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from proto.errors import NO_CAPACITY_RETRY_AFTER_S
from proto.hashing import pack_tokens
from proto.messages import MESH_MAX_PAYLOAD, GenerateRequest, SamplingParams
from proto.records import OutputOptions

from .errors import ApiError, bad_request, clip, invalid_json, model_not_found, overloaded, tokenizer_failed
from .models import ModelLimits, ModelSpec
from .openai_api import RequestKind, SamplingFields, WsClientMessage, ws_client_decoder
from .sampling_fields import check_cache_salt, check_metadata, invalid

Body = bytes | bytearray | memoryview | str | msgspec.Raw

MAX_WS_ID_CHARS = 128

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
    cache_salt: str = ""  # vLLM's: prefixes shared only with the same org and salt

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
            cache_salt=self.cache_salt,
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


def decode_body(decoder: msgspec.json.Decoder[Any], body: Body) -> Any:
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


_any_json = msgspec.json.Decoder()
_S = TypeVar("_S", bound=Struct)


def decode_object(body: Body, struct: type[_S]) -> tuple[dict[str, Any], _S]:
    """A JSON object body both raw (the fields a translation passes on as they are) and as
    ``struct``; ``ApiError`` 400 as ``decode_body`` raises them, naming the field."""
    raw = decode_body(_any_json, body)
    if not isinstance(raw, dict):
        raise invalid_json("the body is not a JSON object")
    try:
        return raw, msgspec.convert(raw, struct)
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc) from None


def parse_ws_message(data: Body) -> WsClientMessage:
    """Decode one client WebSocket message; ApiError 400 when malformed.

    Request bodies stay raw (``msgspec.Raw``): pass them to ``parse_ws_request`` or the
    ``parse_*_request`` functions.
    """
    message = decode_body(ws_client_decoder, data)
    request_id: str | None = getattr(message, "id", None)
    if request_id is not None and not 0 < len(request_id) <= MAX_WS_ID_CHARS:
        raise bad_request(f"'id' must be 1 to {MAX_WS_ID_CHARS} characters.", "id", "invalid_value")
    return message


# ------------------------------------------------------------------ field validation


def model_allowed(name: str, spec: ModelSpec, allowed: Collection[str] | None) -> bool:
    """Whether a key whose ``ApiKeyRecord.models`` is ``allowed`` (empty: every model) may
    use ``name``: named itself, or an alias of a model it names. A LoRA adapter is a model
    of its own: a team's fine-tune is not every user of its base model's."""
    return not allowed or name in allowed or (spec.lora is None and spec.name in allowed)


def resolve_model(name: str, models: Mapping[str, ModelSpec], allowed: Collection[str] | None, *,
                  needs_replica: bool = True) -> ModelSpec:
    """The spec of model ``name`` if the key may use it (``allowed``), else a 404; a 503
    with a Retry-After while no worker serves it for a moment (``ModelSpec.serving``),
    unless the caller ``needs_replica`` not (tokenizing: the gateway has the tokenizer)."""
    if not name:
        raise bad_request("You must provide a model parameter.", "model", "missing_required_parameter")
    spec = models.get(name)
    # ``allowed`` is ApiKeyRecord.models: empty means every model. A forbidden model
    # answers like a missing one (404), as OpenAI does, so keys cannot probe the catalog.
    if spec is None or not model_allowed(name, spec, allowed):
        raise model_not_found(name)
    if not spec.serving and needs_replica:
        # Its workers left a moment ago (restarting): admission's "no replica" answer, so
        # clients retry instead of taking a 404 as final.
        raise overloaded(f"No replica of the model `{clip(name)}` is available right now. Please try again in"
                         f" {NO_CAPACITY_RETRY_AFTER_S:.1f}s.", NO_CAPACITY_RETRY_AFTER_S, 503, "no_capacity")
    return spec


def check_max_tokens(param: str, value: int | None, limits: ModelLimits, *, allow_zero: bool = False) -> int | None:
    """The requested output bound, checked against the model's cap (None: not given).
    ``allow_zero``: completions with ``echo``, where 0 asks for the prompt alone (vLLM's)."""
    if value is None:
        return None
    if value == 0 and allow_zero:
        return 0
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
    """max_tokens after the context-length check (OpenAI's wording for the error), lowered
    to the model's ``max_tokens_override`` as vLLM's ``get_max_tokens`` does."""
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
        return requested if limits.max_tokens_override is None else min(requested, limits.max_tokens_override)
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
    for cap in (limits.max_tokens_cap, limits.max_tokens_override):
        if cap is not None:
            resolved = min(resolved, cap)
    return resolved


def truncate_prompt(req: SamplingFields, spec: ModelSpec, prompt: list[int], requested_max: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last k prompt tokens (-1: the model's
    length less the output asked for, at least one token, so that the request can run;
    vLLM keeps the whole length and then refuses the request)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return prompt
    if k == -1:
        k = max(spec.limits.max_model_len - max(requested_max or 1, 1), 1)
    if k < 1:
        invalid("truncate_prompt_tokens", f"must be -1 or at least 1, got {k}.")
    if k > spec.limits.max_model_len:
        invalid("truncate_prompt_tokens", f"{k} exceeds this model's context length ({spec.limits.max_model_len}).")
    return prompt[-k:]


def finish_request(
    kind: RequestKind,
    req: SamplingFields,
    spec: ModelSpec,
    prompt: list[int],
    common: dict[str, Any],
    max_param: str,
    requested_max: int | None,
    output: OutputOptions,
) -> NormalizedRequest:
    """The request every parser ends in: the prompt's token ids checked against the
    context length, ``max_tokens`` resolved, the sampling and output options assembled."""
    if kind == "chat":
        prompt = truncate_prompt(req, spec, prompt, requested_max)
    if not prompt:
        raise bad_request("The prompt is empty after tokenization.", "messages" if kind == "chat" else "prompt",
                          "invalid_value")
    max_tokens = _resolve_max_tokens(kind, max_param, requested_max, len(prompt), spec.limits)
    check_prompt_logprobs(kind, common.get("prompt_logprobs"), len(prompt))
    min_tokens = req.min_tokens
    if min_tokens is not None:
        if min_tokens < 0:
            invalid("min_tokens", f"must be >= 0, got {min_tokens}.")
        if min_tokens > max_tokens:
            invalid("min_tokens", f"{min_tokens} exceeds max_tokens ({max_tokens}).")
        common["min_tokens"] = min_tokens
    session = req.session_id or req.prompt_cache_key or req.user or req.safety_identifier or None
    include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
    if include_usage and req.stream_options is not None and req.stream_options.continuous_usage_stats:
        output = msgspec.structs.replace(output, continuous_usage=True, prompt_tokens=len(prompt))
    return NormalizedRequest(
        kind=kind,
        model=spec.name,
        requested_model=req.model,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **common),
        stream=bool(req.stream),
        include_usage=include_usage,
        session_key=session,
        user=req.user or req.safety_identifier,
        metadata=check_metadata(req.metadata),
        output=output,
        lora=spec.lora,
        lora_path=spec.lora_path,
        lora_size_bytes=spec.lora_size_bytes,
        priority=req.priority or 0,
        cache_salt=check_cache_salt(req.cache_salt),
    )


# Prompt log probabilities one response may carry (tokens × (prompt_logprobs + 1)): they
# travel in one chunk, which must fit the bus's max_payload (MESH_MAX_PAYLOAD: ~200k entries with their
# text); 130k tokens × 21 held a sim worker's loop 7 s and then could not be sent at all.
MAX_PROMPT_LOGPROB_ENTRIES = 200_000


def check_prompt_logprobs(kind: RequestKind, per_token: int | None, prompt_tokens: int,
                          max_payload: int = MESH_MAX_PAYLOAD) -> None:
    """The parsers check against meshserve's own bus; the gateway again against a smaller
    one it finds itself on (NATS's 1 MB default), before any engine works on it."""
    if per_token is None:
        return
    entries = prompt_tokens * (per_token + 1)
    limit = MAX_PROMPT_LOGPROB_ENTRIES * min(max_payload, MESH_MAX_PAYLOAD) // MESH_MAX_PAYLOAD
    if entries > limit:
        field_name = "messages" if kind == "chat" else "prompt"
        raise bad_request(
            f"prompt_logprobs={per_token} over {prompt_tokens} prompt tokens asks for {entries:,} log"
            f" probabilities; one response carries at most {limit:,}. Ask for fewer"
            f" per token or shorten the {field_name}.",
            "prompt_logprobs",
            "invalid_value",
        )


def encode_text(spec: ModelSpec, text: str) -> list[int]:
    """Token ids of ``text``; a tokenizer that fails is the server's fault (500)."""
    try:
        return spec.tokenizer.encode(text)
    except Exception as exc:  # a tokenizer bug is ours, not the client's
        raise tokenizer_failed(exc) from None
