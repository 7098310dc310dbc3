"""The gateway end to end: stock clients against a mesh of real processes (``meshserve up``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import Bus
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from tests.browser import CHROMIUM, launch_chromium
from tests.sse import read_sse, sse_text

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-llama-8b"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        state_dir=tmp_path_factory.mktemp("mesh"), nats_port=0, http_port=free_port(), model=MODEL, workers=2, speed=20.0,
        gateway_args=["--stall-timeout", "20"],
    )
    m = Mesh(config)
    try:
        asyncio.run(m.start(timeout=90))
    except BaseException:
        m.stop(timeout=10)
        raise
    yield m
    m.stop(timeout=30)


@pytest.fixture
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0, timeout=60)


def test_openai_client_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 12 and len(chat.choices[0].message.content or "") == 12  # byte tokenizer

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30,
                                            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "length" and usage is not None and usage.completion_tokens == 30
    assert len("".join(pieces)) == 30

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert completion.usage is not None and completion.usage.prompt_tokens == len("The capital of France is")
    streamed = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, stream=True, extra_body={"ignore_eos": True})
    assert len("".join(c.choices[0].text for c in streamed if c.choices)) == 16

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def run() -> str:
        r = client.completions.create(model=MODEL, prompt="seeded", max_tokens=40, seed=1234, extra_body={"ignore_eos": True})
        return r.choices[0].text

    assert run() == run()


def test_openai_errors(client: openai.OpenAI, mesh: Mesh) -> None:
    bad_key = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="msk-000000000000-" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=7)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x" * 10, max_tokens=10_000_000)
    assert info.value.code in ("context_length_exceeded", "invalid_value")


async def test_http_status_codes_and_headers(mesh: Mesh) -> None:
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        async with http.post("/v1/chat/completions", data=b"{not json", headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}) as r:
            assert r.status == 401 and "error" in await r.json()
        async with http.post("/v1/completions", data=b"x" * (5 * 1024 * 1024), headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
        async with http.get("/healthz") as r:
            assert r.status == 200
        async with http.get("/readyz") as r:
            assert r.status == 200 and (await r.json())["models"] == [MODEL]
        async with http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                           "temperature": 9}, headers=headers) as r:
            assert r.status == 400
        async with http.get("/metrics") as r:
            text = await r.text()
            assert "meshserve:time_to_first_token_seconds_bucket" in text and "meshserve:gateway_requests_total" in text
        # refusals are requests too, counted by their HTTP status (only requests that ran
        # were: the dashboard's request rates never showed a 4xx)
        refused = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("meshserve:gateway_requests_total{")}
        # bad JSON and a bad temperature (a body that fails validation names no model yet)
        assert refused['meshserve:gateway_requests_total{api="chat",model="",status="400"}'] >= 2
        assert refused['meshserve:gateway_requests_total{api="chat",model="",status="401"}'] >= 1
        assert refused['meshserve:gateway_requests_total{api="completion",model="",status="413"}'] >= 1


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=12,
    ).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({
        "model": st.sampled_from([MODEL, "", "x" * 300, "🙂"]),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus", 3]),
                                                   "content": st.one_of(st.text(max_size=30), st.integers(), st.none())}), max_size=3),
        "max_tokens": st.one_of(st.integers(min_value=-5, max_value=10**12), st.text(max_size=5), st.none()),
        "temperature": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.none()),
        "stream": st.just(False),
        "n": st.integers(min_value=-1, max_value=3),
    }).map(lambda v: json.dumps(v).encode()),
))
def test_fuzzed_bodies_get_only_4xx(mesh: Mesh, body: bytes) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(mesh.gateway_url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {mesh.dev_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    if status == 200:  # a body that happened to be valid (n=1, tiny max_tokens)
        assert json.loads(payload)["object"] == "chat.completion"
        return
    assert 400 <= status < 500, (status, body, payload)
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


async def test_gateway_returns_to_baseline_after_fuzz(mesh: Mesh) -> None:
    # runs after the fuzz test: no stream left open
    async with aiohttp.ClientSession(mesh.gateway_url) as http, http.get("/metrics") as r:
        text = await r.text()
    line = next(ln for ln in text.splitlines() if ln.startswith("meshserve:gateway_streams_in_flight "))
    assert float(line.split()[1]) == 0


async def test_only_a_resumable_request_can_be_streamed_again(mesh: Mesh) -> None:
    """A request sent without X-Meshserve-Resumable has no resume record (its client's
    disconnect cancels it): GET …/stream answers 404 while it runs, as for an unknown id."""
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "one viewer", "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        async with http.post("/v1/completions", json=body, headers=headers) as r:
            request_id = r.headers["X-Request-Id"]
            await read_sse(r, limit=2)
            await asyncio.sleep(0.3)  # a record, were one kept, is stored just after the placement
            async with http.get(f"/v1/requests/{request_id}/stream", headers=headers) as again:
                assert again.status == 404, await again.text()
                assert (await again.json())["error"]["code"] == "not_found"
            rest = await read_sse(r)  # its own client still gets the whole stream
        assert rest and rest[-1][1] == "[DONE]"


async def test_a_request_no_longer_resumable_cannot_be_streamed_again(mesh: Mesh) -> None:
    """A resumable request whose client was cut for reading too slowly is cancelled, and
    its stored record says it is no longer resumable: GET …/stream then answers 404 on
    every gateway, as for an unknown id, instead of replaying a cancelled request."""
    from proto import RequestRecord, decode, encode

    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "cut me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    bus = await Bus.open(mesh.settings, "test-records", initial_attempts=10)
    try:
        kv = await bus.js.key_value(bus.subjects.requests_bucket)
        async with aiohttp.ClientSession(mesh.gateway_url) as http:
            async with http.post("/v1/completions", json=body, headers={**headers, "X-Meshserve-Resumable": "true"}) as r:
                request_id = r.headers["X-Request-Id"]
                await read_sse(r, limit=2)
                async with http.get(f"/v1/requests/{request_id}/stream", headers=headers) as again:
                    assert again.status == 200  # resumable: a second viewer may follow it
                # What the gateway stores when it cuts a slow client.
                record = decode((await kv.get(request_id)).value or b"", RequestRecord)
                record.resumable = False
                await kv.put(request_id, encode(record))
                async with http.get(f"/v1/requests/{request_id}/stream", headers=headers) as again:
                    assert again.status == 404, await again.text()
                    assert (await again.json())["error"]["code"] == "not_found"
    finally:
        await bus.close()


async def test_a_bearer_token_past_8k_gets_an_openai_error(mesh: Mesh) -> None:
    """aiohttp refuses a header over 8,190 bytes with a plain-text 400 before any handler
    runs; an OIDC token with many claims can be that long. The gateway reads it, and a
    token it does not know is OpenAI's 401 JSON."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        async with http.post("/v1/completions", json=body, headers={"Authorization": "Bearer " + "a" * 20_000}) as r:
            assert r.status == 401, await r.text()
            assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_a_request_line_past_8k_gets_an_openai_error(mesh: Mesh) -> None:
    """aiohttp refused a request line over 8,190 bytes with a plain-text 400 (a long model id)."""
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        async with http.get("/v1/models/" + "m" * 20_000, headers=headers) as r:
            assert r.status == 404, await r.text()
            assert (await r.json())["error"]["code"] == "model_not_found"


