"""The ledger suite, run against SQLite and a real PostgreSQL (skipped only when none is installed).

Idempotency (same usage id twice → counted once, inside a batch and across batches),
totals grouped every way the query allows, time ranges (since inclusive, until
exclusive), time buckets, the error classes the service's retry logic relies on, and
the upgrade of a ledger written by an older schema.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from proto import CapacityEvent, UsageEvent
from services.metering.fleet import capacity_entries
from services.metering.ledger import (
    COLUMNS,
    SCHEMA_VERSION,
    Ledger,
    LedgerEntry,
    LedgerRejected,
    LedgerUnavailable,
    PostgresLedger,
    SqliteLedger,
    columns_at,
    entry_from_event,
    entry_from_row,
    entry_row,
    postgres_schema,
    sqlite_schema,
)
from services.metering.pgserver import PostgresServer, postgres_bin_dir
from services.metering.prices import ModelPrice, PriceTable

PRICES = PriceTable(models={"small": ModelPrice.of(input="0.1", cached_input="0.05", output="0.4"),
                            "big": ModelPrice.of(input=3, cached_input=1, output=15)})
FLEET_PRICES = PriceTable(models=PRICES.models, accelerators={"H100-80GB": 3_000_000_000})  # 3.00 an hour
DAY = 86400.0
T0 = 1_750_032_000.0  # 2025-06-16 00:00:00 UTC: a day boundary


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb on PATH nor in /usr/lib/postgresql/*/bin); "
                    ".ci/run installs Debian's postgresql package")
    server = PostgresServer(bin_dir).start()
    try:
        yield server
    finally:
        server.destroy()


_db_names = itertools.count()


async def fresh_database(server: PostgresServer) -> str:
    import asyncpg

    name = f"ledger_{next(_db_names)}"
    conn = await asyncpg.connect(server.url())
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name}")
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return server.url(name)


async def unopened(backend: str, request: pytest.FixtureRequest, tmp_path: Path, name: str = "ledger") -> Ledger:
    if backend == "sqlite":
        return SqliteLedger(tmp_path / f"{name}.sqlite3")
    return PostgresLedger(await fresh_database(request.getfixturevalue("postgres")))


async def sql(ledger: Ledger, *statements: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run statements on a connection of our own, beside the ledger's; the last one's rows."""
    rows: list[tuple[Any, ...]] = []
    if isinstance(ledger, SqliteLedger):
        conn = sqlite3.connect(ledger.path, isolation_level=None)
        try:
            for statement in statements:
                rows = list(conn.execute(statement, params if "?" in statement else ()).fetchall())
        finally:
            conn.close()
        return rows
    import asyncpg

    assert isinstance(ledger, PostgresLedger)
    conn_pg = await asyncpg.connect(ledger._dsn)
    try:
        for statement in statements:
            rows = [tuple(r) for r in await conn_pg.fetch(statement, *(params if "$1" in statement else ()))]
    finally:
        await conn_pg.close()
    return rows


async def stored_entries(ledger: Ledger) -> list[LedgerEntry]:
    return [entry_from_row(row) for row in await sql(ledger, f"SELECT {', '.join(COLUMNS)} FROM usage_events "
                                                             "ORDER BY usage_id")]


async def table_shape(ledger: Ledger) -> list[tuple[Any, ...]]:
    """usage_events' columns in order: name, type, nullability, default."""
    if isinstance(ledger, SqliteLedger):
        return [row[1:] for row in await sql(ledger, "PRAGMA table_info(usage_events)")]
    return await sql(ledger, "SELECT column_name, data_type, is_nullable, column_default FROM information_schema.columns "
                             "WHERE table_name = 'usage_events' ORDER BY ordinal_position")


