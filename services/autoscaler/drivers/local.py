"""``LocalDriver``: worker processes on this machine (the default under ``meshserve up``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .base import Driver, Launch, WorkerRef, pool_slug

log = logging.getLogger(__name__)


def default_worker_command() -> list[str]:
    return [sys.executable, "-m", "ops.cli", "serve", "worker"]


def process_start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22): with the pid,
    it names one process for good, where a pid alone may be reused. "" when it does not
    run (or is a zombie), or where there is no /proc."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_bytes()
    except OSError:
        return ""
    fields = stat.rsplit(b") ", 1)[-1].split()  # from field 3 (state) on: the name may hold spaces
    return fields[19].decode() if len(fields) > 19 and fields[0] != b"Z" else ""


def _process_args(pid: int) -> list[str]:
    if Path("/proc").is_dir():
        try:
            raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            return []
        return [a.decode(errors="replace") for a in raw.split(b"\0")]
    try:  # elsewhere (macOS): ps
        return subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return []


def is_worker_process(pid: int, worker_id: str, start_time: str) -> bool:
    """Whether ``pid`` is still the worker ``worker_id`` that was started then (not a
    process that reused its pid): it runs, started at ``start_time`` where /proc says,
    and was started with ``--worker-id worker_id``."""
    if pid <= 0:
        return False
    if Path("/proc").is_dir():
        if not start_time or process_start_time(pid) != start_time:
            return False
    else:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
    args = _process_args(pid)
    return any(a == "--worker-id" and b == worker_id for a, b in itertools.pairwise(args))


UNKNOWN_EXIT = -255  # an adopted worker's exit code: not our child, nobody tells us


class _AdoptedProcess:
    """A worker an earlier autoscaler process started (it was killed, its workers served on):
    not our child, so it is watched through its pid and start time instead of waited for,
    and its exit code is unknown."""

    returncode: int | None = None

    def __init__(self, pid: int, worker_id: str, start_time: str) -> None:
        self.pid = pid
        self.worker_id = worker_id
        self.start_time = start_time

    def poll(self) -> int | None:
        if self.returncode is None and not is_worker_process(self.pid, self.worker_id, self.start_time):
            self.returncode = UNKNOWN_EXIT
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a process that reused the pid
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.worker_id} (pid {self.pid})", timeout or 0.0)
            time.sleep(0.05)
        return code


@dataclass
class _LocalWorker:
    ref: WorkerRef
    proc: subprocess.Popen[bytes] | _AdoptedProcess
    log_path: Path
    started_at: float
    retiring: bool = False  # drain over (or forced): the driver ends it if it lingers
    exit_deadline: float | None = None  # SIGTERM after this
    kill_at: float | None = None  # SIGKILL after this


class LocalDriver(Driver):
    """Worker processes on this machine.

    Each worker gets ``--model POOL --worker-id ID`` plus the pool's worker arguments and
    inherits this process's environment (``MESHSERVE_NATS_URL``, ``MESHSERVE_ROOT``...),
    so it joins the same mesh. Workers run in their own session: a Ctrl-C meant for the
    autoscaler's terminal must not reach them, the autoscaler drains them in order.

    With ``pid_dir``, each worker it starts has a file there (``<worker id>.json``: pool,
    pid, process start time) until it ends, and ``open`` adopts the workers whose files an
    earlier autoscaler left (it was killed; they served on) and that still run as those
    processes: they are managed again, scaled down and drained like the ones it starts.
    """

    name = "local"

    def __init__(
        self,
        *,
        log_dir: Path,
        worker_args: Mapping[str, Sequence[str]] | Sequence[str] = (),
        command: Sequence[str] | None = None,
        max_workers: int = 8,
        env: Mapping[str, str] | None = None,
        exit_grace_s: float = 10.0,
        stop_grace_s: float = 10.0,
        on_close: Literal["drain", "leave"] = "drain",
        close_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        pid_dir: Path | None = None,
    ) -> None:
        super().__init__(clock=clock)
        self.log_dir = Path(log_dir)
        self.worker_args = worker_args
        self.command = list(command) if command is not None else default_worker_command()
        self.max_workers = max_workers
        self.env = dict(env) if env is not None else None
        self.exit_grace_s = exit_grace_s
        self.stop_grace_s = stop_grace_s
        self.on_close = on_close
        self.close_timeout_s = close_timeout_s
        self.pid_dir = Path(pid_dir) if pid_dir is not None else None
        self.workers: dict[str, _LocalWorker] = {}
        self.adopted = 0  # workers an earlier autoscaler started, managed here since ``open``

    def args_for(self, pool: str) -> list[str]:
        if isinstance(self.worker_args, Mapping):
            return list(self.worker_args.get(pool, self.worker_args.get("*", ())))
        return list(self.worker_args)

    def alive(self) -> list[_LocalWorker]:
        return [w for w in self.workers.values() if w.proc.poll() is None]

    knows_its_workers = True

    def managed(self) -> set[str]:
        return {w.ref.worker_id for w in self.alive()}

    def log_path(self, worker_id: str) -> Path:
        return self.log_dir / f"autoscaler-{worker_id}.log"

    async def start(self, pool: str, count: int) -> Launch:
        room = self.max_workers - len(self.alive())
        if room <= 0:
            raise self.fail("max_reached", f"max_workers {self.max_workers} reached: cannot start {count} more {pool}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**(self.env if self.env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        started: list[str] = []
        spawn_error: OSError | None = None
        for _ in range(min(count, room)):
            worker_id = f"{pool_slug(pool)}-{uuid.uuid4().hex[:8]}"
            argv = [*self.command, "--model", pool, "--worker-id", worker_id, *self.args_for(pool)]
            path = self.log_path(worker_id)
            try:
                proc = self._spawn(argv, env, path)
            except OSError as exc:
                if not started:
                    raise self.fail("spawn_failed", f"cannot start {argv[0]}: {exc}") from exc
                spawn_error = exc
                break
            self.workers[worker_id] = _LocalWorker(WorkerRef(worker_id, pool, pid=proc.pid), proc, path, self.clock())
            self._write_pid_file(worker_id, pool, proc.pid)
            started.append(worker_id)
            log.info("started worker %s (pid %d, log %s)", worker_id, proc.pid, path)
        if spawn_error is not None:
            self.fail("spawn_failed", f"started {len(started)} of {count} {pool}, then: {spawn_error}")
        elif len(started) < count:
            # Partial: report it, but what did start is real and counted.
            self.fail("max_reached", f"max_workers {self.max_workers} reached: started {len(started)} of {count} {pool}")
        else:
            self.succeeded()
        return Launch(len(started), tuple(started))

    # ---- the workers' files: who started what, for the next autoscaler ------------------
    def _pid_file(self, worker_id: str) -> Path | None:
        return self.pid_dir / f"{worker_id}.json" if self.pid_dir is not None else None

    def _write_pid_file(self, worker_id: str, pool: str, pid: int) -> None:
        path = self._pid_file(worker_id)
        if path is None:
            return
        record = {"worker_id": worker_id, "pool": pool, "pid": pid, "start_time": process_start_time(pid)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as exc:  # the worker runs all the same; only a restarted autoscaler would not know it
            log.warning("cannot record worker %s in %s: %s", worker_id, path, exc)

    def _forget(self, worker_id: str) -> None:
        path = self._pid_file(worker_id)
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    async def open(self) -> None:
        """Adopt the workers an earlier autoscaler of this ``pid_dir`` started that still run."""
        if self.pid_dir is None or not self.pid_dir.is_dir():
            return
        for path in sorted(self.pid_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                worker_id, pool = str(record["worker_id"]), str(record["pool"])
                pid, start_time = int(record["pid"]), str(record.get("start_time", ""))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable worker record %s: %s", path, exc)
                continue
            if self.pools and pool not in self.pools:
                continue  # another autoscaler's pool, sharing this folder
            if worker_id in self.workers:
                continue
            if not is_worker_process(pid, worker_id, start_time):
                with contextlib.suppress(OSError):
                    path.unlink()  # it ended while nobody watched (or its pid is another process now)
                continue
            proc = _AdoptedProcess(pid, worker_id, start_time)
            self.workers[worker_id] = _LocalWorker(WorkerRef(worker_id, pool, pid=pid), proc, self.log_path(worker_id),
                                                   self.clock())
            self.adopted += 1
            log.info("adopted worker %s of %s (pid %d), started by an earlier autoscaler", worker_id, pool, pid)

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        # Popen returns as soon as the child has exec'd (milliseconds), and poll() reaps it
        # without the watcher thread per child asyncio's subprocesses would need.
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    async def stop(self, ref: WorkerRef) -> None:
        worker = self.workers.get(ref.worker_id)
        if worker is None or worker.proc.poll() is not None:
            return
        # A draining worker already ignores a second SIGTERM; it is here because its drain
        # outlived its timeout, so SIGKILL follows after a short grace.
        now = self.clock()
        worker.retiring = True
        worker.exit_deadline = now
        self._signal(worker, signal.SIGTERM)
        worker.kill_at = now + self.stop_grace_s

    async def stopped(self, ref: WorkerRef) -> None:
        worker = self.workers.get(ref.worker_id)
        if worker is None:
            return  # not ours (started by `meshserve up` or by hand): it exits by itself
        if worker.proc.poll() is not None:
            self.workers.pop(ref.worker_id, None)
            self._forget(ref.worker_id)
            return
        worker.retiring = True
        if worker.exit_deadline is None:
            # It deregistered; its process ends within moments. Give it that long.
            worker.exit_deadline = self.clock() + self.exit_grace_s

    async def reap(self) -> list[str]:
        now = self.clock()
        ended: list[str] = []
        for worker_id, worker in list(self.workers.items()):
            code = worker.proc.poll()
            if code is not None:
                del self.workers[worker_id]
                self._forget(worker_id)
                ended.append(worker_id)
                if code == UNKNOWN_EXIT and not worker.retiring:
                    self.fail("worker_exited", f"worker {worker_id} (adopted: its exit code is unknown) exited "
                              f"(log: {worker.log_path})", blocking=False)
                elif code != 0 and not worker.retiring:
                    self.fail("worker_exited", f"worker {worker_id} exited with code {code} (log: {worker.log_path})",
                              blocking=False)
                else:
                    log.info("worker %s exited (code %d)", worker_id, code)
                continue
            if worker.retiring and worker.exit_deadline is not None and now >= worker.exit_deadline:
                if worker.kill_at is None:
                    log.warning("worker %s still running %.0fs after its drain ended: SIGTERM", worker_id, self.exit_grace_s)
                    self._signal(worker, signal.SIGTERM)
                    worker.kill_at = now + self.stop_grace_s
                elif now >= worker.kill_at:
                    log.warning("worker %s ignored SIGTERM: SIGKILL", worker_id)
                    self._signal(worker, signal.SIGKILL)
        return ended

    @staticmethod
    def _signal(worker: _LocalWorker, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(sig)

    def describe(self) -> str:
        alive = self.alive()
        per_pool = Counter(w.ref.pool for w in alive)
        pools = ", ".join(f"{n} {p}" for p, n in sorted(per_pool.items())) or "none"
        adopted = sum(isinstance(w.proc, _AdoptedProcess) for w in alive)
        also = f", {adopted} adopted from an earlier autoscaler" if adopted else ""
        return f"{len(alive)}/{self.max_workers} local workers ({pools}{also}); logs in {self.log_dir}"

    async def close(self) -> None:
        if self.on_close == "leave":
            return
        alive = self.alive()
        if not alive:
            return
        # SIGTERM drains a worker (in-flight requests finish, bounded by its own
        # --drain-timeout); all at once, so the slowest one bounds the wait.
        log.info("draining %d local workers", len(alive))
        for worker in alive:
            self._signal(worker, signal.SIGTERM)

        def wait(proc: subprocess.Popen[bytes] | _AdoptedProcess) -> None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.close_timeout_s)

        await asyncio.gather(*(asyncio.to_thread(wait, w.proc) for w in alive))
        for worker in self.alive():
            log.warning("worker %s did not exit within %.0fs: SIGKILL", worker.ref.worker_id, self.close_timeout_s)
            self._signal(worker, signal.SIGKILL)
        for worker_id, worker in list(self.workers.items()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(1.0)
            if worker.proc.poll() is not None:
                self._forget(worker_id)
