"""How ``meshserve up`` keeps its service processes running: each child process
(``ServiceProcess``), and restarting the ones that crash (``RestartPolicy``, ``supervise``)
as a process supervisor would. The mesh they make up is ``ops.up``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .natsserver import last_line
from .processes import child_pids, signal_all


@dataclass(frozen=True)
class RestartPolicy:
    """How ``meshserve up`` restarts a service process that crashed (exited non-zero or by a
    signal), as a supervisor would: after ``first_backoff_s``, doubling with each crash up
    to ``max_backoff_s``, back to the first after a run of ``healthy_after_s``; it gives up
    (and stops the mesh) on the ``max_crashes``-th crash within ``window_s``."""

    # Above the 2 s a worker waits before stopping a vanished gateway's requests
    # (services/worker/orphans.py): a gateway back sooner under its id would keep them.
    first_backoff_s: float = 3.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 30.0
    max_crashes: int = 5
    window_s: float = 60.0

    def after_crash(self, crashes: deque[float], backoff_s: float, ran_s: float, now: float) -> float | None:
        """Record a crash at ``now`` in ``crashes`` (the process's earlier ones) after a run
        of ``ran_s``; the delay before restarting it (``backoff_s`` was the last one, 0
        before any), or None: it keeps crashing, give up."""
        crashes.append(now)
        while crashes and now - crashes[0] > self.window_s:
            crashes.popleft()
        if len(crashes) >= self.max_crashes:
            return None
        if backoff_s <= 0 or ran_s >= self.healthy_after_s:
            return self.first_backoff_s
        return min(backoff_s * 2, self.max_backoff_s)


class GaveUp(RuntimeError):
    """A service kept crashing: ``meshserve up`` stops the mesh rather than restart it again."""


@dataclass
class ServiceProcess:
    name: str  # service kind: worker, gateway, ...
    label: str  # unique label, e.g. worker-1
    argv: list[str]
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0  # monotonic
    # The supervisor's bookkeeping (``Mesh.supervise``): crash times within the window, the
    # last backoff, and when a restart is due.
    crashes: deque[float] = field(default_factory=deque)
    backoff_s: float = 0.0
    restart_at: float | None = None
    restarts: int = 0

    def start(self, base_env: dict[str, str]) -> None:
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", self.name, *self.argv],
            env={**base_env, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C handling stops children in order
        )
        self.started_at = time.monotonic()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_report(self) -> str:
        """``label (exit N): its last log line`` for a process that has exited."""
        code = self.proc.returncode if self.proc is not None else None
        said = last_line(self.log_file)
        return f"{self.label} (exit {code})" + (f": {said}" if said else "")

    def terminate(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kill -9 the process and every process under it: the autoscaler's workers run in
        sessions of their own and would outlive it, and so would an engine's own children."""
        if self.running():
            assert self.proc is not None
            signal_all(child_pids(self.proc.pid, recursive=True), signal.SIGKILL)
            self.proc.kill()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()


def supervise(processes: list[ServiceProcess], policy: RestartPolicy, env: dict[str, str], now: float) -> list[str]:
    """Restart the processes that crashed (``policy``) in ``processes`` (one that exited 0
    stopped on purpose: it is removed, not restarted); what was done, one line each. Raise
    ``GaveUp`` with the child's last words when one keeps crashing."""
    said: list[str] = []
    for p in list(processes):
        if p.restart_at is not None:
            if now >= p.restart_at:
                p.restart_at = None
                p.start(env)
                p.restarts += 1
                pid = p.proc.pid if p.proc is not None else 0
                said.append(f"restarted: {p.label} (pid {pid}; restart {p.restarts}, log {p.log_file})")
            continue
        if p.running() or p.proc is None:
            continue
        report = p.exit_report()
        if p.proc.returncode == 0:
            processes.remove(p)
            said.append(f"exited: {report} (stopped by itself: not restarted)")
            continue
        delay = policy.after_crash(p.crashes, p.backoff_s, now - p.started_at, now)
        if delay is None:
            raise GaveUp(f"{p.label} crashed {len(p.crashes)} times within "
                         f"{policy.window_s:.0f}s, not restarting it again; last: {report} "
                         f"(log: {p.log_file})")
        p.backoff_s = delay
        p.restart_at = now + delay
        said.append(f"exited: {report}; restarting it in {delay:.0f}s")
    return said
