"""The admission verdict: quota, then SLO; refunds on shedding; reconciliation from usage."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from proto.messages import AdmissionRequest, UsageEvent, UsageStatus
from services.admission.buckets import Limiter
from services.admission.policy import AdmissionPolicy
from services.admission.slo import ReplicaLoad, SloAdmitter, SloConfig

IDLE = [ReplicaLoad(worker_id="w0", queued_prefill_tokens=0, prefill_tokens_per_s=10_000, step_time_s=0.05)]
BUSY = [
    ReplicaLoad(worker_id="w0", queued_prefill_tokens=30_000, prefill_tokens_per_s=10_000, step_time_s=0.05)
]


def req(
    rid: str, prompt: int = 1000, max_tokens: int = 500, tier: str = "standard", **kw: Any
) -> AdmissionRequest:
    base: dict[str, Any] = {"rpm_limit": 10, "tpm_limit": 20_000, "org_tpm_limit": 100_000}
    base.update(kw)
    return AdmissionRequest(
        request_id=rid,
        org="acme",
        key_id="k1",
        tier=tier,
        model="m",
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        **base,
    )


def usage(rid: str, prompt: int, completion: int, status: UsageStatus = "finished") -> UsageEvent:
    return UsageEvent(
        request_id=rid,
        org="acme",
        key_id="k1",
        model="m",
        prompt_tokens=prompt,
        completion_tokens=completion,
        status=status,
    )


def policy() -> AdmissionPolicy:
    """The formula alone: no prior tail factor before outcomes arrive."""
    return AdmissionPolicy(Limiter(), SloAdmitter(SloConfig(priority_queues=False, calibration_prior=1.0)))


def test_admitted_request_reserves_its_pessimistic_estimate() -> None:
    p = policy()
    d = p.check(req("r1"), IDLE, 0.0)
    assert d.admitted
    assert d.reason is None
    assert d.reserved_tokens == 1500
    assert d.predicted_ttft == pytest.approx(0.15)
    assert d.worker_id == IDLE[0].worker_id  # the replica of the prediction: the router's hint
    # its slack: premium's check, 0.8 × 1 s against 0.15 s predicted at 10k tokens/s, would
    # pass 6,500 more prefill tokens ahead, but the prediction may at most double: 1,500
    assert d.slack_tokens == 1500
    assert p.check(req("r2"), BUSY, 0.0).slack_tokens == 0  # refused: no slack to give
    assert p.limiter.bucket("key:k1:tpm").available(0.0) == 18_500  # type: ignore[union-attr]


def test_quota_refusal_reasons() -> None:
    p = policy()
    for i in range(13):
        assert p.check(req(f"r{i}", rpm_limit=100), IDLE, 0.0).admitted
    d = p.check(req("r13", rpm_limit=100), IDLE, 0.0)  # 13 × 1500 = 19 500 reserved; 1500 more does not fit
    assert (d.admitted, d.reason) == (False, "quota_tokens")
    assert d.retry_after == pytest.approx(1000 / (20_000 / 60))
    p2 = policy()
    for i in range(10):
        assert p2.check(req(f"r{i}", prompt=10, max_tokens=10), IDLE, 0.0).admitted
    d = p2.check(req("r10", prompt=10, max_tokens=10), IDLE, 0.0)
    assert (d.reason, d.retry_after) == ("quota_requests", pytest.approx(6.0))


def test_oversized_request_is_refused_for_good() -> None:
    d = policy().check(req("big", prompt=15_000, max_tokens=8000), IDLE, 0.0)
    assert (d.admitted, d.reason, d.retry_after) == (False, "quota_tokens", 0.0)
    assert "cannot succeed" in d.message


def test_slo_shed_refunds_the_reservation_in_full() -> None:
    p = policy()
    d = p.check(req("r1"), BUSY, 0.0)
    assert (d.admitted, d.reason) == (False, "slo")
    assert d.retry_after == pytest.approx((30_000 + 1000) / 10_000 + 0.05 - 0.8)
    assert d.predicted_ttft == pytest.approx(3.15)
    assert p.limiter.bucket("key:k1:tpm").available(0.0) == 20_000  # type: ignore[union-attr]
    assert p.limiter.bucket("key:k1:rpm").available(0.0) == 10  # type: ignore[union-attr]
    assert len(p.limiter) == 0


def test_no_capacity() -> None:
    d = policy().check(req("r1"), [], 0.0)
    assert (d.admitted, d.reason, d.retry_after) == (False, "no_capacity", 5.0)


def test_an_unknown_fleet_is_not_an_empty_one() -> None:
    """Before admission has read the registry (``replicas`` None) it admits on quota alone,
    with no prediction, where an empty pool refuses: a restarted admission whose registry
    read met a NATS node's failover answered "no replica is serving this model" (chaos soak)."""
    p = policy()
    d, verdict = p.check_verdict(req("r1"), None, 0.0)
    assert (d.admitted, d.reason, d.predicted_ttft, verdict, p.slo_skipped) == (True, None, None, None, 1)
    assert d.reserved_tokens == 1500  # the quota still holds, and reserves as usual
    assert p.on_usage(usage("r1", 1000, 100), 0.0) == 400
    # the quota is checked first, fleet or not
    for i in range(9):
        p.check_verdict(req(f"q{i}", prompt=10, max_tokens=10), None, 0.0)
    refused, _ = p.check_verdict(req("over", prompt=10, max_tokens=10), None, 0.0)
    assert (refused.admitted, refused.reason) == (False, "quota_requests")


