"""vLLM's KV event publisher, read: the ZMQ socket the engine publishes to (bound here,
on a free loopback port, before vLLM starts) and the task that decodes its batches and
hands them, translated by ``vllm_kv.KvEventBridge``, to the engine's ``KvEventQueue``.
Imports zmq and vLLM only when opened: the engine shell uses it on the ``engine`` mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from proto.workers import KvEvent

from .vllm_kv import KvEventBridge

log = logging.getLogger(__name__)


class KvEventSocket:
    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.seq = -1  # the last batch's sequence number
        self.gaps = 0  # times batches were lost (the router resyncs from the next snapshot)
        self.closed = False

    @classmethod
    def open(cls) -> KvEventSocket | None:
        """A bound SUB socket, or None when this vLLM or environment cannot publish KV events."""
        try:
            import zmq
            import zmq.asyncio
            from vllm.config import KVEventsConfig  # noqa: F401  (present from vLLM 0.9 on)
        except ImportError as exc:
            log.warning("vLLM KV events unavailable (%s): predicting the cache from served requests", exc)
            return None
        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVHWM, 0)  # never drop: a lost event costs a router resync
        socket.bind("tcp://127.0.0.1:0")
        return cls(socket)

    @property
    def endpoint(self) -> str:
        import zmq

        return str(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def close(self) -> None:
        self.closed = True
        self.socket.close(linger=0)

    async def read(self, bridge: KvEventBridge, push: Callable[[list[KvEvent]], None]) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            try:
                frames = await self.socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.closed:
                    return
                log.exception("KV event socket failed")
                await asyncio.sleep(0.1)
                continue
            if len(frames) < 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq >= 0 and self.seq >= 0 and seq != self.seq + 1:
                # Lost events: the bridge may miss blocks (their children then go unresolved
                # and the router learns them from the next snapshot resync).
                self.gaps += 1
                log.warning("vLLM KV events %d..%d lost", self.seq + 1, seq - 1)
            self.seq = max(self.seq, seq)
            try:
                batch = decoder.decode(frames[2])
            except msgspec.DecodeError:
                log.exception("undecodable vLLM KV event batch")
                continue
            push(bridge.translate(batch.events))
