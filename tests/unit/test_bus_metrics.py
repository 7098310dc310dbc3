"""``MetricsServer``s of one process on one fixed address share a listener and one page
(a host's worker service per model); the page stays valid Prometheus text, and the
listener goes when its last server does, whatever way a start ended."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from bus import metrics
from bus.metrics import MetricsServer
from ops.natsserver import free_port
from services.worker.metrics import WorkerMetrics


async def scrape(port: int) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as response:
        return response.status, await response.text()


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_two_models_share_one_valid_page_and_the_port_goes_with_the_last() -> None:
    port = free_port()
    a, b = WorkerMetrics("m-a", "sim"), WorkerMetrics("m-b", "sim")
    a.cache_config(16, 100)
    b.cache_config(16, 100)  # the same cache shape: one series, not a duplicate
    a.success.labels(model_name="m-a", engine="sim", finished_reason="stop").inc()
    servers = [MetricsServer(a.registry, port=port), MetricsServer(b.registry, port=port)]
    assert await asyncio.gather(*(s.start() for s in servers)) == [port, port]
    status, text = await scrape(port)
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: valid text
    assert len(families) == len(list(text_string_to_metric_families(text)))  # each family once
    finished = {s.labels["model_name"] for s in families["vllm:request_success"].samples}
    assert finished == {"m-a", "m-b"}
    assert len(families["vllm:cache_config_info"].samples) == 1
    await servers[0].stop()
    status, text = await scrape(port)
    assert status == 200 and 'model_name="m-a"' not in text and 'model_name="m-b"' in text
    await servers[1].stop()
    assert port_is_free(port) and not metrics._listeners


async def test_one_failing_refresh_leaves_the_other_models_on_the_page() -> None:
    port = free_port()
    good = WorkerMetrics("m-good", "sim")

    def broken() -> None:
        raise RuntimeError("engine stats unavailable")

    servers = [MetricsServer(good.registry, port=port),
               MetricsServer(WorkerMetrics("m-broken", "sim").registry, port=port, before_scrape=broken)]
    for server in servers:
        await server.start()
    try:
        status, text = await scrape(port)
        assert status == 200 and 'model_name="m-good"' in text  # was a 500 for every model
    finally:
        for server in servers:
            await server.stop()


async def test_a_cancelled_or_failed_start_leaves_no_listener() -> None:
    port = free_port()
    starting = asyncio.ensure_future(MetricsServer(CollectorRegistry(), port=port).start())
    await asyncio.sleep(0)
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    await asyncio.sleep(0.1)
    assert port_is_free(port) and not metrics._listeners  # the bind went on for nobody
    again = MetricsServer(CollectorRegistry(), port=port)
    assert await again.start() == port
    await again.stop()

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        outcomes = await asyncio.gather(MetricsServer(CollectorRegistry(), port=busy).start(),
                                        MetricsServer(CollectorRegistry(), port=busy).start(), return_exceptions=True)
    assert all(isinstance(o, OSError) for o in outcomes) and not metrics._listeners
