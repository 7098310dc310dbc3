"""meshserve's NATS accounts config on a real nats-server.

The permissions come from ``ops.nats.accounts`` (the one definition); here they are
rendered with literal passwords for a loopback server. The whole mesh runs in this process
with one NATS user per service, serves requests over HTTP and over the NATS API, meters
them and answers status; the server must log no permission violation. An API client user
can request ``mesh.api.>`` and read its own inbox, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from bus import Bus, BusSettings
from ops.keys import create_key
from ops.nats import accounts
from ops.natsserver import nats_server_binary
from ops.status import fetch_status
from proto import WorkerInfo, encode
from proto.metering import FleetQuery, FleetReport, UsageQuery, UsageReport
from proto.subjects import Subjects
from services.admission.config import AdmissionConfig
from services.admission.service import AdmissionService
from services.autoscaler.control import PoolPolicy
from services.autoscaler.drivers import Driver, Launch, WorkerRef
from services.autoscaler.service import AutoscalerConfig, AutoscalerService
from services.gateway.service import GatewayConfig, GatewayService
from services.metering.service import MeteringConfig, MeteringService
from services.router.service import RouterService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.deploy.natsauth import PASSWORDS, AuthNatsServer, settings_for

MODEL = "sim-llama-8b"
HERE = Path(accounts.__file__).resolve().parent


class IdleDriver(Driver):
    """The autoscaler's actuator is not under test here: it never needs to act."""

    name = "idle"

    async def start(self, pool: str, count: int) -> Launch:
        self.succeeded()
        return Launch(0)

    async def stop(self, ref: WorkerRef) -> None:
        self.succeeded()

    async def stopped(self, ref: WorkerRef) -> None:
        self.succeeded()

    def describe(self) -> str:
        return "idle"


