"""What each fault costs: requests in flight when it struck, completed, ended with an
explicit error, lost (must be 0), and the extra latency of recovery (p50/p99 of E2E
against the same requests without the fault).

Faults, each on a fresh mesh of real processes (``ops.up.Mesh``), struck with kill -9:
- worker: the worker serving half the streams dies; its requests migrate.
- gateway: the gateway serving resumable streams dies; clients resume on a second one.
- nats: one node of a 3-node JetStream cluster (every stream and bucket R3) dies.
- metering: the ledger writer dies twice under load; it catches up from USAGE.

Before them, how fast a killed worker is noticed: ten workers killed one after another,
each timed from the kill until a registry (the one every service keeps) drops it.

Run: ``.venv/bin/python benchmarks/faults.py`` (about three minutes). Prints a Markdown table.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from bus import Bus
from bus.registry import WorkerRegistry
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig, ServiceProcess

MODEL = "sim-llama-8b"


@dataclass
class Outcome:
    fault: str
    in_flight: int = 0
    completed: int = 0
    errors: int = 0
    lost: int = 0
    baseline_e2e: list[float] = field(default_factory=list)
    fault_e2e: list[float] = field(default_factory=list)

    def extra(self, q: float) -> float:
        if not self.fault_e2e or not self.baseline_e2e:
            return float("nan")
        return float(np.percentile(self.fault_e2e, q) - np.percentile(self.baseline_e2e, q)) * 1000


async def _events(response: aiohttp.ClientResponse, limit: int | None = None) -> list[tuple[str, str]]:
    events, event_id = [], ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            if limit and len(events) >= limit:
                break
    return events


def _classify(events: list[tuple[str, str]], tokens: int) -> str:
    for _, data in reversed(events):
        if data == "[DONE]":
            continue
        body = json.loads(data)
        if "error" in body:
            return "error"
        if body.get("usage"):
            return "ok" if body["usage"]["completion_tokens"] == tokens else "error"
    return "lost"


async def _stream(http: aiohttp.ClientSession, url: str, key: str, seed: int, tokens: int,
                  resumable: bool = False, limit: int | None = None) -> tuple[str, list[tuple[str, str]], float]:
    body = {"model": MODEL, "prompt": f"r{seed}", "max_tokens": tokens, "seed": seed, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}", **({"X-Meshserve-Resumable": "true"} if resumable else {})}
    start = time.perf_counter()
    try:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
            rid = r.headers.get("X-Request-Id", "")
            events = await _events(r, limit)
    except (aiohttp.ClientError, TimeoutError):
        return "", [], time.perf_counter() - start
    return rid, events, time.perf_counter() - start


def _mesh(tmp: Path, name: str, **kw: object) -> Mesh:
    return Mesh(MeshConfig(state_dir=tmp / name, nats_port=0, http_port=free_port(), model=MODEL, **kw))  # type: ignore[arg-type]


async def detection(tmp: Path, rounds: int = 10) -> list[float]:
    """Seconds from a worker's kill -9 until a registry (what every service keeps) drops it."""
    mesh = _mesh(tmp, "detection", workers=1, speed=2.0)
    await mesh.start()
    seconds: list[float] = []
    observer = await Bus.open(mesh.settings, "detection-observer", initial_attempts=10)
    registry = WorkerRegistry(observer)
    dropped_at: dict[str, float] = {}
    dropped = asyncio.Event()

    def on_change(worker_id: str, info: object) -> None:
        if info is None:
            dropped_at[worker_id] = time.perf_counter()
            dropped.set()

    registry.on_change(on_change)
    await registry.start()
    try:
        for i in range(rounds):
            victim = mesh.add_process(mesh.worker_process(10 + i))
            worker_id = f"{MODEL}-w{10 + i}"
            deadline = time.monotonic() + 60
            while registry.workers.get(worker_id) is None or registry.workers[worker_id].state != "ready":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker_id} never registered")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            struck = time.perf_counter()
            victim.kill()
            while worker_id not in dropped_at:
                dropped.clear()
                await asyncio.wait_for(dropped.wait(), 60)
            seconds.append(dropped_at[worker_id] - struck)
    finally:
        await registry.stop()
        await observer.close()
        mesh.stop()
    return seconds


async def worker_fault(tmp: Path, n: int = 12, tokens: int = 600) -> Outcome:
    # The default stall timeout (30 s): the worker's death is noticed from its connection.
    mesh = _mesh(tmp, "worker", workers=2, speed=2.0)
    await mesh.start()
    out = Outcome("worker killed mid-stream")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            base = await asyncio.gather(*(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens) for i in range(n)))
            out.baseline_e2e = [e2e for _, _, e2e in base]
            tasks = [asyncio.create_task(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens)) for i in range(n)]
            await asyncio.sleep(1.0)
            out.in_flight = sum(not t.done() for t in tasks)
            next(p for p in mesh.processes if p.label == "worker-1").kill()
            results = await asyncio.gather(*tasks)
        _tally(out, [(ev, e2e) for _, ev, e2e in results], tokens)
    finally:
        mesh.stop()
    return out


