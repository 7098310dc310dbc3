"""The autoscaler's pure bookkeeping (``services.autoscaler.tracking``): launch
tracking, pending demand, the decision log."""

from __future__ import annotations

from services.autoscaler.control import PoolController, PoolObservation, PoolPolicy
from services.autoscaler.tracking import DecisionLog, LaunchTracker, PendingDemand


def test_launch_tracker_redeems_by_id_and_anonymously() -> None:
    tracker = LaunchTracker(timeout_s=60)
    tracker.observe("m", ["old-1"])  # present before any launch: not a launch
    tracker.launched("m", 2, now=0.0, worker_ids=["m-a", "m-b"])
    tracker.launched("n", 2, now=0.0)  # an orchestrator names none
    assert tracker.starting("m") == 2 and tracker.starting("n") == 2
    tracker.observe("m", ["old-1", "m-a", "stranger"])  # a stranger does not redeem a named launch
    assert tracker.starting("m") == 1
    tracker.observe("n", ["n-x"])
    tracker.observe("n", ["n-x"])  # seen once only
    assert tracker.starting("n") == 1
    assert [t.worker_id for t in tracker.ended(["m-b"])] == ["m-b"]  # died before its first gauge
    assert tracker.starting("m") == 0
    expired = tracker.expire(now=60.0)
    assert [(t.pool, t.worker_id) for t in expired] == [("n", None)] and tracker.starting("n") == 0


def test_pending_demand_sums_sources_and_expires() -> None:
    demand = PendingDemand(ttl_s=10)
    demand.report("m", 3, 300, now=0.0, source="gw-1")
    demand.report("m", 2, 100, now=5.0, source="gw-2")
    demand.report("m", 1, 50, now=6.0, source="gw-1")  # the latest report of a source wins
    assert demand.get("m", now=7.0) == (3, 150)
    assert demand.get("other", now=7.0) == (0, 0)
    assert demand.get("m", now=15.5) == (1, 50)  # gw-2 (at 5.0) expired, gw-1 (at 6.0) not yet
    demand.report("m", 0, 0, now=17.0, source="gw-2")
    assert demand.get("m", now=17.0) == (0, 0)


def test_decision_log_keeps_actions_and_changed_holds() -> None:
    ctrl = PoolController(PoolPolicy(pool="m", min_replicas=1, max_replicas=4, scale_down_cooldown_s=0))
    log = DecisionLog(size=3)
    for t in range(5):  # five identical holds on an empty pool... after one scale up
        decision = ctrl.decide(PoolObservation(starting=1 if t else 0), float(t))
        log.add(decision)
    actions = [r.action for r in log.records]
    assert actions == ["scale_up", "hold"]
    assert log.latest is not None and log.latest.at == 4.0
    assert "scale up 0 → 1" in log.records[0].reason
