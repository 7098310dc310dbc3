"""The metering service on a real nats-server: exact totals, idempotency, hostile input,
ledger outages (backpressure), drain, and ``meshserve usage``.

The service runs in-process here; ``test_metering_crash.py`` runs it as a process and
kills it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js import api

from bus import Bus, BusSettings, provision
from proto import CapacityEvent, ErrorCode, RemoteError, UsageEvent, usage_dedup_id
from proto.metering import FleetQuery, FleetReport, UsageQuery, UsageReport
from services.metering.fleet import CapacityEntry
from services.metering.ledger import COLUMNS, LedgerEntry, SqliteLedger, entry_from_row
from services.metering.prices import ModelPrice, PriceTable
from services.metering.service import MeteringConfig, MeteringService

REPO = Path(__file__).resolve().parents[2]
PRICES = PriceTable(models={"small": ModelPrice.of(input="0.1", cached_input="0.05", output="0.4"),
                            "*": ModelPrice.of(input=1, output=2)})
T0 = 1_750_000_000.0


def make_events(n: int, seed: int = 1, prefix: str = "req") -> list[UsageEvent]:
    rng = random.Random(seed)
    events = []
    for i in range(n):
        prompt = rng.randrange(1, 4000)
        events.append(UsageEvent(
            request_id=f"{prefix}-{i}", org=rng.choice(["acme", "beta", "gamma.co"]), key_id=rng.choice(["k1", "k2"]),
            model=rng.choice(["small", "meta-llama/Llama-3.1-8B"]), worker_id="w1", prompt_tokens=prompt,
            cached_tokens=rng.randrange(0, prompt + 1), completion_tokens=rng.randrange(0, 1000),
            status=rng.choice(["finished", "finished", "length", "cancelled", "failed"]),  # type: ignore[arg-type]
            arrival_time=T0 + i, first_token_time=T0 + i + 0.1, finish_time=T0 + i + 1.0,
        ))
    return events


def expected_totals(events: Sequence[UsageEvent], dims: Sequence[str]) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """requests, prompt, cached, completion, spend per group, computed here independently of the ledger."""
    out: dict[tuple[Any, ...], list[int]] = {}
    for e in events:
        key = tuple(getattr(e, d) for d in dims)
        charge = PRICES.charge(e.model, e.status, e.prompt_tokens, e.cached_tokens, e.completion_tokens)
        sums = out.setdefault(key, [0, 0, 0, 0, 0])
        for i, value in enumerate((1, e.prompt_tokens, e.cached_tokens, e.completion_tokens, charge.spend_nano)):
            sums[i] += value
    return {k: tuple(v) for k, v in out.items()}


def report_totals(report: UsageReport, fields: Sequence[str]) -> dict[tuple[Any, ...], tuple[int, ...]]:
    return {tuple(getattr(r, f) for f in fields): (r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                                                   r.spend_nano) for r in report.rows}


async def publish(bus: Bus, events: Sequence[UsageEvent], concurrency: int = 64) -> None:
    for start in range(0, len(events), concurrency):
        await asyncio.gather(*(bus.js_publish(bus.subjects.usage(e.org), e, msg_id=usage_dedup_id(e.request_id, e.migrations))
                               for e in events[start:start + concurrency]))


async def eventually(check: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float = 20.0,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def consumer(bus: Bus, durable: str = "metering") -> api.ConsumerInfo:
    return await bus.js.consumer_info(bus.subjects.usage_stream, durable)


def config(tmp_path: Path, **overrides: Any) -> MeteringConfig:
    base: dict[str, Any] = dict(ledger_url=str(tmp_path / "ledger.sqlite3"), prices=PRICES, ack_wait_s=3.0,
                                fetch_timeout_s=0.2, batch_size=64, backoff_max_s=0.5)
    base.update(overrides)
    return MeteringConfig(**base)


@pytest.fixture
async def provisioned(bus: Bus) -> Bus:
    await provision(bus.js, bus.subjects)
    return bus


@pytest.fixture
async def metering(provisioned: Bus, bus_settings: BusSettings, tmp_path: Path) -> AsyncIterator[MeteringService]:
    svc = MeteringService(config(tmp_path), bus_settings)
    await svc.start()
    try:
        yield svc
    finally:
        if not svc.stopped.is_set():
            await svc.drain_and_close()


async def query(bus: Bus, **fields: Any) -> UsageReport:
    return await bus.request(bus.subjects.metering_usage, UsageQuery(**fields), UsageReport, timeout=5.0)


# ---- exact totals -----------------------------------------------------------------------
async def test_totals_are_exact_per_org_key_model(provisioned: Bus, metering: MeteringService) -> None:
    bus = provisioned
    events = make_events(500)
    await publish(bus, events)
    await eventually(lambda: metering.events_written == 500, what="500 events written")

    report = await query(bus, group_by=["org", "key", "model"])
    assert report_totals(report, ["org", "key_id", "model"]) == expected_totals(events, ["org", "key_id", "model"])
    assert report.currency == "USD" and not report.truncated
    by_status = await query(bus, group_by=["status"])
    assert report_totals(by_status, ["status"]) == expected_totals(events, ["status"])
    # filters and a time range: since inclusive, until exclusive, on the finish time
    acme = await query(bus, org="acme", since=T0 + 100.0, until=T0 + 301.0, group_by=["model"])
    chosen = [e for e in events if e.org == "acme" and T0 + 100 <= e.finish_time < T0 + 301]
    assert report_totals(acme, ["model"]) == expected_totals(chosen, ["model"])
    limited = await query(bus, group_by=["org", "key", "model"], limit=2)
    assert len(limited.rows) == 2 and limited.truncated
    info = await consumer(bus)
    assert info.num_pending == 0 and info.num_ack_pending == 0
    assert metering.stats()["lag"] == 0 and metering.stats()["ledger_ok"] is True


async def test_redelivered_and_republished_events_count_once(provisioned: Bus, metering: MeteringService) -> None:
    bus = provisioned
    events = make_events(100, seed=2)
    await publish(bus, events)
    await eventually(lambda: metering.events_written == 100, what="100 written")
    # Same msg ids: JetStream's duplicate window drops them before they reach the stream.
    await publish(bus, events[:30])
    # Different msg ids (a publish after the window, a buggy retry): the ledger's key drops them.
    for e in events[30:60]:
        await bus.js_publish(bus.subjects.usage(e.org), e, msg_id=f"other-{e.request_id}")
    await eventually(lambda: metering.duplicates == 30, what="30 duplicates")
    assert metering.events_written == 100
    report = await query(bus, group_by=["org"])
    assert report_totals(report, ["org"]) == expected_totals(events, ["org"])


# ---- hostile input ------------------------------------------------------------------------
async def test_hostile_bytes_are_terminated_not_redelivered(provisioned: Bus, metering: MeteringService) -> None:
    bus = provisioned
    events = make_events(40, seed=3)
    subject = bus.subjects.usage("acme")
    await publish(bus, events[:20])
    await bus.js.publish(subject, b"\xc1\xff\x00 not msgpack")
    await bus.js.publish(subject, msgspec.msgpack.encode({"hello": "world"}))
    await bus.js.publish(subject, msgspec.msgpack.encode([1, 2, 3] * 1000))
    await bus.js.publish(subject, msgspec.msgpack.encode(
        {"v": 2, "request_id": "future", "org": "acme", "key_id": "k", "model": "m"}))
    await bus.js.publish(subject, msgspec.msgpack.encode(
        {"v": 1, "request_id": "neg", "org": "acme", "key_id": "k", "model": "m", "prompt_tokens": -5}))
    await bus.js.publish(subject, msgspec.msgpack.encode(
        {"v": 1, "request_id": "", "org": "acme", "key_id": "k", "model": "m"}))
    await publish(bus, events[20:])
    await eventually(lambda: metering.events_written == 40, what="the valid events")
    await eventually(lambda: metering.decode_errors == 3 and metering.unsupported_version == 1
                     and metering.invalid_events == 2, what="bad events counted")
    # terminated, not pending: after more than ack_wait nothing comes back
    await asyncio.sleep(metering.config.ack_wait_s + 0.5)
    info = await consumer(bus)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    assert (metering.decode_errors, metering.unsupported_version, metering.invalid_events) == (3, 1, 2)
    report = await query(bus, group_by=["org"])
    assert report_totals(report, ["org"]) == expected_totals(events, ["org"])


async def test_capacity_events_are_recorded_once_and_bad_ones_terminated(provisioned: Bus,
                                                                         metering: MeteringService) -> None:
    bus = provisioned
    good = CapacityEvent(event_id="w1:1", worker_id="w1", model="small", accelerator="H100-80GB", accelerators=1,
                         start=T0, end=T0 + 60, busy_s=12.0, held_s={"small": 60.0})
    twice = CapacityEvent(event_id="w1:2", worker_id="w1", model="small", accelerator="H100-80GB", accelerators=1,
                          start=T0 + 60, end=T0 + 120, held_s={"small": 60.0, "": 60.0})  # counts the GPU twice
    subject = bus.subjects.capacity("w1")
    for message in (good, twice):
        await bus.js_publish_until_stored(subject, message, msg_id=message.event_id)
    await bus.js.publish(subject, b"\xc1 not msgpack")
    await bus.js_publish_until_stored(subject, good, msg_id="w1:1-again")  # a copy past dedup: counted once
    await publish(bus, make_events(5, seed=4))
    await eventually(lambda: metering.capacity_events == 2 and metering.invalid_events == 1
                     and metering.decode_errors == 1 and metering.events_written == 5, what="events handled")
    assert (metering.capacity_rows_written, metering.duplicates) == (1, 0)
    # what metering could not record stays in CAPACITY, to be replayed
    assert (await bus.js.stream_info(bus.subjects.capacity_stream)).state.messages == 4
    report = await bus.request(bus.subjects.metering_fleet, FleetQuery(group_by=["model"]), FleetReport, timeout=5)
    row = next(r for r in report.rows if r.model == "small")
    assert (row.replica_s, row.busy_s, row.accelerator_s, row.cost_nano) == (60.0, 12.0, 60.0, 0)  # unpriced here
    assert row.unpriced_accelerator_s == 60.0
    with pytest.raises(RemoteError) as bad:
        await bus.request(bus.subjects.metering_fleet, FleetQuery(group_by=["org"]),  # type: ignore[list-item]
                          FleetReport, timeout=5)
    assert bad.value.code == ErrorCode.DECODE and "group_by" in str(bad.value)  # the contract's Literal


async def test_user_and_metadata_reach_the_ledger(provisioned: Bus, metering: MeteringService,
                                                  tmp_path: Path) -> None:
    bus = provisioned
    base: dict[str, Any] = dict(org="acme", key_id="k1", model="small", prompt_tokens=10, completion_tokens=2,
                                finish_time=T0)
    tagged = UsageEvent(request_id="tagged", user="end-user-9", metadata={"project": "apollo", "run": "7"}, **base)
    plain = UsageEvent(request_id="plain", **base)
    too_much = UsageEvent(request_id="too-much", metadata={f"k{i}": "v" for i in range(17)}, **base)  # over OpenAI's 16
    await publish(bus, [tagged, plain, too_much])
    await eventually(lambda: metering.events_written == 2 and metering.invalid_events == 1, what="events handled")
    conn = sqlite3.connect(tmp_path / "ledger.sqlite3")
    try:
        rows = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_events ORDER BY usage_id").fetchall()
    finally:
        conn.close()
    assert [(e.usage_id, e.user, e.metadata) for e in map(entry_from_row, rows)] == [
        ("plain", "", {}), ("tagged", "end-user-9", {"project": "apollo", "run": "7"})]


async def test_bad_queries_get_typed_errors(provisioned: Bus, metering: MeteringService) -> None:
    bus = provisioned
    with pytest.raises(RemoteError) as caught:
        await query(bus, group_by=["org", "org"])
    assert caught.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RemoteError) as caught:
        await query(bus, since=10.0, until=1.0)
    assert caught.value.code == ErrorCode.BAD_REQUEST
    # raw garbage on the query subject: an error reply, and the endpoint lives on
    reply = await bus.nc.request(bus.subjects.metering_usage, b"\x00\x01garbage", timeout=5.0)
    assert reply.headers and "Nats-Service-Error" in reply.headers
    assert (await query(bus, group_by=[])).rows == []


# ---- backpressure: the ledger is down -------------------------------------------------
async def test_ledger_outage_holds_events_in_the_stream(provisioned: Bus, bus_settings: BusSettings,
                                                        tmp_path: Path) -> None:
    bus = provisioned
    path = tmp_path / "ledger.sqlite3"
    ledger = SqliteLedger(path, busy_timeout_s=0.05)
    await ledger.open()
    # Another process holds the write lock: every commit fails with "database is locked".
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    events = make_events(200, seed=4)
    await publish(bus, events)
    svc = MeteringService(config(tmp_path, batch_size=50, max_ack_pending=100), bus_settings, ledger=ledger)
    await svc.start()
    try:
        await eventually(lambda: svc.ledger_errors >= 3, what="failed commits")
        # It stopped fetching: one batch held unacked, the rest waits in the stream.
        info = await consumer(bus)
        assert (info.num_ack_pending, info.num_pending) == (50, 150)
        assert svc.events_written == 0 and svc.stats()["ledger_ok"] is False
        # Longer than ack_wait: in_progress keeps the held batch from being redelivered.
        await asyncio.sleep(svc.config.ack_wait_s * 1.5)
        info = await consumer(bus)
        assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (50, 150, 0)
        blocker.execute("ROLLBACK")
        blocker.close()
        await eventually(lambda: svc.events_written == 200, what="the backlog written after recovery")
        assert svc.duplicates == 0 and svc.stats()["ledger_ok"] is True
        report = await query(bus, group_by=["org", "model"])
        assert report_totals(report, ["org", "model"]) == expected_totals(events, ["org", "model"])
    finally:
        await svc.drain_and_close()


async def test_ledger_unavailable_at_start_then_recovers(provisioned: Bus, bus_settings: BusSettings,
                                                         tmp_path: Path) -> None:
    bus = provisioned
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the ledger's folder should be")
    svc = MeteringService(config(tmp_path, ledger_url=str(blocked / "ledger.sqlite3")), bus_settings)
    await svc.start()  # starts anyway: answers queries with an error, consumes nothing
    try:
        events = make_events(30, seed=5)
        await publish(bus, events)
        await eventually(lambda: svc.ledger_errors >= 2, what="open retries")
        with pytest.raises(RemoteError, match="unavailable"):
            await query(bus)
        assert (await consumer(bus)).num_pending == 30
        blocked.unlink()
        await eventually(lambda: svc.events_written == 30, what="written once the ledger opens")
        assert report_totals(await query(bus, group_by=["org"]), ["org"]) == expected_totals(events, ["org"])
    finally:
        await svc.drain_and_close()


# ---- crash between commit and ack; drain ----------------------------------------------
class GatedLedger(SqliteLedger):
    """Commits, then waits at a gate before returning (the acks come after the return)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = asyncio.Event()
        self.committed = asyncio.Event()

    async def record(self, entries: Sequence[LedgerEntry], capacity: Sequence[CapacityEntry] = ()) -> int:
        inserted = await super().record(entries, capacity)
        self.committed.set()
        await self.gate.wait()
        return inserted


