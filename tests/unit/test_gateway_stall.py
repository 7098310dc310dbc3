"""The gateway's stall verdict on a worker's probe reply."""

from __future__ import annotations

from proto import RequestProbeReply
from services.gateway.stall import queued_on_live_worker


def reply(state: str, engine_idle_s: float = 0.1) -> RequestProbeReply:
    return RequestProbeReply(worker_id="w", request_id="r", state=state, since_output_s=40.0,  # type: ignore[arg-type]
                             engine_idle_s=engine_idle_s)


def test_queued_behind_live_work_stays() -> None:
    assert queued_on_live_worker(reply("waiting"), stall_timeout_s=30)


def test_everything_else_is_a_stall() -> None:
    assert not queued_on_live_worker(None, 30)  # no answer: dead or wedged worker
    assert not queued_on_live_worker(reply("unknown"), 30)  # the worker lost the request
    assert not queued_on_live_worker(reply("running"), 30)  # its chunks stopped reaching the gateway
    assert not queued_on_live_worker(reply("waiting", engine_idle_s=30.0), 30)  # an engine producing nothing
