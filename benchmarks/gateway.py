"""The gateway's cost: added latency, and the token rate one gateway process relays.

1. Added latency: TTFT the client sees through the mesh (HTTP → gateway → admission
   path → router/placement → worker → TOKENS → gateway → SSE) minus the worker's own
   TTFT (its receipt of the request → its first token, from the final chunk's timings,
   read off NATS by request id). Sequential requests on an idle mesh, p50/p99.
   The same, over chat completions, for the features that add gateway work (issue 16),
   interleaved in one run so they meet the same machine: plain, tools (the template renders
   them; the output goes through the Hermes parser), a forced tool call (guided decoding,
   the call assembled from the output) and logprobs with ``top_logprobs=5``.
2. Relay throughput: closed-loop streams at 1, 64 and 512 concurrent, long outputs from
   two echo workers (``--relay-engine sim``: fast sim workers, whose per-token work takes
   half this machine), measured with ``meshserve bench``'s Python API; output tokens/s the
   one gateway delivered over SSE, ITL p50/p99, and each process's CPU (the gateway's per
   1k tokens); and at 64 streams with ``top_logprobs=5`` (each token then carries six
   candidates). ``--relay-only`` runs that part alone.
3. ``--apis-only``: the same streamed request through chat completions, the Responses API
   and Anthropic's Messages API, interleaved: what each translation adds.

Everything shares this machine's cores (client, gateway, workers, nats-server), so the
relay figure is a floor for a gateway on its own host.

The added latency is broken down per hop from wall-clock stamps on this one machine: the
client's send, the gateway's ``arrival_time`` (set once admission admitted it), the
moments a passive listener on the bus saw the route request and the router's forward to
the worker, the worker's own receipt and first token (the final chunk's timings), and
the client's first event. Inside the first hop, the gateway's own phases from its
``Server-Timing`` header (parse: body, validation, chat template and tokenizer; hash:
the prompt's block hashes; admission: its NATS round trip). ``--latency-only`` runs that
part alone.

Run: ``.venv/bin/python benchmarks/gateway.py [--requests 200] [--latency-only]``; the request path
alone: ``.venv/bin/python benchmarks/gateway.py --request-path 100,200,400,800 --duration 15``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web
from nats.aio.msg import Msg

from bus import Bus
from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, run_bench
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto import GenerateRequest, RouteRequest, TokenChunk, decode

MODEL = "sim-llama-8b"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    import os

    return ticks / os.sysconf("SC_CLK_TCK")


class Observer:
    """A passive listener on the bus: every request's final chunk (its timings: the
    worker's own TTFT), and the wall-clock moments its placement passed the router's and
    the worker's subjects (a plain subscriber gets a copy of each; it never answers)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.finals: dict[str, TokenChunk] = {}
        self.route_seen: dict[str, tuple[float, float]] = {}  # request id → (gateway's stamp, seen at router's subject)
        self.forward_seen: dict[str, float] = {}  # request id → seen at the worker's subject

    @classmethod
    async def open(cls, mesh: Mesh) -> Observer:
        bus = await Bus.open(mesh.settings, "bench-observer", initial_attempts=10)
        self = cls(bus)
        s = bus.subjects

        async def on_chunk(msg: Msg) -> None:
            chunk = decode(msg.data, TokenChunk)
            if chunk.finish_reason is not None:
                self.finals[chunk.request_id] = chunk

        async def on_route(msg: Msg) -> None:
            now = time.time()
            route = decode(msg.data, RouteRequest)
            self.route_seen[route.request.request_id] = (route.request.arrival_time, now)

        async def on_forward(msg: Msg) -> None:
            now = time.time()
            self.forward_seen[decode(msg.data, GenerateRequest).request_id] = now

        await bus.nc.subscribe(s.tokens_all, cb=on_chunk)
        await bus.nc.subscribe(s.router_route, cb=on_route)
        await bus.nc.subscribe(f"{s.root}.worker.*.generate", cb=on_forward)
        await bus.nc.flush()
        return self


