"""The API key store: ``ApiKeyRecord``s in the ``mesh_keys`` KV bucket, keyed by key id.

Only SHA-256 hashes of keys are stored. Readers that authenticate every request
(gateways) ``watch`` the bucket into a local map (``KvMirror``), so a lookup costs no
round trip and a revocation reaches every gateway within moments.
"""

from __future__ import annotations

from proto.records import AdapterRecord, ApiKeyRecord

from .client import Bus
from .mirror import KvMirror
from .provision import adapters_bucket, keys_bucket


class KeyStore(KvMirror[ApiKeyRecord]):
    def __init__(self, bus: Bus) -> None:
        super().__init__(bus, keys_bucket, ApiKeyRecord, "key")

    async def put(self, record: ApiKeyRecord) -> None:  # type: ignore[override]
        await super().put(record.key_id, record)

    async def list(self) -> list[ApiKeyRecord]:
        return sorted(await self.all(), key=lambda r: r.created_at)

    async def revoke(self, key_id: str) -> bool:
        record = await self.get(key_id)
        if record is None:
            return False
        record.revoked = True
        await self.put(record)
        return True


class AdapterStore(KvMirror[AdapterRecord]):
    """LoRA adapters (``meshserve adapters``), keyed by name, in ``mesh_adapters``."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(bus, adapters_bucket, AdapterRecord, "adapter")

    async def put(self, record: AdapterRecord) -> None:  # type: ignore[override]
        await super().put(record.name, record)

    async def list(self) -> list[AdapterRecord]:
        return sorted(await self.all(), key=lambda r: r.name)
