"""``meshserve up`` as a supervisor: a crashed service is restarted with backoff (3 s doubling
to 30 s, back to 3 s after a healthy run), one that exits 0 stopped on purpose and stays
stopped, and one that keeps crashing (5 times within a minute) makes ``up`` give up with
its last words. The restart policy is pure; ``Mesh.supervise`` runs real processes (a
``meshserve serve`` that fails its arguments is a service that crashes at once)."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import pytest

from ops.supervise import GaveUp, RestartPolicy, ServiceProcess
from ops.up import Mesh, MeshConfig


def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_run() -> None:
    policy = RestartPolicy(max_crashes=100)
    crashes: deque[float] = deque()
    delays = []
    backoff, now = 0.0, 0.0
    for _ in range(7):
        delay = policy.after_crash(crashes, backoff, ran_s=0.5, now=now)
        assert delay is not None
        delays.append(delay)
        backoff, now = delay, now + delay + 0.5
    assert delays == [3, 6, 12, 24, 30, 30, 30]
    assert policy.after_crash(crashes, backoff, ran_s=policy.healthy_after_s, now=now) == 3


def test_it_gives_up_on_the_fifth_crash_within_a_minute_only() -> None:
    policy = RestartPolicy()
    crashes: deque[float] = deque()
    for t in (0.0, 1.0, 3.0, 7.0):
        assert policy.after_crash(crashes, 1.0, ran_s=0.0, now=t) is not None
    assert policy.after_crash(crashes, 8.0, ran_s=0.0, now=15.0) is None
    # Crashes spread wider than the window are restarted for ever.
    spread: deque[float] = deque()
    assert all(policy.after_crash(spread, 30.0, ran_s=20.0, now=t * 20.0) is not None for t in range(20))


def _wait_exited(process: ServiceProcess) -> None:
    assert process.proc is not None
    process.proc.wait(60)


def test_a_crashing_service_is_restarted_with_backoff_then_given_up_on(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(state_dir=tmp_path, nats_port=0))
    mesh.log_dir.mkdir(parents=True)
    # ``meshserve serve bogus``: argparse refuses it (exit 2), as a service that crashes at start.
    crashing = ServiceProcess("bogus", "bogus", [], mesh.log_dir / "bogus.log")
    crashing.start(mesh.env())
    mesh.processes = [crashing]
    # The processes' start times are real monotonic readings: the test's clock starts there
    # (a fixed 1000.0 read as a long healthy run on a host up for less than 16 minutes).
    now = time.monotonic()
    said: list[str] = []
    with pytest.raises(GaveUp) as gave_up:
        for _ in range(10):
            _wait_exited(crashing)
            said += mesh.supervise(now)  # the crash: a restart is due after the backoff
            assert crashing.restart_at is not None
            said += mesh.supervise(crashing.restart_at - 0.01)  # not before
            now = crashing.restart_at
            said += mesh.supervise(now)  # restarted
    exited = [line for line in said if line.startswith("exited: ")]
    assert [line.rsplit(" ", 1)[-1] for line in exited] == ["3s", "6s", "12s", "24s"], said
    assert all("bogus (exit 2)" in line for line in exited), said
    assert [line.split(" (")[0] for line in said if line.startswith("restarted: ")] == ["restarted: bogus"] * 4
    message = str(gave_up.value)
    assert "bogus crashed 5 times within 60s" in message and "exit 2" in message
    assert "invalid choice" in message  # its last words


def test_a_service_that_exits_0_is_not_restarted(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(state_dir=tmp_path, nats_port=0))
    mesh.log_dir.mkdir(parents=True)
    done = ServiceProcess("router", "router", ["--help"], mesh.log_dir / "router.log")
    done.start(mesh.env())
    mesh.processes = [done]
    _wait_exited(done)
    said = mesh.supervise(time.monotonic())
    assert said and said[0].startswith("exited: router (exit 0)") and "not restarted" in said[0]
    assert mesh.processes == [] and mesh.supervise(time.monotonic() + 60) == []
