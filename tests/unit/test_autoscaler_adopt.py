"""``LocalDriver`` adopting the workers an earlier autoscaler started (real processes: the
fake worker of ``test_autoscaler_drivers``): only those still running as the very process
recorded, never a dead one's pid taken by another process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from services.autoscaler.drivers import LocalDriver, WorkerRef
from services.autoscaler.drivers.local import process_start_time
from tests.unit.test_autoscaler_drivers import FAKE_WORKER, FakeClock, local_driver, wait_for

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="processes are told apart through /proc")


@pytest.fixture
def fake_worker(tmp_path: Path) -> tuple[list[str], Path]:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return [sys.executable, str(script)], out


async def test_a_new_driver_adopts_the_live_workers_and_drains_them(tmp_path: Path,
                                                                     fake_worker: tuple[list[str], Path]) -> None:
    pids = tmp_path / "pids"
    first = local_driver(tmp_path, fake_worker, FakeClock(), pid_dir=pids)
    launch = await first.start("serve", 2)
    out = fake_worker[1]
    await wait_for(lambda: all((out / f"{w}.json").exists() for w in launch.worker_ids))
    assert sorted(p.stem for p in pids.glob("*.json")) == sorted(launch.worker_ids)
    # The first driver is gone without a word (its process was killed): a second one starts.
    second = local_driver(tmp_path, fake_worker, FakeClock(), pid_dir=pids)
    second.pools = ("serve",)
    await second.open()
    try:
        assert second.managed() == set(launch.worker_ids)
        assert second.status().message.startswith("2/4 local workers (2 serve, 2 adopted")
        (one, other) = launch.worker_ids
        await second.stopped(WorkerRef(one, "serve"))  # a drained one: ended when it lingers
        await second.stop(WorkerRef(one, "serve"))
        await wait_for(lambda: (out / f"{one}.term").exists())
        first.workers[one].proc.wait(5)  # our test process is its parent: reap the zombie
        assert one in await second.reap() and second.managed() == {other}
        assert not (pids / f"{one}.json").exists()
    finally:
        await second.close()  # drains the adopted ones
    assert (out / f"{other}.term").exists()
    assert not list(pids.glob("*.json"))
    for worker in first.workers.values():
        worker.proc.wait(5)


async def test_records_of_ended_workers_and_reused_pids_are_not_adopted(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    # A worker that ended (its pid unused: far above pid_max's default), and a pid that is
    # now another process (ours) with a start time that is not its own.
    (pids / "gone.json").write_text(json.dumps({"worker_id": "gone", "pool": "p", "pid": 4_000_000, "start_time": "1"}))
    mine = os.getpid()
    (pids / "reused.json").write_text(json.dumps({"worker_id": "reused", "pool": "p", "pid": mine,
                                                  "start_time": str(int(process_start_time(mine)) - 1)}))
    (pids / "garbled.json").write_text("{")
    (pids / "other-pool.json").write_text(json.dumps({"worker_id": "other", "pool": "q", "pid": mine,
                                                      "start_time": process_start_time(mine)}))
    driver = LocalDriver(log_dir=tmp_path / "logs", pid_dir=pids)
    driver.pools = ("p",)
    await driver.open()
    assert driver.managed() == set()
    assert sorted(p.name for p in pids.glob("*.json")) == ["garbled.json", "other-pool.json"]
