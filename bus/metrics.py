"""Serving a service's Prometheus registry over HTTP (``GET /metrics``).

Every service that exports metrics keeps its own ``CollectorRegistry`` (so tests can run
several services in one process) and serves it with ``MetricsServer``. Servers in one
process given the same fixed address share one listener and one page: a worker process
hosting several models (``--host-models``) runs one worker service per model, and an
operator scrapes the host once, each model's series told apart by their labels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0,
                 before_scrape: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.before_scrape = before_scrape  # refresh gauges that are computed, not counted
        self._listener: _Listener | None = None

    async def start(self) -> int:
        # Port 0 asks for a free port of one's own; a fixed port is shared within the process.
        key = (self.host, self.port)
        listener = _listeners.get(key) if self.port else None
        if listener is None:
            listener = _Listener(self.host, self.port)
            if self.port:
                _listeners[key] = listener  # before binding: hosted services start at once
        # Attached before the bind is awaited, so the last server to stop closes the
        # listener, a bind that a cancelled start left under way included.
        listener.servers.append(self)
        self._listener = listener
        try:
            await listener.started()
        except BaseException:
            await self.stop()
            raise
        self.port = listener.port
        return self.port

    async def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        listener.servers.remove(self)
        if not listener.servers:
            if _listeners.get((listener.host, listener.requested_port)) is listener:
                del _listeners[(listener.host, listener.requested_port)]
            await listener.stop()


class _Listener:
    """One HTTP listener serving the merged page of the servers attached to it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.requested_port = port
        self.port = port
        self.servers: list[MetricsServer] = []
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Task[None] | None = None

    async def started(self) -> None:
        """Bind once; every server attaching meanwhile waits for the same outcome."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            for server in list(self.servers):
                if server.before_scrape is not None:
                    try:
                        server.before_scrape()
                    except Exception:  # one model's refresh failing leaves the others' page
                        log.exception("metrics: refreshing computed gauges failed")
            page = _Merged([s.registry for s in self.servers])
            return web.Response(body=generate_latest(page), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            runner, self._runner = self._runner, None
            await runner.cleanup()
            raise
        addresses = self._runner.addresses  # (host, port, ...) of each listening socket
        self.port = addresses[0][1] if addresses else self.port
        log.info("metrics on http://%s:%s/metrics", self.host, self.port)

    async def stop(self) -> None:
        starting = self._starting
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait([starting])
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


class _Merged:
    """Several registries as one page: a family named in more than one (each hosted
    model's ``vllm:num_requests_running``) is written once, with every registry's
    samples; a sample repeated with the same labels (one host's cache shape) once."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        if len(self.registries) == 1:
            yield from self.registries[0].collect()
            return
        families: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        merged.samples.append(sample)
        yield from families.values()


_listeners: dict[tuple[str, int], _Listener] = {}
