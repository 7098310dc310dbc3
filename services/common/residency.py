"""Hot-swap residency: which models a host must evict to load another (DESIGN.md, Many
models per GPU).

A host process holds the models that fit its memory and loads others on demand. One
rule, used by the host when it loads and by the router when it prices a load (so the
router's prediction is the host's decision): evict the least recently used models that
are idle (no request running or waiting) and not pinned, until the new one fits. A
model in use is never evicted under its requests; a pinned one (the fleet's busiest,
named by the router) is never evicted at all, which stops a burst of quiet models from
pushing out the models most requests need (anti-thrash). Pure and synchronous.

Placement (``swap_costs``, read by the router and by admission): an entry whose model is
resident costs nothing extra; one loading costs the seconds its load has left; a cold
one costs the load's seconds, half as much again when the host must evict a model for it
(someone reloads that later), and cannot take the request at all while every model it
would have to evict is busy or pinned (``blocked``: the request would wait on a model's
requests to finish). Seconds become prefill tokens (the router's cost unit) at the
pool's measured prefill rate, so a model's traffic stays on its resident replicas until
their queues cost more than a load elsewhere, and a hot model spreads to more hosts as
its traffic grows. The forecast is the host's own rule applied to the entries' gauges,
with the placements the gauges do not show yet counted as work: a model just placed on
is loading and busy.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
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
    loading: bool = False


def victims(resident: Sequence[ResidentModel], need_gib: float, capacity_gib: float,
            pinned: Collection[str] = (), *, allow_busy: bool = False) -> list[str] | None:
    """The models to evict, least recently used first, so ``need_gib`` more fits in
    ``capacity_gib``; [] when it fits already; None when it cannot fit by evicting idle,
    unpinned models (the load must wait for one to go idle, or go to another host).

    ``allow_busy``: the models that will have to go once their requests end (idle ones
    first), so a host waiting for room can stop taking new work for them; None only when
    pinned and loading models leave no room at all."""
    if need_gib > capacity_gib:
        return NO_ROOM
    free = capacity_gib - sum(r.footprint_gib for r in resident)
    if need_gib <= free + 1e-9:
        return []
    out: list[str] = []
    for r in sorted(evictable(resident, pinned, allow_busy=allow_busy), key=lambda r: (r.busy, -r.idle_s)):
        out.append(r.model)
        free += r.footprint_gib
        if need_gib <= free + 1e-9:
            return out
    return NO_ROOM


# A load that has waited this long for room evicts pinned models too: pins stop thrash,
# they must not starve a quiet model's requests when every slot holds a pinned one.
PIN_PATIENCE_S = 10.0


def pins_honoured(pinned: Sequence[str], waited_s: float, patience_s: float = PIN_PATIENCE_S) -> list[str]:
    return list(pinned) if waited_s < patience_s else []


def evictable(resident: Iterable[ResidentModel], pinned: Collection[str] = (), *,
              allow_busy: bool = False) -> list[ResidentModel]:
    return [r for r in resident if (allow_busy or not r.busy) and not r.loading and r.model not in pinned]


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
    """A hot-swap entry's state: "resident", "evicting" (resident until its requests
    end), "loading" (under way, or due: requests wait for it, or placements a gauge does
    not show yet) or "cold"; "" for a dedicated worker."""
    if w.info is None or not w.info.host_id:
        return ""
    state = w.gauge.residency if w.gauge is not None and w.gauge.residency else "cold"
    if state == "cold" and (w.placements or (w.gauge is not None and w.gauge.waiting > 0)):
        return "loading"
    return state


# Prefill tokens per second a load's seconds are priced at before any gauge measured a
# rate (an 8B model on an H100 prefills ~12k tokens/s: profiles/llama-3.1-8b-h100).
DEFAULT_SWAP_TOKENS_PER_S = 10_000.0
EVICTION_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class SwapCosts:
    costs: dict[str, float]  # worker id → tokens its model's load costs (resident: absent)
    blocked: frozenset[str]  # cold entries whose host cannot make room now
    # host id → the pinned models it must keep: each pinned model on one host only (the
    # first by id of those holding it), so the replicas a hot model spread to stay
    # evictable and no host can end up with every slot pinned by copies of the busiest
    pins: dict[str, tuple[str, ...]] = field(default_factory=dict)


def swap_costs(eligible: Sequence[FleetWorker], fleet: Iterable[FleetWorker], pinned: Sequence[str]) -> SwapCosts:
    """Load costs of the hot-swap entries among ``eligible``; ``fleet``: every worker
    the view holds (each entry's host siblings are among them); ``pinned``: the models
    kept resident (see ``SwapCosts.pins``)."""
    hosts = {w.info.host_id for w in eligible if w.info is not None and w.info.host_id}
    if not hosts:
        return SwapCosts({}, frozenset())
    siblings: dict[str, list[FleetWorker]] = {h: [] for h in hosts}
    wanted = set(pinned)
    keeper: dict[str, str] = {}  # pinned model → the host that keeps it
    rate = 0.0
    for w in fleet:
        info = w.info
        if info is None or not info.host_id:
            continue
        if info.host_id in siblings:
            siblings[info.host_id].append(w)
            if w.gauge is not None:
                rate = max(rate, w.gauge.prefill_tokens_per_s)
        if w.model in wanted and residency(w) in ("resident", "loading"):
            keeper[w.model] = min(keeper.get(w.model, info.host_id), info.host_id)
    for w in eligible:
        if w.gauge is not None:
            rate = max(rate, w.gauge.prefill_tokens_per_s)
    rate = rate or DEFAULT_SWAP_TOKENS_PER_S
    pins: dict[str, tuple[str, ...]] = {}
    for model, host in sorted(keeper.items()):
        pins[host] = (*pins.get(host, ()), model)
    costs: dict[str, float] = {}
    blocked: set[str] = set()
    for w in eligible:
        info = w.info
        if info is None or not info.host_id:
            continue
        state = residency(w)
        if state == "resident":
            continue
        if state == "evicting":  # resident until its requests end, then gone: prefer elsewhere
            costs[w.worker_id] = info.load_s * rate
            continue
        if state == "loading":
            costs[w.worker_id] = load_left(w) * rate
            continue
        resident = [_resident(s) for s in siblings[info.host_id] if s is not w and residency(s) != "cold"]
        # loads run one at a time per host: this one starts after those under way
        ahead = sum(load_left(s) for s in siblings[info.host_id] if s is not w and residency(s) == "loading")
        keep = [*pins.get(info.host_id, ()), w.model]
        out = victims(resident, info.footprint_gib, info.host_memory_gib, keep)
        if out is None:
            # Room only once busy models' requests end (the host stops feeding them), or never.
            if victims(resident, info.footprint_gib, info.host_memory_gib, keep, allow_busy=True) is None:
                blocked.add(w.worker_id)
            costs[w.worker_id] = (ahead + info.load_s * EVICTION_FACTOR * 2) * rate
        else:
            costs[w.worker_id] = (ahead + info.load_s * (EVICTION_FACTOR if out else 1.0)) * rate
    return SwapCosts(costs, frozenset(blocked), pins)


def load_left(w: FleetWorker) -> float:
    """Seconds a loading entry's load has left (a placement not yet in a gauge: all of it)."""
    g = w.gauge
    if g is not None and g.residency == "loading":
        return g.load_remaining_s
    return w.info.load_s if w.info is not None else 0.0


def _resident(w: FleetWorker) -> ResidentModel:
    g = w.gauge
    loading = residency(w) == "loading"
    busy = loading or bool(w.placements) or (g is not None and (g.waiting or g.running) > 0)
    return ResidentModel(w.model, w.info.footprint_gib if w.info is not None else 0.0, busy=busy,
                         idle_s=g.idle_s if g is not None else 0.0, loading=loading)
