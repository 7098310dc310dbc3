"""Typed errors shared by every service.

Error codes are part of the wire contract: an `ErrorInfo` carries one of them, and
the gateway maps them onto HTTP statuses. Exceptions raised by `proto` and `bus`
derive from `MeshError` so callers can catch one family.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"              # malformed or invalid input (4xx)
    UNSUPPORTED_VERSION = "unsupported_version"
    DECODE = "decode_error"
    UNKNOWN_MODEL = "unknown_model"
    PROMPT_TOO_LONG = "prompt_too_long"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    QUOTA_TOKENS = "quota_tokens"            # admission: tokens-per-minute bucket empty
    QUOTA_REQUESTS = "quota_requests"        # admission: requests-per-minute bucket empty
    SLO = "slo"                              # admission: predicted TTFT breaks the tier's SLO
    NO_CAPACITY = "no_capacity"              # no ready replica for the model
    OVERLOADED = "overloaded"                # a component's own in-flight limit
    DRAINING = "draining"                    # worker refuses new work while draining (retryable)
    PAYLOAD_TOO_LARGE = "payload_too_large"
    TIMEOUT = "timeout"
    NO_RESPONDERS = "no_responders"
    CANCELLED = "cancelled"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"


# Codes a caller may retry elsewhere or later without changing the request.
# How long a client told "no capacity" (no replica ready, every worker refused) should
# wait before trying again: admission, router and gateway all say the same.
NO_CAPACITY_RETRY_AFTER_S = 5.0

RETRYABLE = frozenset(
    {
        ErrorCode.QUOTA_TOKENS,
        ErrorCode.QUOTA_REQUESTS,
        ErrorCode.SLO,
        ErrorCode.NO_CAPACITY,
        ErrorCode.OVERLOADED,
        ErrorCode.DRAINING,
        ErrorCode.TIMEOUT,
        ErrorCode.NO_RESPONDERS,
        ErrorCode.WORKER_LOST,
    }
)


class MeshError(Exception):
    """Base of every meshserve error; carries a wire error code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


class DecodeError(MeshError):
    """Bytes that are not a valid message of the expected type."""

    code = ErrorCode.DECODE


class UnsupportedVersion(DecodeError):
    """A well-formed message whose schema version this build does not speak."""

    code = ErrorCode.UNSUPPORTED_VERSION


class PayloadTooLarge(MeshError):
    code = ErrorCode.PAYLOAD_TOO_LARGE

    def __init__(self, size: int, limit: int, subject: str = "") -> None:
        where = f" on {subject}" if subject else ""
        super().__init__(f"payload too large{where}: {size} bytes exceeds the server limit of {limit} bytes")
        self.size = size
        self.limit = limit


class RequestTimeout(MeshError):
    code = ErrorCode.TIMEOUT


class NoResponders(MeshError):
    code = ErrorCode.NO_RESPONDERS


class RemoteError(MeshError):
    """The far side answered with an ErrorReply."""

    def __init__(self, message: str, *, code: ErrorCode, retry_after: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after
