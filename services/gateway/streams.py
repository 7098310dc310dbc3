"""Token chunks from workers to the requests waiting for them, in order, exactly once.

Live delivery: one core-NATS subscription per gateway on ``mesh.tokens.<gw>.*`` (the
TOKENS stream captures the same messages) dispatches each chunk by request id. Chunks
carry sequence numbers, so a duplicate is dropped and a gap (a chunk lost to a slow
consumer or a reconnect) is filled from JetStream. Resume after a lost client
connection, on this gateway or any other, replays the request's subject from
JetStream with an ordered consumer and continues live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.js import api

from bus import Bus, cancel_and_wait
from proto import ChunkResend, ControlReply, DecodeError, TokenChunk, UsageEvent, decode, usage_dedup_id

log = logging.getLogger(__name__)

# Usage events lately handed to ``on_usage`` (by dedup id): a final chunk seen again
# (live, then from TOKENS; on a resume) is handed on once.
USAGE_SEEN = 4096


def is_void(chunk: TokenChunk, retired: dict[str, int]) -> bool:
    """A chunk from a worker that lost the request, at or past the point another took over."""
    cutoff = retired.get(chunk.worker_id)
    return cutoff is not None and chunk.seq >= cutoff


class RequestStream:
    """The ordered chunks of one request, starting at ``next_seq``."""

    def __init__(self, request_id: str, subject: str, next_seq: int = 0, max_buffered: int = 4096) -> None:
        self.request_id = request_id
        self.subject = subject
        self.next_seq = next_seq
        self.max_buffered = max_buffered
        self._ready: asyncio.Queue[TokenChunk | None] = asyncio.Queue()  # None: wake the reader
        self._out_of_order: dict[int, TokenChunk] = {}
        self.gap_since: float | None = None
        self.finished = False
        self.duplicates = 0
        self.last_chunk_at = time.monotonic()
        self.overflowed = False
        self.on_overflow: Callable[[], None] | None = None  # cut the slow client at once
        # Workers that lost this request → the seq from which their chunks are void.
        self.retired: dict[str, int] = {}
        # The worker streaming it now (empty while it is being placed): only its chunks, and
        # those of retired workers before their cut-off, are taken; asked to resend gaps.
        self.worker_id = ""
        # While it is being placed: the worker whose chunks arrived (the placement's worker,
        # should the router's answer never come).
        self.arrived_from = ""
        self.foreign = 0  # chunks dropped from workers the request was never placed on
        self.gap_checks = 0  # looks into TOKENS (then the worker) since the gap opened

    def retire(self, worker_id: str, from_seq: int) -> None:
        """Void ``worker_id``'s chunks from ``from_seq`` on (it lost the request; another continues).

        ``from_seq`` is where the reader is (the first chunk it has not taken): chunks of
        that worker delivered meanwhile but not yet read (e.g. while its probe was answered)
        are dropped too, and the stream continues at ``from_seq`` with the next worker."""
        self.retired[worker_id] = from_seq
        for seq in [s for s, c in self._out_of_order.items() if is_void(c, self.retired)]:
            del self._out_of_order[seq]
        if self.next_seq > from_seq:
            queued = self._drain_ready()
            kept = [c for c in queued if c is None or not is_void(c, self.retired)]
            for c in kept:
                self._ready.put_nowait(c)
            if len(kept) < len(queued):  # unread void chunks (a suffix: the queue is in order)
                self.next_seq = from_seq
                self.finished = any(c is not None and c.finish_reason is not None for c in kept)
        self.gap_since = time.monotonic() if self._out_of_order else None
        self.gap_checks = 0

    def deliver(self, chunk: TokenChunk) -> None:
        if is_void(chunk, self.retired):
            self.duplicates += 1
            return
        if self.worker_id and chunk.worker_id and chunk.worker_id != self.worker_id and chunk.worker_id not in self.retired:
            # A worker the request is not placed on: one the router gave up on (a timed-out
            # forward) that ran it anyway. Its chunks number other tokens: never mix them in.
            self.foreign += 1
            return
        if chunk.seq < self.next_seq or chunk.seq in self._out_of_order:
            self.duplicates += 1
            return
        if not self.worker_id and chunk.worker_id:
            self.arrived_from = chunk.worker_id
        self.last_chunk_at = time.monotonic()
        if chunk.seq > self.next_seq:
            self._out_of_order[chunk.seq] = chunk
            if self.gap_since is None:
                self.gap_since = time.monotonic()
            return
        self._push(chunk)
        while self.next_seq in self._out_of_order:
            self._push(self._out_of_order.pop(self.next_seq))
        self.gap_since = time.monotonic() if self._out_of_order else None
        if not self._out_of_order:
            self.gap_checks = 0

    def _push(self, chunk: TokenChunk) -> None:
        if self._ready.qsize() >= self.max_buffered:
            # The reader is not keeping up: it is cut rather than holding memory forever
            # (and it cannot slow the worker or anyone else: delivery never waits for it).
            if not self.overflowed:
                self.overflowed = True
                if self.on_overflow is not None:
                    self.on_overflow()
            return
        self._ready.put_nowait(chunk)
        self.next_seq = chunk.seq + 1
        if chunk.finish_reason is not None:
            self.finished = True

    async def get(self, timeout: float) -> TokenChunk:
        """The next chunk; TimeoutError after ``timeout`` without one, or when woken."""
        ready = self._ready
        if ready.empty():
            # asyncio.timeout, not wait_for: wait_for wraps the get in a task of its own,
            # once per chunk relayed.
            async with asyncio.timeout(timeout):
                chunk = await ready.get()
        else:
            chunk = ready.get_nowait()
        if chunk is None:
            raise TimeoutError("woken")
        return chunk

    def get_nowait(self) -> TokenChunk | None:
        while True:
            try:
                chunk = self._ready.get_nowait()
            except asyncio.QueueEmpty:
                return None
            if chunk is not None:
                return chunk

    def _drain_ready(self) -> list[TokenChunk | None]:
        out: list[TokenChunk | None] = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except asyncio.QueueEmpty:
                return out

    def wake(self) -> None:
        """End the reader's current wait as a timeout would (it checks on its worker)."""
        self._ready.put_nowait(None)

    @property
    def buffered(self) -> int:
        return self._ready.qsize()

    def missing(self) -> tuple[int, int] | None:
        """The first gap: the sequence numbers from ``next_seq`` to the first chunk held."""
        return (self.next_seq, min(self._out_of_order) - 1) if self._out_of_order else None