@pytest.fixture(params=["sqlite", "postgresql"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ledger]:
    opened = await unopened(request.param, request, tmp_path)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def make(request_id: str, *, org: str = "acme", key: str = "k1", model: str = "small", prompt: int = 100,
         cached: int = 0, completion: int = 10, status: str = "finished", at: float = T0 + 60, migrations: int = 0,
         tier: str = "standard", worker: str = "w1", user: str = "",
         metadata: dict[str, str] | None = None, base_model: str = "", region: str = "") -> LedgerEntry:
    event = UsageEvent(request_id=request_id, org=org, key_id=key, model=model, prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion, status=status,  # type: ignore[arg-type]
                       arrival_time=at - 1, finish_time=at, migrations=migrations, tier=tier, worker_id=worker,
                       user=user, metadata=metadata or {}, base_model=base_model, region=region)
    return entry_from_event(event, PRICES, recorded_at=at + 1, stream_seq=1)


async def test_totals_by_region(ledger: Ledger) -> None:
    """Where requests ran (DESIGN.md, Regions): ``meshserve usage --group-by region``."""
    await ledger.record([make("a", prompt=10, region="eu"), make("b", prompt=20, region="eu"),
                         make("c", prompt=40, region="us"), make("d", prompt=80)])
    rows = {r.region: (r.requests, r.prompt_tokens) for r in await ledger.totals(group_by=["region"])}
    assert rows == {"eu": (2, 30), "us": (1, 40), "": (1, 80)}


async def test_same_usage_id_twice_is_counted_once(ledger: Ledger) -> None:
    first = make("r1", prompt=100, completion=10)
    assert await ledger.record([first]) == 1
    # a redelivery (same id) in a later batch: ignored, even if its content differs
    assert await ledger.record([make("r1", prompt=999, completion=999), make("r2")]) == 1
    # the same id twice inside one batch
    assert await ledger.record([make("r3"), make("r3")]) == 1
    (row,) = await ledger.totals(group_by=[])
    assert row.requests == 3
    assert row.prompt_tokens == 300 and row.completion_tokens == 30  # the first r1 won
    assert await ledger.record([]) == 0


async def test_migration_segments_are_distinct_usage(ledger: Ledger) -> None:
    assert await ledger.record([make("r1", completion=5), make("r1", completion=7, migrations=1)]) == 2
    assert await ledger.record([make("r1", completion=7, migrations=1)]) == 0
    (row,) = await ledger.totals(group_by=[])
    # one request (usage showed 2), its two segments' rows and tokens
    assert row.requests == 1 and row.completion_tokens == 12 and sum(row.by_status.values()) == 2


async def test_every_field_is_stored(ledger: Ledger, tmp_path: Path) -> None:
    metadata = {"project": "apollo", "quote\"s": "{\"not\": \"json\"}\\", "ключ": "\U0001f600", "": ""}
    entry = make("r-all", prompt=123, cached=45, completion=67, status="cancelled", migrations=3, tier="premium",
                 worker="w-9", user="end-user-42", metadata=metadata)
    await ledger.record([entry, make("r-plain")])
    (row,) = await sql(ledger, "SELECT * FROM usage_events WHERE usage_id = 'r-all#m3'")
    assert row == entry_row(entry)  # every column, in COLUMNS' order; metadata as JSON text
    assert row[COLUMNS.index("end_user")] == "end-user-42"
    # read back: metadata a dict again, and an event without any gets {}
    assert await stored_entries(ledger) == [entry, make("r-plain")]


# ---- schema versions ----------------------------------------------------------------------
# A ledger as schema 1 created it (before end_user and metadata), for the upgrade test.
V1_MARK = "INSERT INTO ledger_meta (name, value) VALUES ('schema', '1')"
V1_SQLITE = (*sqlite_schema(1), V1_MARK)
V1_POSTGRES = (*postgres_schema(1), V1_MARK)
V1_COLUMNS = columns_at(1)
assert V1_COLUMNS == COLUMNS[: COLUMNS.index("spend_nano") + 1]  # what schema 1 had: its last column


async def schema_version(ledger: Ledger) -> str:
    (row,) = await sql(ledger, "SELECT value FROM ledger_meta WHERE name = 'schema'")
    return str(row[0])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_a_version_1_ledger_is_upgraded_in_place(request: pytest.FixtureRequest, tmp_path: Path,
                                                       backend: str) -> None:
    old = make("old", prompt=11, completion=3, at=T0 + 5)
    ledger = await unopened(backend, request, tmp_path, "v1")
    is_sqlite = isinstance(ledger, SqliteLedger)
    insert_old = (f"INSERT INTO usage_events ({', '.join(V1_COLUMNS)}) VALUES ("
                  + ", ".join("?" if is_sqlite else f"${i + 1}" for i in range(len(V1_COLUMNS))) + ")")
    await sql(ledger, *(V1_SQLITE if is_sqlite else V1_POSTGRES), insert_old,
              params=entry_row(old)[:len(V1_COLUMNS)])

    await ledger.open()
    try:
        assert await schema_version(ledger) == str(SCHEMA_VERSION) == "5"
        assert await stored_entries(ledger) == [old]  # user '', metadata {}, base_model '' and region ''
        adapter = make("adapter", prompt=1, completion=1, base_model="base-m")
        assert await ledger.record([adapter]) == 1
        assert [e.base_model for e in await stored_entries(ledger) if e.usage_id == "adapter"] == ["base-m"]
        new = make("new", prompt=7, completion=2, user="u-1", metadata={"team": "search"})
        assert await ledger.record([new, old]) == 1  # the old row still dedups
        assert [e for e in await stored_entries(ledger) if e.usage_id != "adapter"] == [new, old]
        (row,) = await ledger.totals(group_by=[])
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (3, 19, 6)
        # the upgraded table is the one a new ledger gets: same columns, order, types, defaults
        fresh = await unopened(backend, request, tmp_path, "fresh")
        await fresh.open()
        try:
            assert await table_shape(ledger) == await table_shape(fresh)
        finally:
            await fresh.close()
    finally:
        await ledger.close()
    await ledger.open()  # a second open finds nothing to do
    try:
        assert await schema_version(ledger) == "5"
        assert sorted(e.usage_id for e in await stored_entries(ledger)) == ["adapter", "new", "old"]
        # version 4's table came with the upgrade: a capacity period is written and reported
        assert await ledger.record([], capacity_entries(period("w1", T0, T0 + 60), FLEET_PRICES, recorded_at=T0)) == 1
        (fleet_row,) = await ledger.fleet(group_by=[])
        assert (fleet_row.replica_s, fleet_row.accelerator_s, fleet_row.requests) == (60.0, 60.0, 3)
    finally:
        await ledger.close()


async def test_a_newer_ledger_is_refused_untouched(ledger: Ledger) -> None:
    await ledger.record([make("r1")])
    await ledger.close()
    await sql(ledger, f"UPDATE ledger_meta SET value = '{SCHEMA_VERSION + 1}' WHERE name = 'schema'")
    with pytest.raises(LedgerRejected, match=f"ledger schema {SCHEMA_VERSION + 1}"):
        await ledger.open()
    assert await schema_version(ledger) == str(SCHEMA_VERSION + 1)
    assert [e.usage_id for e in await stored_entries(ledger)] == ["r1"]


async def test_totals_grouping_and_spend(ledger: Ledger) -> None:
    entries = [
        make("a1", org="acme", key="k1", model="small", prompt=1000, cached=400, completion=100),
        make("a2", org="acme", key="k1", model="big", prompt=2000, cached=0, completion=500, status="cancelled"),
        make("a3", org="acme", key="k2", model="small", prompt=10, completion=0, status="rejected"),
        make("b1", org="beta", key="k3", model="big", prompt=50, cached=50, completion=5, tier="premium"),
    ]
    assert await ledger.record(entries) == 4
    by_key_model = await ledger.totals(group_by=["org", "key", "model"])
    assert [(r.org, r.key_id, r.model) for r in by_key_model] == [
        ("acme", "k1", "big"), ("acme", "k1", "small"), ("acme", "k2", "small"), ("beta", "k3", "big")]
    for row in by_key_model:
        assert row.tier is None and row.status is None and row.bucket is None
    by_org = {r.org: r for r in await ledger.totals(group_by=["org"])}
    acme = by_org["acme"]
    assert (acme.requests, acme.prompt_tokens, acme.cached_tokens, acme.completion_tokens) == (3, 3010, 400, 600)
    assert acme.by_status == {"finished": 1, "cancelled": 1, "rejected": 1}
    # spend: a1 = 600×0.1 + 400×0.05 + 100×0.4 = 120 per M; a2 = 2000×3 + 500×15 = 13500 per M; a3 free (rejected)
    assert acme.spend_nano == 120 * 1000 + 13500 * 1000
    assert by_org["beta"].spend_nano == 50 * 1000 + 5 * 15000
    assert sum(r.spend_nano for r in by_org.values()) == sum(e.spend_nano for e in entries)
    by_status = {r.status: r.requests for r in await ledger.totals(group_by=["status"])}
    assert by_status == {"finished": 2, "cancelled": 1, "rejected": 1}
    by_tier = {r.tier: r.requests for r in await ledger.totals(group_by=["tier"])}
    assert by_tier == {"standard": 3, "premium": 1}
    by_worker = await ledger.totals(group_by=["worker"])
    assert [(r.worker_id, r.requests) for r in by_worker] == [("w1", 4)]
    # filters
    (k1,) = await ledger.totals(org="acme", key_id="k1", group_by=["key"])
    assert k1.key_id == "k1" and k1.requests == 2
    (big,) = await ledger.totals(model="big", group_by=[])
    assert big.requests == 2 and big.org is None
    assert await ledger.totals(org="nobody") == []


async def test_time_ranges_are_half_open(ledger: Ledger) -> None:
    times = [T0, T0 + 10, T0 + 20, T0 + 30]
    await ledger.record([make(f"r{i}", at=t, completion=i + 1) for i, t in enumerate(times)])

    async def completions(since: float | None, until: float | None) -> int:
        rows = await ledger.totals(since=since, until=until, group_by=[])
        return rows[0].completion_tokens if rows else 0

    assert await completions(None, None) == 1 + 2 + 3 + 4
    assert await completions(T0 + 10, T0 + 30) == 2 + 3  # since inclusive, until exclusive
    assert await completions(T0 + 10.5, None) == 3 + 4
    assert await completions(None, T0) == 0
    assert await completions(T0 + 30, T0 + 30) == 0
    (row,) = await ledger.totals(since=T0, until=T0 + 31, group_by=[])
    assert (row.first_at, row.last_at) == (T0, T0 + 30)


async def test_hour_and_day_buckets(ledger: Ledger) -> None:
    await ledger.record([
        make("d1a", at=T0 + 5), make("d1b", at=T0 + 3600 + 5), make("d1c", at=T0 + DAY - 1),
        make("d2a", at=T0 + DAY), make("d2b", at=T0 + DAY + 7200 + 1),
    ])
    days = await ledger.totals(group_by=["day"])
    assert [(r.bucket, r.requests) for r in days] == [(T0, 3), (T0 + DAY, 2)]
    hours = await ledger.totals(since=T0, until=T0 + DAY, group_by=["hour"])
    assert [(r.bucket, r.requests) for r in hours] == [(T0, 1), (T0 + 3600, 1), (T0 + DAY - 3600, 1)]
    per_model_day = await ledger.totals(group_by=["model", "day"])
    assert [(r.model, r.bucket) for r in per_model_day] == [("small", T0), ("small", T0 + DAY)]


async def test_hostile_strings_round_trip(ledger: Ledger) -> None:
    org = "o'; DROP TABLE usage_events; --\u202e\U0001f600"
    await ledger.record([make("x1", org=org, key="k\x00ey")])
    (row,) = await ledger.totals(org=org, group_by=["org", "key"])
    assert row.org == org and row.key_id == "key"


async def test_concurrent_writers_and_readers(ledger: Ledger) -> None:
    rng = random.Random(7)
    batches = [[make(f"c{b}-{i}", completion=rng.randrange(50)) for i in range(50)] for b in range(8)]
    # the same batches twice, concurrently with queries: every id lands exactly once
    results = await asyncio.gather(*(ledger.record(b) for b in batches + batches),
                                   *(ledger.totals(group_by=["org"]) for _ in range(8)))
    inserted = [r for r in results if isinstance(r, int)]
    assert sum(inserted) == 400
    (row,) = await ledger.totals(group_by=[])
    assert row.requests == 400
    assert row.completion_tokens == sum(e.completion_tokens for b in batches for e in b)


async def test_reopen_keeps_the_data(ledger: Ledger) -> None:
    await ledger.record([make("p1"), make("p2")])
    await ledger.close()
    await ledger.open()
    assert await ledger.record([make("p1"), make("p3")]) == 1
    (row,) = await ledger.totals(group_by=[])
    assert row.requests == 3


# ---- errors the service relies on ---------------------------------------------------------
async def test_sqlite_lock_is_unavailable_not_rejected(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = SqliteLedger(path, busy_timeout_s=0.1)
    await ledger.open()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(LedgerUnavailable):
            await ledger.record([make("l1")])
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert await ledger.record([make("l1")]) == 1  # nothing half-written before
    await ledger.close()
    with pytest.raises(LedgerUnavailable):
        await ledger.record([make("l2")])


async def test_sqlite_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(LedgerUnavailable):
        await SqliteLedger(tmp_path / "file" / "ledger.sqlite3").open()


async def test_constraint_violation_is_rejected_and_rolls_back_the_batch(ledger: Ledger) -> None:
    bad = LedgerEntry(**{**{f: getattr(make("n1"), f) for f in LedgerEntry.__slots__}, "org": None})  # type: ignore[arg-type]
    with pytest.raises(LedgerRejected):
        await ledger.record([make("ok"), bad])
    assert await ledger.totals(group_by=[]) == []  # one transaction: "ok" was rolled back too
    assert await ledger.record([make("ok")]) == 1


async def test_postgres_down_is_unavailable_and_recovers(postgres: PostgresServer) -> None:
    ledger = PostgresLedger(await fresh_database(postgres), timeout_s=2.0)
    await ledger.open()
    assert await ledger.record([make("u1")]) == 1
    postgres.stop("immediate")
    try:
        with pytest.raises(LedgerUnavailable):
            await ledger.record([make("u2")])
        with pytest.raises(LedgerUnavailable):
            await ledger.totals()
    finally:
        postgres.start()
    # the pool replaces its dead connections: the same ledger object works again
    for _ in range(20):
        try:
            assert await ledger.record([make("u2"), make("u1")]) == 1
            break
        except LedgerUnavailable:
            await asyncio.sleep(0.25)
    (row,) = await ledger.totals(group_by=[])
    assert row.requests == 2
    await ledger.close()


async def test_postgres_unreachable_at_open_is_unavailable() -> None:
    from services.metering.pgserver import _free_port

    with pytest.raises(LedgerUnavailable):
        await PostgresLedger(f"postgresql://x@127.0.0.1:{_free_port()}/none", timeout_s=1.0).open()


# ---- capacity periods and the fleet report --------------------------------------------------
def period(worker: str, start: float, end: float, *, model: str = "small", busy: float = 0.0,
           accelerator: str = "H100-80GB", accelerators: int = 1, held: dict[str, float] | None = None) -> CapacityEvent:
    return CapacityEvent(event_id=f"{worker}:{round(start * 1000)}", worker_id=worker, model=model, engine="sim",
                         accelerator=accelerator, accelerators=accelerators, start=start, end=end, busy_s=busy,
                         held_s=held if held is not None else {model: end - start})


async def test_fleet_cost_beside_the_usage_it_served(ledger: Ledger) -> None:
    rows = [
        *capacity_entries(period("w1", T0, T0 + 3600, busy=1800), FLEET_PRICES, recorded_at=T0),
        *capacity_entries(period("w2", T0, T0 + 3600, busy=900, accelerators=2), FLEET_PRICES, recorded_at=T0),
        # an accelerator without a price: counted, not costed
        *capacity_entries(period("w3", T0, T0 + 1800, model="big", accelerator="TPU-v9"), FLEET_PRICES, recorded_at=T0),
    ]
    usage = [make("u1", model="small", worker="w1", prompt=600_000, completion=400_000, at=T0 + 100),
             make("u2", model="small", worker="w2", prompt=1_000_000, completion=0, at=T0 + 200),
             make("u3", model="lora-a", base_model="small", worker="w2", prompt=0, completion=1_000_000, at=T0 + 300),
             make("u4", model="big", worker="", prompt=5, completion=0, status="rejected", at=T0 + 400)]
    assert await ledger.record(usage, rows) == 7
    assert await ledger.record(usage[:1], rows[:1]) == 0  # redelivered: counted once

    by_model = {row.model: row for row in await ledger.fleet(group_by=["model"])}
    small = by_model["small"]
    assert (small.replica_s, small.accelerator_s, small.busy_s) == (7200.0, 3 * 3600.0, 2700.0)
    assert small.cost_nano == 9_000_000_000 and small.utilisation == 2700 / 7200
    assert (small.requests, small.prompt_tokens, small.completion_tokens) == (3, 1_600_000, 1_400_000)  # the adapter's too
    assert small.cost_per_million(3_000_000) == 3.0
    big = by_model["big"]
    assert (big.accelerator_s, big.cost_nano, big.unpriced_accelerator_s, big.requests) == (1800.0, 0, 1800.0, 1)

    by_accelerator = {row.accelerator: row for row in await ledger.fleet(group_by=["accelerator"])}
    assert by_accelerator["H100-80GB"].requests == 3 and by_accelerator["H100-80GB"].cost_nano == 9_000_000_000
    assert by_accelerator["TPU-v9"].accelerator_s == 1800.0 and by_accelerator["TPU-v9"].requests == 0
    assert by_accelerator[""].requests == 1  # served by no worker: on no accelerator

    late = await ledger.fleet(model="small", group_by=["worker"], since=T0 + 3000, until=T0 + 3601)
    assert [(r.worker_id, r.replica_s, r.requests) for r in late] == [("w1", 3600.0, 0), ("w2", 3600.0, 0)]
    # a period counts at its end
    assert await ledger.fleet(model="small", group_by=["model"], since=T0 + 3600.5) == []
    hours = await ledger.fleet(group_by=["hour"], model="big")
    assert [(r.bucket, r.accelerator_s) for r in hours] == [(T0, 1800.0)]


async def test_a_hot_swap_hosts_time_is_split_among_its_models(ledger: Ledger) -> None:
    # 60 s on one accelerator: model a held 40 % of the host's memory, b 25 % for half the
    # period, and the rest was unallocated ("").
    event = period("host-a", T0, T0 + 60, model="a", busy=30, held={"a": 24.0, "": 28.5})
    other = period("host-b", T0, T0 + 60, model="b", held={"b": 7.5})
    entries = capacity_entries(event, FLEET_PRICES, recorded_at=T0) + capacity_entries(other, FLEET_PRICES, recorded_at=T0)
    await ledger.record([], entries)
    rows = {row.model: row for row in await ledger.fleet(group_by=["model"])}
    assert {m: r.accelerator_s for m, r in rows.items()} == {"": 28.5, "a": 24.0, "b": 7.5}
    assert sum(r.accelerator_s for r in rows.values()) == 60.0
    assert (rows["a"].replica_s, rows["a"].busy_s, rows[""].replica_s) == (60.0, 30.0, 0.0)
