"""The worker's entry in the registry (``<root>_workers``, a KV bucket whose entries expire
unless renewed): what it publishes about itself (``WorkerInfo``), the heartbeat that keeps
it there, and its removal at the end. Routers, admission and gateways read the bucket;
a worker whose beats stop is gone for them once its entry expires."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError
from nats.js.kv import KeyValue

from bus.provision import StreamLimits, workers_bucket
from bus.runner import MESHSERVE_VERSION
from proto import WorkerInfo, encode
from proto.subjects import Subjects

from .config import WorkerConfig
from .engines.base import Engine

log = logging.getLogger(__name__)


def accelerator_of(engine: Engine, config: WorkerConfig) -> tuple[str, int]:
    """What the worker runs on: its ``--accelerator``/``--accelerators``, else the engine's own."""
    name, count = engine.accelerator
    return (config.accelerator or name, count if config.accelerators is None else config.accelerators)


def worker_info(engine: Engine, config: WorkerConfig, worker_id: str, model_dir: str, tokenizer_digest: str) -> WorkerInfo:
    """The registry record of a ready worker serving ``engine``."""
    accelerator, accelerators = accelerator_of(engine, config)
    return WorkerInfo(
        accelerator=accelerator,
        accelerators=accelerators,
        role=config.role,
        disaggregation=engine.disaggregation,
        region=config.region,
        worker_id=worker_id,
        model=engine.model,
        engine=engine.engine_name,
        state="ready",
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        kv_blocks_total=engine.kv_blocks_total,
        lora_adapters=list(engine.stats().lora_adapters),
        max_loras=int(engine.lora_runtime["max_loras"]),
        max_lora_rank=int(engine.lora_runtime["max_lora_rank"]),
        lora_load_gb_per_s=engine.lora_runtime["lora_load_gb_per_s"],
        lora_host_gb_per_s=engine.lora_runtime["lora_host_gb_per_s"],
        **engine.hosting,  # type: ignore[arg-type]
        tokenizer=engine.tokenizer_spec,
        tool_parser=config.tool_parser,
        reasoning_parser=config.reasoning_parser,
        sampling_defaults=engine.sampling_defaults,
        model_dir=model_dir,
        tokenizer_digest=tokenizer_digest,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=time.time(),
        version=MESHSERVE_VERSION,
    )


class Registration:
    """The worker's registry entry, written on every beat with the worker's current state."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, *, replicas: int, state: Callable[[], str]) -> None:
        self.js = js
        self.subjects = subjects
        self.replicas = replicas
        self.state = state  # read at each beat
        self.info: WorkerInfo | None = None
        self._kv: KeyValue | None = None

    async def open(self) -> None:
        """Provision the bucket (idempotent): before anything else is published."""
        self._kv = await workers_bucket(self.js, self.subjects, replicas=self.replicas)

    async def beat(self) -> None:
        """Store the entry with the state now; a failure is logged, the next beat retries."""
        if self._kv is None or self.info is None:
            return
        self.info.state = self.state()  # type: ignore[assignment]
        self.info.heartbeat_at = time.time()
        started = time.monotonic()
        try:
            try:
                await self._kv.put(self.info.worker_id, encode(self.info))
            except NoStreamResponseError:
                # The registry is in memory: a restarted single nats-server lost it. Made
                # again (idempotent, as at start), or no heartbeat is ever stored again.
                log.warning("the worker registry bucket is gone (a NATS restart?): provisioning it again")
                self._kv = await workers_bucket(self.js, self.subjects, replicas=self.replicas)
                await self._kv.put(self.info.worker_id, encode(self.info))
        except Exception as exc:  # the next beat retries; say so, since missed beats end in expiry
            log.warning("heartbeat not stored after %.1fs: %r", time.monotonic() - started, exc)
            return
        if (took := time.monotonic() - started) > 1.0:
            log.warning("heartbeat took %.1fs to store", took)

    async def beat_every(self, interval_s: float) -> None:
        """Beat until cancelled, at least four times per entry lifetime."""
        interval = min(interval_s, StreamLimits().workers_ttl_s / 4)
        while True:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            if (late := time.monotonic() - due) > interval:  # a blocked event loop, not NATS
                log.warning("heartbeat %.1fs late: the worker's event loop was blocked", late)
            await self.beat()

    async def remove(self) -> None:
        """Delete the entry (a clean stop): readers drop the worker at once, not at expiry."""
        if self._kv is not None and self.info is not None:
            with contextlib.suppress(Exception):
                await self._kv.delete(self.info.worker_id)


__all__ = ["Registration", "worker_info"]