# The hops of a request's time to first token, in order, from wall-clock stamps taken on
# this one machine (the client's, the gateway's ``arrival_time``, the observer's, the worker's).
# The gateway's Server-Timing phases inside the first hop (before its arrival stamp), and
# the two it then waits through while the request travels on (admission, placement).
FIRST_HOP_PHASES = ("auth", "parse", "hash")
HTTP_IN = "rest: client send, HTTP in, handler start"
PHASE_HOP = {"auth": 0, "parse": 0, "hash": 0, HTTP_IN: 0, "admission": 1, "record": 1, "route": 1}
PHASE_NAMES = {"auth": "gateway: the key check", "parse": "gateway: body, validation, template, tokenizer",
               "hash": "gateway: the prompt's block hashes",
               "admission": "the gateway waits for admission's verdict (from its stamp)",
               "record": "then saves the resume record", "route": "then waits for the placement"}
HOPS = (
    "client → gateway sent it on (HTTP in, parse, hash)",
    "gateway → router's subject (via admission: its forward, or its round trip then the route request)",
    "router: decision and forward → worker's subject",
    "worker: receipt → engine (its handler, n choices, the engine request)",
    "worker: engine receipt → first token (the engine's own TTFT)",
    "first token → client (chunk out, NATS, gateway relay, SSE, HTTP)",
)


async def _ttfts(http: aiohttp.ClientSession, path: str, body: dict[str, object], headers: dict[str, str],
                 not_first: bytes, observer: Observer,
                 phases: dict[str, list[float]] | None = None,
                 first_with: bytes | None = None) -> tuple[float, float, list[float] | None] | None:
    """(client TTFT, worker TTFT, ms per hop of ``HOPS`` or None) of one streamed request:
    the client's first event is the first ``data:`` line without ``not_first`` (an empty
    text, the role delta), or with ``first_with`` when given (the Responses and Messages
    APIs open with events that carry no text). ``phases`` collects the gateway's
    ``Server-Timing`` (ms per phase before the worker had it)."""
    sent_wall, start = time.time(), time.perf_counter()
    first = first_wall = None
    async with http.post(path, json=body, headers=headers) as r:
        request_id = r.headers["X-Request-Id"]
        if phases is not None:
            for part in r.headers.get("Server-Timing", "").split(","):
                name, _, ms = part.strip().partition(";dur=")
                if ms:
                    phases.setdefault(name, []).append(float(ms))
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and (
                    first_with in line if first_with is not None else not_first not in line):
                first, first_wall = time.perf_counter() - start, time.time()
    for _ in range(100):
        if request_id in observer.finals:
            break
        await asyncio.sleep(0.01)
    t = observer.finals[request_id].timings
    if first is None or first_wall is None or t is None:
        return None
    hops = None
    if request_id in observer.route_seen and request_id in observer.forward_seen:
        admitted_at, at_router = observer.route_seen[request_id]
        stamps = (sent_wall, admitted_at, at_router, observer.forward_seen[request_id], t.arrival, t.first_token, first_wall)
        hops = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
        if phases is not None and all(phases.get(p) for p in FIRST_HOP_PHASES):
            # What the gateway's own phases leave of the first hop: the client's send, the
            # kernel, aiohttp reading the request and starting the handler.
            phases.setdefault(HTTP_IN, []).append(hops[0] - sum(phases[p][-1] for p in FIRST_HOP_PHASES))
    return first, t.first_token - t.arrival, hops


CLIENT_CPU = "client (with the bus observer)"


