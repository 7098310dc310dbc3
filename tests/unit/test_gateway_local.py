"""Who gets the development key: clients on the gateway's own host, and nobody forwarded."""

from __future__ import annotations

import pytest

from services.gateway.local import is_local_request

HOST = {"Host": "127.0.0.1:8080"}


@pytest.mark.parametrize(("peer", "headers"), [
    ("127.0.0.1", HOST),
    ("::1", {"Host": "[::1]:8080"}),
    ("127.0.0.1", {"Host": "localhost:8080", "Sec-Fetch-Site": "same-origin"}),
    ("127.0.0.1", {"Host": "localhost", "Sec-Fetch-Site": "none"}),  # typed into the address bar
    ("127.0.0.1", {**HOST, "X-Forwarded-For": "127.0.0.1"}),  # a local proxy for a local client
    ("127.0.0.1", {**HOST, "Forwarded": 'for="[::1]:5555"'}),
])
def test_local(peer: str, headers: dict[str, str]) -> None:
    assert is_local_request(peer, headers)


@pytest.mark.parametrize(("peer", "headers"), [
    ("10.0.0.5", HOST),
    (None, HOST),
    ("", HOST),
    ("127.0.0.1", {**HOST, "X-Forwarded-For": "203.0.113.7"}),
    ("127.0.0.1", {**HOST, "X-Forwarded-For": "127.0.0.1, 203.0.113.7"}),
    ("127.0.0.1", {**HOST, "X-Forwarded-For": "garbage"}),
    ("127.0.0.1", {**HOST, "X-Real-IP": "203.0.113.7"}),
    ("127.0.0.1", {**HOST, "Forwarded": "for=192.0.2.60;proto=http"}),
    ("127.0.0.1", {**HOST, "Forwarded": "proto=http"}),  # forwarded for nobody we can check
    ("127.0.0.1", {"Host": "rebound.attacker.example:8080"}),  # DNS rebinding onto 127.0.0.1
    ("127.0.0.1", {}),
    ("127.0.0.1", {**HOST, "Sec-Fetch-Site": "cross-site"}),
    ("127.0.0.1", {**HOST, "Sec-Fetch-Site": "same-site"}),
])
def test_not_local(peer: str | None, headers: dict[str, str]) -> None:
    assert not is_local_request(peer, headers)
