"""bus.cancel_and_wait: a task that swallows its cancel (as nats-py's publish does) still ends."""

from __future__ import annotations

import asyncio

from bus import cancel_and_wait


async def test_a_task_that_swallows_its_first_cancel_is_cancelled_again() -> None:
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)  # stands in for a publish waiting on its flush
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # what nats-py's _flush_pending does: the loop goes on

    stubborn = asyncio.create_task(loop())
    plain = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([stubborn, plain]), 5)
    assert stubborn.cancelled() and plain.cancelled() and swallowed == 1
    await cancel_and_wait([stubborn])  # ended ones: nothing to do
