"""The API key store: ``ApiKeyRecord``s in the ``mesh_keys`` KV bucket, keyed by key id.

Only SHA-256 hashes of keys are stored. Readers that authenticate every request
(gateways) ``watch`` the bucket into a local map, so a lookup costs no round trip and a
revocation reaches every gateway within moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from proto.codec import decode, encode
from proto.errors import DecodeError
from proto.messages import ApiKeyRecord

from .client import Bus
from .provision import keys_bucket
from .tasks import cancel_and_wait

log = logging.getLogger(__name__)


class KeyStore:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._kv: KeyValue | None = None
        self.records: dict[str, ApiKeyRecord] = {}
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def open(self) -> KeyStore:
        self._kv = await keys_bucket(self.bus.js, self.bus.subjects, replicas=self.bus.settings.js_replicas)
        return self

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "KeyStore.open() first"
        return self._kv

    async def put(self, record: ApiKeyRecord) -> None:
        await self.kv.put(record.key_id, encode(record))
        self.records[record.key_id] = record

    async def get(self, key_id: str) -> ApiKeyRecord | None:
        if self._task is not None:
            return self.records.get(key_id)
        try:
            entry = await self.kv.get(key_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return decode(entry.value, ApiKeyRecord)

    async def list(self) -> list[ApiKeyRecord]:
        out = []
        with contextlib.suppress(Exception):  # nats-py raises when the bucket is empty
            for key_id in await self.kv.keys():
                record = await self.get(key_id)
                if record is not None:
                    out.append(record)
        return sorted(out, key=lambda r: r.created_at)

    async def revoke(self, key_id: str) -> bool:
        record = await self.get(key_id)
        if record is None:
            return False
        record.revoked = True
        await self.put(record)
        return True

    async def watch(self) -> None:
        """Keep ``records`` in sync with the bucket from now on."""
        self._task = asyncio.create_task(self._watch(), name="keys-watch")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), 5.0)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _watch(self) -> None:
        while True:
            try:
                async for entry in await self.kv.watchall():
                    if entry is None:
                        self._synced.set()
                        continue
                    if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                        self.records.pop(entry.key, None)
                        continue
                    try:
                        self.records[entry.key] = decode(entry.value, ApiKeyRecord)
                    except DecodeError as exc:
                        log.warning("ignoring bad key record %s: %s", entry.key, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("key watch restarting: %r", exc)
                await asyncio.sleep(0.5)
