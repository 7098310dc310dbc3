"""Autoscaler drivers against stand-ins of what they drive.

- ``LocalDriver`` runs a tiny Python script as its "worker" (real processes, signals);
- ``ComposeDriver`` runs a fake ``docker`` executable that records its arguments and
  keeps a container list in a file (no Docker engine exists here);
- ``NomadDriver`` talks to an in-test aiohttp server implementing the job read, job
  scale, allocations and allocation-stop endpoints of Nomad's HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ops.natsserver import free_port
from services.autoscaler.control import PoolController, PoolObservation, PoolPolicy
from services.autoscaler.drivers import (
    ComposeDriver,
    DriverError,
    LocalDriver,
    NomadDriver,
    WorkerRef,
    pool_slug,
)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# =========================================================================== local

FAKE_WORKER = r'''
import json, os, signal, sys, time
args = sys.argv[1:]
model = args[args.index("--model") + 1]
worker_id = args[args.index("--worker-id") + 1]
out = os.environ["FAKE_OUT"]
# written whole, then renamed: the test reads the file as soon as it exists
with open(os.path.join(out, worker_id + ".json.tmp"), "w") as f:
    json.dump({"argv": args, "nats": os.environ.get("MESHSERVE_NATS_URL"), "pid": os.getpid()}, f)
os.replace(os.path.join(out, worker_id + ".json.tmp"), os.path.join(out, worker_id + ".json"))
if model == "crash":
    sys.exit(3)
if model == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def on_term(*_):
        with open(os.path.join(out, worker_id + ".term.tmp"), "w") as f:
            f.write("drained")
        os.replace(os.path.join(out, worker_id + ".term.tmp"), os.path.join(out, worker_id + ".term"))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
print("fake worker up", flush=True)
while True:
    time.sleep(0.05)
'''


@pytest.fixture
def fake_worker(tmp_path: Path) -> tuple[list[str], Path]:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return [sys.executable, str(script)], out


def local_driver(tmp_path: Path, fake_worker: tuple[list[str], Path], clock: FakeClock, **kwargs: Any) -> LocalDriver:
    command, out = fake_worker
    env = {**os.environ, "FAKE_OUT": str(out), "MESHSERVE_NATS_URL": "nats://10.1.2.3:4222"}
    options: dict[str, Any] = {"worker_args": {"*": ["--engine", "sim", "--speed", "20"]}, "max_workers": 4}
    options.update(kwargs)
    return LocalDriver(log_dir=tmp_path / "logs", command=command, env=env, clock=clock, exit_grace_s=5.0,
                       stop_grace_s=2.0, close_timeout_s=10.0, **options)


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def reap_until(driver: LocalDriver, worker_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while worker_id not in await driver.reap():
        if time.monotonic() > deadline:
            raise AssertionError(f"{worker_id} not reaped")
        await asyncio.sleep(0.02)


async def test_local_start_passes_model_id_args_and_environment(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    clock = FakeClock()
    driver = local_driver(tmp_path, fake_worker, clock)
    launch = await driver.start("meta-llama/Llama-3.1-8B", 2)
    try:
        assert launch.count == 2 and len(set(launch.worker_ids)) == 2
        out = fake_worker[1]
        await wait_for(lambda: all((out / f"{w}.json").exists() for w in launch.worker_ids))
        for worker_id in launch.worker_ids:
            assert worker_id.startswith("llama-3-1-8b-")
            seen = json.loads((out / f"{worker_id}.json").read_text())
            assert seen["argv"] == ["--model", "meta-llama/Llama-3.1-8B", "--worker-id", worker_id,
                                    "--engine", "sim", "--speed", "20"]
            assert seen["nats"] == "nats://10.1.2.3:4222"
        await wait_for(lambda: "fake worker up" in driver.log_path(launch.worker_ids[0]).read_text())
        assert driver.managed() == set(launch.worker_ids)
        status = driver.status()
        assert status.ok and "2/4 local workers" in status.message
    finally:
        await driver.close()
    assert not driver.alive()


async def test_local_stopped_waits_for_exit_then_terminates(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    clock = FakeClock()
    driver = local_driver(tmp_path, fake_worker, clock)
    (worker_id,) = (await driver.start("serve", 1)).worker_ids
    out = fake_worker[1]
    await wait_for(lambda: (out / f"{worker_id}.json").exists())
    await driver.stopped(WorkerRef(worker_id, "serve"))
    # Within the exit grace nothing is signalled: a deregistered worker exits by itself.
    assert await driver.reap() == []
    await asyncio.sleep(0.2)
    assert driver.alive() and not (out / f"{worker_id}.term").exists()
    clock.t += 5.0  # the grace passed and it is still there: SIGTERM
    await reap_until(driver, worker_id)
    assert (out / f"{worker_id}.term").read_text() == "drained"
    status = driver.status()
    assert status.ok and status.errors == {}


async def test_local_forced_stop_escalates_to_sigkill(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    clock = FakeClock()
    driver = local_driver(tmp_path, fake_worker, clock)
    (worker_id,) = (await driver.start("stubborn", 1)).worker_ids
    await wait_for(lambda: "fake worker up" in driver.log_path(worker_id).read_text())
    proc = driver.workers[worker_id].proc
    await driver.stop(WorkerRef(worker_id, "stubborn"))
    await asyncio.sleep(0.3)
    assert await driver.reap() == [] and proc.poll() is None  # SIGTERM ignored, grace not over
    clock.t += 2.0
    await reap_until(driver, worker_id)
    assert proc.returncode == -signal.SIGKILL


async def test_local_crash_is_reported_not_silent(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    clock = FakeClock()
    driver = local_driver(tmp_path, fake_worker, clock)
    seen: list[tuple[str, str, str]] = []
    driver.on_error(lambda *e: seen.append(e))
    (worker_id,) = (await driver.start("crash", 1)).worker_ids
    await reap_until(driver, worker_id)
    status = driver.status()
    assert status.errors == {"worker_exited": 1}
    assert "exited with code 3" in status.last_error and str(driver.log_path(worker_id)) in status.last_error
    assert status.ok  # one crashed worker does not stop the driver from acting
    assert seen and seen[0][:2] == ("local", "worker_exited")


async def test_local_max_workers_reported(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    clock = FakeClock()
    driver = local_driver(tmp_path, fake_worker, clock, max_workers=1)
    try:
        launch = await driver.start("serve", 2)
        assert launch.count == 1  # what fits starts
        status = driver.status()
        assert not status.ok and "max_workers 1 reached" in status.message and status.errors == {"max_reached": 1}
        with pytest.raises(DriverError) as info:
            await driver.start("serve", 1)
        assert info.value.reason == "max_reached"
        assert driver.status().errors == {"max_reached": 2}
    finally:
        await driver.close()


async def test_local_spawn_failure(tmp_path: Path) -> None:
    driver = LocalDriver(log_dir=tmp_path / "logs", command=[str(tmp_path / "no-such-binary")])
    with pytest.raises(DriverError) as info:
        await driver.start("m", 1)
    assert info.value.reason == "spawn_failed"
    assert not driver.status().ok and "no-such-binary" in driver.status().message


async def test_local_close_leave_keeps_workers(tmp_path: Path, fake_worker: tuple[list[str], Path]) -> None:
    driver = local_driver(tmp_path, fake_worker, FakeClock(), on_close="leave")
    (worker_id,) = (await driver.start("serve", 1)).worker_ids
    await driver.close()
    proc = driver.workers[worker_id].proc
    assert proc.poll() is None
    proc.terminate()
    proc.wait(5)


# =========================================================================== compose

FAKE_DOCKER = r'''#!{python}
import json, os, sys
state_path = os.environ["FAKE_DOCKER_STATE"]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
if os.environ.get("FAKE_DOCKER_FAIL"):
    sys.stderr.write("Cannot connect to the Docker daemon at unix:///var/run/docker.sock\n")
    sys.exit(1)
state = json.load(open(state_path)) if os.path.exists(state_path) else {"containers": [], "next": 1}
args = sys.argv[1:]
if args[0] == "compose":
    i = args.index("-p") + 2
    while args[i] == "-f":
        i += 2
    cmd = args[i:]
    if cmd[0] == "ps":
        print("\n".join(state["containers"]))
    elif cmd[0] == "up":
        n = int(cmd[cmd.index("--scale") + 1].split("=")[1])
        while len(state["containers"]) < n:
            state["containers"].append("c%011d" % state["next"])
            state["next"] += 1
        del state["containers"][n:]
elif args[0] == "rm":
    state["containers"].remove(args[1])
json.dump(state, open(state_path, "w"))
'''


@pytest.fixture
def fake_docker(tmp_path: Path) -> tuple[str, Path, dict[str, str]]:
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER.replace("{python}", sys.executable))
    docker.chmod(0o755)
    log = tmp_path / "docker.log"
    env = {**os.environ, "FAKE_DOCKER_STATE": str(tmp_path / "docker-state.json"), "FAKE_DOCKER_LOG": str(log)}
    return str(docker), log, env


def docker_state(env: dict[str, str]) -> dict[str, Any]:
    return dict(json.loads(Path(env["FAKE_DOCKER_STATE"]).read_text()))


def break_docker_state(env: dict[str, str]) -> None:
    Path(env["FAKE_DOCKER_STATE"]).write_text("not json")


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_compose_scale_up_and_drained_removal(fake_docker: tuple[str, Path, dict[str, str]]) -> None:
    docker, log, env = fake_docker
    driver = ComposeDriver(project="prod", files=["compose.yaml"], services={"big": "worker-big"}, docker=docker, env=env)
    launch = await driver.start("small", 2)
    assert launch.count == 2 and launch.worker_ids == ()
    await driver.start("small", 1)
    base = ["compose", "-p", "prod", "-f", "compose.yaml"]
    assert calls(log) == [
        [*base, "ps", "-a", "-q", "worker"],
        [*base, "up", "-d", "--scale", "worker=2", "--no-recreate", "worker"],
        [*base, "ps", "-a", "-q", "worker"],
        [*base, "up", "-d", "--scale", "worker=3", "--no-recreate", "worker"],
    ]
    log.unlink()
    # The drained worker reported its container's short id as host: exactly that one goes.
    await driver.stopped(WorkerRef("w-2", "small", host="c00000000002"))
    assert calls(log) == [
        ["stop", "--time", "10", "c00000000002"],
        ["rm", "c00000000002"],
        [*base, "ps", "-a", "-q", "worker"],
        [*base, "up", "-d", "--scale", "worker=2", "--no-recreate", "worker"],
    ]
    assert docker_state(env)["containers"] == ["c00000000001", "c00000000003"]
    log.unlink()
    await driver.start("big", 1)  # a pool with its own service
    assert calls(log)[-1] == [*base, "up", "-d", "--scale", "worker-big=3", "--no-recreate", "worker-big"]
    assert driver.status().ok


async def test_compose_bad_command_stays_reported(fake_docker: tuple[str, Path, dict[str, str]], tmp_path: Path) -> None:
    docker, _, env = fake_docker
    driver = ComposeDriver(docker=docker, env=env, files=[str(tmp_path / "absent.yaml")])
    driver.pools = ("m",)
    break_docker_state(env)  # the fake now fails the way a broken compose project does
    with pytest.raises(DriverError) as info:
        await driver.start("m", 1)
    assert info.value.reason == "command_failed" and "exited with 1" in info.value.message
    assert not driver.status().ok


async def test_compose_without_host_lets_compose_pick(fake_docker: tuple[str, Path, dict[str, str]]) -> None:
    docker, log, env = fake_docker
    driver = ComposeDriver(project="p", docker=docker, env=env)
    await driver.start("m", 3)
    log.unlink()
    await driver.stopped(WorkerRef("w", "m"))
    assert calls(log) == [
        ["compose", "-p", "p", "ps", "-a", "-q", "worker"],
        ["compose", "-p", "p", "up", "-d", "--scale", "worker=2", "--no-recreate", "worker"],
    ]
    log.unlink()
    await driver.stop(WorkerRef("w", "m", host="c00000000001"))
    assert calls(log) == [["stop", "--time", "10", "c00000000001"]]
    with pytest.raises(DriverError) as info:
        await driver.stop(WorkerRef("w", "m"))
    assert info.value.reason == "unmapped"


async def test_compose_missing_docker_is_reported(tmp_path: Path) -> None:
    clock = FakeClock()
    driver = ComposeDriver(docker=str(tmp_path / "docker"), clock=clock)
    driver.pools = ("m",)
    with pytest.raises(DriverError) as info:
        await driver.start("m", 1)
    assert info.value.reason == "docker_missing"
    status = driver.status()
    assert not status.ok and "not found" in status.message and status.errors == {"docker_missing": 1}
    assert status.last_error_at == clock.t


async def test_compose_failing_docker_is_reported_then_recovers(fake_docker: tuple[str, Path, dict[str, str]]) -> None:
    docker, _, env = fake_docker
    clock = FakeClock()
    driver = ComposeDriver(docker=docker, env={**env, "FAKE_DOCKER_FAIL": "1"}, clock=clock, poll_s=30.0)
    driver.pools = ("m",)
    with pytest.raises(DriverError) as info:
        await driver.start("m", 1)
    assert info.value.reason == "unreachable" and "Cannot connect to the Docker daemon" in info.value.message
    assert await driver.reap() == []
    assert not driver.status().ok and driver.status().errors == {"unreachable": 2}
    driver.env = env  # the daemon is back: the next probe clears the problem
    clock.t += 31
    await driver.reap()
    status = driver.status()
    assert status.ok and "worker: 0 containers" in status.message


# =========================================================================== nomad


class FakeNomad:
    """Nomad's job read, job scale, allocations and allocation stop endpoints."""

    def __init__(self, token: str = "secret") -> None:
        self.token = token
        self.jobs: dict[str, dict[str, Any]] = {}
        self.allocs: dict[str, list[dict[str, Any]]] = {}
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.app = web.Application()
        self.app.router.add_get("/v1/job/{job}", self.read_job)
        self.app.router.add_post("/v1/job/{job}/scale", self.scale)
        self.app.router.add_get("/v1/job/{job}/allocations", self.allocations)
        self.app.router.add_post("/v1/allocation/{alloc}/stop", self.stop_alloc)

    def add_job(self, job_id: str, count: int, maximum: int | None = None, group: str = "workers") -> None:
        tg: dict[str, Any] = {"Name": group, "Count": count, "Tasks": [{"Name": "worker", "Driver": "docker"}]}
        if maximum is not None:
            tg["Scaling"] = {"Min": 0, "Max": maximum, "Enabled": True}
        self.jobs[job_id] = {"ID": job_id, "Name": job_id, "Type": "service", "TaskGroups": [tg]}

    async def _record(self, request: web.Request) -> web.Response | None:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, dict(request.query), body))
        if request.headers.get("X-Nomad-Token") != self.token:
            return web.Response(status=403, text="Permission denied")
        return None

    async def read_job(self, request: web.Request) -> web.Response:
        if (denied := await self._record(request)) is not None:
            return denied
        job = self.jobs.get(request.match_info["job"])
        return web.json_response(job) if job else web.Response(status=404, text="job not found")

    async def scale(self, request: web.Request) -> web.Response:
        if (denied := await self._record(request)) is not None:
            return denied
        job = self.jobs.get(request.match_info["job"])
        if job is None:
            return web.Response(status=404, text="job not found")
        body = self.requests[-1][3]
        group = next(g for g in job["TaskGroups"] if g["Name"] == body["Target"]["Group"])
        group["Count"] = body["Count"]
        return web.json_response({"EvalID": "e1", "Index": 42})

    async def allocations(self, request: web.Request) -> web.Response:
        if (denied := await self._record(request)) is not None:
            return denied
        return web.json_response(self.allocs.get(request.match_info["job"], []))

    async def stop_alloc(self, request: web.Request) -> web.Response:
        if (denied := await self._record(request)) is not None:
            return denied
        return web.json_response({"EvalID": "e2", "Index": 43})


