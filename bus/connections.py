"""Whose NATS connections closed for good: a pure watch over the server's client connect
and disconnect advisories (``Subjects.client_connected`` / ``client_disconnected``).

A worker killed with -9 leaves its heartbeat in the registry until the bucket's TTL
expires (10 s), and every stream on it stalls that long. The NATS server knows at once:
its socket closed. But a closed connection is not always a death: a client whose server
node failed over reconnects to another node within a moment (``reconnect_wait_s`` plus a
handshake). So a name counts as gone only when its last known connection closed and no
connection under that name appeared for ``grace_s``.

Connections are keyed by (server, client id): a client that reconnects elsewhere before
the old node reports the old connection closed keeps one open connection, and is not
declared gone. Connections that opened before the watch started are unknown; a close of
one of them counts as the name's last, unless a newer one is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnectionEvent:
    kind: str  # "connect" or "disconnect"
    name: str  # the client's connection name (a worker connects under its worker id)
    key: tuple[str, int]  # (server, client id): one connection
    reason: str = ""


def parse_advisory(data: bytes) -> ConnectionEvent | None:
    """A ``io.nats.server.advisory.v1.client_connect`` / ``client_disconnect`` message, or
    None for anything else (another type, no client name, not JSON)."""
    try:
        advisory: Any = json.loads(data)
        kind = {"io.nats.server.advisory.v1.client_connect": "connect",
                "io.nats.server.advisory.v1.client_disconnect": "disconnect"}.get(advisory.get("type", ""))
        client, server = advisory.get("client") or {}, advisory.get("server") or {}
        name = client.get("name") or ""
        if kind is None or not name:
            return None
        key = (str(server.get("name") or server.get("id") or ""), int(client.get("id") or 0))
        return ConnectionEvent(kind, str(name), key, str(advisory.get("reason") or ""))
    except (ValueError, TypeError, AttributeError):
        return None


@dataclass
class ConnectionWatch:
    grace_s: float = 0.75
    _open: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    _closed_at: dict[str, float] = field(default_factory=dict)  # name → when its last connection closed

    def observe(self, event: ConnectionEvent, now: float) -> None:
        live = self._open.setdefault(event.name, set())
        if event.kind == "connect":
            live.add(event.key)
            self._closed_at.pop(event.name, None)
            return
        live.discard(event.key)
        if not live:
            del self._open[event.name]
            self._closed_at[event.name] = now

    def due(self, now: float) -> list[str]:
        """Names whose last connection closed at least ``grace_s`` ago, none since; each
        is reported once."""
        gone = [name for name, at in self._closed_at.items() if now - at >= self.grace_s]
        for name in gone:
            del self._closed_at[name]
        return gone

    def next_due(self, now: float) -> float | None:
        """Seconds until the next closed name is due (0 when one is), None when none waits."""
        if not self._closed_at:
            return None
        return max(min(self._closed_at.values()) + self.grace_s - now, 0.0)

    def pending(self) -> int:
        """Names closed and still within their grace."""
        return len(self._closed_at)
