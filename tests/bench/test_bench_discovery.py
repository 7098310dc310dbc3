"""A bench run without --model says why the endpoint named no model (a refused key, say)
and what to do about it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from ops.bench.config import EndpointConfig
from ops.bench.targets import KEY_REFUSED, PASS_KEY, PASS_MODEL, OpenAITarget
from ops.natsserver import free_port


@pytest.fixture
async def refusing_server() -> AsyncIterator[str]:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                            "code": "invalid_api_key"}}, status=401)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("api_key", "hint"), [("msk-wrong", KEY_REFUSED), (None, PASS_KEY)])
async def test_discovery_reports_the_servers_answer(refusing_server: str, api_key: str | None, hint: str) -> None:
    target = OpenAITarget(EndpointConfig(url=refusing_server, api_key=api_key))
    await target.start()
    try:
        assert await target.discover_model() is None
    finally:
        await target.close()
    assert target.discovery_error is not None
    assert "answered 401: Incorrect API key provided" in target.discovery_error
    # Not "pass --model": every request would be refused too. A key that was sent is
    # called refused, not missing.
    assert target.discovery_hint == hint and not target.discovery_unreachable


async def test_discovery_says_when_nothing_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    target = OpenAITarget(EndpointConfig(url=url))
    await target.start()
    try:
        assert await target.discover_model() is None
    finally:
        await target.close()
    assert target.discovery_error is not None and "failed" in target.discovery_error
    assert target.discovery_hint != PASS_MODEL and url in target.discovery_hint
    assert target.discovery_unreachable


def test_a_server_that_does_not_answer_is_a_failure_not_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1, as for a NATS target that cannot be reached: the command line was right,
    the server was not there (it exited 2, the code for bad input)."""
    from ops.cli import main

    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["bench", "--target", url, "-n", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"meshserve bench: {url}: no model given and none discovered") and "is a server running" in err
