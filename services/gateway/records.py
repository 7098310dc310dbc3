"""Resume records (``mesh_requests`` KV): what any gateway needs to resume a request's stream
after its client lost the connection. One writer, one reader."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.errors import InvalidKeyError, KeyNotFoundError
from nats.js.kv import KeyValue

from bus.client import backoff_delay
from proto import ErrorCode, MeshError, RequestRecord, decode, encode

log = logging.getLogger(__name__)


class ResumeRecords:
    def __init__(self, kv: KeyValue, *, required_within_s: float = 10.0) -> None:
        self.kv = kv
        # A required record is retried this long: a JetStream election takes seconds.
        self.required_within_s = required_within_s

    async def save(self, record: RequestRecord, *, required: bool = False) -> None:
        """Store ``record``; best effort (a failure is logged) unless ``required``. A resumable
        request requires its first record: it is retried for ``required_within_s`` (the
        bucket's stream may be electing a leader), then the request is refused with a
        retryable ``no_capacity`` MeshError, not a 500; later updates (its worker, a
        migration, a resume) are best effort: the request is already running."""
        deadline = time.monotonic() + (self.required_within_s if required else 0.0)
        attempt = 0
        while True:
            try:
                put = self.kv.put(record.request_id, encode(record))
                # Within the deadline: a put to a stream without a leader waits out the JetStream timeout.
                await (asyncio.wait_for(put, max(1.0, deadline - time.monotonic())) if required else put)
                return
            except Exception as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if required:
                        raise MeshError(f"cannot record a resumable request right now: {exc!r}",
                                        code=ErrorCode.NO_CAPACITY) from exc
                    log.warning("request %s: resume record not stored (%r)", record.request_id, exc)
                    return
                await asyncio.sleep(min(backoff_delay(attempt, 0.1, 2.0), remaining))
                attempt += 1

    async def load(self, request_id: str) -> RequestRecord | None:
        try:
            entry = await self.kv.get(request_id)
            return decode(entry.value or b"", RequestRecord)
        except (KeyNotFoundError, InvalidKeyError, MeshError):  # InvalidKeyError: no id of ours ("a b", "a>b")
            return None