async def test_crash_between_commit_and_ack_counts_nothing_twice(provisioned: Bus, bus_settings: BusSettings,
                                                                 tmp_path: Path) -> None:
    bus = provisioned
    events = make_events(60, seed=6)
    await publish(bus, events)
    path = tmp_path / "ledger.sqlite3"
    gated = GatedLedger(path)
    first = MeteringService(config(tmp_path, batch_size=100), bus_settings, ledger=gated)
    await first.start()
    await asyncio.wait_for(gated.committed.wait(), 10)
    # "Crash": the connection goes away with the batch committed but never acked.
    await first.bus.nc.close()
    for task in list(first._tasks):
        task.cancel()
    second = MeteringService(config(tmp_path, batch_size=100), bus_settings)
    await second.start()
    try:
        await eventually(lambda: second.duplicates == 60, timeout=first.config.ack_wait_s + 10,
                         what="the redelivered batch recognised as duplicates")
        assert second.events_written == 0 and second.redelivered == 60
        report = await query(bus, group_by=["org", "key", "model"])
        assert report_totals(report, ["org", "key_id", "model"]) == expected_totals(events, ["org", "key_id", "model"])
    finally:
        await second.drain_and_close()
        await gated.close()


async def test_drain_finishes_the_batch_in_progress(provisioned: Bus, bus_settings: BusSettings,
                                                    tmp_path: Path) -> None:
    bus = provisioned
    events = make_events(40, seed=7)
    await publish(bus, events)
    gated = GatedLedger(tmp_path / "ledger.sqlite3")
    svc = MeteringService(config(tmp_path, batch_size=100), bus_settings, ledger=gated)
    await svc.start()
    await asyncio.wait_for(gated.committed.wait(), 10)
    drain = asyncio.create_task(svc.drain_and_close())
    await asyncio.sleep(0.3)
    assert not drain.done()  # the drain waits for the commit's acks
    gated.gate.set()
    assert await asyncio.wait_for(drain, 10) is True
    info = await consumer(bus)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    reopened = SqliteLedger(tmp_path / "ledger.sqlite3")
    await reopened.open()
    (row,) = await reopened.totals(group_by=[])
    assert row.requests == 40
    await reopened.close()


