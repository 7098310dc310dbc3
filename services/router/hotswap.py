"""The pinned set of hot-swap hosts (DESIGN.md, Many models per GPU): the fleet's busiest
hosted models, which no host evicts to load another. ``Demand`` is each model's request
rate, decayed exponentially, as the router places requests; the load costs themselves
are ``services.common.residency.swap_costs``, shared with admission.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.common.fleet import FleetView
from services.common.residency import busiest


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


def pinned_models(view: FleetView, demand: Demand, pin_top: int, now: float) -> list[str]:
    """The hosted models no host may evict (``RouterConfig.pin_top``): the busiest
    ``pin_top``, or with -1 every model requested at least once per its load time, up to
    as many as the hosts hold together."""
    memory: dict[str, float] = {}  # host → its memory
    footprints: dict[str, list[float]] = {}  # host → its entries' footprints
    load_s: dict[str, float] = {}  # model → its quickest load
    for w in view:
        info = w.info
        if info is not None and info.host_id:
            memory[info.host_id] = info.host_memory_gib
            footprints.setdefault(info.host_id, []).append(info.footprint_gib)
            load_s[w.model] = min(load_s.get(w.model, math.inf), info.load_s)
    if pin_top >= 0:
        return demand.busiest(pin_top, now, load_s)
    rates = demand.rates(now)
    slots = sum(int(memory[h] // (sum(f) / len(f))) for h, f in footprints.items() if sum(f) > 0)
    due = [m for m, t in load_s.items() if rates.get(m, 0.0) * t >= 1.0]
    return demand.busiest(slots, now, due)
