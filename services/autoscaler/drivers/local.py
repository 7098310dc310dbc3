"""``LocalDriver``: worker processes on this machine (the default under ``meshserve up``)."""

from __future__ import annotations

import asyncio
import contextlib
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


@dataclass
class _LocalWorker:
    ref: WorkerRef
    proc: subprocess.Popen[bytes]
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
        self.workers: dict[str, _LocalWorker] = {}

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
                ended.append(worker_id)
                if code != 0 and not worker.retiring:
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
    def _signal(worker: _LocalWorker, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(sig)

    def describe(self) -> str:
        alive = self.alive()
        per_pool = Counter(w.ref.pool for w in alive)
        pools = ", ".join(f"{n} {p}" for p, n in sorted(per_pool.items())) or "none"
        return f"{len(alive)}/{self.max_workers} local workers ({pools}); logs in {self.log_dir}"

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

        def wait(proc: subprocess.Popen[bytes]) -> None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.close_timeout_s)

        await asyncio.gather(*(asyncio.to_thread(wait, w.proc) for w in alive))
        for worker in self.alive():
            log.warning("worker %s did not exit within %.0fs: SIGKILL", worker.ref.worker_id, self.close_timeout_s)
            self._signal(worker, signal.SIGKILL)
        for worker in list(self.workers.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(1.0)
