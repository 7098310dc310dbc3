"""Errors for the client: ``ApiError`` (an HTTP status plus OpenAI's error body) and its
builders, and the one table that maps mesh error codes onto HTTP statuses.

Every front door (HTTP, WebSocket, NATS API) answers with these: one error type, one JSON
body shape; ``validation`` raises them for bad requests, the shell for the rest (401, 413,
429, 503, ...).
"""

from __future__ import annotations

import math
from collections.abc import Collection

from proto.errors import ErrorCode
from proto.messages import AdmissionDecision

from .chat_template import ChatTemplateError
from .openai_api import ErrorBody, ErrorResponse, encode_json, ws_error


class ApiError(Exception):
    """An error for the client: HTTP status plus OpenAI's error body fields.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header and the WebSocket error's
    ``retry_after``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, code={self.code!r})"

    @property
    def body(self) -> ErrorBody:
        return ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)

    def to_json(self) -> bytes:
        """The HTTP (and NATS reply) body: ``{"error": {message, type, param, code}}``."""
        return encode_json(ErrorResponse(error=self.body))

    def headers(self) -> dict[str, str]:
        """Extra response headers: ``Retry-After`` in whole seconds, rounded up."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def to_ws(self, id: str | None) -> bytes:
        """The WebSocket ``error`` message for request ``id`` (None: the socket itself)."""
        return ws_error(id, self.status, self.body, self.retry_after)


def clip(value: str, limit: int = 200) -> str:
    # Errors echo client values; a megabyte model name must not come back a megabyte.
    return value if len(value) <= limit else value[:limit] + "…"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def invalid_json(detail: str = "") -> ApiError:
    suffix = f" ({clip(detail)})" if detail else ""
    return ApiError(
        400,
        "We could not parse the JSON body of your request. The body must be a JSON object"
        f" (Content-Type: application/json){suffix}.",
        "invalid_request_error",
        None,
        "invalid_json",
    )


def from_template_error(exc: ChatTemplateError) -> ApiError:
    """The error for a conversation the model's chat template could not render: 400 when
    the conversation is the problem, 500 when the operator's template is broken."""
    if exc.reason == "raised":
        return bad_request(exc.message, "messages", "invalid_value")
    if exc.reason == "too_long":
        return bad_request(f"The conversation is too long: {exc.message}.", "messages", "context_length_exceeded")
    if exc.reason == "budget":
        return bad_request(f"The conversation is too large for this model's chat template: {exc.message}.",
                           "messages", "invalid_value")
    return ApiError(500, f"The model's chat template is broken: {exc.message}", "server_error", None,
                    "chat_template_error")


def tokenizer_failed(exc: Exception) -> ApiError:
    """A tokenizer that raised: a bug of ours, not the client's (500)."""
    return ApiError(500, f"The tokenizer failed: {type(exc).__name__}", "server_error", None, "tokenizer_error")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{clip(model)}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


# What the client should have called instead; shown in every unknown-URL error.
SERVED_ENDPOINTS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET|DELETE /v1/responses/{id}, "
                    "GET /v1/responses/{id}/input_items, POST /v1/messages, GET /v1/models")


def unknown_url(method: str, path: str, served: str = SERVED_ENDPOINTS) -> ApiError:
    """404 for a path the server does not serve, in OpenAI's words ("Invalid URL (POST
    /v1/x)"); ``served``: what it does serve (sim-server has no /v1/responses)."""
    return ApiError(
        404,
        f"Invalid URL ({clip(method, 16)} {clip(path)}): meshserve serves {served}.",
        "invalid_request_error",
        None,
        "unknown_url",
    )


def method_not_allowed(method: str, path: str, allowed: Collection[str]) -> ApiError:
    allow = ", ".join(sorted(allowed))
    return ApiError(
        405,
        f"Method {clip(method, 16)} is not allowed for {clip(path)}; use {allow}.",
        "invalid_request_error",
        None,
        "method_not_allowed",
    )


def payload_too_large(limit: int, size: int | None = None) -> ApiError:
    got = f" ({size} bytes)" if size is not None else ""
    return ApiError(
        413,
        f"Request body too large{got}: the limit is {limit} bytes.",
        "invalid_request_error",
        None,
        "payload_too_large",
    )


def internal_error() -> ApiError:
    """What a client gets when the gateway itself failed (the cause goes to its log only)."""
    return ApiError(500, "internal error", "server_error", None, "internal")


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "You didn't provide an API key. Provide it in an Authorization header using Bearer auth"
        " (Authorization: Bearer msk-...), in an api-key header, or as the first WebSocket message"
        " {\"type\": \"auth\"}.",
        "invalid_request_error",
        None,
        "missing_api_key",
    )


