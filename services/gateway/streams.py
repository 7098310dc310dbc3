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
from collections.abc import AsyncIterator, Callable

from nats.aio.msg import Msg
from nats.js import api

from bus import Bus
from proto import DecodeError, TokenChunk, decode

log = logging.getLogger(__name__)


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
        self._ready: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._out_of_order: dict[int, TokenChunk] = {}
        self.gap_since: float | None = None
        self.finished = False
        self.duplicates = 0
        self.last_chunk_at = time.monotonic()
        self.overflowed = False
        self.on_overflow: Callable[[], None] | None = None  # cut the slow client at once
        # Workers that lost this request → the seq from which their chunks are void.
        self.retired: dict[str, int] = {}

    def retire(self, worker_id: str, from_seq: int) -> None:
        """Void ``worker_id``'s chunks from ``from_seq`` on (it lost the request; another continues)."""
        self.retired[worker_id] = from_seq
        for seq in [s for s, c in self._out_of_order.items() if is_void(c, self.retired)]:
            del self._out_of_order[seq]
        self.gap_since = time.monotonic() if self._out_of_order else None

    def deliver(self, chunk: TokenChunk) -> None:
        if is_void(chunk, self.retired):
            self.duplicates += 1
            return
        if chunk.seq < self.next_seq or chunk.seq in self._out_of_order:
            self.duplicates += 1
            return
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
        return await asyncio.wait_for(self._ready.get(), timeout)

    def get_nowait(self) -> TokenChunk | None:
        try:
            return self._ready.get_nowait()
        except asyncio.QueueEmpty:
            return None

    @property
    def buffered(self) -> int:
        return self._ready.qsize()


class TokenDispatcher:
    def __init__(self, bus: Bus, gateway_id: str, *, gap_fill_after_s: float = 0.5, max_buffered: int = 4096) -> None:
        self.bus = bus
        self.max_buffered = max_buffered
        self.gateway_id = gateway_id
        self.gap_fill_after_s = gap_fill_after_s
        self.streams: dict[str, RequestStream] = {}
        self.unroutable = 0  # chunks for requests nobody waits for (cancelled, finished)
        self.gap_fills = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def subject_for(self, request_id: str) -> str:
        return self.bus.subjects.tokens(self.gateway_id, request_id)

    async def start(self) -> None:
        await self.bus.nc.subscribe(self.bus.subjects.tokens_of_gateway(self.gateway_id), cb=self._on_message)
        # Chunks published while we were disconnected reached TOKENS, not us: re-read them.
        self.bus.reconnect_listeners.append(self.fill_all)
        self._tasks.add(asyncio.create_task(self._gap_watch(), name="gap-watch"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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
        stream = self.streams.get(chunk.request_id)
        if stream is None:
            self.unroutable += 1
            return
        stream.deliver(chunk)

    async def _gap_watch(self) -> None:
        while True:
            await asyncio.sleep(self.gap_fill_after_s / 2)
            now = time.monotonic()
            for stream in list(self.streams.values()):
                if stream.gap_since is not None and now - stream.gap_since >= self.gap_fill_after_s:
                    stream.gap_since = now  # one fill at a time per stream
                    self.fill(stream)

    def fill_all(self) -> None:
        for stream in list(self.streams.values()):
            self.fill(stream)

    def fill(self, stream: RequestStream) -> None:
        """Deliver whatever TOKENS holds for ``stream`` that it has not seen (missed tails too)."""
        self.gap_fills += 1
        task = asyncio.create_task(self._fill(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fill(self, stream: RequestStream) -> None:
        """Re-read the request's subject from TOKENS and deliver what was missed."""
        with contextlib.suppress(Exception):
            async for chunk in self.replay(stream.subject, stop_at_final=False, idle_timeout_s=0.5):
                stream.deliver(chunk)

    async def replay(
        self, subject: str, *, stop_at_final: bool = True, idle_timeout_s: float = 30.0
    ) -> AsyncIterator[TokenChunk]:
        """Every chunk stored on ``subject`` (a wildcard allowed), then live ones, in order."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            try:
                queue.put_nowait(decode(msg.data, TokenChunk))
            except DecodeError:
                self.bus.decode_errors += 1

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
                    return
                yield chunk
                if stop_at_final and chunk.finish_reason is not None:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
