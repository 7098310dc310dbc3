"""A vLLM general plugin: how vLLM's processes wait on each other on the CPU build.

vLLM's engine core and its model-runner process hand each step over shared-memory queues
whose readers, while busy, poll with ``os.sched_yield()`` in a tight loop. Under Linux's
EEVDF scheduler (6.6 on) two such loops starve every other process on a small machine for
as long as the engine decodes: on a 2-vCPU VM a process sleeping 5 ms at a time went
unscheduled for 3.2-3.6 s, the whole of a 1,740-token decode, so the gateway, the router,
NATS and the client saw nothing until the request was over (and a client that left could
not cancel it). Sleeping 100 µs per poll instead keeps the queue's polling (no reliance
on its wake-up notifications) and gives the CPU back; it costs the tiny test model about
a sixth of its 500 tokens/s, and a real model, whose steps take tens of milliseconds,
nothing measurable (BENCHMARKS.md, "vLLM's CPU build: waiting without starving the mesh").

vLLM loads ``vllm.general_plugins`` entry points in every one of its processes; this one
acts only where ``MESHSERVE_VLLM_SPIN_SLEEP_S`` is set above 0, which the worker's vLLM
engine sets on the CPU build (a user's own setting, 0 included, wins). Any other use of
vLLM in the same environment is left as vLLM made it.
"""

from __future__ import annotations

import os
import time
from typing import Any

SPIN_SLEEP_ENV = "MESHSERVE_VLLM_SPIN_SLEEP_S"
DEFAULT_CPU_SPIN_SLEEP_S = 0.0001


def spin_sleep_s() -> float:
    """The sleep per busy poll this process was asked for (0: vLLM's own sched_yield)."""
    try:
        return max(0.0, float(os.environ.get(SPIN_SLEEP_ENV, "0") or 0))
    except ValueError:
        return 0.0


def register() -> None:
    """vLLM's plugin hook: patch the shared-memory queue's busy wait when asked to."""
    sleep_s = spin_sleep_s()
    if sleep_s <= 0:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or getattr(condition, "meshserve_spin_sleep_s", None) is not None:
        return  # a vLLM without it (nothing to patch), or patched already in this process
    patch_spin_condition(condition, sleep_s)


def patch_spin_condition(condition: Any, sleep_s: float) -> None:
    """Make ``condition.wait`` sleep ``sleep_s`` where vLLM would ``sched_yield`` (a reader
    within its busy window); the idle wait on the notify socket stays vLLM's."""
    original = condition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(sleep_s)
            return
        original(self, timeout_ms)

    condition.wait = wait
    condition.meshserve_spin_sleep_s = sleep_s
