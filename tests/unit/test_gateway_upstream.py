"""Admission unreachable: open within the grace window, closed after it, each decision counted
(in the client and through on_unreachable, which feeds the gateway's metric)."""

from __future__ import annotations

from typing import Any

from proto import AdmissionRequest, NoResponders
from services.gateway.upstream import UpstreamClient, UpstreamConfig


def test_grace_then_closed_and_every_decision_reported() -> None:
    now = [0.0]
    seen: list[str] = []
    bus: Any = None  # never used: the decision without admission is synchronous
    client = UpstreamClient(bus, registry=None, config=UpstreamConfig(admission_grace_s=30.0),  # type: ignore[arg-type]
                            clock=lambda: now[0], on_unreachable=seen.append)
    request = AdmissionRequest(request_id="r", org="o", key_id="k", model="m", prompt_tokens=1, max_tokens=1)
    assert client._admission_unreachable(request, NoResponders("no admission")).admitted
    now[0] = 31.0
    closed = client._admission_unreachable(request, NoResponders("no admission"))
    assert not closed.admitted and closed.reason == "no_capacity"
    assert seen == ["open", "closed"]
    assert (client.admission_fail_open, client.admission_fail_closed) == (1, 1)
