"""The autoscaler's control law with a fake clock: every ``now`` is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.workers import WorkerGauge
from services.autoscaler.control import (
    CapacityEstimate,
    PoolController,
    PoolObservation,
    PoolPolicy,
    ScaleDecision,
    ScheduleWindow,
    choose_drain_victim,
    update_capacity,
)

CAP = 10_000  # tokens a simulated replica holds with its KV full


def replica(
    wid: str,
    held: int = 0,
    queued: int = 0,
    *,
    cap: int = CAP,
    draining: bool = False,
    waiting: int | None = None,
) -> WorkerGauge:
    """A gauge consistent with a replica whose KV holds ``cap`` tokens."""
    if waiting is None:
        waiting = 1 if queued else 0
    return WorkerGauge(
        worker_id=wid,
        model="m",
        ts=0.0,
        running=held // 1000,
        waiting=waiting,
        running_tokens=held,
        queued_prefill_tokens=queued,
        kv_usage=held / cap,
        prefill_tokens_per_s=5000.0,
        decode_tokens_per_s=1000.0,
        draining=draining,
    )


def policy(**kw: object) -> PoolPolicy:
    base: dict[str, object] = {
        "pool": "m",
        "min_replicas": 1,
        "max_replicas": 10,
        "target_utilization": 0.75,
        "scale_down_cooldown_s": 300.0,
        "initial_replica_token_capacity": float(CAP),
    }
    base.update(kw)
    return PoolPolicy(**base)  # type: ignore[arg-type]


@dataclass
class Fleet:
    """A simulated pool: replicas start after ``start_s`` and leave ``drain_s`` after a drain.

    Its gauges show a drain only from the tick after it was issued, as real gauges lag.
    """

    start_s: float = 60.0
    drain_s: float = 45.0
    starting: list[float] = field(default_factory=list)  # ready times
    ready: list[str] = field(default_factory=list)
    draining: dict[str, float] = field(default_factory=dict)  # id → issued at
    next_id: int = 0

    def add_ready(self, n: int) -> None:
        for _ in range(n):
            self.ready.append(f"w{self.next_id:02d}")
            self.next_id += 1

    def advance(self, now: float) -> None:
        due = [t for t in self.starting if t <= now]
        self.starting = [t for t in self.starting if t > now]
        self.add_ready(len(due))
        for wid, at in list(self.draining.items()):
            if now - at >= self.drain_s:
                del self.draining[wid]

    def observe(self, now: float, load: int, pending: int = 0) -> PoolObservation:
        self.advance(now)
        live = [w for w in self.ready if w not in self.draining]
        gauges = []
        per = load // len(live) if live else 0
        for w in live:
            held = min(per, CAP)
            gauges.append(replica(w, held, per - held))
        for w, at in self.draining.items():
            gauges.append(replica(w, 0, draining=at < now))
        pending_requests = pending if not live else 0
        return PoolObservation(gauges=gauges, starting=len(self.starting), pending_requests=pending_requests)

    def apply(self, d: ScaleDecision, now: float) -> None:
        if d.action == "scale_up":
            self.starting += [now + self.start_s] * d.count
        elif d.action == "scale_down":
            assert d.drain_worker is not None
            self.ready.remove(d.drain_worker)
            self.draining[d.drain_worker] = now

    @property
    def size(self) -> int:
        return len(self.ready) + len(self.starting)


def run(ctl: PoolController, fleet: Fleet, now: float, load: int, pending: int = 0) -> ScaleDecision:
    d = ctl.decide(fleet.observe(now, load, pending), now)
    fleet.apply(d, now)
    return d


# --------------------------------------------------------------------------- step up


def test_step_up_is_immediate_and_counts_starting_replicas() -> None:
    ctl = PoolController(policy())
    # Two full replicas with 20k tokens queued each: 60k / 0.75 / 10k = 8.
    obs = PoolObservation(gauges=[replica("a", CAP, 20_000), replica("b", CAP, 20_000)])
    d = ctl.decide(obs, now=0.0)
    assert (d.action, d.current, d.target, d.desired, d.count) == ("scale_up", 2, 8, 8, 6)
    assert d.signals.waiting_tokens == 40_000 and d.signals.running_tokens == 20_000
    assert d.signals.replica_token_capacity == CAP
    assert d.reason.startswith("scale up 2 → 8")
    assert not d.cold_start
    # The six it started count as current while they boot: no second scale-up.
    d = ctl.decide(PoolObservation(gauges=obs.gauges, starting=6), now=5.0)
    assert (d.action, d.current, d.count) == ("hold", 8, 0)


def test_warm_buffer_and_max_clamp() -> None:
    ctl = PoolController(policy(warm_buffer=2, max_replicas=5))
    d = ctl.decide(PoolObservation(gauges=[replica("a", 3000)]), now=0.0)
    assert (d.signals.needed, d.target) == (1, 3)  # ceil(3000/0.75/10000) + 2
    d = ctl.decide(PoolObservation(gauges=[replica("a", CAP, 500_000)], starting=2), now=1.0)
    assert d.signals.needed > 5 and d.target == d.desired == 5 and d.count == 2


# --------------------------------------------------------------------------- step down


def test_step_down_waits_for_the_cooldown_then_drains_the_least_loaded() -> None:
    ctl = PoolController(policy(scale_down_cooldown_s=300.0))
    high = [replica(w, 7_000) for w in ("a", "b", "c", "d")]  # 28k / 0.75 / 10k → 4
    assert ctl.decide(PoolObservation(gauges=high), now=0.0).action == "hold"
    low = [replica("a", 600), replica("b", 200), replica("c", 900), replica("d", 400)]  # → 1
    for t in range(100, 400, 10):
        d = ctl.decide(PoolObservation(gauges=low), now=float(t))
        assert d.action == "hold", t
        assert d.target == 1 and d.desired == 4
    # The high target held until the tick at t = 100, so at t = 390 10 s are left.
    assert "must hold 10 s more" in d.reason
    d = ctl.decide(PoolObservation(gauges=low), now=400.0)
    assert (d.action, d.count, d.drain_worker) == ("scale_down", 1, "b")
    assert d.desired == 1 and "scale down 4 → 3" in d.reason


def test_cooldown_counts_from_the_last_high_target() -> None:
    ctl = PoolController(policy(scale_down_cooldown_s=300.0))
    high = [replica(w, 7_000) for w in "abcd"]
    low = [replica(w, 300) for w in "abcd"]
    for t in (0, 100, 200):
        ctl.decide(PoolObservation(gauges=high), now=float(t))
    # A brief return of the load at t = 250 (until the next tick, 260) restarts the cooldown.
    ctl.decide(PoolObservation(gauges=low), now=240.0)
    ctl.decide(PoolObservation(gauges=high), now=250.0)
    for t in range(260, 560, 10):
        assert ctl.decide(PoolObservation(gauges=low), now=float(t)).action == "hold"
    assert ctl.decide(PoolObservation(gauges=low), now=560.0).action == "scale_down"


def test_a_replica_lost_within_the_cooldown_is_started_again() -> None:
    """A crash took the pool below its highest recent target, and nothing replaced it: a
    scale-down with no cooldown. Within the cooldown the pool stays at that target."""
    ctl = PoolController(policy(scale_down_cooldown_s=300.0))
    high = [replica(w, 7_000) for w in "abcd"]  # → 4
    assert ctl.decide(PoolObservation(gauges=high), now=0.0).action == "hold"
    low = [replica(w, 300) for w in "abc"]  # d crashed; the load fell to a target of 1
    d = ctl.decide(PoolObservation(gauges=low), now=100.0)
    assert (d.action, d.count, d.desired) == ("scale_up", 1, 4) and "replacing a lost replica" in d.reason
    # once the low target held a whole cooldown, it scales down as before
    ctl.decide(PoolObservation(gauges=low, starting=1), now=110.0)
    four = [*low, replica("e", 300)]
    for t in range(120, 400, 10):
        assert ctl.decide(PoolObservation(gauges=four), now=float(t)).action == "hold", t
    assert ctl.decide(PoolObservation(gauges=four), now=400.0).action == "scale_down"


def test_a_worker_started_by_someone_else_is_never_drained() -> None:
    """It counts as capacity, but nothing here could start it again: the autoscaler drained
    a hand-started worker within a second of it joining (it had the least work)."""
    ctl = PoolController(policy(scale_down_cooldown_s=0.0, min_replicas=1))
    gauges = [replica("ours", 2_000), replica("by-hand", 0)]
    d = ctl.decide(PoolObservation(gauges=gauges, unmanaged=frozenset({"by-hand"})), now=0.0)
    assert (d.action, d.drain_worker) == ("scale_down", "ours")
    alone = ctl.decide(PoolObservation(gauges=[replica("by-hand", 0), replica("by-hand-2", 0)],
                                       unmanaged=frozenset({"by-hand", "by-hand-2"})), now=1.0)
    assert alone.action == "hold" and "none of the ready replicas is ours to drain" in alone.reason


def test_no_scale_down_before_a_full_cooldown_has_been_observed() -> None:
    # A freshly started controller has not seen the lower target hold for the cooldown.
    ctl = PoolController(policy(scale_down_cooldown_s=120.0))
    low = [replica(w, 100) for w in "abc"]
    assert all(
        ctl.decide(PoolObservation(gauges=low), now=float(t)).action == "hold" for t in range(0, 120, 10)
    )
    assert ctl.decide(PoolObservation(gauges=low), now=120.0).action == "scale_down"


def test_flapping_input_does_not_flap_the_fleet() -> None:
    ctl, fleet = PoolController(policy(scale_down_cooldown_s=300.0)), Fleet()
    fleet.add_ready(1)
    actions = []
    for i in range(240):  # two hours, the load swings every 30 s between 6 replicas' worth and none
        load = 45_000 if i % 2 == 0 else 0
        actions.append(run(ctl, fleet, now=30.0 * i, load=load).action)
    assert actions.count("scale_up") == 1 and actions.count("scale_down") == 0
    assert fleet.size == 6


def test_one_scale_down_at_a_time() -> None:
    ctl = PoolController(policy(min_replicas=1, scale_down_cooldown_s=60.0, drain_ack_timeout_s=30.0))
    idle = [replica(w, 0) for w in "abcde"]
    for t in range(0, 60, 10):
        ctl.decide(PoolObservation(gauges=idle), now=float(t))
    d = ctl.decide(PoolObservation(gauges=idle), now=60.0)
    assert (d.action, d.drain_worker) == ("scale_down", "a")
    # The gauge has not caught up yet: the controller's own record keeps it single.
    d = ctl.decide(PoolObservation(gauges=idle), now=61.0)
    assert d.action == "hold" and "waits for a to finish draining" in d.reason
    assert d.current == 4 and d.signals.draining == 1
    draining = [replica("a", 0, draining=True), *idle[1:]]
    for later in (70.0, 100.0, 200.0):  # however long the drain takes
        assert ctl.decide(PoolObservation(gauges=draining), now=later).action == "hold"
    # An operator's drain counts too: nothing new while any replica drains.
    d = ctl.decide(PoolObservation(gauges=[*idle[1:4], replica("e", 0, draining=True)]), now=210.0)
    assert d.action == "hold"
    d = ctl.decide(PoolObservation(gauges=idle[1:]), now=220.0)  # a and e gone
    assert (d.action, d.drain_worker) == ("scale_down", "b")


def test_a_drain_the_worker_never_showed_is_reissued_after_the_ack_timeout() -> None:
    ctl = PoolController(policy(scale_down_cooldown_s=0.0, drain_ack_timeout_s=30.0))
    gauges = [replica("a", 0), replica("b", 50)]
    assert ctl.decide(PoolObservation(gauges=gauges), now=0.0).drain_worker == "a"
    assert ctl.decide(PoolObservation(gauges=gauges), now=30.0).action == "hold"
    d = ctl.decide(PoolObservation(gauges=gauges), now=31.0)
    assert (d.action, d.drain_worker) == ("scale_down", "a")


def test_drain_victim_has_least_work_and_is_never_draining() -> None:
    gauges = [
        replica("a", 5_000),
        replica("b", 0, draining=True),
        replica("c", 1_500, 1_500),
        replica("d", 3_000),
        replica("e", 3_000),
    ]
    # c and d both have 3000 tokens in flight; c has 2 requests (1 running, 1 waiting), d 3.
    # b has none at all but is already draining.
    assert choose_drain_victim(gauges) == "c"
    assert choose_drain_victim(gauges, exclude=["c"]) == "d"  # d before e by id
    assert choose_drain_victim([replica("b", 0, draining=True)]) is None


# --------------------------------------------------------------------------- bounds (property)


@settings(max_examples=150, deadline=None)
@given(
    min_r=st.integers(0, 3),
    extra=st.integers(0, 6),
    warm=st.integers(0, 2),
    cooldown=st.sampled_from([0.0, 30.0, 120.0, 600.0]),
    steps=st.lists(
        st.tuples(st.integers(0, 150_000), st.integers(0, 3), st.floats(1.0, 200.0)), min_size=1, max_size=50
    ),
)
def test_bounds_hold_and_never_two_scale_downs(
    min_r: int, extra: int, warm: int, cooldown: float, steps: list[tuple[int, int, float]]
) -> None:
    p = policy(
        min_replicas=min_r,
        max_replicas=max(1, min_r + extra),
        warm_buffer=warm,
        scale_down_cooldown_s=cooldown,
        idle_to_zero_s=300.0,
    )
    ctl, fleet, now = PoolController(p), Fleet(), 0.0
    fleet.add_ready(min_r)
    for load, pending, dt in steps:
        now += dt
        d = run(ctl, fleet, now, load, pending)
        assert p.min_replicas <= d.desired <= p.max_replicas
        assert p.min_replicas <= d.target <= p.max_replicas
        assert len(fleet.draining) <= 1  # includes the one just issued
        assert fleet.size <= p.max_replicas
        if d.action == "scale_down":
            assert d.count == 1 and d.drain_worker is not None
            assert d.drain_worker in fleet.draining and len(fleet.draining) == 1
        elif d.action == "scale_up":
            assert d.count >= 1 and d.current + d.count == d.desired
        else:
            assert d.count == 0 and d.drain_worker is None


# --------------------------------------------------------------------------- time of day


def _at(hour: int, minute: int, zone: str = "America/New_York", day: int = 3) -> float:
    return datetime(2026, 7, day, hour, minute, tzinfo=ZoneInfo(zone)).timestamp()


def test_time_of_day_minimum_in_an_explicit_zone_with_prescaling() -> None:
    p = policy(
        min_replicas=1,
        schedule=(ScheduleWindow(8, 18, 4),),
        timezone="America/New_York",
        prescale_lead_s=1800.0,  # a known 08:00 peak: be warm by then
        scale_down_cooldown_s=600.0,
    )
    assert p.scheduled_min(_at(7, 29)) == 0
    assert p.scheduled_min(_at(7, 30)) == 4  # 30 min early
    assert p.scheduled_min(_at(17, 59)) == 4
    assert p.scheduled_min(_at(18, 0)) == 0  # ends on time
    # 12:00 UTC is 08:00 in New York in July: the zone, not the machine's, decides.
    assert p.scheduled_min(datetime(2026, 7, 3, 12, 0, tzinfo=ZoneInfo("UTC")).timestamp()) == 4

    ctl, fleet = PoolController(p), Fleet()
    fleet.add_ready(1)
    assert run(ctl, fleet, _at(7, 0), load=0).action == "hold"
    d = run(ctl, fleet, _at(7, 30), load=0)
    assert (d.action, d.count, d.desired) == ("scale_up", 3, 4)
    assert "time-of-day minimum 4" in d.reason
    # Idle all day, it stays at the scheduled minimum...
    for h in range(8, 18):
        assert run(ctl, fleet, _at(h, 0), load=0).action == "hold"
    # ...and after 18:00 comes down only once the cooldown has passed.
    assert run(ctl, fleet, _at(18, 0), load=0).action == "hold"
    assert run(ctl, fleet, _at(18, 9), load=0).action == "hold"
    assert run(ctl, fleet, _at(18, 10), load=0).action == "scale_down"


def test_schedule_window_past_midnight() -> None:
    night = ScheduleWindow(22, 6, 2)
    assert night.active(23.5) and night.active(0) and night.active(5.99)
    assert not night.active(6) and not night.active(12)
    assert ScheduleWindow(0, 0, 1).active(13)  # equal hours: all day


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        policy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        policy(schedule=(ScheduleWindow(8, 18, 11),))
    with pytest.raises(ValueError):
        policy(target_utilization=0.0)
    with pytest.raises(Exception):  # noqa: B017 - zoneinfo raises its own error type
        policy(timezone="Mars/Olympus_Mons")


# --------------------------------------------------------------------------- scale to zero


def test_scale_to_zero_after_the_idle_period_and_cold_start_on_demand() -> None:
    p = policy(min_replicas=0, idle_to_zero_s=600.0, scale_down_cooldown_s=300.0, warm_buffer=1)
    ctl, fleet = PoolController(p), Fleet()
    fleet.add_ready(1)
    assert run(ctl, fleet, 0.0, load=3_000).action == "scale_up"  # 1 needed + 1 warm
    assert run(ctl, fleet, 100.0, load=3_000).action == "hold"
    assert fleet.size == 2
    # Load stops after t = 100. After the cooldown the warm spare goes, the last one stays.
    actions = {t: run(ctl, fleet, float(t), load=0) for t in range(110, 700, 10)}
    downs = [t for t, d in actions.items() if d.action == "scale_down"]
    assert downs == [410]  # the high target held until the tick at 110, + 300 s
    assert actions[690].action == "hold" and "hold 1" in actions[690].reason
    d = run(ctl, fleet, 700.0, load=0)  # idle for 600 s since t = 100
    assert (d.action, d.target, d.desired) == ("scale_down", 0, 0)
    assert "scaling to zero" in d.reason
    fleet.advance(800.0)
    assert fleet.size == 0
    d = run(ctl, fleet, 800.0, load=0)
    assert (d.action, d.current, d.desired) == ("hold", 0, 0)
    # A request for the empty pool: one replica at once, marked as a cold start.
    d = run(ctl, fleet, 900.0, load=0, pending=1)
    assert (d.action, d.count, d.desired, d.cold_start) == ("scale_up", 2, 2, True)  # 1 + warm buffer
    assert d.reason.startswith("cold start") and "waiting with no replica" in d.reason
    d = run(ctl, fleet, 905.0, load=0, pending=3)
    assert d.action == "hold" and not d.cold_start  # already starting
    assert "cold start in progress (2 starting)" in d.reason


def test_a_busy_zero_able_pool_does_not_go_to_zero() -> None:
    p = policy(min_replicas=0, idle_to_zero_s=120.0, scale_down_cooldown_s=30.0)
    ctl, fleet = PoolController(p), Fleet()
    fleet.add_ready(1)
    for t in range(0, 3600, 20):
        d = run(ctl, fleet, float(t), load=500 if t % 100 == 0 else 0)  # a request every 100 s
        assert d.action != "scale_down"
    assert fleet.size == 1


# --------------------------------------------------------------------------- capacity


def test_capacity_starts_at_the_configured_value_until_measured() -> None:
    p = policy(initial_replica_token_capacity=50_000.0)
    est = update_capacity(CapacityEstimate(), [replica("a", 0)], 0.0, p)
    assert est.value(p.initial_replica_token_capacity) == (50_000.0, "initial")


def test_capacity_converges_from_gauges() -> None:
    # The guess is far off; replicas have 40k tokens of KV but saturate (max_num_seqs)
    # at about 30k held tokens.
    p = policy(initial_replica_token_capacity=100_000.0, capacity_time_constant_s=60.0)
    ctl = PoolController(p)
    # Unsaturated: 20k held at 50 % KV → 40k with a full KV, the ceiling.
    d = ctl.decide(PoolObservation(gauges=[replica("a", 20_000, cap=40_000)]), now=0.0)
    assert (d.signals.replica_token_capacity, d.signals.capacity_source) == (40_000.0, "kv_extrapolated")
    # Saturated replicas (requests waiting) holding 28k–32k: their mean is ~30k.
    t = 0.0
    for i in range(60):
        t += 10.0
        held = 28_000 if i % 2 else 32_000
        d = ctl.decide(PoolObservation(gauges=[replica("a", held, 5_000, cap=40_000)]), now=t)
    assert d.signals.capacity_source == "saturated"
    assert d.signals.replica_token_capacity == pytest.approx(30_000, rel=0.05)
    # The law then sizes with the measured figure: 90k held+queued / 0.75 / ~30k = 4.
    gauges = [replica(w, 30_000, 0, cap=40_000) for w in "abc"]
    d = ctl.decide(PoolObservation(gauges=gauges), now=t + 10.0)
    assert d.signals.needed == 4 and d.action == "scale_up"


def test_an_underestimate_is_corrected_without_saturation() -> None:
    # Over-provisioned from a low guess, replicas never saturate; their KV usage still
    # tells what they could hold, and whatever they hold is a floor.
    p = policy(initial_replica_token_capacity=1_000.0)
    ctl = PoolController(p)
    d = ctl.decide(
        PoolObservation(gauges=[replica("a", 10_000, cap=40_000), replica("b", 2_000, cap=40_000)]), 0.0
    )
    assert d.signals.replica_token_capacity == pytest.approx(40_000)
    assert d.signals.needed == 1  # 12k / 0.75 / 40k, not 16 from the guess
    est = CapacityEstimate(saturated=5_000.0, saturated_at=0.0)
    assert est.value(1_000.0, floor=8_000.0) == (8_000.0, "observed_floor")


def test_draining_replicas_do_not_feed_the_estimate_or_the_load() -> None:
    ctl = PoolController(policy())
    d = ctl.decide(
        PoolObservation(gauges=[replica("a", 9_000, 50_000, draining=True), replica("b", 1_000)]), now=0.0
    )
    assert (d.signals.running_tokens, d.signals.waiting_tokens) == (1_000, 0)
    assert d.signals.capacity_source == "kv_extrapolated" and d.current == 1 and d.signals.draining == 1


# ---- prefill compute: a replica with KV to spare that cannot keep up with its prompts ------
BIG_KV = 400_000  # tokens: what a replica of an 8B model on an H100 holds
# Its batch limit, known to the shell: a request waiting below it is no memory saturation.
LIMITS = {"w1": 1024, "w2": 1024}


def computing(wid: str, total: int, queued: int, *, held: int = 30_000, prefill: float = 14_000.0) -> WorkerGauge:
    """A replica holding ``held`` tokens of ``BIG_KV`` (memory to spare) that has computed
    ``total`` prompt tokens since it started, with ``queued`` waiting."""
    return WorkerGauge(worker_id=wid, model="m", ts=0.0, running=3, waiting=1 if queued else 0, running_tokens=held,
                       queued_prefill_tokens=queued, kv_usage=held / BIG_KV, prefill_tokens_per_s=prefill,
                       decode_tokens_per_s=1000.0, prefill_tokens_total=total)


def windowed(rate: float, samples: int, window: int = 20) -> float:
    """A constant rate as the demand reads it after ``samples`` one-second ticks: what
    arrived over the last window (ticks since the first), over the whole window."""
    return rate * min(samples, window) / window


def test_a_replica_falling_behind_on_prefill_gets_help_though_its_kv_has_room() -> None:
    # 17k prompt tokens a second arrive at a replica that computes 14k: it computes at its
    # limit and its queue grows by 3k a second. Memory alone (57,000 of 400,000 tokens) says 1.
    controller = PoolController(policy(initial_replica_token_capacity=float(BIG_KV)))
    decisions = [controller.decide(PoolObservation(gauges=[computing("w1", total=14_000 * t, queued=3_000 * t)],
                                                   max_num_seqs=LIMITS), float(t)) for t in range(60)]
    # The demand is what arrived over 20 s: one replica until it passes 75 % of 14k.
    first_up = next(d for d in decisions if d.action == "scale_up")
    assert first_up.at == 13.0 and first_up.signals.prefill_demand_tokens_per_s == pytest.approx(windowed(17_000, 13))
    s = decisions[-1].signals
    assert s.needed == 1 and s.prefill_demand_tokens_per_s == pytest.approx(17_000)  # whole after one window
    assert s.needed_prefill == 2 and decisions[-1].desired == 2  # ⌈17,000 / 0.75 / 14,000⌉
    assert "for prefill" in first_up.reason and "14,000 per replica" in first_up.reason


def test_one_long_prompt_calls_no_replica_it_could_not_use() -> None:
    # A 128k-token prompt (RAG, a long document) queues on the one replica, which prefills it
    # at 14k a second; replicas added now could serve only later requests.
    controller = PoolController(policy(initial_replica_token_capacity=float(BIG_KV)))
    queue = [0, 128_000] + [max(0, 128_000 - 14_000 * t) for t in range(1, 11)]
    decisions = [controller.decide(PoolObservation(gauges=[computing("w1", 128_000 - q if t > 1 else 0, q)],
                                                   max_num_seqs=LIMITS), float(t)) for t, q in enumerate(queue)]
    assert all(d.signals.needed_prefill <= 1 and d.desired == 1 for d in decisions)


def test_light_prefill_demand_changes_nothing_and_an_idle_pool_needs_none() -> None:
    controller = PoolController(policy(min_replicas=0, idle_to_zero_s=10.0, initial_replica_token_capacity=float(BIG_KV)))
    decision = None
    for tick in range(10):
        decision = controller.decide(PoolObservation(gauges=[computing("w1", total=2_000 * tick, queued=0)],
                                                     max_num_seqs=LIMITS), float(tick))
    assert decision is not None
    assert decision.signals.needed_prefill == 1 and decision.action == "hold" and decision.desired == 1
    # Idle (nothing running or waiting): what arrived within the window holds nothing up.
    idle = WorkerGauge(worker_id="w1", model="m", ts=0.0, prefill_tokens_per_s=14_000.0, prefill_tokens_total=18_000)
    later = [controller.decide(PoolObservation(gauges=[idle], max_num_seqs=LIMITS), float(t)) for t in range(10, 30)]
    down = next(d for d in later if d.action == "scale_down")  # 10 s after the last busy tick (9)
    assert down.at == 19.0 and "scaling to zero" in down.reason
    assert down.signals.prefill_demand_tokens_per_s is not None and down.signals.prefill_demand_tokens_per_s > 0
    assert down.signals.needed_prefill == 0


def test_counters_that_restart_or_come_with_a_history_make_no_false_demand() -> None:
    controller = PoolController(policy(initial_replica_token_capacity=float(BIG_KV)))
    controller.decide(PoolObservation(gauges=[computing("w1", 5_000_000, 0)]), 0.0)  # an autoscaler restart: baseline
    first = controller.decide(PoolObservation(gauges=[computing("w1", 5_001_000, 0)]), 1.0)
    assert first.signals.prefill_demand_tokens_per_s == pytest.approx(1_000 / 20)
    # w1's engine reloaded (its counter restarts at 400: all of it new); w2 joins with a long history
    later = controller.decide(PoolObservation(gauges=[computing("w1", 400, 0), computing("w2", 9_000_000, 0)]), 2.0)
    assert later.signals.prefill_demand_tokens_per_s == pytest.approx((1_000 + 400) / 20)
    with pytest.raises(ValueError, match="window"):
        policy(demand_window_s=0.0)


def test_a_queue_that_never_empties_adds_a_replica_whatever_the_figures_say() -> None:
    # Prefill steps of 10k tokens every other second, decodes between: the figures read
    # 5k tokens/s arriving against 10k a replica computes (one replica), but a queue has
    # sat there at every tick: arrivals outrun it.
    controller = PoolController(policy(initial_replica_token_capacity=float(BIG_KV)))
    decisions = [controller.decide(PoolObservation(gauges=[computing("w1", total=10_000 * ((t + 1) // 2), queued=5_000)],
                                                   max_num_seqs=LIMITS), float(t)) for t in range(25)]
    assert all(d.desired == 1 for d in decisions[:20])
    up = next(d for d in decisions if d.action == "scale_up")
    assert up.at == 20.0 and up.desired == 2 and up.signals.backed_up
    assert up.signals.prefill_demand_tokens_per_s == pytest.approx(5_000, rel=0.05)
    assert "a queue for the last 20 s at 1 replica(s)" in up.reason
    # a second replica starting: the pool's size changed, so a new window must show the queue again
    starting = controller.decide(PoolObservation(gauges=[computing("w1", total=130_000, queued=5_000)], starting=1,
                                                 max_num_seqs=LIMITS), 25.0)
    assert not starting.signals.backed_up and starting.action == "hold"


def test_what_a_queue_taught_keeps_the_pool_from_shrinking_back_into_it() -> None:
    # As above, then two replicas share the 5k tokens/s and no queue is left. The figures
    # alone (10k a replica) would say one again after the cooldown; the queue showed one
    # replica computes at most 5k with its decodes, so two stay.
    controller = PoolController(policy(initial_replica_token_capacity=float(BIG_KV), scale_down_cooldown_s=10.0))
    for t in range(21):
        controller.decide(PoolObservation(gauges=[computing("w1", total=10_000 * ((t + 1) // 2), queued=5_000)],
                                          max_num_seqs=LIMITS), float(t))
    later = [controller.decide(PoolObservation(gauges=[computing(w, total=100_000 + 2_500 * (t - 20), queued=0)
                                                       for w in ("w1", "w2")], max_num_seqs=LIMITS), float(t))
             for t in range(21, 80)]
    assert all(d.desired == 2 and d.action != "scale_down" for d in later)
    assert later[-1].signals.replica_prefill_capacity == pytest.approx(5_000, rel=0.1)
    assert later[-1].signals.needed_prefill == 2
