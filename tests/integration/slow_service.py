"""A minimal service for runner tests: each request takes a while, then answers.

Run as ``python tests/integration/slow_service.py`` with MESHSERVE_NATS_URL set.
"""

from __future__ import annotations

import asyncio
import os

from nats.aio.msg import Msg

from bus import Service, run_service
from proto import ControlCommand, ControlReply


class SlowService(Service):
    name = "slow"
    description = "answers each request after MESHSERVE_SLOW_S seconds"

    async def on_start(self) -> None:
        self.delay = float(os.environ.get("MESHSERVE_SLOW_S", "1.0"))
        await self.add_endpoint("work", "test.slow.work", ControlCommand, self.work)

    async def work(self, command: ControlCommand, msg: Msg) -> None:
        await asyncio.sleep(self.delay)
        await self.bus.respond(msg, ControlReply(worker_id=self.instance_id, state="ready", message=command.reason))


if __name__ == "__main__":
    raise SystemExit(run_service(lambda: SlowService(drain_timeout_s=10)))
