"""How a request ended on this worker: its finish, error and usage. Pure.

The shell streams the engine's outputs and then hands this module what it saw: the last
output (``None`` when the engine produced none), an engine failure, whether the drain
timeout ended the request, and how many tokens it streamed. ``request_outcome`` turns
that into what the final chunk and the usage event say.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.errors import ErrorCode
from proto.messages import ErrorInfo, FinishReason, Timings, Usage, UsageStatus, segment_usage

from .engines.base import EngineOutput

USAGE_STATUS: dict[FinishReason, UsageStatus] = {"stop": "finished", "length": "length", "abort": "cancelled", "error": "failed"}


@dataclass(frozen=True, slots=True)
class Outcome:
    finish: FinishReason
    error_text: str  # the usage event's error ("" when none)
    error: ErrorInfo | None  # the final chunk's error: set exactly when finish is "error"
    usage: Usage  # the whole request, as the client sees it (earlier segments' output included)
    billed: Usage  # this segment's usage event (``proto.segment_usage``)
    timings: Timings | None

    @property
    def status(self) -> UsageStatus:
        return USAGE_STATUS[self.finish]


def request_outcome(
    last: EngineOutput | None,
    *,
    prompt_tokens: int,
    prior_tokens: int,
    streamed: int,
    migrations: int,
    engine_error: str = "",
    drain_error: str = "",
) -> Outcome:
    """``prompt_tokens``: the request's prompt (without the ``prior_tokens`` of output an
    earlier worker produced, which the engine got as part of its prompt); ``streamed``:
    tokens this worker sent, what it bills (an aborted engine may have computed a token
    nobody received); ``drain_error``: set when the drain timeout ended the request."""
    finish: FinishReason = last.finish_reason if last is not None and last.finish_reason else "error"
    error_text = engine_error
    if drain_error:
        finish, error_text = "error", drain_error
    if finish == "error" and not error_text:
        error_text = last.error if last is not None and last.error else "engine ended the request without a finish reason"
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=prior_tokens + streamed,
        cached_tokens=min(last.cached_tokens, prompt_tokens) if last is not None else 0,
    )
    own = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=streamed, cached_tokens=usage.cached_tokens)
    return Outcome(
        finish=finish,
        error_text=error_text,
        error=ErrorInfo(code=ErrorCode.INTERNAL.value, message=error_text) if finish == "error" else None,
        usage=usage,
        billed=segment_usage(own, migrations),
        timings=last.timings if last is not None else None,
    )
