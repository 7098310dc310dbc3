"""A ``superseded`` cancel names one placement try (``GenerateRequest.attempt``): the worker
refuses or stops that try's copy only, and takes a later try of the same segment (a
migration that waited for this worker, paused, to come back), on a real nats-server."""

from __future__ import annotations

import msgspec
import pytest

from bus import Bus
from proto import (
    SUPERSEDED,
    CancelRequest,
    ControlReply,
    ErrorCode,
    GenerateRequest,
    RemoteError,
    TokenChunk,
    UsageEvent,
)
from services.worker.service import WorkerService
from tests.conftest import eventually
from tests.integration.test_router import Chunks, WorkerFactory, generate, long_prompt, start_worker

__all__ = ["start_worker"]  # fixtures


async def test_a_superseded_try_blocks_only_itself_not_a_later_try_of_the_segment(
    bus: Bus, start_worker: WorkerFactory
) -> None:
    finals: list[tuple[str, int, int]] = []  # (request, segment, try) of each final chunk published
    billed: list[tuple[str, int, int]] = []  # ... of each usage event

    def spy(w: WorkerService) -> None:
        publish_chunk, publish_usage = w._publish_chunk, w._publish_usage

        async def chunk(request: GenerateRequest, chunk: TokenChunk, *, ack: bool = False) -> None:
            if chunk.finish_reason is not None:
                finals.append((request.request_id, request.migrations, request.attempt))
            await publish_chunk(request, chunk, ack=ack)

        def usage(request: GenerateRequest, event: UsageEvent) -> None:
            billed.append((request.request_id, request.migrations, request.attempt))
            publish_usage(request, event)

        w._publish_chunk = chunk  # type: ignore[method-assign]
        w._publish_usage = usage  # type: ignore[method-assign]

    worker = await start_worker("w1", speed=20.0, prepare=spy)
    chunks = await Chunks(bus).start()

    async def send(request: GenerateRequest) -> ControlReply:
        return await bus.request(bus.subjects.worker_generate("w1"), request, ControlReply)

    async def supersede(request_id: str, migrations: int, attempt: int) -> ControlReply:
        return await bus.request(bus.subjects.worker_cancel("w1"), CancelRequest(
            request_id=request_id, reason=SUPERSEDED, migrations=migrations, attempt=attempt), ControlReply)

    def segment(request_id: str, migrations: int, attempt: int, max_tokens: int) -> GenerateRequest:
        return msgspec.structs.replace(generate(bus, request_id, long_prompt(len(request_id), 64), max_tokens),
                                       migrations=migrations, first_seq=100 * migrations, attempt=attempt)

    # A migration's try timed out on this (paused) worker: its cancel came first. That try is
    # refused; the gateway's next try of the same segment runs (it was refused too).
    assert (await supersede("moved", 1, 5)).message == "unknown request"
    with pytest.raises(RemoteError) as info:
        await send(segment("moved", 1, 5, 3))
    assert info.value.code is ErrorCode.CANCELLED
    await send(segment("moved", 1, 6, 3))
    final = await chunks.final("moved")
    assert final.finish_reason == "length" and final.seq >= 100

    # A try held here, then a later try of the same segment comes (the first one's answer
    # was late, its placer tried again): the earlier copy stops, the later one runs.
    await send(segment("again", 1, 7, 400))
    await eventually(lambda: bool(chunks.chunks["again"]), what="the first try's first chunk")
    await send(segment("again", 1, 8, 3))
    assert (await chunks.final("again")).finish_reason == "length"

    # An earlier try arriving after a later one is held: refused, the later one runs on.
    await send(segment("late", 0, 11, 400))
    await eventually(lambda: bool(chunks.chunks["late"]), what="the later try's first chunk")
    with pytest.raises(RemoteError) as info:
        await send(segment("late", 0, 10, 3))
    assert info.value.code is ErrorCode.CANCELLED
    assert worker.book.held("late") == (0, 11)
    assert (await supersede("late", 0, 11)).message == "superseded"
    await eventually(lambda: "late" not in worker._requests, what="the superseded try to stop")

    assert finals == [("moved", 1, 6), ("again", 1, 8)]
    assert billed == [("moved", 1, 6), ("again", 1, 8)]
