"""Admission unreachable: open within the grace window, closed after it, each decision counted
(in the client and through on_unreachable, which feeds the gateway's metric)."""

from __future__ import annotations

from typing import Any

from proto import AdmissionRequest, NoResponders, RequestProbeReply
from services.gateway.upstream import UpstreamClient, UpstreamConfig, pick_holder


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


def test_a_silent_router_s_request_goes_to_the_worker_holding_it() -> None:
    def reply(worker_id: str, state: Any) -> RequestProbeReply:
        return RequestProbeReply(worker_id=worker_id, request_id="r", state=state)

    assert pick_holder([]) == ("", [])
    assert pick_holder([reply("a", "unknown"), reply("b", "unknown")]) == ("", [])
    assert pick_holder([reply("a", "unknown"), reply("b", "waiting")]) == ("b", [])
    # two copies (a timed-out forward's cancel still on its way): the one with output wins
    assert pick_holder([reply("a", "waiting"), reply("c", "running"), reply("b", "waiting")]) == ("c", ["a", "b"])
