"""The autoscaler service: the control law of ``control.py`` wired to the mesh.

Every tick (1 s by default) and for every configured pool (a model), it:

1. reaps what the driver reports as ended and writes off launches that never showed up;
2. moves drains along: a drained worker that deregistered is handed to
   ``driver.stopped``; one whose acknowledged drain outlived ``drain timeout + grace``
   is force-stopped (``driver.stop``) and then handed over; a drain the worker never
   acknowledged is never followed by a kill;
3. builds the pool's ``PoolObservation`` from the shared fleet view: the latest gauge of
   every worker in the registry (draining ones included, gauges of workers gone from the
   registry dropped, stale ones ignored), ``starting`` = replicas the driver launched that have not
   reported a gauge yet, and the pending-demand counter (below);
4. asks the pool's ``PoolController`` for a ``ScaleDecision`` and acts on it: scale up →
   ``driver.start(pool, count)``; scale down → ``ControlCommand(drain)`` to the worker
   the law chose, request-reply on ``mesh.worker.<id>.control``. The worker refuses new
   work (the router skips draining workers), finishes its requests, deregisters and
   exits; nothing is killed to scale down.

Pending demand: load a pool's queues do not show. Admission publishes, per pool, what it
refused for want of capacity (its SLO, no replica) over the last few seconds
(``PoolDemand`` on ``mesh.autoscaler.demand``; quota refusals are not demand): its
shedding keeps the queues short, so without it a pool refusing half its traffic read
"at target". Its requests count as pending (a pool with none brings a replica back) and
its prompt tokens as waiting load. Each source's report holds for ``pending_ttl_s``, the
latest per source wins and sources add up (``report_pending``).

``mesh.autoscaler.status`` answers ``AutoscalerStatusRequest`` with an
``AutoscalerStatus`` (``meshserve status`` prints it). Prometheus metrics live in the
service's own registry, served on ``--metrics-port`` when given.

The pure parts (``control.py``'s law; ``tracking.py``'s ``LaunchTracker``,
``PendingDemand``, ``DecisionLog``) take the clock as an argument; the shell reads it
from the injected ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge

from bus import BusSettings, Service, cancel_and_wait
from bus.metrics import MetricsServer
from proto.autoscaler import (
    AutoscalerStatus,
    AutoscalerStatusRequest,
    DecisionRecord,
    DrainView,
    DriverInfo,
    PoolStatus,
    WorkerView,
)
from proto.errors import MeshError, RemoteError
from proto.messages import ControlCommand, ControlReply, PoolDemand
from proto.workers import WorkerGauge, WorkerInfo
from services.common.feed import FleetFeed
from services.common.fleet import FleetView

from .control import PoolController, PoolObservation, PoolPolicy, ScaleDecision
from .drivers import Driver, DriverError, Launch, WorkerRef
from .tracking import DecisionLog, LaunchTracker, PendingDemand, to_signals

log = logging.getLogger(__name__)


# =========================================================================== configuration


@dataclass(frozen=True)
class AutoscalerConfig:
    pools: tuple[PoolPolicy, ...]
    tick_s: float = 1.0
    drain_timeout_s: float = 120.0  # what a drained worker gets to finish its requests
    drain_grace_s: float = 15.0  # beyond the drain timeout before a forced stop
    start_timeout_s: float = 600.0  # a launch with no gauge by then is written off (cold starts: minutes)
    gauge_stale_s: float = 15.0  # an older gauge is not evidence of a live replica
    # No decision before gauges had time to arrive: a (re)started autoscaler that has not
    # heard its replicas yet would see an empty pool and start replicas it does not need.
    warmup_s: float = 3.0
    control_timeout_s: float = 3.0  # the drain command's request-reply
    history: int = 50  # decisions kept per pool
    pending_ttl_s: float = 10.0
    start_backoff_s: float = 2.0  # after a failed start, doubling up to start_backoff_max_s
    start_backoff_max_s: float = 60.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no HTTP endpoint (the registry still counts)

    def __post_init__(self) -> None:
        names = [p.pool for p in self.pools]
        if not names:
            raise ValueError("the autoscaler needs at least one pool")
        if len(set(names)) != len(names):
            raise ValueError("a pool is configured twice")
        if self.tick_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("tick and drain timeout must be positive")


# =========================================================================== metrics


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("meshserve:autoscaler_replicas_desired", "Replicas the controller holds the pool at", ["pool"], registry=r)
        self.current = Gauge("meshserve:autoscaler_replicas_current", "Ready plus starting replicas", ["pool"], registry=r)
        self.ready = Gauge("meshserve:autoscaler_replicas_ready", "Replicas reporting gauges, not draining", ["pool"], registry=r)
        self.starting = Gauge("meshserve:autoscaler_replicas_starting", "Launched, no gauge yet", ["pool"], registry=r)
        self.draining = Gauge("meshserve:autoscaler_replicas_draining", "Replicas draining", ["pool"], registry=r)
        self.target = Gauge("meshserve:autoscaler_replicas_target", "The law's instantaneous target", ["pool"], registry=r)
        self.load = Gauge("meshserve:autoscaler_load_tokens", "Waiting plus running tokens", ["pool"], registry=r)
        self.capacity = Gauge("meshserve:autoscaler_replica_token_capacity", "Measured tokens per replica", ["pool"], registry=r)
        self.pending = Gauge("meshserve:autoscaler_pending_requests", "Requests waiting for a pool with no replica", ["pool"], registry=r)
        self.decisions = Counter("meshserve:autoscaler_decisions_total", "Decisions by action", ["pool", "action"], registry=r)
        self.drains = Counter("meshserve:autoscaler_drains_total", "Scale-down drains by outcome", ["pool", "outcome"], registry=r)
        self.driver_errors = Counter(
            "meshserve:autoscaler_driver_errors_total", "Driver failures by reason", ["driver", "reason"], registry=r
        )
        self.ticks = Counter("meshserve:autoscaler_ticks_total", "Control ticks run", registry=r)

    def observe(self, d: ScaleDecision, pending: int) -> None:
        pool = d.pool
        self.desired.labels(pool=pool).set(d.desired)
        self.current.labels(pool=pool).set(d.current)
        self.ready.labels(pool=pool).set(d.ready)
        self.starting.labels(pool=pool).set(d.signals.starting)
        self.draining.labels(pool=pool).set(d.signals.draining)
        self.target.labels(pool=pool).set(d.target)
        self.load.labels(pool=pool).set(d.signals.waiting_tokens + d.signals.running_tokens)
        self.capacity.labels(pool=pool).set(d.signals.replica_token_capacity)
        self.pending.labels(pool=pool).set(pending)
        self.decisions.labels(pool=pool, action=d.action).inc()


# =========================================================================== the shell


@dataclass
class _Drain:
    ref: WorkerRef
    issued_at: float
    deadline: float
    acknowledged: bool = False
    in_flight: int = 0
    forced: bool = False


@dataclass
class _PoolRuntime:
    controller: PoolController
    log: DecisionLog
    starts_in_flight: int = 0
    backoff_until: float = 0.0
    backoff_s: float = 0.0
    drains: dict[str, _Drain] = field(default_factory=dict)
    last_pending: int = 0


class AutoscalerService(Service):
    name = "autoscaler"
    description = "meshserve autoscaler: per-pool control law, drains, drivers"

    def __init__(
        self,
        config: AutoscalerConfig,
        driver: Driver,
        settings: BusSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        instance_id: str | None = None,
    ) -> None:
        # On SIGTERM the runner waits this long for starts and drain commands in flight;
        # the local driver's drain of its workers (on_stop) has its own bound.
        super().__init__(settings, instance_id=instance_id, drain_timeout_s=30.0)
        self.config = config
        self.driver = driver
        self.clock = clock
        self.metrics = AutoscalerMetrics()
        self.pools: dict[str, _PoolRuntime] = {
            p.pool: _PoolRuntime(PoolController(p), DecisionLog(config.history)) for p in config.pools
        }
        self.launches = LaunchTracker(config.start_timeout_s)
        self.pending = PendingDemand(config.pending_ttl_s)
        # Registry entries and each worker's latest gauge (reordered ones dropped, those of
        # workers the registry does not list ignored): the fleet view router and admission read.
        self.view = FleetView()
        self.feed = FleetFeed(self, self.view, lambda: self.clock(), kv_events=False, on_registry=self._on_registry_change)
        self.retired: set[str] = set()  # force-stopped: ignored until they leave the registry
        self._tick_task: asyncio.Task[None] | None = None
        self._listening_since: float | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        driver.pools = tuple(self.pools)
        driver.on_error(lambda name, reason, _msg: self.metrics.driver_errors.labels(driver=name, reason=reason).inc())

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        await self.driver.open()  # before the first tick: workers an earlier run started are managed
        await self.feed.start()
        self._listening_since = self.clock()
        await self.add_endpoint("status", self.bus.subjects.autoscaler_status, AutoscalerStatusRequest, self.handle_status)
        await self.bus.subscribe(self.bus.subjects.autoscaler_demand, PoolDemand, self.handle_demand)
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, host=self.config.metrics_host, port=self.config.metrics_port)
            self.metrics_port = await self._metrics_server.start()
        self._tick_task = asyncio.create_task(self._tick_loop(), name="autoscaler-tick")

    async def on_drain(self) -> None:
        # Stop deciding first: a scale-down begun now would outlive us unattended.
        if self._tick_task is not None:
            await cancel_and_wait([self._tick_task])
        await self.stop_endpoints()

    async def on_stop(self) -> None:
        await self.driver.close()
        await self.feed.stop()
        if self._metrics_server is not None:
            await self._metrics_server.stop()

    def stats(self) -> dict[str, object]:
        return {
            "pools": {name: rt.log.latest.desired if rt.log.latest else None for name, rt in self.pools.items()},
            "driver": self.driver.name,
            "driver_ok": self.driver.status().ok,
        }

    # ---- inputs -----------------------------------------------------------------------
    def _on_registry_change(self, worker_id: str, info: WorkerInfo | None) -> None:
        if info is None:
            self.retired.discard(worker_id)
            self.launches.forget(worker_id)

    def report_pending(self, pool: str, requests: int, tokens: int = 0, source: str = "") -> None:
        """Demand ``pool``'s queues do not show (see the module doc)."""
        self.pending.report(pool, requests, tokens, self.clock(), source)

    async def handle_demand(self, demand: PoolDemand, msg: Msg) -> None:
        """Admission's refusals for want of capacity: pending demand of its pool."""
        if demand.pool in self.pools:
            self.report_pending(demand.pool, demand.requests, demand.tokens, f"admission:{demand.source}")

    def pool_gauges(self, pool: str, now: float) -> list[WorkerGauge]:
        """The latest fresh gauge of every registered worker of ``pool`` (draining too)
        that takes requests: prefill workers (P/D split) are a set the law does not size."""
        members = self.view.pool(pool)
        out = []
        for w in members if members is not None else ():
            gauge, info = w.gauge, w.info
            if gauge is None or info is None or w.worker_id in self.retired or info.role == "prefill":
                continue
            if now - w.gauge_received_at > self.config.gauge_stale_s:
                continue
            if info.state == "draining" and not gauge.draining:
                gauge = msgspec.structs.replace(gauge, draining=True)  # the registry heard it first
            out.append(gauge)
        return out

    # ---- the tick ---------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad tick must not end autoscaling
                log.exception("autoscaler tick failed")
            await asyncio.sleep(max(0.0, self.config.tick_s - (time.monotonic() - started)))

    async def tick(self) -> None:
        now = self.clock()
        self.metrics.ticks.inc()
        try:
            ended = await self.driver.reap()
        except DriverError:
            ended = []
        for ticket in self.launches.ended(ended):
            log.warning("launched worker %s of %s exited before reporting", ticket.worker_id, ticket.pool)
        for ticket in self.launches.expire(now):
            self.driver.fail(
                "start_timeout",
                f"a {ticket.pool} replica launched {now - ticket.at:,.0f}s ago never reported a gauge",
                blocking=False,
            )
        await self._progress_drains(now)
        if self._listening_since is None or now - self._listening_since < self.config.warmup_s:
            return
        workers = self.feed.workers
        managed = self.driver.managed()
        for pool, rt in self.pools.items():
            gauges = self.pool_gauges(pool, now)
            self.launches.observe(pool, (g.worker_id for g in gauges))
            pending_requests, pending_tokens = self.pending.get(pool, now)
            rt.last_pending = pending_requests
            observation = PoolObservation(
                gauges=gauges,
                starting=self.launches.starting(pool) + rt.starts_in_flight,
                pending_requests=pending_requests,
                pending_tokens=pending_tokens,
                # Lets the law tell a replica at its limit from one whose new arrival
                # waits for the next step (gauges go out as requests arrive).
                max_num_seqs={g.worker_id: workers[g.worker_id].max_num_seqs for g in gauges
                              if g.worker_id in workers and workers[g.worker_id].max_num_seqs > 0},
                unmanaged=frozenset(g.worker_id for g in gauges if g.worker_id not in managed)
                if self.driver.knows_its_workers else frozenset(),
            )
            decision = rt.controller.decide(observation, now)
            record = rt.log.add(decision)
            self.metrics.observe(decision, pending_requests)
            if decision.action != "hold":
                log.info("%s: %s", pool, decision.reason)
            self._act(pool, rt, decision, record, now)

    def _act(self, pool: str, rt: _PoolRuntime, decision: ScaleDecision, record: DecisionRecord | None, now: float) -> None:
        if decision.action == "scale_up" and decision.count > 0:
            if now < rt.backoff_until:
                if record is not None:
                    record.outcome = f"not started: driver backing off {rt.backoff_until - now:,.0f}s ({self.driver.status().message})"
                return
            rt.starts_in_flight += decision.count
            self.spawn(self._start(pool, rt, decision.count, record), name=f"start-{pool}")
        elif decision.action == "scale_down" and decision.drain_worker:
            self.spawn(self._drain(pool, rt, decision.drain_worker, decision.reason, record), name=f"drain-{pool}")

    async def _start(self, pool: str, rt: _PoolRuntime, count: int, record: DecisionRecord | None) -> None:
        launch = Launch(0)
        try:
            launch = await self.driver.start(pool, count)
            outcome = f"started {launch.count}" + (f" ({', '.join(launch.worker_ids)})" if launch.worker_ids else "")
            if launch.count < count:
                outcome += f" of {count}: {self.driver.status().message}"
        except DriverError as exc:
            outcome = f"not started: {exc.message}"
        except Exception as exc:  # a driver bug is a failed start, not a dead autoscaler
            log.exception("driver start failed")
            outcome = f"not started: {self.driver.fail('internal', repr(exc)).message}"
        finally:
            rt.starts_in_flight -= count
        self.launches.launched(pool, launch.count, self.clock(), launch.worker_ids)
        if launch.count < count:
            rt.backoff_s = min(self.config.start_backoff_max_s, rt.backoff_s * 2 if rt.backoff_s else self.config.start_backoff_s)
            rt.backoff_until = self.clock() + rt.backoff_s
        else:
            rt.backoff_s = 0.0
        if record is not None:
            record.outcome = outcome
        log.info("%s: %s", pool, outcome)

    async def _drain(self, pool: str, rt: _PoolRuntime, worker_id: str, reason: str, record: DecisionRecord | None) -> None:
        info = self.feed.workers.get(worker_id)
        ref = WorkerRef(worker_id, pool, host=info.host if info else "", pid=info.pid if info else 0)
        now = self.clock()
        drain = _Drain(ref, now, now + self.config.drain_timeout_s + self.config.drain_grace_s)
        rt.drains[worker_id] = drain
        command = ControlCommand(command="drain", timeout_s=self.config.drain_timeout_s, reason=reason[:500])
        try:
            reply = await self.bus.request(
                self.bus.subjects.worker_control(worker_id), command, ControlReply, timeout=self.config.control_timeout_s
            )
        except (MeshError, RemoteError) as exc:
            # Unacknowledged: never followed by a kill. If the worker did get it, its gauge
            # shows draining and the drain is tracked from there; else the law writes the
            # drain off after its ack timeout and decides again.
            outcome = f"drain of {worker_id} not acknowledged: {exc}"
            self.metrics.drains.labels(pool=pool, outcome="unacknowledged").inc()
        else:
            drain.acknowledged = True
            drain.in_flight = reply.in_flight
            outcome = f"drain sent to {worker_id} ({reply.in_flight} in flight, state {reply.state})"
        if record is not None:
            record.outcome = outcome
        log.info("%s: %s", pool, outcome)

    async def _progress_drains(self, now: float) -> None:
        workers = self.feed.workers
        for pool, rt in self.pools.items():
            for worker_id, drain in list(rt.drains.items()):
                w = self.view.worker(worker_id)
                if not drain.acknowledged and w is not None and w.gauge is not None and w.gauge.draining:
                    drain.acknowledged = True  # the reply was lost, the command was not
                if worker_id not in workers:
                    # Deregistered: its requests are done. Let the driver release it.
                    del rt.drains[worker_id]
                    self.metrics.drains.labels(pool=pool, outcome="forced" if drain.forced else "finished").inc()
                    await self._stopped(drain.ref)
                    continue
                if not drain.acknowledged:
                    if now - drain.issued_at > rt.controller.policy.drain_ack_timeout_s:
                        del rt.drains[worker_id]  # the law has written it off too
                    continue
                if now >= drain.deadline and not drain.forced:
                    # The worker ended its own requests at its drain timeout; still being
                    # here after the grace means it is hung. Nothing is aborted by this.
                    log.warning("%s: drain of %s outlived %.0fs: forcing a stop", pool, worker_id, now - drain.issued_at)
                    drain.forced = True
                    self.retired.add(worker_id)
                    with contextlib.suppress(DriverError):
                        await self.driver.stop(drain.ref)
                    del rt.drains[worker_id]
                    self.metrics.drains.labels(pool=pool, outcome="forced").inc()
                    await self._stopped(drain.ref)

    async def _stopped(self, ref: WorkerRef) -> None:
        try:
            await self.driver.stopped(ref)
        except DriverError:
            pass  # counted and shown by the driver
        except Exception as exc:
            log.exception("driver stopped() failed")
            self.driver.fail("internal", repr(exc))

    # ---- status -----------------------------------------------------------------------
    async def handle_status(self, request: AutoscalerStatusRequest, msg: Msg) -> None:
        await self.bus.respond(msg, self.status(request))

    def status(self, request: AutoscalerStatusRequest | None = None) -> AutoscalerStatus:
        request = request or AutoscalerStatusRequest()
        now = self.clock()
        ds = self.driver.status()
        pools = []
        for name, rt in self.pools.items():
            if request.pool and request.pool != name:
                continue
            policy = rt.controller.policy
            latest = rt.log.latest
            count = max(0, request.decisions)
            pools.append(PoolStatus(
                pool=name,
                min_replicas=policy.min_replicas,
                max_replicas=policy.max_replicas,
                current=latest.current if latest else 0,
                desired=latest.desired if latest else 0,
                ready=latest.ready if latest else 0,
                starting=latest.signals.starting if latest else 0,
                draining=latest.signals.draining if latest else 0,
                pending_requests=rt.last_pending,
                signals=to_signals(latest) if latest else None,
                last_reason=latest.reason if latest else f"warming up: no decision in the first {self.config.warmup_s:g} s",
                workers=self._worker_views(name, now),
                drains=[DrainView(worker_id=d.ref.worker_id, issued_at=d.issued_at, deadline=d.deadline,
                                  in_flight=d.in_flight, acknowledged=d.acknowledged) for d in rt.drains.values()],
                decisions=list(rt.log.records)[-count:] if count else [],
            ))
        return AutoscalerStatus(
            instance_id=self.instance_id,
            at=now,
            tick_s=self.config.tick_s,
            driver=DriverInfo(name=self.driver.name, ok=ds.ok, message=ds.message, errors=dict(ds.errors),
                              last_error=ds.last_error, last_error_at=ds.last_error_at),
            pools=pools,
        )

    def _worker_views(self, pool: str, now: float) -> list[WorkerView]:
        workers = self.feed.workers
        managed = self.driver.managed()
        views = []
        for worker_id, info in sorted(workers.items()):
            if info.model != pool:
                continue
            w = self.view.worker(worker_id)
            g = w.gauge if w is not None else None
            views.append(WorkerView(
                worker_id=worker_id,
                region=info.region,
                # a hot-swap entry that is ready but not resident says so: loading, cold, evicting
                state="retired" if worker_id in self.retired else (
                    g.residency if g is not None and info.state == "ready" and g.residency not in ("", "resident")
                    else info.state),
                running=g.running if g else 0,
                waiting=g.waiting if g else 0,
                running_tokens=g.running_tokens if g else 0,
                queued_prefill_tokens=g.queued_prefill_tokens if g else 0,
                kv_usage=g.kv_usage if g else 0.0,
                gauge_age_s=(now - w.gauge_received_at) if w is not None and g is not None else None,
                managed=worker_id in managed,
            ))
        return views
