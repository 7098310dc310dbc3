"""When a worker does not take a placed request: decide again without it, or give up.

The shell forwards each decision to its worker. A refusal (draining, overloaded, no
responders, timeout) means nothing started there: the request is placed again by a
fresh ``Router.decide`` with the refusing workers excluded. A fresh decision, not a
runner-up kept from the first one: it reads the view as it is after the refusal (which
may have taken a whole forward timeout), and a cascade falls back to its other pool when
the excluded worker was the last of the first. Any other error is the request's own
fault and goes back to the gateway as it is: another worker would refuse it too.

Each attempt may take the forward timeout, and all must fit in the gateway's route
timeout (5 s against 2 s each): ``ATTEMPTS`` is 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proto.errors import NO_CAPACITY_RETRY_AFTER_S, ErrorCode, MeshError

ATTEMPTS = 2

# Worker answers that mean "not me, try another": nothing started there.
REFUSALS = frozenset({ErrorCode.DRAINING, ErrorCode.OVERLOADED, ErrorCode.NO_RESPONDERS, ErrorCode.TIMEOUT})


@dataclass(frozen=True, slots=True)
class Refusal:
    worker_id: str
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The error the gateway gets."""

    code: ErrorCode
    message: str

    def error(self) -> PlacementError:
        """The error to answer, with a ``retry_after`` when capacity may come back."""
        return PlacementError(self.message, code=self.code, retry_after=retry_after_for(self.code))


class PlacementError(MeshError):
    """The router's answer when it placed nothing; ``retry_after`` travels in the error
    reply (``ErrorInfo.retry_after``), which the gateway makes a ``Retry-After``."""

    def __init__(self, message: str, *, code: ErrorCode, retry_after: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


def retry_after_for(code: ErrorCode) -> float | None:
    """A capacity answer may pass: ``NO_CAPACITY_RETRY_AFTER_S``; any other none."""
    return NO_CAPACITY_RETRY_AFTER_S if code is ErrorCode.NO_CAPACITY else None


def is_refusal(code: ErrorCode) -> bool:
    return code in REFUSALS


def after_refusal(refusals: Sequence[Refusal], attempts: int = ATTEMPTS) -> GiveUp | None:
    """``None``: decide again, the refusing workers excluded; else the error to answer."""
    if len(refusals) < attempts:
        return None
    workers = _and([r.worker_id for r in refusals])
    reasons = "; ".join(r.message for r in refusals)
    return GiveUp(ErrorCode.NO_CAPACITY, f"workers {workers} refused the request ({reasons})")


def no_worker(refusals: Sequence[Refusal], code: ErrorCode, message: str) -> GiveUp:
    """The decision found no worker (``code`` and ``message`` say why); after refusals,
    the error names them too."""
    if not refusals:
        return GiveUp(code, message)
    refused = "; ".join(f"worker {r.worker_id} refused ({r.message})" for r in refusals)
    return GiveUp(code, f"{refused} and {message}")


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
