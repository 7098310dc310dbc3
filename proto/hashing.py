"""The prefix block hash that router and workers must agree on bit for bit.

A prompt's token ids are cut into full blocks of ``block_size`` tokens; block i's hash
is xxh64(parent hash as 8 little-endian bytes ‖ the block's tokens as little-endian
uint32), with the parent of block 0 derived from an optional salt (the model/LoRA
namespace). A trailing partial block is never hashed: engines only cache full blocks.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_LITTLE = sys.byteorder == "little"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed little-endian uint32: 4 bytes a token on the wire."""
    packed = array("I", token_ids)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    packed = array("I")
    packed.frombytes(data)
    if not _LITTLE:
        packed.byteswap()
    return packed.tolist()


def prefix_salt(lora: str | None, org: str = "") -> str:
    """The salt of a request's block hashes: its LoRA adapter (an adapter's KV is its own,
    as in vLLM) and its org. A prefix one org's requests cached is found by that org's
    requests only, as OpenAI's prompt caching is per organization: shared across orgs, a
    request's ``cached_tokens`` (and its TTFT) told whether another tenant had sent the
    same text. Every hasher of a request (gateway, router, engines) salts with this."""
    if not org:
        return lora or ""
    return f"{lora or ''}\x00org:{org}"


def cache_scope(org: str, cache_salt: str = "") -> str:
    """Whose requests share cached prefixes: an org's, or with a client's ``cache_salt``
    (vLLM's request field) only its requests that give the same salt, so a service holding
    one key for many end users can keep each user's prefixes to that user. What
    ``prefix_salt`` takes as its ``org``, and what engines get as their cache salt."""
    return f"{org}\x00salt:{cache_salt}" if cache_salt else org


def root_hash(salt: str = "") -> int:
    """The parent hash of a sequence's first block."""
    return xxhash.xxh64_intdigest(salt.encode())


def block_hashes(token_ids: Sequence[int] | bytes, block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (packed bytes accepted as is)."""
    return extend_block_hashes(root_hash(salt), token_ids, block_size)


def extend_block_hashes(parent: int, token_ids: Sequence[int] | bytes, block_size: int) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` chained onto ``parent``.

    Engines use this to hash blocks as they fill during decode, continuing a prompt's chain.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = token_ids if isinstance(token_ids, bytes) else pack_tokens(token_ids)
    stride = 4 * block_size
    out: list[int] = []
    h = xxhash.xxh64()
    for start in range(0, len(data) - stride + 1, stride):
        h.reset()
        h.update(parent.to_bytes(8, "little"))
        h.update(data[start : start + stride])
        parent = h.intdigest()
        out.append(parent)
    return out
