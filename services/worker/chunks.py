"""What goes out on a request's token subject besides the engine's tokens: the chunks'
numbering (a request's choices stream at once) and a chunk larger than the bus carries."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from proto import GenerateRequest, PayloadTooLarge, TokenChunk

from .bookkeeping import Choice

if TYPE_CHECKING:
    from .service import WorkerService

log = logging.getLogger(__name__)


def too_large_text(exc: PayloadTooLarge) -> str:
    return (f"the response does not fit one message on the bus ({exc}): ask for fewer log probabilities "
            "(prompt_logprobs, top_logprobs) or raise the NATS server's max_payload")


def too_large(choice: Choice, exc: PayloadTooLarge) -> None:
    """A chunk the bus cannot carry ends its choice with a client error (the engine is
    closed with the stream), never a stream that stops without an end."""
    log.warning("choice %s ends: %s", choice.engine_id, exc)
    choice.undeliverable = too_large_text(exc)


class ChunkPublisher:
    """Numbers and publishes a request's chunks in order (its choices stream at once)."""

    def __init__(self, worker: WorkerService, request: GenerateRequest) -> None:
        self.worker = worker
        self.request = request
        self.seq = request.first_seq
        self.lock = asyncio.Lock()

    async def publish(self, chunk: TokenChunk, *, ack: bool = False) -> None:
        if self.worker.superseded(self.request):
            return  # a stale copy: the request's chunks come from the worker it runs on
        async with self.lock:
            chunk.seq = self.seq
            await self.worker._publish_chunk(self.request, chunk, ack=ack)
            self.seq += 1
