"""Predictive SLO admission: prediction, cold start, tier ordering, retry_after."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.workers import WorkerGauge
from services.admission.slo import DEFAULT_TIERS, RankedWindow, ReplicaLoad, SloAdmitter, SloConfig, TierSLO

TIERS = ("premium", "standard", "batch")


def formula(**kw: Any) -> SloConfig:
    """For the formula's own tests: no prior tail factor before outcomes arrive."""
    return SloConfig(calibration_prior=1.0, **kw)


FIFO = formula(priority_queues=False, default_step_time_s=0.05)


def rep(q: int, rate: float = 10_000.0, step: float = 0.05, wid: str = "w", **kw: Any) -> ReplicaLoad:
    return ReplicaLoad(
        worker_id=wid, queued_prefill_tokens=q, prefill_tokens_per_s=rate, step_time_s=step, **kw
    )


def test_prediction_formula_and_best_replica() -> None:
    slo = SloAdmitter(FIFO)
    a = rep(8000, rate=10_000, step=0.04, wid="a")
    b = rep(2000, rate=5_000, step=0.04, wid="b", cached_tokens=800)
    assert slo.predict(a, 1000, "standard", 0.0) == pytest.approx((8000 + 1000) / 10_000 + 0.04)
    assert slo.predict(b, 1000, "standard", 0.0) == pytest.approx((2000 + 200) / 5_000 + 0.04)
    v = slo.check("premium", 1000, [a, b], 0.0)
    assert v.admitted
    assert v.worker_id == "b"
    assert v.predicted_ttft == pytest.approx(0.48)


def test_cold_start_uses_configured_defaults() -> None:
    slo = SloAdmitter(
        formula(priority_queues=False, default_prefill_tokens_per_s=4000, default_step_time_s=0.1)
    )
    cold = ReplicaLoad(worker_id="new", queued_prefill_tokens=2000)
    assert slo.predict(cold, 2000, "standard", 0.0) == pytest.approx(4000 / 4000 + 0.1)
    g = WorkerGauge(worker_id="new", model="m", ts=0.0, queued_prefill_tokens=2000)
    assert slo.predict(ReplicaLoad.from_gauge(g), 2000, "standard", 0.0) == pytest.approx(1.1)


def test_no_capacity_when_no_live_replica() -> None:
    slo = SloAdmitter(formula())
    for replicas in ([], [rep(0, draining=True)]):
        v = slo.check("premium", 10, replicas, 0.0)
        assert (v.admitted, v.reason, v.retry_after) == (False, "no_capacity", 5.0)


def test_default_thresholds_chain() -> None:
    slo = SloAdmitter(formula())
    assert slo.thresholds("premium") == [("premium", 1.0)]
    assert slo.thresholds("standard") == [("standard", 2.0), ("premium", pytest.approx(0.8))]
    assert slo.thresholds("batch") == [
        ("batch", 10.0),
        ("premium", pytest.approx(0.64)),
        ("standard", pytest.approx(1.6)),
    ]
    assert slo.tier("no-such-tier").name == "standard"


def first_rejection(slo: SloAdmitter, tier: str, prompt: int = 500) -> int:
    for q in range(0, 200_000, 100):
        if not slo.check(tier, prompt, [rep(q, wid="a"), rep(q + 3000, wid="b")], 0.0).admitted:
            return q
    raise AssertionError("never rejected")


def test_fifo_rising_load_sheds_batch_then_standard_then_premium() -> None:
    slo = SloAdmitter(FIFO)
    qb, qs, qp = (first_rejection(slo, t) for t in ("batch", "standard", "premium"))
    assert qb < qs < qp
    # one queue, one prediction: thresholds 0.64 / 0.8 / 1.0 s at 10k tokens/s, 0.05 s step
    assert qb == pytest.approx((0.64 - 0.05) * 10_000 - 500, abs=100)
    assert qs == pytest.approx((0.80 - 0.05) * 10_000 - 500, abs=100)
    assert qp == pytest.approx((1.00 - 0.05) * 10_000 - 500, abs=100)


def test_priority_queues_rising_load_keeps_the_order() -> None:
    slo = SloAdmitter(formula(priority_queues=True))
    # recent traffic: mostly batch, some standard, a little premium
    slo.record_admitted("batch", 60_000, 0.0)
    slo.record_admitted("standard", 30_000, 0.0)
    slo.record_admitted("premium", 10_000, 0.0)
    qb, qs, qp = (first_rejection(slo, t) for t in ("batch", "standard", "premium"))
    assert qb < qs < qp
    # premium waits only for the premium tenth of the queue: it survives a 10x longer queue
    assert qp > 5 * first_rejection(SloAdmitter(FIFO), "premium")


