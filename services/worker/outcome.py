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
    undeliverable: str = "",
) -> Outcome:
    """``prompt_tokens``: the request's prompt (without the ``prior_tokens`` of output an
    earlier worker produced, which the engine got as part of its prompt); ``streamed``:
    tokens this worker sent, what it bills (an aborted engine may have computed a token
    nobody received); ``engine_error``: an engine failure (after its finish it is only
    reported); ``undeliverable``: the answer could not be sent (a chunk larger than the
    bus carries), which fails the request with a client error whatever the engine's
    finish."""
    finish: FinishReason = last.finish_reason if last is not None and last.finish_reason else "error"
    error_text = engine_error
    if undeliverable:
        finish, error_text = "error", undeliverable
    if finish == "error" and not error_text:
        error_text = last.error if last is not None and last.error else "engine ended the request without a finish reason"
    refused = finish == "error" and not engine_error and last is not None and last.rejected
    error_code = ErrorCode.BAD_REQUEST if refused or undeliverable else ErrorCode.INTERNAL
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=prior_tokens + streamed,
        cached_tokens=min(last.cached_tokens, prompt_tokens) if last is not None else 0,
    )
    own = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=streamed, cached_tokens=usage.cached_tokens)
    return Outcome(
        finish=finish,
        error_text=error_text,
        error=ErrorInfo(code=error_code.value, message=error_text) if finish == "error" else None,
        usage=usage,
        billed=segment_usage(own, migrations),
        timings=last.timings if last is not None else None,
    )


# A request of n choices ends as its worst choice did.
_SEVERITY: dict[FinishReason, int] = {"stop": 0, "length": 1, "abort": 2, "error": 3}


def combine_outcomes(outcomes: list[Outcome], *, migrations: int, finished_before: int = 0) -> Outcome:
    """The request-level outcome of a request with n > 1 choices (``outcomes``: the choices
    this worker ran; ``finished_before``: choices an earlier worker finished). The prompt
    counts once, the completion tokens of every choice add up; the finish is the worst
    (an error anywhere fails the request; all cut at max_tokens reads ``length``)."""
    assert outcomes
    finish = max((o.finish for o in outcomes), key=_SEVERITY.__getitem__)
    if finish == "length" and (finished_before or any(o.finish == "stop" for o in outcomes)):
        finish = "stop"  # some choice ended on its own: the request is not "cut"
    errors = [o for o in outcomes if o.finish == "error"]
    first = outcomes[0]
    usage = Usage(prompt_tokens=first.usage.prompt_tokens,
                  completion_tokens=sum(o.usage.completion_tokens for o in outcomes),
                  cached_tokens=first.usage.cached_tokens)
    own = Usage(prompt_tokens=first.billed.prompt_tokens if migrations == 0 else 0,
                completion_tokens=sum(o.billed.completion_tokens for o in outcomes),
                cached_tokens=first.billed.cached_tokens if migrations == 0 else 0)
    timed = [o.timings for o in outcomes if o.timings is not None]
    timings = None
    if timed:
        timings = Timings(
            arrival=min(t.arrival for t in timed),
            scheduled=min((t.scheduled for t in timed if t.scheduled), default=0.0),
            first_token=min((t.first_token for t in timed if t.first_token), default=0.0),
            finished=max(t.finished for t in timed),
        )
    return Outcome(
        finish=finish,
        error_text=errors[0].error_text if errors else "",
        error=errors[0].error if errors else None,
        usage=usage,
        billed=segment_usage(own, migrations),
        timings=timings,
    )
