"""``meshserve up`` as a newcomer runs it: a real process, its console, its exit code.

Busy ports are named before anything starts, a child that dies at start-up is reported
with its own last words, Ctrl-C during start-up stops what was started, one development
key serves every start of a state folder, ``--workers 0`` waits for workers started by
hand, and ``--nats-url`` never falls back to a NATS it was not given.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.natsserver import NatsServer, free_port
from ops.processes import child_pids, marked_processes, running, signal_all
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def up_runs(tmp_path: Path) -> Iterator[list[UpProcess]]:
    runs: list[UpProcess] = []
    yield runs
    for run in runs:
        run.kill()


def start_up(runs: list[UpProcess], cwd: Path, *args: str) -> UpProcess:
    run = UpProcess(list(args), cwd)
    runs.append(run)
    return run


def listening_socket() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_busy_ports_are_named_before_anything_starts(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    held_nats, nats_port = listening_socket()
    held_http, http_port = listening_socket()
    with held_nats, held_http:
        run = start_up(up_runs, tmp_path, "--nats-port", str(nats_port), "--http-port", str(http_port))
        code = run.finish(timeout=30)
    text = run.text()
    assert code != 0
    assert f"port {nats_port} for NATS" in text and "--nats-port" in text, text
    assert f"port {http_port} for HTTP (gateway)" in text and "--http-port" in text, text
    assert f"pid {os.getpid()}" in text, text  # the process holding the port is named
    assert "make up ARGS=" in text, text
    assert not (tmp_path / ".meshserve" / "logs").exists()  # nothing was started


def test_a_child_that_dies_at_start_up_is_reported_with_its_last_words(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    # A worker argument up cannot check for it (a metrics port another process holds):
    # the worker itself fails at start-up.
    held, port = listening_socket()
    with held:
        run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--no-autoscaler",
                       "--workers", "1", f"--worker-arg=--metrics-port={port}")
        code = run.finish(timeout=60)
    text = run.text()
    assert code == 1, text
    assert "exited during start-up: worker-1 (exit 1)" in text, text
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in text, text  # the worker's own line
    assert "meshserve is up" not in text


def test_worker_arguments_up_can_check_are_refused_before_anything_starts(tmp_path: Path,
                                                                           up_runs: list[UpProcess]) -> None:
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--no-autoscaler",
                   "--workers", "1", "--worker-arg=--max-num-seqs=not-a-number")
    code = run.finish(timeout=60)
    text = run.text()
    assert code == 2, text
    assert "not a whole number: 'not-a-number'" in text, text
    assert not (tmp_path / ".meshserve" / "logs").exists()  # nothing was started


def test_ctrl_c_during_start_up_stops_everything_started(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()))
    run.wait_for("", timeout=5)
    deadline = time.monotonic() + 30
    while not (tmp_path / ".meshserve" / "logs" / "nats.log").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    code = run.interrupt(timeout=30)
    text = run.text()
    assert code == 130, text
    assert "interrupted during start-up" in text, text
    assert "meshserve is up" not in text and "development API key" not in text, text
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes left running: {leftover}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the mesh's processes are found through /proc")
def test_a_second_ctrl_c_kills_the_autoscalers_workers_too(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    """An impatient double Ctrl-C kills every process at once: the workers the autoscaler
    started (in sessions of their own) go too, not left running for good without it."""
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()))
    run.wait_for("Ctrl-C stops everything")
    _wait_for_the_whole_mesh(tmp_path)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("stopping...", timeout=10)  # the gateway goes first; the autoscaler has not been told yet
    run.proc.send_signal(signal.SIGINT)
    run.finish(timeout=60)
    assert "second interrupt: killing everything" in run.text(), run.text()
    left = _leftrunning(tmp_path)
    assert left == [], f"outlived meshserve up: {left}"


@pytest.mark.skipif(not hasattr(signal, "SIGHUP") or not Path("/proc").is_dir(), reason="no SIGHUP or /proc here")
def test_a_closed_terminal_stops_the_mesh_it_started(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    """Closing the terminal (or an SSH session dropping) sends SIGHUP: the mesh stops as on
    Ctrl-C, instead of ``meshserve up`` dying alone and leaving every service it started
    running and holding its ports."""
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()))
    run.wait_for("Ctrl-C stops everything")
    _wait_for_the_whole_mesh(tmp_path)
    run.proc.send_signal(signal.SIGHUP)
    assert run.finish(timeout=60) == 0, run.text()
    left = _leftrunning(tmp_path)
    assert left == [], f"left running after the hangup: {left}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="leftovers are found through /proc")
def test_a_mesh_left_by_a_killed_up_is_stopped_by_the_next(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    """``meshserve up`` killed outright (kill -9, an OOM kill) leaves its services running on
    their ports; the next ``up`` of the same state folder stops them and starts, where it
    used to fail on the busy ports and suggest other ones."""
    http_port = free_port()
    first = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(http_port))
    first.wait_for("Ctrl-C stops everything")
    left = _wait_for_the_whole_mesh(tmp_path)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    second = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(http_port))
    text = second.wait_for("Ctrl-C stops everything", timeout=90)
    assert "processes an earlier meshserve up of" in text, text
    assert [pid for pid in left if running(pid)] == [], text
    assert second.interrupt() == 0, second.text()
    assert _leftrunning(tmp_path) == []


def test_a_second_up_of_a_running_mesh_names_the_first(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    first = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--workers", "0")
    first.wait_for("Ctrl-C stops everything")
    second = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--workers", "0")
    assert second.finish(timeout=60) == 1, second.text()
    assert f"already running, started by pid {first.proc.pid}" in second.text(), second.text()
    assert first.proc.poll() is None  # untouched
    assert first.interrupt() == 0, first.text()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="strays are found through /proc")
def test_the_workers_of_an_autoscaler_that_died_stop_with_the_mesh(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()))
    text = run.wait_for("Ctrl-C stops everything")
    _wait_for_the_whole_mesh(tmp_path)
    autoscaler = int(re.findall(r"autoscaler\s*│ pid (\d+)", text)[0])
    workers = child_pids(autoscaler)
    assert len(workers) == 2, text
    os.kill(autoscaler, signal.SIGKILL)
    run.wait_for("exited: autoscaler", timeout=30)
    assert all(running(pid) for pid in workers)  # they serve on without it
    assert run.interrupt() == 0, run.text()
    left = _leftrunning(tmp_path)
    assert left == [], f"the dead autoscaler's workers outlived meshserve up: {left}"


# A session leader on a terminal that, like ``make up``, handles SIGHUP by waiting for its child.
_LEADER = """
import fcntl, signal, subprocess, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
signal.signal(signal.SIGHUP, lambda *_: None)
sys.exit(subprocess.call(sys.argv[1:]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP") or not Path("/proc").is_dir(), reason="no SIGHUP or /proc here")
def test_a_terminal_that_hangs_up_under_make_stops_the_mesh(tmp_path: Path) -> None:
    """The kernel sends a hangup to the terminal's session leader only. When that is
    ``make up`` (``ssh -t host make up``), make waits for ``meshserve up``, which never hears
    of it: ``up`` watches its terminal and stops the mesh when it is gone."""
    import pty
    import select

    master, slave = pty.openpty()
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER, sys.executable, "-m", "ops.cli", "up", "--state-dir",
         str(tmp_path / ".meshserve"), "--nats-port", "0", "--http-port", str(free_port())],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env={**os.environ, "COLUMNS": "200"},
    )
    os.close(slave)
    out = bytearray()
    try:
        # read in this thread: a reader blocked on the master in another one would keep the
        # terminal open after the close below
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops everything" not in out and time.monotonic() < deadline and leader.poll() is None:
            if select.select([master], [], [], 0.2)[0]:
                out.extend(os.read(master, 65536))
        text = out.decode(errors="replace")
        assert "Ctrl-C stops everything" in text, text
        _wait_for_the_whole_mesh(tmp_path)
        os.close(master)  # the terminal goes away
        master = -1
        assert leader.wait(60) == 0, (tmp_path / ".meshserve" / "logs" / "up.log").read_text()
        assert "stopped: gateway=0" in (tmp_path / ".meshserve" / "logs" / "up.log").read_text()
        left = _leftrunning(tmp_path)
        assert left == [], f"left running after the hangup: {left}"
    finally:
        if master >= 0:
            os.close(master)
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
        _leftrunning(tmp_path, within_s=0)  # whatever a failure left behind


