"""One request's life in the gateway, owned by one object: ``ActiveRequest``.

``ActiveRequest.start`` admits the request (admission), stores its resume record, places
it (router, which forwards it to a worker) and returns it fully built, its chunks
arriving on its ``RequestStream``. A front door then relays ``chunks()`` inside
``serving()``, which handles a client that goes away and closes the request whatever way
it ends. States (``RequestState``)::

    STREAMING ──stop()──▶ STOPPING ──final chunk / stop grace──▶ FINISHED
        │  │                  └──cancel()──▶ CANCELLED
        │  ├──final chunk──▶ FINISHED
        │  ├──cancel()──▶ CANCELLED
        │  └──client gone, resumable──▶ DETACHED (the worker generates on, for a resume)

While streaming, a silent stream is checked on (``migration.plan_migration`` decides)
and moved to another worker when its own is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import trace

from proto import (
    AdmissionDecision,
    AdmissionRequest,
    ApiKeyRecord,
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    MeshError,
    Placement,
    RemoteError,
    RequestRecord,
    RouteRequest,
    TokenChunk,
    TtftObservation,
    Usage,
    UsageEvent,
    block_hashes,
    cache_scope,
    prefix_salt,
    usage_dedup_id,
    usage_model,
)

from .errors import from_admission, from_mesh_error, overloaded
from .events import DONE, EventBuilder
from .migration import GiveUp, Migrate, MigrationLimits, Segment, Stay, plan_migration, replica_wait
from .normalized import NormalizedRequest, check_prompt_logprobs
from .openai_api import new_request_id
from .output import ChoiceAssembler
from .streams import RequestStream

if TYPE_CHECKING:
    from .service import GatewayService

log = logging.getLogger(__name__)
tracer = trace.get_tracer("meshserve.gateway")


class PhaseTimer:
    """Milliseconds per phase of a request's start, in order, for the ``Server-Timing``
    response header (W3C): what the gateway spent before the worker had the request."""

    __slots__ = ("_last", "phases")

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began where the previous one ended)."""
        now = time.perf_counter()
        self.phases.append((phase, (now - self._last) * 1000))
        self._last = now

    def header(self, before: Iterable[tuple[str, float]] = ()) -> str:
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in (*before, *self.phases))


class RequestState(enum.Enum):
    STREAMING = "streaming"  # chunks are relayed to the client
    STOPPING = "stopping"  # the client asked to stop: relayed until the worker's final chunk (the usage it billed)
    DETACHED = "detached"  # a resumable request's client went away: the worker generates on, for a resume
    FINISHED = "finished"  # the final chunk was relayed
    CANCELLED = "cancelled"  # the worker was told to stop and nobody reads the rest


_RELAYING = (RequestState.STREAMING, RequestState.STOPPING)


