"""OpenAI-compatible request and response shapes, and fast encoders for them.

Requests decode with msgspec in strict mode (no ``"5"`` → ``5`` coercion) through the
decoders below; ``services.gateway.validation`` turns the result into a normalised
request or an ``ApiError``. Fields OpenAI clients may send that meshserve does not
implement are declared anyway so validation can refuse them when they would change
the output (tools, response_format, logprobs, ...) instead of silently ignoring them;
other unknown fields (``store``, ``metadata``, new SDK fields) are ignored, as OpenAI-
compatible servers such as vLLM do.

Responses are Structs in OpenAI's field order, encoded by one shared
``msgspec.json.Encoder``. Streaming helpers return ready-to-send bytes, because they sit
on the per-token path.

The WebSocket protocol of ``/v1/ws`` is here too (``Ws*`` Structs): its request bodies
are OpenAI bodies, its error bodies OpenAI error bodies.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from proto.messages import Usage

# Tool calls have one set of shapes, the parsers' (re-exported here with the others).
from services.common.parsers.events import FunctionCall as FunctionCall
from services.common.parsers.events import FunctionCallDelta as FunctionCallDelta
from services.common.parsers.events import ToolCall as ToolCall
from services.common.parsers.events import ToolCallDelta as ToolCallDelta

RequestKind = Literal["chat", "completion"]

# --------------------------------------------------------------------------- requests


class ContentPart(Struct, kw_only=True):
    """One part of a message's ``content`` array; only ``{"type": "text"}`` is served.

    ``type`` is a plain string (not a tagged union) so an ``image_url`` part gets a
    readable "not supported" error from validation rather than msgspec's tag error.
    """

    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    # role is a plain string so validation can say which roles are supported.
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant, echoed back by some clients: not rendered (as vLLM)
    # assistant: its reasoning, handed back for interleaved thinking; the template gets it
    # as ``reasoning`` and ``reasoning_content`` (as vLLM passes it)
    reasoning: str | None = None


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far on every chunk


class SamplingFields(Struct, kw_only=True):
    """Fields chat and completions requests share. ``None`` everywhere means "default".

    OpenAI's spec makes most of them nullable and some SDKs send explicit nulls, so
    ``null`` is accepted and treated as absent.
    """

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    min_p: float | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    priority: int | None = None  # lower runs first; only where the server schedules by priority
    # vLLM's guided decoding fields (older names, and 0.1x's ``structured_outputs``)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # OpenAI's cache routing key: meshserve's session affinity (prefix cache) uses it
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor to ``user``: the usage record's user
    service_tier: str | None = None
    store: bool | None = None
    # meshserve extension: session affinity key (falls back to prompt_cache_key, then ``user``)
    session_id: str | None = None
    # vLLM's fields that change what comes back and that meshserve does not serve: declared
    # so that one set to anything but vLLM's default is refused by name (``sampling_fields.
    # VLLM_UNSERVED``), not dropped (use_beam_search was: greedy copies came back as "beams").
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    add_special_tokens: Any = None
    cache_salt: Any = None
    logprob_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    return_token_offsets: Any = None
    truncation_side: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    return_mm_kwargs: Any = None
    routed_experts_prompt_start: Any = None


# OpenAI's reasoning efforts, for chat's reasoning_effort and the Responses API's
# reasoning.effort alike (a template that knows the variable reads it; others ignore it).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's, refused when set as the fields of SamplingFields above
    chat_template: Any = None
    documents: Any = None
    include_reasoning: Any = None
    return_prompt_text: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    # Declared to be refused when set (see validation): they change what the model must produce.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM: the answer opens with the last message's content when that message is the
    # assistant's (a continued final message), streamed as its first content.
    echo: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or the batch forms (strings / lists of token ids); validation
    # accepts a batch of exactly one. msgspec allows one array type per union, hence the
    # element union rather than ``list[str] | list[int] | list[list[int]]``.
    prompt: str | list[str | int | list[int]]
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    prompt_embeds: Any = None  # vLLM's, refused when set (SamplingFields' vLLM fields)


chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)


# -------------------------------------------------------------------------- responses


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class CompletionUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Set when the model's reasoning parser counted reasoning tokens.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def usage_from_proto(u: Usage) -> CompletionUsage:
    """OpenAI usage from the ``proto.Usage`` a worker's final chunk carries."""
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


