"""The admission service: ``AdmissionPolicy`` wired to the mesh (DESIGN.md, Admission).

``mesh.admission.check`` (a NATS micro endpoint, queue group ``admission``) answers each
``AdmissionRequest`` with an ``AdmissionDecision``: quota first (token buckets per key
and org from the request's RPM/TPM limits), then the predictive SLO check per tier over
the model's replicas (``ReplicaBook``: registry, latest gauges, this service's recent
admissions, and the prefix each replica caches, from the same KV events the router
reads, matched against the request's block hashes). Reservations are reconciled from
the USAGE stream and unreconciled ones expire (``Limiter``).

One active instance, standbys beside it. The budget is global state: two instances
deciding independently would each grant a key its whole budget. Two ways out were
weighed. Sharding keys by a stable hash across instances needs every instance to agree
on the membership (a shard map) at every moment, a request touches a key bucket and an
org bucket that hash apart unless sharding is by org, and each join or leave moves
live buckets between instances. A leader lease is simpler and enough: a check is a few
dict operations and one SLO pass (tens of µs), so one instance serves far more checks
than a fleet of gateways sends, and what a fleet needs from several instances is
availability, which standbys give. So:

- The lease (its mechanics: ``leadership.LeaderLease``; what leading means stays here) is
  the key ``leader`` in the JetStream KV bucket ``<root>_admission``, whose
  entries live ``lease_ttl_s``. An instance takes it with an atomic ``create`` (only one
  can succeed), renews it every ``lease_renew_s`` with ``update(last=revision)`` (fails
  if anyone else wrote it), and stops serving if it could not renew for 0.8 of the TTL,
  before anyone else can take the lease over, so two leaders never serve at once. A
  standby retries ``create`` every ``lease_renew_s``: it takes over at most TTL + renew
  after the leader died (the gateway fails open meanwhile, within its grace window).
  A leader that drains deletes the lease, and a standby takes over at once.
- Only the leader has the check endpoint and consumes USAGE. Standbys keep their replica
  book warm (registry, gauges, KV events) so they predict well from the first request.
  A standby answers ``$SRV.PING``/``INFO`` but, with no endpoint, reports no figures in
  ``$SRV.STATS`` (NATS micro attaches them to endpoints).
- The leader checkpoints the limiter every ``checkpoint_interval_s`` into the bucket
  ``<root>_admission_state`` (no TTL): buckets not full, open reservations, and the
  USAGE stream sequence reconciled so far. The successor restores it and consumes USAGE
  from the next sequence, so reservations open at the checkpoint are still reconciled
  exactly once and failover grants no fresh budget: at most the admissions of the last
  checkpoint interval go uncharged. Bucket times are wall-clock seconds (``clock``),
  comparable across hosts; everything local (gauge ages, lease timing) is monotonic.

USAGE is read with an ordered push consumer (ephemeral, flow-controlled, re-created by
the client from the last sequence on any gap): each event is applied once, in order,
and the limiter's ledger makes a repeated event a no-op anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from opentelemetry import trace

from bus import BusSettings, Service, cancel_and_wait
from bus.metrics import MetricsServer
from proto import (
    AdmissionDecision,
    AdmissionRequest,
    ControlCommand,
    ControlReply,
    DecodeError,
    ErrorCode,
    MeshError,
    PoolDemand,
    TtftObservation,
    UsageEvent,
    decode,
)
from services.common.feed import FleetFeed
from services.common.regions import allowed, region_of
from services.common.residency import residency, swap_costs

from .buckets import InvalidLimits, Limiter
from .config import AdmissionConfig
from .demand import CAPACITY_REASONS, RefusedDemand
from .leadership import LeaderLease
from .lease import STATE_KEY, Checkpoint, admission_buckets
from .metrics import AdmissionMetrics
from .policy import AdmissionPolicy, forwarded_route
from .replicas import ReplicaBook
from .slo import ReplicaLoad, SloAdmitter
from .slots import SlotWaiters

log = logging.getLogger(__name__)
tracer = trace.get_tracer("meshserve.admission")

# ============================================================================ the shell


class AdmissionService(Service):
    name = "admission"
    description = "meshserve admission: quotas and predictive SLO shedding"

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        settings: BusSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        instance_id: str | None = None,
    ) -> None:
        super().__init__(settings, instance_id=instance_id)
        self.config = config or AdmissionConfig()
        self.clock = clock  # quota state: shared with the next leader, so wall clock
        self.monotonic = monotonic  # local ages: gauges, lease renewals
        self.policy = AdmissionPolicy(Limiter(self.config.limiter), SloAdmitter(self.config.slo))
        self.book = ReplicaBook(self.config.book)
        self.feed = FleetFeed(self, self.book, lambda: self.monotonic(), resync_retry_s=self.config.resync_retry_s,
                              snapshot_timeout_s=self.config.snapshot_timeout_s)
        self.metrics = AdmissionMetrics()
        self.leading = False
        self.usage_seq = 0
        self.lease: LeaderLease | None = None  # made at start, with its buckets
        self._usage_sub: Subscription | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._warming: dict[str, float] = {}  # worker id → until when a load it was asked for counts
        self._background: set[asyncio.Task[None]] = set()
        self.warm_requests = 0
        self._slot_waiters = SlotWaiters(self.config.slot_waiters_per_key)
        self._slot_tasks: set[asyncio.Task[None]] = set()
        self._waiters_decide_now = False  # draining: each waiter is answered at once
        self.slot_waits = 0  # checks that waited for a slot of their key's concurrency limit
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        self.admitted = 0
        self.forwarded = 0  # admitted requests sent on to the router (AdmissionRequest.route)
        self.rejected: dict[str, int] = {}
        self.demand = RefusedDemand(self.config.demand_window_s)
        self.reconciled = 0
        self.takeovers = 0
        self.checkpoints = 0

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.bus.subjects
        await self.feed.start()
        await self.subscribe(s.admission_ttft, TtftObservation, self._on_ttft)
        lease, state = await admission_buckets(
            self.bus.js, s, lease_ttl_s=self.config.lease_ttl_s, replicas=self.settings.js_replicas
        )
        self.lease = LeaderLease(self, self.bus, self.config, self.instance_id, self.monotonic,
                                 self.settings.js_replicas, lease, state)
        await self.lease.step()  # lead at once when nobody does
        self._loops = [
            asyncio.create_task(self.lease.run(), name="admission-lease"),
            asyncio.create_task(self._maintenance_loop(), name="admission-maintenance"),
            asyncio.create_task(self._demand_loop(), name="admission-demand"),
        ]
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, host=self.config.metrics_host,
                                                 port=self.config.metrics_port,
                                                 before_scrape=lambda: self.metrics.open.set(len(self.policy.limiter)))
            self.metrics_port = await self._metrics_server.start()

    async def on_drain(self) -> None:
        # Checks waiting for a slot are answered while this instance still leads (a refusal,
        # unless a slot is free): unanswered, their gateways would time out and fail open.
        self._waiters_decide_now = True
        self._slot_waiters.wake_all()
        if self._slot_tasks:
            await asyncio.wait(set(self._slot_tasks))
        # Hand over at once: final checkpoint, then delete the lease so a standby's next
        # create succeeds without waiting for the TTL.
        await cancel_and_wait(self._loops)
        self._loops = []
        if self.lease is not None:
            async with self.lease.lock:
                if self.leading:
                    await self._checkpoint()
                    await self.step_down("draining")
                    await self.lease.release()
        await self.stop_endpoints()

    async def on_stop(self) -> None:
        await cancel_and_wait([*self._loops, *self._background])
        await self.feed.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "leading": self.leading,
            "admitted": self.admitted,
            "forwarded": self.forwarded,  # of those, sent on to the router by admission (one hop fewer)
            "rejected": dict(self.rejected),
            "open_reservations": len(self.policy.limiter),
            "reconciled": self.reconciled,
            "usage_seq": self.usage_seq,
            "takeovers": self.takeovers,
            "checkpoints": self.checkpoints,
            "replicas": len(self.book),
            "registry_synced": self.feed.registry_synced,
            "slo_skipped": self.policy.slo_skipped,  # admitted on quota alone, before the registry was read
            "warm_requests": self.warm_requests,  # hot-swap loads asked for after a refusal for a load's time
            "slot_waits": self.slot_waits,  # checks that waited for a slot of their key's concurrency limit
            "ttft_calibration": {t.name: self.policy.slo.calibration.factor(t.name) for t in self.policy.slo.config.tiers},
            "ttft_overhead_s": self.policy.slo.overhead(),
            "prediction_error": self.policy.prediction_errors(),  # predicted / actual TTFT per tier
            "prediction_worst": self.policy.worst_predictions(),
        }

    # ---- leading (the lease itself: leadership.LeaderLease) ----------------------------
    async def take_over(self) -> None:
        assert self.lease is not None
        s = self.bus.subjects
        checkpoint: Checkpoint | None = None
        try:
            entry = await self.lease.state.get(STATE_KEY)
            if entry.value:
                checkpoint = msgspec.msgpack.decode(entry.value, type=Checkpoint)
        except nats.js.errors.KeyNotFoundError:
            pass
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("ignoring an unreadable admission checkpoint: %s", exc)
        if checkpoint is not None:
            self.policy.limiter.restore(checkpoint.limiter, self.clock())
            self.usage_seq = checkpoint.usage_seq
            log.info("restored the limiter of %s: %d buckets, %d open reservations, USAGE at %d",
                     checkpoint.instance_id, len(checkpoint.limiter.buckets), len(checkpoint.limiter.reservations),
                     checkpoint.usage_seq)
        else:
            # Nothing to carry over: every reservation is ours from here on.
            self.usage_seq = (await self.bus.js.stream_info(s.usage_stream)).state.last_seq
        await self.follow_usage()
        await self.add_endpoint("check", s.admission_check, AdmissionRequest, self.handle_check,
                                queue_group="admission", concurrent=False)
        # Ready means the server routes to our subscriptions (no "no responders").
        await self.bus.confirm_subscriptions()
        self.leading = True
        self.takeovers += 1
        self.metrics.leader.set(1)
        self.metrics.takeovers.inc()
        log.info("%s is the admission leader", self.instance_id)

    async def follow_usage(self) -> None:
        """(Re)subscribe to USAGE from the first event not yet applied."""
        s = self.bus.subjects
        if self._usage_sub is not None:
            with contextlib.suppress(Exception):
                await self._usage_sub.unsubscribe()
            self._usage_sub = None
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.usage_seq + 1
        )
        self._usage_sub = await self.bus.js.subscribe(
            s.usage_all, stream=s.usage_stream, cb=self._on_usage, ordered_consumer=True, config=config
        )

    async def step_down(self, reason: str) -> None:
        if not self.leading:
            return
        self.leading = False
        self.metrics.leader.set(0)
        log.warning("%s stops serving admission: %s", self.instance_id, reason)
        await self.remove_endpoint("check")
        self._slot_waiters.wake_all()  # they refuse their checks: only a leader may admit
        if self._usage_sub is not None:
            with contextlib.suppress(Exception):
                await self._usage_sub.unsubscribe()
            self._usage_sub = None

    async def _checkpoint(self) -> None:
        if not self.leading or self.lease is None:
            return
        record = Checkpoint(
            instance_id=self.instance_id, usage_seq=self.usage_seq, limiter=self.policy.limiter.snapshot(self.clock())
        )
        data = msgspec.msgpack.encode(record)
        if len(data) + 1024 > self.bus.max_payload:
            log.error("admission checkpoint of %d bytes exceeds max_payload: not written", len(data))
            return
        try:
            await self.lease.state.put(STATE_KEY, data)
            self.checkpoints += 1
        except (nats.errors.Error, TimeoutError) as exc:
            # A bucket gone with a NATS restart is provisioned again by the lease loop (under
            # its lock, with the lease); the next checkpoint is stored then.
            log.warning("admission checkpoint failed: %r", exc)

    async def _demand_loop(self) -> None:
        """Tell the autoscalers what was refused for want of capacity (``RefusedDemand``)."""
        while True:
            await asyncio.sleep(self.config.demand_interval_s)
            for pool, (requests, tokens) in self.demand.reports(self.monotonic()).items():
                demand = PoolDemand(pool=pool, source=self.instance_id, requests=requests, tokens=tokens,
                                    window_s=self.demand.window_s)
                try:
                    await self.bus.publish(self.bus.subjects.autoscaler_demand, demand, trace=False)
                except Exception:  # best effort: the next report says it again
                    log.debug("demand report for %s not sent", pool, exc_info=True)

    async def _maintenance_loop(self) -> None:
        last_expire = self.monotonic()
        while True:
            await asyncio.sleep(self.config.checkpoint_interval_s)
            try:
                if self.leading:
                    await self._checkpoint()
                    if self.monotonic() - last_expire >= self.config.expire_interval_s:
                        last_expire = self.monotonic()
                        expired = self.policy.expire(self.clock())
                        if expired:
                            self._slot_waiters.wake_one(None)
                            self.metrics.expired.inc(len(expired))
                            log.info("%d reservations expired without a usage event (charged in full)", len(expired))
                self.metrics.open.set(len(self.policy.limiter))
                self.feed.request_resyncs()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("admission maintenance failed")

    # ---- feeds (registry, gauges and KV events: FleetFeed) ------------------------------
    async def _on_ttft(self, obs: TtftObservation, msg: Msg) -> None:
        if self.policy.on_ttft(obs.request_id, obs.ttft_s):
            self._export_calibration(obs.tier)

    def _export_calibration(self, tier_name: str) -> None:
        tier = self.policy.slo.tier(tier_name).name
        self.metrics.calibration.labels(tier=tier).set(self.policy.slo.calibration.factor(tier))

    async def _on_usage(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.usage_seq:
            return  # already in the restored checkpoint
        self.usage_seq = seq
        try:
            event = decode(msg.data, UsageEvent)
        except DecodeError as exc:
            log.warning("ignoring a bad usage event at USAGE %d: %s", seq, exc)
            return
        delta = self.policy.on_usage(event, self.clock())
        if delta is not None:
            self._slot_waiters.wake_one(event.key_id)
        self._export_calibration(event.tier)  # a usage event may stand in for a lost TTFT report
        if delta is None:
            outcome = "no_reservation"  # repeat, expired, or reserved by a failed predecessor
        elif event.status == "rejected":
            outcome = "released"
        else:
            outcome = "refunded" if delta >= 0 else "charged"
            self.reconciled += 1
        self.metrics.reconciled.labels(outcome=outcome).inc()

    # ---- the endpoint -----------------------------------------------------------------
    async def handle_check(self, req: AdmissionRequest, msg: Msg) -> None:
        with tracer.start_as_current_span(
            "admission.check", context=self.bus.remote_context(msg), kind=trace.SpanKind.SERVER,
            attributes={"meshserve.request_id": req.request_id, "gen_ai.request.model": req.model,
                        "meshserve.tier": req.tier},
        ) as span:
            # At the limit, or behind checks of the key that wait already (a slot a waiter was
            # woken for must not go to a check that came after it).
            if self.leading and (self._at_concurrency_limit(req) or self._queued_behind(req)):
                waiter = self._slot_waiters.join(req.key_id)
                if waiter is not None:
                    span.set_attribute("meshserve.slot_wait", True)
                    task = self.spawn(self._check_when_a_slot_frees(req, msg, waiter), name=f"slot-{req.request_id}")
                    self._slot_tasks.add(task)
                    task.add_done_callback(self._slot_tasks.discard)
                    return
                # Too many of the key's checks wait already: refused now, as at its limit.
            await self._answer(req, msg, span)

    def _at_concurrency_limit(self, req: AdmissionRequest) -> bool:
        limit = req.concurrency_limit
        return (limit is not None and limit > 0 and not self.policy.limiter.is_open(req.request_id)
                and self.policy.limiter.in_flight(req.key_id) >= limit)

    def _queued_behind(self, req: AdmissionRequest, waiter: asyncio.Event | None = None) -> bool:
        """Whether checks of ``req``'s key wait ahead of it (of ``waiter``: it is not the first)."""
        if req.concurrency_limit is None or self.policy.limiter.is_open(req.request_id):
            return False
        return self._slot_waiters.ahead_of(req.key_id, waiter)

    async def _check_when_a_slot_frees(self, req: AdmissionRequest, msg: Msg, waiter: asyncio.Event) -> None:
        """Decide ``req`` once its key has fewer requests in flight than its limit, or after
        ``slot_wait_s`` (then refused as at its limit). Other checks go on meanwhile: this
        one's answer is sent from here. An instance that stops leading meanwhile hands the
        check back refused (it may not admit: another may lead already)."""
        self.slot_waits += 1
        deadline = self.monotonic() + self.config.slot_wait_s
        try:
            while (self.leading and not self._waiters_decide_now
                   and (self._at_concurrency_limit(req) or self._queued_behind(req, waiter))):
                left = deadline - self.monotonic()
                if left <= 0:
                    break
                waiter.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wait(), left)
        finally:
            self._slot_waiters.leave(req.key_id, waiter)
        if not self.leading:
            # It may not admit (another instance may lead already) and handing the check on
            # finds nobody until the next leader takes the lease: the gateway would fail open,
            # past the key's limit. A refusal grants nothing: the client retries.
            with contextlib.suppress(Exception):
                await self.bus.respond(msg, AdmissionDecision(
                    request_id=req.request_id, admitted=False, reason="quota_requests", retry_after=1.0,
                    message="concurrency limit reached while admission changes leader; retry"))
            return
        with tracer.start_as_current_span(
            "admission.check", context=self.bus.remote_context(msg), kind=trace.SpanKind.SERVER,
            attributes={"meshserve.request_id": req.request_id, "gen_ai.request.model": req.model,
                        "meshserve.tier": req.tier, "meshserve.slot_wait": True},
        ) as span:
            try:
                await self._answer(req, msg, span)
            except MeshError as exc:
                await self.bus.respond_error(msg, exc)
            except Exception as exc:  # as the endpoint's own handler answers: never left unanswered
                log.exception("admission check %s failed", req.request_id)
                await self.bus.respond_error(msg, MeshError(f"internal error: {exc!r}"))
        limit = req.concurrency_limit
        if limit is not None and self.policy.limiter.in_flight(req.key_id) < limit:
            self._slot_waiters.wake_one(req.key_id)  # several slots freed at once (expiry): the next waiter's turn

    async def _answer(self, req: AdmissionRequest, msg: Msg, span: trace.Span) -> None:
        """Decide ``req`` and reply (forwarding it to the router when admitted)."""
        # Synchronous from here to the reply: no other check can interleave with this one.
        decision = self.decide(req)
        span.set_attribute("meshserve.admitted", decision.admitted)
        if decision.reason:
            span.set_attribute("meshserve.admission_reason", decision.reason)
        if decision.predicted_ttft is not None:
            span.set_attribute("meshserve.predicted_ttft_s", decision.predicted_ttft)
        route = forwarded_route(req, decision, self.clock())
        if route is not None:
            # The request goes on to the router from here (one hop fewer before its
            # worker); the router answers the gateway, in this span's trace.
            try:
                await self.bus.publish(self.bus.subjects.router_route, route, reply=req.placement_reply)
            except Exception:  # not forwarded: the gateway places it itself, as without a route
                log.exception("forwarding %s to the router failed", req.request_id)
            else:
                decision.forwarded = True
                self.forwarded += 1
        await self.bus.respond(msg, decision)

    def decide(self, req: AdmissionRequest) -> AdmissionDecision:
        mono = self.monotonic()
        # Before the registry is read, the book's empty pool would refuse as "no replica"
        # (a restarted admission during a NATS node's failover did, for 6 s, in the chaos soak).
        replicas = self.book.loads(req, mono) if self.feed.registry_synced else None
        tier = self.policy.slo.tier(req.tier).name
        try:
            decision, verdict = self.policy.check_verdict(req, replicas, self.clock())
        except InvalidLimits as exc:
            # The key's record is wrong, not the mesh: an error reply the gateway turns into
            # a 403 for this key, while every other key is served as before.
            self.rejected["invalid_limits"] = self.rejected.get("invalid_limits", 0) + 1
            self.metrics.decisions.labels(tier=tier, outcome="invalid_limits").inc()
            raise MeshError(f"key {req.org}/{req.key_id} has an invalid limit: {exc}; recreate the key",
                            code=ErrorCode.FORBIDDEN) from exc
        if not decision.admitted and decision.reason == "no_capacity" and req.regions:
            decision.message = f"{decision.message} in region {', '.join(req.regions)} (the key's regions)"
        if decision.admitted:
            self.admitted += 1
            self.metrics.decisions.labels(tier=tier, outcome="admitted").inc()
            if decision.predicted_ttft is not None:
                self.metrics.predicted_ttft.labels(tier=tier).observe(decision.predicted_ttft)
            if verdict is not None and verdict.worker_id is not None:
                cached = next((r.cached_tokens for r in replicas or () if r.worker_id == verdict.worker_id), 0)
                self.book.note_admitted(req.request_id, verdict.worker_id, max(req.prompt_tokens - cached, 0), mono)
        else:
            reason = decision.reason or "unknown"
            # Demand the autoscaler answers with replicas; not a key's residency with no
            # replica left in its regions (the autoscaler sizes pools, not regions).
            if reason in CAPACITY_REASONS and not (req.regions and not replicas):
                self.demand.record(req.model, req.prompt_tokens, mono)
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            self.metrics.decisions.labels(tier=tier, outcome=reason).inc()
            if verdict is not None and verdict.worker_id is not None:
                self._warm_if_cold(req, verdict.worker_id, replicas or [], mono)
        return decision

    def _warm_if_cold(self, req: AdmissionRequest, refused_on: str, replicas: list[ReplicaLoad], mono: float) -> None:
        """Refused for a hot-swap model's load time: have the replica the router would
        load it on (room first, no busy or pinned model in the way) load it now, so the
        client's retry after Retry-After finds it loading or resident, rather than every
        request for a quiet model being refused while nothing ever loads it. Nothing when
        a load is under way already, or the best replica needed none (a queue refusal)."""
        best = next((r for r in replicas if r.worker_id == refused_on), None)
        pool = self.book.pool(req.model)
        if best is None or best.load_s <= 0 or pool is None:
            return
        entries = allowed(list(pool), req.regions)  # never a load where the key may not run
        home = [w for w in entries if region_of(w) == req.region]
        entries = home if req.region and home else entries  # its own region's hosts first
        if any(residency(w) == "loading" for w in entries) or any(
                self._warming.get(w.worker_id, -math.inf) > mono for w in entries):
            return
        costs = swap_costs(entries, self.book, [])
        open_ = {wid: c for wid, c in costs.costs.items() if wid not in costs.blocked}
        if not open_:
            return
        worker_id = min(open_, key=lambda wid: (open_[wid], wid))
        self._warming[worker_id] = mono + max(best.load_s, 1.0)
        self.warm_requests += 1

        async def load() -> None:
            with contextlib.suppress(Exception):
                await self.bus.request(self.bus.subjects.worker_control(worker_id), ControlCommand(command="load"),
                                       ControlReply, timeout=2.0)

        task = asyncio.create_task(load(), name=f"warm-{worker_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)


__all__ = ["AdmissionService"]