class ActiveRequest:
    """One admitted, placed request whose chunks are arriving."""

    def __init__(self, gateway: GatewayService, request: NormalizedRequest, generate: GenerateRequest,
                 record: RequestRecord, stream: RequestStream, worker_id: str, started: float, span: trace.Span,
                 *, ttft_tier: str = "") -> None:
        self.gateway = gateway
        self.request = request
        self.request_id = generate.request_id
        self.generate = generate  # what the current worker was sent (the next segment's base on a migration)
        self.record = record  # the resume record, as last stored
        self.stream = stream
        self.worker_id = worker_id
        stream.worker_id = worker_id
        self.worker_region = self._region_of(worker_id)  # known while it lives: a lost segment is billed there
        self.started = started
        self.span = span
        self.ttft_tier = ttft_tier  # set when admission predicted this request's TTFT: report it back
        self.state = RequestState.STREAMING
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.final: TokenChunk | None = None
        self.live_at = 0.0  # when its worker last said it is queued behind live work
        self.stop_requested_at = 0.0  # when the client asked to stop (state STOPPING)
        self.segment_tokens: list[int] = []  # tokens the current worker streamed
        self._prior_tokens: list[int] = []
        # n > 1: each choice's tokens (all segments) and the choices that ended, for a migration
        self.choice_tokens: dict[int, list[int]] = {}
        self.finished_choices: set[int] = set()
        self.phases = PhaseTimer()  # where the time to placement went (Server-Timing)
        self.read_seq = stream.next_seq  # the first sequence number not yet read from the stream

    # ---- start: admission, record, placement ------------------------------------------
    @classmethod
    async def start(cls, gateway: GatewayService, request: NormalizedRequest, key: ApiKeyRecord, *,
                    parent: Any = None, resumable: bool = False, client_address: str = "") -> ActiveRequest:
        """Admit, place and start streaming one request; raises ApiError when it cannot.
        ``client_address``: who sent it (behind a trusted proxy, its X-Forwarded-For hop),
        for the request's span (OpenTelemetry's ``client.address``)."""
        # The parsers sized this for meshserve's own bus; on a smaller one, refuse it here
        # rather than after the prefill (the worker's 400 when the chunk does not fit).
        check_prompt_logprobs(request.kind, request.sampling.prompt_logprobs, request.prompt_tokens,
                              gateway.bus.max_payload)
        if gateway.streams_in_flight >= gateway.config.max_in_flight:
            raise overloaded(f"gateway {gateway.gateway_id} is at its in-flight limit", retry_after=1.0, status=429,
                             code="overloaded")
        started = time.monotonic()
        request_id = new_request_id()
        span = tracer.start_span("gateway.request", context=parent, kind=trace.SpanKind.SERVER, attributes={
            "meshserve.request_id": request_id, "gen_ai.request.model": request.model,
            "gen_ai.operation.name": "chat" if request.kind == "chat" else "text_completion",
            "meshserve.org": key.org, "meshserve.key_id": key.key_id, "gen_ai.usage.input_tokens": request.prompt_tokens,
            **({"client.address": client_address} if client_address else {}),
        })
        try:
            with trace.use_span(span, end_on_exit=False):
                return await cls._start(gateway, request, key, request_id, started, span, resumable)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR)
            span.end()
            raise

    @classmethod
    async def _start(cls, g: GatewayService, request: NormalizedRequest, key: ApiKeyRecord, request_id: str,
                     started: float, span: trace.Span, resumable: bool) -> ActiveRequest:
        block_size = g.models.block_size(request.model)
        phases = PhaseTimer()
        # An adapter's KV is its own (as vLLM's), and an org's (or a client's cache_salt's):
        # each salts its blocks.
        salt = prefix_salt(request.lora, cache_scope(key.org, request.cache_salt))
        hashes = block_hashes(request.prompt_token_ids, block_size, salt) if block_size else []
        phases.mark("hash")
        # Open before admission: admission may send the request on to the router itself,
        # and its first chunk can come before the decision does.
        stream = g.dispatcher.open(request_id)  # from here on the request counts as in flight
        generate = request.generate_request(
            request_id=request_id, token_subject=stream.subject, gateway_id=g.gateway_id, org=key.org,
            key_id=key.key_id, tier=key.tier, priority=g.config.tier_priority.get(key.tier, 1),
            arrival_time=time.time(), reserved_tokens=request.reserved_tokens,
        )
        generate.resumable = resumable  # its worker keeps it if this gateway dies
        # Placed in this gateway's region while it has room, never outside the key's regions.
        generate.region, generate.regions = g.config.region, key.regions
        try:
            with tracer.start_as_current_span("gateway.admission") as admission_span:
                # A resumable request's record must exist before any worker has it: it is
                # placed from here, after the record is saved.
                admit = asyncio.ensure_future(g.upstream.admit(AdmissionRequest(
                    request_id=request_id, org=key.org, key_id=key.key_id, tier=key.tier, model=request.model,
                    prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens, rpm_limit=key.rpm,
                    tpm_limit=key.tpm, concurrency_limit=key.max_concurrent, block_hashes=hashes, block_size=block_size,
                    lora=request.lora, region=generate.region, regions=generate.regions,
                ), route=None if resumable else RouteRequest(request=generate, block_size=block_size)))
                try:
                    decision = await asyncio.shield(admit)
                except asyncio.CancelledError:
                    # The client left while admission decided (a check waiting for a slot of
                    # its key waits up to 0.4 s): an admission made anyway is undone, or its
                    # reservation, and its key's slot, would be held until they expire.
                    g.spawn(_undo_admission(g, admit, generate), name=f"undo-{request_id}")
                    raise
                phases.mark("admission")
                admission_span.set_attribute("meshserve.admitted", decision.admitted)
                if decision.reason:
                    admission_span.set_attribute("meshserve.admission_reason", decision.reason)
        except BaseException:
            g.dispatcher.close(request_id)
            raise
        span.set_attribute("meshserve.admission", "admitted" if decision.admitted else str(decision.reason))
        if not decision.admitted:
            g.dispatcher.close(request_id)
            g.metrics.errors.labels(code=str(decision.reason)).inc()
            raise from_admission(decision)
        if decision.reserved_tokens:
            generate = msgspec.structs.replace(generate, reserved_tokens=decision.reserved_tokens)
        record = RequestRecord(request_id=request_id, key_id=key.key_id, org=key.org, gateway_id=g.gateway_id,
                               token_subject=stream.subject, kind=request.kind, model=request.requested_model,
                               created=int(time.time()), include_usage=request.include_usage, resumable=resumable,
                               output=request.output, segment=generate if resumable else None)
        try:
            if resumable:  # its client may resume at once, anywhere: the record must exist first
                await g.records.save(record, required=True)
                phases.mark("record")
            with tracer.start_as_current_span("gateway.route"):
                if decision.forwarded:
                    placement = await g.upstream.placed(request_id, arrived_from=lambda: stream.arrived_from)
                else:
                    route = RouteRequest(request=generate, block_hashes=hashes, block_size=block_size)
                    placement = await g.upstream.place(route.admitted_by(decision),
                                                       arrived_from=lambda: stream.arrived_from)
            phases.mark("route")
        except BaseException as exc:
            g.dispatcher.close(request_id)
            # Admission reserved budget for this request: a usage event reconciles it.
            await g.publish_usage(rejected_usage(generate, str(exc)), usage_dedup_id(request_id))
            if isinstance(exc, RemoteError | MeshError):
                g.metrics.errors.labels(code=str(exc.code)).inc()
                raise from_mesh_error(str(exc.code), exc.message, getattr(exc, "retry_after", None)) from exc
            raise
        span.set_attribute("meshserve.worker_id", placement.worker_id)
        record.worker_id = placement.worker_id
        if resumable:
            # Resume and its disconnect timer need the worker; not worth a round trip before
            # the first token (best effort, as every later update of the record). A request
            # that is not resumable has no record: nothing reads it (its client's disconnect
            # cancels it, and GET /v1/requests/{id}/stream serves resumable requests only),
            # and storing one cost a JetStream write per request.
            g.spawn(g.records.save(record), name=f"record-{request_id}")
        active = cls(g, request, generate, record, stream, placement.worker_id, started, span,
                     ttft_tier=key.tier if decision.worker_id else "")  # a worker_id: admission made a prediction
        active.phases = phases
        return active

    # ---- relay ------------------------------------------------------------------------
    async def chunks(self) -> AsyncIterator[TokenChunk]:
        cfg = self.gateway.config
        while self.state in _RELAYING:
            try:
                chunk = await self.stream.get(timeout=cfg.liveness_check_s)
            except TimeoutError:
                if self.state is RequestState.STOPPING:
                    # Stopped by its client: no migration; wait a moment for the worker's
                    # final chunk, then end it with what was relayed.
                    if time.monotonic() - self.stop_requested_at < cfg.stop_grace_s:
                        continue
                    chunk = self._stopped_chunk()
                    self.state = RequestState.FINISHED
                    self.final = chunk
                    yield chunk
                    return
                silent = time.monotonic() - self.stream.last_chunk_at
                if silent >= cfg.silence_fill_s and silent - cfg.liveness_check_s < cfg.silence_fill_s:
                    # A quiet stream may have lost its tail (a chunk never delivered live):
                    # look in TOKENS once before suspecting the worker.
                    self.gateway.dispatcher.fill(self.stream)
                failed = await self._check_worker()
                if failed is None:
                    continue
                chunk = failed
            if self.stream.overflowed:
                chunk = self._error_chunk(ErrorCode.OVERLOADED, "client too slow: stream buffer exceeded")
                await self.cancel("slow_client")
            if chunk.token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
                if self.ttft_tier:
                    self._report_ttft(self.first_token_at - self.started)
            self.completion_tokens += len(chunk.token_ids)
            self.segment_tokens.extend(chunk.token_ids)
            self.read_seq = chunk.seq + 1
            if self.generate.sampling.n > 1:
                self.choice_tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
                if chunk.choice_finish_reason is not None:
                    self.finished_choices.add(chunk.index)
            if chunk.finish_reason is not None:
                if self.state in _RELAYING:
                    self.state = RequestState.FINISHED
                self.final = chunk
            yield chunk

    def _report_ttft(self, ttft_s: float) -> None:
        g = self.gateway
        observation = TtftObservation(request_id=self.request_id, tier=self.ttft_tier, ttft_s=ttft_s)
        g.spawn(g.bus.publish(g.bus.subjects.admission_ttft, observation, trace=False), name=f"ttft-{self.request_id}")

    # ---- a lost worker: check, then migrate -------------------------------------------
    async def _check_worker(self) -> TokenChunk | None:
        """None while the worker is fine (or the request moved on); the error chunk that ends
        the request when it cannot continue. A stream silent for the stall timeout asks its
        worker first (``migration.plan_migration`` weighs the answer)."""
        g = self.gateway
        registered = self.worker_id in g.registry.workers
        silent = time.monotonic() - max(self.stream.last_chunk_at, self.live_at)
        if registered and silent < g.config.stall_timeout_s:
            return None
        probe = None
        if registered:
            probe = await g.upstream.probe(self.worker_id, self.request_id, timeout_s=min(2.0, g.config.stall_timeout_s))
            if self.stream.buffered:
                return None  # its chunks came while it was asked: it is alive after all
        plan = plan_migration(self._segment(), MigrationLimits(g.config.stall_timeout_s, g.config.max_migrations),
                              worker_registered=registered, silent_s=silent, probe=probe, now=time.time())
        if registered:
            g.metrics.stall_probes.labels("queued" if isinstance(plan, Stay) else "stalled").inc()
        if isinstance(plan, Stay):
            self.live_at = time.monotonic()
            self.span.add_event("queued_on_live_worker", {"worker": self.worker_id, "waited_s": plan.waited_s})
            return None
        if isinstance(plan, GiveUp):
            await give_up(g, plan, self.request_id)
            return self._error_chunk(ErrorCode.WORKER_LOST, plan.message)
        return await self._migrate(plan)

    def _segment(self) -> Segment:
        # Where the client is: chunks that arrived while the worker was being checked wait
        # unread in the stream, and are not in ``received_tokens``; the cut-off is before them.
        return Segment(generate=self.generate, worker_id=self.worker_id, worker_region=self.worker_region,
                       next_seq=self.read_seq,
                       received_tokens=self.received_tokens, segment_tokens=len(self.segment_tokens),
                       prompt_tokens=self.request.prompt_tokens, retired=self.stream.retired,
                       choice_tokens=self.choice_tokens, finished_choices=sorted(self.finished_choices))

    async def _migrate(self, plan: Migrate) -> TokenChunk | None:
        """Continue the request on another replica from the tokens the client already has;
        the error chunk when no replica takes it, else None (the stream continues at
        ``plan.cutoff`` from the new worker)."""
        log.warning("request %s: %s; migrating (%d tokens so far)", self.request_id, plan.why, self.completion_tokens)
        self.stream.retire(plan.retire, plan.cutoff)
        self.stream.worker_id = ""  # the next worker's chunks may come before its placement does
        self.stream.arrived_from = ""
        self._prior_tokens = self.received_tokens
        self.segment_tokens = []
        self.generate = plan.generate
        try:
            worker_id = await migrate(self.gateway, plan, self.record, arrived_from=lambda: self.stream.arrived_from)
        except MeshError as exc:
            return self._error_chunk(ErrorCode.WORKER_LOST, f"{plan.why}; no replica could take the request over: {exc.message}")
        self.span.add_event("migrated", {"from": plan.retire, "to": worker_id, "at_token": len(self.received_tokens)})
        self.worker_id = self.stream.worker_id = worker_id
        self.worker_region = self._region_of(worker_id)
        self.stream.last_chunk_at = time.monotonic()
        return None

    def _region_of(self, worker_id: str) -> str:
        info = self.gateway.registry.workers.get(worker_id)
        return info.region if info is not None else ""

    @property
    def received_tokens(self) -> list[int]:
        return self._prior_tokens + self.segment_tokens

    def _error_chunk(self, code: ErrorCode, message: str) -> TokenChunk:
        return TokenChunk(request_id=self.request_id, seq=self.stream.next_seq, finish_reason="error",
                          error=ErrorInfo(code=code.value, message=message))

    def _stopped_chunk(self) -> TokenChunk:
        return TokenChunk(request_id=self.request_id, seq=self.stream.next_seq, finish_reason="abort",
                          usage=Usage(prompt_tokens=self.request.prompt_tokens, completion_tokens=self.completion_tokens))

    # ---- the client: stop, cancel, going away -----------------------------------------
    async def stop(self, reason: str) -> None:
        """Ask the worker to stop, but keep relaying: its final chunk (finish ``abort``)
        carries the usage it billed, tokens streamed before the stop included."""
        if self.state is not RequestState.STREAMING:
            return
        self.state = RequestState.STOPPING
        self.stop_requested_at = time.monotonic()
        self.gateway.metrics.cancels.labels(reason=reason).inc()
        await self.gateway.upstream.cancel(self.worker_id, self.request_id, reason)

    async def cancel(self, reason: str) -> None:
        """Stop the worker and the relay at once (nobody is left to read the rest)."""
        if self.state in _RELAYING:
            self.state = RequestState.CANCELLED
            self.gateway.metrics.cancels.labels(reason=reason).inc()
            await self.gateway.upstream.cancel(self.worker_id, self.request_id, reason)

    async def client_gone(self) -> None:
        """The client went away mid-request: a resumable request keeps generating (its client
        may resume, on any gateway, within the resume window); any other is cancelled, which
        frees the worker's KV blocks now."""
        if self.state not in _RELAYING:
            return
        if self.record.resumable:
            self.state = RequestState.DETACHED
            self.gateway.keep_for_resume(self.record)
        else:
            await self.cancel("client_disconnected")

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[ActiveRequest]:
        """A front door relays the request inside this: a client that goes away (its
        connection reset, its handler cancelled) is ``client_gone``; whatever way the relay
        ends, the request is closed."""
        try:
            async with on_client_gone(self.client_gone):
                yield self
        finally:
            self.close()

    def close(self) -> None:
        """Metrics and bookkeeping, whatever way the request ended."""
        g = self.gateway
        g.dispatcher.close(self.request_id)  # no longer in flight
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
        # OpenTelemetry's GenAI conventions, as the worker's span
        self.span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if self.final is not None and self.final.finish_reason:
            self.span.set_attribute("gen_ai.response.finish_reasons", [self.final.finish_reason])
        self.span.set_attribute("meshserve.status", status)
        self.span.end()

    def assembler(self, include_usage: bool = False) -> ChoiceAssembler:
        """The request's choice assembler (every front door formats its deltas)."""
        return ChoiceAssembler(self.request.kind, self.request_id, self.request.requested_model, int(time.time()),
                               self.request.output, include_usage)

    async def collect(self) -> bytes:
        """The whole non-streamed response body (any API); an error chunk raises ApiError."""
        assembler = self.assembler()
        async for chunk in self.chunks():
            if chunk.error is not None:
                raise from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
            assembler.deltas(chunk)
        final = self.final
        assert final is not None  # chunks() ends on a final chunk unless cancelled, which raises here first
        return assembler.response(final.usage)


