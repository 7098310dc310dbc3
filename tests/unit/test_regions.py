"""Regions (DESIGN.md, Regions): a request stays in the region it entered by while that
region has room, takes a farther one only when the wait it saves outweighs the round
trip, and never leaves its key's regions — in the router and in admission's prediction
(the gateway's own placement, without a router: tests/integration/test_router.py)."""

from __future__ import annotations

import argparse
import random

import pytest

from proto import WorkerInfo
from proto.messages import AdmissionRequest
from services.admission.replicas import BookConfig, ReplicaBook
from services.admission.slo import ReplicaLoad, SloAdmitter, SloConfig
from services.common.cli_types import region_name, region_names
from services.common.fleet import FleetView
from services.common.regions import RegionLatency, by_distance, parse_regions
from services.router.decision import NoCapacity, RouteQuery
from services.router.policy import PolicyConfig, Router, RouterConfig
from tests.unit.test_router_policy import decided, set_load

MODEL = "llama"
PROMPT = list(range(64))


def regional_view(**regions: int) -> FleetView:
    """``eu=2, us=2``: workers ``eu-0``, ``eu-1``, ``us-0``, ``us-1`` in their regions."""
    v = FleetView()
    for region, n in regions.items():
        for i in range(n):
            v.update_worker(WorkerInfo(worker_id=f"{region}-{i}", model=MODEL, engine="sim", state="ready",
                                       region=region), 0.0)
    return v


def regional_router(v: FleetView, latency: RegionLatency | None = None, **kw: object) -> Router:
    cfg = RouterConfig(default=PolicyConfig(**kw), regions=latency or RegionLatency())  # type: ignore[arg-type]
    return Router(v, cfg, random.Random(0))


def rq(rid: str = "r", region: str = "eu", regions: tuple[str, ...] = (), **kw: object) -> RouteQuery:
    return RouteQuery.of(rid, MODEL, PROMPT, region=region, regions=regions, **kw)


# ---- round trips ----


def test_round_trips_parse_with_a_default_and_pairs() -> None:
    lat = RegionLatency.parse("40,eu:us=85, us:ap=120")
    assert lat.rtt("eu", "us") == lat.rtt("us", "eu") == pytest.approx(0.085)
    assert lat.rtt("eu", "ap") == pytest.approx(0.040)  # no pair: the default
    assert lat.rtt("eu", "eu") == lat.rtt("", "us") == 0.0
    assert RegionLatency.parse("").rtt("a", "b") == pytest.approx(0.050)
    for bad in ("fast", "-5", "eu:eu=3", "eu=3", "EU:us=3", "eu:us=20000"):
        with pytest.raises(ValueError, match="--region-rtt-ms"):
            RegionLatency.parse(bad)


def test_region_names_are_checked() -> None:
    assert region_name("eu-west-1") == "eu-west-1"
    assert parse_regions("eu, us,eu") == ["eu", "us"]
    assert region_names("eu") == ["eu"]
    for empty in ("", " , "):  # an empty shell variable must not make a key allowed everywhere
        with pytest.raises(argparse.ArgumentTypeError, match="no region named"):
            region_names(empty)
    for bad in ("EU", "eu west", "-eu", "a" * 64, "eu.west"):
        with pytest.raises(argparse.ArgumentTypeError):
            region_name(bad)


def test_groups_come_nearest_first_with_the_requests_own_region_leading() -> None:
    v = regional_view(us=1, ap=1, eu=1)
    lat = RegionLatency.parse("100,eu:us=80")
    workers = list(v.pool(MODEL) or [])
    assert [g.region for g in by_distance("eu", workers, lat)] == ["eu", "us", "ap"]
    assert [g.region for g in by_distance("sa", workers, lat)] == ["ap", "eu", "us"]  # none of its own: nearest (ties by name)
    assert len(by_distance("", workers, lat)) == 1  # a request with no region: one group, as before regions


# ---- the router ----


def test_an_idle_or_moderately_busy_region_keeps_its_traffic() -> None:
    v = regional_view(eu=2, us=2)
    r = regional_router(v)
    placed = [decided(r.place(rq(f"r{i}"), 0.5)) for i in range(6)]
    assert {d.worker_id[:2] for d in placed} == {"eu"}
    assert all(d.region == "eu" and "outside" not in d.note for d in placed)
    # eu busy but within the round trip (50 ms at 10k tokens/s = 500 tokens) plus the
    # margin (2,048): an idle us takes none of it
    v2 = regional_view(eu=2, us=2)
    for wid in ("eu-0", "eu-1"):
        set_load(v2, wid, queued=1900)
    assert decided(regional_router(v2).decide(rq(), 0.5)).worker_id.startswith("eu")


