"""A chaos soak: a whole mesh under steady load while a seeded schedule breaks it.

The mesh: a 3-node JetStream cluster (every stream and bucket R3), two gateways,
``--workers`` sim workers, the router, admission and metering, each its own process
(``ops.up.Mesh``). The load: open-loop Poisson arrivals at ``--rate`` requests per
second, each one a streamed completion from one of four clients: HTTP/SSE, HTTP/SSE
resumable (``X-Meshserve-Resumable``, resumed on any gateway with ``Last-Event-ID``),
WebSocket (one multiplexed connection per gateway) and the NATS API (request-reply on
plain NATS connections to the cluster). Meanwhile ``benchmarks/chaos_schedule.py`` (a
pure function of ``--seed``) kills -9 and restarts, or SIGSTOPs and SIGCONTs, workers,
gateways, NATS nodes, the router, admission and metering.

When the schedule and the load are over, the checker verifies:

- every request ended: none hung (no data for ``--idle-timeout`` seconds);
- errors only where a fault explains them: a non-resumable HTTP or WebSocket client whose
  gateway was killed under it, a resumable client whose gateway died before it learnt the
  request id, a NATS API client whose own NATS connection dropped (its replies are core
  NATS messages: what was sent while it reconnected is gone, and it knows it) or that
  heard nothing more after a gateway was killed (a NATS API client cannot tell which
  gateway serves it); every other error, and every other hang, fails;
- exact tokens: a fault-free replay of each request (same body, same seed, after the
  mesh healed: the sim's output is a function of seed and prompt) has the same text as
  every completed stream and begins with the text of every cut one; no event id twice;
- the ledger: metering's totals for the org equal the USAGE stream's (no event lost or
  counted twice across metering's deaths); each completed request is billed exactly the
  completion tokens its client was told; a cut one at least what its client saw (one
  byte, one sim token) and at most max_tokens (the rest ran on, unseen, and is billed);
- no KV blocks held and nothing running on any worker once idle, no open reservation
  left in admission;
- recovery: every process (and NATS node) alive, every service answers ``$SRV.PING``,
  every worker ready, both gateways ready, admission led by one instance.

Run: ``.venv/bin/python benchmarks/chaos.py --duration 300 --seed 1`` (prints the tables;
exit 1 when an invariant fails). ``tests/faults/test_chaos.py`` runs it for 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.chaos_schedule import Fault, ScheduleConfig, counts, schedule
from bus import Bus
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig, ServiceProcess, discover, ready_workers
from proto import UsageEvent, WorkerGauge, decode
from proto.metering import UsageQuery, UsageReport
from tests.sse import sse_events

MODEL = "sim-llama-8b"
ORG = "dev"  # the development key's org
CLIENTS = ("http", "http-resumable", "ws", "nats")


# ---- what happened --------------------------------------------------------------------
@dataclass
class Req:
    index: int
    client: str
    max_tokens: int
    started: float = 0.0
    ended: float = 0.0
    gateway: str = ""  # label of the gateway that served it (HTTP, WebSocket)
    request_id: str = ""
    outcome: str = "lost"  # completed | error | lost
    reason: str = ""
    explained: str = ""  # for an error or a hang: the fault that explains it, if any
    event_ids: list[str] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] | None = None
    resumes: int = 0
    done: bool = False
    error: str = ""

    def body(self, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "prompt": f"chaos request {self.index}", "max_tokens": self.max_tokens,
                                "seed": self.index, "ignore_eos": True, "user": f"chaos-{self.index}"}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body


@dataclass
class Struck:
    target: str
    action: str
    at: float  # monotonic
    until: float = float("inf")


class FaultLog:
    def __init__(self) -> None:
        self.struck: list[Struck] = []
        self.failed: list[str] = []  # a fault that could not be applied or undone (a restart that failed)

    def killed(self, target: str, start: float, end: float) -> bool:
        """Whether ``target`` was killed while a request was on it. A second before its start
        counts too: a pooled keep-alive connection to a process killed a moment ago is
        still the client's connection to that process until the client hears it closed."""
        return any(s.action == "kill" and s.target == target and start - 1.0 <= s.at <= end for s in self.struck)

    def killed_kind(self, prefix: str, start: float, end: float) -> bool:
        return any(s.action == "kill" and s.target.startswith(prefix) and start <= s.at <= end for s in self.struck)


