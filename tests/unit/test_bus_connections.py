"""``bus.connections``: which workers' NATS connections closed for good."""

from __future__ import annotations

import json

import pytest

from bus.connections import ConnectionEvent, ConnectionWatch, parse_advisory


def advisory(kind: str, name: str, cid: int, server: str = "n1", reason: str = "") -> bytes:
    return json.dumps({
        "type": f"io.nats.server.advisory.v1.client_{kind}", "id": "x", "timestamp": "2026-12-03T00:00:00Z",
        "server": {"name": server, "id": "NABC"}, "client": {"id": cid, "name": name, "acc": "MESH"},
        **({"reason": reason} if reason else {}),
    }).encode()


def test_advisories_parse_and_anything_else_is_ignored() -> None:
    assert parse_advisory(advisory("disconnect", "w1", 7, reason="Client Closed")) == ConnectionEvent(
        "disconnect", "w1", ("n1", 7), "Client Closed")
    assert parse_advisory(advisory("connect", "w1", 8)) == ConnectionEvent("connect", "w1", ("n1", 8))
    assert parse_advisory(advisory("connect", "", 8)) is None  # an unnamed client is nobody we know
    assert parse_advisory(b'{"type": "io.nats.server.advisory.v1.account_connections"}') is None
    assert parse_advisory(b"not json") is None
    assert parse_advisory(b"[1, 2]") is None


def test_a_closed_connection_is_a_death_only_after_the_grace() -> None:
    watch = ConnectionWatch(grace_s=0.75)
    watch.observe(ConnectionEvent("connect", "w1", ("n1", 1)), 0.0)
    watch.observe(ConnectionEvent("disconnect", "w1", ("n1", 1)), 10.0)
    assert watch.due(10.5) == [] and watch.pending() == 1
    assert watch.due(10.75) == ["w1"]
    assert watch.due(20.0) == []  # reported once


def test_a_client_back_within_the_grace_is_not_dead() -> None:
    # A NATS node failover: the client reconnects (to any node) within a moment.
    watch = ConnectionWatch(grace_s=0.75)
    watch.observe(ConnectionEvent("disconnect", "w1", ("n1", 1)), 10.0)  # a connection from before the watch
    watch.observe(ConnectionEvent("connect", "w1", ("n2", 5)), 10.6)
    assert watch.due(12.0) == [] and watch.pending() == 0


def test_a_reconnect_reported_before_the_old_close_keeps_the_client_alive() -> None:
    watch = ConnectionWatch(grace_s=0.75)
    watch.observe(ConnectionEvent("connect", "w1", ("n1", 1)), 0.0)
    watch.observe(ConnectionEvent("connect", "w1", ("n2", 5)), 10.0)  # the new node reports first
    watch.observe(ConnectionEvent("disconnect", "w1", ("n1", 1)), 10.1)
    assert watch.due(20.0) == []
    watch.observe(ConnectionEvent("disconnect", "w1", ("n2", 5)), 30.0)  # then it really dies
    assert watch.due(31.0) == ["w1"]


def test_names_are_independent() -> None:
    watch = ConnectionWatch(grace_s=1.0)
    watch.observe(ConnectionEvent("disconnect", "w1", ("n1", 1)), 0.0)
    watch.observe(ConnectionEvent("disconnect", "w2", ("n1", 2)), 0.5)
    assert watch.due(1.0) == ["w1"]
    assert watch.due(1.5) == ["w2"]


def test_next_due_says_when_to_look_again() -> None:
    # A timer may fire a hair early (uvloop keeps a millisecond clock): the registry looks
    # again when the watch says the name is due, or it would wait for the heartbeat TTL.
    watch = ConnectionWatch(grace_s=0.75)
    assert watch.next_due(0.0) is None
    watch.observe(ConnectionEvent("disconnect", "w1", ("n1", 1)), 10.0)
    assert watch.due(10.7495) == [] and watch.next_due(10.7495) == pytest.approx(0.0005)
    assert watch.next_due(11.0) == 0.0 and watch.due(11.0) == ["w1"] and watch.next_due(11.0) is None
