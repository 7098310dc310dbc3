"""Bearer JWTs at a real gateway: a local OIDC issuer (discovery document and JWKS served by
aiohttp on a free port, keys generated here), a sim worker, admission, and the stock
``openai`` client with a JWT as its api_key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import openai
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from bus import Bus, BusSettings
from ops.keys import create_key
from services.admission.service import AdmissionService
from services.gateway.jwks import JwksUnavailable, jwks_fetcher
from services.gateway.oidc import OidcConfig, TierLimits, synthetic_key_id
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import usage_events

MODEL = "sim-llama-8b"
AUDIENCE = "meshserve-test"


class Issuer:
    """An OIDC issuer on loopback: ``/.well-known/openid-configuration`` and ``/jwks``."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[Any, str, Any]] = {}  # kid → (private key, alg, JWK algorithm)
        self.jwks_fetches = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    def add_key(self, kid: str, private: Any, alg: str, algorithm: Any) -> None:
        self.keys[kid] = (private, alg, algorithm)

    def sign(self, kid: str, **claims: Any) -> str:
        private, alg, _ = self.keys[kid]
        now = time.time()
        body = {"iss": self.url, "aud": AUDIENCE, "sub": "alice", "org": "oidc-org", "iat": now, "exp": now + 300}
        body.update(claims)
        return jwt.encode({k: v for k, v in body.items() if v is not None}, private, algorithm=alg,
                          headers={"kid": kid})

    async def start(self) -> None:
        async def discovery(_: web.Request) -> web.Response:
            return web.json_response({"issuer": self.url, "jwks_uri": f"{self.url}/jwks"})

        async def jwks(_: web.Request) -> web.Response:
            self.jwks_fetches += 1
            keys = [{**json.loads(algorithm.to_jwk(private.public_key())), "kid": kid, "use": "sig"}
                    for kid, (private, _, algorithm) in self.keys.items()]
            return web.json_response({"keys": keys})

        app = web.Application()
        app.add_routes([web.get("/.well-known/openid-configuration", discovery), web.get("/jwks", jwks)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def issuer() -> AsyncIterator[Issuer]:
    server = Issuer()
    server.add_key("rsa-1", rsa.generate_private_key(public_exponent=65537, key_size=2048), "RS256", RSAAlgorithm)
    await server.start()
    yield server
    await server.stop()


class FrozenClock:
    """Admission's wall clock, still: no bucket refills during the test."""

    def __call__(self) -> float:
        return 1_700_000_000.0


@pytest.fixture
async def gateway(bus_settings: BusSettings, issuer: Issuer) -> AsyncIterator[GatewayService]:
    started: list[Any] = []
    try:
        worker = WorkerService(SimEngine(model=MODEL, speed=50.0), WorkerConfig(worker_id="w1"), bus_settings)
        await worker.start()
        started.append(worker)
        admission = AdmissionService(settings=bus_settings, clock=FrozenClock())
        await admission.start()
        started.append(admission)
        # min_refetch_s 0: the rotation below refetches at once (the throttle has its unit test).
        oidc = OidcConfig(issuer=issuer.url, audience=(AUDIENCE,), min_refetch_s=0.0,
                          tiers={"standard": TierLimits(tpm=100_000), "premium": TierLimits()})
        service = GatewayService(GatewayConfig(port=0, oidc=oidc), bus_settings)
        await service.start()
        started.append(service)
        yield service
    finally:
        for service in reversed(started):
            with contextlib.suppress(Exception):
                await service.drain_and_close()


def client(gateway: GatewayService, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=api_key, max_retries=0)


BODY: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "extra_body": {"ignore_eos": True}}


async def test_a_jwt_caller_is_served_and_bad_tokens_get_openais_401(gateway: GatewayService, issuer: Issuer) -> None:
    async with client(gateway, issuer.sign("rsa-1")) as good:
        done = await good.completions.create(**BODY)
        assert done.usage is not None and done.usage.completion_tokens == 5

    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = jwt.encode({"iss": issuer.url, "aud": AUDIENCE, "sub": "mallory", "org": "oidc-org",
                         "exp": time.time() + 300}, other_key, algorithm="RS256", headers={"kid": "rsa-1"})
    payload = issuer.sign("rsa-1").split(".")[1]
    unsigned = ".".join([jwt.utils.base64url_encode(b'{"alg":"none","kid":"rsa-1"}').decode(), payload, ""])
    bad = {
        "the token has expired": issuer.sign("rsa-1", iat=time.time() - 7200, exp=time.time() - 3600),
        "the token's audience (aud) is not this gateway": issuer.sign("rsa-1", aud="another-app"),
        "the token's signature does not verify": forged,
        "unsigned tokens (alg none) are not accepted": unsigned,
    }
    for reason, token in bad.items():
        async with client(gateway, token) as refused:
            with pytest.raises(openai.AuthenticationError) as info:
                await refused.completions.create(**BODY)
        assert info.value.status_code == 401
        assert info.value.response.json() == {"error": {
            "message": f"Invalid bearer token: {reason}.", "type": "invalid_request_error", "param": None,
            "code": "invalid_api_key"}}

    # The other front door: the WebSocket authenticates through the same path.
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/ws"
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, params={"api_key": bad["the token has expired"]}) as ws:
            error = await ws.receive_json(timeout=10)
            assert error["status"] == 401 and "expired" in error["error"]["message"]
        async with http.ws_connect(url) as ws:
            await ws.send_json({"type": "auth", "api_key": issuer.sign("rsa-1")})
            await ws.send_json({"type": "completion", "id": "a",
                                "body": {"model": MODEL, "prompt": "ws", "max_tokens": 3, "ignore_eos": True}})
            while (message := await ws.receive_json(timeout=30))["type"] == "token":
                pass
            assert message["type"] == "done" and message["usage"]["completion_tokens"] == 3