@dataclass
class Ctx:
    mesh: Mesh
    gateways: list[tuple[str, str]]  # (label, url)
    http: aiohttp.ClientSession
    faults: FaultLog
    idle_timeout: float
    ws: dict[str, WsLink] = field(default_factory=dict)
    ncs: list[NatsLink] = field(default_factory=list)
    ready: dict[str, bool] = field(default_factory=dict)  # by gateway label, from /readyz

    @property
    def key(self) -> str:
        return self.mesh.dev_key

    def order(self, index: int) -> list[tuple[str, str]]:
        """The gateways in the order this request tries them: a load balancer's round robin
        over those whose /readyz said ready at the last look, then the others."""
        k = index % len(self.gateways)
        turn = self.gateways[k:] + self.gateways[:k]
        return sorted(turn, key=lambda g: not self.ready.get(g[0], True))

    async def health_checks(self) -> None:
        """What a load balancer in front of the gateways does: /readyz every half second."""
        while True:
            for label, url in self.gateways:
                try:
                    async with self.http.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        self.ready[label] = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    self.ready[label] = False
            await asyncio.sleep(0.5)


# ---- SSE over HTTP --------------------------------------------------------------------
def _apply_event(req: Req, data: str) -> None:
    if data == "[DONE]":
        req.done = True
        return
    body = json.loads(data)
    if "error" in body:
        req.error = str(body["error"].get("message", body["error"]))[:200]
        return
    for choice in body.get("choices", []):
        req.text += choice.get("text") or ""
    if body.get("usage"):
        req.usage = body["usage"]


async def _read_sse(response: aiohttp.ClientResponse, req: Req) -> None:
    """Applies each event as it arrives, so a stream cut midway keeps what it got."""
    async for event_id, data in sse_events(response):
        if event_id:
            req.event_ids.append(event_id)
        _apply_event(req, data)


def _finish(req: Req) -> None:
    if req.error:
        req.outcome, req.reason = "error", f"error event: {req.error}"
    elif req.done and req.usage is not None:
        req.outcome = "completed"


async def http_request(ctx: Ctx, req: Req, resumable: bool) -> None:
    headers = {"Authorization": f"Bearer {ctx.key}", **({"X-Meshserve-Resumable": "true"} if resumable else {})}
    broke = ""
    for label, url in ctx.order(req.index):
        try:
            async with ctx.http.post(url + "/v1/completions", json=req.body(), headers=headers) as r:
                req.gateway = label
                req.request_id = r.headers.get("X-Request-Id", "")
                if r.status != 200:
                    req.outcome, req.reason = "error", f"HTTP {r.status}: {(await r.text())[:200]}"
                    return
                await _read_sse(r, req)
            break
        except aiohttp.ClientConnectorError:
            continue  # that gateway is down: nothing was sent, the next one gets it
        except TimeoutError:
            req.gateway = req.gateway or label
            req.outcome, req.reason = "lost", f"no data for {ctx.idle_timeout:.0f} s"
            return
        except aiohttp.ClientError as exc:
            req.gateway = req.gateway or label
            broke = f"connection lost ({type(exc).__name__})"
            break
    else:
        req.outcome, req.reason = "error", "no gateway accepted the connection"
        return
    _finish(req)
    if req.outcome == "completed" or req.error:
        return
    broke = broke or "stream ended without [DONE]"
    if not resumable:
        req.outcome, req.reason = "error", broke
        if ctx.faults.killed(req.gateway, req.started, time.monotonic()):
            req.explained = f"{req.gateway} killed"
        return
    if not req.request_id:
        req.outcome, req.reason = "error", broke + " before the request id"
        if ctx.faults.killed(req.gateway, req.started, time.monotonic()):
            req.explained = f"{req.gateway} killed before answering"
        return
    await _resume(ctx, req, broke)


