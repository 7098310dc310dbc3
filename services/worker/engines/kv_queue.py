"""An engine's KV events on their way to its worker: one queue, the same rule for every
engine that has one (the sim, vLLM).

Batches are kept in order until the worker takes them. A worker that stops draining (its
NATS connection down) must not make the engine hold events without bound: past
``limit`` batches the backlog is replaced by one batch that rebuilds the current state
(``AllCleared``, then every cached block from ``snapshot``), which keeps "apply every batch
= the engine's snapshot" true. ``close`` ends every reader, now and later.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from proto.workers import AllCleared, BlockStored, KvEvent


class KvEventQueue:
    def __init__(self, limit: int, snapshot: Callable[[], list[int]], block_size: Callable[[], int]) -> None:
        self.limit = limit
        self._snapshot = snapshot
        self._block_size = block_size
        self._queue: asyncio.Queue[list[KvEvent] | None] = asyncio.Queue()

    def push(self, events: list[KvEvent]) -> None:
        if not events:
            return
        queue = self._queue
        if queue.qsize() >= self.limit:
            while not queue.empty():
                queue.get_nowait()
            resync: list[KvEvent] = [AllCleared()]
            snapshot = self._snapshot()
            if snapshot:
                resync.append(BlockStored(block_hashes=snapshot, block_size=self._block_size()))
            queue.put_nowait(resync)
            return
        queue.put_nowait(events)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def batches(self) -> AsyncGenerator[list[KvEvent], None]:
        while True:
            batch = await self._queue.get()
            if batch is None:
                self._queue.put_nowait(None)  # later callers end too
                return
            yield batch
