"""``meshserve up``: the whole mesh on this machine, on its embedded defaults.

Starts a local nats-server with JetStream (data under the state folder), provisions the
streams and buckets, starts every service as its own process (``meshserve serve X``),
waits until each answers NATS micro discovery, prints what runs where, and on Ctrl-C
stops everything in order: front door first, workers drained, NATS last.

``Mesh`` is also the test harness's way to run a real mesh of processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus import Bus, BusSettings, provision

from .natsserver import NatsServer, cluster, free_port


@dataclass
class ServiceProcess:
    name: str  # service kind: worker, gateway, ...
    label: str  # unique label, e.g. worker-1
    argv: list[str]
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, base_env: dict[str, str]) -> None:
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", self.name, *self.argv],
            env={**base_env, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C handling stops children in order
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class MeshConfig:
    state_dir: Path = Path(".meshserve")
    nats_port: int = 4222
    nats_nodes: int = 1  # 3: a local JetStream cluster, every stream and bucket R3
    http_port: int = 8080
    root: str = "mesh"
    model: str = "sim-llama-8b"
    workers: int = 2
    speed: float = 1.0
    profile: str | None = None
    worker_args: list[str] = field(default_factory=list)
    services: tuple[str, ...] = ("worker", "router", "admission", "gateway", "metering")
    gateway_args: list[str] = field(default_factory=list)
    # extra arguments per service kind (e.g. {"router": ["--policy", "least_load"]})
    service_args: dict[str, list[str]] = field(default_factory=dict)
    dev_key: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)


class Mesh:
    """A local mesh of real processes on one nats-server (or a JetStream cluster of them)."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir).resolve()
        self.log_dir = self.state_dir / "logs"
        if config.nats_nodes > 1:
            self.nats_nodes = cluster(self.state_dir / "nats", config.nats_nodes)
            for i, node in enumerate(self.nats_nodes):
                node.log_file = self.log_dir / f"nats-{i}.log"
        else:
            self.nats_nodes = [NatsServer(store_dir=self.state_dir / "nats", port=config.nats_port or free_port(),
                                          log_file=self.log_dir / "nats.log")]
        self.nats = self.nats_nodes[0]
        self.processes: list[ServiceProcess] = []
        self.dev_key = ""

    @property
    def nats_url(self) -> str:
        """The first node's URL (a single URL, what plain NATS clients take)."""
        return self.nats.url

    @property
    def replicas(self) -> int:
        return 3 if len(self.nats_nodes) >= 3 else 1

    @property
    def settings(self) -> BusSettings:
        return BusSettings(servers=tuple(n.url for n in self.nats_nodes), root=self.config.root, js_replicas=self.replicas)

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "MESHSERVE_NATS_URL": ",".join(n.url for n in self.nats_nodes),
            "MESHSERVE_JS_REPLICAS": str(self.replicas),
            "MESHSERVE_ROOT": self.config.root,
            "PYTHONUNBUFFERED": "1",
            **self.config.extra_env,
        }
        return env

    def worker_process(self, index: int) -> ServiceProcess:
        c = self.config
        argv = ["--model", c.model, "--speed", str(c.speed), "--worker-id", f"{c.model}-w{index}", *c.worker_args]
        if c.profile:
            argv += ["--profile", c.profile]
        return ServiceProcess("worker", f"worker-{index}", argv, self.log_dir / f"worker-{index}.log")

    def plan(self) -> list[ServiceProcess]:
        plan: list[ServiceProcess] = []
        for name in self.config.services:
            if name == "worker":
                plan += [self.worker_process(i) for i in range(1, self.config.workers + 1)]
            elif name == "gateway":
                argv = ["--port", str(self.config.http_port), "--gateway-id", "gw-1", *self.config.gateway_args]
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
        worker_args = ["--engine", "sim", "--speed", str(c.speed), *(["--profile", c.profile] if c.profile else []),
                       "--drain-timeout", "20", *c.worker_args]
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

    async def start(self, timeout: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for node in self.nats_nodes:
            node.start()
        bus = await Bus.open(self.settings, "meshserve-up", initial_attempts=50)
        try:
            await self._provision(bus, timeout)
            env = self.env()
            self.processes = self.plan()
            for process in self.processes:
                process.start(env)
            await self.wait_ready(bus, timeout)
            if self.config.dev_key:
                from .keys import create_key

                self.dev_key, _ = await create_key(bus, org="dev", tier="premium", name="meshserve up development key")
                (self.state_dir / "dev-key").write_text(self.dev_key + "\n")
                await self.wait_gateway_ready(timeout)
        finally:
            await bus.close()

    async def _provision(self, bus: Bus, timeout: float) -> None:
        """Provision streams and buckets; a fresh cluster first needs a JetStream meta leader."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await provision(bus.js, bus.subjects, replicas=self.replicas)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)

    async def wait_gateway_ready(self, timeout: float) -> None:
        """Until the gateway's /readyz says a worker serves some model."""
        if "gateway" not in self.config.services:
            return
        import aiohttp

        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.gateway_url + "/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gateway not ready after {timeout}s (logs in {self.log_dir})")
                await asyncio.sleep(0.2)

    def add_process(self, process: ServiceProcess) -> ServiceProcess:
        """Start one more service process (an extra worker, a second gateway)."""
        process.start(self.env())
        self.processes.append(process)
        return process

    async def wait_ready(self, bus: Bus, timeout: float) -> None:
        """Until every started service answers ``$SRV.PING`` (NATS micro discovery)."""
        expected: dict[str, int] = {}
        for p in self.processes:
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
            dead = [p.label for p in self.processes if not p.running()]
            if dead:
                raise RuntimeError(f"services exited during start-up: {', '.join(dead)} (logs in {self.log_dir})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"services not ready after {timeout}s: {missing} (logs in {self.log_dir})")
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
        for node in self.nats_nodes:
            node.stop()
        return codes

    def summary(self) -> list[tuple[str, str, str]]:
        rows = [(f"nats-server-{i}" if len(self.nats_nodes) > 1 else "nats-server", n.url, str(n.log_file))
                for i, n in enumerate(self.nats_nodes)]
        for p in self.processes:
            pid = str(p.proc.pid) if p.proc else "-"
            rows.append((p.label, f"pid {pid}", str(p.log_file)))
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


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("up", help="start the whole mesh locally (nats-server and every service)")
    parser.add_argument("--state-dir", default=".meshserve", help="NATS data, logs and the ledger live here")
    parser.add_argument("--nats-port", type=int, default=4222, help="0 picks a free port")
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument("--root", default="mesh", help="subject root of this mesh")
    parser.add_argument("--model", default="sim-llama-8b")
    parser.add_argument("--workers", type=int, default=2, help="sim workers to start")
    parser.add_argument("--speed", type=float, default=1.0, help="sim speed factor (1.0 = real time)")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--no-autoscaler", action="store_true",
                        help="start a fixed set of --workers instead of letting the autoscaler manage the pool")
    parser.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    config = MeshConfig(
        state_dir=Path(args.state_dir), nats_port=args.nats_port, http_port=args.http_port, root=args.root,
        model=args.model, workers=args.workers, speed=args.speed, profile=args.profile,
    )
    if not args.no_autoscaler:
        # The autoscaler owns the pool: it starts --workers replicas and scales with the queue.
        config.services = (*(s for s in config.services if s != "worker"), "autoscaler")
    mesh = Mesh(config)
    stop = asyncio.Event()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        with console.status("starting nats-server and services..."):
            try:
                await mesh.start()
            except Exception as exc:
                console.print(f"[red]meshserve up failed:[/red] {exc}")
                mesh.stop(timeout=10)
                return 1
        table = Table(title="meshserve is up", show_lines=False)
        table.add_column("what")
        table.add_column("where")
        table.add_column("log")
        for row in mesh.summary():
            table.add_row(*row)
        console.print(table)
        console.print(f"NATS: [bold]{mesh.nats_url}[/bold]   subject root: [bold]{config.root}[/bold]")
        if mesh.dev_key:
            console.print(f"OpenAI-compatible API: [bold]{mesh.gateway_url}/v1[/bold]   chat page: {mesh.gateway_url}/")
            console.print(f"development API key (also in {mesh.state_dir / 'dev-key'}):")
            console.print(f"  [bold]{mesh.dev_key}[/bold]")
            console.print(f"  export OPENAI_BASE_URL={mesh.gateway_url}/v1 OPENAI_API_KEY={mesh.dev_key}")
            console.print(f"  curl {mesh.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {mesh.dev_key}' "
                          f"-d '{{\"model\": \"{config.model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'")
        console.print("Ctrl-C stops everything (workers drain first).")
        while not stop.is_set():
            dead = [p for p in mesh.processes if not p.running()]
            if dead:
                console.print(f"[yellow]exited:[/yellow] {', '.join(p.label for p in dead)} (see logs)")
                mesh.processes = [p for p in mesh.processes if p not in dead]
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        console.print("stopping...")
        codes = mesh.stop()
        console.print("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
        return 0

    return asyncio.run(main())