async def gateway_fault(tmp: Path, n: int = 8, tokens: int = 500) -> Outcome:
    mesh = _mesh(tmp, "gateway", workers=2, speed=5.0)
    await mesh.start()
    port2 = free_port()
    mesh.add_process(ServiceProcess("gateway", "gateway-2", ["--port", str(port2), "--gateway-id", "gw-2",
                                                             "--admission-unreachable", "open"], mesh.log_dir / "gateway-2.log"))
    second = f"http://127.0.0.1:{port2}"
    out = Outcome("gateway killed mid-stream (clients resume elsewhere)")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            for _ in range(100):
                try:
                    async with http.get(second + "/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            base = await asyncio.gather(*(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens, True) for i in range(n)))
            out.baseline_e2e = [e2e for _, _, e2e in base]
            starts = time.perf_counter()
            heads = await asyncio.gather(*(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens, True, limit=4)
                                           for i in range(n)))
            out.in_flight = n
            next(p for p in mesh.processes if p.label == "gateway").kill()

            async def resume(rid: str, events: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], float]:
                async with http.get(f"{second}/v1/requests/{rid}/stream",
                                    headers={"Authorization": f"Bearer {mesh.dev_key}", "Last-Event-ID": events[-1][0]}) as r:
                    rest = await _events(r)
                return events + rest, time.perf_counter() - starts

            results = await asyncio.gather(*(resume(rid, ev) for rid, ev, _ in heads))
        _tally(out, results, tokens)
    finally:
        mesh.stop()
    return out


async def nats_node_fault(tmp: Path, n: int = 8, tokens: int = 600) -> Outcome:
    mesh = _mesh(tmp, "nats", nats_nodes=3, workers=2, speed=1.0)
    await mesh.start()
    out = Outcome("NATS node killed (3-node cluster, R3)")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            base = await asyncio.gather(*(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens) for i in range(n)))
            out.baseline_e2e = [e2e for _, _, e2e in base]
            tasks = [asyncio.create_task(_stream(http, mesh.gateway_url, mesh.dev_key, i, tokens)) for i in range(n)]
            await asyncio.sleep(1.0)
            out.in_flight = sum(not t.done() for t in tasks)
            mesh.nats_nodes[1].kill()
            results = await asyncio.gather(*tasks)
        _tally(out, [(ev, e2e) for _, ev, e2e in results], tokens)
    finally:
        mesh.stop()
    return out


async def metering_fault(tmp: Path, n: int = 1500, tokens: int = 40) -> Outcome:
    mesh = _mesh(tmp, "metering", workers=2, speed=5.0)
    await mesh.start()
    out = Outcome("metering killed twice under load")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            sem = asyncio.Semaphore(32)

            async def one(i: int) -> tuple[list[tuple[str, str]], float]:
                async with sem:
                    _, ev, e2e = await _stream(http, mesh.gateway_url, mesh.dev_key, i, tokens)
                return ev, e2e

            base = await asyncio.gather(*(one(i) for i in range(n)))
            out.baseline_e2e = [e2e for _, e2e in base]
            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            for _ in range(2):
                await asyncio.sleep(0.5)
                out.in_flight += min(32, sum(not t.done() for t in tasks))
                victim = next(p for p in mesh.processes if p.name == "metering" and p.running())
                victim.kill()
                await asyncio.sleep(0.3)
                mesh.add_process(ServiceProcess("metering", "metering", victim.argv, victim.log_file))
            results = await asyncio.gather(*tasks)
        _tally(out, results, tokens)
    finally:
        mesh.stop()
    return out


def _tally(out: Outcome, results: list[tuple[list[tuple[str, str]], float]], tokens: int) -> None:
    for events, e2e in results:
        kind = _classify(events, tokens)
        if kind == "ok":
            out.completed += 1
            out.fault_e2e.append(e2e)
        elif kind == "error":
            out.errors += 1
        else:
            out.lost += 1


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        detected = await detection(Path(tmp))
        outcomes = [await worker_fault(Path(tmp)), await gateway_fault(Path(tmp)), await nats_node_fault(Path(tmp)),
                    await metering_fault(Path(tmp))]
    print(f"killed worker dropped from the registry after p50 {np.percentile(detected, 50) * 1000:.0f} ms, "
          f"p99 {np.percentile(detected, 99) * 1000:.0f} ms ({len(detected)} kills)")
    print("| fault | in flight when struck | completed | explicit error | lost | extra E2E p50 ms | extra E2E p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for o in outcomes:
        print(f"| {o.fault} | {o.in_flight} | {o.completed} | {o.errors} | {o.lost} | {o.extra(50):.0f} | {o.extra(99):.0f} |")


if __name__ == "__main__":
    import argparse
    import signal

    import uvloop

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # as Ctrl-C: each fault's mesh is stopped on the way out

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        raise SystemExit("faults.py: interrupted; its meshes are stopped") from None