async def added_latency(mesh: Mesh, requests: int, phases: dict[str, list[float]] | None = None,
                        hops: list[list[float]] | None = None,
                        cpu_ms: dict[str, float] | None = None, gap_s: float = 0.0,
                        concurrency: int = 1, client_lag_ms: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Client and worker TTFT (s) of ``requests`` requests from ``concurrency`` clients, each
    sending its next as its previous one ends (and ``gap_s`` after, if set); ``phases``
    collects the gateway's Server-Timing per request (ms), ``hops`` the ms per hop of
    ``HOPS`` per request, ``cpu_ms`` each process's CPU milliseconds per request, and
    ``client_lag_ms`` how late the client's own event loop ran (sampled every 10 ms: a
    busy client reads its first event late, which would count as the mesh's)."""
    observer = await Observer.open(mesh)
    client_ttft, worker_ttft = [], []
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "x" * 256, "max_tokens": 4, "stream": True, "ignore_eos": True}
    seen: dict[str, list[float]] = {}
    pids = _pids(mesh)
    cpu0: dict[str, float] = {}
    warmup = 10
    async with aiohttp.ClientSession(mesh.gateway_url, connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(i: int) -> None:
            one_phases: dict[str, list[float]] = {}
            ttfts = await _ttfts(http, "/v1/completions", {**body, "seed": i}, headers, b'"text":""', observer, one_phases)
            if i >= warmup and ttfts is not None:
                client_ttft.append(ttfts[0])
                worker_ttft.append(ttfts[1])
                for name, values in one_phases.items():
                    seen.setdefault(name, []).extend(values)
                if hops is not None and ttfts[2] is not None:
                    hops.append(ttfts[2])

        for i in range(warmup):  # sequential, to warm things up
            await one(i)
        cpu0 = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        cpu0[CLIENT_CPU] = time.process_time()
        numbers = iter(range(warmup, warmup + requests))

        async def client() -> None:
            for i in numbers:
                if gap_s:
                    await asyncio.sleep(gap_s)
                await one(i)

        done = asyncio.Event()

        async def watch_lag() -> None:
            while not done.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.01)
                if client_lag_ms is not None:
                    client_lag_ms.append((time.perf_counter() - before - 0.01) * 1000)

        watcher = asyncio.create_task(watch_lag())
        started = time.perf_counter()
        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            done.set()
            await watcher
        elapsed = time.perf_counter() - started
        print(f"{requests} requests in {elapsed:.1f} s: {requests / elapsed:.0f} req/s")
    if cpu_ms is not None:
        cpu_ms.update({name: (_cpu_seconds(pid) - cpu0[name]) * 1000 / requests for name, pid in pids.items()})
        cpu_ms[CLIENT_CPU] = (time.process_time() - cpu0[CLIENT_CPU]) * 1000 / requests
    with contextlib.suppress(Exception):
        stats = await observer.bus.service_stats("admission")
        print(f"admission: {stats.get('admitted')} admitted, {stats.get('forwarded')} sent on to the router by it")
    await observer.bus.close()
    if phases is not None:
        phases.update(seen)
    return np.array(client_ttft), np.array(worker_ttft)


def _pids(mesh: Mesh) -> dict[str, int]:
    """The mesh's processes by name (nats-server's too), for their CPU time."""
    pids: dict[str, int] = {}
    for p in mesh.processes:
        if p.proc is not None:
            name = p.name if p.name not in pids else f"{p.name}-{sum(n.startswith(p.name) for n in pids) + 1}"
            pids[name] = p.proc.pid
    for i, node in enumerate(mesh.nats_nodes):
        if (pid := node.pid) is not None:
            pids[f"nats-server{'' if i == 0 else i}"] = pid
    return pids


def print_hops(hops: list[list[float]], phases: dict[str, list[float]]) -> None:
    """The per-hop table: each hop's p50/p99/mean in ms, the gateway's own phases inside
    the first hop (and what the gateway waits through meanwhile during the second), and
    the total added by the mesh (every hop but the engine's TTFT)."""
    table = np.array(hops)
    print("| hop | p50 ms | p99 ms | mean ms |\n|---|---:|---:|---:|")
    for i, name in enumerate(HOPS):
        values = table[:, i]
        print(f"| {name} | {np.percentile(values, 50):.3f} | {np.percentile(values, 99):.3f} | {values.mean():.3f} |")
        for phase, ms in phases.items():
            if PHASE_HOP.get(phase, 0) == i:
                v = np.array(ms)
                print(f"| &nbsp;&nbsp;{'of which' if i == 0 else 'meanwhile'} {PHASE_NAMES.get(phase, phase)} "
                      f"| {np.percentile(v, 50):.3f} | {np.percentile(v, 99):.3f} | {v.mean():.3f} |")
    added = table.sum(axis=1) - table[:, 4]
    print(f"| added by the mesh (all but the engine's TTFT) | {np.percentile(added, 50):.3f} "
          f"| {np.percentile(added, 99):.3f} | {added.mean():.3f} |")


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FEATURES: dict[str, dict[str, object]] = {
    "plain": {},
    "tools (auto, parsed)": {"tools": [TOOL]},
    "forced tool call": {"tools": [TOOL], "tool_choice": "required"},
    "logprobs, top 5": {"logprobs": True, "top_logprobs": 5},
}