def test_priority_queues_let_batch_use_its_own_slo_on_a_batch_queue() -> None:
    slo = SloAdmitter(formula())
    slo.record_admitted("batch", 100_000, 0.0)
    # 8 s of queued batch work: far past premium's 1 s, yet premium would jump the queue
    v = slo.check("batch", 500, [rep(80_000)], 0.0)
    assert v.admitted
    assert v.predicted_ttft == pytest.approx(8.1)
    assert slo.check("premium", 500, [rep(80_000)], 0.0).admitted
    assert not slo.check("batch", 500, [rep(100_000)], 0.0).admitted  # 10.1 s > 10 s


def test_mix_decays() -> None:
    slo = SloAdmitter(formula(mix_half_life_s=10.0))
    slo.record_admitted("premium", 1000, 0.0)
    slo.record_admitted("batch", 1000, 10.0)
    # at t=10 premium's weight halved: 500 / 1500 of the queue runs before a premium request
    assert slo.mix.share_at_or_above(2, 10.0) == pytest.approx(1 / 3)
    assert slo.mix.share_at_or_above(0, 10.0) == 1.0


def test_retry_after_is_the_queue_drain_needed() -> None:
    slo = SloAdmitter(FIFO)
    # standard: 0.8 s limit (protecting premium); prediction (12000+500)/10000 + 0.05 = 1.3 s
    v = slo.check("standard", 500, [rep(12_000)], 0.0)
    assert (v.admitted, v.reason) == (False, "slo")
    assert v.retry_after == pytest.approx(0.5)
    assert v.predicted_ttft == pytest.approx(1.3)
    assert "protecting premium" in v.message
    # the best replica sets it: another one 0.1 s over its limit
    v = slo.check("standard", 500, [rep(12_000, wid="a"), rep(8_500, wid="b")], 0.0)
    assert v.retry_after == pytest.approx(0.25)  # 0.1 s, floored at min_retry_after_s
    assert v.worker_id == "b"


def test_long_prompt_is_held_to_a_proportional_target() -> None:
    slo = SloAdmitter(FIFO)
    # 20k tokens at 10k/s: 2.05 s on an idle replica, past premium's 1 s forever
    assert slo.check("premium", 20_000, [rep(0)], 0.0).admitted
    assert slo.check("premium", 20_000, [rep(10_000)], 0.0).admitted  # waits 1 s ≤ 50 % of 2.05 s
    assert not slo.check("premium", 20_000, [rep(11_000)], 0.0).admitted
    # ordering still holds for it
    assert not slo.check("standard", 20_000, [rep(10_000)], 0.0).admitted


def test_custom_tiers_same_priority_peers_do_not_constrain_each_other() -> None:
    cfg = formula(
        tiers=(TierSLO("gold", 0.5, 1), TierSLO("silver", 3.0, 1), TierSLO("bronze", 20.0, 0)),
        default_tier="silver",
        priority_queues=False,
    )
    slo = SloAdmitter(cfg)
    assert slo.thresholds("silver") == [("silver", 3.0)]
    assert slo.check("silver", 100, [rep(20_000)], 0.0).admitted  # 2.06 s
    assert not slo.check("gold", 100, [rep(20_000)], 0.0).admitted


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError):
        SloConfig(default_tier="gold")
    with pytest.raises(ValueError):
        SloConfig(headroom=1.5)
    assert DEFAULT_TIERS[0].priority > DEFAULT_TIERS[1].priority > DEFAULT_TIERS[2].priority


# ---- the ordering guarantee, for any state ----

