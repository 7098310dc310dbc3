"""The service runner every meshserve service uses.

It owns the process lifecycle: logging and tracing set-up, the NATS connection, stream
provisioning, NATS micro registration (``$SRV.PING|INFO|STATS`` answer with the
service's endpoints), readiness, and the drain on SIGTERM/SIGINT: stop taking new work,
let in-flight work finish within a timeout, then close the connection cleanly.

A service subclasses ``Service``, registers endpoints and subscriptions in
``on_start``, and runs its long work through ``spawn`` so the drain can wait for it.

A service that cannot start for want of JetStream (a cluster electing a leader, a server
still coming up) is built again and retried for ``JETSTREAM_WAIT_S`` by ``run_service``:
nothing restarts a service under ``meshserve up``, so exiting would leave it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import nats.micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import EndpointStats

from proto.codec import decode
from proto.errors import DecodeError, MeshError

from .client import Bus
from .logs import setup_logging
from .micro import request_msg, stop_endpoint
from .provision import provision
from .settings import BusSettings, RunOptions
from .tasks import cancel_and_wait
from .tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

MESHSERVE_VERSION = "0.1.0"

# How long run_service keeps building a service again while JetStream is unavailable
# (a leader election takes seconds; a node restarting, tens of seconds).
JETSTREAM_WAIT_S = 120.0


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level_problem(level: str) -> str | None:
    """Why ``level`` (``--log-level``, ``MESHSERVE_LOG_LEVEL``) is not a logging level, or
    None when it is (any case; ``warn`` and ``fatal`` too, as ``logging`` takes them)."""
    if level.upper() in logging.getLevelNamesMapping():
        return None
    return f"not a level ({', '.join(LOG_LEVELS)})"


def listen_problem(host: str, port: int) -> tuple[str, int] | None:
    """Why nothing can listen on ``host:port`` (TCP, as aiohttp's sites bind: every address
    the name resolves to, ``SO_REUSEADDR``), with the exit code to end with (2: a host
    that does not resolve, bad input; 1: an address in use or not on this machine); None
    when the port is free. Checked before a service connects to NATS, so that a port in
    use is one line at once rather than a traceback once the mesh is up. Port 0 checks the
    host only."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"cannot listen on {host}:{port}: {host} does not resolve to an address ({why})", 2
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks (no IPv6): asyncio's create_server skips it too
        try:
            with sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {(exc.strerror or str(exc)).lower()}", 1
    return None


def jetstream_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says JetStream did not answer: no
    responders on its API (not enabled, no leader), a 503, or a request nobody answered
    in time (``nats: timeout``, what an election looks like to a client)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                                nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError)):
            return True
        if isinstance(current, nats.js.errors.APIError) and current.code == 503:
            return True
        current = current.__cause__ or current.__context__
    return False