async def migrate(g: GatewayService, plan: Migrate, record: RequestRecord, *,
                  arrived_from: Callable[[], str] | None = None) -> str:
    """Carry out a migration plan (whoever watches the stream: the request's gateway, or the
    one its client resumed on) and store it in the resume record; the new worker's id.
    ``arrived_from``: the worker whose chunks of the next segment arrived already, if any.
    Raises MeshError when no replica takes the request."""
    g.spawn(g.upstream.cancel(plan.retire, record.request_id, "migrated away"))  # a stalled worker frees its blocks
    await g.publish_usage(plan.lost_usage, plan.lost_usage_id)
    record.retired[plan.retire] = plan.cutoff
    stored = record.segment is not None  # a resumable request's record (it holds its segment); no other is stored
    if stored:
        record.segment = plan.generate
        await g.records.save(record)
    placement = await place_when_ready(g, RouteRequest(request=plan.generate, exclude_workers=plan.exclude_workers),
                                       arrived_from=arrived_from)
    g.metrics.migrations.inc()
    record.worker_id = placement.worker_id
    if stored:
        await g.records.save(record)
    return placement.worker_id


async def place_when_ready(g: GatewayService, route: RouteRequest, *,
                           arrived_from: Callable[[], str] | None = None) -> Placement:
    """Place a migrating request; while no replica can take it (``migration.replica_wait``),
    wait for one to be listed and ask again, up to ``migration_wait_s``. Raises MeshError.
    ``arrived_from``: as for ``UpstreamClient.place``."""
    began = time.monotonic()
    waiting = False
    while True:
        try:
            return await g.upstream.place(route, arrived_from=arrived_from)
        except MeshError as exc:
            waited = time.monotonic() - began
            pause = replica_wait(str(exc.code), waited, g.config.migration_wait_s)
            if pause is None and waiting:
                raise MeshError(f"{exc.message} (waited {waited:.0f}s for a replica)", code=exc.code) from exc
            if pause is None:
                raise
            if not waiting:
                log.warning("request %s: no replica can take it over (%s); waiting up to %.0fs for one",
                            route.request.request_id, exc.message, g.config.migration_wait_s)
                waiting = True
        await _replica_listed(g, route, pause)


