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