async def feature_latency(mesh: Mesh, requests: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Client and worker TTFT per feature, chat completions, the features interleaved."""
    observer = await Observer.open(mesh)
    seen: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in FEATURES}
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for i in range(requests + 10):
            for name, extra in FEATURES.items():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 4,
                        "stream": True, "seed": i, **extra}
                # the first event after the role delta: content, a tool call or logprobs
                ttfts = await _ttfts(http, "/v1/chat/completions", body, headers, b'"role":"assistant"', observer)
                if i >= 10 and ttfts is not None:
                    seen[name][0].append(ttfts[0])
                    seen[name][1].append(ttfts[1])
    await observer.bus.close()
    return {name: (np.array(c), np.array(w)) for name, (c, w) in seen.items()}


# The same plain streamed request through each HTTP API, and what marks its first text event.
APIS: dict[str, tuple[str, dict[str, object], bytes | None]] = {
    # (chat: the first event after the role delta, as in the other tables)
    "chat completions": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, None),
    "Responses API": ("/v1/responses", {"input": "x" * 200, "store": False}, b'"response.output_text.delta"'),
    "Anthropic's Messages API": ("/v1/messages", {"messages": [{"role": "user", "content": "x" * 200}]},
                                 b'"text_delta"'),
}


async def api_latency(mesh: Mesh, requests: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Client and worker TTFT per HTTP API, the same request through each, interleaved:
    what the Responses and Messages translations add over chat completions."""
    observer = await Observer.open(mesh)
    seen: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in APIS}
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for i in range(requests + 10):
            for name, (path, body, marker) in APIS.items():
                limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                full = {"model": MODEL, **body, limit: 16, "stream": True, "seed": i}
                ttfts = await _ttfts(http, path, full, headers, b'"role":"assistant"', observer, first_with=marker)
                if i >= 10 and ttfts is not None:
                    seen[name][0].append(ttfts[0])
                    seen[name][1].append(ttfts[1])
    await observer.bus.close()
    return {name: (np.array(c), np.array(w)) for name, (c, w) in seen.items()}


def print_api_latency(apis: dict[str, tuple[np.ndarray, np.ndarray]], requests: int) -> None:
    print(f"\n### Added latency per HTTP API ({requests} sequential streamed requests each, interleaved)\n")
    print("| API | added p50 ms | p90 ms | p99 ms | worker TTFT p50 ms |\n|---|---:|---:|---:|---:|")
    for name, (client_s, worker_s) in apis.items():
        a = (client_s - worker_s) * 1000
        print(f"| {name} | {np.percentile(a, 50):.2f} | {np.percentile(a, 90):.2f} | {np.percentile(a, 99):.2f} "
              f"| {np.percentile(worker_s * 1000, 50):.2f} |")


async def relay(mesh: Mesh, concurrency: int, duration: float,
                extra_body: dict[str, object] | None = None) -> tuple[float, dict[str, float], float, float, float]:
    """Closed-loop streams for ``duration``: output tokens/s the client received, each
    process's CPU (cores) over the run, the client's ITL p50/p99 (ms), and the mean
    tokens per SSE event."""
    pids = _pids(mesh)
    cpu0 = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    client0, t0 = time.process_time(), time.monotonic()
    config = BenchConfig(
        endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", api="completions", model=mesh.config.model,
                                  api_key=mesh.dev_key)],
        workload=WorkloadConfig(kind="random", input_tokens="64", output_tokens="2000"),
        concurrency=[concurrency], duration=duration, num_requests=None, request_timeout=120, drain_timeout=30, seed=1,
        extra_body=dict(extra_body or {}),
    )
    result = await run_bench(config)
    wall = time.monotonic() - t0
    cpu = {name: (_cpu_seconds(pid) - cpu0[name]) / wall for name, pid in pids.items()}
    cpu["client"] = (time.process_time() - client0) / wall
    run = result.runs[0]
    events = sum(len(r.chunk_tokens) for r in run.requests)
    per_event = sum(sum(r.chunk_tokens) for r in run.requests) / max(events, 1)
    return (run.summary.output_token_throughput, cpu, run.summary.itl_ms.p50 or 0.0, run.summary.itl_ms.p99 or 0.0,
            per_event)