async def test_drain_with_the_ledger_down_hands_the_batch_back(provisioned: Bus, bus_settings: BusSettings,
                                                               tmp_path: Path) -> None:
    bus = provisioned
    path = tmp_path / "ledger.sqlite3"
    events = make_events(30, seed=8)
    await publish(bus, events)
    # a long ack_wait: only the nak can make these come back quickly
    slow = config(tmp_path, ack_wait_s=60.0)
    ledger = SqliteLedger(path, busy_timeout_s=0.05)
    await ledger.open()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    first = MeteringService(slow, bus_settings, ledger=ledger)
    await first.start()
    await eventually(lambda: first.ledger_errors >= 1, what="a failed commit")
    started = time.monotonic()
    assert await first.drain_and_close() is True
    assert time.monotonic() - started < 5.0
    blocker.execute("ROLLBACK")
    blocker.close()
    second = MeteringService(slow, bus_settings)
    await second.start()
    try:
        await eventually(lambda: second.events_written == 30, timeout=10, what="the handed-back batch")
    finally:
        await second.drain_and_close()


# ---- meshserve usage ------------------------------------------------------------------
async def test_meshserve_usage_cli(provisioned: Bus, metering: MeteringService, nats_url: str) -> None:
    bus = provisioned
    events = make_events(50, seed=9)
    await publish(bus, events)
    await eventually(lambda: metering.events_written == 50, what="written")

    async def cli(*argv: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ops.cli", "usage", "--nats-url", nats_url, *argv, cwd=REPO,
            env={**os.environ, "COLUMNS": "200"}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    rc, out, err = await cli("--group-by", "org,model", "--since", str(T0), "--json")
    assert rc == 0, err
    body = json.loads(out)
    got = {(r["org"], r["model"]): (r["requests"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"],
                                    r["spend_nano"]) for r in body["data"]}
    assert got == expected_totals(events, ["org", "model"])
    rc, out, err = await cli("--org", "acme", "--group-by", "key,day")
    assert rc == 0, err
    acme = [e for e in events if e.org == "acme"]
    assert "k1" in out and "total" in out and f"{len(acme):,}" in out
    rc, _, err = await cli("--since", "last tuesday")
    assert rc == 2 and "not a time" in err


async def test_restart_with_new_limits_updates_the_durable_consumer(provisioned: Bus, bus_settings: BusSettings,
                                                                    tmp_path: Path) -> None:
    bus = provisioned
    first = MeteringService(config(tmp_path, ack_wait_s=30.0, max_ack_pending=1000), bus_settings)
    await first.start()
    await publish(bus, make_events(10, seed=10))
    await eventually(lambda: first.events_written == 10, what="written")
    await first.drain_and_close()
    second = MeteringService(config(tmp_path, ack_wait_s=5.0, max_ack_pending=300), bus_settings)
    await second.start()
    try:
        info = await consumer(bus)
        assert (info.config.ack_wait, info.config.max_ack_pending) == (5.0, 300)
        assert info.config.ack_policy == api.AckPolicy.EXPLICIT and info.config.max_deliver == -1
        # the durable kept its position: nothing is consumed twice
        await publish(bus, make_events(5, seed=11, prefix="later"))
        await eventually(lambda: second.events_written == 5, what="only the new events")
        assert second.duplicates == 0
    finally:
        await second.drain_and_close()


async def test_usage_stream_recreated_the_durable_is_created_again(provisioned: Bus, metering: MeteringService) -> None:
    """USAGE deleted and provisioned again (an operator, a recovery) takes metering's durable
    consumer with it: metering creates it again and bills what the new stream holds."""
    bus = provisioned
    await publish(bus, make_events(3, seed=12, prefix="before"))
    await eventually(lambda: metering.events_written == 3, what="the first events written")
    await bus.js.delete_stream(bus.subjects.usage_stream)
    await asyncio.sleep(0.5)  # a few fetches (0.2 s each) find no stream
    await provision(bus.js, bus.subjects)
    await publish(bus, make_events(4, seed=13, prefix="after"))
    await eventually(lambda: metering.events_written == 7, what="the new stream's events written")
    assert (await consumer(bus)).config.durable_name == metering.config.durable


async def test_metrics_show_the_ledger_and_what_could_not_be_billed(provisioned: Bus, bus_settings: BusSettings,
                                                                    tmp_path: Path) -> None:
    """Metering exported nothing: a ledger down or events not billed were seen only in its
    log and $SRV.STATS."""
    import aiohttp

    svc = MeteringService(config(tmp_path, metrics_port=0), bus_settings)
    await svc.start()
    try:
        assert svc.metrics_port
        events = make_events(30, seed=9)
        await publish(provisioned, events)
        await provisioned.js.publish(provisioned.subjects.usage("acme"), b"\xc1 not msgpack")
        await eventually(lambda: svc.events_written == 30 and svc.decode_errors == 1, what="events handled")
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{svc.metrics_port}/metrics") as r:
            text = await r.text()
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        assert values["meshserve:metering_events_written_total"] == 30
        assert values['meshserve:metering_events_not_billed_total{reason="undecodable"}'] == 1
        assert values["meshserve:metering_ledger_up"] == 1
        assert values["meshserve:metering_last_commit_timestamp_seconds"] > 0
        assert values["meshserve:metering_lag_events"] >= 0
        assert values["meshserve:metering_capacity_lag_events"] == 0
        assert values["meshserve:metering_capacity_events_total"] == 0
    finally:
        await svc.drain_and_close()
