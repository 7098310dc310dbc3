"""``meshserve up``: the whole mesh on this machine, on its embedded defaults.

Starts a local nats-server with JetStream (data under the state folder), provisions the
streams and buckets, starts every service as its own process (``meshserve serve X``),
waits until each answers NATS micro discovery, and stops everything in order: front
door first, workers drained, NATS last. The command line (flags, progress, Ctrl-C, the
banner) is ``ops.up_cli``; each child process and restarting the crashed ones,
``ops.supervise``.

``Mesh`` is also the test harness's way to run a real mesh of processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus import Bus, BusSettings, provision
from proto.workers import WorkerInfo

from .natsserver import NatsServer, cluster, free_port, port_in_use, port_owner
from .processes import (
    UP_MARK,
    marked_processes,
    parent_pid,
    proc_read,
    signal_all,
    stop_leftovers,
)
from .supervise import RestartPolicy, ServiceProcess, supervise


@dataclass
class MeshConfig:
    state_dir: Path = Path(".meshserve")
    nats_port: int = 4222
    nats_nodes: int = 1  # 3: a local JetStream cluster, every stream and bucket R3
    http_port: int = 8080
    root: str = "mesh"
    model: str = "sim-llama-8b"
    workers: int = 2
    # Sim workers that only prefill long prompts for the others (DESIGN.md, Prefill and
    # decode apart), a fixed set beside ``workers``.
    prefill_workers: int = 0
    speed: float = 1.0
    profile: str | None = None
    worker_args: list[str] = field(default_factory=list)
    services: tuple[str, ...] = ("worker", "router", "admission", "gateway", "metering")
    gateway_args: list[str] = field(default_factory=list)
    # extra arguments per service kind (e.g. {"router": ["--policy", "least_load"]})
    service_args: dict[str, list[str]] = field(default_factory=dict)
    dev_key: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    # A NATS (with JetStream) that someone else runs: then no nats-server is started here.
    nats_url: str | None = None
    engine: str = "sim"  # the workers' engine; vllm: ``model_dir`` holds the weights
    model_dir: str | None = None
    # The region every process of this mesh runs in (DESIGN.md, Regions; "": none). The ids
    # of the workers it starts itself (not the autoscaler's, which are unique anyway) and of
    # its gateway carry it, so meshes of several regions on one supercluster never share an id.
    region: str = ""


class StartupError(RuntimeError):
    """Start-up failed for a reason the operator can act on; the message says which and how."""


class Mesh:
    """A local mesh of real processes on one nats-server (or a JetStream cluster of them)."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir).resolve()
        self.log_dir = self.state_dir / "logs"
        self.nats_nodes: list[NatsServer]
        if config.nats_url:
            self.nats_nodes = []
        elif config.nats_nodes > 1:
            self.nats_nodes = cluster(self.state_dir / "nats", config.nats_nodes, root=config.root)
            for i, node in enumerate(self.nats_nodes):
                node.log_file = self.log_dir / f"nats-{i}.log"
        else:
            self.nats_nodes = [NatsServer(store_dir=self.state_dir / "nats", port=config.nats_port or free_port(),
                                          log_file=self.log_dir / "nats.log", root=config.root)]
        for node in self.nats_nodes:
            node.env = {**os.environ, UP_MARK: self._mark}
        self.processes: list[ServiceProcess] = []
        self.leftovers_stopped = 0  # processes an earlier, killed ``up`` of this folder left running
        self.dev_key = ""
        self.dev_key_reused = False
        self.workers: list[WorkerInfo] = []  # the ready workers when start() returned
        self.restart_policy = RestartPolicy()

    @property
    def nats(self) -> NatsServer:
        """The first nats-server this mesh started."""
        if not self.nats_nodes:
            raise AttributeError("this mesh uses a NATS it did not start (--nats-url)")
        return self.nats_nodes[0]

    @property
    def nats_servers(self) -> tuple[str, ...]:
        if self.config.nats_url:
            return tuple(u.strip() for u in self.config.nats_url.split(",") if u.strip())
        return tuple(n.url for n in self.nats_nodes)

    @property
    def nats_url(self) -> str:
        """The first server's URL (a single URL, what plain NATS clients take)."""
        return self.nats_servers[0]

    @property
    def replicas(self) -> int:
        return 3 if len(self.nats_nodes) >= 3 else 1

    @property
    def settings(self) -> BusSettings:
        return BusSettings(servers=self.nats_servers, root=self.config.root, js_replicas=self.replicas)

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "MESHSERVE_NATS_URL": ",".join(self.nats_servers),
            "MESHSERVE_JS_REPLICAS": str(self.replicas),
            "MESHSERVE_ROOT": self.config.root,
            "PYTHONUNBUFFERED": "1",
            UP_MARK: self._mark,
            **({"MESHSERVE_REGION": self.config.region} if self.config.region else {}),
            **self.config.extra_env,
        }
        return env

    @property
    def _mark(self) -> str:
        return f"{os.getpid()}:{self.state_dir}"

    def take_over_leftovers(self) -> None:
        """Stop what an earlier ``meshserve up`` of this state folder left running when it was
        killed outright; refuse to start beside one that still runs."""
        marked = {pid: up for pid, up in marked_processes(self.state_dir).items() if up != os.getpid()}
        # A starter still running is still the parent of the services it started.
        live = sorted({up for pid, up in marked.items() if parent_pid(pid) == up})
        if live:
            starter = b" ".join(proc_read(live[0], "cmdline").split(b"\0")).decode(errors="replace").strip()
            raise StartupError(f"a mesh from {self.state_dir} is already running, started by pid {live[0]} "
                               f"({starter[:80]}): stop it (Ctrl-C in its terminal, or kill {live[0]}), or give "
                               f"this one another --state-dir")
        stale = [pid for pid, up in marked.items() if up not in live]
        if stale:
            stop_leftovers(stale)
            self.leftovers_stopped = len(stale)

    def worker_process(self, index: int, *, prefill: bool = False) -> ServiceProcess:
        c = self.config
        hosted = "--host-models" in c.worker_args
        where = f"{c.region}-" if c.region else ""
        worker_id = (f"host-{where}w{index}" if hosted
                     else f"{Path(c.model).name or 'model'}-{where}{'p' if prefill else 'w'}{index}")
        if c.engine == "vllm":
            argv = ["--engine", "vllm", "--model", c.model, "--worker-id", worker_id,
                    *(["--model-dir", c.model_dir] if c.model_dir else []), *c.worker_args]
        elif c.engine == "echo":
            argv = ["--engine", "echo", "--model", c.model, "--worker-id", worker_id, *c.worker_args]
        else:
            argv = ["--model", c.model, "--speed", str(c.speed), "--worker-id", worker_id, *c.worker_args]
            if c.profile:
                argv += ["--profile", c.profile]
        if prefill:
            argv += ["--role", "prefill"]
            return ServiceProcess("worker", f"prefill-{index}", argv, self.log_dir / f"prefill-{index}.log")
        return ServiceProcess("worker", f"worker-{index}", argv, self.log_dir / f"worker-{index}.log")

    def plan(self) -> list[ServiceProcess]:
        plan: list[ServiceProcess] = []
        for name in self.config.services:
            if name == "worker":
                plan += [self.worker_process(i) for i in range(1, self.config.workers + 1)]
                plan += [self.worker_process(i, prefill=True) for i in range(1, self.config.prefill_workers + 1)]
            elif name == "gateway":
                gateway_id = f"gw-{self.config.region}-1" if self.config.region else "gw-1"
                argv = ["--port", str(self.config.http_port), "--gateway-id", gateway_id, *self.config.gateway_args]
                if self.config.dev_key:  # the chat page offers it, to loopback clients only
                    argv += ["--dev-key-file", str(self.state_dir / "dev-key")]
                if "admission" not in self.config.services:
                    argv += ["--admission-unreachable", "open"]  # a mesh run without admission on purpose
                plan.append(ServiceProcess(name, "gateway", argv, self.log_dir / "gateway.log"))
            elif name == "autoscaler":
                plan.append(self.autoscaler_process())
            elif name == "metering":
                argv = [] if os.environ.get("MESHSERVE_LEDGER_URL") else ["--ledger-url", str(self.state_dir / "ledger.sqlite3")]
                plan.append(ServiceProcess(name, name, argv, self.log_dir / "metering.log"))
            else:
                plan.append(ServiceProcess(name, name, [], self.log_dir / f"{name}.log"))
        for p in plan:
            p.argv = [*p.argv, *self.config.service_args.get(p.name, [])]
        return plan

    def autoscaler_process(self) -> ServiceProcess:
        """The autoscaler with the local driver: it starts (and drains) the pool's workers itself."""
        c = self.config
        engine = ["--engine", "echo"] if c.engine == "echo" else [
            "--engine", "sim", "--speed", str(c.speed), *(["--profile", c.profile] if c.profile else [])]
        worker_args = [*engine, "--drain-timeout", "20", *c.worker_args]
        argv = [
            "--driver", "local", "--pool", c.model, "--min-replicas", str(c.workers),
            "--max-replicas", str(max(4, c.workers)), "--max-workers", str(max(4, c.workers)),
            "--state-dir", str(self.state_dir), "--drain-timeout", "20", "--drain-grace", "5",
            "--worker-args", " ".join(worker_args),
        ]
        return ServiceProcess("autoscaler", "autoscaler", argv, self.log_dir / "autoscaler.log")

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.config.http_port}"

    def busy_ports(self) -> list[str]:
        """Each port this mesh would listen on that another process holds, with its owner and the flag to change it."""
        wanted: list[tuple[int, str, str]] = [(n.port, f"NATS ({n.server_name})", "--nats-port") for n in self.nats_nodes]
        wanted += [(n.cluster_port, "NATS cluster route", "") for n in self.nats_nodes if n.cluster_port]
        if "gateway" in self.config.services:
            wanted.append((self.config.http_port, "HTTP (gateway)", "--http-port"))
        busy = []
        for port, what, flag in wanted:
            if port and port_in_use(port):
                owner = port_owner(port)
                alt = _next_free(port)
                hint = f"; choose another with {flag} {alt} (make up ARGS=\"{flag} {alt}\")" if flag else ""
                busy.append(f"port {port} for {what} is in use" + (f" by {owner}" if owner else "") + hint)
        return busy

    async def start(self, timeout: float = 60.0, progress: Callable[[str], None] | None = None,
                    wait_workers: bool = True) -> None:
        """Start everything and wait until it answers; raise ``StartupError`` saying what failed.

        Cancelling it (Ctrl-C during start-up) leaves started processes to ``stop()``; a
        failure stops them itself, so a caller that only sees the exception (a benchmark
        whose gateway could not start) leaves no orphaned mesh behind.
        ``wait_workers=False`` returns once the control plane answers: workers (or the
        autoscaler's) may still be loading, or none may be configured (they join later).
        """
        try:
            await self._start(timeout, progress, wait_workers)
        except Exception:
            self.stop(timeout=10.0)
            raise

    async def _start(self, timeout: float, progress: Callable[[str], None] | None, wait_workers: bool) -> None:
        say = progress or (lambda _text: None)
        say("looking for a mesh an earlier run left behind")
        self.take_over_leftovers()
        busy = self.busy_ports()
        if busy:
            raise StartupError("; ".join(busy))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.nats_nodes:
            say("starting nats-server")
            for node in self.nats_nodes:
                node.start(wait=False)
            for node in self.nats_nodes:
                await node.wait_listening()
        say(f"connecting to NATS at {self.nats_url}")
        try:
            bus = await Bus.open(self.settings, "meshserve-up", initial_attempts=3 if self.nats_nodes else 2)
        except Exception as exc:
            raise StartupError(f"cannot connect to NATS at {', '.join(self.nats_servers)}: {exc}") from exc
        try:
            say("creating streams and buckets")
            await self._provision(bus, timeout)
            env = self.env()
            self.processes = self.plan()
            for process in self.processes:
                process.start(env)
            kinds = None if wait_workers else {p.name for p in self.processes if p.name != "worker"}
            await self.wait_ready(bus, timeout, kinds=kinds, progress=say)
            if self.config.dev_key:
                await self._dev_key(bus)
            if wait_workers:
                await self.wait_gateway_ready(timeout, bus=bus, progress=say)
            self.workers = await ready_workers(bus)
        finally:
            await bus.close()

    async def _dev_key(self, bus: Bus) -> None:
        """One development key per state folder: reuse the one in ``dev-key`` while the key store still
        holds it unrevoked, else mint a new one (premium, org ``dev``) and revoke the one it replaces."""
        from bus.keys import KeyStore
        from services.gateway.apikeys import hash_key, parse_key

        from .keys import create_key

        path = self.state_dir / "dev-key"
        store = await KeyStore(bus).open()
        previous = path.read_text().strip() if path.exists() else ""
        parsed = parse_key(previous) if previous else None
        record = await store.get(parsed.key_id) if parsed else None
        if record is not None and not record.revoked and record.key_hash == hash_key(previous):
            self.dev_key, self.dev_key_reused = previous, True
            return
        if record is not None and not record.revoked:
            await store.revoke(record.key_id)
        self.dev_key, _ = await create_key(bus, org="dev", tier="premium", name="meshserve up development key")
        self.dev_key_reused = False
        path.write_text(self.dev_key + "\n")
        path.chmod(0o600)

    async def _provision(self, bus: Bus, timeout: float) -> None:
        """Provision streams and buckets; a fresh cluster first needs a JetStream meta leader."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await provision(bus.js, bus.subjects, replicas=self.replicas)
                return
            except Exception as exc:
                if not self.nats_nodes and "ServiceUnavailable" in type(exc).__name__:
                    # nats.py's answer when nobody serves $JS.API: the server runs without JetStream.
                    raise StartupError(f"the NATS at {self.nats_url} has no JetStream (meshserve stores tokens, "
                                       "usage and keys in it): start nats-server with -js") from exc
                if time.monotonic() > deadline:
                    raise StartupError(f"cannot create JetStream streams on {self.nats_url}: {exc!r}") from exc
                await asyncio.sleep(0.3)

    def _check_children(self) -> None:
        """Fail at once, with its own last words, when a child exited during start-up."""
        for node in self.nats_nodes:
            node.check_alive()
        dead = [p for p in self.processes if not p.running()]
        if dead:
            raise StartupError("exited during start-up: " + "; ".join(p.exit_report() for p in dead)
                               + f" (logs in {self.log_dir})")

    async def wait_gateway_ready(self, timeout: float, bus: Bus | None = None,
                                 progress: Callable[[str], None] | None = None) -> None:
        """Until the gateway's /readyz says a worker serves some model."""
        if "gateway" not in self.config.services:
            return
        import aiohttp

        t0 = time.monotonic()
        deadline = t0 + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.gateway_url + "/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                self._check_children()
                if progress is not None and bus is not None:
                    ready = len(await ready_workers(bus))
                    progress(f"waiting for workers ({ready} ready, {time.monotonic() - t0:.0f}s; "
                             f"a vLLM engine takes a minute to load)")
                if time.monotonic() > deadline:
                    raise StartupError(f"no worker ready after {timeout:.0f}s (logs in {self.log_dir})")
                await asyncio.sleep(0.5 if progress else 0.2)

    def nats_lost(self) -> list[NatsServer] | None:
        """The nats-servers started here that exited, when too many did for the mesh to work
        on (the only one, or a majority of a cluster: JetStream has no quorum); else None.
        A mesh on a NATS it did not start (``--nats-url``) never says so."""
        dead = [node for node in self.nats_nodes if not node.running()]
        if not self.nats_nodes or len(self.nats_nodes) - len(dead) > len(self.nats_nodes) // 2:
            return None
        return dead

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart the service processes that crashed (``RestartPolicy``), as a supervisor
        would: what it did, one line each. A process that exited 0 stopped on purpose and is
        left stopped. Raise ``GaveUp`` with the child's last words when one keeps crashing.
        Called only while the mesh runs (never while it stops: a stop restarts nothing).

        The autoscaler's workers are not ours to restart (it starts and replaces them); the
        workers started here (no autoscaler) are, as any other service. NATS is not: its
        loss stops the mesh (``nats_lost``)."""
        return supervise(self.processes, self.restart_policy, self.env(), time.monotonic() if now is None else now)

    def add_process(self, process: ServiceProcess) -> ServiceProcess:
        """Start one more service process (an extra worker, a second gateway)."""
        process.start(self.env())
        self.processes.append(process)
        return process

    async def wait_ready(self, bus: Bus, timeout: float, kinds: set[str] | None = None,
                         progress: Callable[[str], None] | None = None) -> None:
        """Until every started service (of ``kinds``, default all) answers ``$SRV.PING`` (NATS micro discovery)."""
        expected: dict[str, int] = {}
        for p in self.processes:
            if kinds is None or p.name in kinds:
                expected[p.name] = expected.get(p.name, 0) + 1
        deadline = time.monotonic() + timeout
        while True:
            missing = {}
            for name, count in expected.items():
                seen = await discover(bus, f"meshserve-{name}")
                if len(seen) < count:
                    missing[name] = count - len(seen)
            if not missing:
                return
            self._check_children()
            if progress is not None:
                progress("waiting for " + ", ".join(sorted(missing)))
            if time.monotonic() > deadline:
                raise StartupError(f"services not ready after {timeout:.0f}s: {', '.join(sorted(missing))} "
                                   f"(logs in {self.log_dir})")
            await asyncio.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Front door first, then workers (they drain), then the rest, NATS last."""
        order = {"gateway": 0, "autoscaler": 1, "worker": 2, "router": 3, "admission": 3, "metering": 4}
        codes: dict[str, int | None] = {}
        for rank in sorted(set(order.values()) | {9}):
            group = [p for p in self.processes if order.get(p.name, 9) == rank]
            for p in group:
                p.terminate()
            deadline = time.monotonic() + timeout  # one deadline for the group: they drain in parallel
            for p in group:
                codes[p.label] = p.wait(max(deadline - time.monotonic(), 0.1))
        stop_leftovers(self._strays())
        for node in self.nats_nodes:
            node.stop()
        return codes

    def kill(self) -> None:
        """Kill -9 every process at once (a second Ctrl-C while stopping)."""
        for p in self.processes:
            p.kill()
        signal_all(self._strays(), signal.SIGKILL)
        for node in self.nats_nodes:
            node.kill()

    def _strays(self) -> list[int]:
        """Processes this mesh started that run on without a parent here: the workers of an
        autoscaler that died (they run in sessions of their own)."""
        nats = {node.pid for node in self.nats_nodes}
        return [pid for pid, up in marked_processes(self.state_dir).items() if up == os.getpid() and pid not in nats]

    def summary(self) -> list[tuple[str, str, str]]:
        rows = [(f"nats-server-{i}" if len(self.nats_nodes) > 1 else "nats-server", n.url, str(n.log_file))
                for i, n in enumerate(self.nats_nodes)]
        if not self.nats_nodes:
            rows.append(("NATS (not started here)", self.nats_url, "-"))
        by_pid: dict[int, list[WorkerInfo]] = {}
        for w in self.workers:
            by_pid.setdefault(w.pid, []).append(w)
        for p in self.processes:
            pid = p.proc.pid if p.proc else 0
            entries = by_pid.get(pid, [])
            if len(entries) > 1 or (entries and entries[0].host_id):  # a hot-swap host: one entry per model
                models = ", ".join(sorted(w.model for w in entries))
                rows.append((f"{p.label} {entries[0].host_id}", f"pid {pid} ({entries[0].engine}, hosts {models})",
                             str(p.log_file)))
                continue
            one = entries[0] if entries else None
            role = ", prefill only" if one is not None and one.role == "prefill" else ""
            rows.append((f"{p.label} {one.worker_id}" if one else p.label,
                         f"pid {pid or '-'}" + (f" ({one.engine}, {one.model}{role})" if one else ""), str(p.log_file)))
        started_here = {p.proc.pid for p in self.processes if p.proc}
        for w in self.workers:
            if w.pid not in started_here:  # the autoscaler's workers, or ones started by hand
                log = self.log_dir / f"autoscaler-{w.worker_id}.log"
                rows.append((f"worker {w.worker_id}", f"pid {w.pid} ({w.engine}, {w.model})",
                             str(log) if log.exists() else "-"))
        return rows