async def _resume(ctx: Ctx, req: Req, broke: str) -> None:
    """Resume on any gateway (the other one first) until the stream ends or 60 s pass."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for label, url in sorted(ctx.gateways, key=lambda g: g[0] == req.gateway):
            headers = {"Authorization": f"Bearer {ctx.key}"}
            if req.event_ids:
                headers["Last-Event-ID"] = req.event_ids[-1]
            try:
                async with ctx.http.get(f"{url}/v1/requests/{req.request_id}/stream", headers=headers) as r:
                    req.resumes += 1
                    req.gateway = label
                    if r.status != 200:
                        req.outcome, req.reason = "error", f"resume: HTTP {r.status}: {(await r.text())[:200]}"
                        return
                    await _read_sse(r, req)
            except aiohttp.ClientConnectorError:
                continue
            except TimeoutError:
                req.outcome, req.reason = "lost", f"resumed stream: no data for {ctx.idle_timeout:.0f} s"
                return
            except aiohttp.ClientError:
                pass
            _finish(req)
            if req.outcome == "completed" or req.error:
                return
        await asyncio.sleep(0.5)
    req.outcome, req.reason = "error", f"{broke}; resuming failed for 60 s"


# ---- WebSocket ------------------------------------------------------------------------
class WsLink:
    """One WebSocket to one gateway, multiplexing requests; its loss ends all of them."""

    def __init__(self, ctx: Ctx, label: str, url: str, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.label, self.url, self.ws = label, url, ws
        self.pending: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.closed = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                frame = json.loads(message.data)
                queue = self.pending.get(str(frame.get("id")))
                if queue is not None:
                    queue.put_nowait(frame)
        except Exception:  # any way the socket ends is its end
            pass
        finally:
            self.closed = True
            for queue in self.pending.values():
                queue.put_nowait(None)


async def _ws_link(ctx: Ctx, req: Req) -> WsLink | None:
    for label, url in ctx.order(req.index):
        link = ctx.ws.get(label)
        if link is not None and not link.closed:
            return link
        try:
            ws = await ctx.http.ws_connect(url + "/v1/ws", heartbeat=None)
        except (aiohttp.ClientError, TimeoutError):
            continue
        await ws.send_json({"type": "auth", "api_key": ctx.key})
        ctx.ws[label] = WsLink(ctx, label, url, ws)
        return ctx.ws[label]
    return None


async def ws_request(ctx: Ctx, req: Req) -> None:
    link = await _ws_link(ctx, req)
    if link is None:
        req.outcome, req.reason = "error", "no gateway accepted the WebSocket"
        return
    req.gateway = link.label
    rid = str(req.index)
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    link.pending[rid] = queue
    try:
        try:
            await link.ws.send_json({"type": "completion", "id": rid, "body": req.body(stream=False)})
        except (aiohttp.ClientError, ConnectionError, RuntimeError):
            queue.put_nowait(None)
        while True:
            try:
                frame = await asyncio.wait_for(queue.get(), ctx.idle_timeout)
            except TimeoutError:
                req.outcome, req.reason = "lost", f"no frame for {ctx.idle_timeout:.0f} s"
                return
            if frame is None:
                req.outcome, req.reason = "error", "WebSocket closed"
                if ctx.faults.killed(link.label, req.started, time.monotonic()):
                    req.explained = f"{link.label} killed"
                return
            if frame["type"] == "token":
                req.event_ids.append(str(frame.get("seq")))
                req.text += frame.get("text") or ""
            elif frame["type"] == "done":
                req.usage, req.done = frame.get("usage"), True
                req.outcome = "completed" if req.usage is not None else "error"
                req.reason = "" if req.usage is not None else "done without usage"
                return
            elif frame["type"] == "error":
                req.outcome, req.reason = "error", f"error frame {frame.get('status')}: {str(frame.get('error'))[:200]}"
                return
    finally:
        link.pending.pop(rid, None)


# ---- the NATS API ---------------------------------------------------------------------
class NatsLink:
    """A plain NATS client connection of the cluster; when it drops, its requests end:
    replies sent while it reconnected are lost, and it knows."""

    def __init__(self) -> None:
        self.nc = NatsClient()
        self.pending: dict[str, asyncio.Queue[Msg | None]] = {}
        self.disconnects = 0

    async def connect(self, servers: list[str]) -> None:
        options: dict[str, Any] = {"reconnect_time_wait": 0.5}  # nats.py takes a float; its hint says int
        await self.nc.connect(servers=servers, max_reconnect_attempts=-1, disconnected_cb=self._disconnected,
                              error_cb=self._error, name="chaos-nats-client", **options)

    async def _error(self, exc: Exception) -> None:
        """Connection errors are the schedule's doing (a node killed): the disconnect says it."""

    async def _disconnected(self) -> None:
        self.disconnects += 1
        for queue in self.pending.values():
            queue.put_nowait(None)


