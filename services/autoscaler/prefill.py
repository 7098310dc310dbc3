"""The autoscaler's prefill bookkeeping (pure): prompt tokens arriving at a pool, whether
it kept a queue through a window, and the capacity ceiling such a queue taught. The
control law (``control.step``) reads it for ``needed_prefill`` (DESIGN.md, Autoscaling)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from proto.workers import WorkerGauge

CEILING_RELAX_S = 900.0  # a learnt prefill capacity ceiling relaxes by e this often


@dataclass(frozen=True)
class PrefillDemand:
    """Prompt tokens a second arriving at the pool (what its replicas computed plus what its
    queue grew by, over a window), whether the pool kept a queue through a window, and the
    ceiling on a replica's prefill capacity that such a queue taught. Pure bookkeeping of
    the gauges' counters."""

    counts: tuple[tuple[str, int], ...] = ()  # worker → its prefill_tokens_total at the last tick
    at: float | None = None  # the last tick
    queued: int = 0  # the pool's waiting tokens then
    arrived: tuple[tuple[float, int], ...] = ()  # (tick, prompt tokens arrived since the one before), the window's
    rate: float | None = None  # tokens arrived over the window / the window: a steady rate in one window
    # What a pool that kept a queue taught: a replica computes at most ``ceiling`` tokens/s
    # (the arrivals over the replicas that could not keep up). It relaxes by e every
    # ``CEILING_RELAX_S``: a workload may change, but it must not be unlearnt before the
    # scale-down cooldown, or the pool would shrink into the same queue again.
    ceiling: float | None = None
    ceiling_at: float | None = None
    # Whether the pool had a queue, each tick since its size last changed (within the window).
    size: int = -1
    since: float | None = None
    queue_ticks: tuple[tuple[float, bool], ...] = ()

    def backed_up(self, now: float, window_s: float, share: float = 0.9) -> bool:
        """A queue at (nearly) every tick for a whole window at this size: arrivals outrun
        the replicas, whatever the demand and capacity figures say (a replica's decodes take
        the compute its prefill rate does not show)."""
        if self.since is None or now - self.since < window_s or len(self.queue_ticks) < 2:
            return False
        return sum(1 for _, queued in self.queue_ticks if queued) >= share * len(self.queue_ticks)

    def update(self, gauges: Sequence[WorkerGauge], queued: int, now: float, window_s: float, *, size: int = 0,
               computing_queue: bool = False) -> PrefillDemand:
        seen = dict(self.counts)
        computed = 0
        for g in gauges:
            before = seen.get(g.worker_id)
            if before is None:
                continue  # a worker first seen now only sets its baseline: its count may span hours
            # A counter below its last value restarted (a reloaded engine): all of it is new.
            computed += g.prefill_tokens_total - before if g.prefill_tokens_total >= before else g.prefill_tokens_total
        counts = tuple((g.worker_id, g.prefill_tokens_total) for g in gauges)
        arrived, rate = self.arrived, self.rate
        if self.at is not None and now > self.at:
            # Not clipped per tick: a queue's fall (a cached prompt leaving it whole, a step's
            # chunk counted before its step ends) cancels its earlier rise within the window.
            # Over the whole window, never the time seen so far: one 128k-token prompt in the
            # first second is 6.4k tokens/s over 20 s, not 128k.
            arrived = (*(a for a in arrived if a[0] > now - window_s), (now, computed + queued - self.queued))
            rate = sum(tokens for _, tokens in arrived) / window_s
        since, ticks = (self.since, self.queue_ticks) if size == self.size else (now, ())
        ticks = (*(t for t in ticks if t[0] > now - window_s), (now, computing_queue))
        return replace(self, counts=counts, at=now, queued=queued, arrived=arrived, rate=rate, size=size, since=since,
                       queue_ticks=ticks)

    @property
    def tokens_per_s(self) -> float:
        return max(0.0, self.rate or 0.0)

    def ceiling_now(self, now: float) -> float | None:
        if self.ceiling is None or self.ceiling_at is None:
            return None
        return self.ceiling * math.exp(max(0.0, now - self.ceiling_at) / CEILING_RELAX_S)

    def learn_ceiling(self, now: float, replicas: int) -> PrefillDemand:
        """The pool kept a queue at ``replicas``: none of them computes more than the
        arrivals' share."""
        if replicas <= 0 or self.tokens_per_s <= 0:
            return self
        bound = self.tokens_per_s / replicas
        current = self.ceiling_now(now)
        return replace(self, ceiling=bound if current is None else min(current, bound), ceiling_at=now)
