"""A throwaway PostgreSQL server (initdb + pg_ctl) for the ledger's tests and local trials.

Like ``ops/natsserver.py`` for NATS: a real server on a free loopback port with its data
and unix socket in a temporary folder, trust authentication, fsync off (throwaway data).
It finds the binaries on PATH or in Debian's ``/usr/lib/postgresql/<version>/bin``.
PostgreSQL refuses to run as root, so as root it runs them as the ``postgres`` system
user (else ``nobody``) through ``runuser``.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SUPERUSER = "meshserve"


def postgres_bin_dir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    # Debian keeps each major version apart; take the newest.
    versions = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    versions.sort(key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    return versions[-1] if versions else None


def _run_as() -> str | None:
    """The unprivileged user to run PostgreSQL as (None: the current user is fine)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root and neither a postgres nor a nobody user exists")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PostgresServer:
    bin_dir: Path
    port: int = 0
    base_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="meshserve-pg-")))
    user: str | None = field(default_factory=_run_as)
    initialised: bool = False

    def __post_init__(self) -> None:
        self.port = self.port or _free_port()

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *argv: str) -> list[str]:
        if self.user is None:
            return list(argv)
        return ["runuser", "-u", self.user, "--", *argv]

    def _run(self, *argv: str, timeout: float = 60.0) -> None:
        result = subprocess.run(self._cmd(*argv), capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            log = self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({result.returncode}): {result.stderr.strip()}\n{log}")

    def init(self) -> None:
        if self.user is not None:
            shutil.chown(self.base_dir, self.user, self.user)
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--no-sync")
        self.initialised = True

    def start(self) -> PostgresServer:
        if not self.initialised:
            self.init()
        options = f"-p {self.port} -k {self.base_dir} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-o", options, "-l", str(self.log_file),
                  "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast`` disconnects clients and stops; ``immediate`` is a crash (no checkpoint)."""
        if (self.data_dir / "postmaster.pid").exists():
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
