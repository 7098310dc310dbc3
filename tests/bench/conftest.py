"""Known-delay fakes for the bench tests: an OpenAI-compatible HTTP server and a NATS
responder speaking meshserve's API protocol, both answering with a first token after
``ttft`` seconds and then one token every ``itl`` seconds.

They run on their own event loop in a background thread, so the client under test and
the fake do not share a loop, and they log their own (perf_counter) send times: the
tests compare what the client measured with what the server really did.

Behaviour is chosen by the request's model name: ``sim`` streams normally, ``err429``
answers 429, ``err500`` answers 500, ``noend`` closes the stream without [DONE].
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from proto.subjects import Subjects


@dataclass
class ServedRequest:
    model: str
    body: dict[str, Any]
    headers: dict[str, str]
    t_recv: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.t_recv


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].encode()) for m in body["messages"])
    return len(body.get("prompt", "").encode())


class KnownDelayServer:
    def __init__(self, ttft: float = 0.2, itl: float = 0.02, tokens_per_chunk: int = 1) -> None:
        self.ttft = ttft
        self.itl = itl
        self.tokens_per_chunk = tokens_per_chunk
        self.served: list[ServedRequest] = []
        self.inflight = 0
        self.max_inflight = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self._nc: Any = None
        self.base_url = ""

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- the token schedule, shared by both protocols

    async def _generate(self, req: ServedRequest, emit: Any) -> None:
        """Emit max_tokens tokens: first at t_recv+ttft, then every itl (absolute times)."""
        n = int(req.body.get("max_tokens") or 16)
        chat = "messages" in req.body
        t_first = req.t_recv + self.ttft
        k = 0
        while k < n:
            c = min(self.tokens_per_chunk, n - k)
            due = t_first + (k + c - 1) * self.itl
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            k += c
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if k == n else None}
            if chat:
                choice["delta"] = {"content": "a" * c} if k > c else {"role": "assistant", "content": "a" * c}
            else:
                choice["text"] = "a" * c
            # Logged before the write: the client can never see a token before this instant.
            req.token_times.extend([time.perf_counter()] * c)
            await emit({"id": "x", "object": "chunk", "choices": [choice]}, final=False)
            if req.model == "noend" and k >= n // 2:
                return  # the stream breaks off: no finish reason, no usage, no end marker
        usage = {"prompt_tokens": req.prompt_tokens, "completion_tokens": n,
                 "total_tokens": req.prompt_tokens + n}
        await emit({"id": "x", "object": "chunk", "choices": [], "usage": usage}, final=True)

    def _track(self, delta: int) -> None:
        self.inflight += delta
        self.max_inflight = max(self.max_inflight, self.inflight)

    # -- HTTP

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t_recv = time.perf_counter()
        body = await request.json()
        req = ServedRequest(body.get("model", ""), body, dict(request.headers), t_recv, _prompt_tokens(body))
        self.served.append(req)
        if req.model in ("err429", "err500"):
            status = 429 if req.model == "err429" else 500
            err = {"error": {"message": "slow down", "type": "rate_limit", "param": None, "code": "quota"}}
            return web.json_response(err, status=status)
        self._track(1)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def emit(obj: dict[str, Any], final: bool) -> None:
                if final and not body.get("stream_options", {}).get("include_usage"):
                    return
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            try:
                await self._generate(req, emit)
                if req.model != "noend":
                    await resp.write(b"data: [DONE]\n\n")
            except ConnectionError:
                pass  # the client gave up (timeout tests)
            return resp
        finally:
            self._track(-1)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def _start_http(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/v1"

    def start_http(self) -> str:
        self.base_url = self.call(self._start_http())
        return self.base_url

    # -- NATS (meshserve's API protocol)

    async def _start_nats(self, url: str, root: str) -> None:
        import nats

        self._nc = await nats.connect(url)
        subjects = Subjects(root)
        for subject in (subjects.api_chat, subjects.api_completions):
            await self._nc.subscribe(subject, queue="gateway", cb=self._on_nats)
        await self._nc.flush()

    async def _on_nats(self, msg: Any) -> None:
        t_recv = time.perf_counter()
        body = json.loads(msg.data)
        req = ServedRequest(body.get("model", ""), body, dict(msg.headers or {}), t_recv, _prompt_tokens(body))
        self.served.append(req)
        self.loop.create_task(self._serve_nats(req, msg.reply))

    async def _serve_nats(self, req: ServedRequest, reply: str) -> None:
        nc = self._nc
        if req.model in ("err429", "err500"):
            code = "429" if req.model == "err429" else "500"
            err = {"error": {"message": "slow down", "type": "rate_limit", "param": None, "code": "quota"}}
            await nc.publish(reply, json.dumps(err).encode(),
                             headers={"Nats-Service-Error": "slow down", "Nats-Service-Error-Code": code})
            return
        self._track(1)
        try:
            async def emit(obj: dict[str, Any], final: bool) -> None:
                headers = {"Meshserve-Done": "1"} if final else None
                await nc.publish(reply, json.dumps(obj).encode(), headers=headers)

            await self._generate(req, emit)
        finally:
            self._track(-1)

    def start_nats(self, url: str, root: str = "mesh") -> None:
        self.call(self._start_nats(url, root))

    async def _stop(self) -> None:
        if self._nc is not None:
            await self._nc.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


# Nominal delays of the known-delay fakes (the example: X=200 ms, Y=20 ms).
TTFT_S = 0.200
ITL_S = 0.020


@pytest.fixture
def http_server() -> Iterator[KnownDelayServer]:
    server = KnownDelayServer(TTFT_S, ITL_S)
    server.start_http()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_responder(nats_url: str) -> Iterator[KnownDelayServer]:
    server = KnownDelayServer(TTFT_S, ITL_S)
    server.start_nats(nats_url)
    try:
        yield server
    finally:
        server.stop()
