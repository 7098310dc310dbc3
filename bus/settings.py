"""Connection settings shared by every service, read from ``MESHSERVE_*`` variables, and a
service process's run options: those settings with ``meshserve serve``'s common options
(``--nats-url``, ``--root``, ``--log-level``, ``--log-format``) over them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from proto.subjects import Subjects

ENV_PREFIX = "MESHSERVE_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def _env(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    value = env.get(ENV_PREFIX + name)
    return value if value not in (None, "") else default


@dataclass(frozen=True, slots=True)
class BusSettings:
    servers: tuple[str, ...] = (DEFAULT_NATS_URL,)
    root: str = "mesh"
    creds_file: str | None = None  # NATS decentralised auth (.creds)
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    js_replicas: int = 1  # R3 on a 3-node cluster
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.root)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BusSettings:
        env = os.environ if env is None else env
        servers = tuple(s.strip() for s in (_env(env, "NATS_URL", DEFAULT_NATS_URL) or "").split(",") if s.strip())
        return cls(
            servers=servers or (DEFAULT_NATS_URL,),
            root=_env(env, "ROOT", "mesh") or "mesh",
            creds_file=_env(env, "NATS_CREDS"),
            user=_env(env, "NATS_USER"),
            password=_env(env, "NATS_PASSWORD"),
            token=_env(env, "NATS_TOKEN"),
            nkey_seed_file=_env(env, "NATS_NKEY"),
            tls_ca=_env(env, "NATS_TLS_CA"),
            tls_cert=_env(env, "NATS_TLS_CERT"),
            tls_key=_env(env, "NATS_TLS_KEY"),
            js_replicas=int(_env(env, "JS_REPLICAS", "1") or 1),
        )

    def with_servers(self, *servers: str) -> BusSettings:
        return replace(self, servers=tuple(servers))


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What a service process runs with: its bus settings and its logging (None: the
    ``MESHSERVE_LOG_*`` variables, else INFO as text)."""

    settings: BusSettings = field(default_factory=BusSettings)
    log_level: str | None = None
    log_format: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RunOptions:
        """The environment's settings with the common command-line options that were given."""
        settings = BusSettings.from_env(env)
        nats_url = getattr(args, "nats_url", None)
        if nats_url:
            settings = settings.with_servers(*(s.strip() for s in nats_url.split(",") if s.strip()))
        root = getattr(args, "root", None)
        if root:
            settings = replace(settings, root=root)
        return cls(settings, getattr(args, "log_level", None) or None, getattr(args, "log_format", None) or None)

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with these options as ``MESHSERVE_*`` variables: the environment of a
        process this one starts (the autoscaler's local workers), so it joins the same mesh."""
        env = {**base, ENV_PREFIX + "NATS_URL": ",".join(self.settings.servers), ENV_PREFIX + "ROOT": self.settings.root}
        if self.log_level:
            env[ENV_PREFIX + "LOG_LEVEL"] = self.log_level
        if self.log_format:
            env[ENV_PREFIX + "LOG_FORMAT"] = self.log_format
        return env
