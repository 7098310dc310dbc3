"""Serving a service's Prometheus registry over HTTP (``GET /metrics``).

Every service that exports metrics keeps its own ``CollectorRegistry`` (so tests can run
several services in one process) and serves it with ``MetricsServer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0,
                 before_scrape: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.before_scrape = before_scrape  # refresh gauges that are computed, not counted
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        async def metrics(_: web.Request) -> web.Response:
            if self.before_scrape is not None:
                self.before_scrape()
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of each listening socket
        self.port = addresses[0][1] if addresses else self.port
        log.info("metrics on http://%s:%s/metrics", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