async def test_a_request_id_no_request_can_have_is_a_404(mesh: Mesh) -> None:
    """Ids that are not bucket keys ("a b", "a>b", a NUL) were a 500 and a traceback."""
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for quoted in ("a%20b", "a*b", "a%3Eb", "%00", "%ff"):
            async with http.get(f"/v1/requests/{quoted}/stream", headers=headers) as r:
                assert r.status == 404, (quoted, await r.text())
                assert (await r.json())["error"]["code"] == "not_found"


async def test_kill_and_resume_joins_to_the_uninterrupted_text(mesh: Mesh) -> None:
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "resume me", "max_tokens": 400, "seed": 99, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        async with http.post("/v1/completions", json=body, headers=headers) as r:
            uninterrupted = await read_sse(r)
        # second run, resumable: cut after a few events
        async with http.post("/v1/completions", json=body, headers={**headers, "X-Meshserve-Resumable": "true"}) as r:
            request_id = r.headers["X-Request-Id"]
            first = await read_sse(r, limit=3)
        # the connection is closed: the worker keeps generating, tokens wait in JetStream
        await asyncio.sleep(0.3)
        async with http.get(f"/v1/requests/{request_id}/stream", headers={**headers, "Last-Event-ID": first[-1][0]}) as r:
            assert r.status == 200
            rest = await read_sse(r)
        # another key may not read it
        async with http.get(f"/v1/requests/{request_id}/stream", headers={"Authorization": "Bearer msk-000000000000-" + "y" * 43}) as r:
            assert r.status == 401
        other_key = await _second_key(mesh)
        async with http.get(f"/v1/requests/{request_id}/stream", headers={"Authorization": f"Bearer {other_key}"}) as r:
            assert r.status == 404
    joined = first + rest
    ids = [e for e, _ in joined]
    assert len(ids) == len(set(ids)), "an event was repeated"
    assert sse_text(joined) == sse_text(uninterrupted) and len(sse_text(joined)) == 400
    assert joined[-1][1] == "[DONE]" and json.loads(joined[-2][1])["usage"]["completion_tokens"] == 400