def test_usage_reconciles_exactly_once() -> None:
    p = policy()
    p.check(req("r1"), IDLE, 0.0)
    assert p.on_usage(usage("r1", 1000, 120, "cancelled"), 0.0) == 1500 - 1120
    assert p.on_usage(usage("r1", 1000, 120, "cancelled"), 0.0) is None
    assert p.limiter.bucket("key:k1:tpm").available(0.0) == 20_000 - 1120  # type: ignore[union-attr]


def test_every_segment_of_a_migrated_request_is_charged() -> None:
    """Issue 20, item 3: the first segment's usage settles the reservation; the later
    segments' used to go unpaid (the ledger counted them, the key's bucket did not)."""
    p = policy()
    p.check(req("r1"), IDLE, 0.0)
    first = msgspec.structs.replace(usage("r1", 1000, 200, "migrated"), migrations=0)
    assert p.on_usage(first, 0.0) == 1500 - 1200
    later = msgspec.structs.replace(usage("r1", 0, 250), migrations=1)
    assert p.on_usage(later, 0.0) is None  # nothing reserved for it: charged as it is
    assert p.limiter.bucket("key:k1:tpm").available(0.0) == 20_000 - 1200 - 250  # type: ignore[union-attr]
    assert p.limiter.bucket("org:acme:tpm").available(0.0) == 100_000 - 1200 - 250  # type: ignore[union-attr]


def test_usage_of_a_request_rejected_downstream_releases_it() -> None:
    p = policy()
    p.check(req("r1"), IDLE, 0.0)
    assert p.on_usage(usage("r1", 0, 0, "rejected"), 0.0) == 0
    assert p.limiter.bucket("key:k1:rpm").available(0.0) == 10  # type: ignore[union-attr]
    assert p.on_usage(usage("r1", 0, 0, "rejected"), 0.0) is None


def test_admitted_work_feeds_the_queue_mix() -> None:
    p = AdmissionPolicy()
    p.check(req("r1", tier="batch"), IDLE, 0.0)
    assert p.slo.mix.share_at_or_above(2, 0.0) == 0.0  # only batch admitted so far
    assert p.slo.mix.share_at_or_above(0, 0.0) == 1.0


def test_expired_reservations_are_settled() -> None:
    p = policy()
    p.check(req("r1"), IDLE, 0.0)
    assert p.expire(10_000.0) == ["r1"]
    assert p.on_usage(usage("r1", 10, 10), 10_001.0) is None


def test_usage_timings_calibrate_the_tier() -> None:
    p = AdmissionPolicy(Limiter(), SloAdmitter(SloConfig(priority_queues=False, calibration_min_samples=3,
                                                         calibration_floor=0.0, calibration_prior=1.0)))
    for i in range(4):
        assert p.check(req(f"r{i}", rpm_limit=100, tpm_limit=10**6), IDLE, 0.0).admitted  # raw 0.15 s
    assert set(p.predictions) == {"r0", "r1", "r2", "r3"}

    def timed(rid: str, ttft: float, **kw: Any) -> UsageEvent:
        return msgspec.structs.replace(usage(rid, 1000, 10), arrival_time=1000.0, first_token_time=1000.0 + ttft, **kw)

    p.on_usage(timed("r0", 0.225), 1.0)
    p.on_usage(timed("r1", 0.225), 1.0)
    p.on_usage(timed("r2", 3.0, migrations=1), 1.0)  # a migrated segment's times say nothing of the prediction
    assert p.slo.calibration.factor("standard") == pytest.approx(1.5)  # two outcomes: the worst seen
    p.on_usage(timed("r3", 0.3), 1.0)
    assert p.slo.calibration.factor("standard") == pytest.approx(2.0)  # 0.3 s for 0.15 predicted
    assert not p.predictions  # every prediction settled once
    # a prediction whose usage never comes is dropped, not kept forever
    p.check(req("r9", rpm_limit=100, tpm_limit=10**6), IDLE, 0.0)
    p.expire(AdmissionPolicy.prediction_max_age_s + 1)
    assert not p.predictions


