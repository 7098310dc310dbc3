"""Stored Responses API responses: the ``<root>_responses`` JetStream KV bucket.

One entry per stored response, under ``<org hash>.<response id>``: a lookup is always
made under the caller's org, so another org's response is not found (a 404 exactly
like an unknown id), by construction rather than by a check that could be forgotten.
The bucket's TTL (``GatewayConfig.responses_ttl_s``, 7 days by default) bounds how long
a response can be retrieved or continued; DELETE purges it at once.

An entry holds the Response object and its conversation (every input item, those of
earlier responses in its chain included), so continuing a response costs one read
however long the chain, and does not depend on its predecessors still being stored.
Values are zlib-compressed msgpack: conversations repeat text and grow turn by turn.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from typing import Any

import msgspec
from msgspec import Struct
from nats.js import JetStreamContext, api
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus.provision import ensure_kv
from proto.subjects import Subjects

log = logging.getLogger(__name__)

STORED_VERSION = 1


class StoredResponse(Struct, kw_only=True):
    v: int = STORED_VERSION
    response: dict[str, Any]  # the Response object, as returned
    conversation: list[dict[str, Any]]  # the input items it answered, earlier turns first


def store_key(org: str, response_id: str) -> str:
    """The KV key of ``response_id`` for ``org``: a hash (KV keys allow few characters,
    and org names stay out of key listings)."""
    return f"{hashlib.sha256(org.encode()).hexdigest()[:32]}.{response_id}"


def encode_stored(stored: StoredResponse) -> bytes:
    return zlib.compress(msgspec.msgpack.encode(stored), 1)


def decode_stored(data: bytes) -> StoredResponse | None:
    """None for an entry this build cannot read (corrupt, or another version)."""
    try:
        stored = msgspec.msgpack.decode(zlib.decompress(data), type=StoredResponse)
    except (zlib.error, msgspec.DecodeError):
        return None
    return stored if stored.v == STORED_VERSION else None


async def responses_bucket(js: JetStreamContext, subjects: Subjects, *, ttl_s: float, replicas: int = 1) -> KeyValue:
    """The bucket, created when missing; an existing one is brought to ``ttl_s``."""
    kv = await ensure_kv(js, api.KeyValueConfig(
        bucket=subjects.responses_bucket,
        description="meshserve Responses API: stored responses and their conversations, per org",
        history=1,
        ttl=ttl_s,
        storage=api.StorageType.FILE,
        replicas=replicas,
    ))
    stream = f"KV_{subjects.responses_bucket}"
    info = await js.stream_info(stream)
    if info.config.max_age != ttl_s:  # the TTL setting changed since the bucket was made
        log.info("updating KV bucket %s TTL to %.0f s", subjects.responses_bucket, ttl_s)
        info.config.max_age = ttl_s
        if ttl_s and (info.config.duplicate_window or 0) > ttl_s:  # the server requires window <= age
            info.config.duplicate_window = ttl_s
        await js.update_stream(info.config)
    return kv


class ResponseStore:
    def __init__(self, kv: KeyValue, max_payload: int) -> None:
        self.kv = kv
        self.max_payload = max_payload

    async def save(self, org: str, stored: StoredResponse) -> bool:
        """Store a response; False (logged) when it could not be: too large for the bus,
        or JetStream unavailable. The response itself was generated and is returned anyway."""
        response_id = stored.response["id"]
        data = encode_stored(stored)
        if len(data) > self.max_payload - 1024:  # headroom for the message headers
            log.warning("response %s not stored: %d bytes compressed, over the bus limit", response_id, len(data))
            return False
        try:
            await self.kv.put(store_key(org, response_id), data)
        except Exception as exc:
            log.warning("response %s not stored (%r)", response_id, exc)
            return False
        return True

    async def load(self, org: str, response_id: str) -> StoredResponse | None:
        """The response ``org`` stored under ``response_id``; None when unknown, expired,
        deleted or another org's."""
        try:
            entry = await self.kv.get(store_key(org, response_id))
        except KeyNotFoundError:  # KeyDeletedError is one too
            return None
        return decode_stored(entry.value or b"")

    async def delete(self, org: str, response_id: str) -> bool:
        """Purge a stored response (its data, not just a delete marker); False when ``org``
        has none under that id."""
        key = store_key(org, response_id)
        try:
            await self.kv.get(key)
        except KeyNotFoundError:
            return False
        await self.kv.purge(key)
        return True