async def _replica_listed(g: GatewayService, route: RouteRequest, within_s: float) -> None:
    """Until the registry lists a ready worker that may take ``route`` (at most ``within_s``)."""
    deadline = time.monotonic() + within_s
    regions = route.request.regions  # a worker outside the key's regions is no replica for it
    await asyncio.sleep(min(0.2, within_s))  # not a tight loop while the router lags the registry
    while time.monotonic() < deadline:
        if any(w.worker_id not in route.exclude_workers and (not regions or w.region in regions)
               for w in g.registry.ready_workers(route.request.model)):
            return
        await asyncio.sleep(0.1)


async def give_up(g: GatewayService, plan: GiveUp, request_id: str) -> None:
    """A request that may not move again: stop its worker (a stalled one frees its blocks)
    and bill the segment it streamed, which it will never report."""
    g.spawn(g.upstream.cancel(plan.retire, request_id, "worker lost"))
    await g.publish_usage(plan.lost_usage, plan.lost_usage_id)


@contextlib.asynccontextmanager
async def on_client_gone(gone: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """The one place a client's going away is noticed: its connection reset or its handler
    cancelled (aiohttp's handler_cancellation) runs ``gone`` (shielded: the handler is
    being cancelled) and the error goes on."""
    try:
        yield
    except (ConnectionResetError, asyncio.CancelledError):
        await asyncio.shield(gone())
        raise


def cut_slow_client(transport: asyncio.Transport | None, active: ActiveRequest) -> None:
    """A client that cannot keep up (its request's buffer is full): its connection is
    aborted, so the blocked write fails and its handler cancels the worker. SSE, the
    Responses stream and the WebSocket all cut it so (``stream.on_overflow``)."""
    log.warning("request %s: client too slow (%d chunks buffered); cutting it", active.request_id,
                active.stream.buffered)
    g = active.gateway
    g.metrics.errors.labels(code="slow_client").inc()
    if active.record.resumable:
        # A client that cannot keep up does not get to resume: its request is cancelled,
        # and its stored record must say so to every gateway's resume endpoint.
        active.record.resumable = False
        g.spawn(g.records.save(active.record), name=f"unresumable-{active.request_id}")
    if transport is not None:
        transport.abort()


async def chat_event_dicts(active: ActiveRequest, request: NormalizedRequest,
                           transport: asyncio.Transport | None) -> AsyncGenerator[list[dict[str, Any] | None]]:
    """A streamed chat request's events chunk by chunk, as the dicts a translation over
    chat reads (the Responses and Messages APIs): None marks the stream's end, an error
    event is ``{"error": {...}}`` (``is_error_event``). A client that cannot keep up is cut."""
    builder = EventBuilder(request.kind, active.request_id, request.requested_model, active.record.created,
                           request.include_usage, request.output)
    active.stream.on_overflow = functools.partial(cut_slow_client, transport, active)
    async for chunk in active.chunks():
        yield [None if e.data == DONE else json.loads(e.data) for e in builder.events(chunk, first=chunk.seq == 0)]


def is_error_event(data: Mapping[str, Any]) -> bool:
    return "error" in data and "choices" not in data


async def _undo_admission(g: GatewayService, admit: asyncio.Future[AdmissionDecision],
                          generate: GenerateRequest) -> None:
    """Release what admission granted a request whose client left before the decision came:
    its forwarded placement's copy is stopped, and a ``rejected`` usage event gives its
    reservation back in full (nothing ran)."""
    try:
        decision = await admit
    except Exception:  # refused, or admission unreachable: nothing was granted
        return
    if not decision.admitted:
        return
    if decision.forwarded:
        g.upstream.abandon(generate.request_id)
    await g.publish_usage(rejected_usage(generate, "client gone during admission"), usage_dedup_id(generate.request_id))


def rejected_usage(generate: GenerateRequest, error: str) -> UsageEvent:
    """The usage event of an admitted request that no worker took: it reconciles what admission reserved."""
    return UsageEvent(request_id=generate.request_id, org=generate.org, key_id=generate.key_id,
                      **usage_model(generate), tier=generate.tier, status="rejected", reserved_tokens=generate.reserved_tokens,
                      arrival_time=generate.arrival_time, finish_time=time.time(), error=error[:500],
                      user=generate.user, metadata=generate.metadata)
