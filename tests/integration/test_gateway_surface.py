"""The gateway's HTTP surface as clients other than ours meet it: vLLM's /health, model
objects, OpenAI-shaped errors for every path it does not serve, keys in the headers other
SDKs use, the development key for the chat page, and the usage of a cancelled WebSocket
request. A sim worker and the gateway run as tasks in this process, on a real nats-server."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from bus import Bus, BusSettings
from ops.keys import create_key
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.service import WorkerService
from tests.browser import CHROMIUM, launch_chromium
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings) as service:
        yield service


@pytest.fixture
def dev_key_file(tmp_path: Path) -> Path:
    return tmp_path / "dev-key"


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService, dev_key_file: Path) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings, GatewayConfig(port=0, dev_key_file=str(dev_key_file))) as service:
        yield service


@pytest.fixture
async def key(bus: Bus, gateway: GatewayService) -> str:
    return await known_key(bus, gateway, "surface-org")


async def _get(url: str, method: str = "GET", **kwargs: object) -> tuple[int, str, dict, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http, http.request(method, url, **kwargs) as r:  # type: ignore[arg-type]
        body = await r.json(content_type=None) if r.content_type == "application/json" else {}
        return r.status, r.content_type, body, dict(r.headers)


async def test_health_answers_under_vllms_name(gateway: GatewayService) -> None:
    status, _, body, _ = await _get(f"{gateway.http_url}/health")
    assert status == 200 and body == {"status": "ok"}
    for method in ("GET", "POST"):  # vLLM's /ping (SageMaker's health check)
        assert (await _get(f"{gateway.http_url}/ping", method))[0] == 200
    status, _, body, _ = await _get(f"{gateway.http_url}/version")
    assert status == 200 and body["version"] == importlib.metadata.version("meshserve")


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/audio/speech"), ("POST", "/v1/embeddings"), ("GET", "/no/such/path"), ("DELETE", "/v1/files/x"),
])
async def test_unknown_paths_get_openai_errors(gateway: GatewayService, key: str, method: str, path: str) -> None:
    status, content_type, body, _ = await _get(f"{gateway.http_url}{path}", method, json={"model": MODEL, "input": "x"},
                                               headers={"Authorization": f"Bearer {key}"})
    assert (status, content_type) == (404, "application/json")
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "unknown_url"
    assert f"Invalid URL ({method} {path})" in body["error"]["message"]
    assert "/v1/chat/completions" in body["error"]["message"]  # says what is served instead


async def test_wrong_method_is_an_openai_405(gateway: GatewayService) -> None:
    status, content_type, body, headers = await _get(f"{gateway.http_url}/v1/chat/completions")
    assert (status, content_type) == (405, "application/json")
    assert body["error"]["code"] == "method_not_allowed" and headers["Allow"] == "POST"


async def test_plain_get_on_the_websocket_path_is_an_openai_400(gateway: GatewayService) -> None:
    status, content_type, body, _ = await _get(f"{gateway.http_url}/v1/ws")
    assert (status, content_type) == (400, "application/json")
    assert "WebSocket" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


async def test_stock_client_sees_not_found_errors_and_model_objects(gateway: GatewayService, key: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as embeddings:
        await client.embeddings.create(model=MODEL, input="x")
    assert embeddings.value.code == "unknown_url"
    model = await client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    listed = await client.models.list()
    assert [(m.id, (m.model_extra or {}).get("max_model_len")) for m in listed.data] == [(MODEL, 2048)]


async def test_model_object_is_hidden_from_keys_restricted_to_other_models(bus: Bus, gateway: GatewayService) -> None:
    restricted, _ = await create_key(bus, org="surface-org", models=["some-other-model"])
    url = f"{gateway.http_url}/v1/models/{MODEL}"
    for _ in range(100):
        status, _, body, _ = await _get(url, headers={"Authorization": f"Bearer {restricted}"})
        if status != 401:
            break
        await asyncio.sleep(0.1)
    assert status == 404 and body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("header", ["api-key", "x-api-key", "Api-Key"])
async def test_key_in_api_key_headers_is_accepted(gateway: GatewayService, key: str, header: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    status, _, reply, _ = await _get(f"{gateway.http_url}/v1/completions", "POST", json=body, headers={header: key})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("authorization", ["{key}", "Basic {key}", "Token {key}"])
async def test_key_without_bearer_is_called_malformed(gateway: GatewayService, key: str, authorization: str) -> None:
    headers = {"Authorization": authorization.format(key=key)}
    status, _, body, _ = await _get(f"{gateway.http_url}/v1/models", headers=headers)
    assert status == 401 and body["error"]["code"] == "invalid_authorization_header"
    assert "malformed Authorization header" in body["error"]["message"]
    assert "didn't provide" not in body["error"]["message"]
    # A well-formed api-key header next to it wins: some clients send both.
    status, _, _, _ = await _get(f"{gateway.http_url}/v1/models", headers={**headers, "api-key": key})
    assert status == 200


async def test_an_empty_bearer_is_a_missing_key(gateway: GatewayService) -> None:
    status, _, body, _ = await _get(f"{gateway.http_url}/v1/models", headers={"Authorization": "Bearer "})
    assert status == 401 and "didn't provide an API key" in body["error"]["message"]


async def test_nats_api_and_websocket_take_the_same_headers(gateway: GatewayService, key: str, bus: Bus) -> None:
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "ignore_eos": true}' % MODEL.encode()
    reply = await bus.nc.request(bus.subjects.api_completions, body, headers={"api-key": key}, timeout=20)
    assert b'"completion_tokens":2' in reply.data
    reply = await bus.nc.request(bus.subjects.api_completions, body, headers={"Authorization": key}, timeout=20)
    assert (reply.headers or {}).get("Nats-Service-Error-Code") == "401" and b"malformed Authorization header" in reply.data
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{gateway.http_url}/v1/ws", headers={"Authorization": key}) as ws:
            error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["error"]["code"] == "invalid_authorization_header"
        async with http.ws_connect(f"{gateway.http_url}/v1/ws", headers={"x-api-key": key}) as ws:
            await ws.send_json({"type": "completion", "id": "a", "body": {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                                  "ignore_eos": True}})
            messages = [await ws.receive_json(timeout=20)]
            while messages[-1]["type"] == "token":
                messages.append(await ws.receive_json(timeout=20))
        assert messages[-1]["type"] == "done" and messages[-1]["usage"]["completion_tokens"] == 2


async def test_websocket_cancel_reports_the_usage_that_was_billed(gateway: GatewayService, key: str) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": key})
        await ws.send_json({"type": "completion", "id": "long", "body": {
            "model": MODEL, "prompt": "count", "max_tokens": 1500, "ignore_eos": True}})
        received = 0
        cancelled = False
        while True:
            message = await ws.receive_json(timeout=30)
            if message["type"] != "token":
                break
            received += len(message["token_ids"])
            if received >= 10 and not cancelled:
                await ws.send_json({"type": "cancel", "id": "long"})
                cancelled = True
    assert message["type"] == "done" and message["finish_reason"] == "abort", message
    usage = message["usage"]
    assert usage is not None, "a cancelled request's tokens were billed: its done frame must say how many"
    assert usage["prompt_tokens"] == len("count")
    # Every token the worker billed reached the client before the done frame, and no more.
    assert usage["completion_tokens"] == received and 10 <= received < 1500


async def test_websocket_a_reused_id_is_refused_without_ending_the_running_request(
        gateway: GatewayService, key: str) -> None:
    """The refusal carried the running request's id, so a client read it as that request's end."""
    body = {"model": MODEL, "prompt": "count", "max_tokens": 300, "ignore_eos": True}
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": key})
        await ws.send_json({"type": "completion", "id": "a", "body": body})
        first = await ws.receive_json(timeout=30)
        assert first["type"] == "token" and first["id"] == "a"
        await ws.send_json({"type": "completion", "id": "a", "body": body})
        frames = [await ws.receive_json(timeout=30)]
        while frames[-1]["type"] != "done":
            frames.append(await ws.receive_json(timeout=30))
    refusals = [f for f in frames if f["type"] == "error"]
    assert len(refusals) == 1 and refusals[0]["id"] is None and refusals[0]["error"]["param"] == "id"
    assert "already in flight" in refusals[0]["error"]["message"]
    done = frames[-1]
    assert done["id"] == "a" and done["usage"]["completion_tokens"] == 300  # the first ran to its end


async def test_websocket_cancel_before_placement_still_ends_with_done(gateway: GatewayService, key: str) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": key})
        await ws.send_json({"type": "completion", "id": "early", "body": {
            "model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True}})
        await ws.send_json({"type": "cancel", "id": "early"})
        tokens = 0
        while (message := await ws.receive_json(timeout=30))["type"] == "token":
            tokens += len(message["token_ids"])
    assert message["type"] == "done" and message["finish_reason"] == "abort"
    assert message["usage"]["completion_tokens"] == tokens < 1500


async def test_dev_key_goes_to_this_host_only(gateway: GatewayService, dev_key_file: Path) -> None:
    url = f"{gateway.http_url}/dev-key"
    status, _, body, _ = await _get(url)
    assert status == 404 and body["error"]["code"] == "unknown_url"  # no key written yet
    dev_key_file.write_text("msk-000000000000-devdevdevdevdevdevdevdevdev\n")  # noqa: ASYNC240 (a test fixture file)
    status, _, body, headers = await _get(url)
    assert status == 200 and body == {"api_key": "msk-000000000000-devdevdevdevdevdevdevdevdev"}
    assert headers["Cache-Control"] == "no-store"
    for refused in ({"X-Forwarded-For": "203.0.113.7"}, {"X-Real-IP": "198.51.100.2"},
                    {"Forwarded": "for=192.0.2.60;proto=https"}, {"Host": "attacker.example:8080"},
                    {"Sec-Fetch-Site": "cross-site"}):
        status, _, body, _ = await _get(url, headers=refused)
        assert status == 404, refused


async def test_dev_key_route_is_off_without_a_key_file(bus_settings: BusSettings, worker: WorkerService, tmp_path: Path) -> None:
    (tmp_path / "dev-key").write_text("msk-000000000000-devdevdevdevdevdevdevdevdev\n")
    service = GatewayService(GatewayConfig(port=0), bus_settings)
    await service.start()
    try:
        status, _, _, _ = await _get(f"{service.http_url}/dev-key")
        assert status == 404
    finally:
        await service.drain_and_close()


async def test_favicon(gateway: GatewayService) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.http_url}/favicon.ico") as r:
        assert r.status == 200 and r.content_type == "image/svg+xml"
        assert (await r.read()).startswith(b"<svg")


async def test_the_chat_page_may_run_its_own_code_only_and_not_be_framed(gateway: GatewayService) -> None:
    """It holds a key: no other script, no frame around it (a click-jacking page), no
    connection but to this gateway. Its inline script and style are allowed by their hashes
    (the headless Chromium test below runs the page under this policy)."""
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.http_url}/") as r:
        assert r.status == 200
        policy = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
        assert policy.count("'sha256-") == 2 and "'unsafe-inline'" not in policy
        host = f"127.0.0.1:{gateway.bound_port}"
        assert f"connect-src 'self' ws://{host} wss://{host};" in policy
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["X-Content-Type-Options"] == "nosniff"
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.http_url}/",
                                                          headers={"Host": "x; script-src *"}) as r:
        assert "script-src *" not in r.headers["Content-Security-Policy"]  # a Host header is no directive


async def test_tokenizer_export_asks_the_mesh_which_tokenizer_a_model_uses(
    nats_url: str, worker: WorkerService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer

    from ops.cli import main
    from services.common.tokenizer import ByteTokenizer

    monkeypatch.setenv("MESHSERVE_NATS_URL", nats_url)
    out = tmp_path / "tok"
    assert await asyncio.to_thread(main, ["tokenizer", "export", str(out), "--model", MODEL]) == 0
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert exported.encode("grüß dich").ids == ByteTokenizer().encode("grüß dich")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 2048 and config["name_or_path"] == MODEL  # what the worker registered
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["tokenizer", "export", str(out), "--model", "nope"]) == 2
    assert f"no worker serves 'nope' (served: {MODEL})" in capsys.readouterr().err




@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)")
async def test_chat_page_opens_asking_for_the_key_and_offers_the_dev_key(
    gateway: GatewayService, key: str, dev_key_file: Path, tmp_path: Path
) -> None:
    """In headless Chromium: no request and no red before a key, the favicon is there, the
    development key works, and the key lasts for the tab only."""
    dev_key_file.write_text(key + "\n")  # noqa: ASYNC240 (what meshserve up writes)
    await asyncio.to_thread(_drive_chat_page, gateway.http_url, tmp_path)


def _drive_chat_page(url: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            context = browser.new_context()
            page = context.new_page()
            failed: list[str] = []
            page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            refused: list[str] = []  # what the page's own Content-Security-Policy blocked of it
            page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
            page.goto(url + "/")
            page.wait_for_selector("#use-dev-key:not([hidden])")
            assert page.is_visible("#key-panel") and not page.is_visible("#key-message")
            assert page.inner_text("#status") == "" and page.locator(".error").count() == 0
            assert page.evaluate("fetch('/favicon.ico').then(r => r.status)") == 200
            assert failed == [], failed  # nothing asked of the API before there is a key: no 401 anywhere
            page.click("#use-dev-key")
            page.wait_for_selector("#model option", state="attached")  # no eval: the page's CSP forbids it
            assert not page.is_visible("#key-panel")
            page.fill("#prompt", "Hello from a fresh tab")
            page.click("#send")
            page.wait_for_selector(".reply[data-state=done]", timeout=30_000)
            assert page.inner_text(".reply[data-state=done] .reply-text").strip()
            assert refused == [], refused
            page.screenshot(path=str(tmp_path / "chat.png"))
            # a reload keeps the key (same tab); a new tab asks again
            page.reload()
            page.wait_for_selector("#model option", state="attached")  # no eval: the page's CSP forbids it
            assert not page.is_visible("#key-panel")
            other = context.new_page()
            other.goto(url + "/")
            other.wait_for_selector("#key-panel:not([hidden])")
            assert failed == [], failed
        finally:
            browser.close()


async def test_server_timing_says_where_the_gateways_time_went(gateway: GatewayService, key: str) -> None:
    # W3C Server-Timing: each phase before the worker had the request, in order, in ms.
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "timing", "max_tokens": 2}
    for extra, resumable, expected in (({}, False, ["auth", "parse", "hash", "admission", "route"]),
                                       ({"stream": True}, True, ["auth", "parse", "hash", "admission", "record", "route"])):
        sent = {**headers, **({"X-Meshserve-Resumable": "true"} if resumable else {})}
        async with aiohttp.ClientSession() as http, http.post(f"{gateway.http_url}/v1/completions",
                                                              json={**body, **extra}, headers=sent) as r:
            assert r.status == 200, await r.text()
            timing = r.headers["Server-Timing"]
            await r.read()
        phases = [part.strip().split(";dur=") for part in timing.split(",")]
        assert [name for name, _ in phases] == expected, timing
        assert all(float(ms) >= 0 for _, ms in phases)
