"""``ComposeDriver``: ``docker compose ... up -d --scale worker=N --no-recreate``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from .base import REACHABILITY, Driver, DriverError, Launch, WorkerRef

log = logging.getLogger(__name__)


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
        if not self.poll_due(self.poll_s):
            return []
        try:
            counts = {self.service(pool): len(await self.containers(pool)) for pool in self.pools}
        except DriverError:
            return []
        self._summary = ", ".join(f"{service}: {n} containers" for service, n in counts.items()) or "reachable"
        self.succeeded(REACHABILITY)
        return []

    def describe(self) -> str:
        return f"docker compose project {self.project}: {self._summary}"
