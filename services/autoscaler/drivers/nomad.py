"""``NomadDriver``: the worker task group's count in a Nomad job, through Nomad's HTTP API."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from .base import REACHABILITY, Driver, DriverError, Launch, WorkerRef, pool_slug

log = logging.getLogger(__name__)


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
        if not self.poll_due(self.poll_s):
            return []
        summaries = []
        try:
            for pool in self.pools:
                allocs = await self.allocations(pool)
                states = Counter(str(a.get("ClientStatus", "?")) for a in allocs if a.get("DesiredStatus") == "run")
                summaries.append(f"{self.job_id(pool)}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
        except DriverError:
            return []
        self._summary = "; ".join(summaries) or "reachable"
        self.succeeded(REACHABILITY)
        return []

    def describe(self) -> str:
        return f"Nomad {self.address} group {self.group!r}: {self._summary}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
