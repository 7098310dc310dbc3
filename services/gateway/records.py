"""Resume records (``mesh_requests`` KV): what any gateway needs to resume a request's stream
after its client lost the connection. One writer, one reader."""

from __future__ import annotations

import logging

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from proto import ErrorCode, MeshError, RequestRecord, decode, encode

log = logging.getLogger(__name__)


class ResumeRecords:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def save(self, record: RequestRecord, *, required: bool = False) -> None:
        """Store ``record``; best effort (a failure is logged) unless ``required``. A resumable
        request requires its first record, so a KV outage (e.g. a NATS node failing over)
        refuses it with a retryable ``no_capacity`` MeshError, not a 500; later updates (its
        worker, a migration, a resume) are best effort: the request is already running."""
        try:
            await self.kv.put(record.request_id, encode(record))
        except Exception as exc:
            if required:
                raise MeshError(f"cannot record a resumable request right now: {exc!r}", code=ErrorCode.NO_CAPACITY) from exc
            log.warning("request %s: resume record not stored (%r)", record.request_id, exc)

    async def load(self, request_id: str) -> RequestRecord | None:
        try:
            entry = await self.kv.get(request_id)
            return decode(entry.value or b"", RequestRecord)
        except (KeyNotFoundError, MeshError):
            return None
