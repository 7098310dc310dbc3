"""What the fleet costs, the pure parts: a worker's capacity meter, a hot-swap host's split
of its accelerators, accelerator prices, and capacity events into priced ledger rows.
The ledger's queries run against SQLite and PostgreSQL in test_metering_ledger.py; the
whole path (workers → USAGE → metering → ``meshserve usage --fleet``) in
tests/integration/test_fleet_cost_mesh.py."""

from __future__ import annotations

import contextlib

import pytest

from proto import CapacityEvent, SamplingParams
from services.metering.fleet import capacity_entries
from services.metering.ledger_rows import InvalidEvent
from services.metering.prices import PriceTable, hourly_cost_nano, parse_prices
from services.worker.capacity import CapacityMeter
from services.worker.config import WorkerConfig
from services.worker.engines.base import EngineRequest
from services.worker.engines.echo import EchoEngine
from services.worker.engines.hosted import HostedEngine, ModelHost
from services.worker.engines.sim import SimEngine
from services.worker.registration import accelerator_of

T0 = 1_750_000_000.0


# ---- the worker's meter -------------------------------------------------------------------
def test_busy_time_is_exact_to_the_request_and_periods_follow_each_other() -> None:
    meter = CapacityMeter(worker_id="w1", model="m", accelerator="H100-80GB", accelerators=2, start=T0, engine="sim")
    meter.observe(T0 + 10, busy=True)
    meter.observe(T0 + 12, busy=True)  # a second request: still busy, nothing counted twice
    meter.observe(T0 + 25, busy=False)
    first = meter.close(T0 + 60)
    assert first is not None
    assert (first.event_id, first.start, first.end, first.busy_s) == (f"w1:{round(T0 * 1000)}", T0, T0 + 60, 15.0)
    assert (first.accelerator, first.accelerators, first.held_s) == ("H100-80GB", 2, {"m": 60.0})
    meter.observe(T0 + 70, busy=True)
    second = meter.close(T0 + 90)  # busy across the boundary: the next period goes on counting
    assert second is not None
    assert (second.start, second.busy_s, second.held_s) == (T0 + 60, 20.0, {"m": 30.0})
    assert second.event_id != first.event_id
    third = meter.close(T0 + 100)
    assert third is not None and third.busy_s == 10.0
    # a clock stepping back adds nothing and takes nothing away
    meter.observe(T0 + 95, busy=False)
    last = meter.close(T0 + 110)
    assert last is not None and last.busy_s == 0.0
    assert meter.close(T0 + 110) is None  # no time passed: no empty period, whose id the next would repeat
    stepped_back = meter.close(T0 + 108)
    assert stepped_back is None and meter.start == T0 + 110
    following = meter.close(T0 + 120)
    assert following is not None and (following.start, following.end, following.held_s) == (T0 + 110, T0 + 120,
                                                                                              {"m": 10.0})


def test_shares_change_as_models_load_and_go() -> None:
    meter = CapacityMeter(worker_id="h1-a", model="a", accelerator="H100", accelerators=1, start=T0)
    meter.observe(T0, shares={"a": 0.0, "": 1.0})  # cold: the host's memory unallocated
    meter.observe(T0 + 20, shares={"a": 0.25, "": 0.75})  # loaded
    event = meter.close(T0 + 60)
    assert event is not None and event.held_s == {"a": 10.0, "": 50.0}
    assert sum(event.held_s.values()) == 60.0  # the accelerator, counted once


def test_a_host_splits_its_accelerators_by_memory_and_reports_what_is_free_once() -> None:
    host = ModelHost("h1", 40.0)
    models = {m: HostedEngine(host, lambda m=m: SimEngine(model=m, profile="tiny-test", speed=50.0),  # type: ignore[misc]
                              footprint_gib=10, load_s=0.01) for m in ("a", "b")}
    # both cold: a (the host's first) reports the whole host unallocated; b reports nothing held
    assert models["a"].capacity_shares() == {"a": 0.0, "": 1.0}
    assert models["b"].capacity_shares() == {"b": 0.0}
    models["a"].residency = "resident"
    assert models["a"].capacity_shares() == {"a": 0.25, "": 0.75}
    assert models["a"].accelerator == ("sim", 1)  # the tiny profile names no hardware


