"""``meshserve up`` heals its mesh: a service killed -9 is restarted and serves again (here
admission, whose absence makes every request a 503 once the gateway's fail-open grace is
over, and the autoscaler, whose restart adopts the workers it had started), and a Ctrl-C
afterwards still stops everything, restarting nothing."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bus import Bus, BusSettings
from ops.natsserver import free_port
from ops.processes import marked_processes, running, signal_all
from ops.status import fetch_status
from ops.up import discover
from proto import AdmissionDecision, AdmissionRequest
from tests.conftest import eventually
from tests.up_process import UpProcess

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="the mesh's processes are found through /proc")]


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    run = UpProcess(["--nats-port", str(free_port()), "--http-port", str(free_port())], tmp_path)
    yield run
    run.kill()
    signal_all(list(marked_processes((tmp_path / ".meshserve").resolve())), signal.SIGKILL)


def _pid(text: str, label: str) -> int:
    return int(re.findall(rf"{label}\s*│ pid (\d+)", text)[0])


async def _admission_answers(bus: Bus) -> bool:
    request = AdmissionRequest(request_id=f"r-{time.monotonic_ns()}", org="o", key_id="k", model="sim-llama-8b",
                               prompt_tokens=5, max_tokens=5)
    try:
        await bus.request(bus.subjects.admission_check, request, AdmissionDecision, timeout=2)
    except Exception:
        return False
    return True


async def _completion(http: aiohttp.ClientSession, url: str, key: str) -> int:
    body = {"model": "sim-llama-8b", "prompt": "hi", "max_tokens": 4}
    async with http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


async def test_up_restarts_a_killed_service_and_it_serves_again(tmp_path: Path, up: UpProcess) -> None:
    text = up.wait_for("Ctrl-C stops everything", timeout=90)
    nats_url = re.findall(r"NATS: (nats://\S+)", text)[0]
    gateway_url = re.findall(r"OpenAI-compatible API: (http://\S+)/v1", text)[0]
    key = (tmp_path / ".meshserve" / "dev-key").read_text().strip()
    bus = await Bus.open(BusSettings(servers=(nats_url,)), "test-up-restart", initial_attempts=5)
    try:
        async with aiohttp.ClientSession() as http:
            assert await _completion(http, gateway_url, key) == 200

            admission = _pid(text, "admission")
            os.kill(admission, signal.SIGKILL)
            up.wait_for("exited: admission (exit -9)", timeout=30)
            text = up.wait_for("restarted: admission", timeout=30)
            new = int(re.findall(r"restarted: admission \(pid (\d+)", text)[0])
            assert new != admission and running(new)
            deadline = time.monotonic() + 60
            while not (await discover(bus, "meshserve-admission") and await _admission_answers(bus)):
                assert time.monotonic() < deadline, f"the restarted admission does not answer:\n{up.text()}"
                await asyncio.sleep(0.5)
            assert await _completion(http, gateway_url, key) == 200

            # The autoscaler: restarted, it manages the workers the first one started.
            before = {w.worker_id for w in (await fetch_status(bus)).pools[0].workers}
            assert len(before) == 2
            os.kill(_pid(text, "autoscaler"), signal.SIGKILL)
            up.wait_for("restarted: autoscaler", timeout=30)
            deadline = time.monotonic() + 60
            while True:
                try:
                    pool = (await fetch_status(bus, timeout=1.0)).pools[0]
                    if {w.worker_id for w in pool.workers} == before and all(w.managed for w in pool.workers):
                        break
                except Exception:
                    pass
                assert time.monotonic() < deadline, f"the restarted autoscaler does not manage its workers:\n{up.text()}"
                await asyncio.sleep(0.5)
            assert await _completion(http, gateway_url, key) == 200
    finally:
        await bus.close()

    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(90) == 0, up.text()
    after_stop = up.text().split("stopping...", 1)[1]
    assert "restarted:" not in after_stop, up.text()  # a stop is not a crash
    await eventually(lambda: not marked_processes((tmp_path / ".meshserve").resolve()), timeout=10,
                     what="every process of the mesh to end")