def malformed_authorization() -> ApiError:
    return ApiError(
        401,
        "You sent a malformed Authorization header: expected 'Authorization: Bearer msk-...'"
        " (an 'api-key' or 'x-api-key' header holding just the key works too).",
        "invalid_request_error",
        None,
        "invalid_authorization_header",
    )


def invalid_api_key(redacted: str = "") -> ApiError:
    """401 for an unknown, revoked or malformed key; pass ``apikeys.redact_key(key)``."""
    shown = f": {redacted}" if redacted else ""
    return ApiError(401, f"Incorrect API key provided{shown}.", "invalid_request_error", None, "invalid_api_key")


def rate_limited(message: str, retry_after: float, kind: str = "requests") -> ApiError:
    """429; ``kind`` is OpenAI's error type: ``requests`` (RPM) or ``tokens`` (TPM)."""
    return ApiError(429, message, kind, None, "rate_limit_exceeded", retry_after)


def overloaded(message: str, retry_after: float | None = None, status: int = 503, code: str = "overloaded") -> ApiError:
    return ApiError(status, message, "server_error", None, code, retry_after)


def from_admission(decision: AdmissionDecision) -> ApiError:
    """The client error for a refusal from admission (``decision.admitted`` is False).

    Quota and SLO shedding are 429 + Retry-After (DESIGN.md: shed early rather than admit
    a request that misses its SLO); no ready replica is 503.
    """
    retry = decision.retry_after or None
    wait = f" Please try again in {decision.retry_after:.1f}s." if decision.retry_after else ""
    match decision.reason:
        case "quota_tokens":
            return rate_limited(decision.message or f"Rate limit reached for tokens per minute.{wait}", retry or 1.0, "tokens")
        case "quota_requests":
            return rate_limited(decision.message or f"Rate limit reached for requests per minute.{wait}", retry or 1.0, "requests")
        case "slo":
            return overloaded(
                decision.message or f"The model is overloaded: this request would miss its latency target.{wait}",
                retry or 1.0,
                status=429,
                code="slo_overloaded",
            )
        case _:  # "no_capacity" or a reason this build does not know
            return overloaded(
                decision.message or f"No replica of this model is available right now.{wait}", retry, 503, "no_capacity"
            )


_MESH_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_MODEL: (404, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "invalid_request_error"),
    ErrorCode.FORBIDDEN: (403, "invalid_request_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.QUOTA_TOKENS: (429, "tokens"),
    ErrorCode.QUOTA_REQUESTS: (429, "requests"),
    ErrorCode.SLO: (429, "server_error"),
    # 499 is nginx's "client closed request": only logs and metrics ever see it.
    ErrorCode.CANCELLED: (499, "invalid_request_error"),
    ErrorCode.NO_CAPACITY: (503, "server_error"),
    ErrorCode.OVERLOADED: (503, "server_error"),
    ErrorCode.DRAINING: (503, "server_error"),
    ErrorCode.NO_RESPONDERS: (503, "server_error"),
    ErrorCode.WORKER_LOST: (502, "server_error"),
    ErrorCode.TIMEOUT: (504, "server_error"),
    # A decode or version error between services is our fault, never the client's.
    ErrorCode.DECODE: (500, "server_error"),
    ErrorCode.UNSUPPORTED_VERSION: (500, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


def from_mesh_error(code: str, message: str, retry_after: float | None = None) -> ApiError:
    """The client error for a mesh ``ErrorInfo``/``RemoteError`` code (unknown codes: 500)."""
    status, type_ = _MESH_STATUS.get(code, (500, "server_error"))
    api_code = "context_length_exceeded" if code == ErrorCode.PROMPT_TOO_LONG else str(code)
    if status == 429 and code != ErrorCode.SLO:
        api_code = "rate_limit_exceeded"
    return ApiError(status, message, type_, None, api_code, retry_after)


def missing_nats_api_key() -> ApiError:
    """401 for a NATS API request without a key: says where a NATS client puts it."""
    return ApiError(
        401,
        "You didn't provide an API key. Provide it in a NATS header of your request:"
        " Authorization: Bearer msk-... (or api-key: msk-...).",
        "invalid_request_error",
        None,
        "missing_api_key",
    )


def request_not_found(request_id: str) -> ApiError:
    """404 for a request id that is not in flight for this key (another key's gets the same answer)."""
    return ApiError(404, f"No request {clip(request_id, 64)!r} of yours is in flight (unknown, finished or not"
                         " yours).", "invalid_request_error", None, "not_found")


def deadline_passed(timeout_s: float) -> ApiError:
    """504 for a request whose client-given deadline passed: it was cancelled."""
    return ApiError(504, f"The request did not finish within its Meshserve-Timeout of {timeout_s:g}s and was"
                         " cancelled.", "server_error", None, "timeout")
