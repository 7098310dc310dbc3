"""How fast the ledger writes usage events, alone and end to end through NATS.

    python -m services.metering.bench --ledger-url sqlite:////tmp/bench.sqlite3 --events 50000
    python -m services.metering.bench --ledger-url postgresql://user@host/db --batch-size 64,256,1024
    python -m services.metering.bench --nats-url nats://127.0.0.1:4222 --events 20000   # + end to end

``ledger`` rows: ``Ledger.record`` in batches (one transaction each) into a fresh ledger.
``end-to-end`` row (with ``--nats-url``, a JetStream server): the events are published
into USAGE first (under a private subject root, so a real mesh's data is untouched),
then a MeteringService drains the backlog: fetch, decode, price, commit, ack.
Figures depend on the disk (SQLite commits fsync with ``synchronous=FULL``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import uuid
from pathlib import Path

from proto.messages import UsageEvent, usage_dedup_id

from .ledger import Ledger, LedgerEntry, SqliteLedger, entry_from_event, ledger_from_url
from .prices import ModelPrice, PriceTable

PRICES = PriceTable(models={"*": ModelPrice.of(input="0.1", cached_input="0.05", output="0.4")})


def make_events(n: int, tag: str) -> list[UsageEvent]:
    rng = random.Random(0)
    return [
        UsageEvent(request_id=f"{tag}-{i}", org=f"org{rng.randrange(50)}", key_id=f"key{rng.randrange(500)}",
                   model="sim-llama-8b", worker_id="w1", prompt_tokens=rng.randrange(1, 8000),
                   cached_tokens=rng.randrange(0, 4000), completion_tokens=rng.randrange(1, 1000),
                   arrival_time=1.75e9 + i, first_token_time=1.75e9 + i + 0.1, finish_time=1.75e9 + i + 2)
        for i in range(n)
    ]


def fresh_ledger(url: str | None, tmp: Path, tag: str) -> Ledger:
    if url is None:
        return SqliteLedger(tmp / f"{tag}.sqlite3")
    if url.startswith("sqlite") or "://" not in url:
        path = Path(url.removeprefix("sqlite:///"))
        return SqliteLedger(path.with_name(f"{path.stem}-{tag}{path.suffix}"))
    return ledger_from_url(url)  # PostgreSQL: ids carry a unique tag, so a shared table is fine


async def bench_ledger(url: str | None, n: int, batch: int, tmp: Path) -> float:
    tag = uuid.uuid4().hex[:8]
    entries: list[LedgerEntry] = [entry_from_event(e, PRICES, recorded_at=time.time()) for e in make_events(n, tag)]
    ledger = fresh_ledger(url, tmp, tag)
    await ledger.open()
    try:
        started = time.perf_counter()
        written = 0
        for i in range(0, n, batch):
            written += await ledger.record(entries[i:i + batch])
        elapsed = time.perf_counter() - started
        assert written == n, (written, n)
        # a redelivery of everything: how fast duplicates are ignored
        started = time.perf_counter()
        for i in range(0, n, batch):
            assert await ledger.record(entries[i:i + batch]) == 0
        dup_elapsed = time.perf_counter() - started
    finally:
        await ledger.close()
    print(f"ledger      {ledger.url.split('://')[0]:10s} batch {batch:5d}: {n / elapsed:10,.0f} events/s new, "
          f"{n / dup_elapsed:10,.0f} events/s duplicates")
    return n / elapsed


async def bench_end_to_end(nats_url: str, url: str | None, n: int, batch: int, tmp: Path) -> float:
    from bus import Bus, BusSettings, provision

    from .service import MeteringConfig, MeteringService

    tag = uuid.uuid4().hex[:8]
    settings = BusSettings(servers=(nats_url,), root=f"bench{tag}")
    bus = await Bus.open(settings, "metering-bench", initial_attempts=3)
    events = make_events(n, tag)
    svc = None
    try:
        await provision(bus.js, bus.subjects)
        for i in range(0, n, 500):
            await asyncio.gather(*(bus.js_publish(bus.subjects.usage(e.org), e, msg_id=usage_dedup_id(e.request_id))
                                   for e in events[i:i + 500]))
        svc = MeteringService(MeteringConfig(batch_size=batch, max_ack_pending=max(2048, 4 * batch), prices=PRICES),
                              settings, ledger=fresh_ledger(url, tmp, tag))
        started = time.perf_counter()
        await svc.start()
        while svc.events_written < n:
            if time.perf_counter() - started > 600:
                raise TimeoutError(f"only {svc.events_written} of {n} events written in 10 minutes")
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
    finally:
        if svc is not None:
            await svc.drain_and_close()
        for name in (bus.subjects.usage_stream, bus.subjects.tokens_stream):
            await bus.js.delete_stream(name)
        await bus.close()
    print(f"end-to-end  {svc.ledger.url.split('://')[0]:10s} batch {batch:5d}: {n / elapsed:10,.0f} events/s "
          f"(fetch, decode, price, commit, ack; service start included)")
    return n / elapsed


async def main(args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batch_size.split(",")]
    with tempfile.TemporaryDirectory(prefix="metering-bench-") as tmp:
        for batch in batches:
            await bench_ledger(args.ledger_url, args.events, batch, Path(tmp))
        if args.nats_url:
            for batch in batches:
                await bench_end_to_end(args.nats_url, args.ledger_url, args.events, batch, Path(tmp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ledger-url", default=None, help="default: SQLite files in a temporary folder")
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--batch-size", default="64,256,1024", help="comma-separated")
    parser.add_argument("--nats-url", default=None, help="a JetStream server for the end-to-end figure")
    asyncio.run(main(parser.parse_args()))