replica = st.builds(
    ReplicaLoad,
    worker_id=st.sampled_from(["a", "b", "c", "d"]),
    queued_prefill_tokens=st.integers(0, 200_000),
    prefill_tokens_per_s=st.sampled_from([0.0, 500.0, 4000.0, 12_000.0, 40_000.0]),
    step_time_s=st.sampled_from([0.0, 0.01, 0.05, 0.3]),
    cached_tokens=st.integers(0, 30_000),
    draining=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(
    replicas=st.lists(replica, max_size=5),
    prompt=st.integers(1, 60_000),
    mix=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
    headroom=st.sampled_from([0.5, 0.8, 1.0]),
    priority_queues=st.booleans(),
)
def test_a_higher_tier_is_never_shed_while_a_lower_one_is_admitted(
    replicas: list[ReplicaLoad],
    prompt: int,
    mix: tuple[int, int, int],
    headroom: float,
    priority_queues: bool,
) -> None:
    slo = SloAdmitter(formula(headroom=headroom, priority_queues=priority_queues))
    for tier, tokens in zip(TIERS, mix, strict=True):
        if tokens:
            slo.record_admitted(tier, tokens, 0.0)
    admitted = [slo.check(t, prompt, replicas, 0.0).admitted for t in TIERS]
    # premium rejected ⇒ standard rejected ⇒ batch rejected
    assert admitted == sorted(admitted, reverse=True)


def test_higher_priority_arrivals_overtake_a_waiting_request() -> None:
    """Premium arriving at 3k tokens/s on a 10k tokens/s pool leaves standard's queue 70 %."""
    slo = SloAdmitter(formula(mix_half_life_s=30.0))
    slo.record_admitted("batch", 0, -1e6)  # a long history: the weights are at steady state
    r = 3_000.0
    slo.record_admitted("premium", int(r * 30.0 / math.log(2)), 0.0)  # the steady-state weight of r
    slo.record_admitted("standard", 50_000, 0.0)
    replica = rep(5_000)
    share = slo.mix.share_at_or_above(1, 0.0)
    expected = 5_000 * share / (10_000 * 0.7) + 500 / 10_000 + 0.05
    assert slo.predict(replica, 500, "standard", 0.0) == pytest.approx(expected, rel=1e-3)
    # premium is overtaken by nobody; on a pool twice as large the same arrivals take half as much
    assert slo.predict(replica, 500, "premium", 0.0) == pytest.approx(
        5_000 * slo.mix.share_at_or_above(2, 0.0) / 10_000 + 0.1
    )
    assert slo.predict(replica, 500, "standard", 0.0, pool_rate=20_000) < expected
    # the overtaking is capped: a queue always drains a little
    slo.record_admitted("premium", 10**9, 0.0)
    assert slo.predict(replica, 500, "standard", 0.0) < math.inf
    # FIFO workers: nobody overtakes
    fifo = SloAdmitter(FIFO)
    fifo.record_admitted("premium", 10**6, 0.0)
    assert fifo.predict(replica, 500, "standard", 0.0) == pytest.approx(5_000 / 10_000 + 500 / 10_000 + 0.05)


def test_young_mix_rates_are_scaled_up_to_what_the_weights_will_hold() -> None:
    slo = SloAdmitter(formula(mix_half_life_s=30.0))
    for t in range(30):  # premium at 1000 tokens/s for 30 s: one half-life, the weight half full
        slo.record_admitted("premium", 1000, float(t))
    assert slo.mix.rate_above(1, 30.0) == pytest.approx(1000, rel=0.05)
    young = SloAdmitter(formula(mix_half_life_s=30.0))
    young.record_admitted("premium", 1000, 0.0)
    assert young.mix.rate_above(1, 0.5) <= 4 * 1000 * math.log(2) / 30  # capped extrapolation


def test_target_below_one_scales_every_threshold() -> None:
    slo = SloAdmitter(formula(target=0.75))
    names, limits = zip(*slo.thresholds("standard"), strict=True)
    assert names == ("standard", "premium") and limits == pytest.approx((1.5, 0.6))
    assert first_rejection(slo, "premium") < first_rejection(SloAdmitter(formula()), "premium")


# ---- calibration: predictions scaled by the tail of actual / predicted ----


def test_calibration_scales_predictions_by_the_observed_tail() -> None:
    one_tier = (TierSLO("standard", 2.0, 1),)
    cfg = SloConfig(tiers=one_tier, priority_queues=False, calibration_min_samples=20, calibration_window=100,
                    calibration_prior=1.0)
    adm = SloAdmitter(cfg)
    replica = [ReplicaLoad("w", queued_prefill_tokens=10_000, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    # raw prediction 1 + 0.1 + 0.05 = 1.15 s: inside standard's 2 s
    first = adm.check("standard", 1000, replica, 0.0)
    assert first.admitted and first.predicted_ttft == pytest.approx(1.15)
    assert first.raw_predicted_ttft == pytest.approx(1.15)
    # too few outcomes to read a tail from: the worst seen bounds the decision, the point
    # prediction stays the formula's
    for _ in range(19):
        adm.observe("standard", 1.0, 1.5)
    early = adm.check("standard", 1000, replica, 0.0)
    assert early.admitted and early.predicted_ttft == pytest.approx(1.15)
    assert early.ttft_bound == pytest.approx(1.15 * 1.5)
    # 20 outcomes, the tail at 2× their prediction: predictions double
    adm.observe("standard", 1.0, 2.0)
    refused = adm.check("standard", 1000, replica, 0.0)
    assert not refused.admitted and refused.predicted_ttft == pytest.approx(1.15 * 1.5)
    assert SloAdmitter(SloConfig()).calibration.factor("premium") == 1.0  # per tier
    # an engine faster than the formula earns a factor under 1 (bounded)
    fast = SloAdmitter(cfg)
    for _ in range(40):
        fast.observe("standard", 1.0, 0.1)
    assert fast.calibration.factor("standard") == cfg.calibration_bounds[0]
    # and off means off
    off = SloAdmitter(SloConfig(tiers=one_tier, priority_queues=False, calibration=False, calibration_min_samples=1))
    off.observe("standard", 1.0, 3.0)
    assert off.check("standard", 1000, replica, 0.0).predicted_ttft == pytest.approx(1.15)


def test_before_its_first_outcomes_a_tier_bounds_its_queue_by_the_prior() -> None:
    """Issue 14: at 2× from the first second, the only admitted requests past their SLO
    were admitted in its first 1.8 s, on the bare formula, while the first outcomes were
    still on their way (one at 2.45× its formula, most of it queue). Until a tier has
    outcomes to read a tail from, its bound takes the queue at the prior's multiple, if
    higher-priority arrivals can overtake it."""
    two_tiers = (TierSLO("premium", 1.0, 2), TierSLO("standard", 2.0, 1))
    adm = SloAdmitter(SloConfig(tiers=two_tiers, calibration_prior=4.0, calibration_min_samples=3))
    queued = [ReplicaLoad("w", queued_prefill_tokens=5_000, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    first = adm.check("standard", 1000, queued, 0.0)  # raw 0.65 s: 0.5 s of it queue
    assert not first.admitted
    assert first.predicted_ttft == pytest.approx(0.65)  # the point prediction is still the formula's
    assert "bound 2.15 s > 2.00 s" in first.message  # 0.15 + 4 × 0.5
    # the top tier is overtaken by nothing: its queue is what the gauges say
    assert adm.check("premium", 1000, queued, 0.0).ttft_bound == pytest.approx(0.65)
    # nor is anyone on FIFO workers
    fifo = SloAdmitter(SloConfig(tiers=two_tiers, priority_queues=False, calibration_prior=4.0))
    assert fifo.check("standard", 1000, queued, 0.0).ttft_bound == pytest.approx(0.65)
    adm.observe("standard", 1.0, 1.2)  # an outcome worse than the formula multiplies it all
    assert adm.calibration.factor("standard") == pytest.approx(1.2)
    shorter = [ReplicaLoad("w", queued_prefill_tokens=3_000, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    assert adm.check("standard", 1000, shorter, 0.0).ttft_bound == pytest.approx((0.15 + 4 * 0.3) * 1.2)
    # once calibrated, the outcomes alone decide
    adm.observe("standard", 1.0, 1.0)
    adm.observe("standard", 1.0, 1.0)
    assert adm.check("standard", 1000, queued, 0.0).admitted
    # an idle mesh is untouched: with nothing queued, nothing is multiplied
    idle = [ReplicaLoad("w", queued_prefill_tokens=0, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    fresh = SloAdmitter(SloConfig())
    for t in TIERS:
        verdict = fresh.check(t, 1000, idle, 0.0)
        assert verdict.admitted and verdict.ttft_bound == pytest.approx(0.15)
    with pytest.raises(ValueError):
        SloConfig(calibration_prior=10.0)
    with pytest.raises(ValueError):
        SloConfig(calibration_prior=0.5)

def test_the_decision_holds_the_tail_bound_but_predicts_the_median() -> None:
    """Issue 14: a tail factor reported as the prediction was > 2× the TTFT seen for
    most requests at 2× overload. The bound decides; the point prediction is the median's."""
    one_tier = (TierSLO("standard", 2.0, 1),)
    cfg = SloConfig(tiers=one_tier, priority_queues=False, calibration_min_samples=20, calibration_window=100,
                    calibration_quantile=0.95)
    adm = SloAdmitter(cfg)
    for i in range(100):  # most requests meet their prediction, one in ten takes 3×
        adm.observe("standard", 1.0, 3.0 if i % 10 == 0 else 1.0)
    assert adm.calibration.factor("standard") == pytest.approx(3.0)
    assert adm.calibration.expected_factor("standard") == pytest.approx(1.0)
    replica = [ReplicaLoad("w", queued_prefill_tokens=10_000, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    refused = adm.check("standard", 1000, replica, 0.0)  # raw 1.15 s: bound 3.45 s > 2 s
    assert not refused.admitted
    assert refused.predicted_ttft == pytest.approx(1.15)
    assert "predicted TTFT 1.15 s, p95 bound 3.45 s > 2.00 s" in refused.message
    light = [ReplicaLoad("w", queued_prefill_tokens=3_000, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    admitted = adm.check("standard", 1000, light, 0.0)  # raw 0.45 s: bound 1.35 s
    assert admitted.admitted
    assert admitted.predicted_ttft == pytest.approx(0.45)
    assert admitted.ttft_bound == pytest.approx(1.35)
    assert adm.predict(light[0], 1000, "standard", 0.0) == pytest.approx(0.45)


def test_calibration_quantile_ignores_the_rare_outlier() -> None:
    adm = SloAdmitter(SloConfig(calibration_quantile=0.95, calibration_min_samples=50, calibration_window=100))
    for i in range(100):
        adm.observe("standard", 1.0, 9.0 if i == 50 else 1.2)
    assert adm.calibration.factor("standard") == pytest.approx(1.2)


def test_the_ranked_window_reads_what_sorting_the_window_reads() -> None:
    """The calibration's window keeps its values ranked as they come and go; every read
    must equal sorting the last ``size`` values (duplicates and evictions included)."""
    rng = random.Random(7)
    window = RankedWindow(50)
    recent: list[float] = []
    for i in range(600):
        value = rng.choice([1.0, 1.5, 2.0]) if i % 3 == 0 else round(rng.lognormvariate(0, 0.5), 2)
        window.append(value)
        recent = [*recent, value][-50:]
        ranked = sorted(recent)
        assert list(window) == recent and len(window) == len(recent)
        for q in (0.0, 0.25, 0.5, 0.995, 0.999):
            assert window.at(q) == ranked[min(int(q * len(ranked)), len(ranked) - 1)]
        assert window.largest() == ranked[-1]


def test_the_default_bound_covers_every_recent_outcome() -> None:
    """Issue 14: at the 0.995 quantile (the third largest of 500 ratios) one admitted
    standard request in ~600 still missed its SLO at 2× overload: requests met the rare
    burst that two outcomes in the window had met before. The default bound now covers
    the worst of the window."""
    cfg = SloConfig()
    adm = SloAdmitter(cfg)
    for i in range(cfg.calibration_window):
        adm.observe("standard", 1.0, 2.4 if i in (100, 300) else 1.3 + (i % 7) * 0.1)
    assert adm.calibration.factor("standard") == pytest.approx(2.4)
    assert adm.calibration.expected_factor("standard") == pytest.approx(1.6)


def test_slack_shrinks_with_the_factor() -> None:
    cfg = SloConfig(priority_queues=False, calibration_min_samples=1, calibration_prior=1.0)
    replica = [ReplicaLoad("w", queued_prefill_tokens=0, prefill_tokens_per_s=10_000, step_time_s=0.05)]
    plain = SloAdmitter(cfg).check("premium", 2500, replica, 0.0)
    scaled = SloAdmitter(cfg)
    scaled.observe("premium", 1.0, 2.0)
    doubled = scaled.check("premium", 2500, replica, 0.0)
    # premium's 1 s against 0.3 s raw: at 2× every token counts twice, 2,000 tokens of room
    assert doubled.slack_tokens == (1.0 - 0.6) * 10_000 / 2
    # without the factor the SLO leaves 7,000 tokens, but the predicted 0.3 s may at
    # most double wherever the router puts the request: 3,000
    assert plain.slack_tokens == 3000


@pytest.mark.parametrize("placement_slack", [1.0, 0.5, 0.0])
def test_the_router_may_not_move_a_request_past_its_prediction_and_the_placement_slack(placement_slack: float) -> None:
    """Issue 14: predictions under half the TTFT seen were requests the router placed,
    within admission's slack, behind far more work than admission predicted for."""
    cfg = SloConfig(priority_queues=False, calibration_prior=1.0, placement_slack=placement_slack)
    for queued in (0, 2_000, 4_000):
        verdict = SloAdmitter(cfg).check("standard", 1000, [rep(queued)], 0.0)
        assert verdict.admitted and verdict.predicted_ttft is not None
        # slack tokens ahead add slack / rate seconds: the TTFT stays within 1 + placement_slack of the prediction
        ahead = verdict.slack_tokens / 10_000
        assert verdict.predicted_ttft + ahead <= (1 + placement_slack) * verdict.predicted_ttft + 1e-9
        if queued == 0:  # far from the SLO, the router does get that room
            assert ahead == pytest.approx(placement_slack * verdict.predicted_ttft, rel=0.01, abs=1e-4)


# ---- light load: what the formula leaves out must not become a factor (issue 14) ----


def light_load_outcomes(adm: SloAdmitter, n: int = 200) -> None:
    """An idle mesh: the formula says 45 ms (a 512-token prompt at 14k tokens/s plus one
    step), the gateway sees 55-170 ms (gateway, bus and HTTP time, a cold first request)."""
    for i in range(n):
        adm.observe("premium", 0.045, 0.055 + (0.115 if i % 25 == 0 else 0.01 * (i % 3)), queue_free=True)


def test_light_load_outcomes_leave_the_factor_alone() -> None:
    adm = SloAdmitter()
    light_load_outcomes(adm)
    # 45 ms predicted against a 250 ms floor: as right as the SLO can tell. Taken raw,
    # these ratios (1.2-3.8) made 3.8 the factor, and an idle mesh refused premium.
    assert adm.calibration.factor("premium") == 1.0
    idle = [rep(0, rate=14_000, step=0.007)]
    v = adm.check("premium", 512, idle, 0.0)
    assert v.admitted
    # (512 / 14k + 7 ms) + the median 20 ms outside the engine: 64 ms, 55-75 ms seen
    assert v.raw_predicted_ttft == pytest.approx(512 / 14_000 + 0.007)
    assert v.predicted_ttft == pytest.approx(512 / 14_000 + 0.007 + 0.02)
    assert v.queue_free
    # a pool with a queue anywhere: its outcome will not teach the overhead
    assert not adm.check("premium", 512, [*idle, rep(3000, wid="busy")], 0.0).queue_free
    # and the queue a 2× overload builds is still judged by the formula, not 4× it
    assert adm.check("premium", 512, [rep(12_000, rate=14_000, step=0.007)], 0.0).admitted


def test_a_miss_from_a_small_prediction_still_counts() -> None:
    adm = SloAdmitter(SloConfig(calibration_min_samples=50))
    for i in range(100):
        # predicted 50 ms, yet now and then 0.6 s: a burst the formula did not see
        adm.observe("premium", 0.05, 0.6 if i % 10 == 0 else 0.06)
    assert adm.calibration.factor("premium") == pytest.approx(0.6 / 0.25)  # measured against the floor


def test_overhead_is_learnt_from_an_idle_pool_and_bounded() -> None:
    cfg = SloConfig(overhead_min_samples=10)
    adm = SloAdmitter(cfg)
    for _ in range(9):
        adm.observe("standard", 0.01, 0.03, queue_free=True)
    assert adm.overhead() == 0.0  # too few outcomes yet
    adm.observe("standard", 0.01, 0.03, queue_free=True)
    assert adm.overhead() == pytest.approx(0.02)
    # queues about, or a prediction near the limit: its error is the queue's, not the
    # mesh's (under 2× overload these read 0.6 s and doubled every prediction)
    for _ in range(50):
        adm.observe("standard", 0.05, 0.9)
        adm.observe("standard", 1.5, 3.0, queue_free=True)
    assert adm.overhead() == pytest.approx(0.02)
    # the mesh's usual latency, not its fastest: the median of what an idle pool saw
    for i in range(90):
        adm.observe("standard", 0.01, 0.015 + 0.01 * (i % 3), queue_free=True)
    assert adm.overhead() == pytest.approx(0.015)
    # a slow mesh: never more than the tightest tier's floor (0.25 × premium's 1 s)
    slow = SloAdmitter(cfg)
    for _ in range(20):
        slow.observe("batch", 0.1, 2.0, queue_free=True)
    assert slow.overhead() == pytest.approx(0.25)
    # it is part of the calibration: off means off
    off = SloAdmitter(SloConfig(calibration=False, overhead_min_samples=1))
    off.observe("standard", 0.01, 0.5, queue_free=True)
    assert off.overhead() == 0.0
    assert off.predict(rep(0, rate=10_000, step=0.01), 1000, "standard", 0.0) == pytest.approx(0.11)
