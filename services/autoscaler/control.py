"""The autoscaler's control law (DESIGN.md, Autoscaling): pure, synchronous, clock injected.

One call per pool per tick: ``step(policy, state, observation, now)`` returns a
``ScaleDecision`` (what to do, and why, with every signal it used) and the next ``PoolState``.
The async shell feeds it the latest gauge of each live worker of the pool, actuates the
decision through a driver, and shows the decisions in ``meshserve status``.

The law
    target = clamp(max(needed, needed_prefill) + warm_buffer, floor, max)
    needed = ceil((waiting_tokens + running_tokens) / target_utilization / replica_token_capacity)
    needed_prefill = ceil(prefill_demand / target_utilization / replica_prefill_capacity)
where floor = max(min_replicas, the time-of-day minimum). Queue load is a leading
signal: tokens waiting now are work a replica must hold soon.

Two resources bind a replica, and ``needed`` sees only one: memory (the tokens it holds
in KV). Prefill is compute: a replica whose KV has room still falls behind when prompt
tokens arrive faster than it computes them, and its queue (and TTFT) grows while its KV
reads half empty. ``needed_prefill`` is the planner's ⌈λ / (ρ·μ)⌉ in prompt tokens: the
demand is what the replicas computed (the gauges' ``prefill_tokens_total``, cumulative)
plus the change of the queue, over the last ``demand_window_s`` (20 s: a steady rate is
read whole one window after it starts; one 128k-token prompt is 6.4k tokens/s); the
capacity is the replicas' prefill tokens per busy second (their mean: an upper bound). A queue
that does not drain shows as demand above what the replicas compute. A backlog alone is
not counted: a request already queued on a replica stays there, so replicas added for it
serve only later ones (one 128k-token prompt would otherwise call several). An idle pool
needs none for prefill (the window's tail must not hold it from zero). A queue at nearly
every tick for a whole window at one size adds one replica whatever the figures say, and
teaches ``PrefillDemand.ceiling``: the figures miss what decodes take between prefills.

Hysteresis
    Scale up at once, to the target. Scale down only to the highest target seen over the
    last ``scale_down_cooldown_s`` (a stabilisation window, as Kubernetes' HPA does it):
    a lower target must have held for the whole cooldown, so input that flaps faster than
    the cooldown leaves the fleet at its high level. Scale-down drains one replica at a
    time (the one with the least work in flight) and the next waits until that drain is
    over, so at most one scale-down is in progress per pool.

Capacity (tokens a replica holds at saturation) is measured, never guessed once it can be:
    - a replica with requests waiting while it runs is saturated: its ``running_tokens``
      is a direct sample of its capacity, whatever limit it hit (KV blocks, max_num_seqs).
      Where the shell knows a replica's ``max_num_seqs`` it also requires that a limit
      was hit (that many running, or the KV at ``saturation_kv_usage``): gauges are
      published as requests arrive, so a new arrival waiting for the next engine step
      shows ``waiting > 0`` on an almost idle replica, which is no saturation;
    - any replica whose KV is in use gives ``running_tokens / kv_usage``, the tokens it
      would hold with its KV full: a ceiling, since a replica may saturate before its KV;
    - whatever a replica holds right now is a floor.
    Both samples are smoothed with time-constant EWMAs (irregular ticks weigh by elapsed
    time). The estimate is the smaller of the two measured figures (saturation can only
    come at or before a full KV), raised to the floor; the configured initial value is
    used only until the first sample. A low estimate over-provisions, the safe side.
    Prefill/decode throughput from the gauges is reported with each decision (and the
    time the queue needs to drain at the measured prefill rate) for the operator; the
    law itself works in tokens held, because that is what ``running_tokens`` measures.

Scale to zero (``min_replicas == 0``)
    An idle pool (no waiting, running or pending tokens) keeps one replica until it has
    been idle for ``idle_to_zero_s``, then goes to zero; the warm buffer does not keep an
    idle zero-able pool warm. Requests waiting for a pool with no replicas (a signal the
    shell provides: ``pending_requests``) bring it to at least one at once, and the
    decision records that a cold start was triggered.

Time of day
    ``schedule`` raises the floor during windows of local time in an explicit zone;
    ``prescale_lead_s`` starts each window that much early, so a known daily peak finds
    its replicas already warm despite cold starts of minutes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal
from zoneinfo import ZoneInfo

from proto.workers import WorkerGauge
from services.common.smoothing import ewma

from .prefill import PrefillDemand

Action = Literal["scale_up", "scale_down", "hold"]
CapacitySource = Literal["initial", "saturated", "kv_extrapolated", "observed_floor"]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ScheduleWindow:
    """A minimum replica count during [start_hour, end_hour) local time, every day.

    ``end_hour < start_hour`` wraps past midnight; ``start_hour == end_hour`` is all day.
    Fractional hours are allowed (8.5 is 08:30).
    """

    start_hour: float
    end_hour: float
    min_replicas: int

    def __post_init__(self) -> None:
        if not (0 <= self.start_hour <= 24 and 0 <= self.end_hour <= 24):
            raise ValueError("schedule hours must lie in [0, 24]")
        if self.min_replicas < 0:
            raise ValueError("schedule minimum must be ≥ 0")

    def active(self, hour: float) -> bool:
        start, end = self.start_hour % 24, self.end_hour % 24
        if start == end:
            return True
        if start < end:
            return start <= hour < end
        return hour >= start or hour < end


@dataclass(frozen=True)
class PoolPolicy:
    pool: str  # the model name the pool serves
    min_replicas: int = 1  # 0 allows scale to zero
    max_replicas: int = 8
    target_utilization: float = 0.75
    warm_buffer: int = 0  # spare replicas kept ready: cold starts take minutes on GPUs
    scale_down_cooldown_s: float = 300.0
    idle_to_zero_s: float = 900.0  # only with min_replicas == 0
    initial_replica_token_capacity: float = 65_536.0  # until gauges measure it
    capacity_time_constant_s: float = 60.0  # EWMA time constant of the capacity samples
    min_kv_usage_for_estimate: float = 0.1  # below it running/kv_usage is block-rounding noise
    drain_ack_timeout_s: float = 30.0  # a drain the worker never showed is considered lost
    saturation_kv_usage: float = 0.9  # KV this full with requests waiting: at its limit
    schedule: tuple[ScheduleWindow, ...] = ()
    timezone: str = "UTC"  # IANA name the schedule's hours are in
    prescale_lead_s: float = 0.0  # start scheduled minimums this early
    demand_window_s: float = 20.0  # the prefill demand is what arrived over this long (needed_prefill)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 ≤ min_replicas ≤ max_replicas and max_replicas ≥ 1")
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization must be in (0, 1]")
        if self.warm_buffer < 0 or self.scale_down_cooldown_s < 0 or self.idle_to_zero_s < 0:
            raise ValueError("warm_buffer, cooldown and idle period must be ≥ 0")
        if self.initial_replica_token_capacity <= 0 or self.capacity_time_constant_s <= 0:
            raise ValueError("initial capacity and its time constant must be positive")
        if self.demand_window_s <= 0:
            raise ValueError("the prefill demand's window must be positive")
        if any(w.min_replicas > self.max_replicas for w in self.schedule):
            raise ValueError("a scheduled minimum exceeds max_replicas")
        ZoneInfo(self.timezone)  # fail at configuration time, not at 08:00

    def scheduled_min(self, now: float) -> int:
        """The time-of-day minimum at ``now`` (or ``prescale_lead_s`` ahead of it)."""
        if not self.schedule:
            return 0
        zone = ZoneInfo(self.timezone)
        hours = {_local_hour(now, zone), _local_hour(now + self.prescale_lead_s, zone)}
        return max((w.min_replicas for w in self.schedule if any(w.active(h) for h in hours)), default=0)


def _local_hour(ts: float, zone: ZoneInfo) -> float:
    t = datetime.fromtimestamp(ts, zone)
    return t.hour + t.minute / 60 + t.second / 3600


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PoolObservation:
    """What the shell knows about one pool at one tick."""

    gauges: Sequence[WorkerGauge] = ()  # the latest gauge of each live worker (draining too)
    starting: int = 0  # replicas launched that have not reported a gauge yet
    pending_requests: int = 0  # requests waiting for this pool with no replica to take them
    pending_tokens: int = 0  # their prompt tokens, if known
    max_num_seqs: Mapping[str, int] = field(default_factory=dict)  # worker id → its limit, if known
    # Workers someone else started (by hand, another orchestrator): they count as capacity,
    # and are never drained (nothing here could start them again).
    unmanaged: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- capacity


@dataclass(frozen=True)
class CapacityEstimate:
    saturated: float | None = None  # EWMA of running_tokens on saturated replicas
    saturated_at: float | None = None
    kv_full: float | None = None  # EWMA of running_tokens / kv_usage
    kv_full_at: float | None = None
    samples: int = 0

    def value(self, initial: float, floor: float = 0.0) -> tuple[float, CapacitySource]:
        measured = [x for x in (self.saturated, self.kv_full) if x is not None]
        if measured:
            base = min(measured)
            source: CapacitySource = "saturated" if base == self.saturated else "kv_extrapolated"
        else:
            base, source = initial, "initial"
        if floor > base:
            return floor, "observed_floor"
        return base, source


def is_saturated(g: WorkerGauge, max_num_seqs: int = 0, kv_full: float = 0.9) -> bool:
    """Requests wait while others run: the replica took all it could hold.

    With its ``max_num_seqs`` known, only when it hit a limit: a request that arrived
    just before the gauge waits for the next step on any replica, however idle.
    """
    if not (g.waiting > 0 and g.running > 0 and g.running_tokens > 0):
        return False
    return max_num_seqs <= 0 or g.running >= max_num_seqs or g.kv_usage >= kv_full


def update_capacity(
    est: CapacityEstimate,
    gauges: Sequence[WorkerGauge],
    now: float,
    policy: PoolPolicy,
    max_num_seqs: Mapping[str, int] | None = None,
) -> CapacityEstimate:
    live = [g for g in gauges if not g.draining]
    limits = max_num_seqs or {}
    sat = [
        float(g.running_tokens)
        for g in live
        if is_saturated(g, limits.get(g.worker_id, 0), policy.saturation_kv_usage)
    ]
    kv = [
        g.running_tokens / g.kv_usage
        for g in live
        if g.kv_usage >= policy.min_kv_usage_for_estimate and g.running_tokens > 0
    ]
    tau = policy.capacity_time_constant_s
    if sat:
        s = sum(sat) / len(sat)
        est = replace(est, saturated=ewma(est.saturated, est.saturated_at, s, now, tau), saturated_at=now)
    if kv:
        k = sum(kv) / len(kv)
        est = replace(est, kv_full=ewma(est.kv_full, est.kv_full_at, k, now, tau), kv_full_at=now)
    if sat or kv:
        est = replace(est, samples=est.samples + 1)
    return est


# --------------------------------------------------------------------------- drain choice


def choose_drain_victim(gauges: Sequence[WorkerGauge], exclude: Sequence[str] = ()) -> str | None:
    """The replica with the least work in flight, never one already draining.

    Work is counted in tokens (held plus queued for prefill), as the router balances;
    requests in flight break ties, then the worker id, so the choice is deterministic.
    """
    candidates = [g for g in gauges if not g.draining and g.worker_id not in exclude]
    if not candidates:
        return None
    best = min(
        candidates,
        key=lambda g: (g.running_tokens + g.queued_prefill_tokens, g.running + g.waiting, g.worker_id),
    )
    return best.worker_id


# --------------------------------------------------------------------------- state and decision


@dataclass(frozen=True)
class PoolState:
    started_at: float | None = None  # first tick: the window covers a full cooldown only after it
    # Sliding-window maximum of targets over the cooldown: (in effect until, target) pairs
    # with strictly decreasing targets, so the front is the window's maximum (a monotonic
    # queue: a few entries however many ticks the cooldown spans).
    window: tuple[tuple[float, int], ...] = ()
    last_busy: float | None = None
    drain_worker: str | None = None  # the scale-down this controller issued, until it ends
    drain_issued_at: float | None = None
    capacity: CapacityEstimate = field(default_factory=CapacityEstimate)
    prefill: PrefillDemand = field(default_factory=lambda: PrefillDemand())


@dataclass(frozen=True)
class Signals:
    waiting_tokens: int  # queued prefill tokens on ready replicas + pending tokens
    running_tokens: int
    pending_requests: int
    replica_token_capacity: float
    capacity_source: CapacitySource
    target_utilization: float
    needed: int  # ceil(load / utilisation / capacity), before buffer and bounds
    warm_buffer: int
    floor: int  # max(min_replicas, scheduled minimum)
    scheduled_min: int
    max_replicas: int
    window_max: int  # the highest target over the cooldown window
    cooldown_remaining_s: float  # until a lower target may act (0 when it may)
    idle_s: float
    starting: int
    draining: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    queue_drain_s: float | None  # waiting tokens / measured prefill rate
    prefill_demand_tokens_per_s: float | None = None  # prompt tokens arriving a second (smoothed)
    needed_prefill: int = 0  # replicas the prefill demand needs
    replica_prefill_capacity: float = 0.0  # what a replica computes with a queue (else its busy-second rate)
    backed_up: bool = False  # a queue at nearly every tick for a whole window at this size


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    at: float
    current: int  # ready + starting (draining replicas are leaving and not counted)
    ready: int
    desired: int  # the size the controller holds the pool at after hysteresis
    target: int  # the law's instantaneous output
    action: Action
    count: int  # replicas to start (scale_up) or drain (scale_down, always 1)
    drain_worker: str | None
    cold_start: bool
    reason: str
    signals: Signals


def _push_window(
    window: tuple[tuple[float, int], ...], now: float, target: int, horizon: float
) -> tuple[tuple[float, int], ...]:
    entries = list(window)
    if entries:
        # Ticks are samples of a target that holds until the next tick: the last one was
        # in effect until now, so a high target counts for as long as it lasted.
        entries[-1] = (now, entries[-1][1])
    kept = [(t, v) for t, v in entries if t > now - horizon and v > target]
    kept.append((now, target))
    return tuple(kept)


def step(
    policy: PoolPolicy, state: PoolState, obs: PoolObservation, now: float
) -> tuple[ScaleDecision, PoolState]:
    """One tick of the control law for one pool. Pure: the same inputs give the same outputs."""
    gauges = list(obs.gauges)

    # Is a scale-down in progress? Ours lasts until the worker deregisters; a drain the
    # worker never acknowledged (no draining flag within the timeout) was lost.
    drain_worker, drain_issued_at = state.drain_worker, state.drain_issued_at
    if drain_worker is not None:
        g = next((g for g in gauges if g.worker_id == drain_worker), None)
        issued = now if drain_issued_at is None else drain_issued_at
        lost = g is not None and not g.draining and now - issued > policy.drain_ack_timeout_s
        if g is None or lost:
            drain_worker = drain_issued_at = None
    draining_ids = {g.worker_id for g in gauges if g.draining}
    if drain_worker is not None:
        draining_ids.add(drain_worker)
    live = [g for g in gauges if g.worker_id not in draining_ids]
    ready = len(live)
    current = ready + obs.starting

    # Signals from the replicas that stay: a draining replica's load leaves with it.
    waiting_tokens = sum(g.queued_prefill_tokens for g in live) + obs.pending_tokens
    running_tokens = sum(g.running_tokens for g in live)
    load = waiting_tokens + running_tokens
    busy = load > 0 or obs.pending_requests > 0 or any(g.running or g.waiting for g in live)
    prefill_rate = sum(g.prefill_tokens_per_s for g in live)
    decode_rate = sum(g.decode_tokens_per_s for g in live)

    capacity_est = update_capacity(state.capacity, live, now, policy, obs.max_num_seqs)
    # Every replica's queue and count, draining ones too: the two must cover the same ones.
    queued_all = sum(g.queued_prefill_tokens for g in gauges) + obs.pending_tokens
    # The pool keeps a queue when at least half its replicas do (any one of several has a
    # short one often at 80 % load); one waiting for a model's load is no compute's queue.
    computing = [g for g in live if g.residency not in ("cold", "loading")]
    queued_replicas = sum(1 for g in computing if g.queued_prefill_tokens > 0)
    computing_queue = obs.pending_tokens > 0 or (queued_replicas > 0 and 2 * queued_replicas >= len(computing))
    prefill = state.prefill.update(gauges, queued_all, now, policy.demand_window_s, size=current,
                                   computing_queue=computing_queue)
    backed_up = prefill.backed_up(now, policy.demand_window_s)
    if backed_up and busy:
        prefill = prefill.learn_ceiling(now, ready)
    measured = [g.prefill_tokens_per_s for g in live if g.prefill_tokens_per_s > 0]
    needed_prefill = 0
    # The replicas' prefill tokens per busy second of prefill steps: an upper bound (it leaves
    # out the decode steps between them), so the term sizes low, never below memory's, until
    # a queue teaches a ceiling. (Per tick what a queued replica computed was tried: a sim or
    # vLLM counts a step's prompt tokens at one end of it, and ticks inside long steps read
    # from nothing to several times the rate, which called a second replica at 10 % load.)
    per_replica = sum(measured) / len(measured) if measured else 0.0
    ceiling = prefill.ceiling_now(now)
    if ceiling is not None and per_replica > 0:
        per_replica = min(per_replica, ceiling)
    if per_replica > 0 and busy and prefill.tokens_per_s > 0:
        needed_prefill = math.ceil(prefill.tokens_per_s / policy.target_utilization / per_replica - 1e-9)
    if backed_up and busy:
        needed_prefill = max(needed_prefill, current + 1)  # one more, then a window to see it work
    held = max((float(g.running_tokens) for g in live), default=0.0)
    capacity, source = capacity_est.value(policy.initial_replica_token_capacity, floor=held)

    started_at = state.started_at if state.started_at is not None else now
    last_busy = now if busy or state.last_busy is None else state.last_busy
    idle_s = now - last_busy

    scheduled = policy.scheduled_min(now)
    floor = max(policy.min_replicas, scheduled)
    needed = math.ceil(load / policy.target_utilization / capacity) if load > 0 else 0
    if obs.pending_requests > 0:
        needed = max(needed, 1)
    binding = max(needed, needed_prefill)
    if floor == 0 and binding == 0:
        # Idle zero-able pool: keep the last replica until the idle period is over.
        target = 0 if idle_s >= policy.idle_to_zero_s else min(1, current)
    else:
        target = min(max(binding + policy.warm_buffer, floor), policy.max_replicas)

    cooldown = policy.scale_down_cooldown_s
    window = _push_window(state.window, now, target, cooldown)
    window_max = window[0][1]
    # Going to zero: the idle period is that step's hysteresis, not the cooldown.
    to_zero = target == 0 and floor == 0 and window_max <= 1
    down_to = 0 if to_zero else window_max
    # A lower target acts once it has held for a whole cooldown: no target ≥ current in
    # the window, and the window covers a full cooldown of observations.
    covered = now - started_at >= cooldown or to_zero
    cooldown_remaining = 0.0
    if target < current:
        above = [t for t, v in window if v >= current]
        since = max(above) if above and not to_zero else started_at
        cooldown_remaining = 0.0 if to_zero else max(0.0, since + cooldown - now)

    signals = Signals(
        waiting_tokens=waiting_tokens,
        running_tokens=running_tokens,
        pending_requests=obs.pending_requests,
        replica_token_capacity=capacity,
        capacity_source=source,
        target_utilization=policy.target_utilization,
        needed=needed,
        warm_buffer=policy.warm_buffer,
        floor=floor,
        scheduled_min=scheduled,
        max_replicas=policy.max_replicas,
        window_max=window_max,
        cooldown_remaining_s=cooldown_remaining,
        idle_s=idle_s,
        starting=obs.starting,
        draining=len(draining_ids),
        prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate,
        queue_drain_s=waiting_tokens / prefill_rate if prefill_rate > 0 and waiting_tokens > 0 else None,
        prefill_demand_tokens_per_s=None if prefill.rate is None else prefill.tokens_per_s,
        needed_prefill=needed_prefill,
        replica_prefill_capacity=per_replica,
        backed_up=backed_up,
    )

    def clamp(n: int) -> int:
        return min(max(n, policy.min_replicas), policy.max_replicas)

    action: Action = "hold"
    count = 0
    victim: str | None = None
    cold_start = False
    load_text = (
        f"load {load:,} tokens ({waiting_tokens:,} waiting + {running_tokens:,} running) "
        f"/ {policy.target_utilization:.0%} / {capacity:,.0f} per replica ({source})"
    )
    # Within the cooldown the pool stays at its highest recent target: a replica lost to a
    # crash is started again (else a crash would be a scale-down with no cooldown).
    up_to = target if to_zero else max(target, window_max)
    if up_to > current:
        action, count, desired = "scale_up", up_to - current, up_to
        cold_start = current == 0
        if target >= up_to:
            why = _up_reason(signals, policy, target, scheduled, load_text, current)
        else:
            why = (f"replacing a lost replica: the highest target of the last {cooldown:,.0f} s is {window_max} "
                   f"(now {target}; a lower target must hold a whole cooldown)")
        reason = f"scale up {current} → {up_to}: {why}"
        if cold_start:
            reason = f"cold start: {reason}"
    elif down_to < current and covered:
        desired = clamp(down_to)
        if len(draining_ids) > 0:
            who = sorted(draining_ids)[0]
            reason = f"hold {current}: scale-down to {desired} waits for {who} to finish draining"
        else:
            victim = choose_drain_victim(live, exclude=tuple(obs.unmanaged))
            if victim is None:
                ours = "none of the ready replicas is ours to drain" if live else "no ready replica to drain yet"
                reason = f"hold {current}: scale-down to {desired} waits, {ours}"
            else:
                action, count = "scale_down", 1
                drain_worker, drain_issued_at = victim, now
                if to_zero:
                    why = f"idle for {idle_s:,.0f} s ≥ {policy.idle_to_zero_s:,.0f} s, scaling to zero"
                else:
                    why = f"targets ≤ {window_max} for the last {cooldown:,.0f} s; {load_text}"
                reason = f"scale down {current} → {current - 1} (toward {desired}): drain {victim}, {why}"
    else:
        desired = clamp(current)
        if target < current:
            reason = (
                f"hold {current}: target {target} must hold {cooldown_remaining:,.0f} s more "
                f"(cooldown {cooldown:,.0f} s, highest recent target {window_max}); {load_text}"
            )
        else:
            reason = f"hold {current}: at target; {load_text}"
        if ready == 0 and obs.starting > 0:
            reason = f"{reason}; cold start in progress ({obs.starting} starting)"

    new_state = PoolState(
        started_at=started_at,
        window=window,
        last_busy=last_busy,
        drain_worker=drain_worker,
        drain_issued_at=drain_issued_at,
        capacity=capacity_est,
        prefill=prefill,
    )
    decision = ScaleDecision(
        pool=policy.pool,
        at=now,
        current=current,
        ready=ready,
        desired=desired,
        target=target,
        action=action,
        count=count,
        drain_worker=victim,
        cold_start=cold_start,
        reason=reason,
        signals=signals,
    )
    return decision, new_state


def _up_reason(s: Signals, policy: PoolPolicy, target: int, scheduled: int, load_text: str, current: int) -> str:
    parts = []
    if s.pending_requests > 0:
        parts.append(f"{s.pending_requests} request(s) waiting with no replica to take them")
    binding = max(s.needed, s.needed_prefill)
    if target == scheduled and scheduled > max(binding + policy.warm_buffer, policy.min_replicas):
        parts.append(f"time-of-day minimum {scheduled} ({policy.timezone})")
    elif target == policy.min_replicas and binding + policy.warm_buffer < policy.min_replicas:
        parts.append(f"minimum {policy.min_replicas}")
    elif s.needed_prefill > s.needed and s.backed_up and s.needed_prefill == current + 1:
        parts.append(f"needed {s.needed_prefill} for prefill: a queue for the last {policy.demand_window_s:g} s at "
                     f"{current} replica(s), arrivals outrun them (memory needs {s.needed}; {load_text})")
    elif s.needed_prefill > s.needed:
        demand = s.prefill_demand_tokens_per_s or 0.0
        parts.append(
            f"needed {s.needed_prefill} for prefill + warm buffer {policy.warm_buffer}: {demand:,.0f} prompt tokens/s"
            f" arriving / {policy.target_utilization:.0%} / {s.replica_prefill_capacity:,.0f} per replica"
            f" (memory needs {s.needed}; {load_text})")
    else:
        parts.append(f"needed {s.needed} + warm buffer {policy.warm_buffer}; {load_text}")
        if s.queue_drain_s is not None:
            parts.append(
                f"queue drains in {s.queue_drain_s:,.1f} s at {s.prefill_tokens_per_s:,.0f} prefill tokens/s"
            )
    return "; ".join(parts)


class PoolController:
    """``step`` with its state kept: what the async shell holds per pool."""

    def __init__(self, policy: PoolPolicy, state: PoolState | None = None) -> None:
        self.policy = policy
        self.state = state or PoolState()

    def decide(self, observation: PoolObservation, now: float) -> ScaleDecision:
        decision, self.state = step(self.policy, self.state, observation, now)
        return decision
