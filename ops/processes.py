"""Local processes as ``meshserve up`` sees them: process trees, and the mark that tells
which processes an ``up`` of a state folder started (so that what a killed ``up`` left
running can be found and stopped). Linux's /proc where it is needed; elsewhere empty."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def child_pids(pid: int, *, recursive: bool = False) -> list[int]:
    """The processes ``pid`` started (with ``recursive``, theirs too, at any depth); [] where
    ``pgrep`` is missing."""
    try:
        found = [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    except OSError:
        return []
    if recursive:
        found += [g for c in list(found) for g in child_pids(c, recursive=True)]
    return found


# Every process a ``meshserve up`` starts carries ``<its pid>:<state dir>`` in this variable
# (the autoscaler's workers inherit it), so the next ``up`` of that folder can tell what an
# earlier one left running when it was killed outright (kill -9, an OOM kill).
UP_MARK = "MESHSERVE_UP"


def proc_read(pid: int, name: str) -> bytes:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes()
    except OSError:
        return b""


def parent_pid(pid: int) -> int:
    fields = proc_read(pid, "stat").rsplit(b") ", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else 0


def marked_processes(state_dir: Path) -> dict[int, int]:
    """pid → the pid of the ``meshserve up`` that started it, for each process an ``up`` of
    ``state_dir`` started that is still running (Linux: from /proc; elsewhere none)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    mark = f"{UP_MARK}=".encode()
    want = str(state_dir).encode()
    found: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for var in proc_read(int(entry.name), "environ").split(b"\0"):
            if var.startswith(mark):
                up, _, where = var[len(mark):].partition(b":")
                if where == want and up.isdigit():
                    found[int(entry.name)] = int(up)
                break
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs: exists and is not a zombie (exited, waiting for its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    state = proc_read(pid, "stat").rsplit(b") ", 1)[-1][:1]
    return state != b"Z"  # no /proc (not Linux): it exists, so it runs


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``; one that has gone meanwhile is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_leftovers(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM ``pids`` (nats-server last, so the services can say goodbye to it), then SIGKILL
    whatever still runs after ``grace_s``."""
    nats = [p for p in pids if proc_read(p, "comm").strip() == b"nats-server"]
    for group in ([p for p in pids if p not in nats], nats):
        signal_all(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(running(p) for p in group) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_all([p for p in group if running(p)], signal.SIGKILL)
