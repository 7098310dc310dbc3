"""Placement on hot-swap hosts (DESIGN.md, Many models per GPU): what a model's load
costs on each host that may hold it, in the prefill tokens the policies' costs are in.

An entry whose model is resident costs nothing extra; one loading costs the seconds its
load has left; a cold one costs the load's seconds, half as much again when the host
must evict a model for it (someone reloads that later), and cannot take the request at
all while every model it would have to evict is busy or pinned (``blocked``: the request
would wait on a model's requests to finish). Seconds become tokens at the pool's
measured prefill rate, so a model's traffic stays on its resident replicas until their
queues cost more than a load elsewhere, and a hot model spreads to more hosts as its
traffic grows. The eviction forecast is the host's own rule (``residency.victims``)
applied to the entries' gauges, with the placements the gauges do not show yet counted
as work: a model just placed on is loading and busy.

The pinned set (the fleet's busiest models, never evicted) comes from ``Demand``: each
model's request rate, decayed exponentially, as the router places requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.common.fleet import FleetWorker
from services.common.residency import ResidentModel, busiest, residency, victims

# Prefill tokens per second a load's seconds are priced at before any gauge measured a
# rate (an 8B model on an H100 prefills ~12k tokens/s: profiles/llama-3.1-8b-h100).
DEFAULT_SWAP_TOKENS_PER_S = 10_000.0
EVICTION_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class SwapCosts:
    costs: dict[str, float]  # worker id → tokens its model's load costs (resident: absent)
    blocked: frozenset[str]  # cold entries whose host cannot make room now


def swap_costs(eligible: Sequence[FleetWorker], fleet: Iterable[FleetWorker], pinned: Sequence[str]) -> SwapCosts:
    """Load costs of the hot-swap entries among ``eligible``; ``fleet``: every worker
    the view holds (each entry's host siblings are among them)."""
    hosts = {w.info.host_id for w in eligible if w.info is not None and w.info.host_id}
    if not hosts:
        return SwapCosts({}, frozenset())
    siblings: dict[str, list[FleetWorker]] = {h: [] for h in hosts}
    rate = 0.0
    for w in fleet:
        if w.info is not None and w.info.host_id in siblings:
            siblings[w.info.host_id].append(w)
            if w.gauge is not None:
                rate = max(rate, w.gauge.prefill_tokens_per_s)
    for w in eligible:
        if w.gauge is not None:
            rate = max(rate, w.gauge.prefill_tokens_per_s)
    rate = rate or DEFAULT_SWAP_TOKENS_PER_S
    costs: dict[str, float] = {}
    blocked: set[str] = set()
    for w in eligible:
        info = w.info
        if info is None or not info.host_id:
            continue
        state = residency(w)
        if state == "resident":
            continue
        if state == "loading":
            g = w.gauge
            left = g.load_remaining_s if g is not None and g.residency == "loading" else info.load_s
            costs[w.worker_id] = left * rate
            continue
        resident = [_resident(s) for s in siblings[info.host_id] if s is not w and residency(s) in ("resident", "loading")]
        out = victims(resident, info.footprint_gib, info.host_memory_gib, [*pinned, w.model])
        if out is None:
            blocked.add(w.worker_id)
            costs[w.worker_id] = info.load_s * rate * EVICTION_FACTOR * 2
        else:
            costs[w.worker_id] = info.load_s * rate * (EVICTION_FACTOR if out else 1.0)
    return SwapCosts(costs, frozenset(blocked))


def _resident(w: FleetWorker) -> ResidentModel:
    g = w.gauge
    busy = residency(w) == "loading" or bool(w.placements) or (g is not None and (g.waiting or g.running) > 0)
    return ResidentModel(w.model, w.info.footprint_gib if w.info is not None else 0.0, busy=busy,
                         idle_s=g.idle_s if g is not None else 0.0)


class Demand:
    """Each model's request rate (an exponentially decayed count over ``window_s``)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._count: dict[str, tuple[float, float]] = {}  # model → (decayed count, at)

    def add(self, model: str, now: float) -> None:
        count, at = self._count.get(model, (0.0, now))
        self._count[model] = (count * math.exp(-(now - at) / self.window_s) + 1.0, now)

    def rates(self, now: float) -> dict[str, float]:
        return {m: c * math.exp(-(now - at) / self.window_s) / self.window_s for m, (c, at) in self._count.items()}

    def busiest(self, k: int, now: float, among: Iterable[str] | None = None) -> list[str]:
        rates = self.rates(now)
        if among is not None:
            keep = set(among)
            rates = {m: r for m, r in rates.items() if m in keep}
        return busiest(rates, k)
