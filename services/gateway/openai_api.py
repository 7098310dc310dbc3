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


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None


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
    # meshserve extension: session affinity key (falls back to ``user``)
    session_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # Declared to be refused when set (see validation): they change what the model must produce.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or the batch forms (strings / lists of token ids); validation
    # accepts a batch of exactly one. msgspec allows one array type per union, hence the
    # element union rather than ``list[str] | list[int] | list[list[int]]``.
    prompt: str | list[str | int | list[int]]
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None


chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)


# -------------------------------------------------------------------------- responses


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0


class CompletionUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


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


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str = ""


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    # omit_defaults: OpenAI sends {"role": ..., "content": ""} first, then {"content": ...},
    # and {} on the finishing chunk.
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


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
    logprobs: None = None
    finish_reason: str | None = None


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


def chat_completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: CompletionUsage | None,
) -> ChatCompletion:
    """A non-streamed ``chat.completion``."""
    return ChatCompletion(
        id=id,
        created=created,
        model=model,
        choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)],
        usage=usage,
    )


def text_completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: CompletionUsage | None,
) -> TextCompletion:
    """A non-streamed ``text_completion``."""
    return TextCompletion(
        id=id,
        created=created,
        model=model,
        choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
        usage=usage,
    )


class ChatStream:
    """Builds the ``data`` JSON of each ``chat.completion.chunk`` of one streamed reply.

    Call order, as OpenAI streams: ``role()`` once, ``content(text)`` per text delta,
    ``finish(reason)`` once, then ``usage(u)`` if ``include_usage``. Each returns JSON
    bytes; frame them with ``sse_event``/``sse_data`` and end with ``SSE_DONE``.
    """

    __slots__ = ("created", "id", "include_usage", "model")

    def __init__(self, id: str, model: str, created: int, include_usage: bool = False) -> None:
        self.id = id
        self.model = model
        self.created = created
        self.include_usage = include_usage

    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> bytes:
        return _encoder.encode(
            ChatCompletionChunk(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                usage=None if self.include_usage else UNSET,
            )
        )

    def role(self) -> bytes:
        return self._chunk(ChatDelta(role="assistant", content=""), None)

    def content(self, text: str) -> bytes:
        return self._chunk(ChatDelta(content=text), None)

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk(ChatDelta(), finish_reason)

    def usage(self, usage: CompletionUsage) -> bytes:
        """The extra last chunk of ``include_usage``: no choices, the request's usage."""
        return _encoder.encode(
            ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        )


class CompletionStream:
    """Like ``ChatStream`` for streamed ``text_completion`` chunks (no role chunk)."""

    __slots__ = ("created", "id", "include_usage", "model")

    def __init__(self, id: str, model: str, created: int, include_usage: bool = False) -> None:
        self.id = id
        self.model = model
        self.created = created
        self.include_usage = include_usage

    def _chunk(self, text: str, finish_reason: str | None) -> bytes:
        return _encoder.encode(
            TextCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
                usage=None if self.include_usage else UNSET,
            )
        )

    def content(self, text: str) -> bytes:
        return self._chunk(text, None)

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk("", finish_reason)

    def usage(self, usage: CompletionUsage) -> bytes:
        return _encoder.encode(
            TextCompletion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        )


# ------------------------------------------------------------------ WebSocket protocol
#
# One socket carries many concurrent requests, told apart by the client-chosen ``id``.
# Client → server (JSON text frames):
#   {"type": "auth", "api_key": "msk-..."}           first message, unless ?api_key=
#   {"type": "chat.completion", "id": "...", "body": {OpenAI chat body}}
#   {"type": "completion", "id": "...", "body": {OpenAI completions body}}
#   {"type": "cancel", "id": "..."}
# Server → client:
#   {"type": "token", "id", "seq", "text", "token_ids"}
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


class WsToken(Struct, kw_only=True, tag_field="type", tag="token"):
    id: str
    seq: int
    text: str
    token_ids: list[int]


class WsDone(Struct, kw_only=True, tag_field="type", tag="done"):
    id: str
    finish_reason: str | None
    usage: CompletionUsage | None = None


class WsError(Struct, kw_only=True, tag_field="type", tag="error"):
    id: str | None  # None: about the socket itself (e.g. failed auth), not one request
    status: int
    error: ErrorBody
    retry_after: float | None = None


def ws_token(id: str, seq: int, text: str, token_ids: list[int]) -> bytes:
    """A ``token`` message. Send it as a text frame (``bytes.decode()``): browsers hand
    binary frames to ``onmessage`` as Blobs."""
    return _encoder.encode(WsToken(id=id, seq=seq, text=text, token_ids=token_ids))


def ws_done(id: str, finish_reason: str | None, usage: CompletionUsage | None) -> bytes:
    return _encoder.encode(WsDone(id=id, finish_reason=finish_reason, usage=usage))


def ws_error(id: str | None, status: int, error: ErrorBody, retry_after: float | None = None) -> bytes:
    return _encoder.encode(WsError(id=id, status=status, error=error, retry_after=retry_after))