def _wait_for_the_whole_mesh(tmp_path: Path, timeout: float = 30.0) -> list[int]:
    """The processes ``up`` started in ``tmp_path`` (by the mark they carry), once all are
    there: nats-server, five services and the autoscaler's two workers."""
    deadline = time.monotonic() + timeout
    while len(found := list(marked_processes((tmp_path / ".meshserve").resolve()))) < 8:
        assert time.monotonic() < deadline, f"only {len(found)} processes of the mesh appeared"
        time.sleep(0.1)
    return found


def _leftrunning(tmp_path: Path, within_s: float = 10.0) -> list[int]:
    """Processes ``up`` started in ``tmp_path`` that still run after ``within_s`` (then
    killed, so that none is left for the next test)."""
    deadline = time.monotonic() + within_s
    while (left := list(marked_processes((tmp_path / ".meshserve").resolve()))) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(left, signal.SIGKILL)
    return left


def test_one_development_key_per_state_folder(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    keys = []
    for _ in range(2):
        run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--workers", "0")
        run.wait_for("Ctrl-C stops everything")
        keys.append((tmp_path / ".meshserve" / "dev-key").read_text().strip())
        assert run.interrupt() == 0, run.text()
    assert keys[0] == keys[1]
    assert "reused from an earlier run" in run.text()


def test_workers_zero_waits_for_a_worker_started_by_hand(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--workers", "0")
    text = run.wait_for("Ctrl-C stops everything")
    assert "no worker yet" in text, text
    nats_url = next(line.split()[1] for line in text.splitlines() if line.startswith("NATS: "))
    worker = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "serve", "worker", "--nats-url", nats_url, "--model", "sim-llama-8b",
         "--worker-id", "by-hand"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        run.wait_for("worker ready: by-hand (sim, model sim-llama-8b)", timeout=60)
        services = subprocess.run([sys.executable, "-m", "ops.cli", "services", "--nats-url", nats_url],
                                  capture_output=True, text=True, timeout=30)
        for name in ("meshserve-gateway", "meshserve-router", "meshserve-admission", "meshserve-worker"):
            assert name in services.stdout, services.stdout + services.stderr
        # another subject root on the same NATS: another mesh, none of this one's services
        other = subprocess.run([sys.executable, "-m", "ops.cli", "services", "--nats-url", nats_url, "--root", "other"],
                               capture_output=True, text=True, timeout=30)
        assert other.returncode == 1 and other.stdout == "", other.stdout
        assert other.stderr.startswith("meshserve services: no service answered under the subject root 'other'")
    finally:
        worker.terminate()
        worker.wait(30)
    assert run.interrupt() == 0, run.text()


def test_nats_url_without_jetstream_is_refused_with_the_reason(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    port = free_port()
    plain = subprocess.Popen([str(Path(sys.executable).parent / "nats-server"), "-a", "127.0.0.1", "-p", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        run = start_up(up_runs, tmp_path, "--nats-url", f"nats://127.0.0.1:{port}", "--http-port", str(free_port()))
        code = run.finish(timeout=60)
    finally:
        plain.terminate()
        plain.wait(10)
    text = run.text()
    assert code == 1, text
    assert "has no JetStream" in text, text


def test_nats_url_is_used_instead_of_starting_one(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    theirs = NatsServer(store_dir=tmp_path / "theirs", log_file=tmp_path / "theirs.log").start()
    try:
        run = start_up(up_runs, tmp_path, "--nats-url", theirs.url, "--http-port", str(free_port()), "--workers", "0")
        text = run.wait_for("Ctrl-C stops everything")
        assert f"NATS: {theirs.url}" in text and "not started here" in text, text
        assert not (tmp_path / ".meshserve" / "nats").exists()
        assert run.interrupt() == 0, run.text()
        assert theirs.running()  # left alone on the way out
    finally:
        theirs.stop()


def test_a_mesh_that_fails_to_start_leaves_no_process_behind(tmp_path: Path) -> None:
    """A benchmark that only sees the StartupError used to leave a whole mesh running."""
    import asyncio

    from ops.up import Mesh, MeshConfig, StartupError

    mesh = Mesh(MeshConfig(state_dir=tmp_path / "m", nats_port=0, http_port=free_port(), workers=1,
                           gateway_args=["--no-such-flag"]))
    with pytest.raises(StartupError, match="gateway"):
        asyncio.run(mesh.start(timeout=60))
    assert mesh.processes and all(p.proc is not None and p.proc.poll() is not None for p in mesh.processes)
    assert mesh.nats_nodes and not any(n.running() for n in mesh.nats_nodes)


def test_up_stops_everything_when_its_nats_server_dies(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    # Every service is cut off without NATS and nothing restarts it: `up` must not stay "up".
    run = start_up(up_runs, tmp_path, "--nats-port", "0", "--http-port", str(free_port()), "--no-autoscaler",
                   "--workers", "1")
    run.wait_for("Ctrl-C stops everything")
    config = tmp_path / ".meshserve" / "nats" / "meshserve-nats.conf"
    pids = subprocess.run(["pgrep", "-f", str(config)], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), signal.SIGKILL)
    code = run.finish(timeout=90)
    text = run.text()
    assert code == 1, text
    assert "exited: meshserve-nats (exit -9)" in text, text  # which child, and how it ended
    assert "NATS is gone" in text and "stopping everything" in text, text
    stopped = next(line for line in text.splitlines() if line.startswith("stopped: "))
    codes = dict(part.split("=") for part in stopped.removeprefix("stopped: ").split(", "))
    assert set(codes) == {"gateway", "worker-1", "router", "admission", "metering"}, stopped
    assert set(codes.values()) == {"0"}, stopped  # each drained and exited by itself, cut off or not
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes left running: {leftover}"


def test_up_reports_failures_on_stderr(tmp_path: Path) -> None:
    """As every command: one line on stderr, ``meshserve up: <message>``; they went to
    stdout (and a failed start said ``meshserve up failed:``)."""
    bad = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--engine", "echo", "--host-models", "a,b",
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "", (bad.stdout, bad.stderr)
    assert bad.stderr.startswith("meshserve up: ") and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
