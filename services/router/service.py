"""The router service: ``policy`` and the fleet view wired to the mesh (DESIGN.md, Routing).

It keeps the shared ``services.common.fleet.FleetView`` live (``FleetFeed``) from four
feeds: the worker registry (joins, heartbeats, state changes, deletes), gauges
(``mesh.gauges.>``), KV event batches (``mesh.kv.>``; a gap, a stream joined mid-way or
a batch a gauge names but that never came makes it ask the worker for a
``KvSnapshot``), and its own clock (workers silent for ``stale_after_s`` are
expired). Several routers may run: each builds the same view from the same events and
they share the ``router`` queue group, so each request is placed by exactly one.

``mesh.router.route`` (a NATS micro endpoint): decide with the model's policy, forward
the ``GenerateRequest`` to the chosen worker (request-reply on its generate subject; its
model rewritten to the resolved pool when an alias or cascade resolved it), and answer
the gateway with a ``Placement``. A worker that refuses (draining, no responders,
timeout) costs one retry on a new decision without it (``retry.py`` decides); then the
gateway gets a typed error (``no_capacity``; ``unknown_model`` for a model nobody ever served).
On a timeout the first worker is told its copy is ``superseded`` (naming the request's
segment and placement try, ``GenerateRequest.attempt``, which the gateway sets for each
try), in case it did take the request and only its answer was late (or the request
reaches it later still): that copy stops, or is refused, and streams and bills nothing,
so the request never runs twice; a later try of the same segment there is taken. A
"no capacity" answer carries a ``retry_after``. Past the request's
``place_by`` (its gateway stopped waiting and places it itself) nothing is forwarded.

Metrics (own Prometheus registry, served on ``metrics_port`` when set, also in
``stats()``): placements per worker and policy, prefix-hit and prompt tokens, retries,
errors, resyncs, decision time; and the prefix policy's spills (placements on a worker
holding less of the prompt than the best holder, and the tokens they prefill again),
spills held back (``spill_wait_tokens``), underused-rule takes (``rebalanced``),
admission-hint outcomes, and the cost terms of the chosen worker and the best holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from bus import BusSettings, Service, cancel_and_wait
from bus.metrics import MetricsServer
from bus.tokenizers import TokenizerFiles, directory_of
from proto import (
    SUPERSEDED,
    CancelRequest,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    MeshError,
    RequestTimeout,
    RouteRequest,
    WorkerInfo,
    placement_expired,
)
from services.common import native
from services.common.feed import FleetFeed
from services.common.fleet import FleetView

from .config import RouterServiceConfig
from .policy import (
    POLICIES,
    NoCapacity,
    RouteDecision,
    RouteQuery,
    Router,
)
from .retry import Refusal, after_refusal, is_refusal, no_worker

log = logging.getLogger(__name__)
tracer = trace.get_tracer("meshserve.router")


# ============================================================================ metrics

# RouteDecision's cost terms, as summed in stats and metrics
COST_TERMS = ("chosen_queued", "chosen_running", "chosen_cost", "holder_cost")
DECISION_BUCKETS = (0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.placements = Counter(
            "meshserve:router_placements_total", "Requests placed, by worker and policy", ["model", "worker", "policy"], registry=r
        )
        self.prompt_tokens = Counter("meshserve:router_prompt_tokens_total", "Prompt tokens placed", ["model"], registry=r)
        self.prefix_hit_tokens = Counter(
            "meshserve:router_prefix_hit_tokens_total", "Prompt tokens estimated cached on the chosen worker", ["model"], registry=r
        )
        self.decision_seconds = Histogram(
            "meshserve:router_decision_seconds", "Time of one placement decision", buckets=DECISION_BUCKETS, registry=r
        )
        self.retries = Counter("meshserve:router_retries_total", "Placements moved after a refusal", ["reason"], registry=r)
        self.admission_hints = Counter(
            "meshserve:router_admission_hints_total", "Placements with admission's replica: kept, moved (within its slack), unavailable", ["outcome"],
            registry=r,
        )
        self.rebalanced = Counter(
            "meshserve:router_rebalanced_total", "Placements sent to an underused worker over the cost's choice", ["model"],
            registry=r,
        )
        self.remote_prefills = Counter(
            "meshserve:router_remote_prefills_total", "Placements whose prompt a prefill worker computes, by that worker",
            ["model", "worker"], registry=r,
        )
        self.regional = Counter(
            "meshserve:router_region_placements_total",
            "Placements of requests that name their region, by that region and the chosen worker's",
            ["origin", "region"], registry=r,
        )
        # issue 17: what sends a prompt away from its cache, and what the cost saw
        self.spills = Counter(
            "meshserve:router_spills_total", "Placements on a worker holding less of the prompt than the best holder",
            ["model"], registry=r,
        )
        self.spill_tokens = Counter(
            "meshserve:router_spill_tokens_total", "Prompt tokens a spill prefills again (the best holder had them cached)",
            ["model"], registry=r,
        )
        self.spills_held = Counter(
            "meshserve:router_spills_held_total",
            "Placements kept on a holder over a cheaper worker without the prefix (spill_wait_tokens)", ["model"],
            registry=r,
        )
        self.cost_terms = Counter(
            "meshserve:router_cost_terms_tokens_total",
            "Prefix-policy cost terms summed over placements with a holder: the chosen worker's queued prefill, "
            "running tokens and cost, and the best holder's cost", ["model", "term"], registry=r,
        )
        self.errors = Counter("meshserve:router_errors_total", "Route requests answered with an error", ["code"], registry=r)
        self.resyncs = Counter("meshserve:router_kv_resyncs_total", "KV snapshot requests by outcome", ["outcome"], registry=r)
        self.workers = Gauge("meshserve:router_workers", "Workers in the view, by placeability", ["state"], registry=r)


# ============================================================================ the shell


class RouterService(Service):
    name = "router"
    description = "meshserve router: KV-aware placement of requests on workers"

    def __init__(
        self,
        config: RouterServiceConfig | None = None,
        settings: BusSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        instance_id: str | None = None,
    ) -> None:
        super().__init__(settings, instance_id=instance_id)
        self.config = config or RouterServiceConfig()
        # The view only compares the router's own clock readings: monotonic suits it.
        self.clock = clock
        self.view = FleetView(self.config.view)
        self.feed = FleetFeed(self, self.view, lambda: self.clock(), resync_retry_s=self.config.resync_retry_s,
                              snapshot_timeout_s=self.config.snapshot_timeout_s, on_registry=self._on_registry,
                              on_resync=lambda _wid, outcome: self.metrics.resyncs.labels(outcome=outcome).inc())
        self.router = Router(self.view, self.config.router, random.Random(self.config.seed))
        self.metrics = RouterMetrics()
        self._background: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        self._cascade_keywords_done: set[str] = set()
        # plain counters for stats() (Prometheus children are per label set)
        self.placed = 0
        self.placed_by_worker: dict[str, int] = {}
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.retried = 0
        self.hints: dict[str, int] = {}  # admission hint outcome → placements
        self.rebalanced = 0
        self.remote_prefills = 0
        self.outside_region = 0  # placed outside the region the request entered by
        self.spills = 0
        self.spill_tokens = 0
        self.spills_held = 0
        self.holder_placements = 0  # placements where some worker held part of the prompt
        self.cost_terms: dict[str, float] = dict.fromkeys(COST_TERMS, 0.0)
        self.failed = 0
        self.decision_s_total = 0.0
        self.prehashed = 0  # requests whose prompt came hashed (RouteRequest.block_hashes)
        self.tokenizer_files: TokenizerFiles | None = None  # cascades' keywords (bus.tokenizers)

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.bus.subjects
        log.info("placement code: %s", native.status())
        self.tokenizer_files = TokenizerFiles(self.bus.js, s)
        await self.feed.start()
        await self.add_endpoint("route", s.router_route, RouteRequest, self.handle_route, queue_group="router")
        self._loop_task = asyncio.create_task(self._maintenance(), name="router-maintenance")
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, host=self.config.metrics_host,
                                                 port=self.config.metrics_port, before_scrape=lambda: self._update_worker_gauges())
            self.metrics_port = await self._metrics_server.start()
        # Ready means the server routes to our subscriptions (no "no responders").
        await self.bus.confirm_subscriptions()

    async def on_stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._background) if t is not None]
        await cancel_and_wait(tasks)
        await self.feed.stop()
        if self.tokenizer_files is not None:
            await self.tokenizer_files.close()
        if self._metrics_server is not None:
            await self._metrics_server.stop()

    def stats(self) -> dict[str, Any]:
        placeable = 0
        known = 0
        now = self.clock()
        for pool in self.view.pools.values():
            for w in pool:
                known += 1
                placeable += self.view.placeable(w, now)
        return {
            "workers": known,
            "placeable": placeable,
            "placements": self.placed,
            "placements_by_worker": dict(self.placed_by_worker),
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "retries": self.retried,
            "admission_hints": dict(self.hints),
            "rebalanced": self.rebalanced,
            "remote_prefills": self.remote_prefills,
            "outside_region": self.outside_region,
            "spills": self.spills,
            "spill_tokens": self.spill_tokens,
            "spills_held": self.spills_held,
            # means over the placements with a holder (a prompt some worker had cached)
            "cost_terms_mean": {
                k: v / self.holder_placements if self.holder_placements else 0.0 for k, v in self.cost_terms.items()
            },
            "errors": self.failed,
            "resyncs_requested": self.feed.resyncs_requested,
            "resyncs_applied": self.feed.resyncs_applied,
            "mean_decision_us": 1e6 * self.decision_s_total / self.placed if self.placed else 0.0,
            "prompts_hashed_by_gateway": self.prehashed,
            "placement_code": native.status(),
        }

    # ---- feeds (the view is fed by FleetFeed) -------------------------------------------
    def _on_registry(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is not None:
            self._maybe_compile_keywords(info)

    async def _maintenance(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                for worker_id in self.view.expire(self.clock()):
                    log.warning("worker %s expired: no registry heartbeat, gauge or KV event for %.0f s",
                                worker_id, self.config.view.stale_after_s)
                self.feed.request_resyncs()
                self._update_worker_gauges()
            except Exception:  # a bug here must not stop expiry for good
                log.exception("router maintenance failed")

    def _update_worker_gauges(self) -> None:
        s = self.stats()
        self.metrics.workers.labels(state="placeable").set(s["placeable"])
        self.metrics.workers.labels(state="other").set(s["workers"] - s["placeable"])

    def _background_task(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- cascades: keyword token ids ---------------------------------------------------
    def _maybe_compile_keywords(self, info: WorkerInfo) -> None:
        """Tokenize a cascade's hard keywords once a worker tells which tokenizer its pool uses."""
        for name, cascade in self.router.config.cascades.items():
            if name in self._cascade_keywords_done or not cascade.hard_keywords or cascade.hard_keyword_tokens:
                continue
            if info.model not in (cascade.small, cascade.large):
                continue
            source = (self.tokenizer_files.source(info) if self.tokenizer_files
                      else directory_of(info.model_dir, info.tokenizer) or "byte")
            if source is None:
                assert self.tokenizer_files is not None
                self.tokenizer_files.want(info)  # compiled at a heartbeat after it arrives
                return
            self._cascade_keywords_done.add(name)
            try:
                from services.common.tokenizer import load_tokenizer

                tok = load_tokenizer(source)
                seqs: set[tuple[int, ...]] = set()
                for kw in cascade.hard_keywords:
                    for variant in (kw, " " + kw, kw.capitalize(), " " + kw.capitalize()):
                        ids = tuple(tok.encode(variant))
                        if ids and ids[0] == tok.bos_token_id:
                            ids = ids[1:]  # a BOS would only match at the prompt's start
                        if ids:
                            seqs.add(ids)
            except Exception as exc:
                log.warning("cascade %s: cannot tokenize keywords with %s's tokenizer: %s", name, info.model, exc)
                continue
            self.router.set_cascade(name, replace(cascade, hard_keyword_tokens=tuple(sorted(seqs))))

    # ---- the endpoint -----------------------------------------------------------------
    async def handle_route(self, route: RouteRequest, msg: Msg) -> None:
        request = route.request
        with tracer.start_as_current_span(
            "router.route", context=self.bus.remote_context(msg), kind=trace.SpanKind.SERVER,
            attributes={"meshserve.request_id": request.request_id, "gen_ai.request.model": request.model},
        ) as span:
            try:
                decision = await self._place(route)
            except MeshError as exc:
                self.failed += 1
                self.metrics.errors.labels(code=exc.code.value).inc()
                span.set_attribute("meshserve.error", exc.code.value)
                raise
            span.set_attributes({"meshserve.worker_id": decision.worker_id, "meshserve.policy": decision.policy,
                                 "meshserve.cached_tokens": decision.cached_tokens})
        placement = decision.to_placement()
        if request.attempt:  # the placed copy's try: what a cancel of it as superseded names
            placement = msgspec.structs.replace(placement, attempt=request.attempt)
        await self.bus.respond(msg, placement)

    def _decide(self, query: RouteQuery, exclude: list[str]) -> RouteDecision | NoCapacity:
        t0 = time.perf_counter()
        result = self.router.place(query, self.clock(), exclude)
        elapsed = time.perf_counter() - t0
        self.metrics.decision_seconds.observe(elapsed)
        self.decision_s_total += elapsed
        return result

    async def _place(self, route: RouteRequest) -> RouteDecision:
        request = route.request
        query = RouteQuery.from_generate(
            request, prefer_worker=route.prefer_worker or None, prefer_slack_tokens=route.prefer_slack_tokens,
            block_hashes=route.block_hashes, block_size=route.block_size,
        )
        self.prehashed += bool(query.block_hashes)
        exclude = list(route.exclude_workers)
        refusals: list[Refusal] = []
        while True:
            decision = self._decide(query, exclude)
            if isinstance(decision, NoCapacity):
                code = ErrorCode.NO_CAPACITY if decision.retryable else ErrorCode.UNKNOWN_MODEL
                raise no_worker(refusals, code, decision.message).error()
            try:
                await self._forward(decision, request)
            except MeshError as exc:
                self.router.release(request.request_id)
                if not is_refusal(exc.code):
                    raise  # the request itself is at fault: another worker would refuse it too
                if placement_expired(request, time.time()):
                    raise  # its gateway stopped waiting and may have placed it itself
                refusals.append(Refusal(decision.worker_id, exc.code, exc.message))
                give_up = after_refusal(refusals)
                if give_up is not None:
                    raise give_up.error() from exc
                self.retried += 1
                self.metrics.retries.labels(reason=exc.code.value).inc()
                log.info("worker %s refused %s (%s); retrying elsewhere", decision.worker_id, request.request_id, exc.code.value)
                exclude.append(decision.worker_id)
                continue
            self._count(decision, request.region)
            return decision

    async def _forward(self, decision: RouteDecision, request: GenerateRequest) -> None:
        """Hand the request to the decision's worker; raises MeshError when it does not take it."""
        if placement_expired(request, time.time()):
            # Its gateway stopped waiting for us (we were stalled): it places the request
            # itself, so forwarding it now could run it twice.
            raise MeshError(f"request {request.request_id} is past its placement deadline", code=ErrorCode.TIMEOUT)
        forward = request
        if decision.model != request.model or decision.pinned_models or decision.prefill_worker:
            forward = msgspec.structs.replace(request, model=decision.model, pinned_models=list(decision.pinned_models),
                                              prefill_worker=decision.prefill_worker)
        s = self.bus.subjects
        try:
            await self.bus.request(s.worker_generate(decision.worker_id), forward, ControlReply,
                                   timeout=self.config.forward_timeout_s)
        except RequestTimeout:
            if placement_expired(request, time.time()):
                raise  # its gateway stopped waiting: it adopts the worker holding the request, if any
            # It may have started it and only answered late, or get it later still: that copy
            # is stale (the request goes elsewhere), it stops or is refused, and bills nothing.
            with contextlib.suppress(MeshError):
                await self.bus.publish(s.worker_cancel(decision.worker_id), CancelRequest(
                    request_id=request.request_id, reason=SUPERSEDED, migrations=request.migrations,
                    attempt=request.attempt))
            raise

    def _count(self, d: RouteDecision, origin: str = "") -> None:
        self.placed += 1
        self.placed_by_worker[d.worker_id] = self.placed_by_worker.get(d.worker_id, 0) + 1
        self.prompt_tokens += d.prompt_tokens
        self.prefix_hit_tokens += d.cached_tokens
        self.metrics.placements.labels(model=d.model, worker=d.worker_id, policy=d.policy).inc()
        self.metrics.prompt_tokens.labels(model=d.model).inc(d.prompt_tokens)
        self.metrics.prefix_hit_tokens.labels(model=d.model).inc(d.cached_tokens)
        if d.hint:
            self.hints[d.hint] = self.hints.get(d.hint, 0) + 1
            self.metrics.admission_hints.labels(outcome=d.hint).inc()
        if d.prefill_worker:
            self.remote_prefills += 1
            self.metrics.remote_prefills.labels(model=d.model, worker=d.prefill_worker).inc()
        if d.region:
            self.metrics.regional.labels(origin=origin, region=d.region).inc()
            if d.region != origin:
                self.outside_region += 1
        if d.rebalanced:
            self.rebalanced += 1
            self.metrics.rebalanced.labels(model=d.model).inc()
        if d.spilled:
            self.spills += 1
            self.spill_tokens += d.holder_cached_tokens - d.cached_tokens
            self.metrics.spills.labels(model=d.model).inc()
            self.metrics.spill_tokens.labels(model=d.model).inc(d.holder_cached_tokens - d.cached_tokens)
        if d.spill_held:
            self.spills_held += 1
            self.metrics.spills_held.labels(model=d.model).inc()
        if d.holder_cached_tokens:
            self.holder_placements += 1
            for term, value in zip(
                COST_TERMS, (d.queued_tokens, d.running_tokens, d.cost, d.holder_cost), strict=True
            ):
                self.cost_terms[term] += value
                self.metrics.cost_terms.labels(model=d.model, term=term).inc(value)


__all__ = ["POLICIES", "RouterMetrics", "RouterService", "RouterServiceConfig"]