def test_an_overloaded_region_spills_to_its_neighbour() -> None:
    v = regional_view(eu=2, us=2)
    for wid in ("eu-0", "eu-1"):
        set_load(v, wid, queued=20_000)
    d = decided(regional_router(v).decide(rq(), 0.5))
    assert d.worker_id.startswith("us") and d.region == "us" and "outside eu" in d.note
    # the round trip counts at the near worker's own prefill rate: at 100k tokens/s 3 s
    # away is 300k tokens of its prefill, more than its queue
    for wid in ("eu-0", "eu-1"):
        set_load(v, wid, queued=20_000, ts=2.0, prefill_tokens_per_s=100_000.0)
    far = regional_router(v, RegionLatency.parse("3000"))
    assert decided(far.decide(rq(), 0.5)).worker_id.startswith("eu")


def test_a_busy_neighbour_is_no_relief() -> None:
    v = regional_view(eu=1, us=1)
    set_load(v, "eu-0", queued=20_000)
    set_load(v, "us-0", queued=19_000)  # saves 1,000 tokens: less than the trip and the margin
    assert decided(regional_router(v).decide(rq(), 0.5)).worker_id == "eu-0"
    # saves 8,000, but us has no spare capacity either: with both regions past their knee,
    # moving requests between them only splits their caches (benchmarks/regions.py, 100 %:100 %)
    set_load(v, "us-0", queued=12_000, ts=2.0)
    assert decided(regional_router(v).decide(rq(), 0.5)).worker_id == "eu-0"
    set_load(v, "us-0", queued=1_000, ts=3.0)
    assert decided(regional_router(v).decide(rq(), 0.5)).worker_id == "us-0"


def test_the_nearest_region_serves_a_request_whose_own_has_no_worker() -> None:
    v = regional_view(eu=1, us=1)
    lat = RegionLatency.parse("150,ap:us=90")
    d = decided(regional_router(v, lat).decide(rq(region="ap"), 0.5))
    assert d.worker_id == "us-0" and "outside ap" in d.note  # ap has none; us is nearest (90 ms against 150)
    # ... and with no worker in its own region the farther ones still compete on wait
    v2 = regional_view(us=1, eu=1)
    set_load(v2, "us-0", queued=30_000)
    assert decided(regional_router(v2, lat).decide(rq(region="ap"), 0.5)).worker_id == "eu-0"


def test_residency_is_never_left_even_under_overload() -> None:
    v = regional_view(eu=1, us=2)
    set_load(v, "eu-0", queued=50_000)
    d = decided(regional_router(v).decide(rq(regions=("eu",)), 0.5))
    assert d.worker_id == "eu-0"
    set_load(v, "eu-0", queued=0, ts=2.0, draining=True)
    refused = regional_router(v).decide(rq(regions=("eu",)), 0.5)
    assert isinstance(refused, NoCapacity) and refused.reason == "no_eligible_worker"
    assert "in region eu" in refused.message
    # a key allowed both regions spills as any other request
    set_load(v, "eu-0", queued=50_000, ts=3.0)
    assert decided(regional_router(v).decide(rq(regions=("eu", "us")), 0.5)).worker_id.startswith("us")


def test_admissions_replica_abroad_is_followed_once_the_trip_is_paid() -> None:
    """Admission chose a replica in another region because none in the request's own met
    the SLO: the router weighs the round trip alone, without its usual margin."""
    v = regional_view(eu=1, us=1)
    set_load(v, "eu-0", queued=1500)  # wait 1,564: above the 500-token trip, below trip + margin
    plain = decided(regional_router(v).decide(rq(), 0.5))
    assert plain.worker_id == "eu-0"
    hinted = decided(regional_router(v).decide(rq(prefer_worker="us-0", prefer_slack_tokens=100), 0.5))
    assert hinted.worker_id == "us-0"