async def nats_request(ctx: Ctx, req: Req) -> None:
    link = ctx.ncs[req.index % len(ctx.ncs)]
    inbox = link.nc.new_inbox()
    queue: asyncio.Queue[Msg | None] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    link.pending[inbox] = queue
    sub = None
    try:
        try:
            sub = await link.nc.subscribe(inbox, cb=on_msg)
            await link.nc.publish(ctx.mesh.settings.subjects.api_completions, json.dumps(req.body()).encode(),
                                  reply=inbox, headers={"Authorization": f"Bearer {ctx.key}"})
        except Exception as exc:  # a publish while reconnecting may be refused
            req.outcome, req.reason = "error", f"NATS publish failed: {exc!r}"
            req.explained = "own NATS connection dropped" if not link.nc.is_connected else ""
            return
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), ctx.idle_timeout)
            except TimeoutError:
                req.outcome, req.reason = "lost", f"no reply for {ctx.idle_timeout:.0f} s"
                if ctx.faults.killed_kind("gateway", req.started, time.monotonic()):
                    req.explained = "a gateway was killed (a NATS API client cannot tell which serves it)"
                return
            if msg is None:
                req.outcome, req.reason, req.explained = "error", "NATS connection dropped", "own NATS connection dropped"
                return
            headers = msg.headers or {}
            req.request_id = headers.get("Meshserve-Request-Id", req.request_id)
            if headers.get("Nats-Service-Error-Code"):
                req.outcome = "error"
                req.reason = f"NATS error {headers['Nats-Service-Error-Code']}: {headers.get('Nats-Service-Error', '')[:200]}"
                return
            if headers.get("Meshserve-Event-Id"):
                req.event_ids.append(headers["Meshserve-Event-Id"])
            _apply_event(req, msg.data.decode())
            if headers.get("Meshserve-Done"):
                req.done = True
                _finish(req)
                if req.outcome != "completed" and not req.error:
                    req.outcome, req.reason = "error", "done without usage"
                return
    finally:
        link.pending.pop(inbox, None)
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


# ---- load -----------------------------------------------------------------------------
async def one(ctx: Ctx, req: Req) -> None:
    req.started = time.monotonic()
    try:
        if req.client == "ws":
            await ws_request(ctx, req)
        elif req.client == "nats":
            await nats_request(ctx, req)
        else:
            await http_request(ctx, req, resumable=req.client == "http-resumable")
    except Exception as exc:  # the checker reports it; the soak goes on
        req.outcome, req.reason = "error", f"client failed: {exc!r}"[:300]
    req.ended = time.monotonic()


async def load(ctx: Ctx, seed: int, rate: float, duration: float, max_tokens: int) -> list[Req]:
    """Open loop: Poisson arrivals at ``rate``, whatever the mesh does."""
    rng = random.Random(seed * 7919 + 1)
    reqs: list[Req] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
        req = Req(index=len(reqs), client=rng.choice(CLIENTS), max_tokens=rng.randint(16, max_tokens))
        reqs.append(req)
        tasks.append(asyncio.create_task(one(ctx, req)))
    await asyncio.gather(*tasks)
    return reqs


