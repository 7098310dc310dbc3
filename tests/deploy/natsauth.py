"""A loopback nats-server with meshserve's accounts config (rendered with literal passwords)."""

from __future__ import annotations

from dataclasses import dataclass

from bus import BusSettings
from ops.nats.accounts import OPS_USER, SERVICES, SYSTEM_USER
from ops.natsserver import NatsServer

API_CLIENTS = ("app", "other-app")


def password(user: str) -> str:
    return f"pw-{user}"


PASSWORDS = {u: password(u) for u in (*SERVICES, OPS_USER, SYSTEM_USER, *API_CLIENTS)}


@dataclass
class AuthNatsServer(NatsServer):
    """A loopback nats-server whose config adds the accounts rendered from ops.nats.accounts."""

    accounts: str = ""

    def accounts_text(self) -> str:
        return self.accounts

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file and self.log_file.exists() else ""

    def violations(self) -> list[str]:
        return [line for line in self.log_text().splitlines() if "Violation" in line]


def settings_for(server: AuthNatsServer, user: str) -> BusSettings:
    """A service's bus settings as ``user`` of the accounts config."""
    return BusSettings(servers=(server.url,), user=user, password=PASSWORDS[user])