def test_a_prefill_worker_is_chosen_in_the_decode_workers_region_only() -> None:
    v = FleetView()
    for wid, region, role in (("eu-0", "eu", "both"), ("us-p", "us", "prefill")):
        v.update_worker(WorkerInfo(worker_id=wid, model=MODEL, engine="sim", state="ready", region=region,
                                   role=role, disaggregation=True), 0.0)  # type: ignore[arg-type]
    long_prompt = list(range(2000))
    d = decided(regional_router(v).decide(RouteQuery.of("r", MODEL, long_prompt, region="eu", disaggregable=True), 0.5))
    assert (d.worker_id, d.prefill_worker) == ("eu-0", "")  # its KV would cross an ocean
    v.update_worker(WorkerInfo(worker_id="eu-p", model=MODEL, engine="sim", state="ready", region="eu",
                               role="prefill", disaggregation=True), 0.0)
    d = decided(regional_router(v).decide(RouteQuery.of("r", MODEL, long_prompt, region="eu", disaggregable=True), 0.5))
    assert (d.worker_id, d.prefill_worker) == ("eu-0", "eu-p")


def test_a_hinted_region_behind_a_nearer_one_is_still_weighed() -> None:
    """Admission's replica is in the farthest region: a nearer one the margin rules out
    does not end the search."""
    v = regional_view(eu=1, us=1, ap=1)
    set_load(v, "eu-0", queued=2_000)  # wait 2,064
    set_load(v, "us-0", queued=1_500)  # 30 ms away: saves 500 tokens, less than its trip + margin
    lat = RegionLatency.parse("30,eu:ap=60")  # ap: 600 tokens of trip at 10k tokens/s
    hinted = decided(regional_router(v, lat).decide(rq(prefer_worker="ap-0", prefer_slack_tokens=10), 0.5))
    assert hinted.worker_id == "ap-0" and hinted.region == "ap"


def test_judging_a_farther_region_moves_no_policy_state() -> None:
    """Round robin at home keeps its turns while a neighbour is judged and not taken."""
    v = regional_view(eu=2, us=1)
    for wid in ("eu-0", "eu-1"):
        set_load(v, wid, queued=5_000)
    set_load(v, "us-0", queued=4_000)  # no spare capacity: judged, never taken
    r = regional_router(v, policy="round_robin")
    picks = [decided(r.decide(rq(f"r{i}"), 0.5)).worker_id for i in range(4)]
    assert picks == ["eu-0", "eu-1", "eu-0", "eu-1"]
    set_load(v, "us-0", queued=0, ts=2.0)  # spare now: round robin's overflow spills there
    assert decided(r.decide(rq("s"), 0.5)).worker_id == "us-0"


# ---- admission ----


def _book() -> ReplicaBook:
    book = ReplicaBook(BookConfig(regions=RegionLatency.parse("80")))
    for wid, region in (("eu-0", "eu"), ("us-0", "us")):
        book.update_worker(WorkerInfo(worker_id=wid, model=MODEL, engine="sim", state="ready", region=region), 0.0)
    return book


def _admission_request(**kw: object) -> AdmissionRequest:
    return AdmissionRequest(request_id="r", org="o", key_id="k", model=MODEL, prompt_tokens=64, max_tokens=8,
                            **kw)  # type: ignore[arg-type]


def test_admission_counts_the_round_trip_and_the_keys_regions() -> None:
    book = _book()
    loads = {r.worker_id: r.network_s for r in book.loads(_admission_request(region="eu"), 0.0)}
    assert loads == {"eu-0": 0.0, "us-0": pytest.approx(0.080)}
    assert [r.worker_id for r in book.loads(_admission_request(region="us", regions=["eu"]), 0.0)] == ["eu-0"]
    assert {r.network_s for r in book.loads(_admission_request(), 0.0)} == {0.0}  # no region: as before


def test_admission_keeps_a_request_home_while_home_meets_its_slo() -> None:
    slo = SloAdmitter(SloConfig(calibration_prior=1.0, priority_queues=False))
    home = ReplicaLoad(worker_id="eu-0", queued_prefill_tokens=4000, prefill_tokens_per_s=10_000.0, step_time_s=0.02)
    abroad = ReplicaLoad(worker_id="us-0", prefill_tokens_per_s=10_000.0, step_time_s=0.02, network_s=0.08)
    v = slo.check("standard", 500, [home, abroad], 0.0)
    assert v.admitted and v.worker_id == "eu-0"  # 0.47 s at home meets the SLO: the faster 0.11 s abroad waits
    assert slo.predict(abroad, 500, "standard", 0.0) == pytest.approx(0.05 + 0.02 + 0.08)
    swamped = ReplicaLoad(worker_id="eu-0", queued_prefill_tokens=400_000, prefill_tokens_per_s=10_000.0, step_time_s=0.02)
    v = slo.check("standard", 500, [swamped, abroad], 0.0)
    assert v.admitted and v.worker_id == "us-0"  # home breaks it: the neighbour takes the overflow