async def _second_key(mesh: Mesh) -> str:
    from ops.keys import create_key

    bus = await Bus.open(mesh.settings, "test-keys", initial_attempts=10)
    try:
        key, _ = await create_key(bus, org="other-org")
    finally:
        await bus.close()
    await asyncio.sleep(0.3)  # the gateway's key watcher picks it up
    return key


async def test_client_disconnect_cancels_the_worker(mesh: Mesh) -> None:
    headers = {"Authorization": f"Bearer {mesh.dev_key}"}
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    bus = await Bus.open(mesh.settings, "test-observer", initial_attempts=10)
    try:
        async with aiohttp.ClientSession(mesh.gateway_url) as http:
            async with http.post("/v1/completions", json=body, headers=headers) as r:
                request_id = r.headers["X-Request-Id"]
                await read_sse(r, limit=2)
        # the final chunk of that request says it was aborted, long before 3000 tokens
        from services.gateway.streams import TokenDispatcher

        replay = TokenDispatcher(bus, "observer").replay(bus.subjects.tokens_of_request(request_id), idle_timeout_s=10)
        final = None
        async for chunk in replay:
            final = chunk
        assert final is not None and final.finish_reason == "abort"
        assert final.usage is not None and final.usage.completion_tokens < 3000
    finally:
        await bus.close()


async def test_websocket_multiplexes_requests_and_cancels(mesh: Mesh) -> None:
    async with aiohttp.ClientSession(mesh.gateway_url) as http, http.ws_connect("/v1/ws") as ws:
        await ws.send_json({"type": "chat.completion", "id": "early", "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}})
        error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["status"] == 401
        await ws.send_json({"type": "auth", "api_key": mesh.dev_key})
        await ws.send_json({"type": "chat.completion", "id": "a", "body": {"model": MODEL, "messages": [{"role": "user", "content": "one"}], "max_tokens": 20, "ignore_eos": True}})
        await ws.send_json({"type": "completion", "id": "b", "body": {"model": MODEL, "prompt": "two", "max_tokens": 2000, "ignore_eos": True}})
        await ws.send_json({"type": "completion", "id": "c", "body": {"model": MODEL, "prompt": "", "max_tokens": 5}})
        done: dict[str, dict] = {}
        text: dict[str, str] = {"a": "", "b": ""}
        cancelled = False
        while len(done) < 3:
            message = await ws.receive_json(timeout=30)
            if message["type"] == "token":
                text[message["id"]] += message["text"]
                if message["id"] == "b" and not cancelled:
                    await ws.send_json({"type": "cancel", "id": "b"})
                    cancelled = True
            else:
                done[message["id"]] = message
        assert done["a"]["type"] == "done" and done["a"]["usage"]["completion_tokens"] == 20 and len(text["a"]) == 20
        assert done["b"]["type"] == "done" and done["b"]["finish_reason"] == "abort"
        assert done["c"]["type"] == "error" and done["c"]["status"] == 400


async def test_a_websocket_message_nested_past_the_decoder_is_an_error_frame(mesh: Mesh) -> None:
    """Its id was looked for by decoding it again, which ran out of stack: the socket died
    (an HTTP 500 written onto the upgraded connection). Now an error frame, and the
    socket serves the next request."""
    deep = '{"x":' + "[" * 2000 + "]" * 2000 + "}"
    async with aiohttp.ClientSession(mesh.gateway_url) as http, http.ws_connect("/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": mesh.dev_key})
        await ws.send_str(deep)
        error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["status"] == 400
        await ws.send_json({"type": "completion", "id": "next", "body": {"model": MODEL, "prompt": "still here",
                                                                          "max_tokens": 3, "ignore_eos": True}})
        while (message := await ws.receive_json(timeout=30))["type"] == "token":
            pass
        assert message["type"] == "done" and message["id"] == "next"


async def test_nats_request_reply_api(mesh: Mesh) -> None:
    nc = await nats.connect(mesh.nats_url)
    try:
        headers = {"Authorization": f"Bearer {mesh.dev_key}"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "ignore_eos": True}
        reply = await nc.request("mesh.api.v1.chat.completions", json.dumps(body).encode(), headers=headers, timeout=30)
        response = json.loads(reply.data)
        assert response["object"] == "chat.completion" and response["usage"]["completion_tokens"] == 10

        bad = await nc.request("mesh.api.v1.chat.completions", json.dumps(body).encode(), timeout=10)
        assert bad.headers and bad.headers["Nats-Service-Error-Code"] == "401"

        inbox = nc.new_inbox()
        chunks: list[dict] = []
        finished = asyncio.Event()

        async def on_message(msg):  # type: ignore[no-untyped-def]
            chunks.append(json.loads(msg.data))
            if msg.headers and msg.headers.get("Meshserve-Done") == "1":
                finished.set()

        await nc.subscribe(inbox, cb=on_message)
        stream_body = {**body, "stream": True, "max_tokens": 25, "stream_options": {"include_usage": True}}
        await nc.publish("mesh.api.v1.chat.completions", json.dumps(stream_body).encode(), reply=inbox, headers=headers)
        await asyncio.wait_for(finished.wait(), 30)
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
        assert len(content) == 25 and chunks[-1]["usage"]["completion_tokens"] == 25
    finally:
        await nc.close()


def test_keys_cli_create_list_revoke(mesh: Mesh) -> None:
    env_args = ["--nats-url", mesh.nats_url]
    run = lambda *a: subprocess.run([sys.executable, "-m", "ops.cli", "keys", *env_args, *a], capture_output=True, text=True, cwd=ROOT, check=True)  # noqa: E731
    created = run("create", "--org", "acme", "--tier", "standard")
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("msk-")
    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key=key, max_retries=0)
    assert client.models.list().data
    key_id = key.split("-")[1]
    assert key_id in run("list").stdout and key not in run("list").stdout
    run("revoke", key_id)
    for _ in range(50):  # the gateway's key watcher sees the revocation
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        import time

        time.sleep(0.1)
    else:
        pytest.fail("revoked key still accepted")




