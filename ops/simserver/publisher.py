"""vLLM's ZMQ KV event publisher, on asyncio: a PUB socket and an optional ROUTER for replay.

Wire format as vLLM's ``ZmqEventPublisher``: each batch is three frames ``[topic, seq as
8-byte big-endian, msgpack KVEventBatch]``, ``seq`` counting from 0. A replay client
(DEALER or REQ) sends ``[b"", start_seq as 8 bytes]``; it gets every buffered batch with
``seq >= start_seq`` as ``[b"", topic, seq, payload]`` and then the end marker
``[b"", b"", -1 as 8 bytes signed, b""]``.

Unlike vLLM's, which connects unless the endpoint has a wildcard, this publisher always
binds: vllm-router's ``kv_aware`` SUB socket connects to each backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.asyncio.Socket | None = None
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port of a tcp://…:* bind
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's seq)."""
        return self._seq

    def start(self) -> None:
        if self._replay is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    async def publish(self, payload: bytes) -> None:
        """Send one encoded batch (a slow subscriber loses batches past the high-water mark,
        as with vLLM; it can catch up through the replay socket)."""
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