async def eventually(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


class Violations:
    """Permission errors one client connection was told about (nats-py's error callback)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def callback(self, exc: Exception) -> None:
        self.errors.append(str(exc))

    async def wait_for(self, fragment: str, timeout: float = 3.0) -> None:
        await eventually(lambda: any(fragment.lower() in e.lower() for e in self.errors), f"a violation for {fragment}", timeout)


async def client(server: AuthNatsServer, user: str, **options: Any) -> tuple[nats.NATS, Violations]:
    violations = Violations()
    nc = await nats.connect(server.url, user=user, password=PASSWORDS[user], error_cb=violations.callback,
                            allow_reconnect=False, **options)
    return nc, violations


# ----------------------------------------------------------------------- generated files


def test_checked_in_configs_are_generated_from_the_definitions() -> None:
    for name, text in accounts.generated_files().items():
        assert (HERE / name).read_text() == text, f"ops/nats/{name} is stale: run python -m ops.nats.accounts --write"


def test_wildcards_follow_the_subject_layout() -> None:
    s = Subjects("mesh")
    assert accounts.wildcard(s.worker_generate, 1) == "mesh.worker.*.generate"
    assert accounts.wildcard(s.tokens, 2) == "mesh.tokens.*.*"
    assert accounts.wildcard(s.usage, 1) == "mesh.usage.*"
    other = accounts.service_permissions(Subjects("blue"))
    assert "blue.worker.*.generate" in other["worker"].subscribe_subjects
    assert "$KV.blue_workers.>" in other["worker"].publish_subjects


def test_cluster_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    """nats-server -t accepts the compose cluster node config with its accounts include."""
    (tmp_path / "cluster.conf").write_text((HERE / "cluster.conf").read_text().replace("/data/jetstream", str(tmp_path / "js")))
    (tmp_path / "accounts.conf").write_text((HERE / "accounts.conf").read_text())
    env = {"NATS_SERVER_NAME": "nats-1", **{accounts.password_env(u): "x" for u in PASSWORDS}}
    result = subprocess.run([nats_server_binary(), "-t", "-c", str(tmp_path / "cluster.conf")], env=env,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- API client


async def test_api_client_reaches_only_the_api_and_its_own_inbox(auth_server: AuthNatsServer) -> None:
    s = Subjects("mesh")
    nc, violations = await client(auth_server, "app", inbox_prefix=accounts.inbox_prefix("app"))
    try:
        # Its own inbox: allowed (a request's reply arrives there; here a no-responders reply).
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(s.api_chat, b"{}", timeout=2.0)
        assert violations.errors == []
        for subject in ("mesh.tokens.>", "_INBOX.>", "_INBOX_other-app.>", "mesh.usage.>", "mesh.gauges.>", "$KV.mesh_keys.>"):
            await nc.subscribe(subject)
            await violations.wait_for(f'subscription to "{subject}"')
        for subject in ("mesh.worker.w1.generate", "mesh.admission.check", "$JS.API.STREAM.DELETE.USAGE",
                        "$KV.mesh_keys.forged", "mesh.tokens.gw.rid"):
            await nc.publish(subject, b"x")
            await violations.wait_for(f'publish to "{subject}"')
    finally:
        await nc.close()
    # A client that uses the default inbox prefix cannot even receive its replies.
    plain, plain_violations = await client(auth_server, "app")
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await plain.request(s.api_chat, b"{}", timeout=0.5)
        await plain_violations.wait_for("subscription to")
    finally:
        await plain.close()


async def test_service_users_are_confined(auth_server: AuthNatsServer) -> None:
    cases = {
        "worker": (["mesh.admission.check", "$JS.API.STREAM.DELETE.USAGE", "$KV.mesh_keys.x"], ["mesh.api.>", "mesh.usage.>"]),
        "gateway": (["mesh.worker.w1.control", "$JS.API.STREAM.PURGE.TOKENS", "$KV.mesh_keys.x"], ["mesh.usage.>", "mesh.gauges.>"]),
        "router": (["mesh.tokens.gw.r", "mesh.usage.org"], ["mesh.tokens.>", "mesh.api.>"]),
        "metering": (["mesh.usage.org", "$JS.API.STREAM.DELETE.USAGE"], ["mesh.tokens.>"]),
    }
    for user, (publishes, subscribes) in cases.items():
        nc, violations = await client(auth_server, user)
        try:
            for subject in publishes:
                await nc.publish(subject, b"x")
                await violations.wait_for(f'publish to "{subject}"')
            for subject in subscribes:
                await nc.subscribe(subject)
                await violations.wait_for(f'subscription to "{subject}"')
        finally:
            await nc.close()


# --------------------------------------------------------------------- the mesh, one user each


@pytest.fixture
async def mesh(auth_server: AuthNatsServer, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    services: dict[str, Any] = {}
    ops = await Bus.open(settings_for(auth_server, "ops"), "ops-test", initial_attempts=20)
    try:
        services["worker"] = WorkerService(SimEngine(model=MODEL, speed=50.0),
                                           WorkerConfig(worker_id="w1", gauge_interval_s=0.1, drain_timeout_s=5,
                                                        capacity_interval_s=0.5),
                                           settings_for(auth_server, "worker"))
        services["router"] = RouterService(settings=settings_for(auth_server, "router"))
        services["admission"] = AdmissionService(AdmissionConfig(), settings_for(auth_server, "admission"))
        services["metering"] = MeteringService(MeteringConfig(ledger_url=str(tmp_path / "ledger.sqlite3"), fetch_timeout_s=0.2),
                                               settings_for(auth_server, "metering"))
        services["autoscaler"] = AutoscalerService(
            AutoscalerConfig(pools=(PoolPolicy(pool=MODEL, min_replicas=1, max_replicas=1),), tick_s=0.2, warmup_s=0.2),
            IdleDriver(), settings_for(auth_server, "autoscaler"))
        services["gateway"] = GatewayService(GatewayConfig(port=0, gateway_id="gw-1"), settings_for(auth_server, "gateway"))
        for service in services.values():
            await service.start()
        services["ops"] = ops
        yield services
    finally:
        for name, service in services.items():
            if name != "ops":
                await service.drain_and_close()
        await ops.close()


async def test_every_service_does_its_job_with_its_own_user(auth_server: AuthNatsServer, mesh: dict[str, Any]) -> None:
    gateway: GatewayService = mesh["gateway"]
    ops: Bus = mesh["ops"]
    key, _ = await create_key(ops, org="acme", tier="premium")
    await eventually(lambda: gateway.registry.ready_workers(MODEL), "the worker in the gateway's registry")
    url = f"http://127.0.0.1:{gateway.bound_port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        async def http_stream() -> int | None:
            async with http.post(url, json=body) as r:
                if r.status == 401:
                    return None  # the key watcher has not seen the new key yet
                assert r.status == 200, await r.text()
                usage = None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        usage = event.get("usage") or usage
                return int(usage["completion_tokens"]) if usage else -1

        assert await eventually(http_stream, "a streamed HTTP request") == 12

        # The NATS API as the API client user, on its own inbox prefix.
        nc, violations = await client(auth_server, "app", inbox_prefix=accounts.inbox_prefix("app"))
        try:
            inbox, done, texts = nc.new_inbox(), asyncio.Event(), []

            async def on_chunk(msg: Any) -> None:
                texts.append(msg.data)
                if msg.headers and (msg.headers.get("Meshserve-Done") or msg.headers.get("Nats-Service-Error-Code")):
                    done.set()

            await nc.subscribe(inbox, cb=on_chunk)
            await nc.publish(gateway.bus.subjects.api_chat, json.dumps(body).encode(), reply=inbox,
                             headers={"Authorization": f"Bearer {key}"})
            await asyncio.wait_for(done.wait(), 15)
            assert violations.errors == []
            assert len(texts) > 3, texts
            assert b"error" not in texts[-1], texts[-1]
        finally:
            await nc.close()

        # Metering committed both requests' usage; the gateway can ask it on the caller's behalf.
        async def metered() -> bool:
            report = await ops.request(ops.subjects.metering_usage, UsageQuery(org="acme"), UsageReport, timeout=5.0)
            total = report.total()
            return total.requests == 2 and total.completion_tokens == 24

        await eventually(metered, "the metered usage of both requests")

        # The worker's capacity events reach the ledger under its user, and the fleet report answers.
        async def costed() -> bool:
            report = await ops.request(ops.subjects.metering_fleet, FleetQuery(group_by=["model"]), FleetReport,
                                       timeout=5.0)
            return any(row.model == MODEL and row.replica_s > 0 and row.requests == 2 for row in report.rows)

        await eventually(costed, "the worker's time in the fleet report")
        async with http.get(f"http://127.0.0.1:{gateway.bound_port}/v1/usage") as r:
            assert r.status == 200, await r.text()

    status = await fetch_status(ops, MODEL)
    assert status.pools and status.pools[0].pool == MODEL
    placed = sum(x.value for m in mesh["router"].metrics.placements.collect() for x in m.samples if x.name.endswith("_total"))
    assert placed == 2
    assert gateway.upstream.direct_placements == 0  # the router placed them
    await eventually(lambda: mesh["admission"].leading, "an admission leader")

    # /v1/responses keeps stored responses in its own bucket, under the gateway's user.
    base = f"http://127.0.0.1:{gateway.bound_port}/v1/responses"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        async with http.post(base, json={"model": MODEL, "input": "hello", "max_output_tokens": 4}) as r:
            assert r.status == 200, await r.text()
            response_id = (await r.json())["id"]
        async with http.get(f"{base}/{response_id}") as r:
            assert r.status == 200, await r.text()
        async with http.delete(f"{base}/{response_id}") as r:
            assert r.status == 200, await r.text()

    # A worker's connection closing reaches every registry through the advisories the
    # mesh account imports from the system account: each service drops it at once.
    worker = await Bus.open(settings_for(auth_server, "worker"), "w-advisory", initial_attempts=20)
    kv = await worker.js.key_value(worker.subjects.workers_bucket)
    await kv.put("w-advisory", encode(WorkerInfo(worker_id="w-advisory", model=MODEL, engine="sim", state="ready",
                                                 heartbeat_at=time.time())))
    registries = [gateway.registry, *(mesh[name].feed.registry for name in ("router", "admission", "autoscaler"))]
    await eventually(lambda: all("w-advisory" in r.workers for r in registries), "the worker in every registry")
    await worker.close()
    await eventually(lambda: all("w-advisory" not in r.workers for r in registries), "the worker dropped everywhere")
    assert all(r.disconnect_deaths == 1 for r in registries)  # by the advisory, its heartbeat still fresh
    assert auth_server.violations() == []


async def test_no_violation_at_shutdown(auth_server: AuthNatsServer, mesh: dict[str, Any]) -> None:
    """Drains deregister workers, release the admission lease, stop consumers: all permitted."""
    await eventually(lambda: mesh["gateway"].registry.ready_workers(MODEL), "the worker in the registry")
    for name in ("gateway", "autoscaler", "worker", "router", "admission", "metering"):
        await mesh[name].drain_and_close()
    await asyncio.sleep(0.3)
    assert auth_server.violations() == []


async def test_a_refused_subject_is_logged_as_an_error_naming_it(auth_server: AuthNatsServer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A service whose root or user does not match the accounts (here the router with root
    ``prod``) used to log only JetStream timeouts: the server's refusal names the subject."""
    settings = BusSettings(servers=(auth_server.url,), user="router", password=PASSWORDS["router"], root="prod")
    bus = await Bus.open(settings, "router-prod", initial_attempts=5)
    try:
        with pytest.raises((TimeoutError, nats.errors.TimeoutError)):
            await asyncio.wait_for(bus.js.stream_info("TOKENS_PROD"), 2.0)
        await eventually(lambda: any("tokens_prod" in r.getMessage().lower() and r.levelname == "ERROR" for r in caplog.records),
                         "the refusal in the log", timeout=5.0)
        line = next(r.getMessage() for r in caplog.records if "tokens_prod" in r.getMessage().lower())
        assert "'router'" in line and "MESHSERVE_ROOT" in line
    finally:
        await bus.close()
