"""The gateway's client for the services upstream of it: admission, router and worker.

``admit`` asks admission (``mesh.admission.check``), ``place`` asks the router
(``mesh.router.route``, which forwards the request to the chosen worker), ``cancel``
tells the serving worker to stop. While no router is subscribed, ``place`` falls back to
placing directly on a ready worker of the model from the registry, so a mesh without a
router still serves; when admission is unreachable the gateway fails open for a grace
window, then closed (configurable), and counts every such decision.

Admit and place in one trip: ``admit`` given the route request asks admission to send
it on to the router itself when it admits (``AdmissionRequest.route``), and the router's
``Placement`` comes to this gateway's ``mesh.placed.<gateway>.<request>`` subject, where
``placed`` waits for it: the request reaches its worker without first coming back to
the gateway. Asked only once a router has answered this gateway (a mesh without one
gets ``NoResponders`` on the direct path, which a forward cannot report); a forward that
gets no placement by the deadline is handled as a silent router (below). A placement
that arrives when nobody waits for it any more (the client went away, or admission
answered past the gateway's timeout and the gateway placed the request itself) goes to
``on_late_placement``.

Each placement carries a deadline (``GenerateRequest.place_by``, the route timeout from
now) and its own try id (``GenerateRequest.attempt``, increasing): a copy its placer gave
up on is cancelled as ``superseded`` by that id, so the worker refuses that try only and
takes a later one of the same segment (a migration that waited for a paused worker).
Past the deadline the router forwards nothing and no worker takes the request. So when a
router does not answer in time (stalled, paused), the request is either on the worker
it was forwarded to, which holds it (its chunks arrived, or a probe finds it), or on no
worker and never will be: the gateway adopts that worker, or places the request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import Bus
from bus.registry import WorkerRegistry
from proto import (
    SUPERSEDED,
    AdmissionDecision,
    AdmissionRequest,
    CancelRequest,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    MeshError,
    NoResponders,
    Placement,
    RemoteError,
    RequestProbe,
    RequestProbeReply,
    RequestTimeout,
    RouteRequest,
)
from proto.errors import NO_CAPACITY_RETRY_AFTER_S
from proto.subjects import unescape_token

from .errors import from_mesh_error

log = logging.getLogger(__name__)


# A worker's answers that mean "not me, try another": nothing started there.
DIRECT_REFUSALS = frozenset({ErrorCode.DRAINING, ErrorCode.OVERLOADED, ErrorCode.TIMEOUT})


def no_capacity(message: str) -> RemoteError:
    """Placement's "no capacity" with its Retry-After, as the router's error reply reads."""
    return RemoteError(message, code=ErrorCode.NO_CAPACITY, retry_after=NO_CAPACITY_RETRY_AFTER_S)


def pick_holder(probes: Sequence[RequestProbeReply]) -> tuple[str, list[str]]:
    """Of the workers' answers to a probe for one request, the worker to adopt ("" when
    none holds it) and any others holding it too (stale copies, to stop): one that has
    streamed output before one still waiting, then by id (every gateway picks the same)."""
    holders = sorted((p for p in probes if p.state != "unknown"), key=lambda p: (p.state != "running", p.worker_id))
    if not holders:
        return "", []
    return holders[0].worker_id, [p.worker_id for p in holders[1:]]


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    admission_timeout_s: float = 1.0
    route_timeout_s: float = 5.0
    # "open": admit when admission is unreachable; "closed": reject; "grace": open for
    # grace_s after admission was last seen, then closed.
    admission_unreachable: str = "grace"
    admission_grace_s: float = 30.0
    # "admission": an admitted request goes on from admission to the router (one hop fewer
    # before its worker); "gateway": admission answers, then the gateway asks the router.
    placement_path: str = "admission"

    def __post_init__(self) -> None:
        if self.placement_path not in ("admission", "gateway"):
            raise ValueError(f"placement_path must be 'admission' or 'gateway', not {self.placement_path!r}")


class UpstreamClient:
    def __init__(
        self, bus: Bus, registry: WorkerRegistry, config: UpstreamConfig | None = None,
        clock: Callable[[], float] = time.monotonic, on_unreachable: Callable[[str], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        gateway_id: str = "", on_late_placement: Callable[[Placement], None] | None = None,
    ) -> None:
        self.bus = bus
        self.gateway_id = gateway_id  # "" : admission is never asked to forward (no placement inbox)
        self.on_late_placement = on_late_placement
        self.registry = registry
        self.config = config or UpstreamConfig()
        self.clock = clock
        self.wall_clock = wall_clock  # placement deadlines (``place_by``) are epoch seconds
        self.on_unreachable = on_unreachable  # told "open" or "closed" for each decision made without admission
        self._admission_seen_at = clock()
        self._round_robin = itertools.count()
        self.admission_fail_open = 0
        self.admission_fail_closed = 0
        self.direct_placements = 0
        self.router_timeouts = 0  # placements the router did not answer in time
        self.adopted_placements = 0  # of those, requests found on a worker (the others were placed directly)
        self.forwarded_placements = 0  # placed by a router that admission forwarded the request to
        self.late_placements = 0  # placements that came when nobody waited for them
        # Whether a router has answered a placement lately: only then is admission asked to
        # forward (a forward to no router would wait out the deadline; the direct path is told at once).
        self.router_seen = False
        self._placements: dict[str, tuple[asyncio.Future[Msg], RouteRequest]] = {}
        self._placement_sub: Subscription | None = None
        self._attempt = 0  # the last placement try's id (GenerateRequest.attempt)

    async def start(self) -> None:
        """Subscribe to this gateway's placements (forwarded requests' router replies)."""
        if self.gateway_id:
            self._placement_sub = await self.bus.nc.subscribe(
                self.bus.subjects.placements_of_gateway(self.gateway_id), cb=self._on_placement)

    async def stop(self) -> None:
        if self._placement_sub is not None:
            with contextlib.suppress(Exception):
                await self._placement_sub.unsubscribe()
            self._placement_sub = None

    async def _on_placement(self, msg: Msg) -> None:
        request_id = unescape_token(msg.subject.rsplit(".", 1)[-1])
        waiting = self._placements.get(request_id)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(msg)
            return
        self._late(request_id, msg)

    def abandon(self, request_id: str) -> None:
        """Nobody will wait for this forwarded request's placement (its client left during
        admission): one that comes, or came already unread, is a late one (its copy stopped)."""
        waiting = self._placements.pop(request_id, None)
        if waiting is not None and waiting[0].done() and not waiting[0].cancelled():
            self._late(request_id, waiting[0].result())

    def _late(self, request_id: str, msg: Msg) -> None:
        self.late_placements += 1
        try:
            placement = self.bus.decode_reply(msg, Placement)
        except MeshError:
            return  # an error reply: nothing runs anywhere
        log.warning("placement of %s on %s came when nobody waited for it", request_id, placement.worker_id)
        if self.on_late_placement is not None:
            self.on_late_placement(placement)

    async def admit(self, request: AdmissionRequest, route: RouteRequest | None = None) -> AdmissionDecision:
        """Admission's decision on ``request``. With ``route`` (and a router seen), admission
        is asked to send it on to the router when it admits: then ``decision.forwarded``
        is set and ``placed`` returns its placement. ``route`` need not carry the block
        hashes: admission adds the admission request's own."""
        if (route is not None and self.router_seen and self._placement_sub is not None
                and self.config.placement_path == "admission"):
            route = msgspec.structs.replace(route, request=self._with_deadline(route.request))
            request_id = route.request.request_id
            self._placements[request_id] = (asyncio.get_running_loop().create_future(), route)
            # Past half the wait admission no longer forwards: its answer could come after the
            # gateway has given up on it and placed the request itself.
            request = msgspec.structs.replace(
                request, route=route,
                placement_reply=self.bus.subjects.placement(self.gateway_id, request_id),
                forward_by=self.wall_clock() + self.config.admission_timeout_s / 2,
            )
        decision: AdmissionDecision | None = None
        try:
            decision = await self._admit(request)
        finally:
            if decision is None or not decision.forwarded:
                self._placements.pop(request.request_id, None)
        return decision

    async def _admit(self, request: AdmissionRequest) -> AdmissionDecision:
        try:
            decision = await self.bus.request(
                self.bus.subjects.admission_check, request, AdmissionDecision, timeout=self.config.admission_timeout_s
            )
        except (NoResponders, RequestTimeout) as exc:
            return self._admission_unreachable(request, exc)
        except RemoteError as exc:
            # Admission answered with an error: one that is the client's (a key whose stored
            # limits no bucket can hold is "forbidden") goes back as its 4xx, never a 500.
            self._admission_seen_at = self.clock()
            error = from_mesh_error(str(exc.code), exc.message, exc.retry_after)
            if error.status >= 500:
                raise  # our fault: the gateway's generic 500, no internals in the reply
            raise error from exc
        self._admission_seen_at = self.clock()
        return decision

    async def placed(self, request_id: str, *, arrived_from: Callable[[], str] | None = None) -> Placement:
        """The placement of a request admission forwarded (``decision.forwarded``): the
        router's answer, or, none by the request's deadline, what ``place`` does for a
        router that stays silent."""
        future, route = self._placements[request_id]
        try:
            msg = await asyncio.wait_for(future, timeout=max(route.request.place_by - self.wall_clock(), 0.0))
        except TimeoutError:
            self.router_seen = False  # the next requests go by the direct path, which hears "no router" at once
            return await self._after_silent_router(route, arrived_from)
        finally:
            self._placements.pop(request_id, None)
        placement = self.bus.decode_reply(msg, Placement)
        self.forwarded_placements += 1
        return placement

    def _admission_unreachable(self, request: AdmissionRequest, exc: MeshError) -> AdmissionDecision:
        mode = self.config.admission_unreachable
        within_grace = self.clock() - self._admission_seen_at <= self.config.admission_grace_s
        if mode == "open" or (mode == "grace" and within_grace):
            self.admission_fail_open += 1
            if self.on_unreachable is not None:
                self.on_unreachable("open")
            return AdmissionDecision(request_id=request.request_id, admitted=True, message=f"admission unreachable ({exc.code}); failing open")
        self.admission_fail_closed += 1
        if self.on_unreachable is not None:
            self.on_unreachable("closed")
        return AdmissionDecision(
            request_id=request.request_id, admitted=False, reason="no_capacity", retry_after=5.0,
            message="admission service unreachable; failing closed",
        )

    def _with_deadline(self, request: GenerateRequest) -> GenerateRequest:
        """``request`` as one new placement try: its deadline and its try id."""
        now = self.wall_clock()
        # Increasing here, and unlike another gateway's (one a client resumed on): the wall
        # clock in microseconds. A worker takes a later try of a segment over an earlier one.
        self._attempt = max(self._attempt + 1, int(now * 1e6))
        return msgspec.structs.replace(request, place_by=now + self.config.route_timeout_s, attempt=self._attempt)

    async def place(self, route: RouteRequest, *, arrived_from: Callable[[], str] | None = None) -> Placement:
        """Place ``route.request``. ``arrived_from``: the worker whose chunks for it already
        arrived, if any (adopted when the router does not answer in time)."""
        route = msgspec.structs.replace(route, request=self._with_deadline(route.request))
        try:
            placement = await self.bus.request(self.bus.subjects.router_route, route, Placement,
                                               timeout=self.config.route_timeout_s)
        except NoResponders:
            self.router_seen = False
            return await self._place_directly(route)
        except RequestTimeout:
            return await self._after_silent_router(route, arrived_from)
        except RemoteError:
            self.router_seen = True  # it answered, with an error for this request
            raise
        self.router_seen = True
        return placement

    async def _after_silent_router(self, route: RouteRequest, arrived_from: Callable[[], str] | None) -> Placement:
        """The router did not answer by the request's deadline: adopt the worker holding
        the request, or (none took it, and none will) place it directly."""
        request = route.request
        self.router_timeouts += 1
        # The deadline is on the wall clock the router and workers read, the wait was not.
        if (left := request.place_by - self.wall_clock()) > 0:
            await asyncio.sleep(left)
        worker_id = arrived_from() if arrived_from is not None else ""
        if not worker_id:
            candidates = [w for w in self.registry.workers if w not in route.exclude_workers]
            probes = await asyncio.gather(*(
                self.probe(w, request.request_id, timeout_s=min(1.0, self.config.route_timeout_s)) for w in candidates
            ))
            answers = {p.worker_id: p for p in probes if p is not None}
            worker_id, others = pick_holder(list(answers.values()))
            for other in others:  # cannot happen unless a forward timed out and its cancel is late
                await self.cancel(other, request.request_id, SUPERSEDED, migrations=request.migrations,
                                  attempt=answers[other].attempt)
        if worker_id:
            log.warning("router gave no placement for %s in %.1fs; %s holds it", request.request_id,
                        self.config.route_timeout_s, worker_id)
            self.adopted_placements += 1
            info = self.registry.workers.get(worker_id)
            return Placement(request_id=request.request_id, worker_id=worker_id,
                             model=info.model if info is not None else request.model, policy="adopted")
        log.warning("router gave no placement for %s in %.1fs and no worker holds it; placing it directly",
                    request.request_id, self.config.route_timeout_s)
        return await self._place_directly(route)

    async def _place_directly(self, route: RouteRequest) -> Placement:
        """No router: round robin over ready workers, skipping one that refuses."""
        request = route.request
        candidates = [w for w in self.registry.ready_workers(request.model) if w.worker_id not in route.exclude_workers]
        # A prefill worker (P/D split) serves a request only when nothing else can.
        candidates = [w for w in candidates if w.role != "prefill"] or candidates
        if request.regions:  # data residency: never outside the key's regions
            candidates = [w for w in candidates if w.region in request.regions]
        if request.region:  # its own region first (a request with none: everybody's local)
            candidates = [w for w in candidates if w.region == request.region] or candidates
        if not candidates:
            where = f" in region {', '.join(request.regions)}" if request.regions else ""
            raise no_capacity(f"no ready worker serves model {request.model!r}{where}")
        start = next(self._round_robin)
        last: MeshError | None = None
        for i in range(min(2, len(candidates))):
            worker = candidates[(start + i) % len(candidates)]
            sent = self._with_deadline(request)
            try:
                await self.bus.request(self.bus.subjects.worker_generate(worker.worker_id), sent,
                                       ControlReply, timeout=self.config.route_timeout_s)
            except RemoteError as exc:
                if exc.code not in DIRECT_REFUSALS:
                    raise
                last = exc
                continue
            except NoResponders as exc:
                last = exc
                continue
            except RequestTimeout as exc:
                # It may have taken it and answered late: that copy (this try) is stale.
                await self.cancel(worker.worker_id, request.request_id, SUPERSEDED, migrations=request.migrations,
                                  attempt=sent.attempt)
                last = exc
                continue
            self.direct_placements += 1
            return Placement(request_id=request.request_id, worker_id=worker.worker_id, model=request.model,
                             policy="direct", attempt=sent.attempt)
        raise no_capacity(f"no worker accepted the request: {last}")

    async def probe(self, worker_id: str, request_id: str, timeout_s: float) -> RequestProbeReply | None:
        """The worker's word on one request, or None when it does not answer in time."""
        try:
            return await self.bus.request(self.bus.subjects.worker_probe(worker_id), RequestProbe(request_id=request_id),
                                          RequestProbeReply, timeout=timeout_s)
        except MeshError as exc:
            log.info("probe of %s on %s got no answer: %s", request_id, worker_id, exc)
            return None

    async def cancel(self, worker_id: str, request_id: str, reason: str = "client disconnected", *,
                     migrations: int = 0, attempt: int = 0) -> None:
        """``migrations``, ``attempt``: the segment and placement try cancelled, which a
        ``SUPERSEDED`` cancel names."""
        try:
            await self.bus.publish(self.bus.subjects.worker_cancel(worker_id), CancelRequest(
                request_id=request_id, reason=reason, migrations=migrations, attempt=attempt))
        except MeshError as exc:
            log.warning("cancel of %s on %s failed: %s", request_id, worker_id, exc)
