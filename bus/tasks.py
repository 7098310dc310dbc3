"""Stopping background tasks for good."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

# How often a task that survived its cancel is cancelled again.
RECANCEL_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again any that
    goes on: nats-py swallows a cancel that lands while a publish waits for its flush
    (``Client._flush_pending``), and the task then carries on with its loop, so one
    cancel and a gather can wait forever (a worker's shutdown did)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
