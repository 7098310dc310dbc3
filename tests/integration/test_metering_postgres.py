"""The metering service on a PostgreSQL ledger, through a PostgreSQL outage.

PostgreSQL is stopped while usage keeps arriving: metering stops fetching, the events
wait in the USAGE stream, and once PostgreSQL is back every one of them is written
exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from bus import Bus, BusSettings, provision
from proto import UsageEvent, usage_dedup_id
from proto.metering import UsageQuery, UsageReport
from services.metering.ledger import PostgresLedger
from services.metering.pgserver import PostgresServer, postgres_bin_dir
from services.metering.service import MeteringConfig, MeteringService


@pytest.fixture
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


def make(i: int) -> UsageEvent:
    return UsageEvent(request_id=f"pg-{i}", org=f"org{i % 3}", key_id="k", model="m", prompt_tokens=100 + i,
                      cached_tokens=i % 50, completion_tokens=i, finish_time=1_750_000_000.0 + i)


async def publish(bus: Bus, events: list[UsageEvent]) -> None:
    await asyncio.gather(*(bus.js_publish(bus.subjects.usage(e.org), e, msg_id=usage_dedup_id(e.request_id))
                           for e in events))


async def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_postgres_outage_loses_nothing(bus: Bus, bus_settings: BusSettings, postgres: PostgresServer) -> None:
    await provision(bus.js, bus.subjects)
    # max_ack_pending above everything published: what bounds the events in flight below is
    # metering holding its batch, not the server's limit.
    config = MeteringConfig(ledger_url=postgres.url(), ack_wait_s=3.0, fetch_timeout_s=0.2, batch_size=50,
                            max_ack_pending=1000, backoff_max_s=0.5)
    svc = MeteringService(config, bus_settings, ledger=PostgresLedger(postgres.url(), timeout_s=2.0))
    await svc.start()
    try:
        before = [make(i) for i in range(100)]
        await publish(bus, before)
        await eventually(lambda: svc.events_written == 100, 20, "events before the outage")

        postgres.stop("immediate")  # a crash, not a polite shutdown
        during = [make(i) for i in range(100, 400)]
        await publish(bus, during)
        await eventually(lambda: svc.ledger_errors >= 2, 20, "failed writes")
        # Stopped fetching: the batch being retried is held, and at most one more batch
        # reached the client, delivered to a pull request of a fetch that timed out just as
        # the events arrived (nats-py keeps such messages for the next fetch, which waits).
        info = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
        assert info.num_ack_pending <= 2 * config.batch_size and info.num_ack_pending + info.num_pending == 300
        await asyncio.sleep(1.0)  # several fetch timeouts: a fetching loop would have taken more
        later = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
        assert later.num_ack_pending == info.num_ack_pending and later.num_pending == info.num_pending > 0
        assert svc.events_written == 100 and svc.stats()["ledger_ok"] is False

        postgres.start()
        await eventually(lambda: svc.events_written == 400, 30, "the backlog after PostgreSQL returns")
        report = await bus.request(bus.subjects.metering_usage, UsageQuery(group_by=["org"]), UsageReport, timeout=5)
        everything = before + during
        for row in report.rows:
            mine = [e for e in everything if e.org == row.org]
            assert (row.requests, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
                len(mine), sum(e.prompt_tokens for e in mine), sum(e.cached_tokens for e in mine),
                sum(e.completion_tokens for e in mine))
        assert sum(r.requests for r in report.rows) == 400
        assert svc.duplicates == 0
    finally:
        await svc.drain_and_close()