# ---- faults ---------------------------------------------------------------------------
class Chaos:
    def __init__(self, mesh: Mesh, log: FaultLog) -> None:
        self.mesh, self.log = mesh, log
        self.stopped: dict[str, int] = {}  # label → pid under SIGSTOP

    def _process(self, label: str) -> ServiceProcess:
        return next(p for p in self.mesh.processes if p.label == label)

    def pid(self, target: str) -> int | None:
        if target.startswith("nats-"):
            return self.mesh.nats_nodes[int(target[5:])].pid
        p = self._process(target)
        return p.proc.pid if p.proc is not None and p.running() else None

    async def run(self, faults: list[Fault]) -> None:
        t0 = time.monotonic()
        undo: list[asyncio.Task[None]] = []
        for f in faults:
            await asyncio.sleep(max(0.0, t0 + f.at - time.monotonic()))
            undo.append(asyncio.create_task(self.strike(f)))
        await asyncio.gather(*undo)

    async def strike(self, f: Fault) -> None:
        struck = Struck(f.target, f.action, time.monotonic())
        self.log.struck.append(struck)
        try:
            if f.action == "kill":
                await self._kill_restart(f)
            else:
                await self._pause(f)
        except Exception as exc:
            self.log.failed.append(f"{f.action} {f.target} at {f.at:.1f}s: {exc!r}")
        struck.until = time.monotonic()

    async def _kill_restart(self, f: Fault) -> None:
        if f.kind == "nats":
            node = self.mesh.nats_nodes[int(f.target[5:])]
            node.kill()
            await asyncio.sleep(f.down_s)
            node.start(wait=False)  # same port, same store: it rejoins the cluster
            await node.wait_listening(30)
            return
        old = self._process(f.target)
        old.kill()
        if old.proc is not None:
            await asyncio.to_thread(old.proc.wait)
        await asyncio.sleep(f.down_s)
        new = ServiceProcess(old.name, old.label, old.argv, old.log_file, old.env)
        new.start(self.mesh.env())
        self.mesh.processes[self.mesh.processes.index(old)] = new

    async def _pause(self, f: Fault) -> None:
        pid = self.pid(f.target)
        if pid is None:
            raise RuntimeError(f"{f.target} is not running")
        os.kill(pid, signal.SIGSTOP)
        self.stopped[f.target] = pid
        await asyncio.sleep(f.down_s)
        self.resume_all()

    def resume_all(self) -> None:
        for pid in self.stopped.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


# ---- the checker ----------------------------------------------------------------------
@dataclass
class Check:
    name: str
    ok: bool
    detail: str


async def stats(bus: Bus, service: str) -> list[dict[str, Any]]:
    """``$SRV.STATS`` of every instance ({} for one without endpoints: an admission standby)."""
    return await bus.every_service_stats(service)


async def check_recovery(ctx: Ctx, bus: Bus, chaos: Chaos, workers: int) -> Check:
    mesh, problems = ctx.mesh, list(chaos.log.failed)
    for p in mesh.processes:
        if not p.running():
            problems.append(f"{p.exit_report()}")
    for i, node in enumerate(mesh.nats_nodes):
        if not node.running():
            problems.append(f"nats-{i} not running")
    if problems:
        return Check("recovery", False, "; ".join(problems))
    try:
        await mesh.wait_ready(bus, 60)
    except Exception as exc:
        problems.append(str(exc))
    deadline = time.monotonic() + 60
    ready: list[str] = []
    while time.monotonic() < deadline:
        ready = [w.worker_id for w in await ready_workers(bus)]
        if len(ready) >= workers:
            break
        await asyncio.sleep(0.5)
    if len(ready) < workers:
        problems.append(f"{len(ready)} of {workers} workers ready ({', '.join(ready)})")
    for label, url in ctx.gateways:
        try:
            async with ctx.http.get(url + "/readyz") as r:
                if r.status != 200:
                    problems.append(f"{label} /readyz {r.status}")
        except aiohttp.ClientError as exc:
            problems.append(f"{label} /readyz: {exc!r}")
    leaders = 0
    for _ in range(60):
        leaders = sum(1 for s in await stats(bus, "admission") if s.get("leading"))
        if leaders == 1:
            break
    if leaders != 1:
        problems.append(f"{leaders} admission leaders")
    services = sorted({p.name for p in mesh.processes})
    pings = {name: len(await discover(bus, f"meshserve-{name}")) for name in services}
    detail = "; ".join(problems) or ("all processes alive, " + ", ".join(f"{n} ×{c}" for n, c in pings.items())
                                     + f" answer PING, {len(ready)} workers ready, gateways ready, one admission leader")
    return Check("recovery", not problems, detail)


async def replay(ctx: Ctx, reqs: list[Req]) -> dict[int, tuple[str, int]]:
    """The fault-free run of each request that produced text: (text, completion tokens)."""
    sem = asyncio.Semaphore(8)
    out: dict[int, tuple[str, int]] = {}
    url = ctx.gateways[0][1]

    async def again(req: Req) -> None:
        body = req.body(stream=False) | {"user": f"replay-{req.index}"}
        async with sem:
            for _ in range(3):  # a request missing here is reported by the token check
                try:
                    async with ctx.http.post(url + "/v1/completions", json=body,
                                             headers={"Authorization": f"Bearer {ctx.key}"}) as r:
                        got = await r.json()
                    out[req.index] = (got["choices"][0]["text"], got["usage"]["completion_tokens"])
                    return
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    await asyncio.sleep(1.0)

    await asyncio.gather(*(again(r) for r in reqs if r.text or r.outcome == "completed"))
    return out