async def relay_table(tmp: Path, duration: float, engine: str, env: dict[str, str], gateway_args: list[str],
                      max_messages_per_s: float | None = None) -> None:
    """Relay throughput through one gateway from two workers of ``engine``; each worker
    sends at most ``max_messages_per_s`` chunks a second (None: the worker's default),
    more tokens a chunk beyond it."""
    cap = ["--max-messages-per-s", f"{max_messages_per_s:g}"] if max_messages_per_s else []
    if engine == "echo":
        # 3200 tokens/s a stream in outputs of 16 (every 5 ms): the chunks a sim worker sends
        # at 64 streams, for a few µs of the worker's CPU a token instead of ~13.
        model = "echo"
        workers = MeshConfig(state_dir=tmp, nats_port=0, http_port=free_port(), model=model, workers=2, engine="echo",
                             worker_args=["--echo-tokens-per-s", "3200", "--echo-interval-ms", "5",
                                          "--max-num-seqs", "512", *cap], extra_env=env, gateway_args=gateway_args)
        source = "two echo workers (3200 tokens/s a stream, 16 an output)"
    else:
        model = MODEL
        workers = MeshConfig(state_dir=tmp, nats_port=0, http_port=free_port(), model=model, workers=2, speed=50.0,
                             worker_args=["--max-num-seqs", "512", "--num-kv-blocks", "200000", *cap],
                             extra_env=env, gateway_args=gateway_args)
        source = "two sim workers at speed 50"
    if cap:
        source += f", at most {max_messages_per_s:g} chunks/s each"
    mesh = Mesh(workers)
    await mesh.start()
    try:
        print(f"\n### Relay throughput ({duration:.0f} s closed loop per point, 2000-token outputs, {source})\n")
        print("| concurrent streams | output tokens/s | tokens an event | ITL p50 ms | ITL p99 ms | gateway CPU (cores) "
              "| gateway CPU s per 1k tokens | workers (cores) | nats-server | client |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        points: list[tuple[int, dict[str, object] | None]] = [(1, None), (64, None), (512, None), (64, {"logprobs": 5})]
        for c, extra in points:
            tps, cpu, itl50, itl99, per_event = await relay(mesh, c, duration, extra)
            label = f"{c}, logprobs 5" if extra else str(c)
            gw = cpu.get("gateway", 0.0)
            worker_cores = sum(v for k, v in cpu.items() if k.startswith("worker"))
            print(f"| {label} | {tps:,.0f} | {per_event:.1f} | {itl50:.2f} | {itl99:.2f} | {gw:.2f} | {gw / max(tps, 1) * 1000:.4f} "
                  f"| {worker_cores:.2f} | {cpu.get('nats-server', 0.0):.2f} | {cpu['client']:.2f} |", flush=True)
    finally:
        mesh.stop()


async def request_path(rates: list[float], seconds: float) -> None:
    """Issue 19's request-path throughput: open-loop Poisson arrivals of tiny requests (16
    prompt tokens, 1 output token) through one gateway, one router and one admission, to
    two sim workers at speed 100 (their own TTFT, ~0.1 ms, is left in: it is noise here),
    rate after rate on one mesh; the client's TTFT p50/p99 and each service's CPU share."""
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "p", nats_port=0, http_port=free_port(), model=MODEL, workers=2,
                               speed=100.0, worker_args=["--max-num-seqs", "256"]))
        await mesh.start()
        pids = _pids(mesh)
        rows = []
        try:
            for rate in rates:
                cpu0, t0 = {n: _cpu_seconds(pid) for n, pid in pids.items()}, time.monotonic()
                config = BenchConfig(
                    endpoints=[EndpointConfig(url=mesh.gateway_url + "/v1", api="completions", model=MODEL,
                                              api_key=mesh.dev_key)],
                    workload=WorkloadConfig(kind="random", input_tokens="16", output_tokens="1"),
                    rates=[rate], duration=seconds, num_requests=None, request_timeout=30, seed=1,
                )
                run = (await run_bench(config)).runs[0]
                elapsed = time.monotonic() - t0
                cpu = {n: (_cpu_seconds(pid) - cpu0[n]) / elapsed for n, pid in pids.items()}
                rows.append((rate, run, cpu))
        finally:
            mesh.stop()
    print(f"\n### Request path: tiny requests through one gateway, router and admission ({seconds:.0f} s per rate)\n")
    print("| offered req/s | sent req/s | served req/s | errors | TTFT p50 ms | p99 ms | gateway CPU | router CPU "
          "| admission CPU | workers | metering | nats-server | client lag p99 ms |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    best = None
    for rate, run, cpu in rows:
        s = run.summary
        p99 = s.ttft_ms.p99 or math.inf
        if p99 <= 5.0:
            best = rate
        # sent: the Poisson arrivals' realised rate (a 15 s sample of the offered one);
        # served: completions over the run, from the first send to the last end
        print(f"| {rate:g} | {s.offered_rate or 0:.0f} | {s.request_throughput:.0f} | {sum(s.errors.values())} "
              f"| {s.ttft_ms.p50 or 0:.2f} | {p99:.2f} "
              f"| {cpu.get('gateway', 0):.0%} | {cpu.get('router', 0):.0%} | {cpu.get('admission', 0):.0%} "
              f"| {sum(v for k, v in cpu.items() if k.startswith('worker')):.0%} | {cpu.get('metering', 0):.0%} "
              f"| {cpu.get('nats-server', 0):.0%} | {run.client.lag_ms.p99:.1f} |")
    print(f"\nhighest rate with TTFT p99 ≤ 5 ms: {best:g} req/s" if best else "\nno rate kept TTFT p99 ≤ 5 ms")


class OtlpSink:
    """An OTLP/HTTP endpoint that accepts every export and counts the bytes: the mesh's
    services export their spans to it as they would to a collector (``--tracing otlp``)."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _traces(self, request: web.Request) -> web.Response:
        self.exports += 1
        self.bytes += len(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def tracing_env(tracing: str, sink: OtlpSink | None) -> dict[str, str]:
    """The mesh's environment for ``--tracing``: as inherited, exporting OTLP to ``sink``
    (every request sampled, the SDK's default), or the SDK off."""
    if tracing == "otlp":
        assert sink is not None
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_SDK_DISABLED": "false"}
    if tracing == "off":
        return {"OTEL_SDK_DISABLED": "true"}
    return {}


async def main(requests: int, duration: float, latency_only: bool = False, tracing: str = "default",
               gateway_args: tuple[str, ...] = (), gap_s: float = 0.0, relay_only: bool = False,
               relay_engine: str = "echo", max_messages_per_s: float | None = None, concurrency: int = 1,
               apis_only: bool = False) -> None:
    sink = OtlpSink()
    if tracing == "otlp":
        await sink.start()
    try:
        env = tracing_env(tracing, sink)
        if apis_only:
            with tempfile.TemporaryDirectory() as tmp:
                mesh = Mesh(MeshConfig(state_dir=Path(tmp), nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                                       speed=1.0, extra_env=env, gateway_args=list(gateway_args)))
                await mesh.start()
                try:
                    apis = await api_latency(mesh, requests)
                finally:
                    mesh.stop()
            print_api_latency(apis, requests)
        elif relay_only:
            with tempfile.TemporaryDirectory() as tmp:
                await relay_table(Path(tmp), duration, relay_engine, env, list(gateway_args), max_messages_per_s)
        else:
            await _run(requests, duration, latency_only, env, tracing, list(gateway_args), gap_s, relay_engine,
                       max_messages_per_s, concurrency)
    finally:
        await sink.stop()
    if tracing == "otlp":
        print(f"\nSpans the mesh exported to the OTLP sink: {sink.exports} exports, {sink.bytes / 1e6:.1f} MB")


async def _run(requests: int, duration: float, latency_only: bool, env: dict[str, str], tracing: str,
               gateway_args: list[str], gap_s: float, relay_engine: str, max_messages_per_s: float | None,
               concurrency: int = 1) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # Latency: real-time sim (speed 1) so the worker's TTFT is a realistic few ms.
        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "a", nats_port=0, http_port=free_port(), model=MODEL, workers=1, speed=1.0,
                               extra_env=env, gateway_args=gateway_args))
        await mesh.start()
        phases: dict[str, list[float]] = {}
        hops: list[list[float]] = []
        cpu_ms: dict[str, float] = {}
        lag_ms: list[float] = []
        try:
            client, worker = await added_latency(mesh, requests, phases, hops, cpu_ms, gap_s, concurrency, lag_ms)
        finally:
            mesh.stop()
        added = (client - worker) * 1000
        gap = f", {gap_s * 1000:g} ms apart" if gap_s else ""
        how = "sequential requests" if concurrency == 1 else f"requests from {concurrency} concurrent streams"
        print(f"### Added latency ({len(added)} {how}{gap}, 256-token prompts, tracing: {tracing})\n")
        print("| | p50 ms | p90 ms | p99 ms |\n|---|---:|---:|---:|")
        for name, values in (("client TTFT", client * 1000), ("worker's own TTFT", worker * 1000), ("added by the mesh", added)):
            print(f"| {name} | {np.percentile(values, 50):.2f} | {np.percentile(values, 90):.2f} | {np.percentile(values, 99):.2f} |")
        print(f"\n### Per-hop breakdown of the client TTFT (the same requests, {len(hops)} with every stamp)\n")
        print_hops(hops, phases)
        print("\nCPU per request (ms, each process's user + system time over the same requests): "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(cpu_ms.items(), key=lambda kv: -kv[1])))
        if lag_ms:
            print(f"Client event loop lag (ms, sampled every 10 ms): p50 {np.percentile(lag_ms, 50):.2f}, "
                  f"p99 {np.percentile(lag_ms, 99):.2f}, max {max(lag_ms):.2f}")
        if latency_only:
            return

        mesh = Mesh(MeshConfig(state_dir=Path(tmp) / "f", nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                               speed=1.0, extra_env=env, gateway_args=gateway_args))
        await mesh.start()
        try:
            features = await feature_latency(mesh, requests // 2)
        finally:
            mesh.stop()
        print(f"\n### Added latency per feature ({requests // 2} sequential chat requests each, interleaved)\n")
        print("| request | added p50 ms | p90 ms | p99 ms | worker TTFT p50 ms |\n|---|---:|---:|---:|---:|")
        for name, (client_s, worker_s) in features.items():
            a = (client_s - worker_s) * 1000
            print(f"| {name} | {np.percentile(a, 50):.2f} | {np.percentile(a, 90):.2f} | {np.percentile(a, 99):.2f} "
                  f"| {np.percentile(worker_s * 1000, 50):.2f} |")

        await relay_table(Path(tmp) / "b", duration, relay_engine, env, gateway_args, max_messages_per_s)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--latency-only", action="store_true", help="the added latency and its breakdown alone")
    parser.add_argument("--tracing", choices=("default", "otlp", "off"), default="default",
                        help="the mesh's tracing: as the environment says (default), exporting every span over "
                             "OTLP/HTTP to a sink in this process (otlp), or the SDK off (off)")
    parser.add_argument("--placement-path", choices=("admission", "gateway"), default=None,
                        help="the gateway's --placement-path (default: the gateway's default)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle time between the sequential requests (default 0: each as the previous one ends)")
    parser.add_argument("--concurrency", type=int, choices=range(1, 1025), metavar="N", default=1,
                        help="the added latency from this many concurrent streams, each sending its next request as"
                             " its previous one ends (default 1: sequential requests)")
    parser.add_argument("--relay-only", action="store_true", help="the relay throughput alone")
    parser.add_argument("--apis-only", action="store_true",
                        help="the added latency of the same request through chat completions, the Responses API and"
                             " Anthropic's Messages API, interleaved, alone")
    parser.add_argument("--relay-engine", choices=("echo", "sim"), default="echo",
                        help="the relay's token source: echo workers (a few µs of CPU a token, so the gateway is"
                             " what is measured) or sim workers at speed 50 (~13 µs a token, half this machine)")
    parser.add_argument("--worker-max-messages-per-s", type=float, default=None,
                        help="the relay's workers' --max-messages-per-s (default: the worker's, 1000): higher keeps"
                             " chunks near 16 tokens at high rates, the gateway's hardest case")
    parser.add_argument("--request-path", default=None, metavar="RATES",
                        help="only the request-path throughput: comma-separated req/s of tiny requests, in turn")
    args = parser.parse_args()
    import uvloop

    if args.request_path:
        uvloop.run(request_path([float(r) for r in args.request_path.split(",")], args.duration))
    else:
        uvloop.run(main(args.requests, args.duration, args.latency_only, args.tracing,
                        ("--placement-path", args.placement_path) if args.placement_path else (), args.gap_ms / 1000,
                        args.relay_only, args.relay_engine, args.worker_max_messages_per_s, args.concurrency,
                        args.apis_only))
