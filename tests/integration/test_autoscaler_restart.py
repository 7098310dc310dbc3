"""An autoscaler (local driver) killed -9 and started again on the same state folder, as
``meshserve up`` restarts it: the workers the first one started served on without it, and
the second one manages them again (``managed``, counted by its driver, drained when it
stops) instead of calling them someone else's and starting more beside them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bus import Bus
from ops.processes import running
from ops.status import fetch_status
from proto.autoscaler import AutoscalerStatus
from proto.errors import MeshError
from tests.conftest import eventually

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="worker processes are told apart through /proc")]

ROOT = Path(__file__).resolve().parents[2]
POOL = f"sim-adopt-{uuid.uuid4().hex[:6]}"  # this run's workers only, whatever else runs


def _autoscaler(tmp_path: Path, nats_url: str, n: int) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "ops.cli", "serve", "autoscaler", "--driver", "local", "--pool", POOL,
            "--min-replicas", "2", "--max-replicas", "4", "--state-dir", str(tmp_path / "state"),
            "--worker-args", "--engine sim --speed 20 --drain-timeout 10", "--max-workers", "4", "--tick", "0.5"]
    log_path = tmp_path / f"autoscaler-{n}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log_path


async def _status(bus: Bus, proc: subprocess.Popen[bytes], log_path: Path, ready: int) -> AutoscalerStatus:
    deadline = time.monotonic() + 60
    while True:
        try:
            status = await fetch_status(bus, timeout=1.0)
            if status.pools and status.pools[0].ready == ready:
                return status
        except MeshError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"the autoscaler did not report {ready} ready workers:\n{_tail(log_path)}")
        await asyncio.sleep(0.3)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


def _worker_pids() -> dict[int, str]:
    """pid → worker id of this pool's sim workers (from /proc, by command line)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if POOL in args and "worker" in args and "--worker-id" in args:
            pids[int(entry.name)] = args[args.index("--worker-id") + 1]
    return pids


async def test_a_restarted_autoscaler_manages_the_workers_it_had_started(tmp_path: Path, bus: Bus,
                                                                         nats_url: str) -> None:
    first, first_log = _autoscaler(tmp_path, nats_url, 1)
    second: subprocess.Popen[bytes] | None = None
    pids: dict[int, str] = {}
    try:
        status = await _status(bus, first, first_log, ready=2)
        assert all(w.managed for w in status.pools[0].workers)
        pids = await asyncio.to_thread(_worker_pids)
        assert len(pids) == 2
        first.kill()  # kill -9: no drain, its workers serve on (in sessions of their own)
        first.wait()
        await asyncio.sleep(1.0)
        assert all(running(pid) for pid in pids)

        second, second_log = _autoscaler(tmp_path, nats_url, 2)
        deadline = time.monotonic() + 60
        while True:
            status = await _status(bus, second, second_log, ready=2)
            (pool,) = status.pools
            if all(w.managed for w in pool.workers) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert sorted(w.worker_id for w in pool.workers) == sorted(pids.values())
        assert all(w.managed for w in pool.workers), [(w.worker_id, w.managed) for w in pool.workers]
        assert status.driver.ok and f"2/4 local workers (2 {POOL}, 2 adopted" in status.driver.message, \
            status.driver.message
        await asyncio.sleep(3.0)  # several ticks: it starts nobody beside them
        assert set(await asyncio.to_thread(_worker_pids)) == set(pids)
    finally:
        if first.poll() is None:
            first.kill()
        code = None
        if second is not None:
            second.send_signal(signal.SIGTERM)  # drains what it manages, the adopted workers too
            code = await asyncio.to_thread(second.wait, 60)
        with contextlib.suppress(AssertionError):
            await eventually(lambda: not any(running(pid) for pid in pids), timeout=30)
        left = [pid for pid in pids if running(pid)]
        for pid in [*left, *(p for p in await asyncio.to_thread(_worker_pids) if p not in pids)]:
            os.kill(pid, signal.SIGKILL)  # none left for the next test, whatever failed
    assert code == 0, _tail(second_log)
    assert not left, f"the adopted workers outlived the autoscaler's stop: {left}"
    assert not list((tmp_path / "state" / "autoscaler" / "workers").glob("*.json"))  # their records went with them