async def test_loading_a_model_moves_its_share_from_unallocated() -> None:
    host = ModelHost("h1", 40.0)
    models = {m: HostedEngine(host, lambda m=m: SimEngine(model=m, profile="tiny-test", speed=50.0),  # type: ignore[misc]
                              footprint_gib=10, load_s=0.01, extra_load_s=0.01) for m in ("a", "b")}
    for engine in models.values():
        await engine.start()
    try:
        request = EngineRequest(request_id="r1", prompt_token_ids=[40, 41, 42],
                                sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        async with contextlib.aclosing(models["b"].generate(request)) as stream:
            assert [o async for o in stream][-1].finished
        assert models["b"].capacity_shares() == {"b": 0.25}
        assert models["a"].capacity_shares() == {"a": 0.0, "": 0.75}
    finally:
        for engine in models.values():
            await engine.shutdown()


def test_what_a_worker_runs_on_its_flags_or_its_engines() -> None:
    sim = SimEngine(speed=50.0)  # the H100 profile
    assert accelerator_of(sim, WorkerConfig()) == ("H100-80GB", 1)
    assert accelerator_of(sim, WorkerConfig(accelerator="A100-80GB", accelerators=4)) == ("A100-80GB", 4)
    assert accelerator_of(EchoEngine(model="e"), WorkerConfig()) == ("none", 0)


# ---- prices -------------------------------------------------------------------------------
def test_an_accelerator_is_priced_by_its_name_or_the_longest_key_inside_it() -> None:
    table = parse_prices("""
        [accelerators."H100"]
        per_hour = 2.50
        [accelerators."H100-80GB-HBM3"]
        per_hour = 2.99
        [accelerators."a100"]
        per_hour = 1.20
    """, toml=True)
    assert table.accelerator_price("h100") == 2_500_000_000
    assert table.accelerator_price("NVIDIA H100 80GB HBM3") == 2_990_000_000  # the longer key wins
    assert table.accelerator_price("NVIDIA A100-SXM4-80GB") == 1_200_000_000
    assert table.accelerator_price("L40S") is None  # no price, and no "*"
    assert table.accelerator_price("NVIDIA A1000") is None  # whole words only: no A100 inside an A1000
    small = parse_prices('[accelerators."L4"]\nper_hour = 0.8\n[accelerators."A10"]\nper_hour = 1.0', toml=True)
    assert small.accelerator_price("NVIDIA L4") == 800_000_000
    assert small.accelerator_price("NVIDIA L40S") is None and small.accelerator_price("NVIDIA A100-SXM4-80GB") is None
    with_default = PriceTable(accelerators={"*": 500_000_000})
    assert with_default.accelerator_price("L40S") == 500_000_000


@pytest.mark.parametrize("text, problem", [
    ('[accelerators."H100"]\nhourly = 2.5', "per_hour"),
    ('[accelerators."H100"]\nper_hour = 2.5\nspot = 1.0', "per_hour"),
    ('[accelerators."H100"]\nper_hour = -1', ">= 0"),
    ('accelerators = 3', "table"),
])
def test_a_bad_accelerator_price_is_refused_with_its_name(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_prices(text, toml=True)


def test_cost_is_rounded_once_half_up_to_a_nano_unit() -> None:
    assert hourly_cost_nano(3_600_000_000, 1.0) == 1_000_000  # 3.60 an hour: 0.001 a second
    assert hourly_cost_nano(1, 1800.0) == 1  # half a nano rounds up
    assert hourly_cost_nano(1, 1799.0) == 0
    assert hourly_cost_nano(2_990_000_000, 0.1) == 83_056  # 0.1 s of 2.99 an hour


# ---- capacity events into ledger rows ------------------------------------------------------------
PRICES = PriceTable(accelerators={"H100": 3_600_000_000})


def event(**changes: object) -> CapacityEvent:
    fields: dict[str, object] = {"event_id": "w1:1", "worker_id": "w1", "model": "m", "accelerator": "H100-80GB",
                                 "accelerators": 2, "start": T0, "end": T0 + 60, "busy_s": 30.0,
                                 "held_s": {"m": 60.0}}
    fields.update(changes)
    return CapacityEvent(**fields)  # type: ignore[arg-type]


def test_a_period_becomes_a_priced_row_per_model() -> None:
    (row,) = capacity_entries(event(), PRICES, recorded_at=T0 + 61, stream_seq=7)
    assert (row.entry_id, row.replica_s, row.busy_s, row.accelerator_s) == ("w1:1/m", 60.0, 30.0, 120.0)
    assert (row.price_per_hour_nano, row.priced, row.cost_nano, row.ts) == (3_600_000_000, 1, 120_000_000, T0 + 60)
    host = capacity_entries(event(held_s={"m": 15.0, "": 45.0}), PRICES, recorded_at=T0)
    assert [(r.model, r.replica_s, r.busy_s, r.accelerator_s) for r in host] == [("", 0.0, 0.0, 90.0),
                                                                                  ("m", 60.0, 30.0, 30.0)]
    # a hosted model that held nothing in the period still reports its replica and busy time
    (cold,) = capacity_entries(event(held_s={}, busy_s=0.0), PRICES, recorded_at=T0)
    assert (cold.model, cold.replica_s, cold.accelerator_s, cold.cost_nano) == ("m", 60.0, 0.0, 0)
    (unpriced,) = capacity_entries(event(accelerator="TPU"), PRICES, recorded_at=T0)
    assert (unpriced.priced, unpriced.cost_nano, unpriced.accelerator_s) == (0, 0, 120.0)


@pytest.mark.parametrize("changes, problem", [
    ({"worker_id": ""}, "worker_id"),
    ({"end": T0 - 1}, "time range"),
    ({"start": float("nan")}, "time range"),
    ({"end": T0 + 8 * 86400, "held_s": {}}, "longer than"),
    ({"accelerators": -1}, "accelerators"),
    ({"busy_s": 61.0}, "busy_s"),
    ({"held_s": {"m": 70.0}}, "held_s"),
    ({"held_s": {"m": 40.0, "": 40.0}}, "counted twice"),
    ({"held_s": {"m": -1.0}}, "held_s"),
])
def test_a_capacity_event_that_cannot_be_true_is_refused(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidEvent, match=problem):
        capacity_entries(event(**changes), PRICES, recorded_at=T0)
