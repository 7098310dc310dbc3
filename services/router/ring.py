"""Consistent hashing for the ``session`` policy (``policy.Router``)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import xxhash

from services.common.fleet import Pool


class SessionRing:
    """The ``session`` policy's consistent-hash ring: ``vnodes`` points per worker of a pool,
    rebuilt when the pool's generation changes."""

    __slots__ = ("generation", "hashes", "owners", "vnodes")

    def __init__(self, pool: Pool, vnodes: int) -> None:
        points = sorted(
            (xxhash.xxh64_intdigest(f"{w.worker_id}#{i}".encode()), w.worker_id)
            for w in pool
            for i in range(vnodes)
        )
        self.generation = pool.generation
        self.vnodes = vnodes
        self.hashes = [h for h, _ in points]
        self.owners = [wid for _, wid in points]

    def walk(self, key: str) -> Iterable[str]:
        """Distinct workers clockwise from the key's point."""
        n = len(self.hashes)
        if not n:
            return
        start = bisect.bisect_left(self.hashes, xxhash.xxh64_intdigest(key.encode()))
        seen: set[str] = set()
        for k in range(n):
            wid = self.owners[(start + k) % n]
            if wid not in seen:
                seen.add(wid)
                yield wid
