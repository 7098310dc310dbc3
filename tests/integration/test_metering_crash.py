"""Crash test: ``meshserve serve metering`` SIGKILLed twice while 3000 usage events are
published; the ledger's totals equal the published usage exactly.

A kill can land anywhere: mid-fetch, mid-commit (SQLite rolls the batch back), or after
the commit with acks unsent (the batch is redelivered after ack_wait and the ledger's
primary key drops it). Hostile bytes are mixed into the stream throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from bus import Bus, provision
from proto import UsageEvent, usage_dedup_id
from proto.metering import UsageQuery, UsageReport

REPO = Path(__file__).resolve().parents[2]
N_EVENTS = 3000
ORGS = ["acme", "beta", "gamma.co", "delta org"]


def events(n: int) -> list[UsageEvent]:
    rng = random.Random(42)
    out = []
    for i in range(n):
        prompt = rng.randrange(1, 8000)
        out.append(UsageEvent(
            request_id=f"crash-{i}", org=rng.choice(ORGS), key_id=f"k{rng.randrange(3)}", model="sim-llama-8b",
            prompt_tokens=prompt, cached_tokens=rng.randrange(prompt + 1), completion_tokens=rng.randrange(2000),
            # a few migrated requests: their segments are distinct usage ids
            migrations=1 if i % 97 == 0 else 0, finish_time=1_750_000_000.0 + i,
        ))
    return out


def ledger_count(path: Path) -> int:
    try:
        conn = sqlite3.connect(path, timeout=1.0)
        try:
            return int(conn.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet, or busy for a moment
        return 0


class MeteringProcess:
    def __init__(self, nats_url: str, ledger: Path, log: IO[bytes]) -> None:
        self.argv = [sys.executable, "-m", "ops.cli", "serve", "metering", "--nats-url", nats_url,
                     "--ledger-url", f"sqlite:///{ledger}", "--ack-wait", "2", "--batch-size", "64",
                     "--max-ack-pending", "256", "--log-level", "INFO"]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "OTEL_SDK_DISABLED": "true", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


async def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_sigkill_twice_while_publishing(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    await provision(bus.js, bus.subjects)
    ledger = tmp_path / "ledger.sqlite3"
    published = events(N_EVENTS)
    progress = {"published": 0}

    async def publisher() -> None:
        rng = random.Random(1)
        chunk = 100
        for start in range(0, N_EVENTS, chunk):
            await asyncio.gather(*(
                bus.js_publish(bus.subjects.usage(e.org), e, msg_id=usage_dedup_id(e.request_id, e.migrations))
                for e in published[start:start + chunk]))
            progress["published"] = start + chunk
            if start % 600 == 0:  # hostile bytes now and then
                await bus.js.publish(bus.subjects.usage("acme"), rng.randbytes(40))
            await asyncio.sleep(0.05)  # spread publishing over a few seconds so the kills land mid-stream

    with open(tmp_path / "metering.log", "ab") as log:
        service = MeteringProcess(nats_url, ledger, log)
        service.start()
        publishing = asyncio.create_task(publisher())
        kills = []
        for threshold in (500, 1800):
            await wait_until(lambda t=threshold: ledger_count(ledger) >= t, 60, f"{threshold} events in the ledger")
            service.kill()
            kills.append((ledger_count(ledger), progress["published"]))
            service.start()
        await publishing
        await wait_until(lambda: ledger_count(ledger) >= N_EVENTS, 60, "every event in the ledger")
        # Let redeliveries (ack_wait 2 s) arrive and be dropped, then check the consumer is empty.
        for _ in range(100):
            info = await bus.js.consumer_info(bus.subjects.usage_stream, "metering")
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.1)
        assert info.num_pending == 0 and info.num_ack_pending == 0, info

        assert ledger_count(ledger) == N_EVENTS
        report = await bus.request(bus.subjects.metering_usage, UsageQuery(group_by=["org", "key"]), UsageReport,
                                   timeout=10.0)
        expected: dict[tuple[str, str], list[int]] = {}
        for e in published:
            sums = expected.setdefault((e.org, e.key_id), [0, 0, 0, 0])
            # a request counts once: by its first segment (a later one's event adds its tokens)
            for i, value in enumerate((int(e.migrations == 0), e.prompt_tokens, e.cached_tokens, e.completion_tokens)):
                sums[i] += value
        got = {(r.org or "", r.key_id or ""): [r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens]
               for r in report.rows}
        assert got == expected
        stats = json.loads((await bus.nc.request("$SRV.STATS.meshserve-metering", b"", timeout=5.0)).data)
        figures = stats["endpoints"][0]["data"]
        assert figures["ledger_ok"] is True and figures["lag"] == 0
        assert service.stop() == 0  # SIGTERM: a clean drain
    # at least one kill happened while events were still being published
    print(f"kills at (ledger rows, events published): {kills}; last process: {figures}")
    assert any(published_then < N_EVENTS for _, published_then in kills)
