"""The autoscaler's bookkeeping around the control law: pure, the clock passed in.

- ``LaunchTracker``: replicas a driver launched that have not reported a gauge yet (the
  law's ``starting``), redeemed by their first gauge, written off after a timeout;
- ``PendingDemand``: requests waiting for a pool with no replica, per reporting source;
- ``DecisionLog``: the decisions of one pool worth showing in ``meshserve status``;
- ``to_record`` / ``to_signals``: a ``ScaleDecision`` as the status message's structs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proto.autoscaler import DecisionRecord, PoolSignals

from .control import ScaleDecision


@dataclass
class LaunchTicket:
    """One launched replica not seen yet."""

    pool: str
    at: float
    worker_id: str | None  # None: the orchestrator names it; any new worker of the pool redeems it


class LaunchTracker:
    """Replicas launched and not yet seen: the law's ``starting``.

    A launch is redeemed by the first gauge of its worker: by id when the driver named
    it, else by any worker of the pool never seen before. Tickets expire after
    ``timeout_s`` (the replica failed to come up); ``expire`` returns them for reporting.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.tickets: list[LaunchTicket] = []
        self.seen: set[str] = set()

    def launched(self, pool: str, count: int, now: float, worker_ids: Sequence[str] = ()) -> None:
        named: list[str | None] = []
        named += [w for w in worker_ids if w not in self.seen][:count]
        ids = named + [None] * (count - len(named))
        self.tickets += [LaunchTicket(pool, now, w) for w in ids]

    def observe(self, pool: str, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            if worker_id in self.seen:
                continue
            self.seen.add(worker_id)
            named = next((t for t in self.tickets if t.worker_id == worker_id), None)
            anonymous = next((t for t in self.tickets if t.worker_id is None and t.pool == pool), None)
            if named is not None or anonymous is not None:
                self.tickets.remove(named or anonymous)  # type: ignore[arg-type]

    def ended(self, worker_ids: Iterable[str]) -> list[LaunchTicket]:
        """Workers whose process ended: a launch that died before its first gauge."""
        gone = set(worker_ids)
        dead = [t for t in self.tickets if t.worker_id in gone]
        self.tickets = [t for t in self.tickets if t.worker_id not in gone]
        return dead

    def forget(self, worker_id: str) -> None:
        """A worker left the registry: should its id come back, it is new again."""
        self.seen.discard(worker_id)

    def expire(self, now: float) -> list[LaunchTicket]:
        old = [t for t in self.tickets if now - t.at >= self.timeout_s]
        self.tickets = [t for t in self.tickets if now - t.at < self.timeout_s]
        return old

    def starting(self, pool: str) -> int:
        return sum(1 for t in self.tickets if t.pool == pool)


class PendingDemand:
    """Requests waiting for a pool with no replica, as reported by their holders."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.reports: dict[tuple[str, str], tuple[int, int, float]] = {}  # (pool, source) → (requests, tokens, at)

    def report(self, pool: str, requests: int, tokens: int, now: float, source: str = "") -> None:
        if requests <= 0 and tokens <= 0:
            self.reports.pop((pool, source), None)
        else:
            self.reports[(pool, source)] = (max(0, requests), max(0, tokens), now)

    def get(self, pool: str, now: float) -> tuple[int, int]:
        requests = tokens = 0
        for (p, source), (r, t, at) in list(self.reports.items()):
            if now - at > self.ttl_s:
                del self.reports[(p, source)]
            elif p == pool:
                requests += r
                tokens += t
        return requests, tokens


class DecisionLog:
    """The last decisions of one pool worth showing.

    Every action is kept; a hold only when the picture changed (action, replica counts or
    target), or the log would be a second-by-second copy of the same hold.
    """

    def __init__(self, size: int) -> None:
        self.records: deque[DecisionRecord] = deque(maxlen=size)
        self._last_key: tuple[object, ...] | None = None
        self.latest: ScaleDecision | None = None

    def add(self, decision: ScaleDecision) -> DecisionRecord | None:
        self.latest = decision
        key = (decision.action, decision.current, decision.ready, decision.desired, decision.target, decision.signals.draining)
        if decision.action == "hold" and key == self._last_key:
            return None
        self._last_key = key
        record = to_record(decision)
        self.records.append(record)
        return record


def to_record(d: ScaleDecision) -> DecisionRecord:
    return DecisionRecord(
        at=d.at, action=d.action, current=d.current, ready=d.ready, desired=d.desired, target=d.target,
        count=d.count, drain_worker=d.drain_worker, cold_start=d.cold_start, reason=d.reason,
    )


def to_signals(d: ScaleDecision) -> PoolSignals:
    s = d.signals
    return PoolSignals(
        waiting_tokens=s.waiting_tokens, running_tokens=s.running_tokens, pending_requests=s.pending_requests,
        replica_token_capacity=s.replica_token_capacity, capacity_source=s.capacity_source,
        target_utilization=s.target_utilization, needed=s.needed, warm_buffer=s.warm_buffer, floor=s.floor,
        scheduled_min=s.scheduled_min, max_replicas=s.max_replicas, window_max=s.window_max,
        cooldown_remaining_s=s.cooldown_remaining_s, idle_s=s.idle_s, starting=s.starting, draining=s.draining,
        prefill_tokens_per_s=s.prefill_tokens_per_s, decode_tokens_per_s=s.decode_tokens_per_s,
        queue_drain_s=s.queue_drain_s, prefill_demand_tokens_per_s=s.prefill_demand_tokens_per_s,
        needed_prefill=s.needed_prefill,
    )
