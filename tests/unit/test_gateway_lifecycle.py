"""ActiveRequest's states: how a stop, a cancel and a client going away move a request, and
what each tells its worker. The gateway around it is a small stand-in (no NATS here: the
integration tests drive the same paths over a real mesh)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace

from proto import GenerateRequest, RequestRecord, SamplingParams, TokenChunk, pack_tokens
from services.gateway.config import GatewayConfig
from services.gateway.lifecycle import ActiveRequest, RequestState
from services.gateway.metrics import GatewayMetrics
from services.gateway.normalized import NormalizedRequest
from services.gateway.streams import RequestStream


class _Upstream:
    def __init__(self) -> None:
        self.cancels: list[tuple[str, str, str]] = []

    async def cancel(self, worker_id: str, request_id: str, reason: str = "") -> None:
        self.cancels.append((worker_id, request_id, reason))


class _Dispatcher:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)


class _Gateway:
    def __init__(self) -> None:
        self.config = GatewayConfig(liveness_check_s=0.01)
        self.metrics = GatewayMetrics()
        self.upstream = _Upstream()
        self.dispatcher = _Dispatcher()
        self.registry = SimpleNamespace(workers={})  # no worker known: its region is ""
        self.kept: list[str] = []

    def keep_for_resume(self, record: RequestRecord) -> None:
        self.kept.append(record.request_id)


def _active(gateway: _Gateway, *, resumable: bool = False) -> ActiveRequest:
    sampling = SamplingParams(max_tokens=8)
    request = NormalizedRequest(kind="completion", model="m", requested_model="m", prompt_token_ids=[1, 2], sampling=sampling,
                                stream=True)
    generate = GenerateRequest(request_id="r1", model="m", prompt=pack_tokens([1, 2]), sampling=sampling, token_subject="t",
                               gateway_id="g", org="o", key_id="k")
    record = RequestRecord(request_id="r1", key_id="k", gateway_id="g", token_subject="t", worker_id="w1", resumable=resumable)
    span = trace.get_tracer("test").start_span("request")
    g: Any = gateway
    return ActiveRequest(g, request, generate, record, RequestStream("r1", "t"), "w1", 0.0, span)


def test_a_resumable_request_whose_client_goes_is_detached_not_cancelled() -> None:
    gateway = _Gateway()
    active = _active(gateway, resumable=True)
    asyncio.run(active.client_gone())
    assert active.state is RequestState.DETACHED
    assert gateway.upstream.cancels == [] and gateway.kept == ["r1"]


def test_any_other_request_whose_client_goes_is_cancelled() -> None:
    gateway = _Gateway()
    active = _active(gateway)
    asyncio.run(active.client_gone())
    assert active.state is RequestState.CANCELLED
    assert gateway.upstream.cancels == [("w1", "r1", "client_disconnected")] and gateway.kept == []


def test_a_stopped_request_relays_the_workers_final_chunk_then_a_later_cancel_or_going_away_is_moot() -> None:
    gateway = _Gateway()
    active = _active(gateway)

    async def run() -> list[TokenChunk]:
        await active.stop("client_cancelled")
        assert active.state is RequestState.STOPPING
        await active.stop("client_cancelled")  # once only
        active.stream.deliver(TokenChunk(request_id="r1", seq=0, token_ids=[5], finish_reason="abort", worker_id="w1"))
        chunks = [chunk async for chunk in active.chunks()]
        await active.client_gone()
        await active.cancel("client_disconnected")
        return chunks

    chunks = asyncio.run(run())
    assert [c.finish_reason for c in chunks] == ["abort"] and active.final is chunks[0]
    assert active.state is RequestState.FINISHED
    assert gateway.upstream.cancels == [("w1", "r1", "client_cancelled")]


@pytest.mark.parametrize("cancelled", [asyncio.CancelledError, ConnectionResetError])
def test_serving_handles_a_client_going_away_and_always_closes(cancelled: type[BaseException]) -> None:
    gateway = _Gateway()
    active = _active(gateway)

    async def relay() -> None:
        async with active.serving():
            raise cancelled()

    with pytest.raises(cancelled):
        asyncio.run(relay())
    assert active.state is RequestState.CANCELLED and gateway.dispatcher.closed == ["r1"]
