"""Drivers: how the autoscaler's decisions become replicas (DESIGN.md, Autoscaling).

One interface, three implementations:

- ``LocalDriver`` (the embedded default under ``meshserve up``): worker processes on this
  machine, ``python -m ops.cli serve worker --model POOL --worker-id ID ...``, logs in the
  state folder. It knows each worker's id and process, so it can stop exactly one.
- ``NomadDriver``: the worker task group's count in a Nomad job, through Nomad's HTTP API.
- ``ComposeDriver``: ``docker compose -p PROJECT up -d --scale worker=N --no-recreate``.

The shell never kills a replica to scale down. It drains the replica the control law
chose (``ControlCommand(drain)``); the worker refuses new work, finishes what it holds,
deregisters and exits by itself. Only then does the shell call ``stopped(ref)``, and the
driver releases what the orchestrator holds for it (reaps the process, removes the
container, lowers the job's count). ``stop(ref)`` is the forced stop, used only once an
acknowledged drain has outlived its timeout (by then the worker has ended its requests
itself, so a worker still there is hung).

A driver that cannot act raises ``DriverError(reason, message)`` and remembers why:
``status()`` reports it and every error is counted by reason (the shell turns the counts
into ``meshserve:autoscaler_driver_errors_total{driver,reason}``). Nothing silently does
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import aiohttp

log = logging.getLogger(__name__)

ErrorListener = Callable[[str, str, str], None]  # (driver name, reason, message)
# Problems a successful periodic probe disproves.
_REACHABILITY = frozenset({"unreachable", "docker_missing", "timeout", "bad_response", "forbidden"})


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """What the shell knows of a worker when it asks a driver to act on it.

    ``host`` is the worker's hostname from its registry entry: inside a container that is
    the container's short id (Docker's default), which is how ``ComposeDriver`` finds it.
    """

    worker_id: str
    pool: str
    host: str = ""
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Launch:
    """What a ``start`` did: how many replicas were asked for, with their ids when known."""

    count: int
    worker_ids: tuple[str, ...] = ()  # LocalDriver names its workers; orchestrators do not


@dataclass(frozen=True, slots=True)
class DriverStatus:
    ok: bool
    message: str
    errors: Mapping[str, int] = field(default_factory=dict)  # reason → count since start
    last_error: str = ""
    last_error_at: float = 0.0


class DriverError(Exception):
    """A driver could not do what it was asked; ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def pool_slug(pool: str) -> str:
    """A model name as a short, safe name fragment (worker ids, Nomad job ids)."""
    short = pool.rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9-]+", "-", short).strip("-")[:32] or "pool"


class Driver(ABC):
    name: ClassVar[str] = "driver"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.errors: Counter[str] = Counter()
        self.problem: str | None = None  # why the driver cannot act now, if it cannot
        self.problem_reason = ""
        self.last_error = ""
        self.last_error_at = 0.0
        self._listeners: list[ErrorListener] = []
        self.pools: tuple[str, ...] = ()  # set by the shell: the pools it scales (for polling)

    # ---- the interface ---------------------------------------------------------------
    @abstractmethod
    async def start(self, pool: str, count: int) -> Launch:
        """Launch ``count`` more replicas of ``pool``; raise ``DriverError`` if none could be."""

    @abstractmethod
    async def stop(self, ref: WorkerRef) -> None:
        """Forcibly stop one replica now: only for a drain that outlived its timeout."""

    @abstractmethod
    async def stopped(self, ref: WorkerRef) -> None:
        """The replica's drain is over (it deregistered, or was force-stopped): release it."""

    async def reap(self) -> list[str]:
        """Per-tick housekeeping; the worker ids whose process ended since the last call."""
        return []

    @abstractmethod
    def describe(self) -> str:
        """One line on what the driver manages, for ``status`` when all is well."""

    def managed(self) -> set[str]:
        """Ids of the workers this driver runs, where it knows them."""
        return set()

    async def close(self) -> None:  # noqa: B027 - a hook: most drivers hold nothing to release
        """The autoscaler is stopping."""

    # ---- error bookkeeping shared by every driver -------------------------------------
    def on_error(self, listener: ErrorListener) -> None:
        self._listeners.append(listener)

    def fail(self, reason: str, message: str, *, blocking: bool = True) -> DriverError:
        """Record a failure (status, counters, listeners) and return the error to raise.

        ``blocking``: the driver cannot act until an operation succeeds again (status not
        ok); a non-blocking failure (one worker crashed) is counted and shown, no more.
        """
        self.errors[reason] += 1
        if blocking:
            self.problem, self.problem_reason = message, reason
        self.last_error = message
        self.last_error_at = self.clock()
        log.warning("%s driver: %s", self.name, message)
        for listener in self._listeners:
            try:
                listener(self.name, reason, message)
            except Exception:
                log.exception("driver error listener failed")
        return DriverError(reason, message)

    def succeeded(self, clears: frozenset[str] | None = None) -> None:
        """An operation worked: the driver can act again.

        ``clears`` limits which problems this success disproves (a reachability probe
        does not prove that a maximum is no longer reached).
        """
        if clears is None or self.problem_reason in clears:
            self.problem, self.problem_reason = None, ""

    def status(self) -> DriverStatus:
        return DriverStatus(
            ok=self.problem is None,
            message=self.problem if self.problem is not None else self.describe(),
            errors=dict(self.errors),
            last_error=self.last_error,
            last_error_at=self.last_error_at,
        )


