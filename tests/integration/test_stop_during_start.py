"""A service asked to stop while it is still starting (its NATS server not reachable yet:
the first connection retries for ever) stops at once. It ignored SIGTERM and SIGINT until
NATS answered, so a supervisor's stop (docker, Nomad, `meshserve up`'s Ctrl-C) hung
until it killed the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.natsserver import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("service", "sig"), [("gateway", signal.SIGTERM), ("router", signal.SIGINT)])
def test_a_stop_during_start_up_ends_the_process(tmp_path: Path, service: str, sig: signal.Signals) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    log_path = tmp_path / f"{service}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "serve", service, "--nats-url", url],
                                cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "NATS not reachable" not in log_path.read_text():  # in the connect loop
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"no connection attempt logged:\n{log_path.read_text()}"
            time.sleep(0.1)
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=30)  # a liveness bound, not a speed claim: it never ended before
        except subprocess.TimeoutExpired:
            pytest.fail(f"{service} ignored {sig.name} while connecting:\n{log_path.read_text()[-2000:]}")
        assert code == 0
        assert "stop requested during start-up" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SERVICES_OF_ONE_PROCESS = '''
import asyncio, sys
from bus import BusSettings
from bus.runner import Service, run_services

class Healthy(Service):
    name = "healthy"
    async def on_start(self):
        started.set()
    async def on_stop(self):
        print("healthy: on_stop", flush=True)

class Broken(Service):
    name = "broken"
    async def on_start(self):
        await started.wait()  # fails once its sibling is up
        raise RuntimeError("broken: cannot start")

started = asyncio.Event()
settings = BusSettings(servers=(sys.argv[1],))
sys.exit(run_services(lambda: [Healthy(settings, drain_timeout_s=5), Broken(settings, drain_timeout_s=5)]))
'''


def test_a_service_that_cannot_start_stops_its_siblings(nats_url: str, tmp_path: Path) -> None:
    """A hot-swap host runs one worker service per model in one process. One that failed
    to start ended the process with its siblings still running: never drained (their
    registry entries stayed until they expired), cut off by the event loop's shutdown
    after a 30 s flush timeout, with that traceback."""
    script = tmp_path / "group.py"
    script.write_text(SERVICES_OF_ONE_PROCESS)
    result = subprocess.run([sys.executable, str(script), nats_url], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0
    assert "RuntimeError: broken: cannot start" in result.stderr
    assert "healthy: on_stop" in result.stdout, result.stderr[-3000:]  # the sibling drained and closed
    assert "unhandled exception during asyncio.run() shutdown" not in result.stderr, result.stderr[-3000:]


NO_JETSTREAM_GROUP = '''
import asyncio, sys
import nats.errors
from bus.runner import Service, run_services

builds = 0

class NoJetStream(Service):
    name = "group"
    def __init__(self, delay):
        super().__init__(None)
        self.delay = delay
    async def start(self):  # as a start during a JetStream election fails
        await asyncio.sleep(self.delay)
        raise nats.errors.NoRespondersError()
    async def abandon_start(self):
        pass

def group():
    global builds
    builds += 1
    return [NoJetStream(0.01), NoJetStream(0.2)]

try:
    run_services(group, jetstream_wait_s=2.0)
except nats.errors.NoRespondersError:
    print("gave up after", builds, "builds")
    sys.exit(1)
print("exited 0 after", builds, "builds")
'''


def test_a_group_waiting_for_jetstream_is_built_again_not_stopped(tmp_path: Path) -> None:
    """Stopping a failed start's siblings must not read as a stop request: the JetStream
    wait took it for SIGTERM and the host exited 0 after one try (a supervisor restarts
    nothing that exits 0)."""
    script = tmp_path / "group.py"
    script.write_text(NO_JETSTREAM_GROUP)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    builds = int(result.stdout.split("after ")[1].split()[0])
    assert builds >= 2, result.stdout
