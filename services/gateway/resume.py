"""A resumed stream: a request's chunks again from TOKENS, and the watch over its worker.

A resumable request's first gateway stops watching its worker when the client leaves
(the request generates on, for a resume). The gateway the client resumes on takes that
watch over, with the same verdict as for a live stream (``migration.plan_migration``): a
silence of ``--stall-timeout`` asks the worker; queued behind live work, the stream
waits on; lost, the request moves to another worker from the tokens already streamed
(the resume record carries the segment the worker was sent), or, when it may not move
again or the record has no segment, ends with a ``worker_lost`` error. A resumed stream
never just stops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from proto import ErrorCode, ErrorInfo, MeshError, RequestRecord, TokenChunk, unpack_tokens

from .lifecycle import give_up, migrate
from .migration import GiveUp, MigrationLimits, Segment, Stay, plan_migration
from .stall import queued_on_live_worker
from .streams import RequestStream

if TYPE_CHECKING:
    from .service import GatewayService


class ResumedStream:
    """The chunks of one request from sequence 0, in order, once each, without those of
    workers that lost it; ``chunks`` ends on the final chunk (the worker's, or an error)."""

    def __init__(self, gateway: GatewayService, record: RequestRecord) -> None:
        self.gateway = gateway
        self.record = record
        self.stream = RequestStream(record.request_id, "", 0)
        self.stream.retired = dict(record.retired)
        self.stream.worker_id = record.worker_id
        self.tokens: list[int] = []  # every token delivered, all segments
        self.worker_tokens: dict[str, int] = {}  # of those, how many each worker streamed
        # Each worker's region, noted while it is registered (a lost segment is billed there;
        # by the time it is found lost, its worker has left the registry).
        self.worker_regions: dict[str, str] = {}
        self._note_region(record.worker_id)
        # n > 1: each choice's tokens and the choices that ended, for a migration
        self.choice_tokens: dict[int, list[int]] = {}
        self.finished_choices: set[int] = set()

    def _note_region(self, worker_id: str) -> None:
        info = self.gateway.registry.workers.get(worker_id)
        if info is not None:
            self.worker_regions[worker_id] = info.region

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        g = self.gateway
        # Quiet for a liveness check: a worker gone from the registry (its connection
        # closed) is acted on at once, a listed one only after a whole stall timeout.
        follow = g.dispatcher.follow(g.bus.subjects.tokens_of_request(self.record.request_id),
                                     idle_timeout_s=g.config.liveness_check_s)
        last_chunk_at = time.monotonic()
        async with contextlib.aclosing(follow) as arriving:
            async for chunk in arriving:
                if chunk is None:
                    if self.stream.missing() is not None and self.stream.worker_id:
                        # a chunk that never reached TOKENS: its worker sends it again
                        await g.dispatcher.resend(self.stream)
                    silent = time.monotonic() - last_chunk_at
                    if self.record.worker_id in g.registry.workers and silent < g.config.stall_timeout_s:
                        continue
                    failed = await self._check_worker(silent)
                    if failed is None:
                        last_chunk_at = time.monotonic()  # queued, or moved: a fresh wait
                        continue
                    yield failed
                    return
                last_chunk_at = time.monotonic()
                if chunk.worker_id and chunk.worker_id not in self.stream.retired and chunk.worker_id != self.record.worker_id:
                    await self._reload()  # a worker we did not know of: the request moved meanwhile
                self.stream.deliver(chunk)
                while (ready := self.stream.get_nowait()) is not None:
                    self._count(ready)
                    yield ready
                    if ready.finish_reason is not None:
                        return

    def _count(self, chunk: TokenChunk) -> None:
        self.tokens.extend(chunk.token_ids)
        if chunk.worker_id:
            self.worker_tokens[chunk.worker_id] = self.worker_tokens.get(chunk.worker_id, 0) + len(chunk.token_ids)
            if chunk.worker_id not in self.worker_regions:
                self._note_region(chunk.worker_id)
        self.choice_tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.choice_finish_reason is not None:
            self.finished_choices.add(chunk.index)

    async def _reload(self) -> None:
        fresh = await self.gateway.records.load(self.record.request_id)
        if fresh is not None:
            self.record = fresh
            for worker, cutoff in fresh.retired.items():
                self.stream.retire(worker, cutoff)
            self.stream.worker_id = fresh.worker_id

    async def _check_worker(self, silent_s: float) -> TokenChunk | None:
        """None while the worker is fine (or the request moved on); else the chunk that ends
        the stream."""
        g = self.gateway
        stall_s = g.config.stall_timeout_s
        await self._reload()  # the request's first gateway may have moved it meanwhile
        record = self.record
        registered = record.worker_id in g.registry.workers
        probe = await g.upstream.probe(record.worker_id, record.request_id, timeout_s=min(2.0, stall_s)) if registered else None
        segment = record.segment
        if segment is None:  # not sent resumable: the record cannot move it
            if registered and queued_on_live_worker(probe, stall_s):
                return None
            return self._error(f"worker {record.worker_id} lost the request and it cannot be moved"
                               " (it was not sent with X-Meshserve-Resumable)")
        plan = plan_migration(
            Segment(generate=segment, worker_id=record.worker_id,
                    worker_region=self.worker_regions.get(record.worker_id, ""),
                    next_seq=self.stream.next_seq,
                    received_tokens=self.tokens, segment_tokens=self.worker_tokens.get(record.worker_id, 0),
                    prompt_tokens=len(unpack_tokens(segment.prompt)), retired=self.stream.retired,
                    choice_tokens=self.choice_tokens, finished_choices=sorted(self.finished_choices)),
            MigrationLimits(stall_s, g.config.max_migrations),
            worker_registered=registered, silent_s=silent_s, probe=probe, now=time.time(),
        )
        if registered:
            g.metrics.stall_probes.labels("queued" if isinstance(plan, Stay) else "stalled").inc()
        if isinstance(plan, Stay):
            return None
        if isinstance(plan, GiveUp):
            await give_up(g, plan, record.request_id)
            return self._error(plan.message)
        self.stream.retire(plan.retire, plan.cutoff)
        self.stream.worker_id = ""  # the next worker's chunks may come before its placement does
        self.stream.arrived_from = ""
        try:
            await migrate(g, plan, record, arrived_from=lambda: self.stream.arrived_from)
        except MeshError as exc:
            return self._error(f"{plan.why}; no replica could take the request over: {exc.message}")
        self.stream.worker_id = record.worker_id
        return None

    def _error(self, message: str) -> TokenChunk:
        return TokenChunk(request_id=self.record.request_id, seq=self.stream.next_seq, finish_reason="error",
                          error=ErrorInfo(code=ErrorCode.WORKER_LOST.value, message=message))