@pytest.fixture
async def nomad() -> AsyncIterator[tuple[FakeNomad, str]]:
    fake = FakeNomad()
    runner = web.AppRunner(fake.app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_nomad_scale_up_reads_job_then_sets_group_count(nomad: tuple[FakeNomad, str]) -> None:
    fake, address = nomad
    fake.add_job("meshserve-llama-3-1-8b", 2)
    driver = NomadDriver(address=address, token="secret", namespace="ml")
    try:
        launch = await driver.start("meta-llama/Llama-3.1-8B", 2)
        assert launch.count == 2
        assert fake.requests == [
            ("GET", "/v1/job/meshserve-llama-3-1-8b", {"namespace": "ml"}, None),
            ("POST", "/v1/job/meshserve-llama-3-1-8b/scale", {"namespace": "ml"},
             {"Count": 4, "Target": {"Group": "workers"},
              "Message": "meshserve autoscaler: scale up meta-llama/Llama-3.1-8B 2 → 4"}),
        ]
        assert driver.status().ok
    finally:
        await driver.close()


async def test_nomad_scale_down_after_drain_and_forced_stop(nomad: tuple[FakeNomad, str]) -> None:
    fake, address = nomad
    fake.add_job("llama", 3)
    fake.allocs["llama"] = [
        {"ID": "8a1c2d3e-0000-4000-8000-000000000001", "TaskGroup": "workers", "ClientStatus": "running", "DesiredStatus": "run"},
        {"ID": "9b2c3d4e-0000-4000-8000-000000000002", "TaskGroup": "workers", "ClientStatus": "running", "DesiredStatus": "run"},
    ]
    driver = NomadDriver(address=address, token="secret", jobs={"m": "llama"})
    try:
        ref = WorkerRef("m-9b2c3d4e-0000-4000-8000-000000000002", "m")
        await driver.stopped(ref)
        assert fake.requests[-1] == ("POST", "/v1/job/llama/scale", {},
                                     {"Count": 2, "Target": {"Group": "workers"},
                                      "Message": f"meshserve autoscaler: scale down m: {ref.worker_id} drained"})
        fake.requests.clear()
        await driver.stop(ref)  # forced: the allocation whose id the worker id carries
        assert [(m, p) for m, p, _, _ in fake.requests] == [
            ("GET", "/v1/job/llama/allocations"),
            ("POST", "/v1/allocation/9b2c3d4e-0000-4000-8000-000000000002/stop"),
        ]
        with pytest.raises(DriverError) as info:
            await driver.stop(WorkerRef("m-host-123", "m"))
        assert info.value.reason == "unmapped"
    finally:
        await driver.close()


async def test_nomad_scaling_max_is_reported(nomad: tuple[FakeNomad, str]) -> None:
    fake, address = nomad
    fake.add_job("j", 4, maximum=5)
    driver = NomadDriver(address=address, token="secret", jobs={"m": "j"})
    try:
        launch = await driver.start("m", 3)
        assert launch.count == 1 and fake.jobs["j"]["TaskGroups"][0]["Count"] == 5
        assert not driver.status().ok and driver.status().errors == {"max_reached": 1}
        with pytest.raises(DriverError) as info:
            await driver.start("m", 1)
        assert info.value.reason == "max_reached" and "scaling max 5" in info.value.message
        assert fake.requests[-1][0] == "GET"  # no scale request beyond the max
    finally:
        await driver.close()


async def test_nomad_failures_are_reported(nomad: tuple[FakeNomad, str]) -> None:
    fake, address = nomad
    fake.add_job("j", 1, group="other")
    reasons = []
    for driver, pool in (
        (NomadDriver(address=address, token="wrong", jobs={"m": "j"}), "m"),
        (NomadDriver(address=address, token="secret", jobs={"m": "j"}), "m"),  # no "workers" group
        (NomadDriver(address=address, token="secret"), "absent"),  # job not found
        (NomadDriver(address=f"http://127.0.0.1:{free_port()}", token="secret", timeout_s=2.0), "m"),
    ):
        with pytest.raises(DriverError) as info:
            await driver.start(pool, 1)
        await driver.close()
        assert driver.status().errors == {info.value.reason: 1} and not driver.status().ok
        reasons.append(info.value.reason)
    assert reasons == ["forbidden", "no_group", "not_found", "unreachable"]


async def test_nomad_reap_polls_allocations(nomad: tuple[FakeNomad, str]) -> None:
    fake, address = nomad
    fake.add_job("j", 2)
    fake.allocs["j"] = [
        {"ID": "a1", "TaskGroup": "workers", "ClientStatus": "running", "DesiredStatus": "run"},
        {"ID": "a2", "TaskGroup": "workers", "ClientStatus": "pending", "DesiredStatus": "run"},
        {"ID": "a0", "TaskGroup": "workers", "ClientStatus": "complete", "DesiredStatus": "stop"},
    ]
    clock = FakeClock()
    driver = NomadDriver(address=address, token="secret", jobs={"m": "j"}, clock=clock, poll_s=15.0)
    driver.pools = ("m",)
    try:
        assert await driver.reap() == []
        assert driver.status().message.endswith("j: 1 pending, 1 running")
        await driver.reap()  # within poll_s: no request
        assert len(fake.requests) == 1
        clock.t += 16
        await driver.reap()
        assert len(fake.requests) == 2
    finally:
        await driver.close()


def test_pool_slug() -> None:
    assert pool_slug("meta-llama/Llama-3.1-8B-Instruct") == "llama-3-1-8b-instruct"
    assert pool_slug("///") == "pool"


def test_arrival_waiting_for_the_next_step_is_not_saturation() -> None:
    """Workers publish a gauge as a request arrives, before the engine schedules it: the
    gauge shows one waiting on an idle replica. With the replica's max_num_seqs known
    (the shell reads it from the registry) that is not a capacity sample."""
    from proto.workers import WorkerGauge

    arrival = WorkerGauge(worker_id="w", model="m", ts=0.0, waiting=1, running=1, running_tokens=330, kv_usage=0.01)
    full = WorkerGauge(worker_id="w", model="m", ts=0.0, waiting=3, running=16, running_tokens=6000, kv_usage=0.3)
    policy = PoolPolicy(pool="m", initial_replica_token_capacity=8000)
    limits = {"w": 16}
    d = PoolController(policy).decide(PoolObservation(gauges=[arrival], max_num_seqs=limits), 0.0)
    assert d.signals.capacity_source == "initial" and d.signals.replica_token_capacity == 8000
    d = PoolController(policy).decide(PoolObservation(gauges=[full], max_num_seqs=limits), 0.0)
    assert (d.signals.capacity_source, d.signals.replica_token_capacity) == ("saturated", 6000)
    # Without the limit, the gauge alone decides, as before.
    d = PoolController(policy).decide(PoolObservation(gauges=[arrival]), 0.0)
    assert (d.signals.capacity_source, d.signals.replica_token_capacity) == ("saturated", 330)
