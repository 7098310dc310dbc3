"""The worker service: one engine, spoken for on the mesh.

It registers in ``mesh_workers`` and heartbeats, serves generate / cancel / probe / control /
KV-snapshot requests, streams coalesced token chunks into the TOKENS stream, publishes
gauges and KV event batches, and publishes exactly one usage event per request however
the request ends. SIGTERM or a drain command drains: the state becomes ``draining``,
new requests are refused with a retryable error, in-flight requests finish (bounded by
the drain timeout, after which they end with an explicit error chunk), then the worker
deregisters and exits 0.

A request is held (probes find it) before its placement is answered, and refused past
its ``place_by``. A copy its placer gave up on (a ``superseded`` cancel, which names
the segment and the placement try, or a later segment or later try of the same request
arriving) is refused, or stops and streams and bills nothing: the copy that runs on
reports the request. A later try of a superseded segment is no stale copy: a migration
that waited for this worker (paused, then back) lands here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace

from bus import BusSettings, Service, cancel_and_wait, tokenizers
from bus.client import MSG_ID_HEADER
from bus.connections import parse_advisory
from bus.metrics import MetricsServer
from proto import (
    SUPERSEDED,
    CancelRequest,
    ChunkResend,
    ControlCommand,
    ControlReply,
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    KvEventBatch,
    KvSnapshot,
    KvSnapshotRequest,
    MeshError,
    PayloadTooLarge,
    PrefillRequest,
    RequestProbe,
    RequestProbeReply,
    Timings,
    TokenChunk,
    Usage,
    UsageEvent,
    WorkerGauge,
    cache_scope,
    placement_expired,
    unpack_tokens,
    usage_dedup_id,
)

from .bookkeeping import Choice, RequestBook, SentChunks, request_choices, usage_event
from .capacity import CapacityMeter
from .chunks import ChunkPublisher, too_large, too_large_text
from .coalesce import Coalescer
from .config import WorkerConfig, default_worker_id
from .disagg import (
    CANCELLED,
    RemoteKv,
    RemotePrefill,
    disaggregable,
    prefill_engine_request,
    prefill_problem,
    prefill_result,
)
from .engines.base import Engine, EngineOutput, EngineRequest, PrefillRefused
from .metrics import WorkerMetrics
from .orphans import OrphanWatch
from .outcome import combine_outcomes, request_outcome
from .registration import Registration, accelerator_of, worker_info

log = logging.getLogger(__name__)
tracer = trace.get_tracer("meshserve.worker")


class WorkerService(Service):
    name = "worker"
    description = "meshserve worker: one inference engine on the mesh"

    def __init__(self, engine: Engine, config: WorkerConfig | None = None, settings: BusSettings | None = None) -> None:
        config = config or WorkerConfig()
        worker_id = config.worker_id or default_worker_id(engine.model)
        super().__init__(settings, instance_id=worker_id, drain_timeout_s=config.drain_timeout_s)
        self.engine = engine
        self.config = config
        self.worker_id = worker_id
        self.state = "starting"
        self._requests: dict[str, asyncio.Task[None]] = {}
        self.orphans = OrphanWatch()  # requests whose gateway died: stopped
        self.book = RequestBook(time.monotonic)  # what is known of each request, superseded copies
        self.registration: Registration | None = None  # made on start, with the bus
        self._kv_seq = -1
        self._state_changed = asyncio.Event()
        self._sent = SentChunks(self.config.chunk_retention_s)
        self.chunks_published = 0
        self.chunks_resent = 0
        self.tokens_published = 0
        self.metrics = WorkerMetrics(engine.model, engine.engine_name)
        self._metrics_server: MetricsServer | None = None
        self.capacity: CapacityMeter | None = None  # from start: the accelerator time it reports
        self.capacity_events = 0
        self._capacity_publishes: set[asyncio.Task[None]] = set()
        self.disagg: RemotePrefill | None = None  # made on start, with the bus
        self.prefills_served = 0  # a prefill worker's prefills for decode workers
        if config.role == "prefill" and not engine.disaggregation:
            raise ValueError(f"the {engine.engine_name} engine cannot prefill for other workers (role prefill)")

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        # The accelerator is paid for from here: the engine's start (minutes of loading on a
        # GPU) is part of the worker's time.
        accelerator, accelerators = accelerator_of(self.engine, self.config)
        self.capacity = CapacityMeter(worker_id=self.worker_id, model=self.engine.model, accelerator=accelerator,
                                      accelerators=accelerators, start=time.time(), engine=self.engine.engine_name,
                                      host_id=str(self.engine.hosting.get("host_id", "")))
        self.capacity.observe(time.time(), shares=self.engine.capacity_shares())
        await self.engine.start()
        s = self.bus.subjects
        self.registration = Registration(self.bus.js, s, replicas=self.settings.js_replicas, state=lambda: self.state)
        await self.registration.open()
        model_dir = getattr(self.engine, "model_dir", "")
        # Gateways on other hosts tokenize this model's requests with these files.
        tokenizer_dir = tokenizers.directory_of(model_dir, self.engine.tokenizer_spec)
        tokenizer_digest = await tokenizers.publish(self.bus.js, s, tokenizer_dir, replicas=self.settings.js_replicas) if tokenizer_dir else ""
        self.registration.info = worker_info(self.engine, self.config, self.worker_id, model_dir, tokenizer_digest)
        self.disagg = RemotePrefill(self.bus, self.worker_id, self.config.remote_prefill_timeout_s)
        await self.add_endpoint("generate", s.worker_generate(self.worker_id), GenerateRequest, self.handle_generate)
        if self.config.role == "prefill":
            await self.add_endpoint("prefill", s.worker_prefill(self.worker_id), PrefillRequest, self.handle_prefill)
        await self.add_endpoint("cancel", s.worker_cancel(self.worker_id), CancelRequest, self.handle_cancel, concurrent=False)
        await self.add_endpoint("probe", s.worker_probe(self.worker_id), RequestProbe, self.handle_probe, concurrent=False)
        await self.add_endpoint("resend", s.worker_resend(self.worker_id), ChunkResend, self.handle_resend)
        await self.add_endpoint("control", s.worker_control(self.worker_id), ControlCommand, self.handle_control, concurrent=False)
        await self.add_endpoint(
            "kv_snapshot", s.worker_kv_snapshot(self.worker_id), KvSnapshotRequest, self.handle_kv_snapshot, concurrent=False
        )
        for subject in (s.client_connected, s.client_disconnected):
            await self.bus.nc.subscribe(subject, cb=self._on_connection_advisory)
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, host=self.config.metrics_host, port=self.config.metrics_port,
                                                 before_scrape=lambda: self.metrics.observe_stats(self.engine.stats()))
            await self._metrics_server.start()
        self.state = "ready"
        await self._heartbeat()
        # Background loops are not in-flight work: they run until on_stop.
        self._loops = [
            asyncio.create_task(self._capacity_loop(), name="capacity"),
            asyncio.create_task(self._gauge_loop(), name="gauges"),
            asyncio.create_task(self.registration.beat_every(self.config.heartbeat_interval_s), name="heartbeat"),
            asyncio.create_task(self._kv_event_loop(), name="kv-events"),
        ]

    async def on_drain(self) -> None:
        # Endpoints stay up: new requests get a retryable "draining" error instead of silence.
        self.state = "draining"
        await self._heartbeat()
        self._state_changed.set()
        if not await self.wait_in_flight(self.drain_timeout_s):
            # Handed over, not failed: each stops here without a final chunk, and its gateway,
            # seeing this worker deregister, continues it on another replica from the tokens
            # its client has (as after a crash, with this segment billed by its worker).
            log.warning("drain timeout: handing %d requests over to other replicas", len(self._requests))
            for request_id in list(self._requests):
                self.book.handed_over.add(request_id)
                await self._abort(request_id)
            await self.wait_in_flight(10.0)

    async def on_stop(self) -> None:
        self.state = "stopped"
        await self.stop_endpoints()
        await cancel_and_wait(getattr(self, "_loops", []))
        # Periods still being published: a stop does not wait out a NATS outage for them.
        await cancel_and_wait(list(self._capacity_publishes))
        await self._publish_gauge()
        if self.registration is not None:
            await self.registration.remove()
        try:
            await self.engine.shutdown()
        finally:
            if self.capacity is not None:
                # The last period, up to the engine's release of its accelerators. Bounded
                # (about 2 s): an orchestrator's kill timeout may be 5 s.
                await self._publish_capacity(give_up_after_s=1.0, attempt_timeout_s=1.0)
        if self._metrics_server is not None:
            await self._metrics_server.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "state": self.state,
            "requests": len(self._requests),
            "chunks_published": self.chunks_published,
            "tokens_published": self.tokens_published,
            "chunks_resent": self.chunks_resent,
            "capacity_events": self.capacity_events,
            "role": self.config.role,
            "prefills_served": self.prefills_served,
            **(self.disagg.stats() if self.disagg is not None else {}),
        }

    # ---- endpoints --------------------------------------------------------------------
    def _validate(self, request: GenerateRequest, prompt: list[int]) -> None:
        if request.model != self.engine.model:
            raise MeshError(f"worker {self.worker_id} serves {self.engine.model!r}, not {request.model!r}", code=ErrorCode.UNKNOWN_MODEL)
        if not prompt:
            raise MeshError("empty prompt", code=ErrorCode.BAD_REQUEST)
        # max_tokens 0 (echo without generation) still runs the engine one token.
        total = len(prompt) + max(request.sampling.max_tokens, 1)
        if total > self.engine.max_model_len:
            raise MeshError(
                f"prompt of {len(prompt)} tokens plus max_tokens {request.sampling.max_tokens} exceeds max_model_len {self.engine.max_model_len}",
                code=ErrorCode.PROMPT_TOO_LONG,
            )
        if request.sampling.max_tokens < 0:
            raise MeshError("max_tokens must not be negative", code=ErrorCode.BAD_REQUEST)
        if (request.lora and request.lora not in self.engine.stats().lora_adapters
                and not (self.engine.lora_runtime["max_loras"] and (request.lora_path or request.lora_size_bytes > 0))):
            raise MeshError(f"LoRA adapter {request.lora!r} is not loaded on {self.worker_id}", code=ErrorCode.BAD_REQUEST)
        if request.request_id in self._requests:
            raise MeshError(f"request {request.request_id} is already running here", code=ErrorCode.BAD_REQUEST)

    async def handle_generate(self, request: GenerateRequest, msg: Msg) -> None:
        if self.state != "ready":
            # Retryable: the router places it elsewhere. No chunk, no usage: nothing started here.
            raise MeshError(f"worker {self.worker_id} is {self.state}", code=ErrorCode.DRAINING)
        if self.superseded(request) or self.book.later_try_held(request.request_id, request.migrations,
                                                                     request.attempt):
            # Its placer gave up on this copy (this placement try) before it came (a timed-out
            # forward): it runs elsewhere, or a later try of it runs here.
            raise MeshError(f"request {request.request_id} was superseded", code=ErrorCode.CANCELLED)
        stale = self.book.stale_copy(request.request_id, request.migrations, request.attempt)
        if stale is not None:
            # A later segment, or a later placement try of the segment, of a request whose
            # earlier copy is still held here: that copy is stale.
            await self._supersede(request.request_id, *stale, wait=True)
        if placement_expired(request, time.time()):
            # Whoever placed it stopped waiting (a stalled router): the gateway may have
            # placed it elsewhere. Retryable, nothing started here.
            raise MeshError(f"request {request.request_id} is past its placement deadline", code=ErrorCode.TIMEOUT)
        try:
            prompt = unpack_tokens(request.prompt) + unpack_tokens(request.prior_output)
            self._validate(request, prompt)
        except (MeshError, ValueError) as exc:
            error = exc if isinstance(exc, MeshError) else MeshError(str(exc), code=ErrorCode.BAD_REQUEST)
            await self.bus.respond_error(msg, error, status=400)
            await self._finish_rejected(request, error)
            return
        # Held before the reply (and in the same step as the deadline check): a gateway that
        # stopped waiting for its router probes the workers, and finds every request one took.
        self._track(request.request_id)
        self.book.hold(request.request_id, request.migrations, request.attempt)
        self.orphans.track(request.request_id, request.gateway_id, request.resumable)
        try:
            await self.bus.respond(msg, ControlReply(worker_id=self.worker_id, state="ready",
                                                     in_flight=len(self._requests) - 1))
            with tracer.start_as_current_span(
                "worker.generate",
                context=self.bus.remote_context(msg),
                kind=trace.SpanKind.SERVER,
                attributes={"meshserve.worker_id": self.worker_id, "meshserve.request_id": request.request_id,
                            "gen_ai.request.model": request.model},
            ) as span:
                await self._stream(request, prompt, span)
        finally:
            self._untrack(request.request_id)
            self.book.release(request.request_id)
            self.orphans.release(request.request_id)
            if self.superseded(request):
                self._sent.drop(request.request_id)  # never to be sent again
            self._sent.ended(request.request_id, self._requests)
            self._state_changed.set()

    def _track(self, request_id: str) -> None:
        """``request_id`` runs here from now on (the current task): busy time, gauges, cancels."""
        task = asyncio.current_task()
        assert task is not None
        self._requests[request_id] = task
        if len(self._requests) == 1 and self.capacity is not None:
            self.capacity.observe(time.time(), busy=True)
        self._state_changed.set()

    def _untrack(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if not self._requests and self.capacity is not None:
            self.capacity.observe(time.time(), busy=False)

    async def handle_prefill(self, ask: PrefillRequest, msg: Msg) -> None:
        """A decode worker's prompt (role prefill): computed, its KV described in the answer.
        Nothing streams and nothing is billed here: the request is the decode worker's."""
        if problem := prefill_problem(ask, self.worker_id, self.state, self.engine.model, time.time(), self._requests):
            raise problem
        self._track(ask.request_id)
        # Gauges name it: a router's optimistic count of this prefill settles as for a request.
        self.book.engine_took(ask.request_id)
        try:
            with tracer.start_as_current_span(
                "worker.prefill", context=self.bus.remote_context(msg), kind=trace.SpanKind.SERVER,
                attributes={"meshserve.worker_id": self.worker_id, "meshserve.request_id": ask.request_id,
                            "meshserve.decode_worker": ask.decode_worker, "gen_ai.request.model": ask.model},
            ):
                handoff = await self.engine.prefill(prefill_engine_request(ask, time.time()))
        except PrefillRefused as exc:
            raise MeshError(f"prefill of {ask.request_id} on {self.worker_id}: {exc}", code=ErrorCode.BAD_REQUEST) from exc
        finally:
            self._untrack(ask.request_id)
            self.book.handed_over.discard(ask.request_id)  # a drain's timeout marks whatever runs
            self._state_changed.set()
        self.prefills_served += 1
        await self.bus.respond(msg, prefill_result(ask, handoff, self.worker_id))

    async def _stream(self, request: GenerateRequest, prompt: list[int], span: trace.Span) -> None:
        if self.superseded(request):
            return  # superseded between its arrival and now: nothing to stream or bill
        choices = request_choices(request, prompt)
        self.book.engine_ids[request.request_id] = [c.engine_id for c in choices]
        publisher = ChunkPublisher(self, request)
        try:
            await asyncio.gather(*(self._run_choice(request, c, publisher, single=len(choices) == 1
                                                    and request.sampling.n <= 1) for c in choices))
        finally:
            self.book.engine_ids.pop(request.request_id, None)
        # The request's own prompt: a migrated single choice got its prior output appended.
        prompt_tokens = len(prompt) - (choices[0].prior if request.sampling.n <= 1 else 0)
        outcomes = [
            request_outcome(c.last, prompt_tokens=prompt_tokens, prior_tokens=c.prior, streamed=c.streamed,
                            migrations=request.migrations, engine_error=c.error_text, undeliverable=c.undeliverable)
            for c in choices
        ]
        outcome = outcomes[0] if len(outcomes) == 1 and request.sampling.n <= 1 else combine_outcomes(
            outcomes, migrations=request.migrations,
            finished_before=len(request.finished_choices))
        usage, timings = outcome.usage, outcome.timings
        if request.request_id in self.book.handed_over and not all(c.ended_alone for c in choices):
            # No final chunk: the next replica's segment ends the stream. This one bills what
            # it sent (the same usage id as the gateway's bill of a lost segment: one counts).
            event = usage_event(request, outcome.billed, "migrated", timings,
                                f"worker {self.worker_id} drained (drain timeout): continued on another replica",
                                worker_id=self.worker_id, region=self.config.region, now=time.time())
            self.metrics.observe_request("abort", usage.prompt_tokens, usage.cached_tokens,
                                         sum(c.streamed for c in choices), timings)
            if not self.superseded(request):
                self._publish_usage(request, event)
            return
        event = usage_event(request, outcome.billed, outcome.status, timings, outcome.error_text,
                            worker_id=self.worker_id, region=self.config.region, now=time.time())
        if request.sampling.n <= 1:
            # One choice: its last tokens ride on the request's final chunk.
            token_ids, text, logprobs = choices[0].tail
            final = TokenChunk(request_id=request.request_id, seq=0, token_ids=token_ids, text=text, logprobs=logprobs,
                               finish_reason=outcome.finish, stop_reason=choices[0].stop_reason(outcome.finish),
                               usage=usage, timings=timings, error=outcome.error,
                               worker_id=self.worker_id, usage_event=event)
        else:
            final = TokenChunk(request_id=request.request_id, seq=0, finish_reason=outcome.finish, usage=usage,
                               timings=timings, error=outcome.error, worker_id=self.worker_id, usage_event=event)
        streamed = sum(c.streamed for c in choices)
        # Metrics before the final chunk: whoever sees the request end sees it counted.
        self.metrics.observe_request(outcome.finish, usage.prompt_tokens, usage.cached_tokens, streamed, timings)
        try:
            try:
                await publisher.publish(final, ack=True)
            except PayloadTooLarge as exc:
                # The stream must still end: the same end without what did not fit.
                log.warning("final chunk of %s does not fit the bus: %s", request.request_id, exc)
                message = too_large_text(exc)
                event = msgspec.structs.replace(event, status="failed", error=message)
                await publisher.publish(TokenChunk(
                    request_id=request.request_id, seq=0, finish_reason="error", usage=usage, timings=timings,
                    error=ErrorInfo(code=ErrorCode.BAD_REQUEST.value, message=message),
                    worker_id=self.worker_id, usage_event=event), ack=True)
        finally:  # billed even when the final chunk's ack never came; a stale copy bills nothing
            if not self.superseded(request):
                self._publish_usage(request, event)
        span.set_attributes({
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "meshserve.cached_tokens": usage.cached_tokens,
            "meshserve.finish_reason": outcome.finish,
        })
        _phase_spans(timings)

    async def _run_choice(self, request: GenerateRequest, choice: Choice, publisher: ChunkPublisher,
                          *, single: bool) -> None:
        """Stream one choice's engine outputs as coalesced chunks. ``single``: the request's
        only choice, whose last tokens the final chunk carries (``choice.tail``); else its
        end is a chunk of its own with ``choice_finish_reason``."""
        # max_tokens 0 (completions echo without generation, as vLLM): the engine runs one
        # token, for the prompt's logprobs; the token is billed (vLLM counts it) but not sent.
        echo_only = choice.sampling.max_tokens == 0
        engine_request = EngineRequest(
            request_id=choice.engine_id,
            prompt_token_ids=choice.prompt,
            sampling=msgspec.structs.replace(choice.sampling, max_tokens=1) if echo_only else choice.sampling,
            priority=request.priority,
            arrival_time=time.time(),
            lora=request.lora,
            lora_size_bytes=request.lora_size_bytes,
            lora_path=request.lora_path,
            cache_salt=cache_scope(request.org, request.cache_salt),
            output_offset=choice.prior,
            pinned_models=request.pinned_models,
        )
        coalescer = Coalescer(self.config.coalesce_interval_s, self.config.coalesce_max_tokens)
        prompt_logprobs = None
        token_ids: list[int] = []
        unsent = 0  # tokens taken for a chunk the bus could not carry: not billed
        remote: RemoteKv | None = None
        if disaggregable(request) and single and self.disagg is not None and self.engine.disaggregation:
            try:
                answer = await self.disagg.fetch(request, choice.engine_id)
            finally:
                cancelled = self.disagg.started(choice.engine_id)
            if cancelled or answer is CANCELLED:  # never started: ends as a cancel before scheduling does
                choice.last = EngineOutput(request_id=choice.engine_id, finish_reason="abort", prompt_tokens=len(choice.prompt),
                                           timings=Timings(arrival=engine_request.arrival_time, finished=time.time()))
                return
            if isinstance(answer, RemoteKv):
                remote = answer
                engine_request.kv_transfer = answer.transfer
        # The engine counts the request from the first iteration's start (before it first
        # suspends), so no gauge can name it without counting its tokens.
        self.book.engine_took(request.request_id)
        try:
            async with contextlib.aclosing(self.engine.generate(engine_request)) as stream:
                async for output in stream:
                    choice.last = output
                    now = time.monotonic()
                    if output.new_token_ids:
                        self.book.output(request.request_id)
                    if output.prompt_logprobs is not None and choice.index == 0 and request.first_seq == 0:
                        prompt_logprobs = output.prompt_logprobs
                    if not echo_only:
                        coalescer.add(output.new_token_ids, output.text, now, output.logprobs)
                    if output.finish_reason is not None:
                        break
                    if coalescer.should_flush(now, self.coalesce_interval()):
                        token_ids, text, logprobs = coalescer.take(now)
                        await publisher.publish(TokenChunk(
                            request_id=request.request_id, seq=0, index=choice.index, token_ids=token_ids, text=text,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs, worker_id=self.worker_id))
                        prompt_logprobs = None
        except PayloadTooLarge as exc:
            too_large(choice, exc)
            unsent = len(token_ids)
            prompt_logprobs = None  # not built again for the choice's last chunk
        except Exception as exc:  # an engine failure ends this request with an error, not silence
            log.exception("engine failed on %s", choice.engine_id)
            choice.error_text = f"engine failure: {exc!r}"
        token_ids, text, logprobs = coalescer.take(time.monotonic())
        if remote is not None and choice.last is not None:
            # The prefill worker's cache hits, whatever the engine counted as loaded.
            choice.last.cached_tokens = remote.cached_tokens
        if request.request_id in self.book.handed_over and not choice.ended_alone:
            # Handed over: what the client has is what was sent; the rest is the next replica's.
            choice.streamed = coalescer.emitted - unsent - len(token_ids)
            return
        choice.streamed = coalescer.emitted - unsent  # the final chunk's tokens included
        if echo_only and choice.last is not None:
            choice.streamed = choice.last.completion_tokens
        if single:
            choice.tail = (token_ids, text, logprobs)
            if prompt_logprobs is not None:  # a one-chunk answer: the prompt's logprobs go first
                try:
                    await publisher.publish(TokenChunk(request_id=request.request_id, seq=0,
                                                       prompt_logprobs=prompt_logprobs, worker_id=self.worker_id))
                except PayloadTooLarge as exc:
                    too_large(choice, exc)
            return
        finish = choice.last.finish_reason if choice.last is not None and choice.last.finish_reason else "error"
        end = TokenChunk(
            request_id=request.request_id, seq=0, index=choice.index, token_ids=token_ids, text=text, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, choice_finish_reason="error" if choice.failed else finish,
            stop_reason=None if choice.failed else choice.stop_reason(finish), worker_id=self.worker_id)
        try:
            await publisher.publish(end)
        except PayloadTooLarge as exc:
            too_large(choice, exc)
            await publisher.publish(TokenChunk(request_id=request.request_id, seq=0, index=choice.index,
                                               choice_finish_reason="error", worker_id=self.worker_id))
        if choice.failed:
            # The request fails as a whole: its other choices' tokens would reach nobody.
            for engine_id in self.book.engine_ids.get(request.request_id, []):
                if engine_id != choice.engine_id:
                    await self.engine.abort(engine_id)

    async def _publish_chunk(self, request: GenerateRequest, chunk: TokenChunk, *, ack: bool = False) -> None:
        headers = {MSG_ID_HEADER: f"{request.request_id}:{chunk.seq}"}
        if ack:
            # The last chunk must not be lost: the gateway ends the stream on it.
            await self.bus.js_publish(request.token_subject, chunk, headers=headers)
        else:
            await self.bus.publish(request.token_subject, chunk, headers=headers, trace=False)
        self.chunks_published += 1
        self.tokens_published += len(chunk.token_ids)
        self._sent.keep(request.request_id, request.token_subject, chunk)

    def _publish_usage(self, request: GenerateRequest, event: UsageEvent) -> None:
        """Publish ``event`` in the background, off the request's path, until USAGE stores it
        (it may be without a leader for a while); the drain waits for it like a request."""
        self.spawn(self.bus.js_publish_until_stored(
            self.bus.subjects.usage(request.org), event, msg_id=usage_dedup_id(request.request_id, request.migrations),
            give_up_after_s=self.config.usage_retry_s,
        ), name=f"usage-{request.request_id}")

    async def _finish_rejected(self, request: GenerateRequest, error: MeshError) -> None:
        """A request refused for what it is: an error chunk and a usage record, never silence."""
        if not request.token_subject:
            return
        event = usage_event(request, Usage(), "failed", None, error.message, worker_id=self.worker_id, region=self.config.region, now=time.time())
        chunk = TokenChunk(
            request_id=request.request_id, seq=request.first_seq, finish_reason="error",
            error=ErrorInfo(code=error.code.value, message=error.message), usage=Usage(), worker_id=self.worker_id,
            usage_event=event,
        )
        try:
            with contextlib.suppress(MeshError):
                await self._publish_chunk(request, chunk, ack=True)
        finally:
            self._publish_usage(request, event)

    async def _abort(self, request_id: str) -> None:
        """Stop every engine request of ``request_id`` (its n choices)."""
        for engine_id in self.book.engine_ids.get(request_id, [request_id]):
            if self.disagg is not None:
                self.disagg.cancel(engine_id)  # still waiting for a prefill worker
            await self.engine.abort(engine_id)

    def superseded(self, request: GenerateRequest) -> bool:
        """Whether this copy of ``request`` (its segment) was superseded: it runs elsewhere."""
        return self.book.superseded(request.request_id, request.migrations, request.attempt)

    async def _supersede(self, request_id: str, segment: int, attempt: int, *, wait: bool) -> bool:
        """Remember that copy (segment, placement try) as stale (``RequestBook.supersede``);
        one running here stops (``wait``: until it ended). Whether one ran."""
        task = self._requests.get(request_id)
        if not self.book.supersede(request_id, segment, attempt) or task is None:
            return False
        await self._abort(request_id)
        if wait:
            await asyncio.wait({task})
        return True

    async def _on_connection_advisory(self, msg: Msg) -> None:
        event = parse_advisory(msg.data)
        if event is not None and self.orphans.observe(event, time.monotonic()):
            asyncio.get_running_loop().call_later(self.orphans.connections.grace_s + 0.01, self._stop_orphans)

    def _stop_orphans(self) -> None:
        """Stop the requests of gateways gone for good (services/worker/orphans.py): billed
        for what they produced, as a client's cancel is."""
        if self.state == "stopped":
            return  # a timer of a disconnect seen before the stop: nothing runs here any more
        for gateway_id, request_ids in self.orphans.due(time.monotonic()).items():
            log.warning("gateway %s is gone: stopping its %d requests (not resumable)", gateway_id, len(request_ids))
            for request_id in request_ids:
                self.spawn(self._abort(request_id), name=f"orphan-{request_id}")

    async def handle_cancel(self, cancel: CancelRequest, msg: Msg) -> None:
        if cancel.reason == SUPERSEDED:
            running = await self._supersede(cancel.request_id, cancel.migrations, cancel.attempt, wait=False)
            await self.bus.respond(msg, ControlReply(worker_id=self.worker_id, state=self.state,  # type: ignore[arg-type]
                                                     message="superseded" if running else "unknown request"))
            return
        known = cancel.request_id in self._requests
        if known:
            await self._abort(cancel.request_id)
        await self.bus.respond(msg, ControlReply(worker_id=self.worker_id, state=self.state, message="cancelled" if known else "unknown request"))  # type: ignore[arg-type]

    async def handle_probe(self, probe: RequestProbe, msg: Msg) -> None:
        state, since_output, engine_idle = self.book.progress(probe.request_id)
        if state == "waiting" and (self.engine.stats().residency in ("loading", "cold")
                                   or (self.disagg is not None and self.disagg.waiting(probe.request_id))):
            # A hot-swap model being loaded (or waiting for room), or a prompt on a prefill
            # worker, is work under way, not a hung engine: either can outlast the gateway's
            # stall timeout.
            engine_idle = 0.0
        held = self.book.held(probe.request_id)
        await self.bus.respond(msg, RequestProbeReply(
            worker_id=self.worker_id, request_id=probe.request_id, state=state, since_output_s=since_output,
            engine_idle_s=engine_idle, attempt=held[1] if held is not None else 0,
        ))

    async def handle_control(self, command: ControlCommand, msg: Msg) -> None:
        if command.command in ("drain", "stop"):
            self.drain_timeout_s = command.timeout_s if command.command == "drain" else 0.0
            self.request_stop()
            self.state = "draining"
            await self._heartbeat()
            self._state_changed.set()
        message = ""
        if command.command == "load":
            message = "loading" if self.state == "ready" and await self.engine.warm() else "not loading"
        await self.bus.respond(msg, ControlReply(worker_id=self.worker_id, state=self.state,  # type: ignore[arg-type]
                                                 in_flight=len(self._requests), message=message))

    async def handle_resend(self, resend: ChunkResend, msg: Msg) -> None:
        """Publish again the chunks a gateway is missing (it found a gap TOKENS cannot fill)."""
        subject, again = self._sent.between(resend.request_id, resend.from_seq, resend.to_seq)
        for chunk in again:
            headers = {MSG_ID_HEADER: f"{resend.request_id}:{chunk.seq}"}  # TOKENS stores each once
            await self.bus.publish(subject, chunk, headers=headers, trace=False)
        self.chunks_resent += len(again)
        await self.bus.respond(msg, ControlReply(worker_id=self.worker_id, state=self.state,  # type: ignore[arg-type]
                                                 message=f"{len(again)} chunks sent again"))

    async def handle_kv_snapshot(self, request: KvSnapshotRequest, msg: Msg) -> None:
        await self.bus.respond(
            msg,
            KvSnapshot(worker_id=self.worker_id, model=self.engine.model, seq=self._kv_seq,
                       block_size=self.engine.block_size, block_hashes=self.engine.kv_snapshot()),
        )

    def coalesce_interval(self) -> float:
        """The chunk interval: the configured one, widened so the whole worker stays under
        ``max_messages_per_s`` however many requests run (one chunk per request per step
        would otherwise make the message rate equal the token rate at large batches)."""
        return max(self.config.coalesce_interval_s, len(self._requests) / self.config.max_messages_per_s)

    # ---- telemetry loops --------------------------------------------------------------
    async def _publish_capacity(self, *, give_up_after_s: float, attempt_timeout_s: float = 5.0) -> None:
        assert self.capacity is not None
        event = self.capacity.close(time.time())
        if event is None:
            return  # no time passed (a clock stepped back): nothing to report
        self.capacity_events += 1
        await self.bus.js_publish_until_stored(self.bus.subjects.capacity(self.worker_id), event,
                                               msg_id=event.event_id, give_up_after_s=give_up_after_s,
                                               timeout=attempt_timeout_s)

    async def _capacity_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.capacity_interval_s)
            # In the background: storing may wait for CAPACITY (a leader election), and the next
            # period must not. Not in-flight work: a drain does not wait for it (on_stop cancels).
            task = asyncio.create_task(self._publish_capacity(give_up_after_s=self.config.usage_retry_s),
                                       name="capacity")
            self._capacity_publishes.add(task)
            task.add_done_callback(self._capacity_publishes.discard)

    def gauge(self) -> WorkerGauge:
        return WorkerGauge(
            worker_id=self.worker_id, model=self.engine.model, ts=time.time(), draining=self.state != "ready",
            kv_event_seq=self._kv_seq, arrived=self.book.arrivals_for_gauge(), **self.engine.stats().gauge_fields(),
        )

    async def _publish_gauge(self) -> None:
        with contextlib.suppress(Exception):
            await self.bus.publish(self.bus.subjects.gauges(self.engine.model, self.worker_id), self.gauge(), trace=False)

    async def _gauge_loop(self) -> None:
        while True:
            self._state_changed.clear()  # before the gauge is built: a later change is not lost
            if self.capacity is not None:
                self.capacity.observe(time.time(), shares=self.engine.capacity_shares())
            await self._publish_gauge()
            due = time.monotonic() + self.config.gauge_min_interval_s
            # Not wait_for: on Python 3.11 it swallows a cancel that arrives as the event is
            # set, and on_stop then waits for this loop forever.
            changed = asyncio.ensure_future(self._state_changed.wait())
            try:
                await asyncio.wait({changed}, timeout=self.config.gauge_interval_s)
            finally:
                changed.cancel()
            if (rest := due - time.monotonic()) > 0:
                await asyncio.sleep(rest)

    async def _heartbeat(self) -> None:
        if self.registration is not None:
            await self.registration.beat()

    async def _kv_event_loop(self) -> None:
        async for events in self.engine.kv_events():
            if not events:
                continue
            self._kv_seq += 1
            batch = KvEventBatch(worker_id=self.worker_id, model=self.engine.model, seq=self._kv_seq, ts=time.time(), events=events)
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.kv_events(self.engine.model, self.worker_id), batch, trace=False)


def _phase_spans(timings: Timings | None) -> None:
    """Queue, prefill and decode as child spans of the current worker span, from engine timings."""
    if timings is None or not timings.arrival:
        return
    ns = 1_000_000_000
    phases = (("worker.queue", timings.arrival, timings.scheduled), ("worker.prefill", timings.scheduled, timings.first_token),
              ("worker.decode", timings.first_token, timings.finished))
    for name, start, end in phases:
        if start and end and end >= start:
            tracer.start_span(name, start_time=int(start * ns)).end(end_time=int(end * ns))