def check_ended(reqs: list[Req]) -> Check:
    hung = [r for r in reqs if r.outcome == "lost" and not r.explained]
    return Check("every request ended", not hung,
                 f"{len(reqs)} requests, {len(hung)} hung" + "".join(f"; #{r.index} {r.client} via {r.gateway or '?'}: "
                                                                      f"{r.reason}" for r in hung[:5]))


def check_errors(reqs: list[Req]) -> Check:
    bad = [r for r in reqs if r.outcome == "error" and not r.explained]
    fine = sum(1 for r in reqs if r.outcome != "completed" and r.explained)
    detail = f"{fine} explained by a fault, {len(bad)} not" + "".join(
        f"; #{r.index} {r.client} via {r.gateway or '?'} ({r.request_id or 'no id'}): {r.reason}" for r in bad[:8])
    return Check("errors only where a fault explains them", not bad, detail)


def check_tokens(reqs: list[Req], reference: dict[int, tuple[str, int]]) -> Check:
    problems: list[str] = []
    compared = 0
    for r in reqs:
        if len(r.event_ids) != len(set(r.event_ids)):
            problems.append(f"#{r.index} {r.client}: an event id came twice")
        if r.index not in reference:
            if r.text or r.outcome == "completed":
                problems.append(f"#{r.index} {r.client}: the fault-free replay failed")
            continue
        text, tokens = reference[r.index]
        compared += 1
        if r.outcome == "completed":
            seen = (r.usage or {}).get("completion_tokens")
            if r.text != text:
                at = next((i for i, (a, b) in enumerate(zip(r.text, text, strict=False)) if a != b), min(len(r.text), len(text)))
                problems.append(f"#{r.index} {r.client} ({r.request_id}): text differs from the replay at "
                                f"character {at} ({len(r.text)} vs {len(text)} characters, {r.resumes} resumes): "
                                f"{r.text[max(0, at - 6):at + 6]!r} vs {text[max(0, at - 6):at + 6]!r}")
            elif not seen == tokens == r.max_tokens:
                problems.append(f"#{r.index} {r.client}: usage {seen}, replay {tokens}, max_tokens {r.max_tokens}")
        elif not text.startswith(r.text):
            problems.append(f"#{r.index} {r.client} (cut): its text is not a prefix of the replay's")
    detail = f"{compared} compared with a fault-free replay" + "".join(f"; {p}" for p in problems[:8])
    return Check("no token twice or missed", not problems, detail)


async def read_usage(bus: Bus, events: list[UsageEvent], read: int) -> int:
    """Appends USAGE's events after sequence ``read``; returns the last sequence read."""
    s = bus.subjects
    last = (await bus.js.stream_info(s.usage_stream)).state.last_seq
    for seq in range(read + 1, last + 1):
        with contextlib.suppress(Exception):  # a sequence removed (none are, but no reason to fail on one)
            events.append(decode((await bus.js.get_msg(s.usage_stream, seq)).data or b"", UsageEvent))
    return last


async def check_ledger(bus: Bus, reqs: list[Req]) -> Check:
    # Metering has caught up when its total equals USAGE's (read again each time: nothing
    # should still be arriving, but a late event must not be missed).
    deadline = time.monotonic() + 90
    ledger = stream = None
    all_events: list[UsageEvent] = []
    read = 0
    while True:
        read = await read_usage(bus, all_events, read)
        events = [e for e in all_events if e.org == ORG]
        stream = (sum(e.completion_tokens for e in events), sum(e.prompt_tokens for e in events))
        report = await bus.request(bus.subjects.metering_usage, UsageQuery(org=ORG, group_by=[]), UsageReport, timeout=5)
        total = report.total()
        ledger = (total.completion_tokens, total.prompt_tokens)
        if ledger == stream or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    problems = []
    if ledger != stream:
        problems.append(f"ledger (completion, prompt) {ledger} != USAGE stream {stream}")
    billed: dict[str, int] = Counter()
    for e in events:
        billed[e.user] += e.completion_tokens
    exact = bounded = 0
    for r in reqs:
        got = billed.get(f"chaos-{r.index}", 0)
        if r.outcome == "completed":
            exact += 1
            seen = (r.usage or {}).get("completion_tokens")
            if got != seen:
                problems.append(f"#{r.index} {r.client} ({r.request_id}): billed {got}, client told {seen}")
        else:
            bounded += 1
            seen_tokens = len(r.text.encode())  # the sim's tokens are bytes
            if not seen_tokens <= got <= r.max_tokens:
                problems.append(f"#{r.index} {r.client} cut ({r.reason}): billed {got}, client saw {seen_tokens}, "
                                f"max_tokens {r.max_tokens}")
    detail = (f"ledger {ledger[0]} completion tokens = USAGE {stream[0]}; " if ledger == stream else "") + \
        f"{exact} completed billed exactly what their clients were told, {bounded} cut ones within [seen, max_tokens]" + \
        "".join(f"; {p}" for p in problems[:8])
    return Check("ledger equals what clients saw", not problems, detail)


