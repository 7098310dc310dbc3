"""Demand admission refused for want of capacity, per pool, over a sliding window (pure).

An autoscaler sizes a pool from its queues; admission's SLO shedding keeps those queues
short, so a pool that refuses half its traffic can look "at target". What admission
refused (``PoolDemand``) is the load the queues do not show.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Refusals that mean "not enough replicas": a quota's refusal is the key's limit, not demand.
CAPACITY_REASONS = frozenset({"slo", "no_capacity"})


@dataclass
class RefusedDemand:
    window_s: float = 5.0
    _refused: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # pool → (at, prompt tokens)
    _reported: set[str] = field(default_factory=set)  # pools last reported with demand

    def record(self, pool: str, prompt_tokens: int, now: float) -> None:
        self._refused.setdefault(pool, deque()).append((now, prompt_tokens))

    def reports(self, now: float) -> dict[str, tuple[int, int]]:
        """Per pool, (requests, prompt tokens) refused within the window: every pool with
        some, and once more at (0, 0) each pool that had some at the last call."""
        out: dict[str, tuple[int, int]] = {}
        for pool, refused in list(self._refused.items()):
            while refused and refused[0][0] <= now - self.window_s:
                refused.popleft()
            if refused:
                out[pool] = (len(refused), sum(tokens for _, tokens in refused))
            else:
                del self._refused[pool]
        for pool in self._reported - set(out):
            out[pool] = (0, 0)
        self._reported = {pool for pool, (requests, _) in out.items() if requests}
        return out
