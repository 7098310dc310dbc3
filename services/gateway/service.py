"""The gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS request-reply front door.

Stateless and cheap: authenticate (API keys from ``mesh_keys``), validate and tokenize
once, ask admission, ask the router (which forwards to a worker), then relay the
worker's token chunks from the TOKENS stream to the client. Many replicas may run
behind any load balancer; a client that lost its connection resumes on any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import WSMsgType, web
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.propagate import extract
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bus import BusSettings, Service
from bus.keys import KeyStore
from bus.provision import requests_bucket
from bus.registry import WorkerRegistry
from proto import (
    AdmissionRequest,
    ApiKeyRecord,
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    MeshError,
    RemoteError,
    RequestRecord,
    RouteRequest,
    TokenChunk,
    TtftObservation,
    Usage,
    UsageEvent,
    WorkerInfo,
    block_hashes,
    decode,
    encode,
    pack_tokens,
    usage_dedup_id,
)
from proto.metering import UsageReport, org_usage_query, usage_report_json
from proto.tokenizer import load_tokenizer

from .apikeys import (
    MalformedAuthorization,
    key_allows_model,
    key_from_headers,
    parse_key,
    redact_key,
    verify_key,
)
from .config import GatewayConfig
from .errors import (
    ApiError,
    from_admission,
    from_mesh_error,
    invalid_api_key,
    malformed_authorization,
    method_not_allowed,
    missing_api_key,
    model_not_found,
    overloaded,
    payload_too_large,
    unknown_url,
)
from .events import DONE, EventBuilder, parse_event_id
from .local import is_local_request
from .metrics import GatewayMetrics
from .openai_api import (
    ModelCard,
    ModelList,
    WsAuth,
    WsCancel,
    chat_completion,
    encode_json,
    new_request_id,
    response_id,
    sse_event,
    text_completion,
    usage_from_proto,
    ws_done,
    ws_token,
)
from .openai_api import RequestKind as Kind
from .stall import queued_on_live_worker
from .streams import RequestStream, TokenDispatcher
from .upstream import UpstreamClient
from .validation import (
    ModelLimits,
    ModelSpec,
    NormalizedRequest,
    parse_request,
    parse_ws_message,
    parse_ws_request,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("meshserve.gateway")

STATIC_DIR = Path(__file__).parent / "static"
DONE_HEADER = "Meshserve-Done"  # marks the last message of a streamed NATS API reply
RESUMABLE_HEADER = "X-Meshserve-Resumable"


class Execution:
    """One admitted, placed request whose chunks are arriving."""

    def __init__(self, gateway: GatewayService, request: NormalizedRequest, request_id: str, stream: RequestStream,
                 worker_id: str, started: float, span: trace.Span) -> None:
        self.gateway = gateway
        self.request = request
        self.request_id = request_id
        self.stream = stream
        self.worker_id = worker_id
        self.started = started
        self.span = span
        self.first_token_at: float | None = None
        self.tier = ""  # set when admission predicted this request's TTFT: report it back
        self.completion_tokens = 0
        self.finished = False
        self.final: TokenChunk | None = None
        self.record: RequestRecord | None = None
        self.generate: GenerateRequest | None = None  # what was sent, for a migration
        self.migrations = 0
        self.live_at = 0.0  # when its worker last said it is queued behind live work
        self.stop_requested_at: float | None = None  # the client stopped it: relay until the worker's final chunk
        self.segment_tokens: list[int] = []  # tokens the current worker streamed
        self._prior_tokens: list[int] = []

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        cfg = self.gateway.config
        while not self.finished:
            try:
                chunk = await self.stream.get(timeout=cfg.liveness_check_s)
            except TimeoutError:
                if self.stop_requested_at is not None:
                    # Stopped by its client: no migration; wait a moment for the worker's
                    # final chunk, then end it with what was relayed.
                    if time.monotonic() - self.stop_requested_at < cfg.stop_grace_s:
                        continue
                    chunk = self._stopped_chunk()
                    self.finished = True
                    self.final = chunk
                    yield chunk
                    return
                silent = time.monotonic() - self.stream.last_chunk_at
                if silent >= cfg.silence_fill_s and silent - cfg.liveness_check_s < cfg.silence_fill_s:
                    # A quiet stream may have lost its tail (a chunk never delivered live):
                    # look in TOKENS once before suspecting the worker.
                    self.gateway.dispatcher.fill(self.stream)
                lost = await self._worker_lost()
                if lost is None:
                    continue
                failed = await self._migrate(lost)
                if failed is None:
                    continue
                chunk = failed
            if self.stream.overflowed:
                chunk = self._error_chunk(ErrorCode.OVERLOADED, "client too slow: stream buffer exceeded")
                await self.cancel("slow_client")
            if chunk.token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
                if self.tier:
                    self._report_ttft(self.first_token_at - self.started)
            self.completion_tokens += len(chunk.token_ids)
            self.segment_tokens.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                self.finished = True
                self.final = chunk
            yield chunk

    def _report_ttft(self, ttft_s: float) -> None:
        g = self.gateway
        observation = TtftObservation(request_id=self.request_id, tier=self.tier, ttft_s=ttft_s)
        g.spawn(g.bus.publish(g.bus.subjects.admission_ttft, observation, trace=False), name=f"ttft-{self.request_id}")

    async def _worker_lost(self) -> str | None:
        """Why the serving worker is considered lost, or None while it is fine. A stream
        silent for the stall timeout asks its worker first: a request merely queued behind
        live work stays, and is looked at again after another stall timeout."""
        g = self.gateway
        if self.worker_id not in g.registry.workers:
            return f"worker {self.worker_id} is gone (heartbeat expired)"
        silent = time.monotonic() - max(self.stream.last_chunk_at, self.live_at)
        if silent < g.config.stall_timeout_s:
            return None
        probe = await g.upstream.probe(self.worker_id, self.request_id, timeout_s=min(2.0, g.config.stall_timeout_s))
        queued = queued_on_live_worker(probe, g.config.stall_timeout_s)
        g.metrics.stall_probes.labels("queued" if queued else "stalled").inc()
        if not queued:
            return f"worker {self.worker_id} stalled: no tokens for {silent:.0f}s"
        assert probe is not None
        self.live_at = time.monotonic()
        self.span.add_event("queued_on_live_worker", {"worker": self.worker_id, "waited_s": probe.since_output_s})
        return None

    async def _migrate(self, why: str) -> TokenChunk | None:
        """Continue the request on another replica from the tokens the client already has.

        Returns an error chunk when it cannot (limit reached, nowhere to go), else None and
        the stream continues with the next sequence number from the new worker.
        """
        g = self.gateway
        old = self.worker_id
        assert self.generate is not None
        if self.migrations >= g.config.max_migrations:
            return self._error_chunk(ErrorCode.WORKER_LOST, f"{why}; not migrated again (limit {g.config.max_migrations})")
        log.warning("request %s: %s; migrating (%d tokens so far)", self.request_id, why, self.completion_tokens)
        cutoff = self.stream.next_seq
        self.stream.retire(old, cutoff)
        g.spawn(g.upstream.cancel(old, self.request_id, "migrated away"))  # a stalled worker frees its blocks
        await g.publish_lost_segment(self, old)
        self._prior_tokens = self.received_tokens
        self.migrations += 1
        self.segment_tokens = []
        if self.record is not None:
            self.record.retired[old] = cutoff
            with contextlib.suppress(Exception):
                await g.requests_kv.put(self.request_id, encode(self.record))
        generate = msgspec.structs.replace(
            self.generate, prior_output=pack_tokens(self.received_tokens), first_seq=cutoff, migrations=self.migrations,
        )
        try:
            placement = await g.upstream.place(RouteRequest(request=generate, exclude_workers=list(self.stream.retired)))
        except MeshError as exc:
            return self._error_chunk(ErrorCode.WORKER_LOST, f"{why}; no replica could take the request over: {exc.message}")
        g.metrics.migrations.inc()
        self.span.add_event("migrated", {"from": old, "to": placement.worker_id, "at_token": len(self.received_tokens)})
        self.worker_id = placement.worker_id
        self.stream.last_chunk_at = time.monotonic()
        if self.record is not None:
            self.record.worker_id = placement.worker_id
            with contextlib.suppress(Exception):
                await g.requests_kv.put(self.request_id, encode(self.record))
        return None

    @property
    def received_tokens(self) -> list[int]:
        return self._prior_tokens + self.segment_tokens

    def _error_chunk(self, code: ErrorCode, message: str) -> TokenChunk:
        return TokenChunk(request_id=self.request_id, seq=self.stream.next_seq, finish_reason="error",
                          error=ErrorInfo(code=code.value, message=message))

    def _stopped_chunk(self) -> TokenChunk:
        return TokenChunk(request_id=self.request_id, seq=self.stream.next_seq, finish_reason="abort",
                          usage=Usage(prompt_tokens=self.request.prompt_tokens, completion_tokens=self.completion_tokens))

    async def stop(self, reason: str) -> None:
        """Ask the worker to stop, but keep relaying: its final chunk (finish ``abort``)
        carries the usage it billed, tokens streamed before the stop included."""
        if self.finished or self.stop_requested_at is not None:
            return
        self.stop_requested_at = time.monotonic()
        self.gateway.metrics.cancels.labels(reason=reason).inc()
        await self.gateway.upstream.cancel(self.worker_id, self.request_id, reason)

    async def cancel(self, reason: str) -> None:
        """Stop the worker and the relay at once (nobody is left to read the rest)."""
        if not self.finished:
            self.finished = True
            self.gateway.metrics.cancels.labels(reason=reason).inc()
            await self.gateway.upstream.cancel(self.worker_id, self.request_id, reason)

    def close(self) -> None:
        """Metrics and bookkeeping, whatever way the request ended."""
        g = self.gateway
        g.dispatcher.close(self.request_id)
        g.metrics.in_flight.dec()
        model = self.request.model
        now = time.monotonic()
        status = "ok"
        if self.final is None:
            status = "cancelled"
        elif self.final.error is not None:
            status = "error"
        g.metrics.requests.labels(api=self.request.kind, model=model, status=status).inc()
        g.metrics.e2e.labels(model=model).observe(now - self.started)
        if self.first_token_at is not None:
            g.metrics.ttft.labels(model=model).observe(self.first_token_at - self.started)
            if self.completion_tokens > 1:
                g.metrics.tpot.labels(model=model).observe((now - self.first_token_at) / (self.completion_tokens - 1))
        g.metrics.prompt_tokens.labels(model=model).inc(self.request.prompt_tokens)
        g.metrics.generation_tokens.labels(model=model).inc(self.completion_tokens)
        self.span.set_attribute("meshserve.completion_tokens", self.completion_tokens)
        self.span.set_attribute("meshserve.status", status)
        self.span.end()


class GatewayService(Service):
    name = "gateway"
    description = "meshserve gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS API"

    def __init__(self, config: GatewayConfig | None = None, settings: BusSettings | None = None) -> None:
        config = config or GatewayConfig()
        super().__init__(settings, instance_id=config.gateway_id or None)
        self.config = config
        self.gateway_id = self.instance_id
        self.metrics = GatewayMetrics()
        self._specs: dict[tuple[str, str, int], ModelSpec] = {}
        self._runner: web.AppRunner | None = None
        self._trusted = [ipaddress.ip_network(c, strict=False) for c in config.trusted_proxies]
        self._in_flight = 0
        self._timers: set[asyncio.Task[None]] = set()

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        self.registry = WorkerRegistry(self.bus)
        await self.registry.start()
        self.keys = await KeyStore(self.bus).open()
        await self.keys.watch()
        self.requests_kv: KeyValue = await requests_bucket(self.bus.js, self.bus.subjects, replicas=self.settings.js_replicas)
        self.dispatcher = TokenDispatcher(self.bus, self.gateway_id, max_buffered=self.config.stream_buffer_chunks)
        await self.dispatcher.start()
        self.upstream = UpstreamClient(self.bus, self.registry, self.config.upstream)
        s = self.bus.subjects
        await self.add_raw_endpoint("chat", s.api_chat, self._nats_chat, queue_group="gateway")
        await self.add_raw_endpoint("completions", s.api_completions, self._nats_completions, queue_group="gateway")
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
        await self.dispatcher.stop()
        await self.registry.stop()
        await self.keys.stop()

    def stats(self) -> dict[str, Any]:
        return {"gateway_id": self.gateway_id, "streams": self._in_flight, "http": self.http_url}

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{self.config.host}:{self.bound_port}"

    async def _start_http(self) -> None:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._error_middleware])
        app.add_routes([
            web.post("/v1/chat/completions", self.http_chat),
            web.post("/v1/completions", self.http_completions),
            web.get("/v1/requests/{request_id}/stream", self.http_resume),
            web.get("/v1/models", self.http_models),
            web.get("/v1/models/{model_id:.+}", self.http_model),
            web.get("/v1/usage", self.http_usage),
            web.get("/v1/ws", self.http_ws),
            web.get("/healthz", self.http_health),
            web.get("/health", self.http_health),  # vLLM's name: benchmark clients and routers probe it
            web.get("/readyz", self.http_ready),
            web.get("/metrics", self.http_metrics),
            web.get("/", self.http_index),
            web.get("/favicon.ico", self.http_favicon),
            web.get("/dev-key", self.http_dev_key),
        ])
        if STATIC_DIR.exists():
            app.router.add_static("/static/", STATIC_DIR)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the worker.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        ssl_context = None
        if self.config.tls_cert:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.config.port
        log.info("gateway %s serving %s", self.gateway_id, self.http_url)

    # ---- models and keys --------------------------------------------------------------
    def model_specs(self) -> dict[str, ModelSpec]:
        """Servable models from the live registry (aliases included), tokenizers cached."""
        specs: dict[str, ModelSpec] = {}
        for model, workers in self.registry.models().items():
            spec = self._spec(model, workers)
            if spec is not None:
                specs[model] = spec
        for alias, target in self.config.aliases.items():
            if target in specs:
                specs[alias] = specs[target]
        return specs

    def _spec(self, model: str, workers: list[WorkerInfo]) -> ModelSpec | None:
        tokenizer = tokenizer_source(workers)
        max_len = model_max_len(workers) or 4096
        cache_key = (model, tokenizer, max_len)
        spec = self._specs.get(cache_key)
        if spec is None:
            try:
                tok = load_tokenizer(tokenizer)
            except Exception as exc:
                log.error("cannot load tokenizer %r for %s: %s", tokenizer, model, exc)
                return None
            limits = self.config.model_limits.get(model)
            limits = msgspec.structs.replace(limits, max_model_len=max_len) if limits else ModelLimits(max_model_len=max_len)
            spec = ModelSpec(name=model, tokenizer=tok, limits=limits)
            self._specs[cache_key] = spec
        return spec

    def _block_size(self, model: str) -> int:
        """The KV block size of the model's pool (per engine: 16 on vLLM GPU, 128 on its CPU build)."""
        workers = self.registry.ready_workers(model)
        return workers[0].block_size if workers else 0

    def authenticate_headers(self, headers: Mapping[str, str]) -> ApiKeyRecord:
        """The key record of a request's Authorization / api-key / x-api-key header."""
        return self.authenticate(self._presented_key(headers))

    @staticmethod
    def _presented_key(headers: Mapping[str, str]) -> str | None:
        try:
            return key_from_headers(headers)
        except MalformedAuthorization:
            raise malformed_authorization() from None

    def authenticate(self, presented: str | None) -> ApiKeyRecord:
        if not presented:
            raise missing_api_key()
        parsed = parse_key(presented)
        record = self.keys.records.get(parsed.key_id) if parsed else None
        if record is None or record.revoked or not verify_key(presented, record):
            # Never log the key in clear: only its redacted form.
            log.info("rejected API key %s", redact_key(presented))
            raise invalid_api_key(redact_key(presented))
        return record

    def client_address(self, request: web.Request) -> str:
        """The peer, or the nearest untrusted hop of X-Forwarded-For when the peer is a trusted proxy."""
        peer = request.remote or ""
        forwarded = request.headers.get("X-Forwarded-For")
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

    # ---- the request path, shared by every API ----------------------------------------
    async def execute(self, request: NormalizedRequest, key: ApiKeyRecord, *, parent: Any = None, resumable: bool = False) -> Execution:
        """Admit, place and start streaming one request; raises ApiError when it cannot."""
        if self._in_flight >= self.config.max_in_flight:
            raise overloaded(f"gateway {self.gateway_id} is at its in-flight limit", retry_after=1.0, status=429, code="overloaded")
        started = time.monotonic()
        request_id = new_request_id()
        span = tracer.start_span("gateway.request", context=parent, kind=trace.SpanKind.SERVER, attributes={
            "meshserve.request_id": request_id, "gen_ai.request.model": request.model,
            "meshserve.org": key.org, "meshserve.key_id": key.key_id, "gen_ai.usage.input_tokens": request.prompt_tokens,
        })
        ctx = trace.set_span_in_context(span)
        try:
            with trace.use_span(span, end_on_exit=False):
                return await self._execute(request, key, request_id, started, span, ctx, resumable)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR)
            span.end()
            raise

    async def _execute(self, request: NormalizedRequest, key: ApiKeyRecord, request_id: str, started: float,
                       span: trace.Span, ctx: Any, resumable: bool) -> Execution:
        block_size = self._block_size(request.model)
        with tracer.start_as_current_span("gateway.admission") as admission_span:
            decision = await self.upstream.admit(AdmissionRequest(
                request_id=request_id, org=key.org, key_id=key.key_id, tier=key.tier, model=request.model,
                prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens, rpm_limit=key.rpm, tpm_limit=key.tpm,
                block_hashes=block_hashes(request.prompt_token_ids, block_size) if block_size else [],
                block_size=block_size,
            ))
            admission_span.set_attribute("meshserve.admitted", decision.admitted)
            if decision.reason:
                admission_span.set_attribute("meshserve.admission_reason", decision.reason)
        span.set_attribute("meshserve.admission", "admitted" if decision.admitted else str(decision.reason))
        if not decision.admitted:
            self.metrics.errors.labels(code=str(decision.reason)).inc()
            raise from_admission(decision)
        stream = self.dispatcher.open(request_id)
        self._in_flight += 1
        self.metrics.in_flight.inc()
        generate = request.generate_request(
            request_id=request_id, token_subject=stream.subject, gateway_id=self.gateway_id, org=key.org,
            key_id=key.key_id, tier=key.tier, priority=self.config.tier_priority.get(key.tier, 1),
            arrival_time=time.time(), reserved_tokens=decision.reserved_tokens or request.reserved_tokens,
        )
        record = RequestRecord(request_id=request_id, key_id=key.key_id, org=key.org, gateway_id=self.gateway_id,
                               token_subject=stream.subject, kind=request.kind, model=request.requested_model,
                               created=int(time.time()), include_usage=request.include_usage, resumable=resumable)
        try:
            await self._record(record)
            with tracer.start_as_current_span("gateway.route"):
                placement = await self.upstream.place(RouteRequest(
                    request=generate, prefer_worker=decision.worker_id, prefer_slack_tokens=decision.slack_tokens,
                ))
        except BaseException as exc:
            self.dispatcher.close(request_id)
            self._in_flight -= 1
            self.metrics.in_flight.dec()
            # Admission reserved budget for this request: a usage event reconciles it.
            await self._publish_rejected_usage(generate, str(exc))
            if isinstance(exc, RemoteError | MeshError):
                self.metrics.errors.labels(code=str(exc.code)).inc()
                raise from_mesh_error(str(exc.code), exc.message, getattr(exc, "retry_after", None)) from exc
            raise
        span.set_attribute("meshserve.worker_id", placement.worker_id)
        record.worker_id = placement.worker_id
        with contextlib.suppress(Exception):  # resume and its disconnect timer need the worker
            await self.requests_kv.put(request_id, encode(record))
        execution = Execution(self, request, request_id, stream, placement.worker_id, started, span)
        if decision.worker_id:  # admission made a prediction to calibrate
            execution.tier = key.tier
        execution.record = record
        execution.generate = generate
        return execution

    async def _record(self, record: RequestRecord) -> None:
        """Store the resume record. Best effort for ordinary requests; a resumable one needs it,
        so a KV outage (e.g. a NATS node failing over) makes it a retryable 503, not a 500."""
        try:
            await self.requests_kv.put(record.request_id, encode(record))
        except Exception as exc:
            if record.resumable:
                raise MeshError(f"cannot record a resumable request right now: {exc!r}", code=ErrorCode.NO_CAPACITY) from exc
            log.warning("request %s: resume record not stored (%r)", record.request_id, exc)

    async def publish_lost_segment(self, execution: Execution, worker_id: str) -> None:
        """Bill the segment a lost worker streamed: it will never report it (or it is void)."""
        generate = execution.generate
        assert generate is not None
        first = execution.migrations == 0
        event = UsageEvent(
            request_id=execution.request_id, org=generate.org, key_id=generate.key_id, model=generate.model,
            worker_id=worker_id, tier=generate.tier, prompt_tokens=execution.request.prompt_tokens if first else 0,
            completion_tokens=len(execution.segment_tokens), status="migrated", arrival_time=generate.arrival_time,
            finish_time=time.time(), reserved_tokens=generate.reserved_tokens if first else 0,
            migrations=execution.migrations, error="worker lost; request migrated",
        )
        with contextlib.suppress(MeshError):
            await self.bus.js_publish(self.bus.subjects.usage(generate.org), event,
                                      msg_id=usage_dedup_id(execution.request_id, execution.migrations))

    async def _publish_rejected_usage(self, generate: Any, error: str) -> None:
        event = UsageEvent(request_id=generate.request_id, org=generate.org, key_id=generate.key_id, model=generate.model,
                           tier=generate.tier, status="rejected", reserved_tokens=generate.reserved_tokens,
                           arrival_time=generate.arrival_time, finish_time=time.time(), error=error[:500])
        with contextlib.suppress(MeshError):
            await self.bus.js_publish(self.bus.subjects.usage(generate.org), event, msg_id=usage_dedup_id(generate.request_id))

    def finish(self, execution: Execution) -> None:
        self._in_flight -= 1
        execution.close()

    # ---- HTTP -------------------------------------------------------------------------
    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc)
        except web.HTTPRequestEntityTooLarge as exc:
            return _error_response(payload_too_large(self.config.max_body_bytes, getattr(exc, "actual_size", None)))
        except web.HTTPMethodNotAllowed as exc:
            response = _error_response(method_not_allowed(request.method, request.path, exc.allowed_methods))
            response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return response
        except web.HTTPNotFound:
            # Unknown paths (/v1/responses, /v1/embeddings, typos) answer like OpenAI, not with text/plain.
            return _error_response(unknown_url(request.method, request.path))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            # aiohttp's own text says what was wrong (e.g. a plain GET on /v1/ws); its default is "400: Bad Request".
            detail = " ".join((exc.text or exc.reason).split())
            return _error_response(ApiError(exc.status, detail, "invalid_request_error" if exc.status < 500 else "server_error"))
        except Exception:
            log.exception("unhandled error on %s", request.path)
            return _error_response(ApiError(500, "internal error", "server_error", None, "internal"))

    async def http_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._http_generate(request, "chat")

    async def http_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._http_generate(request, "completion")

    async def _http_generate(self, http: web.Request, kind: Kind) -> web.StreamResponse:
        key = self.authenticate_headers(http.headers)
        if http.content_length is not None and http.content_length > self.config.max_body_bytes:
            raise payload_too_large(self.config.max_body_bytes, http.content_length)
        body = await http.read()
        request = parse_request(kind, body, self.model_specs(), allowed_models=key.models or None)
        parent = extract(dict(http.headers))
        resumable = request.stream and http.headers.get(RESUMABLE_HEADER, "").lower() in ("1", "true", "yes")
        execution = await self.execute(request, key, parent=parent, resumable=resumable)
        try:
            if request.stream:
                return await self._sse(http, execution, request)
            try:
                return await self._unary(execution, request)
            except asyncio.CancelledError:
                await asyncio.shield(execution.cancel("client_disconnected"))
                raise
        finally:
            self.finish(execution)

    async def _unary(self, execution: Execution, request: NormalizedRequest) -> web.Response:
        body = await self._collect(execution, request)
        return web.Response(body=body, content_type="application/json", headers={"X-Request-Id": execution.request_id})

    async def _collect(self, execution: Execution, request: NormalizedRequest) -> bytes:
        """The whole non-streamed response body (any API); an error chunk raises ApiError."""
        text: list[str] = []
        async for chunk in execution.chunks():
            if chunk.error is not None:
                raise from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
            text.append(chunk.text)
        final = execution.final
        assert final is not None
        usage = usage_from_proto(final.usage) if final.usage else None
        rid = response_id(request.kind, execution.request_id)
        build = chat_completion if request.kind == "chat" else text_completion
        return encode_json(build(rid, request.requested_model, int(time.time()), "".join(text), final.finish_reason, usage))

    async def _sse(self, http: web.Request, execution: Execution, request: NormalizedRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": execution.request_id,
            "X-Accel-Buffering": "no",
        })
        await response.prepare(http)
        builder = EventBuilder(request.kind, execution.request_id, request.requested_model, int(time.time()), request.include_usage)
        execution.stream.on_overflow = functools.partial(self._cut_slow_client, http, execution)
        try:
            await self._relay_sse(response, execution.chunks(), builder, after=None, first_seq=0)
        except (ConnectionResetError, asyncio.CancelledError):
            if execution.record is not None and execution.record.resumable:
                execution.finished = True  # keep generating: the client may resume (on any gateway)
                self._start_timer(self._cancel_unless_resumed(execution.request_id, execution.record.resumes))
            else:
                # The client went away mid-stream: free the worker's KV blocks now.
                await asyncio.shield(execution.cancel("client_disconnected"))
            raise
        return response

    def _start_timer(self, coro: Any) -> None:
        # Not in-flight work: a drain does not wait for resume windows (the request just runs on).
        task = asyncio.create_task(coro)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    def _cut_slow_client(self, http: web.Request, execution: Execution) -> None:
        log.warning("request %s: client too slow (%d chunks buffered); cutting it", execution.request_id,
                    execution.stream.buffered)
        self.metrics.errors.labels(code="slow_client").inc()
        if execution.record is not None:
            execution.record.resumable = False  # a client that cannot keep up does not get to resume
        if http.transport is not None:
            http.transport.abort()  # the blocked write fails; the handler cancels the worker

    async def _cancel_unless_resumed(self, request_id: str, resumes_at_disconnect: int) -> None:
        await asyncio.sleep(self.config.resume_window_s)
        record = await self._load_record(request_id)
        if record is None or record.resumes > resumes_at_disconnect or not record.worker_id:
            return
        self.metrics.cancels.labels(reason="resume_window_expired").inc()
        await self.upstream.cancel(record.worker_id, request_id, "client did not resume")

    async def _load_record(self, request_id: str) -> RequestRecord | None:
        try:
            entry = await self.requests_kv.get(request_id)
            return decode(entry.value or b"", RequestRecord)
        except (KeyNotFoundError, MeshError):
            return None

    async def _relay_sse(self, response: web.StreamResponse, chunks: AsyncIterator[TokenChunk], builder: EventBuilder,
                         *, after: tuple[int, int] | None, first_seq: int) -> None:
        async for chunk in chunks:
            events = builder.events(chunk, first=chunk.seq == first_seq)
            frames = [sse_event(e.id, e.data) for e in events if after is None or (e.seq, e.index) > after]
            if frames:
                await response.write(b"".join(frames))

    async def http_resume(self, http: web.Request) -> web.StreamResponse:
        key = self.authenticate_headers(http.headers)
        request_id = http.match_info["request_id"]
        record = await self._load_record(request_id)
        if record is None or record.key_id != key.key_id:
            # Another key's request gets the same answer as an unknown id: ids are not revealed.
            raise ApiError(404, f"No resumable request {request_id!r} (unknown or expired).", "invalid_request_error", None, "not_found")
        record.resumes += 1
        with contextlib.suppress(Exception):
            await self.requests_kv.put(request_id, encode(record))
        after = parse_event_id(http.headers.get("Last-Event-ID"))
        self.metrics.resumes.inc()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": request_id})
        await response.prepare(http)
        builder = EventBuilder(record.kind, request_id, record.model, record.created, record.include_usage)
        chunks = self.dispatcher.replay(self.bus.subjects.tokens_of_request(request_id), idle_timeout_s=self.config.stall_timeout_s)
        try:
            await self._relay_sse(response, self._replayed(request_id, record, chunks), builder, after=after, first_seq=0)
        except (ConnectionResetError, asyncio.CancelledError):
            if record.resumable:
                self._start_timer(self._cancel_unless_resumed(request_id, record.resumes))
            elif record.worker_id:
                await asyncio.shield(self.upstream.cancel(record.worker_id, request_id, "client disconnected"))
            raise
        return response

    async def _replayed(self, request_id: str, record: RequestRecord, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """Stored chunks in order, once each, without those of workers that lost the request."""
        stream = RequestStream(request_id, "", 0)
        stream.retired = dict(record.retired)
        async for chunk in chunks:
            if chunk.worker_id and chunk.worker_id not in stream.retired and chunk.worker_id != record.worker_id:
                # A worker we did not know of: a migration happened during this replay.
                fresh = await self._load_record(request_id)
                if fresh is not None:
                    record = fresh
                    for worker, cutoff in fresh.retired.items():
                        stream.retire(worker, cutoff)
            stream.deliver(chunk)
            while (ready := stream.get_nowait()) is not None:
                yield ready
                if ready.finish_reason is not None:
                    return

    async def http_models(self, http: web.Request) -> web.Response:
        key = self.authenticate_headers(http.headers)
        now = int(time.time())
        cards = [ModelCard(id=name, created=now, owned_by="meshserve", max_model_len=spec.limits.max_model_len)
                 for name, spec in sorted(self.model_specs().items()) if key_allows_model(key, name)]
        return web.Response(body=encode_json(ModelList(data=cards)), content_type="application/json")

    async def http_model(self, http: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model object; unknown or not the key's is OpenAI's 404."""
        key = self.authenticate_headers(http.headers)
        name = http.match_info["model_id"]
        spec = self.model_specs().get(name)
        if spec is None or not (key_allows_model(key, name) or key_allows_model(key, spec.name)):
            raise model_not_found(name)
        card = ModelCard(id=name, created=int(time.time()), owned_by="meshserve", max_model_len=spec.limits.max_model_len)
        return web.Response(body=encode_json(card), content_type="application/json")

    async def http_usage(self, http: web.Request) -> web.Response:
        """Usage and spend of the calling key's own org (from the metering ledger)."""
        key = self.authenticate_headers(http.headers)
        try:
            query = org_usage_query(key.org, dict(http.query), time.time())
        except ValueError as exc:
            raise ApiError(400, f"Invalid usage query: {exc}", "invalid_request_error", None, "invalid_value") from exc
        try:
            report = await self.bus.request(self.bus.subjects.metering_usage, query, UsageReport, timeout=10.0)
        except MeshError as exc:
            code = ErrorCode.NO_CAPACITY if exc.code in (ErrorCode.NO_RESPONDERS, ErrorCode.TIMEOUT) else exc.code
            raise from_mesh_error(str(code), f"usage is unavailable right now: {exc.message}", 5.0) from exc
        return web.json_response(usage_report_json(report))

    async def http_health(self, http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def http_ready(self, http: web.Request) -> web.Response:
        connected = self._bus is not None and self.bus.nc.is_connected
        models = sorted(self.registry.models()) if connected else []
        ready = self.ready and connected and bool(self.registry.ready_workers())
        return web.json_response({"ready": ready, "nats": connected, "models": models}, status=200 if ready else 503)

    async def http_metrics(self, http: web.Request) -> web.Response:
        self.metrics.admission_unreachable.labels(outcome="open")._value.set(self.upstream.admission_fail_open)
        self.metrics.admission_unreachable.labels(outcome="closed")._value.set(self.upstream.admission_fail_closed)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def http_index(self, http: web.Request) -> web.StreamResponse:
        index = STATIC_DIR / "index.html"
        if not index.exists():
            raise web.HTTPNotFound()
        return web.FileResponse(index)

    async def http_favicon(self, http: web.Request) -> web.StreamResponse:
        # An SVG icon under the name browsers ask for; they go by the content type.
        return web.FileResponse(STATIC_DIR / "favicon.svg", headers={"Content-Type": "image/svg+xml",
                                                                     "Cache-Control": "max-age=86400"})

    async def http_dev_key(self, http: web.Request) -> web.Response:
        """The development key, for the chat page of a browser on this host; 404 to anyone else.

        Served only with ``--dev-key-file`` (``meshserve up``). Read on every call: the
        key is created after the gateway starts, and may be replaced.
        """
        path = self.config.dev_key_file
        if not path or not is_local_request(http.remote, http.headers):
            raise web.HTTPNotFound()
        try:
            key = (await asyncio.to_thread(Path(path).read_text)).strip()
        except OSError:
            key = ""
        if not key:
            raise web.HTTPNotFound()
        return web.json_response({"api_key": key}, headers={"Cache-Control": "no-store"})

    # ---- WebSocket --------------------------------------------------------------------
    async def http_ws(self, http: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=self.config.max_body_bytes)
        await ws.prepare(http)
        key: ApiKeyRecord | None = None
        try:
            presented = http.query.get("api_key") or self._presented_key(http.headers)
            if presented:
                key = self.authenticate(presented)
        except ApiError as exc:
            await ws.send_str(exc.to_ws(None).decode())
            await ws.close()
            return ws
        running: dict[str, _WsJob] = {}
        send_lock = asyncio.Lock()

        async def send(data: bytes) -> None:
            async with send_lock:
                await ws.send_str(data.decode())

        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    if message.type == WSMsgType.BINARY:
                        await send(ApiError(400, "send JSON text frames", "invalid_request_error").to_ws(None))
                    continue
                try:
                    parsed = parse_ws_message(message.data)
                    if isinstance(parsed, WsAuth):
                        key = self.authenticate(parsed.api_key)
                        continue
                    if isinstance(parsed, WsCancel):
                        job = running.get(parsed.id)
                        if job is not None:
                            job.stop()
                        continue
                    if key is None:
                        raise missing_api_key()
                    if parsed.id in running:
                        raise ApiError(400, f"request id {parsed.id!r} is already in flight on this socket", "invalid_request_error", "id")
                    request = parse_ws_request(parsed, self.model_specs(), allowed_models=key.models or None)
                except ApiError as exc:
                    await send(exc.to_ws(_message_id(message.data)))
                    continue
                job = _WsJob(self)
                job.task = asyncio.create_task(self._ws_request(send, parsed.id, request, key, job))
                running[parsed.id] = job
                job.task.add_done_callback(functools.partial(_forget, running, parsed.id))
        finally:
            tasks = [job.task for job in running.values() if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return ws

    async def _ws_request(self, send: Any, client_id: str, request: NormalizedRequest, key: ApiKeyRecord, job: _WsJob) -> None:
        try:
            execution = await self.execute(request, key)
        except ApiError as exc:
            await send(exc.to_ws(client_id))
            return
        job.execution = execution
        try:
            if job.stop_requested:  # the cancel came while the request was being admitted and placed
                await execution.stop("client_cancelled")
            async for chunk in execution.chunks():
                if chunk.error is not None:
                    err = from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
                    await send(err.to_ws(client_id))
                    return
                if chunk.token_ids or chunk.text:
                    await send(ws_token(client_id, chunk.seq, chunk.text, chunk.token_ids))
                if chunk.finish_reason is not None:
                    # After a cancel this is the worker's "abort" chunk: its usage is what was billed.
                    await send(ws_done(client_id, chunk.finish_reason, usage_from_proto(chunk.usage) if chunk.usage else None))
        except (asyncio.CancelledError, ConnectionResetError):
            # The socket closed: nobody is left to tell, so stop the relay along with the worker.
            await asyncio.shield(execution.cancel("client_disconnected"))
            raise
        finally:
            self.finish(execution)

    # ---- NATS API ---------------------------------------------------------------------
    async def _nats_chat(self, msg: Msg) -> None:
        await self._nats_generate(msg, "chat")

    async def _nats_completions(self, msg: Msg) -> None:
        await self._nats_generate(msg, "completion")

    async def _nats_generate(self, msg: Msg, kind: Kind) -> None:
        nc = self.bus.nc
        if not msg.reply:
            return
        try:
            key = self.authenticate_headers(msg.headers or {})
            if len(msg.data) > self.config.max_body_bytes:
                raise payload_too_large(self.config.max_body_bytes, len(msg.data))
            request = parse_request(kind, msg.data, self.model_specs(), allowed_models=key.models or None)
            execution = await self.execute(request, key, parent=self.bus.remote_context(msg))
        except ApiError as exc:
            await nc.publish(msg.reply, exc.to_json(), headers=_nats_error_headers(exc))
            return
        try:
            if not request.stream:
                try:
                    await nc.publish(msg.reply, await self._collect(execution, request))
                except ApiError as exc:
                    await nc.publish(msg.reply, exc.to_json(), headers=_nats_error_headers(exc))
                return
            builder = EventBuilder(request.kind, execution.request_id, request.requested_model, int(time.time()), request.include_usage)
            async for chunk in execution.chunks():
                events = [e for e in builder.events(chunk, first=chunk.seq == 0) if e.data != DONE]
                for i, event in enumerate(events):
                    headers = {"Meshserve-Event-Id": event.id, "Meshserve-Request-Id": execution.request_id}
                    if chunk.finish_reason is not None and i == len(events) - 1:
                        headers[DONE_HEADER] = "1"  # the last message of this reply
                    await nc.publish(msg.reply, event.data, headers=headers)
        finally:
            self.finish(execution)


def tokenizer_source(workers: list[WorkerInfo]) -> str:
    """What a model's requests are tokenized with (a ``load_tokenizer`` spec: ``byte`` or a
    directory); ``meshserve tokenizer export`` hands clients the same."""
    return workers[0].model_dir or workers[0].tokenizer or "byte"


def model_max_len(workers: list[WorkerInfo]) -> int:
    """The context every replica of a model can take (0: none of them says)."""
    return min((w.max_model_len for w in workers if w.max_model_len), default=0)


def _message_id(data: str) -> str | None:
    """The client's request id of a WebSocket message that failed validation, if it has one."""
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else None


class _WsJob:
    """One request on a WebSocket: its relay task and, once placed, its execution."""

    __slots__ = ("execution", "gateway", "stop_requested", "task")

    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.task: asyncio.Task[None] | None = None
        self.execution: Execution | None = None
        self.stop_requested = False

    def stop(self) -> None:
        """The client's cancel: the worker stops, the relay runs on to its final usage."""
        self.stop_requested = True
        if self.execution is not None:
            self.gateway.spawn(self.execution.stop("client_cancelled"), name=f"stop-{self.execution.request_id}")


def _forget(running: dict[str, _WsJob], request_id: str, _task: asyncio.Task[None]) -> None:
    running.pop(request_id, None)




def _error_response(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=exc.to_json(), content_type="application/json", headers=exc.headers())


def _nats_error_headers(exc: ApiError) -> dict[str, str]:
    headers = {"Nats-Service-Error": exc.message[:200], "Nats-Service-Error-Code": str(exc.status)}
    headers.update(exc.headers())
    return headers