async def check_kv(bus: Bus, model: str) -> Check:
    latest: dict[str, WorkerGauge] = {}

    async def on_gauge(msg: Msg) -> None:
        g = decode(msg.data, WorkerGauge)
        latest[g.worker_id] = g

    ready = {w.worker_id for w in await ready_workers(bus)}
    sub = await bus.nc.subscribe(bus.subjects.gauges_of_model(model), cb=on_gauge)
    try:
        deadline = time.monotonic() + 60
        while True:
            await asyncio.sleep(1.0)
            busy = {w: g for w, g in latest.items() if w in ready and (g.running or g.waiting or g.kv_blocks_used)}
            if (not busy and ready <= set(latest)) or time.monotonic() > deadline:
                break
    finally:
        await sub.unsubscribe()
    missing = ready - set(latest)
    detail = ", ".join(f"{w}: {g.running} running, {g.waiting} waiting, {g.kv_blocks_used} KV blocks"
                       for w, g in sorted(busy.items()))
    if missing:
        detail += f"; no gauge from {', '.join(sorted(missing))}"
    return Check("no KV blocks held once idle", not busy and not missing,
                 detail or f"{len(latest)} workers idle with 0 KV blocks used")


async def check_reservations(bus: Bus) -> Check:
    deadline = time.monotonic() + 60
    open_ = -1
    while time.monotonic() < deadline:
        leaders = [s for s in await stats(bus, "admission") if s.get("leading")]
        if leaders:
            open_ = int(leaders[0].get("open_reservations", -1))
            if open_ == 0:
                break
        await asyncio.sleep(1.0)
    return Check("no bucket reservation left open", open_ == 0, f"admission leader: {open_} open reservations")


# ---- the run --------------------------------------------------------------------------
def table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(reqs: list[Req], faults: list[Fault], log: FaultLog, checks: list[Check]) -> str:
    outcomes: dict[tuple[str, str], int] = Counter()
    for r in reqs:
        kind = r.outcome if r.outcome == "completed" else f"{r.outcome} ({'explained: ' + r.explained if r.explained else 'unexplained'})"
        outcomes[(r.client, kind)] += 1
    resumed = sum(1 for r in reqs if r.resumes)
    parts = [f"{len(reqs)} requests ({resumed} resumed after a cut)", "",
             table([[c, k, str(n)] for (c, k), n in sorted(outcomes.items())], ["client", "outcome", "requests"]), "",
             table([[k, str(n)] for k, n in counts(faults).items()], ["fault", "injected"]), ""]
    if log.failed:
        parts += ["faults that could not be applied or undone: " + "; ".join(log.failed), ""]
    parts.append(table([[c.name, "PASS" if c.ok else "FAIL", c.detail.replace("|", "/")] for c in checks],
                       ["invariant", "result", "details"]))
    return "\n".join(parts)


