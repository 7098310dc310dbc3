"""Gateway faults on real processes: a gateway killed mid-stream, a client too slow to read."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus
from ops.natsserver import free_port
from ops.up import Mesh, ServiceProcess
from tests.conftest import final_chunks, running_mesh
from tests.sse import read_sse, sse_text, sse_usage

MODEL = "sim-llama-8b"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path / "mesh", workers=2, speed=5.0, gateway_args=["--stream-buffer", "16"]) as m:
        yield m


def test_client_resumes_on_another_gateway_after_its_gateway_dies(mesh: Mesh) -> None:
    port2 = free_port()
    second = mesh.add_process(ServiceProcess("gateway", "gateway-2", ["--port", str(port2), "--gateway-id", "gw-2",
                                                                       "--admission-unreachable", "open"],
                                             mesh.log_dir / "gateway-2.log"))
    asyncio.run(_gateway_death(mesh, f"http://127.0.0.1:{port2}", second))


async def _gateway_death(mesh: Mesh, second_url: str, second: ServiceProcess) -> None:
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "survive", "max_tokens": 500, "seed": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http:
        for _ in range(100):  # the second gateway is up
            try:
                async with http.get(second_url + "/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        async with http.post(second_url + "/v1/completions", json=body, headers=headers) as r:
            reference = await read_sse(r)
        first_gateway = next(p for p in mesh.processes if p.label == "gateway")
        async with http.post(mesh.gateway_url + "/v1/completions", json=body,
                             headers={**headers, "X-Meshserve-Resumable": "true"}) as r:
            request_id = r.headers["X-Request-Id"]
            got = await read_sse(r, limit=5)
            first_gateway.kill()  # kill -9 the gateway serving the stream
        struck = time.perf_counter()
        async with http.get(f"{second_url}/v1/requests/{request_id}/stream",
                            headers={**headers, "Last-Event-ID": got[-1][0]}) as r:
            assert r.status == 200
            rest = await read_sse(r)
        recovery = time.perf_counter() - struck
    joined = got + rest
    ids = [i for i, _ in joined]
    assert len(ids) == len(set(ids))
    assert sse_text(joined) == sse_text(reference) and len(sse_text(joined)) == 500
    usage = sse_usage(joined)
    assert usage is not None and usage["completion_tokens"] == 500
    assert recovery < 60  # sanity bound only; the figure goes to RELIABILITY.md via benchmarks/faults.py


def test_a_dead_gateways_requests_stop_unless_resumable(mesh: Mesh) -> None:
    """kill -9 of the gateway relaying them: its non-resumable request stops on its worker
    (billed for what it produced), where it ran to max_tokens for nobody; a resumable one
    generates on for its client's resume elsewhere."""
    asyncio.run(_gateway_orphans(mesh))


async def _gateway_orphans(mesh: Mesh) -> None:
    bus = await Bus.open(mesh.settings, "orphan-observer", initial_attempts=10)
    finals = await final_chunks(bus, bus.subjects.tokens_all)
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    plain = {"model": MODEL, "prompt": "orphan", "max_tokens": 20000, "ignore_eos": True, "stream": True}
    kept = {**plain, "prompt": "kept", "max_tokens": 3000}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(mesh.gateway_url + "/v1/completions", json=plain, headers=headers) as a, \
                    http.post(mesh.gateway_url + "/v1/completions", json=kept,
                              headers={**headers, "X-Meshserve-Resumable": "true"}) as b:
                orphan_id, resumable_id = a.headers["X-Request-Id"], b.headers["X-Request-Id"]
                await read_sse(a, limit=3)
                await read_sse(b, limit=3)
                next(p for p in mesh.processes if p.label == "gateway").kill()
        for _ in range(600):
            if orphan_id in finals and resumable_id in finals:
                break
            await asyncio.sleep(0.1)
        stopped = finals.get(orphan_id)
        assert stopped is not None, "the dead gateway's request was never stopped"
        assert stopped.finish_reason == "abort"
        assert stopped.usage is not None and 0 < stopped.usage.completion_tokens < 20000
        resumed = finals.get(resumable_id)
        assert resumed is not None and resumed.finish_reason == "length"  # generated on to its end
        assert resumed.usage is not None and resumed.usage.completion_tokens == 3000
    finally:
        await bus.close()


def test_slow_client_is_cut_without_slowing_others(mesh: Mesh) -> None:
    asyncio.run(_slow_client(mesh))


async def _slow_client(mesh: Mesh) -> None:
    # A raw socket that sends a streaming request and never reads a byte of the answer.
    host, port = "127.0.0.1", int(mesh.gateway_url.rsplit(":", 1)[1])
    payload = (b'{"model": "%s", "prompt": "slow", "max_tokens": 20000, "ignore_eos": true, "stream": true}' % MODEL.encode())
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + mesh.dev_key.encode() + b"\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    bus = await Bus.open(mesh.settings, "slow-observer", initial_attempts=10)
    finals = await final_chunks(bus, bus.subjects.tokens_all)
    try:
        # Meanwhile normal clients are served normally.
        async with aiohttp.ClientSession(mesh.gateway_url) as http:
            headers = {"Authorization": f"Bearer {mesh.dev_key}"}
            for i in range(5):
                body = {"model": MODEL, "prompt": f"fast {i}", "max_tokens": 50, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                async with http.post("/v1/completions", json=body, headers=headers) as r:
                    events = await read_sse(r)
                usage = sse_usage(events)
                assert usage is not None and usage["completion_tokens"] == 50
        # Kernel socket buffers (megabytes) absorb a stalled reader for a long time; the
        # gateway's own buffer bound (--stream-buffer) is unit-tested in test_gateway_streams.
        # When the reader finally goes away its request is cancelled, long before 20000 tokens.
        sock.close()
        aborted = None
        for _ in range(300):
            aborted = next((c for c in finals.values() if c.finish_reason == "abort"), None)
            if aborted is not None:
                break
            await asyncio.sleep(0.1)
        assert aborted is not None, "the slow client's request was never cancelled"
        assert aborted.usage is not None and aborted.usage.completion_tokens < 20000
    finally:
        sock.close()
        await bus.close()
