"""The gateway's client for the services upstream of it: admission, router and worker.

``admit`` asks admission (``mesh.admission.check``), ``place`` asks the router
(``mesh.router.route``, which forwards the request to the chosen worker), ``cancel``
tells the serving worker to stop. While no router answers, ``place`` falls back to
placing directly on a ready worker of the model from the registry, so a mesh without a
router still serves; when admission is unreachable the gateway fails open for a grace
window, then closed (configurable), and counts every such decision.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bus import Bus
from bus.registry import WorkerRegistry
from proto import (
    AdmissionDecision,
    AdmissionRequest,
    CancelRequest,
    ControlReply,
    ErrorCode,
    MeshError,
    NoResponders,
    Placement,
    RemoteError,
    RequestProbe,
    RequestProbeReply,
    RequestTimeout,
    RouteRequest,
)

from .errors import from_mesh_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    admission_timeout_s: float = 1.0
    route_timeout_s: float = 5.0
    # "open": admit when admission is unreachable; "closed": reject; "grace": open for
    # grace_s after admission was last seen, then closed.
    admission_unreachable: str = "grace"
    admission_grace_s: float = 30.0


class UpstreamClient:
    def __init__(
        self, bus: Bus, registry: WorkerRegistry, config: UpstreamConfig | None = None,
        clock: Callable[[], float] = time.monotonic, on_unreachable: Callable[[str], None] | None = None,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.config = config or UpstreamConfig()
        self.clock = clock
        self.on_unreachable = on_unreachable  # told "open" or "closed" for each decision made without admission
        self._admission_seen_at = clock()
        self._round_robin = itertools.count()
        self.admission_fail_open = 0
        self.admission_fail_closed = 0
        self.direct_placements = 0

    async def admit(self, request: AdmissionRequest) -> AdmissionDecision:
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

    async def place(self, route: RouteRequest) -> Placement:
        try:
            return await self.bus.request(self.bus.subjects.router_route, route, Placement, timeout=self.config.route_timeout_s)
        except NoResponders:
            return await self._place_directly(route)

    async def _place_directly(self, route: RouteRequest) -> Placement:
        """No router: round robin over ready workers, skipping one that refuses."""
        request = route.request
        candidates = [w for w in self.registry.ready_workers(request.model) if w.worker_id not in route.exclude_workers]
        if not candidates:
            raise MeshError(f"no ready worker serves model {request.model!r}", code=ErrorCode.NO_CAPACITY)
        start = next(self._round_robin)
        last: MeshError | None = None
        for i in range(min(2, len(candidates))):
            worker = candidates[(start + i) % len(candidates)]
            try:
                await self.bus.request(
                    self.bus.subjects.worker_generate(worker.worker_id), request, ControlReply, timeout=self.config.route_timeout_s
                )
            except RemoteError as exc:
                if exc.code is not ErrorCode.DRAINING:
                    raise
                last = exc
                continue
            except (NoResponders, RequestTimeout) as exc:
                last = exc
                continue
            self.direct_placements += 1
            return Placement(request_id=request.request_id, worker_id=worker.worker_id, model=request.model, policy="direct")
        raise MeshError(f"no worker accepted the request: {last}", code=ErrorCode.NO_CAPACITY)

    async def probe(self, worker_id: str, request_id: str, timeout_s: float) -> RequestProbeReply | None:
        """The worker's word on one request, or None when it does not answer in time."""
        try:
            return await self.bus.request(self.bus.subjects.worker_probe(worker_id), RequestProbe(request_id=request_id),
                                          RequestProbeReply, timeout=timeout_s)
        except MeshError as exc:
            log.info("probe of %s on %s got no answer: %s", request_id, worker_id, exc)
            return None

    async def cancel(self, worker_id: str, request_id: str, reason: str = "client disconnected") -> None:
        try:
            await self.bus.publish(self.bus.subjects.worker_cancel(worker_id), CancelRequest(request_id=request_id, reason=reason))
        except MeshError as exc:
            log.warning("cancel of %s on %s failed: %s", request_id, worker_id, exc)
