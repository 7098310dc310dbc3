"""The gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS request-reply front door.

Stateless and cheap: authenticate (API keys from ``mesh_keys``), validate and tokenize
once, ask admission, ask the router (which forwards to a worker), then relay the
worker's token chunks from the TOKENS stream to the client. Many replicas may run
behind any load balancer; a client that lost its connection resumes on any replica.

This module is the shell that wires the parts together and owns what outlives one
request: the HTTP server, the resume-window timers. The front doors are ``http_api``,
``ws_api`` and ``nats_api``; a request's life is ``lifecycle.ActiveRequest``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from bus import BusSettings, Service
from bus.keys import AdapterStore, KeyStore
from bus.provision import requests_bucket
from bus.registry import WorkerRegistry
from bus.tokenizers import TokenizerFiles
from proto import SUPERSEDED, Placement, RequestRecord, UsageEvent, usage_dedup_id

from .auth import Authenticator
from .config import GatewayConfig
from .http_api import HttpApi
from .jwks import Oidc
from .metrics import GatewayMetrics
from .models import ModelCatalog
from .nats_api import NatsApi
from .records import ResumeRecords
from .streams import TokenDispatcher
from .upstream import UpstreamClient
from .ws_api import WsApi

log = logging.getLogger(__name__)
# How long a starting gateway waits for the tokenizers it must fetch (bus.tokenizers)
# before it takes requests: a 30 MB tokenizer takes well under a second on a LAN.
TOKENIZER_FETCH_WAIT_S = 30.0
MAX_HEADER_BYTES = 65_536  # one header's value (room for a large JWT), or the request line


class GatewayService(Service):
    name = "gateway"
    description = "meshserve gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS API"

    def __init__(self, config: GatewayConfig | None = None, settings: BusSettings | None = None) -> None:
        config = config or GatewayConfig()
        super().__init__(settings, instance_id=config.gateway_id or None)
        self.config = config
        self.gateway_id = self.instance_id
        self.metrics = GatewayMetrics()
        self.bound_port = config.port
        self._runner: web.AppRunner | None = None
        self._trusted = [ipaddress.ip_network(c, strict=False) for c in config.trusted_proxies]
        self._timers: set[asyncio.Task[None]] = set()
        self.oidc: Oidc | None = None  # bearer JWT callers, when an issuer is configured

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        self.registry = WorkerRegistry(self.bus)
        await self.registry.start()
        self.keys = await KeyStore(self.bus).open()
        await self.keys.watch()
        if self.config.oidc.enabled:
            self.oidc = Oidc(self.config.oidc)
        self.auth = Authenticator(self.keys.records, await self.oidc.start() if self.oidc else None)
        self.adapters = await AdapterStore(self.bus).open()
        await self.adapters.watch()
        self.tokenizer_files = TokenizerFiles(self.bus.js, self.bus.subjects)
        self.tokenizer_files.watch(self.registry)
        self.models = ModelCatalog(self.registry, self.config.model_limits, self.config.aliases, self.adapters.records,
                                   self.tokenizer_files)
        kv = await requests_bucket(self.bus.js, self.bus.subjects, replicas=self.settings.js_replicas)
        self.records = ResumeRecords(kv)
        self.dispatcher = TokenDispatcher(self.bus, self.gateway_id, max_buffered=self.config.stream_buffer_chunks,
                                          on_usage=self.echo_usage)
        await self.dispatcher.start()
        # A worker gone from the registry: its streams check on it now, not at their next
        # quiet second (they migrate at once; the others find their worker listed).
        self.registry.on_change(lambda worker_id, info: self.dispatcher.wake_all() if info is None else None)
        self.metrics.in_flight.set_function(lambda: self.streams_in_flight)
        self.upstream = UpstreamClient(
            self.bus, self.registry, self.config.upstream,
            on_unreachable=lambda outcome: self.metrics.admission_unreachable.labels(outcome=outcome).inc(),
            gateway_id=self.gateway_id, on_late_placement=self._late_placement,
        )
        await self.upstream.start()
        await self.tokenizer_files.settled(TOKENIZER_FETCH_WAIT_S)
        await NatsApi(self).add_endpoints()
        await self._start_http()

    async def on_drain(self) -> None:
        # New HTTP connections are refused once the site stops; open streams finish.
        await self.stop_endpoints()
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()

    async def on_stop(self) -> None:
        for timer in list(self._timers):
            timer.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.upstream.stop()
        await self.dispatcher.stop()
        await self.registry.stop()
        await self.tokenizer_files.close()
        await self.keys.stop()
        await self.adapters.stop()
        if self.oidc is not None:
            await self.oidc.stop()

    def stats(self) -> dict[str, Any]:
        return {"gateway_id": self.gateway_id, "streams": self.streams_in_flight, "http": self.http_url}

    @property
    def streams_in_flight(self) -> int:
        """Requests being relayed: each holds one open stream from admission to its close."""
        return len(self.dispatcher.streams)

    @property
    def connected(self) -> bool:
        return self._bus is not None and self.bus.nc.is_connected

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{self.config.host}:{self.bound_port}"

    async def _start_http(self) -> None:
        http_api = HttpApi(self)
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[http_api.error_middleware])
        app.add_routes(http_api.routes() + WsApi(self).routes())
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the worker.
        # max_field_size: an OIDC bearer token with many claims (groups) passes aiohttp's 8,190
        # bytes a header, which aiohttp refuses with a plain-text 400 before any handler runs;
        # max_line_size: the same for a request line (a long model id in GET /v1/models/{id}).
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     max_field_size=MAX_HEADER_BYTES, max_line_size=MAX_HEADER_BYTES)
        await self._runner.setup()
        ssl_context = None
        if self.config.tls_cert:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context)
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of each bound socket; port 0 picks one
        self.bound_port = addresses[0][1] if addresses else self.config.port
        log.info("gateway %s serving %s", self.gateway_id, self.http_url)

    def _late_placement(self, placement: Placement) -> None:
        """A forwarded request placed after its start stopped waiting: when nothing here
        reads it any more (its client went away), that copy is stopped and bills nothing;
        one still in flight was adopted where it runs."""
        if placement.request_id not in self.dispatcher.streams:
            self.spawn(self.upstream.cancel(placement.worker_id, placement.request_id, SUPERSEDED,
                                            attempt=placement.attempt),
                       name=f"cancel-{placement.request_id}")

    # ---- what outlives a request's relay ----------------------------------------------
    async def publish_usage(self, event: UsageEvent, dedup_id: str) -> None:
        """A usage event the gateway bills itself (a request no worker took, a lost segment):
        published in the background until USAGE stores it, so a bill survives an election
        and the request path never waits on it. Returns at once (a coroutine only so that
        its callers need not change); the drain waits for the publish like a request.

        No caller needs the bill stored before it goes on: each event has its own dedup id
        (the refused request's, or the lost segment's: the one its worker would have used),
        so any copy counts once, and metering bills events in any order. Only admission's
        token bucket could see a lost first segment after the next one's event, and only
        after an outage, in which the quick attempts lost that bill outright."""
        self.spawn(self.bus.js_publish_until_stored(self.bus.subjects.usage(event.org), event, msg_id=dedup_id,
                                                    give_up_after_s=self.config.usage_retry_s),
                   name=f"usage-{dedup_id}")

    def echo_usage(self, event: UsageEvent) -> None:
        """A worker's usage event, off a request's final chunk: published here too, under the
        same dedup id, so the request is billed once even when its worker dies before USAGE
        stores its own copy (a leader election). Off the request's path, and a little after
        the worker's publish, which usually wins: this copy is then a cheap duplicate."""
        self.spawn(self._echo_usage(event), name=f"usage-{event.request_id}")

    async def _echo_usage(self, event: UsageEvent) -> None:
        await asyncio.sleep(self.config.usage_echo_delay_s)
        await self.bus.js_publish_until_stored(self.bus.subjects.usage(event.org), event,
                                               msg_id=usage_dedup_id(event.request_id, event.migrations),
                                               give_up_after_s=self.config.usage_retry_s)

    def keep_for_resume(self, record: RequestRecord) -> None:
        """The client of a resumable request went away: its worker generates on for the resume
        window, then is told to stop unless a resume came (on any gateway)."""
        self._start_timer(self._cancel_unless_resumed(record.request_id, record.resumes))

    async def resumed_client_gone(self, record: RequestRecord) -> None:
        """The client of a resumed stream went away: the same rule as for its first client."""
        if record.resumable:
            self.keep_for_resume(record)
        elif record.worker_id:
            await self.upstream.cancel(record.worker_id, record.request_id, "client disconnected")

    def _start_timer(self, coro: Coroutine[Any, Any, None]) -> None:
        # Not in-flight work: a drain does not wait for resume windows (the request just runs on).
        task = asyncio.create_task(coro)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _cancel_unless_resumed(self, request_id: str, resumes_at_disconnect: int) -> None:
        await asyncio.sleep(self.config.resume_window_s)
        record = await self.records.load(request_id)
        if record is None or record.resumes > resumes_at_disconnect or not record.worker_id:
            return
        self.metrics.cancels.labels(reason="resume_window_expired").inc()
        await self.upstream.cancel(record.worker_id, request_id, "client did not resume")

    # ---- clients behind proxies -------------------------------------------------------
    def client_address(self, request: web.Request) -> str:
        """The peer, or the nearest untrusted hop of X-Forwarded-For when the peer is a trusted proxy."""
        peer = request.remote or ""
        # Every X-Forwarded-For line, in order: a proxy that adds a line of its own (HAProxy)
        # leaves the client's made-up one first.
        forwarded = ",".join(request.headers.getall("X-Forwarded-For", []))
        if not forwarded or not self._is_trusted(peer):
            return peer
        for hop in reversed([h.strip() for h in forwarded.split(",") if h.strip()]):
            if not self._is_trusted(hop):
                return hop
        return peer

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._trusted)