class TokenDispatcher:
    def __init__(self, bus: Bus, gateway_id: str, *, gap_fill_after_s: float = 0.5, max_buffered: int = 4096,
                 on_usage: Callable[[UsageEvent], None] | None = None) -> None:
        self.bus = bus
        # Told the usage event a final chunk carries (whether or not anyone reads its stream).
        self.on_usage = on_usage
        self._usage_seen: OrderedDict[str, None] = OrderedDict()
        self.max_buffered = max_buffered
        self.gateway_id = gateway_id
        self.gap_fill_after_s = gap_fill_after_s
        self.streams: dict[str, RequestStream] = {}
        self.unroutable = 0  # chunks for requests nobody waits for (cancelled, finished)
        self.gap_fills = 0
        self.resend_requests = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def subject_for(self, request_id: str) -> str:
        return self.bus.subjects.tokens(self.gateway_id, request_id)

    async def start(self) -> None:
        await self.bus.nc.subscribe(self.bus.subjects.tokens_of_gateway(self.gateway_id), cb=self._on_message)
        # Chunks published while we were disconnected reached TOKENS, not us: re-read them.
        self.bus.reconnect_listeners.append(self.fill_all)
        self._tasks.add(asyncio.create_task(self._gap_watch(), name="gap-watch"))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    def open(self, request_id: str, next_seq: int = 0) -> RequestStream:
        stream = RequestStream(request_id, self.subject_for(request_id), next_seq, self.max_buffered)
        self.streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def _on_message(self, msg: Msg) -> None:
        try:
            chunk = decode(msg.data, TokenChunk)
        except DecodeError as exc:
            self.bus.decode_errors += 1
            log.warning("dropped bad token chunk on %s: %s", msg.subject, exc)
            return
        if chunk.usage_event is not None:
            self._usage(chunk)
        stream = self.streams.get(chunk.request_id)
        if stream is None:
            self.unroutable += 1
            return
        stream.deliver(chunk)

    def _usage(self, chunk: TokenChunk) -> None:
        event = chunk.usage_event
        if event is None or self.on_usage is None or event.request_id != chunk.request_id:
            return
        key = usage_dedup_id(event.request_id, event.migrations)
        if key in self._usage_seen:
            return
        self._usage_seen[key] = None
        if len(self._usage_seen) > USAGE_SEEN:
            self._usage_seen.popitem(last=False)
        self.on_usage(event)

    async def _gap_watch(self) -> None:
        while True:
            await asyncio.sleep(self.gap_fill_after_s / 2)
            now = time.monotonic()
            for stream in list(self.streams.values()):
                if stream.gap_since is not None and now - stream.gap_since >= self.gap_fill_after_s:
                    stream.gap_since = now  # one look at a time per stream
                    # First TOKENS (a chunk delivered there but not to us); when that did not
                    # close the gap, the chunk never reached TOKENS: its worker sends it again.
                    if stream.gap_checks and stream.worker_id:
                        self._spawn(self.resend(stream))
                    else:
                        self.fill(stream)
                    stream.gap_checks += 1

    def wake_all(self) -> None:
        for stream in list(self.streams.values()):
            stream.wake()

    def fill_all(self) -> None:
        for stream in list(self.streams.values()):
            self.fill(stream)

    def fill(self, stream: RequestStream) -> None:
        """Deliver whatever TOKENS holds for ``stream`` that it has not seen (missed tails too)."""
        self.gap_fills += 1
        self._spawn(self._fill(stream))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resend(self, stream: RequestStream) -> None:
        """Ask the stream's worker to publish again the chunks of its first gap."""
        gap = stream.missing()
        if gap is None:
            return
        self.resend_requests += 1
        with contextlib.suppress(Exception):  # a dead worker: the registry moves the request
            await self.bus.request(self.bus.subjects.worker_resend(stream.worker_id),
                                   ChunkResend(request_id=stream.request_id, from_seq=gap[0], to_seq=gap[1]),
                                   ControlReply, timeout=2.0)

    async def _fill(self, stream: RequestStream) -> None:
        """Re-read the request's subject from TOKENS and deliver what was missed."""
        with contextlib.suppress(Exception):
            async for chunk in self.replay(stream.subject, stop_at_final=False, idle_timeout_s=0.5):
                stream.deliver(chunk)

    async def replay(
        self, subject: str, *, stop_at_final: bool = True, idle_timeout_s: float = 30.0
    ) -> AsyncIterator[TokenChunk]:
        """Every chunk stored on ``subject`` (a wildcard allowed), then live ones, in order,
        until ``idle_timeout_s`` passes without one."""
        async with contextlib.aclosing(self.follow(subject, stop_at_final=stop_at_final,
                                                   idle_timeout_s=idle_timeout_s)) as chunks:
            async for chunk in chunks:
                if chunk is None:
                    return
                yield chunk

    async def follow(
        self, subject: str, *, stop_at_final: bool = True, idle_timeout_s: float = 30.0
    ) -> AsyncGenerator[TokenChunk | None, None]:
        """As ``replay``, but a silence of ``idle_timeout_s`` yields None and the stream goes
        on: the caller decides whether to wait longer."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            try:
                chunk = decode(msg.data, TokenChunk)
            except DecodeError:
                self.bus.decode_errors += 1
                return
            if chunk.usage_event is not None:  # a final chunk missed live, or one a resume replays
                self._usage(chunk)
            queue.put_nowait(chunk)

        sub = await self.bus.js.subscribe(
            subject,
            stream=self.bus.subjects.tokens_stream,
            cb=on_message,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=60.0,
        )
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(queue.get(), idle_timeout_s)
                except TimeoutError:
                    yield None
                    continue
                yield chunk
                if stop_at_final and chunk.finish_reason is not None:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
