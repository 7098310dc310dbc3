"""Hot-swap residency: which models a host must evict to load another (DESIGN.md, Many
models per GPU).

A host process holds the models that fit its memory and loads others on demand. One
rule, used by the host when it loads and by the router when it prices a load (so the
router's prediction is the host's decision): evict the least recently used models that
are idle (no request running or waiting) and not pinned, until the new one fits. A
model in use is never evicted under its requests; a pinned one (the fleet's busiest,
named by the router) is never evicted at all, which stops a burst of quiet models from
pushing out the models most requests need (anti-thrash). Pure and synchronous.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fleet import FleetWorker

# Nothing can be evicted to make room: every resident model is busy or pinned.
NO_ROOM = None


@dataclass(frozen=True, slots=True)
class ResidentModel:
    """One model resident (or loading) on a host, as an eviction sees it."""

    model: str
    footprint_gib: float
    busy: bool  # requests running or waiting on it (a loading model is busy)
    idle_s: float = 0.0  # since its last request ended


def victims(resident: Sequence[ResidentModel], need_gib: float, capacity_gib: float,
            pinned: Collection[str] = ()) -> list[str] | None:
    """The models to evict, least recently used first, so ``need_gib`` more fits in
    ``capacity_gib``; [] when it fits already; None when it cannot fit by evicting idle,
    unpinned models (the load must wait for one to go idle, or go to another host)."""
    if need_gib > capacity_gib:
        return NO_ROOM
    free = capacity_gib - sum(r.footprint_gib for r in resident)
    if need_gib <= free + 1e-9:
        return []
    out: list[str] = []
    for r in sorted(evictable(resident, pinned), key=lambda r: -r.idle_s):
        out.append(r.model)
        free += r.footprint_gib
        if need_gib <= free + 1e-9:
            return out
    return NO_ROOM


def evictable(resident: Iterable[ResidentModel], pinned: Collection[str] = ()) -> list[ResidentModel]:
    return [r for r in resident if not r.busy and r.model not in pinned]


def idle_expired(resident: Iterable[ResidentModel], idle_unload_s: float, pinned: Collection[str] = ()) -> list[str]:
    """Models idle for ``idle_unload_s`` or more that are not pinned: unloaded to free
    the memory (scale to zero per model); 0 keeps every model until it is evicted."""
    if idle_unload_s <= 0:
        return []
    return [r.model for r in evictable(resident, pinned) if r.idle_s >= idle_unload_s]


def busiest(rates: dict[str, float], k: int) -> list[str]:
    """The ``k`` models with the highest request rates (ties by name): the pinned set."""
    if k <= 0:
        return []
    ranked = sorted(((r, m) for m, r in rates.items() if r > 0), key=lambda x: (-x[0], x[1]))
    return [m for _, m in ranked[:k]]


def residency(w: FleetWorker) -> str:
    """"resident", "loading" or "cold" for a hot-swap entry (placements not yet in a
    gauge make a cold entry loading); "" for a dedicated worker."""
    if w.info is None or not w.info.host_id:
        return ""
    state = w.gauge.residency if w.gauge is not None and w.gauge.residency else "cold"
    if state == "cold" and w.placements:
        return "loading"
    return state


def is_hosted(w: FleetWorker) -> bool:
    return w.info is not None and bool(w.info.host_id)