async def test_a_rotated_signing_key_is_picked_up(gateway: GatewayService, issuer: Issuer) -> None:
    issuer.add_key("ec-2", ec.generate_private_key(ec.SECP256R1()), "ES256", ECAlgorithm)  # published after start
    fetches = issuer.jwks_fetches
    async with client(gateway, issuer.sign("ec-2")) as rotated:
        done = await rotated.completions.create(**BODY)
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert issuer.jwks_fetches == fetches + 1  # one refetch, for the unknown kid
    issuer.keys.pop("ec-2")
    async with client(gateway, issuer.sign("rsa-1")) as old:  # the cache still has the old key
        assert (await old.completions.create(**BODY)).usage is not None


async def test_an_unreachable_issuer_leaves_known_keys_working(gateway: GatewayService, issuer: Issuer) -> None:
    token = issuer.sign("rsa-1")
    issuer.add_key("new", ec.generate_private_key(ec.SECP256R1()), "ES256", ECAlgorithm)
    unknown = issuer.sign("new")
    await issuer.stop()
    async with client(gateway, token) as known:
        assert (await known.completions.create(**BODY)).usage is not None
    async with client(gateway, unknown) as not_known:
        with pytest.raises(openai.AuthenticationError) as info:
            await not_known.completions.create(**BODY)
    assert "is not one the issuer publishes" in info.value.message


async def _eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_jwt_caller_is_limited_and_billed_under_its_own_key_id(
    gateway: GatewayService, issuer: Issuer, bus: Bus
) -> None:
    """rpm from the token's claim, tpm from its tier's default; usage under the synthetic key id."""
    async with client(gateway, issuer.sign("rsa-1", sub="bob", rpm=2, org="bob-org")) as bob:
        for _ in range(2):
            assert (await bob.completions.create(**BODY)).usage is not None
        with pytest.raises(openai.RateLimitError):
            await bob.completions.create(**BODY)
    # Another caller of the same org has its own bucket, and an API key of that org is untouched.
    async with client(gateway, issuer.sign("rsa-1", sub="carol", org="bob-org")) as carol:
        assert (await carol.completions.create(**BODY)).usage is not None
    key, record = await create_key(bus, org="bob-org")

    async def key_seen() -> bool:
        return record.key_id in gateway.keys.records

    await _eventually(key_seen, "the gateway to see the new key")
    async with client(gateway, key) as with_key:
        assert (await with_key.completions.create(**BODY)).usage is not None

    bob_id = synthetic_key_id(issuer.url, "bob")

    async def billed() -> bool:
        return len([e for e in await usage_events(bus) if e.key_id == bob_id and e.status == "length"]) == 2

    await _eventually(billed, "bob's usage events")
    events = [e for e in await usage_events(bus) if e.key_id == bob_id]
    assert {e.org for e in events} == {"bob-org"} and {e.tier for e in events} == {"standard"}
    assert sum(e.completion_tokens for e in events) == 10  # the refused third one generated nothing


async def test_a_static_jwks_file_serves_air_gapped_sites_and_is_reread(
    bus_settings: BusSettings, issuer: Issuer, tmp_path: Path
) -> None:
    """No issuer to reach: the JWKS comes from a file, and a key added to it is found."""
    def write_jwks() -> None:
        keys = [{**json.loads(algorithm.to_jwk(private.public_key())), "kid": kid}
                for kid, (private, _, algorithm) in issuer.keys.items()]
        path.write_text(json.dumps({"keys": keys}))

    path = tmp_path / "jwks.json"
    write_jwks()
    await issuer.stop()  # nothing listens at the issuer's URL
    worker = WorkerService(SimEngine(model=MODEL, speed=50.0), WorkerConfig(worker_id="w-file"), bus_settings)
    await worker.start()
    oidc = OidcConfig(issuer=issuer.url, audience=(AUDIENCE,), jwks_file=str(path), min_refetch_s=0.0)
    gateway = GatewayService(GatewayConfig(port=0, oidc=oidc), bus_settings)
    await gateway.start()
    try:
        async with client(gateway, issuer.sign("rsa-1")) as caller:
            assert (await caller.completions.create(**BODY)).usage is not None
        issuer.add_key("ec-file", ec.generate_private_key(ec.SECP256R1()), "ES256", ECAlgorithm)
        async with client(gateway, issuer.sign("ec-file")) as caller:
            with pytest.raises(openai.AuthenticationError):  # not in the file yet
                await caller.completions.create(**BODY)
            write_jwks()
            assert (await caller.completions.create(**BODY)).usage is not None
    finally:
        await gateway.drain_and_close()
        await worker.drain_and_close()


async def test_discovery_refuses_a_document_for_another_issuer(issuer: Issuer) -> None:
    config = OidcConfig(issuer=issuer.url + "/realms/other", audience=(AUDIENCE,))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(JwksUnavailable, match="404"):  # that issuer has no discovery document here
            await jwks_fetcher(config, session)()
        keys = await jwks_fetcher(OidcConfig(issuer=issuer.url, audience=(AUDIENCE,)), session)()
        assert list(keys) == ["rsa-1"]
        wrong = OidcConfig(issuer=issuer.url + "/", audience=(AUDIENCE,))  # discovery answers for issuer.url
        with pytest.raises(JwksUnavailable, match="names issuer"):
            await jwks_fetcher(wrong, session)()