async def soak(args: argparse.Namespace, state_dir: Path) -> int:
    gateway_args = ["--stall-timeout", str(args.stall_timeout)]
    mesh = Mesh(MeshConfig(state_dir=state_dir, nats_port=0, nats_nodes=3, http_port=free_port(), model=MODEL,
                           workers=args.workers, speed=args.speed, gateway_args=gateway_args))
    print(f"starting the mesh in {state_dir} (3 NATS nodes, 2 gateways, {args.workers} workers)", flush=True)
    await mesh.start(timeout=120)
    log = FaultLog()
    chaos = Chaos(mesh, log)
    try:
        port2 = free_port()
        mesh.add_process(ServiceProcess("gateway", "gateway-2", ["--port", str(port2), "--gateway-id", "gw-2",
                                                                 *gateway_args], mesh.log_dir / "gateway-2.log"))
        bus = await Bus.open(mesh.settings, "chaos-checker", initial_attempts=10)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=args.idle_timeout)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            ctx = Ctx(mesh, [("gateway", mesh.gateway_url), ("gateway-2", f"http://127.0.0.1:{port2}")], http, log,
                      args.idle_timeout)
            await mesh.wait_ready(bus, 60)
            await _gateway_ready(http, ctx.gateways[1][1])
            for _ in range(2):
                link = NatsLink()
                await link.connect(list(mesh.nats_servers))
                ctx.ncs.append(link)
            targets = {
                "worker": [f"worker-{i}" for i in range(1, args.workers + 1)],
                "gateway": ["gateway", "gateway-2"],
                "nats": [f"nats-{i}" for i in range(len(mesh.nats_nodes))],
                "router": ["router"], "admission": ["admission"], "metering": ["metering"],
            }
            faults = schedule(args.seed, args.duration, targets, ScheduleConfig(mean_gap_s=args.fault_gap))
            print(f"soaking for {args.duration:.0f} s at {args.rate:g} requests/s with {len(faults)} faults "
                  f"(seed {args.seed})", flush=True)
            health = asyncio.create_task(ctx.health_checks())
            try:
                reqs, _ = await asyncio.gather(load(ctx, args.seed, args.rate, args.duration, args.max_tokens),
                                               chaos.run(faults))
            finally:
                chaos.resume_all()
                health.cancel()
            print(f"load over: {len(reqs)} requests; checking", flush=True)
            checks = [check_ended(reqs), check_errors(reqs)]
            checks.append(await check_recovery(ctx, bus, chaos, args.workers))
            reference = await replay(ctx, reqs)
            checks.append(check_tokens(reqs, reference))
            checks.append(await check_ledger(bus, reqs))
            checks.append(await check_kv(bus, MODEL))
            checks.append(await check_reservations(bus))
            for link in ctx.ncs:
                await link.nc.close()
            for wl in ctx.ws.values():
                await wl.ws.close()
        await bus.close()
        text = report(reqs, faults, log, checks)
        print(text, flush=True)
        if args.json:
            results = {"requests": len(reqs), "faults": counts(faults),
                       "outcomes": Counter(f"{r.client} {r.outcome}{' explained' if r.explained else ''}" for r in reqs),
                       "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]}
            await asyncio.to_thread(Path(args.json).write_text, json.dumps(results, indent=2))
        return 0 if all(c.ok for c in checks) else 1
    finally:
        chaos.resume_all()
        mesh.stop(timeout=15)


async def _gateway_ready(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/readyz") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the second gateway at {url} never became ready")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load and faults (default 60)")
    p.add_argument("--seed", type=int, default=1, help="seeds the fault schedule and the load (default 1)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second, open loop (default 2)")
    p.add_argument("--workers", type=int, default=3, help="sim workers (default 3)")
    p.add_argument("--speed", type=float, default=1.0, help="sim speed factor (default 1: about 150 tokens/s a stream)")
    p.add_argument("--max-tokens", type=int, default=400, help="each request asks for 16..N tokens (default 400: up to about 3 s a stream)")
    p.add_argument("--fault-gap", type=float, default=4.0, help="mean seconds between fault starts (default 4)")
    p.add_argument("--stall-timeout", type=float, default=3.0,
                   help="the gateways' --stall-timeout: a paused worker's requests move after it (default 3)")
    p.add_argument("--idle-timeout", type=float, default=45.0,
                   help="a client that hears nothing this long counts its request as hung (default 45)")
    p.add_argument("--state-dir", type=Path, default=None, help="keep the mesh's state and logs here (default: a temporary folder)")
    p.add_argument("--json", default="", help="also write the results here as JSON")
    args = p.parse_args(argv)
    for name in ("duration", "rate", "speed", "fault_gap", "stall_timeout", "idle_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.workers < 2:
        p.error("--workers must be at least 2 (one is struck at a time; another must serve)")
    if args.max_tokens < 16:
        p.error("--max-tokens must be at least 16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvloop

    if args.state_dir is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
        return uvloop.run(soak(args, args.state_dir))
    with tempfile.TemporaryDirectory(prefix="meshserve-chaos-") as tmp:
        return uvloop.run(soak(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
