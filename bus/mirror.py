"""A JetStream KV bucket of msgspec records, mirrored into a local map.

Readers on a request's path (a gateway authenticating keys, resolving adapter names)
``watch`` the bucket into ``records``, so a lookup costs no round trip and a change
reaches every reader within moments; writers (the CLI) ``put`` and ``delete``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Self, TypeVar

from msgspec import Struct
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from proto.codec import decode, encode
from proto.errors import DecodeError, MeshError
from proto.subjects import Subjects

from .client import Bus
from .tasks import cancel_and_wait

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Struct)
BucketOpener = Callable[..., Awaitable[KeyValue]]  # bus.provision's bucket functions


async def live_entries(bus: Bus, kv: KeyValue) -> list[KeyValue.Entry]:
    """Every entry of ``kv`` that holds a value, read once, in key order.

    The keys come from the bucket's stream (its subjects, from the JetStream API, page by
    page), not from nats-py's ``kv.keys()``: that watcher signals "no more entries" when
    the consumer's info reports nothing pending and nothing has reached the callback yet,
    and the info reply can overtake the deliveries, so a listing now and then read a full
    bucket as empty (``meshserve keys list`` printed no keys on a mesh serving two).
    """
    status = await kv.status()
    prefix = f"$KV.{status.bucket}."
    stream = status.stream_info.config.name or f"KV_{status.bucket}"
    subjects: set[str] = set()
    while True:  # the server answers up to 100,000 subjects a page
        query = {"subjects_filter": f"{prefix}>", "offset": len(subjects)}
        reply = await bus.nc.request(f"$JS.API.STREAM.INFO.{stream}", json.dumps(query).encode(), timeout=5.0)
        info = json.loads(reply.data)
        if "error" in info:
            raise MeshError(f"cannot list bucket {status.bucket}: {info['error'].get('description', info['error'])}")
        page = (info.get("state") or {}).get("subjects") or {}
        subjects.update(page)
        if not page or len(subjects) >= int(info.get("total") or 0):
            break
    entries = []
    for subject in sorted(subjects):
        try:
            entry = await kv.get(subject[len(prefix):])
        except (KeyNotFoundError, KeyDeletedError):  # deleted, or expired since the listing
            continue
        if entry.value:
            entries.append(entry)
    return entries


async def sync_point(kv: KeyValue) -> int:
    """The revision a new watch of ``kv`` has caught up with the bucket at: its stream's last
    message as of now (0 when it holds none: then nats-py's "no more" marker says it).

    The marker alone can come before the first entry (see ``live_entries``): a watcher
    that counted itself synced there read an empty bucket, and a gateway would refuse a
    key it holds, or admission find no replica, in its first moments. An ordered
    watch delivers in stream order, so an entry at this revision or later means every
    earlier one has come through."""
    state = (await kv.status()).stream_info.state
    return state.last_seq if state.messages else 0


async def synced_at_marker(kv: KeyValue, synced_at: int) -> bool:
    """Whether a watch that reached nats-py's "no more" marker has caught up: when the
    bucket held nothing at the start, or holds nothing now. Every entry up to
    ``synced_at`` can expire or be purged between the sync point and the watch; then no
    entry ever reaches it, and only a fresh look says so."""
    return not synced_at or not await sync_point(kv)


class KvMirror(Generic[T]):
    def __init__(self, bus: Bus, bucket: BucketOpener, record_type: type[T], what: str) -> None:
        self.bus = bus
        self._bucket = bucket
        self._type = record_type
        self._what = what  # for logs: "key", "adapter"
        self._kv: KeyValue | None = None
        self.records: dict[str, T] = {}
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def open(self) -> Self:
        js: JetStreamContext = self.bus.js
        subjects: Subjects = self.bus.subjects
        self._kv = await self._bucket(js, subjects, replicas=self.bus.settings.js_replicas)
        return self

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, f"{type(self).__name__}.open() first"
        return self._kv

    async def put(self, key: str, record: T) -> None:
        await self.kv.put(key, encode(record))
        self.records[key] = record

    async def get(self, key: str) -> T | None:
        if self._task is not None:
            return self.records.get(key)
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        return decode(entry.value, self._type)

    async def delete(self, key: str) -> bool:
        if await self.get(key) is None:
            return False
        await self.kv.delete(key)
        self.records.pop(key, None)
        return True

    async def all(self) -> list[T]:
        """Every record that decodes, read from the bucket (a bad one is logged and left out)."""
        out: list[T] = []
        for entry in await live_entries(self.bus, self.kv):
            try:
                out.append(decode(entry.value or b"", self._type))
            except DecodeError as exc:
                log.warning("ignoring bad %s record %s: %s", self._what, entry.key, exc)
        return out

    async def watch(self) -> None:
        """Keep ``records`` in sync with the bucket from now on."""
        self._task = asyncio.create_task(self._watch(), name=f"{self._what}-watch")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), 5.0)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _watch(self) -> None:
        while True:
            try:
                synced_at = await sync_point(self.kv)
                async for entry in await self.kv.watchall():
                    if entry is None:
                        if not self._synced.is_set() and await synced_at_marker(self.kv, synced_at):
                            self._synced.set()
                        continue
                    if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                        self.records.pop(entry.key, None)
                    else:
                        try:
                            self.records[entry.key] = decode(entry.value, self._type)
                        except DecodeError as exc:
                            log.warning("ignoring bad %s record %s: %s", self._what, entry.key, exc)
                    if entry.revision >= synced_at:
                        self._synced.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s watch restarting: %r", self._what, exc)
                await asyncio.sleep(0.5)