class TopLogprobEntry(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(Struct, kw_only=True):
    """Chat ``choices[].logprobs``."""

    content: list[LogprobEntry] | None = None


class PromptLogprob(Struct, kw_only=True):
    """vLLM's ``Logprob`` in a ``prompt_logprobs`` answer."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(Struct, kw_only=True):
    """Completions ``choices[].logprobs`` (the legacy shape)."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = ""
    # omitted when None would break clients that read ``message.tool_calls`` as a list:
    # OpenAI sends it only when there are calls; UNSET keeps the key out.
    tool_calls: list[ToolCall] | UnsetType = UNSET
    # Set when the model has a reasoning parser, under both names clients read: vLLM's own
    # since 0.1x (``reasoning``, as OpenRouter's) and its earlier one (``reasoning_content``,
    # DeepSeek's API and the clients written for it).
    reasoning_content: str | UnsetType | None = UNSET
    reasoning: str | UnsetType | None = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice, null otherwise (EOS included)
    stop_reason: int | str | None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM extension, when asked for


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    # omit_defaults: OpenAI sends {"role": ..., "content": ""} first, then {"content": ...},
    # and {} on the finishing chunk.
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text: both names, as AssistantMessage's
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | UnsetType | None = UNSET  # on the finishing chunk only, as vLLM's stream


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    # UNSET: key absent (include_usage off); None: "usage": null on every chunk but the
    # last, as OpenAI does when include_usage is on.
    usage: CompletionUsage | UnsetType | None = UNSET


class CompletionChoice(Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, on every choice (streamed ones too)
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM extension, when asked for


class TextCompletion(Struct, kw_only=True):
    """``text_completion``: the whole response, and each streamed chunk of one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: CompletionUsage | UnsetType | None = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "meshserve"
    max_model_len: int | UnsetType = UNSET  # vLLM extension; the chat page shows it
    # vLLM's, on every card: a base model's ``root`` is the model itself and its ``parent``
    # null (clients list base models by ``parent is None``); an adapter's names its weights
    # and its base model.
    root: str | None = None
    parent: str | None = None


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = []


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorBody


# -------------------------------------------------------------------------------- ids


def new_request_id() -> str:
    """A fresh mesh request id: 24 hex chars, safe inside a NATS subject token."""
    return secrets.token_hex(12)


def chat_completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def response_id(kind: RequestKind, request_id: str) -> str:
    return chat_completion_id(request_id) if kind == "chat" else completion_id(request_id)


# --------------------------------------------------------------------------- encoding

_encoder = msgspec.json.Encoder()


def encode_json(obj: Any) -> bytes:
    """JSON bytes of any response Struct (or plain data)."""
    return _encoder.encode(obj)


def error_json(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as bytes."""
    return _encoder.encode(ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code)))


SSE_DONE = b"data: [DONE]\n\n"
# An SSE comment line: proxies keep the connection open, clients ignore it.
SSE_KEEPALIVE = b": keep-alive\n\n"


def sse_event(id: str, data: bytes) -> bytes:
    """One SSE frame ``id: <id>\\ndata: <data>\\n\\n``.

    ``data`` must be single-line, which msgspec's JSON always is (newlines inside strings
    are escaped). The id lets a client resume with ``Last-Event-ID``; a newline in it
    would break the framing, so it is refused.
    """
    if "\n" in id or "\r" in id:
        raise ValueError("SSE event id must not contain a line break")
    return b"id: " + id.encode() + b"\ndata: " + data + b"\n\n"


def sse_data(data: bytes) -> bytes:
    """An SSE frame without an id: ``data: <data>\\n\\n``."""
    return b"data: " + data + b"\n\n"


# ------------------------------------------------------------------ WebSocket protocol
#
# One socket carries many concurrent requests, told apart by the client-chosen ``id``.
# Client → server (JSON text frames):
#   {"type": "auth", "api_key": "msk-..."}           first message, unless ?api_key=
#   {"type": "chat.completion", "id": "...", "body": {OpenAI chat body}}
#   {"type": "completion", "id": "...", "body": {OpenAI completions body}}
#   {"type": "cancel", "id": "..."}
# Server → client:
#   {"type": "token", "id", "seq", "text", "token_ids"[, "index", "reasoning_content",
#    "tool_calls", "logprobs", "finish_reason"]}  (the optional ones only when in play)
#   {"type": "done", "id", "finish_reason", "usage"}
#   {"type": "error", "id", "status", "error": {message, type, param, code}, "retry_after"}
# ``body.stream`` is ignored: the socket always streams.


class WsAuth(Struct, kw_only=True, tag_field="type", tag="auth"):
    api_key: str


class WsChatRequest(Struct, kw_only=True, tag_field="type", tag="chat.completion"):
    id: str
    body: msgspec.Raw  # validated later by validation.parse_chat_request(body, ...)


class WsCompletionRequest(Struct, kw_only=True, tag_field="type", tag="completion"):
    id: str
    body: msgspec.Raw


class WsCancel(Struct, kw_only=True, tag_field="type", tag="cancel"):
    id: str


WsClientMessage = WsAuth | WsChatRequest | WsCompletionRequest | WsCancel

ws_client_decoder = msgspec.json.Decoder(WsClientMessage)


class WsToken(Struct, kw_only=True, tag_field="type", tag="token", omit_defaults=True):
    """``text`` is content; the optional fields appear only when the request asked for
    what fills them (n > 1, a reasoning model, tools, logprobs)."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    index: int = 0
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: list[LogprobEntry] | CompletionLogprobs | None = None
    finish_reason: str | None = None  # this choice's end (n > 1; else see ``done``)
    stop_reason: int | str | None = None  # with finish_reason: the stop string or token id (vLLM's)


class WsDone(Struct, kw_only=True, tag_field="type", tag="done"):
    id: str
    finish_reason: str | None
    usage: CompletionUsage | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (n = 1), as vLLM's


class WsError(Struct, kw_only=True, tag_field="type", tag="error"):
    id: str | None  # None: about the socket itself (e.g. failed auth), not one request
    status: int
    error: ErrorBody
    retry_after: float | None = None


def ws_token(id: str, seq: int, text: str, token_ids: list[int], **extra: Any) -> bytes:
    """A ``token`` message (``extra``: WsToken's optional fields). Send it as a text frame
    (``bytes.decode()``): browsers hand binary frames to ``onmessage`` as Blobs."""
    return _encoder.encode(WsToken(id=id, seq=seq, text=text, token_ids=token_ids, **extra))


def ws_done(id: str, finish_reason: str | None, usage: CompletionUsage | None,
            stop_reason: int | str | None = None) -> bytes:
    return _encoder.encode(WsDone(id=id, finish_reason=finish_reason, usage=usage, stop_reason=stop_reason))


def ws_error(id: str | None, status: int, error: ErrorBody, retry_after: float | None = None) -> bytes:
    return _encoder.encode(WsError(id=id, status=status, error=error, retry_after=retry_after))