# =========================================================================== local processes


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


# =========================================================================== Nomad


class NomadDriver(Driver):
    """The count of a Nomad job's worker task group, through Nomad's HTTP API.

    Each pool maps to one job (``jobs`` or ``job_template`` with ``{pool}`` = the pool's
    slug); its workers are the task group ``group``. Scale up reads the job
    (``GET /v1/job/:job_id``) and raises the group's count
    (``POST /v1/job/:job_id/scale``). Scale down: the shell drains the chosen worker
    first; once it has exited, ``stopped`` lowers the count by one. Nomad picks which
    allocation a lower count stops: if it is not the drained one, that allocation gets
    SIGTERM, which drains a worker within the job's ``kill_timeout`` (set it above the
    worker's ``--drain-timeout``), and the drained one is restarted fresh by its restart
    policy: one extra cold start, never an aborted request. A worker whose id contains its
    allocation id (run workers with ``--worker-id ${NOMAD_ALLOC_ID}``) can be found for a
    forced stop (``POST /v1/allocation/:alloc_id/stop``).
    """

    name = "nomad"

    def __init__(
        self,
        *,
        address: str = "http://127.0.0.1:4646",
        token: str | None = None,
        jobs: Mapping[str, str] | None = None,
        job_template: str = "meshserve-{pool}",
        group: str = "workers",
        namespace: str | None = None,
        region: str | None = None,
        timeout_s: float = 10.0,
        poll_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock=clock)
        self.address = address.rstrip("/")
        self.token = token
        self.jobs = dict(jobs or {})
        self.job_template = job_template
        self.group = group
        self.namespace = namespace
        self.region = region
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._session: aiohttp.ClientSession | None = None
        self._polled_at: float | None = None
        self._summary = "not contacted yet"

    def job_id(self, pool: str) -> str:
        return self.jobs.get(pool) or self.job_template.format(pool=pool_slug(pool))

    def _params(self) -> dict[str, str]:
        params = {}
        if self.namespace:
            params["namespace"] = self.namespace
        if self.region:
            params["region"] = self.region
        return params

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"X-Nomad-Token": self.token} if self.token else {}
        url = f"{self.address}{path}"
        try:
            async with self._session.request(method, url, json=body, headers=headers, params=self._params()) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    reason = {403: "forbidden", 404: "not_found"}.get(resp.status, f"http_{resp.status}")
                    raise self.fail(reason, f"Nomad {method} {path}: HTTP {resp.status} {text.strip()[:200]}")
                return json.loads(text) if text.strip() else None
        except DriverError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise self.fail("unreachable", f"Nomad at {self.address} unreachable: {exc!r}") from exc
        except ValueError as exc:
            raise self.fail("bad_response", f"Nomad {method} {path}: not JSON: {exc}") from exc

    async def group_count(self, pool: str) -> tuple[int, int | None]:
        """The worker group's count and its scaling maximum (None when the job sets none)."""
        job_id = self.job_id(pool)
        job = await self._call("GET", f"/v1/job/{job_id}")
        for group in (job or {}).get("TaskGroups") or []:
            if group.get("Name") == self.group:
                scaling = group.get("Scaling") or {}
                maximum = scaling.get("Max")
                return int(group.get("Count") or 0), (int(maximum) if maximum is not None else None)
        raise self.fail("no_group", f"Nomad job {job_id} has no task group {self.group!r}")

    async def scale(self, pool: str, count: int, message: str) -> None:
        job_id = self.job_id(pool)
        body = {"Count": count, "Target": {"Group": self.group}, "Message": message}
        await self._call("POST", f"/v1/job/{job_id}/scale", body)

    async def allocations(self, pool: str) -> list[dict[str, Any]]:
        allocs = await self._call("GET", f"/v1/job/{self.job_id(pool)}/allocations")
        return [a for a in (allocs or []) if a.get("TaskGroup", self.group) == self.group]

    async def start(self, pool: str, count: int) -> Launch:
        current, maximum = await self.group_count(pool)
        target = current + count
        if maximum is not None and target > maximum:
            if current >= maximum:
                raise self.fail("max_reached", f"Nomad job {self.job_id(pool)} is at its scaling max {maximum}")
            target = maximum
        await self.scale(pool, target, f"meshserve autoscaler: scale up {pool} {current} → {target}")
        if target - current < count:
            self.fail("max_reached", f"Nomad job {self.job_id(pool)} capped at scaling max {maximum}: started {target - current} of {count}")
        else:
            self.succeeded()
        return Launch(target - current)

    def _alloc_of(self, ref: WorkerRef, allocs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        for alloc in allocs:
            alloc_id = str(alloc.get("ID", ""))
            if alloc_id and (alloc_id in ref.worker_id or alloc_id[:8] in ref.worker_id or alloc_id[:8] == ref.host[:8]):
                return alloc
        return None

    async def stop(self, ref: WorkerRef) -> None:
        alloc = self._alloc_of(ref, await self.allocations(ref.pool))
        if alloc is None:
            # stopped() still lowers the count: Nomad then stops some allocation with
            # SIGTERM and kill_timeout, which is as forceful as we can be without a mapping.
            raise self.fail("unmapped", f"no allocation of {self.job_id(ref.pool)} matches worker {ref.worker_id}")
        await self._call("POST", f"/v1/allocation/{alloc['ID']}/stop")
        self.succeeded()

    async def stopped(self, ref: WorkerRef) -> None:
        current, _ = await self.group_count(ref.pool)
        if current <= 0:
            return
        await self.scale(ref.pool, current - 1, f"meshserve autoscaler: scale down {ref.pool}: {ref.worker_id} drained")
        self.succeeded()

    async def reap(self) -> list[str]:
        # Polling the API every tick would load Nomad for nothing: every poll_s.
        now = self.clock()
        if self._polled_at is not None and now - self._polled_at < self.poll_s:
            return []
        self._polled_at = now
        summaries = []
        try:
            for pool in self.pools:
                allocs = await self.allocations(pool)
                states = Counter(str(a.get("ClientStatus", "?")) for a in allocs if a.get("DesiredStatus") == "run")
                summaries.append(f"{self.job_id(pool)}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
        except DriverError:
            return []
        self._summary = "; ".join(summaries) or "reachable"
        self.succeeded(_REACHABILITY)
        return []

    def describe(self) -> str:
        return f"Nomad {self.address} group {self.group!r}: {self._summary}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


# =========================================================================== docker compose


class ComposeDriver(Driver):
    """``docker compose -p PROJECT up -d --scale SERVICE=N --no-recreate`` per pool.

    The compose file's worker service must use ``restart: on-failure`` (a drained worker
    exits 0 and must stay down) and keep Docker's default hostname (the container's short
    id, which the worker reports as its host): ``stopped`` removes exactly the drained
    container, then re-states the scale so compose does not bring it back.
    """

    name = "compose"

    def __init__(
        self,
        *,
        project: str = "meshserve",
        files: Sequence[str] = (),
        services: Mapping[str, str] | None = None,
        default_service: str = "worker",
        docker: str = "docker",
        timeout_s: float = 600.0,
        stop_grace_s: float = 10.0,
        poll_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock=clock)
        self.project = project
        self.files = list(files)
        self.services = dict(services or {})
        self.default_service = default_service
        self.docker = docker
        self.timeout_s = timeout_s  # `up` may pull an image: minutes
        self.stop_grace_s = stop_grace_s
        self.poll_s = poll_s
        self.env = dict(env) if env is not None else None
        self._polled_at: float | None = None
        self._summary = "not contacted yet"

    def service(self, pool: str) -> str:
        return self.services.get(pool, self.default_service)

    def compose_argv(self, *args: str) -> list[str]:
        argv = [self.docker, "compose", "-p", self.project]
        for f in self.files:
            argv += ["-f", f]
        return [*argv, *args]

    async def _run(self, argv: Sequence[str], timeout: float | None = None) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
                env=self.env,
            )
        except FileNotFoundError as exc:
            raise self.fail("docker_missing", f"{self.docker!r} not found: cannot run docker compose") from exc
        except OSError as exc:
            raise self.fail("docker_missing", f"cannot run {self.docker!r}: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout or self.timeout_s)
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise self.fail("timeout", f"{' '.join(argv[:6])}... took over {timeout or self.timeout_s:.0f}s") from exc
        if proc.returncode != 0:
            detail = err.decode(errors="replace").strip()[-300:] or out.decode(errors="replace").strip()[-300:]
            # A daemon that is down is a reachability problem the next probe can clear; any
            # other failure (bad compose file, image) stays until an operation succeeds.
            reason = "unreachable" if "docker daemon" in detail.lower() else "command_failed"
            raise self.fail(reason, f"{' '.join(argv)} exited with {proc.returncode}: {detail}")
        return out.decode(errors="replace")

    async def containers(self, pool: str) -> list[str]:
        """Ids of the pool service's containers, stopped ones too: ``--scale`` counts them all."""
        out = await self._run(self.compose_argv("ps", "-a", "-q", self.service(pool)), timeout=60.0)
        return [line.strip() for line in out.splitlines() if line.strip()]

    async def scale(self, pool: str, count: int) -> None:
        service = self.service(pool)
        await self._run(self.compose_argv("up", "-d", "--scale", f"{service}={count}", "--no-recreate", service))

    async def start(self, pool: str, count: int) -> Launch:
        current = len(await self.containers(pool))
        await self.scale(pool, current + count)
        self.succeeded()
        return Launch(count)

    async def stop(self, ref: WorkerRef) -> None:
        if not ref.host:
            raise self.fail("unmapped", f"worker {ref.worker_id} reported no host: cannot find its container")
        # docker stop: SIGTERM, then SIGKILL after the grace.
        await self._run([self.docker, "stop", "--time", str(int(self.stop_grace_s)), ref.host], timeout=self.stop_grace_s + 30)
        self.succeeded()

    async def stopped(self, ref: WorkerRef) -> None:
        if ref.host:
            # The worker deregistered after its drain: stopping what is left is safe, and
            # removing the container keeps `up --scale` from starting it again.
            await self._run([self.docker, "stop", "--time", str(int(self.stop_grace_s)), ref.host], timeout=self.stop_grace_s + 30)
            await self._run([self.docker, "rm", ref.host], timeout=60.0)
            await self.scale(ref.pool, len(await self.containers(ref.pool)))
        else:
            # No container to name: compose picks which one goes; it gets SIGTERM (drain)
            # and the service's stop_grace_period.
            await self.scale(ref.pool, max(0, len(await self.containers(ref.pool)) - 1))
        self.succeeded()

    async def reap(self) -> list[str]:
        now = self.clock()
        if self._polled_at is not None and now - self._polled_at < self.poll_s:
            return []
        self._polled_at = now
        try:
            counts = {self.service(pool): len(await self.containers(pool)) for pool in self.pools}
        except DriverError:
            return []
        self._summary = ", ".join(f"{service}: {n} containers" for service, n in counts.items()) or "reachable"
        self.succeeded(_REACHABILITY)
        return []

    def describe(self) -> str:
        return f"docker compose project {self.project}: {self._summary}"