class Service:
    name: ClassVar[str] = "service"
    description: ClassVar[str] = ""
    version: ClassVar[str] = MESHSERVE_VERSION

    def __init__(
        self,
        settings: BusSettings | None = None,
        *,
        instance_id: str | None = None,
        drain_timeout_s: float = 30.0,
        provision_streams: bool = True,
    ) -> None:
        self.settings = settings or BusSettings.from_env()
        self.instance_id = instance_id or f"{self.name}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.drain_timeout_s = drain_timeout_s
        self.provision_streams = provision_streams
        self.ready = False
        self.draining = False
        self.started_at = 0.0
        self._bus: Bus | None = None
        self._micro: nats.micro.service.Service | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subscriptions: list[Subscription] = []
        self.stopped = asyncio.Event()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"{self.name} is not connected yet")
        return self._bus

    # ---- hooks for subclasses ---------------------------------------------------------
    async def on_start(self) -> None:
        """Register endpoints and subscriptions, start background loops."""

    async def on_drain(self) -> None:
        """Stop taking new work. The default unsubscribes every endpoint."""
        await self.stop_endpoints()

    async def on_stop(self) -> None:
        """Release resources after in-flight work has ended (connection still open)."""

    def stats(self) -> dict[str, Any]:
        """Service-specific figures reported through ``$SRV.STATS``."""
        return {}

    # ---- endpoints and tasks ----------------------------------------------------------
    async def add_endpoint(
        self,
        name: str,
        subject: str,
        kind: type[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        *,
        queue_group: str | None = None,
        concurrent: bool = True,
    ) -> None:
        """A NATS micro endpoint whose requests are decoded into ``kind`` for ``handler``.

        With ``concurrent`` each request runs as its own tracked task (nats-py runs a
        subscription's callbacks one at a time); the drain waits for those tasks.
        """
        bus = self.bus

        async def handle(message: T, msg: Msg) -> None:
            try:
                await handler(message, msg)
            except MeshError as exc:
                await bus.respond_error(msg, exc)
            except Exception as exc:  # a bug in one request must not kill the endpoint
                log.exception("%s endpoint %s failed", self.name, name)
                await bus.respond_error(msg, MeshError(f"internal error: {exc!r}"))

        async def on_request(request: Request) -> None:
            msg = request_msg(request)
            try:
                message = decode(msg.data, kind)
            except DecodeError as exc:
                bus.decode_errors += 1
                log.warning("%s: dropped bad %s on %s: %s", self.name, kind.__name__, msg.subject, exc)
                await bus.respond_error(msg, exc)
                return
            if concurrent:
                self.spawn(handle(message, msg), name=f"{name}")
            else:
                await handle(message, msg)

        assert self._micro is not None
        await self._micro.add_endpoint(
            name=name,
            subject=subject,
            queue_group=queue_group or self.name,
            handler=on_request,
            metadata={"request": kind.__name__},
        )

    async def add_raw_endpoint(
        self,
        name: str,
        subject: str,
        handler: Callable[[Msg], Coroutine[Any, Any, None]],
        *,
        queue_group: str | None = None,
    ) -> None:
        """A NATS micro endpoint whose bodies are not proto messages (e.g. the JSON client API).

        Each request runs as a tracked task; the handler answers (and reports errors) itself.
        """

        async def on_request(request: Request) -> None:
            self.spawn(handler(request_msg(request)), name=name)

        assert self._micro is not None
        await self._micro.add_endpoint(name=name, subject=subject, queue_group=queue_group or self.name, handler=on_request)

    async def subscribe(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """A plain (non-endpoint) subscription, e.g. gauges or events; closed at drain."""
        sub = await self.bus.subscribe(subject, kind, handler, queue=queue, answer_decode_errors=False)
        self._subscriptions.append(sub)
        return sub

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as in-flight work the drain waits for."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task %s failed", self.name, task.get_name(), exc_info=task.exception())

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def remove_endpoint(self, name: str) -> bool:
        """Stop answering one endpoint (e.g. a leader's, on stepping down); the others and
        ``$SRV`` discovery stay. False when there is no endpoint of that name."""
        if self._micro is None or self._micro.stopped.is_set():
            return False
        stopped = await stop_endpoint(self._micro, name)
        if stopped:
            # Once confirmed, a request another connection sends finds no responder (not a
            # subscription this client already dropped, which would time out). A loaded
            # machine can take seconds to answer: wait long. A closed connection has dropped
            # every subscription anyway; a lost one unsubscribes as it reconnects.
            try:
                await self.bus.confirm_subscriptions(timeout=30)
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                pass
            except nats.errors.FlushTimeoutError:
                log.warning("%s: the server did not confirm that endpoint %s stopped", self.instance_id, name)
        return stopped

    async def stop_endpoints(self) -> None:
        if self._micro is not None and not self._micro.stopped.is_set():
            await self._micro.stop()
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subscriptions.clear()

    async def wait_in_flight(self, timeout: float) -> bool:
        """Wait for tracked tasks; True when all ended in time."""
        deadline = time.monotonic() + timeout
        while self._tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=remaining)
        return True

    # ---- lifecycle --------------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin a drain (what SIGTERM does); safe to call from tests."""
        self._stop.set()

    async def stop_requested(self, within_s: float) -> bool:
        """Whether a stop is (or within ``within_s`` becomes) requested."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), within_s)
        return self._stop.is_set()

    async def abandon_start(self) -> None:
        """Undo what a failed ``start`` began (tasks, ``on_start``'s resources, the
        connection), best effort: the instance is not used again."""
        await cancel_and_wait(list(self._tasks))
        try:
            await asyncio.wait_for(self.on_stop(), self.drain_timeout_s)
        except Exception as exc:  # on_start may have got only part of the way
            log.debug("%s: on_stop after a failed start: %r", self.name, exc)
        with contextlib.suppress(Exception):
            await self.stop_endpoints()
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await self._bus.close()

    async def start(self) -> None:
        """Connect, provision, register with NATS micro, run ``on_start``; then ready."""
        setup_tracing(self.name)
        self._bus = await Bus.open(self.settings, self.instance_id)
        if self.provision_streams:
            await provision(self.bus.js, self.bus.subjects, replicas=self.settings.js_replicas)
        self._micro = await nats.micro.add_service(
            self.bus.nc,
            name=f"meshserve-{self.name}",
            version=self.version,
            description=self.description or f"meshserve {self.name}",
            metadata={"instance": self.instance_id, "root": self.settings.root},
            stats_handler=self._stats_handler,
        )
        await self.on_start()
        # Ready means the server knows every endpoint.
        await self.bus.confirm_subscriptions()
        self.started_at = time.time()
        self.ready = True
        log.info("%s ready (%s)", self.name, self.instance_id)

    def _stats_handler(self, endpoint: EndpointStats) -> Any:
        bad = self._bus.decode_errors if self._bus is not None else 0
        return {"ready": self.ready, "draining": self.draining, "in_flight": self.in_flight, "decode_errors": bad, **self.stats()}

    async def drain_and_close(self) -> bool:
        """Stop new work, wait for in-flight work up to the drain timeout, close."""
        self.ready = False
        self.draining = True
        log.info("%s draining (%d in flight)", self.name, self.in_flight)
        await self.on_drain()
        finished = await self.wait_in_flight(self.drain_timeout_s)
        if not finished:
            log.warning("%s drain timeout: cancelling %d tasks", self.name, len(self._tasks))
            await cancel_and_wait(list(self._tasks))
        await self.on_stop()
        await self.stop_endpoints()
        if self._bus is not None:
            await self._bus.close()
        shutdown_tracing()
        self.stopped.set()
        log.info("%s stopped", self.name)
        return finished

    async def serve(self, *, install_signals: bool = True) -> int:
        """Run until SIGTERM/SIGINT (or ``request_stop``), then drain; the process exit code."""
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        # A stop during start-up (NATS not reachable yet: connecting retries for ever) ends
        # the process at once: SIGTERM must not wait for a server that may never come.
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not starting.done():
            log.info("%s: stop requested during start-up; not started", self.name)
            await cancel_and_wait([starting])
            await self.abandon_start()
            return 0
        starting.result()  # a failed start raises here, as before
        await self._stop.wait()
        finished = await self.drain_and_close()
        return 0 if finished else 3


def _reason(exc: BaseException) -> str:
    """One line saying why JetStream did not answer."""
    if isinstance(exc, nats.js.errors.ServiceUnavailableError) and not exc.description:
        return "no JetStream answered: not enabled, or no leader"
    return " ".join((str(exc) or type(exc).__name__).split())


def run_service(service_factory: Callable[[], Service], options: RunOptions | None = None, *,
                jetstream_wait_s: float = JETSTREAM_WAIT_S) -> int:
    """Process entry point: uvloop, logging (``options``' level and format), then ``Service.serve``.

    ``options.settings`` are the factory's to pass to the service it builds. A start that
    fails for want of JetStream (``jetstream_unavailable``) builds the service again and
    retries, with backoff, for up to ``jetstream_wait_s``; any other failure, or the last
    one, ends the process as before.
    """
    return run_services(lambda: [service_factory()], options, jetstream_wait_s=jetstream_wait_s)


def run_services(group_factory: Callable[[], list[Service]], options: RunOptions | None = None, *,
                 jetstream_wait_s: float = JETSTREAM_WAIT_S) -> int:
    """``run_service`` for services that share one process (a hot-swap host's worker per
    model): all start, SIGTERM/SIGINT drains all, and the exit code is the worst of theirs."""
    import uvloop

    async def serve_all(group: list[Service]) -> int:
        if len(group) == 1:
            return await group[0].serve()
        loop = asyncio.get_running_loop()

        def stop_all() -> None:
            for service in group:
                service.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_all)
        serving = [asyncio.ensure_future(s.serve(install_signals=False)) for s in group]
        try:
            return max(await asyncio.gather(*serving))
        except Exception as exc:
            if jetstream_unavailable(exc) and not any(s.started_at for s in group):
                raise  # main builds the group again (and ends what these left running)
            # One could not start: the others stop too (a started one drains and leaves the
            # registry), not left running until the loop's shutdown cut them off mid-call.
            stop_all()
            for other in await asyncio.gather(*serving, return_exceptions=True):
                if isinstance(other, BaseException) and other is not exc:
                    log.error("%s failed too: %r", group[0].name, other)
            raise

    async def main() -> int:
        began = time.monotonic()
        delay = 0.5
        attempt = 1
        group = group_factory()
        setup_logging(group[0].name, level=options.log_level if options else None, fmt=options.log_format if options else None)
        while True:
            try:
                return await serve_all(group)
            except Exception as exc:
                waited = time.monotonic() - began
                if any(s.started_at for s in group) or not jetstream_unavailable(exc):
                    raise
                if waited + delay > jetstream_wait_s:
                    log.error("%s could not start: JetStream did not answer for %.0fs; giving up", group[0].name, waited)
                    raise
                reason = _reason(exc)
                log.warning("%s could not start for want of JetStream (%s); starting it again in %.1fs "
                            "(attempt %d failed, %.0fs of %.0fs waited)", group[0].name, reason, delay, attempt, waited, jetstream_wait_s)
                for service in group:
                    await service.abandon_start()
                # Whatever the failed instance left running (on_start got part of the way, and
                # its on_stop may not know) goes too: this process runs only these services.
                leftovers = asyncio.all_tasks() - {asyncio.current_task()}
                for task in leftovers:
                    task.cancel()
                await asyncio.gather(*leftovers, return_exceptions=True)
                if await group[0].stop_requested(delay):  # SIGTERM while waiting: nothing to drain
                    return 0
            attempt += 1
            delay = min(delay * 2, 10.0)
            group = group_factory()

    return uvloop.run(main())
