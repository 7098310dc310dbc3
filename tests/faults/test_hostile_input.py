"""Hostile bytes on every subject the mesh listens on: counted, answered, and service goes on.

Endpoints are found the way operators find them, through NATS micro discovery
(``$SRV.INFO``), so an endpoint added later is covered without touching this test.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest

from ops.up import Mesh
from proto import SCHEMA_VERSION, Subjects
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=1, speed=20.0) as m:
        yield m


def payloads() -> list[tuple[bytes, bool]]:
    """Hostile payloads, and whether every endpoint must refuse them.

    A map of only unknown fields is a valid request for an endpoint whose fields are all
    optional (msgspec ignores unknown fields for forward compatibility), and an empty
    body may mean defaults: those need an answer, not necessarily an error.
    """
    must_refuse = [
        os.urandom(64),
        b"\xc1" * 10,  # never valid msgpack
        msgspec.msgpack.encode({"v": SCHEMA_VERSION + 7, "request_id": "x"}),  # a future schema
        b"{" * 5000,  # deep nesting for JSON bodies
        os.urandom(6 * 1024 * 1024),  # big but under max_payload
    ]
    may_pass = [
        b"",
        msgspec.msgpack.encode({"v": SCHEMA_VERSION, "request_id": 5, "prompt": "not bytes"}),  # wrong types
        msgspec.msgpack.encode([1, 2, 3]),
        json.dumps({"model": MODEL, "messages": "x" * 100}).encode(),
    ]
    return [(p, True) for p in must_refuse] + [(p, False) for p in may_pass]


def test_hostile_bytes_everywhere(mesh: Mesh) -> None:
    asyncio.run(_run(mesh))


async def _run(mesh: Mesh) -> None:
    nc = await nats.connect(mesh.nats_url)
    subjects = Subjects()
    try:
        infos = await _discover(nc)
        endpoints = sorted({e["subject"] for info in infos for e in info.get("endpoints", [])})
        assert subjects.api_chat in endpoints and any(".generate" in e for e in endpoints)
        # Request-reply endpoints: every hostile payload gets an answer (an error), never silence.
        for subject in endpoints:
            for data, refuse in payloads():
                reply = await nc.request(subject, data, timeout=10)  # an answer, never silence
                if refuse:
                    assert reply.headers and "Nats-Service-Error-Code" in reply.headers, (subject, data[:40], reply.data[:100])
        # Published telemetry and streams: garbage is dropped and counted.
        for subject in (subjects.gauges(MODEL, "ghost"), subjects.kv_events(MODEL, "ghost"),
                        subjects.tokens("gw-1", "ghost"), subjects.usage("dev")):
            for data, _ in payloads():
                await nc.publish(subject, data)
        await nc.flush()

        # Every service still answers, and counted what it dropped: the worker its gauges
        # and KV events, metering the usage events (it reads USAGE in batches: wait for it).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while True:
            stats = await _stats(nc)
            counted = {s["name"]: max((e.get("data") or {}).get("decode_errors", 0) for e in s["endpoints"]) for s in stats}
            if (counted.get("meshserve-worker", 0) > 0 and counted.get("meshserve-metering", 0) > 0) or loop.time() > deadline:
                break
            await asyncio.sleep(0.5)
        assert {s["name"] for s in stats} >= {s["name"] for s in infos}
        assert counted["meshserve-worker"] > 0 and counted["meshserve-metering"] > 0, counted

        # And the mesh still serves a real request.
        # ignore_eos: the sim's text ends early now and then (EOS after a word), as a model's does.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 5,
                "ignore_eos": True}
        reply = await nc.request(subjects.api_chat, json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {mesh.dev_key}"}, timeout=30)
        assert json.loads(reply.data)["usage"]["completion_tokens"] == 5
    finally:
        await nc.close()


async def _collect(nc: nats.NATS, subject: str) -> list[dict]:
    inbox = nc.new_inbox()
    found: list[dict] = []

    async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
        found.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    return found


async def _discover(nc: nats.NATS) -> list[dict]:
    return [i for i in await _collect(nc, "$SRV.INFO") if i["name"].startswith("meshserve-")]


async def _stats(nc: nats.NATS) -> list[dict]:
    return [s for s in await _collect(nc, "$SRV.STATS") if s["name"].startswith("meshserve-")]
