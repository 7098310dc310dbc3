"""Checks waiting for a slot of their key's concurrency limit: per key, first come first
served, one woken per freed slot (waking every waiter on every usage event cost ~7 µs a
waiter, so one key's pile of waiting checks could saturate the leader). Bookkeeping only:
the admission service's task per waiting check awaits its event."""

from __future__ import annotations

import asyncio


class SlotWaiters:
    def __init__(self, per_key: int) -> None:
        self.per_key = per_key  # beyond this many of one key's checks waiting, the next is refused at once
        self._waiters: dict[str, list[asyncio.Event]] = {}

    def join(self, key_id: str) -> asyncio.Event | None:
        """A place in ``key_id``'s queue, or None when it is full."""
        waiters = self._waiters.setdefault(key_id, [])
        if len(waiters) >= self.per_key:
            return None
        waiter = asyncio.Event()
        waiters.append(waiter)
        return waiter

    def leave(self, key_id: str, waiter: asyncio.Event) -> None:
        waiters = self._waiters.get(key_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(key_id, None)

    def ahead_of(self, key_id: str, waiter: asyncio.Event | None = None) -> bool:
        """Whether checks of ``key_id`` wait ahead of ``waiter`` (None: a check not queued)."""
        waiters = self._waiters.get(key_id)
        return waiters is not None and len(waiters) > 0 and waiters[0] is not waiter

    def wake_one(self, key_id: str | None) -> None:
        """A slot of ``key_id`` freed (None: some, of keys unknown): wake its first waiter not
        woken yet (of every key for None)."""
        for key in (key_id,) if key_id is not None else list(self._waiters):
            waiter = next((w for w in self._waiters.get(key, ()) if not w.is_set()), None)
            if waiter is not None:
                waiter.set()

    def wake_all(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.set()
