"""Thin async clients that send one streaming request and feed a ``StreamAccumulator``.

- ``OpenAITarget``: any OpenAI-compatible HTTP server; aiohttp, SSE parsed here.
- ``NatsTarget``: meshserve's NATS API. One wildcard subscription on a private inbox
  prefix receives every reply (a callback, not a ``next_msg`` loop); each request
  publishes with its own fresh inbox subject under it and is routed by subject.

Timestamps are ``time.perf_counter()`` taken as each chunk is handed to us.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import msgspec

from ops.bench.config import EndpointConfig
from ops.bench.results import (
    STATUS_CONNECTION,
    STATUS_NO_RESPONDERS,
    STATUS_PAYLOAD,
    STATUS_PROTOCOL,
)
from ops.bench.stream import SSEParser, StreamAccumulator, error_message
from proto.subjects import Subjects

log = logging.getLogger(__name__)

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

HDR_DONE = "Meshserve-Done"
HDR_ERROR = "Nats-Service-Error"
HDR_ERROR_CODE = "Nats-Service-Error-Code"


class Target(Protocol):
    endpoint: EndpointConfig
    discovery_error: str | None  # why discover_model found none, for the error the user sees
    discovery_hint: str  # and what to do about it
    discovery_unreachable: bool  # the server did not answer at all: a failure at run time, not bad input

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def discover_model(self) -> str | None: ...

    async def send(self, body: dict[str, Any], acc: StreamAccumulator) -> None:
        """Send ``body``; ``acc.t_sent`` is set to the send instant here."""
        ...


PASS_MODEL = "pass --model"
PASS_KEY = "pass the API key with --api-key, or set MESHSERVE_API_KEY or OPENAI_API_KEY"
KEY_REFUSED = ("the API key sent (--api-key, MESHSERVE_API_KEY or OPENAI_API_KEY) was refused: check it "
               "(`meshserve keys list` shows the mesh's key ids; `make up` writes its development key to "
               ".meshserve/dev-key)")


def make_target(endpoint: EndpointConfig) -> Target:
    return NatsTarget(endpoint) if endpoint.kind == "nats" else OpenAITarget(endpoint)


def _auth_headers(endpoint: EndpointConfig) -> dict[str, str]:
    headers = dict(endpoint.headers)
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    return headers


class OpenAITarget:
    def __init__(self, endpoint: EndpointConfig) -> None:
        self.endpoint = endpoint
        self.base = endpoint.url.rstrip("/")
        path = "/chat/completions" if endpoint.api == "chat" else "/completions"
        self.url = self.base + path
        self._session: aiohttp.ClientSession | None = None
        self.discovery_error: str | None = None
        self.discovery_hint = PASS_MODEL
        self.discovery_unreachable = False

    async def start(self) -> None:
        # limit=0: an open-loop client must never queue requests behind a pool limit.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers={"Content-Type": "application/json", **_auth_headers(self.endpoint)},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def discover_model(self) -> str | None:
        assert self._session is not None
        try:
            async with self._session.get(self.base + "/models") as resp:
                raw = await resp.read()
                if resp.status != 200:
                    try:
                        message = error_message(_decode(raw))[0]
                    except msgspec.DecodeError:
                        message = raw[:200].decode(errors="replace")
                    self.discovery_error = f"GET {self.base}/models answered {resp.status}: {message}"
                    if resp.status in (401, 403):  # --model would only move the refusal to every request
                        self.discovery_hint = KEY_REFUSED if self.endpoint.api_key else PASS_KEY
                    return None
                data = _decode(raw)
            models = data.get("data") or []
            if not models:
                self.discovery_error = f"GET {self.base}/models lists no model"
            return str(models[0]["id"]) if models else None
        except (aiohttp.ClientError, msgspec.DecodeError, KeyError, TypeError, IndexError) as exc:
            self.discovery_error = f"GET {self.base}/models failed: {type(exc).__name__}: {exc}"
            if isinstance(exc, aiohttp.ClientConnectionError):
                self.discovery_hint = f"is a server running at {self.base}? (`make up` prints its address)"
                self.discovery_unreachable = True
            return None

    async def send(self, body: dict[str, Any], acc: StreamAccumulator) -> None:
        assert self._session is not None
        payload = _encode(body)
        acc.start(time.perf_counter())
        try:
            async with self._session.post(self.url, data=payload) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    try:
                        msg, code = error_message(_decode(raw))
                    except msgspec.DecodeError:
                        msg, code = raw[:200].decode("utf-8", "replace"), None
                    acc.fail(time.perf_counter(), str(resp.status),
                             f"{code}: {msg}" if code else msg, http_status=resp.status)
                    return
                parser = SSEParser()
                async for line in resp.content:
                    t = time.perf_counter()
                    data = parser.feed_line(line)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        acc.on_done(t)
                        return
                    try:
                        obj = _decode(data)
                    except msgspec.DecodeError:
                        acc.fail(t, STATUS_PROTOCOL, f"bad chunk: {data[:80]!r}")
                        return
                    acc.on_chunk(t, obj)
                    if acc.finished:
                        return
                t = time.perf_counter()
                tail = parser.flush()
                if tail == "[DONE]":
                    acc.on_done(t)
                else:
                    acc.on_eof(t)
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            acc.fail(time.perf_counter(), STATUS_CONNECTION, f"{type(exc).__name__}: {exc}")
        except ValueError as exc:  # aiohttp: an SSE line over its buffer limit
            acc.fail(time.perf_counter(), STATUS_PROTOCOL, f"{type(exc).__name__}: {exc}")


class NatsTarget:
    def __init__(self, endpoint: EndpointConfig) -> None:
        self.endpoint = endpoint
        subjects = Subjects(endpoint.root)
        self.subject = subjects.api_chat if endpoint.api == "chat" else subjects.api_completions
        self.discovery_error: str | None = "meshserve's NATS API lists no models"
        self.discovery_hint = PASS_MODEL
        self.discovery_unreachable = False  # an unreachable NATS fails start() already
        self._nc: Any = None
        self._prefix = ""
        self._seq = itertools.count()
        self._handlers: dict[str, Callable[[float, Any], None]] = {}
        self._headers = _auth_headers(endpoint)
        self._cancel_subject = subjects.api_cancel
        self.errors: list[Exception] = []  # what nats-py reported while connecting
        self._connected = False

    async def _on_error(self, exc: Exception) -> None:
        # While connecting, nats-py's default logs every error with its traceback (4 of them
        # for one refused connect): the bench reports the outcome once. Once connected, an
        # error (a slow consumer, a permission, a reconnect) is logged: else it would show
        # only as requests timing out.
        if self._connected:
            log.warning("nats: %s", exc or type(exc).__name__)
        elif len(self.errors) < 16:
            self.errors.append(exc)

    async def start(self) -> None:
        import nats

        from ops.console import unreachable_servers
        from services.common.cli_types import shown_nats_url

        hint = "(is the mesh up? `meshserve up` starts it)"
        # nats-py retries a refused connection until its connect timeout: say it at once.
        unreachable = await unreachable_servers([self.endpoint.url], timeout_s=10)
        if unreachable:
            raise ConnectionError(f"cannot reach NATS at {unreachable[0]} {hint}")
        try:
            self._nc = await nats.connect(self.endpoint.url, name="meshserve-bench",
                                          max_reconnect_attempts=3, reconnect_time_wait=0.5,
                                          connect_timeout=10, error_cb=self._on_error)
        except Exception as exc:  # nats-py's own families, OSError, TimeoutError
            cause = self.errors[-1] if self.errors else exc
            why = str(cause) or type(cause).__name__
            raise ConnectionError(f"cannot connect to NATS at {shown_nats_url(self.endpoint.url)}: {why}") from exc
        self._connected = True
        await self._check_key()
        self._prefix = self._nc.new_inbox()
        # Generous pending limits: a slow callback must show up as lag, not as drops.
        await self._nc.subscribe(self._prefix + ".*", cb=self._dispatch,
                                 pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = None

    async def _check_key(self) -> None:
        """Preflight: ask the gateway to cancel no request. It checks the API key first, so
        a 401/403 here is the refusal every request would get, said once, before the run.
        Any other answer (400: no id), or none, leaves it to the requests."""
        from nats.errors import Error as NatsError

        try:
            msg = await self._nc.request(self._cancel_subject, b"", timeout=5,
                                         headers=self._headers or None)
        except (NatsError, TimeoutError):
            return
        headers = msg.headers or {}
        code = headers.get(HDR_ERROR_CODE)
        if code not in ("401", "403"):
            return
        text = headers.get(HDR_ERROR, "")
        try:
            text = error_message(_decode(msg.data))[0] if msg.data else text
        except msgspec.DecodeError:
            pass
        hint = KEY_REFUSED if self.endpoint.api_key else PASS_KEY
        raise ValueError(f"meshserve's NATS API at {self.endpoint.url} answered {code}: {text}; {hint}")

    async def discover_model(self) -> str | None:
        return None

    async def _dispatch(self, msg: Any) -> None:
        t = time.perf_counter()
        handler = self._handlers.get(msg.subject)
        if handler is not None:  # late replies of finished requests are dropped
            handler(t, msg)

    async def send(self, body: dict[str, Any], acc: StreamAccumulator) -> None:
        nc = self._nc
        assert nc is not None
        payload = _encode(body)
        acc.start(time.perf_counter())
        if len(payload) > nc.max_payload:
            acc.fail(acc.t_sent, STATUS_PAYLOAD, f"body {len(payload)} B > max_payload {nc.max_payload} B")
            return
        inbox = f"{self._prefix}.{next(self._seq)}"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_msg(t: float, msg: Any) -> None:
            headers = msg.headers or {}
            code = headers.get(HDR_ERROR_CODE)
            if code is not None:
                text = headers.get(HDR_ERROR, "")
                if msg.data:
                    try:
                        m, c = error_message(_decode(msg.data))
                        text = f"{c}: {m}" if c else m
                    except msgspec.DecodeError:
                        pass
                try:
                    http = int(code)
                except ValueError:
                    http = None
                acc.fail(t, str(code), text, http_status=http)
            elif headers.get("Status") == "503" and not msg.data:
                acc.fail(t, STATUS_NO_RESPONDERS, f"no responders on {self.subject}", http_status=503)
            else:
                if msg.data:
                    try:
                        acc.on_chunk(t, _decode(msg.data))
                    except msgspec.DecodeError:
                        acc.fail(t, STATUS_PROTOCOL, f"bad chunk: {msg.data[:80]!r}")
                if headers.get(HDR_DONE):
                    acc.on_done(t)
            if acc.finished and not done.done():
                done.set_result(None)

        self._handlers[inbox] = on_msg
        try:
            await nc.publish(self.subject, payload, reply=inbox, headers=self._headers or None)
            await done
        except (ConnectionError, OSError) as exc:
            acc.fail(time.perf_counter(), STATUS_CONNECTION, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # nats errors (closed connection, ...) are connection errors here
            if type(exc).__module__.startswith("nats"):
                acc.fail(time.perf_counter(), STATUS_CONNECTION, f"{type(exc).__name__}: {exc}")
            else:
                raise
        finally:
            self._handlers.pop(inbox, None)