@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_chat_page_streams_a_reply_in_headless_chromium(mesh: Mesh, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page()
            page.goto(mesh.gateway_url + "/")
            page.wait_for_selector("#key-panel:not([hidden])")  # it opens asking for the key
            # served by meshserve up's mesh on loopback, it offers the development key
            page.wait_for_selector("#use-dev-key:not([hidden])", timeout=15_000)
            page.click("#use-dev-key")
            page.wait_for_selector("#model option", state="attached")  # no eval: the page's CSP forbids it
            page.fill("#prompt", "Hello from a browser")
            page.click("#send")
            page.wait_for_selector(".reply[data-state=done]", timeout=30_000)
            text = page.inner_text(".reply[data-state=done] .reply-text")
            stats = page.inner_text(".reply[data-state=done] .reply-stats")
            page.screenshot(path=str(tmp_path / "chat.png"))
            assert text.strip(), "no streamed text appeared"
            assert "TTFT" in stats or "ms" in stats
            # a bad key is answered in words and asked for again
            page.click("#change-key")
            page.fill("#api-key", "msk-000000000000-" + "z" * 43)
            page.click("#save-key")
            page.wait_for_selector("#key-message:not([hidden])", timeout=15_000)
            assert "not accepted" in page.inner_text("#key-message")
        finally:
            browser.close()


async def test_usage_endpoint_reports_the_callers_org_only(mesh: Mesh, client: openai.OpenAI) -> None:
    made = client.completions.create(model=MODEL, prompt="bill me", max_tokens=7, extra_body={"ignore_eos": True})
    assert made.usage is not None
    other = await _second_key(mesh)
    async with aiohttp.ClientSession(mesh.gateway_url) as http:
        for _ in range(50):  # metering writes asynchronously from the USAGE stream
            async with http.get("/v1/usage", headers={"Authorization": f"Bearer {mesh.dev_key}"}) as r:
                assert r.status == 200
                report = await r.json()
            if report["data"] and sum(row["completion_tokens"] for row in report["data"]) >= 7:
                break
            await asyncio.sleep(0.2)
        rows = report["data"]
        assert rows and all(row.get("model") == MODEL for row in rows)
        assert sum(row["requests"] for row in rows) >= 1
        async with http.get("/v1/usage", headers={"Authorization": f"Bearer {other}"}) as r:
            assert r.status == 200 and (await r.json())["data"] == []
        async with http.get("/v1/usage?bogus=1", headers={"Authorization": f"Bearer {mesh.dev_key}"}) as r:
            assert r.status == 400 and "error" in await r.json()
