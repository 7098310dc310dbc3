"""The driver interface and what every driver shares: errors, status, bookkeeping."""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

log = logging.getLogger(__name__)

ErrorListener = Callable[[str, str, str], None]  # (driver name, reason, message)
# Problems a successful periodic probe disproves.
REACHABILITY = frozenset({"unreachable", "docker_missing", "timeout", "bad_response", "forbidden"})


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """What the shell knows of a worker when it asks a driver to act on it.

    ``host`` is the worker's hostname from its registry entry: inside a container that is
    the container's short id (Docker's default), which is how ``ComposeDriver`` finds it.
    """

    worker_id: str
    pool: str
    host: str = ""
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Launch:
    """What a ``start`` did: how many replicas were asked for, with their ids when known."""

    count: int
    worker_ids: tuple[str, ...] = ()  # LocalDriver names its workers; orchestrators do not


@dataclass(frozen=True, slots=True)
class DriverStatus:
    ok: bool
    message: str
    errors: Mapping[str, int] = field(default_factory=dict)  # reason → count since start
    last_error: str = ""
    last_error_at: float = 0.0


class DriverError(Exception):
    """A driver could not do what it was asked; ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def pool_slug(pool: str) -> str:
    """A model name as a short, safe name fragment (worker ids, Nomad job ids)."""
    short = pool.rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9-]+", "-", short).strip("-")[:32] or "pool"


class Driver(ABC):
    name: ClassVar[str] = "driver"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.errors: Counter[str] = Counter()
        self.problem: str | None = None  # why the driver cannot act now, if it cannot
        self.problem_reason = ""
        self.last_error = ""
        self.last_error_at = 0.0
        self._listeners: list[ErrorListener] = []
        self.pools: tuple[str, ...] = ()  # set by the shell: the pools it scales (for polling)
        self._polled_at: float | None = None

    # ---- the interface ---------------------------------------------------------------
    @abstractmethod
    async def start(self, pool: str, count: int) -> Launch:
        """Launch ``count`` more replicas of ``pool``; raise ``DriverError`` if none could be."""

    @abstractmethod
    async def stop(self, ref: WorkerRef) -> None:
        """Forcibly stop one replica now: only for a drain that outlived its timeout."""

    @abstractmethod
    async def stopped(self, ref: WorkerRef) -> None:
        """The replica's drain is over (it deregistered, or was force-stopped): release it."""

    async def reap(self) -> list[str]:
        """Per-tick housekeeping; the worker ids whose process ended since the last call."""
        return []

    @abstractmethod
    def describe(self) -> str:
        """One line on what the driver manages, for ``status`` when all is well."""

    # Whether ``managed`` names every worker this driver runs: then a worker it does not
    # name was started by someone else, and the autoscaler never drains it.
    knows_its_workers: ClassVar[bool] = False

    def managed(self) -> set[str]:
        """Ids of the workers this driver runs, where it knows them."""
        return set()

    async def open(self) -> None:  # noqa: B027 - a hook: most drivers find their replicas by asking
        """The autoscaler is starting (``pools`` is set): pick up what an earlier run left."""

    async def close(self) -> None:  # noqa: B027 - a hook: most drivers hold nothing to release
        """The autoscaler is stopping."""

    def poll_due(self, poll_s: float) -> bool:
        """True at most once every ``poll_s``: an orchestrator's API is not polled every
        tick (it would load it for nothing); the first call is always due."""
        now = self.clock()
        if self._polled_at is not None and now - self._polled_at < poll_s:
            return False
        self._polled_at = now
        return True

    # ---- error bookkeeping shared by every driver -------------------------------------
    def on_error(self, listener: ErrorListener) -> None:
        self._listeners.append(listener)

    def fail(self, reason: str, message: str, *, blocking: bool = True) -> DriverError:
        """Record a failure (status, counters, listeners) and return the error to raise.

        ``blocking``: the driver cannot act until an operation succeeds again (status not
        ok); a non-blocking failure (one worker crashed) is counted and shown, no more.
        """
        self.errors[reason] += 1
        if blocking:
            self.problem, self.problem_reason = message, reason
        self.last_error = message
        self.last_error_at = self.clock()
        log.warning("%s driver: %s", self.name, message)
        for listener in self._listeners:
            try:
                listener(self.name, reason, message)
            except Exception:
                log.exception("driver error listener failed")
        return DriverError(reason, message)

    def succeeded(self, clears: frozenset[str] | None = None) -> None:
        """An operation worked: the driver can act again.

        ``clears`` limits which problems this success disproves (a reachability probe
        does not prove that a maximum is no longer reached).
        """
        if clears is None or self.problem_reason in clears:
            self.problem, self.problem_reason = None, ""

    def status(self) -> DriverStatus:
        return DriverStatus(
            ok=self.problem is None,
            message=self.problem if self.problem is not None else self.describe(),
            errors=dict(self.errors),
            last_error=self.last_error,
            last_error_at=self.last_error_at,
        )
