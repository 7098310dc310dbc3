"""The router's retry decision (``services.router.retry``): which worker answers are
refusals, when to give up, and the error the gateway then gets."""

from __future__ import annotations

import pytest

from proto.errors import ErrorCode
from services.router.retry import ATTEMPTS, GiveUp, Refusal, after_refusal, is_refusal, no_worker


@pytest.mark.parametrize(
    ("code", "refusal"),
    [
        (ErrorCode.DRAINING, True),
        (ErrorCode.OVERLOADED, True),
        (ErrorCode.NO_RESPONDERS, True),
        (ErrorCode.TIMEOUT, True),
        # the request's own fault: every worker would answer the same
        (ErrorCode.BAD_REQUEST, False),
        (ErrorCode.PROMPT_TOO_LONG, False),
        (ErrorCode.UNKNOWN_MODEL, False),
        (ErrorCode.INTERNAL, False),
    ],
)
def test_refusals_are_answers_where_nothing_started(code: ErrorCode, refusal: bool) -> None:
    assert is_refusal(code) is refusal


def test_one_refusal_retries_the_second_gives_up_with_no_capacity() -> None:
    first = Refusal("w1", ErrorCode.DRAINING, "worker w1 is draining")
    assert ATTEMPTS == 2  # two forward timeouts fit in the gateway's route timeout
    assert after_refusal([first]) is None
    second = Refusal("w2", ErrorCode.TIMEOUT, "no answer in 2 s")
    assert after_refusal([first, second]) == GiveUp(
        ErrorCode.NO_CAPACITY, "workers w1 and w2 refused the request (worker w1 is draining; no answer in 2 s)"
    )


def test_attempts_bound_the_retries() -> None:
    refusals = [Refusal(f"w{i}", ErrorCode.OVERLOADED, f"busy {i}") for i in range(3)]
    assert after_refusal(refusals[:2], attempts=3) is None
    give_up = after_refusal(refusals, attempts=3)
    assert give_up is not None and give_up.message == "workers w0, w1 and w2 refused the request (busy 0; busy 1; busy 2)"
    assert after_refusal(refusals[:1], attempts=1) is not None


def test_no_worker_keeps_the_decisions_error_and_names_who_refused() -> None:
    assert no_worker([], ErrorCode.UNKNOWN_MODEL, "no worker serves model 'x'") == GiveUp(
        ErrorCode.UNKNOWN_MODEL, "no worker serves model 'x'"
    )
    refused = [Refusal("w1", ErrorCode.NO_RESPONDERS, "no responders")]
    assert no_worker(refused, ErrorCode.NO_CAPACITY, "1 worker(s) for 'm', none ready, live, not draining, 1 excluded") == GiveUp(
        ErrorCode.NO_CAPACITY,
        "worker w1 refused (no responders) and 1 worker(s) for 'm', none ready, live, not draining, 1 excluded",
    )
