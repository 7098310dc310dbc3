"""The WebSocket front door's hold on its sockets: the credential is checked again before each
request (a revoked key, an expired token), a socket must authenticate in time, a key offered
as OpenAI Realtime's subprotocol is taken and never logged, a reader that stopped reading is
cut, and frames name the mesh request id. A sim worker and the gateway run as tasks in this
process, on a real nats-server."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from bus import Bus, BusSettings
from bus.keys import KeyStore
from services.gateway import ws_api
from services.gateway.apikeys import parse_key
from services.gateway.oidc import OidcConfig
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.service import WorkerService
from tests.conftest import eventually
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker
from tests.integration.test_oidc import AUDIENCE, Issuer

BODY: dict[str, Any] = {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


@pytest.fixture
async def key(bus: Bus, gateway: GatewayService) -> str:
    return await known_key(bus, gateway, "ws-org")


async def _complete(ws: aiohttp.ClientWebSocketResponse, request_id: str) -> list[dict[str, Any]]:
    await ws.send_json({"type": "completion", "id": request_id, "body": BODY})
    frames = [await ws.receive_json(timeout=20)]
    while frames[-1]["type"] == "token":
        frames.append(await ws.receive_json(timeout=20))
    return frames


async def _closed(ws: aiohttp.ClientWebSocketResponse) -> int | None:
    message = await ws.receive(timeout=10)
    assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
    return ws.close_code


async def test_a_key_revoked_while_its_socket_is_open_is_refused_and_the_socket_closed(
        bus: Bus, gateway: GatewayService, key: str) -> None:
    parsed = parse_key(key)
    assert parsed is not None
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": key})
        assert (await _complete(ws, "before"))[-1]["type"] == "done"
        assert await (await KeyStore(bus).open()).revoke(parsed.key_id)
        await eventually(lambda: gateway.auth.records[parsed.key_id].revoked, what="the gateway to see the revocation")
        await ws.send_json({"type": "completion", "id": "after", "body": BODY})
        error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["id"] == "after" and error["status"] == 401, error
        assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION


async def test_a_token_past_its_expiry_is_refused_and_the_socket_closed(
        bus_settings: BusSettings, worker: WorkerService) -> None:
    issuer = Issuer()
    issuer.add_key("rsa-1", rsa.generate_private_key(public_exponent=65537, key_size=2048), "RS256", RSAAlgorithm)
    await issuer.start()
    oidc = OidcConfig(issuer=issuer.url, audience=(AUDIENCE,), leeway_s=0.0)
    try:
        async with gateway_service(bus_settings, GatewayConfig(port=0, oidc=oidc)) as gateway:
            async with aiohttp.ClientSession() as http:
                # First, with a token that outlives the wait, until the worker is listed (the
                # short-lived token's few seconds must not go on start-up on a loaded machine).
                async with http.ws_connect(f"{gateway.http_url}/v1/ws") as warm:
                    await warm.send_json({"type": "auth", "api_key": issuer.sign("rsa-1", exp=time.time() + 120)})
                    for _ in range(200):
                        if (await _complete(warm, "warm"))[-1]["type"] == "done":
                            break
                        await asyncio.sleep(0.1)
            expires = time.time() + 6
            token = issuer.sign("rsa-1", exp=expires)
            async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": token})
                frames = await _complete(ws, "before")
                assert frames[-1]["type"] == "done", frames
                await asyncio.sleep(max(0.0, expires - time.time()) + 0.5)  # the token's exp passes
                await ws.send_json({"type": "completion", "id": "after", "body": BODY})
                error = await ws.receive_json(timeout=10)
                assert error["status"] == 401 and "expired" in error["error"]["message"], error
                assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION
    finally:
        await issuer.stop()


async def test_a_key_offered_as_a_subprotocol_authenticates_and_never_reaches_a_log(
        gateway: GatewayService, key: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = key.rsplit("-", 1)[1]
    keyed = f"openai-insecure-api-key.{key}"
    async with aiohttp.ClientSession() as http:
        # As OpenAI's Realtime browser clients offer it: the server answers "realtime".
        async with http.ws_connect(f"{gateway.http_url}/v1/ws", protocols=("realtime", keyed)) as ws:
            assert ws.protocol == "realtime"
            assert (await _complete(ws, "a"))[-1]["type"] == "done"
        # The key alone: a browser needs one of its offers selected, so that one is answered.
        async with http.ws_connect(f"{gateway.http_url}/v1/ws", protocols=(keyed,)) as ws:
            assert ws.protocol == keyed
            assert (await _complete(ws, "b"))[-1]["type"] == "done"
        # A wrong key offered that way is refused like any other, and not logged either.
        wrong = key[:-4] + "AAAA"
        async with http.ws_connect(f"{gateway.http_url}/v1/ws", protocols=(f"openai-insecure-api-key.{wrong}",)) as ws:
            error = await ws.receive_json(timeout=10)
            assert error["status"] == 401
            assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in logged and wrong.rsplit("-", 1)[1] not in logged


async def test_a_socket_that_does_not_authenticate_in_time_is_closed(
        gateway: GatewayService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws_api, "AUTH_TIMEOUT_S", 0.5, raising=False)
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws", autoping=True) as ws:
        error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["id"] is None and error["status"] == 401, error
        assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION


async def test_a_bad_key_in_the_query_closes_with_policy_violation(gateway: GatewayService) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws",
                                                                params={"api_key": "msk-nope"}) as ws:
        error = await ws.receive_json(timeout=10)
        assert error["status"] == 401
        assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION


async def test_a_bad_key_in_an_auth_frame_closes_with_policy_violation(gateway: GatewayService,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """As README says and a bad key anywhere else does: it stayed open, taking guesses
    until the auth deadline (one frame of 401 each), then closed for want of a key."""
    monkeypatch.setattr(ws_api, "AUTH_TIMEOUT_S", 30.0, raising=False)
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": "msk-nope"})
        error = await ws.receive_json(timeout=10)
        assert error["type"] == "error" and error["status"] == 401, error
        assert await _closed(ws) == aiohttp.WSCloseCode.POLICY_VIOLATION


async def test_done_and_error_frames_name_the_mesh_request_id(gateway: GatewayService, key: str) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gateway.http_url}/v1/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": key})
        first, second = (await _complete(ws, "a"))[-1], (await _complete(ws, "b"))[-1]
    for done in (first, second):
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 3  # the old fields stay
        assert re.fullmatch(r"[0-9a-f]{24}", done["request_id"]), done
    assert first["request_id"] != second["request_id"]


def _masked_text_frame(text: str) -> bytes:
    payload = text.encode()
    header = bytes([0x81])
    if len(payload) < 126:
        header += bytes([0x80 | len(payload)])
    else:
        header += bytes([0x80 | 126]) + struct.pack("!H", len(payload))
    return header + b"\0\0\0\0" + payload  # a zero mask leaves the payload as it is


async def test_a_reader_that_stops_reading_is_cut_and_its_request_cancelled(
        bus_settings: BusSettings, bus: Bus) -> None:
    """A raw client with a small receive window that never reads: the gateway's sends block,
    the request's chunks pile up past the buffer, and the socket is cut as an SSE reader's is
    (not left to the heartbeat, which would take 45 s)."""
    async with sim_worker(bus_settings, speed=50.0, max_model_len=16384) as _, \
            gateway_service(bus_settings, GatewayConfig(port=0, stream_buffer_chunks=16)) as gateway:
        key = await known_key(bus, gateway, "ws-slow-org")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", gateway.bound_port))
        try:
            await loop.sock_sendall(sock, (
                f"GET /v1/ws?api_key={key} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode())
            # Logprobs make each token frame large: the send buffers fill within a few hundred tokens.
            body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 12000,
                    "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
            await loop.sock_sendall(sock, _masked_text_frame(msgspec.json.encode(
                {"type": "chat.completion", "id": "slow", "body": body}).decode()))

            def cut() -> bool:
                return any(s.value >= 1 for m in gateway.metrics.errors.collect() for s in m.samples
                           if s.labels.get("code") == "slow_client" and s.name.endswith("_total"))

            # Well within the 45 s the heartbeat would take to notice.
            await eventually(cut, timeout=30, what="the stalled reader to be cut")
            await eventually(lambda: gateway.streams_in_flight == 0, timeout=10, what="the request to end")
        finally:
            sock.close()