def test_gateway_ttft_reports_calibrate_before_the_usage_event() -> None:
    p = AdmissionPolicy(Limiter(), SloAdmitter(SloConfig(priority_queues=False, calibration_min_samples=2, calibration_floor=0.0)))
    for rid in ("a", "b"):
        p.check(req(rid, rpm_limit=100, tpm_limit=10**6), IDLE, 0.0)
    assert p.on_ttft("a", 0.45) and p.on_ttft("b", 0.45)
    assert p.slo.calibration.factor("standard") == pytest.approx(3.0)  # 0.45 s for 0.15 predicted
    assert not p.on_ttft("a", 9.0)  # once per request; an unknown id is ignored
    assert not p.on_ttft("zzz", 9.0)
    # the usage event that follows settles the budget and leaves the calibration alone
    p.on_usage(msgspec.structs.replace(usage("a", 1000, 10), arrival_time=1.0, first_token_time=99.0), 1.0)
    assert p.slo.calibration.factor("standard") == pytest.approx(3.0)


def test_prediction_errors_compare_what_was_decided_with_what_was_seen() -> None:
    p = AdmissionPolicy(Limiter(), SloAdmitter(SloConfig(priority_queues=False, calibration_prior=1.0)))
    actual = {"a": 0.15, "b": 0.3, "c": 0.05, "d": 0.15}  # predicted 0.15 s each (IDLE)
    for rid, ttft in actual.items():
        assert p.check(req(rid, rpm_limit=100, tpm_limit=10**6), IDLE, 0.0).admitted
        p.on_ttft(rid, ttft)
    p.check(req("e", rpm_limit=100, tpm_limit=10**6), IDLE, 0.0)  # no outcome yet: not counted
    errors = p.prediction_errors()["standard"]
    assert errors["n"] == 4
    assert (errors["p1"], errors["p50"], errors["p99"]) == (pytest.approx(0.5), pytest.approx(1.0), pytest.approx(3.0))
    assert (errors["over_2x"], errors["under_2x"]) == (0.25, 0.0)
    assert errors["raw_p50"] == errors["p50"]  # no calibration yet: the formula decided alone
    assert errors["bound_p50"] == errors["p50"]
    # an idle pool (IDLE) teaches the overhead (too few outcomes to use yet)
    assert list(p.slo.calibration.residuals) == pytest.approx([0.0, 0.15, -0.1, 0.0])


def test_worst_predictions_name_the_requests_furthest_off_either_way() -> None:
    p = AdmissionPolicy(Limiter(), SloAdmitter(SloConfig(priority_queues=False, calibration_prior=1.0)))
    actual = {"a": 0.15, "b": 0.6, "c": 0.05, "d": 0.16}  # predicted 0.15 s each (IDLE)
    for i, (rid, ttft) in enumerate(actual.items()):
        assert p.check(req(rid, rpm_limit=100, tpm_limit=10**6), IDLE, 10.0 + i).admitted
        p.on_ttft(rid, ttft)
    worst = p.worst_predictions(k=2)["standard"]
    assert [w["actual_s"] for w in worst] == [0.6, 0.05]  # 4× under, then 3× over
    assert worst[0]["at_s"] == 1.0 and worst[0]["predicted_s"] == pytest.approx(0.15)
    assert AdmissionPolicy().worst_predictions() == {}


def test_an_admitted_request_goes_on_with_the_decisions_replica_slack_reservation_and_hashes() -> None:
    from proto import AdmissionDecision, GenerateRequest, RouteRequest, pack_tokens
    from services.admission.policy import forwarded_route

    generate = GenerateRequest(request_id="r1", model="m", prompt=pack_tokens([1, 2, 3]), token_subject="t",
                               reserved_tokens=900)
    ask = msgspec.structs.replace(req("r1", block_hashes=[11, 12], block_size=16),
                                  route=RouteRequest(request=generate), placement_reply="mesh.placed.gw.r1",
                                  forward_by=100.0)
    admitted = AdmissionDecision(request_id="r1", admitted=True, reserved_tokens=1500, worker_id="w3", slack_tokens=42)
    route = forwarded_route(ask, admitted, now=99.0)
    assert route is not None
    assert (route.prefer_worker, route.prefer_slack_tokens, route.block_hashes, route.block_size) == ("w3", 42, [11, 12], 16)
    assert route.request.reserved_tokens == 1500 and route.request.prompt == generate.prompt
    # Refused, not asked for, or past the gateway's deadline: nothing goes on.
    refused = AdmissionDecision(request_id="r1", admitted=False, reason="slo")
    assert forwarded_route(ask, refused, now=99.0) is None
    assert forwarded_route(ask, admitted, now=100.0) is None
    assert forwarded_route(req("r1"), admitted, now=99.0) is None