async def discover(bus: Bus, service: str, wait: float = 0.3) -> list[dict[str, Any]]:
    """Every instance of a NATS micro service that answers a PING within ``wait`` seconds."""
    inbox = bus.nc.new_inbox()
    found: list[dict[str, Any]] = []

    async def collect(msg: Any) -> None:
        found.append(json.loads(msg.data))

    sub = await bus.nc.subscribe(inbox, cb=collect)
    await bus.nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return found


async def ready_workers(bus: Bus) -> list[WorkerInfo]:
    """The workers whose registry entry says ready, read once from the ``mesh_workers`` bucket."""
    from bus.mirror import live_entries
    from bus.provision import workers_bucket
    from proto.codec import decode
    from proto.errors import DecodeError

    kv = await workers_bucket(bus.js, bus.subjects, replicas=bus.settings.js_replicas)
    found = []
    for entry in await live_entries(bus, kv):
        with contextlib.suppress(DecodeError):  # a record of another version: not one of ours to count
            info = decode(entry.value or b"", WorkerInfo)
            if info.state == "ready":
                found.append(info)
    return sorted(found, key=lambda w: w.worker_id)


def _next_free(port: int) -> int:
    """A nearby free port to suggest in an error."""
    for candidate in range(port + 1, min(port + 50, 65535)):
        if not port_in_use(candidate):
            return candidate
    return free_port()
