"""Requests whose gateway is gone for good: a pure watch over the gateways' NATS connections.

A gateway relays each request's tokens to its client; when that gateway dies (``kill -9``,
its host lost), nobody reads them any more. A resumable request goes on (its client may
resume it on another gateway, from TOKENS); any other would run to ``max_tokens`` for
nobody, holding KV blocks and billed in full. So a worker keeps, per gateway, the
non-resumable requests it relays, watches the server's connect/disconnect advisories
(``bus.connections``: a gateway that fails over to another NATS node within the grace is
not gone), and stops those requests once their gateway's connection closed for good.

The grace is longer than the registry's for workers (0.75 s): cancelling a live gateway's
requests cannot be undone, so a gateway gets several reconnect attempts (0.5 s apart).
A gateway restarted under the same id within the grace counts as the same one: its
predecessor's requests then run to their end (as before this watch).
"""

from __future__ import annotations

from bus.connections import ConnectionEvent, ConnectionWatch

GATEWAY_GRACE_S = 2.0


class OrphanWatch:
    def __init__(self, grace_s: float = GATEWAY_GRACE_S) -> None:
        self.connections = ConnectionWatch(grace_s)
        self._by_gateway: dict[str, set[str]] = {}
        self._gateway_of: dict[str, str] = {}
        # Every gateway that relayed a request here: their connections are followed for
        # good (a reconnect while none of its requests is here still counts: a later
        # request must not be stopped for the earlier disconnect). A handful of names.
        self._known: set[str] = set()

    def track(self, request_id: str, gateway_id: str, resumable: bool) -> None:
        if not gateway_id or resumable:
            return
        self._known.add(gateway_id)
        self._by_gateway.setdefault(gateway_id, set()).add(request_id)
        self._gateway_of[request_id] = gateway_id

    def release(self, request_id: str) -> None:
        gateway_id = self._gateway_of.pop(request_id, None)
        if gateway_id is None:
            return
        requests = self._by_gateway.get(gateway_id)
        if requests is not None:
            requests.discard(request_id)
            if not requests:
                del self._by_gateway[gateway_id]

    def observe(self, event: ConnectionEvent, now: float) -> bool:
        """Take an advisory; whether it concerns a gateway with requests here (then ask
        ``due`` once the grace has passed)."""
        if event.name not in self._known:
            return False
        self.connections.observe(event, now)
        return event.kind == "disconnect" and event.name in self._by_gateway

    def due(self, now: float) -> dict[str, list[str]]:
        """Gateway → its requests here, for each gateway gone a grace ago and not back."""
        gone: dict[str, list[str]] = {}
        for gateway_id in self.connections.due(now):  # (a known gateway with nothing here: nothing)
            requests = self._by_gateway.pop(gateway_id, set())
            for request_id in requests:
                self._gateway_of.pop(request_id, None)
            if requests:
                gone[gateway_id] = sorted(requests)
        return gone

    def next_due(self, now: float) -> float | None:
        return self.connections.next_due(now)
