"""Hot-swap: one host process, several models, memory as a cache of models (DESIGN.md,
Many models per GPU).

A ``ModelHost`` holds the models that fit ``memory_gib`` and loads the others when a
request needs them. Each model it may host is a ``HostedEngine``: an ``Engine`` to its
worker service like any other (the process runs one worker service per model, each
registered in its model's pool with ``WorkerInfo.host_id`` naming the host), which
delegates to the model's real engine while it is resident. A request for a cold model
waits, counted in its entry's queue, while the host evicts the least recently used idle,
unpinned models (``services.common.residency``) and loads it; the gauge says
``loading`` meanwhile, and the load's time is part of the request's TTFT, as a user
sees it.

Loads run one at a time per host (they share the host's storage and PCIe bandwidth). A
load is the engine's own start: on vLLM, building the engine; on the sim, the weights'
bytes over the configured bandwidth plus a fixed start-up, in simulated seconds. An
eviction is the engine's shutdown (its KV cache goes with it: ``AllCleared``), and a new
engine object is built for the next load. Models idle for ``idle_unload_s`` and not
pinned are unloaded (scale to zero per model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Literal

from proto.messages import Timings
from proto.workers import AllCleared, KvEvent, SamplingDefaults
from services.common.residency import PIN_PATIENCE_S, ResidentModel, idle_expired, pins_honoured, victims

from .base import Engine, EngineOutput, EngineRequest, EngineStats

log = logging.getLogger(__name__)

Residency = Literal["cold", "loading", "resident"]

# Bandwidths a load reads weights at (GB/s): ``--load-from``.
LOAD_PRESETS: dict[str, float] = {
    "host": 25.0,  # pinned host memory over PCIe (vLLM sleep mode level 1 wakes from here)
    "nvme": 6.0,  # a local NVMe drive
    "object-store": 1.5,  # S3-class storage, streamed
}


class ModelHost:
    """The models of one host process and the memory they share."""

    def __init__(self, host_id: str, memory_gib: float, *, idle_unload_s: float = 0.0,
                 pin_patience_s: float = PIN_PATIENCE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if memory_gib <= 0:
            raise ValueError("a host needs memory_gib > 0")
        self.host_id = host_id
        self.memory_gib = memory_gib
        self.idle_unload_s = idle_unload_s
        self.pin_patience_s = pin_patience_s
        self.clock = clock
        self.entries: dict[str, HostedEngine] = {}
        self.pinned: list[str] = []  # the router's latest word on the fleet's busiest models
        self.loads = 0
        self.evictions = 0
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._idle_task: asyncio.Task[None] | None = None

    def add(self, entry: HostedEngine) -> None:
        if entry.footprint_gib > self.memory_gib:
            raise ValueError(f"{entry.model} needs {entry.footprint_gib:g} GiB; the host has {self.memory_gib:g}")
        self.entries[entry.model] = entry

    def resident(self) -> list[ResidentModel]:
        now = self.clock()
        return [ResidentModel(e.model, e.footprint_gib, busy=e.busy, idle_s=now - e.last_used,
                              loading=e.residency == "loading")
                for e in self.entries.values() if e.residency != "cold"]

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def ensure_resident(self, entry: HostedEngine, pinned: list[str] | None) -> None:
        """Return once ``entry``'s model is resident: loading it (and evicting others)
        if needed, or waiting for a load under way or for a model to go idle. ``pinned``:
        the router's latest word for this host (None: no word, keep the last)."""
        if pinned is not None:
            self.pinned = list(pinned)
        since = self.clock()
        while entry.residency != "resident":
            if entry.residency == "loading":
                async with self._changed:
                    await self._changed.wait_for(lambda: entry.residency != "loading")
                continue
            async with self._load_lock:
                if entry.residency != "cold":
                    continue
                keep = [*pins_honoured(self.pinned, self.clock() - since, self.pin_patience_s), entry.model]
                out = victims(self.resident(), entry.footprint_gib, self.memory_gib, keep)
                if out is not None:
                    entry.residency = "loading"
                    entry.load_started = self.clock()
                    # Detached at once, so no request starts on a model being evicted.
                    detached = [(self.entries[name], self.entries[name].detach()) for name in out]
                    try:
                        for victim, inner in detached:
                            await victim.release(inner, reason=f"evicted for {entry.model}")
                            self.evictions += 1
                        await entry.load()
                        self.loads += 1
                    except BaseException:
                        if entry.residency == "loading":  # a victim's shutdown failed: not loaded
                            entry.residency = "cold"
                        raise
                    finally:
                        for other in self.entries.values():
                            other.evicting = False  # the next wait chooses again
                        await self.notify()
                    continue
                # Every model that could make room is busy: they take no new work (the
                # router sees "evicting") and go once their requests end.
                for name in victims(self.resident(), entry.footprint_gib, self.memory_gib, keep, allow_busy=True) or []:
                    self.entries[name].evicting = True
            # Wait for a model to end a request (or for time to pass, which ages the idle ones).
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)

    async def start(self) -> None:
        if self._idle_task is None and self.idle_unload_s > 0:
            self._idle_task = asyncio.create_task(self._idle_loop(), name=f"{self.host_id}-idle")

    async def shutdown(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
            self._idle_task = None

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_unload_s / 4, 1.0))
            async with self._load_lock:
                expired = [self.entries[name] for name in idle_expired(self.resident(), self.idle_unload_s, self.pinned)]
                detached = [(e, e.detach()) for e in expired]
                for entry, inner in detached:
                    await entry.release(inner, reason=f"idle for {self.idle_unload_s:g} s")


class HostedEngine(Engine):
    """One model of a ``ModelHost``: its real engine while resident, a queue while not.

    ``factory`` builds a fresh engine (an engine is not restarted after shutdown);
    ``load_s`` is the wall seconds a load is expected to take (advertised to the router
    and admission until a load has been measured); ``extra_load_s`` is slept on top of
    the engine's own start (the sim's modelled weight transfer; 0 for vLLM, whose start
    is the real load).
    """

    def __init__(self, host: ModelHost, factory: Callable[[], Engine], *, footprint_gib: float,
                 load_s: float, extra_load_s: float = 0.0, preload: bool = False) -> None:
        self.host = host
        self._factory = factory
        self.inner = factory()
        self.footprint_gib = footprint_gib
        self.expected_load_s = load_s
        self.extra_load_s = extra_load_s
        self.preload = preload
        self.residency: Residency = "cold"
        self.evicting = False  # chosen to make room once its requests end
        self.load_started = 0.0
        self.last_used = host.clock()
        self.in_use = 0
        self._waiting: dict[str, int] = {}  # request id → prompt tokens, waiting for the load
        self._aborted: set[str] = set()
        self._kv: asyncio.Queue[list[KvEvent] | None] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self._closed = False
        host.add(self)

    # --- identity: the model's engine, resident or not -----------------------------------
    @property
    def engine_name(self) -> str:
        return self.inner.engine_name

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def kv_blocks_total(self) -> int:
        return self.inner.kv_blocks_total

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.inner.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.inner.max_num_batched_tokens

    @property
    def lora_runtime(self) -> dict[str, float]:
        return self.inner.lora_runtime

    @property
    def tokenizer_spec(self) -> str:
        return self.inner.tokenizer_spec

    @property
    def sampling_defaults(self) -> SamplingDefaults | None:
        return self.inner.sampling_defaults

    @property
    def hosting(self) -> dict[str, float | str]:
        return {"host_id": self.host.host_id, "host_memory_gib": self.host.memory_gib,
                "footprint_gib": self.footprint_gib, "load_s": self.expected_load_s}

    @property
    def accelerator(self) -> tuple[str, int]:
        return self.inner.accelerator  # the host's: every model of a host runs on the same ones

    def held_share(self) -> float:
        """The share of the host's accelerators this model holds now: its memory's, unless cold."""
        return 0.0 if self.residency == "cold" else min(1.0, self.footprint_gib / self.host.memory_gib)

    def capacity_shares(self) -> dict[str, float]:
        shares = {self.model: self.held_share()}
        # The host's first model also reports the host's unallocated memory (""), so the
        # host's accelerators are counted once, whole, among its models' reports.
        if next(iter(self.host.entries.values()), None) is self:
            shares[""] = max(0.0, 1.0 - sum(e.held_share() for e in self.host.entries.values()))
        return shares

    @property
    def busy(self) -> bool:
        return self.in_use > 0 or bool(self._waiting) or self.residency == "loading"

    # --- load and unload (the host decides when) ------------------------------------------
    async def load(self) -> None:
        t0 = self.host.clock()
        try:
            if self.extra_load_s > 0:
                await asyncio.sleep(self.extra_load_s)
            await self.inner.start()
        except BaseException:
            self.residency = "cold"
            with contextlib.suppress(Exception):
                await self.inner.shutdown()
            self.inner = self._factory()
            raise
        self._pump = asyncio.create_task(self._pump_kv(self.inner), name=f"{self.model}-kv")
        self.residency = "resident"
        self.last_used = self.host.clock()
        # What the router and admission expect next time: this host's measured load.
        self.expected_load_s = self.host.clock() - t0
        log.info("%s: loaded %s in %.2f s", self.host.host_id, self.model, self.expected_load_s)

    def detach(self) -> Engine | None:
        """Mark the model cold and take its engine (None if it held none): from here on a
        request for it waits for a new load."""
        if self.residency == "cold":
            return None
        self.residency = "cold"
        self.evicting = False
        inner, self.inner = self.inner, self._factory()
        return inner

    async def release(self, inner: Engine | None, *, reason: str) -> None:
        """Shut a detached engine down; its cache went with it (``AllCleared``)."""
        if inner is None:
            return
        log.info("%s: unloading %s (%s)", self.host.host_id, self.model, reason)
        await inner.shutdown()
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await self._pump
            self._pump = None
        self._kv.put_nowait([AllCleared()])

    async def unload(self, *, reason: str) -> None:
        await self.release(self.detach(), reason=reason)

    async def _pump_kv(self, inner: Engine) -> None:
        async with contextlib.aclosing(inner.kv_events()) as events:
            async for batch in events:
                self._kv.put_nowait(batch)

    # --- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await self.host.start()
        if self.preload:
            await self.host.ensure_resident(self, None)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warming
        for request_id in list(self._waiting):
            self._aborted.add(request_id)
        await self.host.notify()
        await self.unload(reason="shutdown")
        if all(e._closed for e in self.host.entries.values()):
            await self.host.shutdown()
        self._kv.put_nowait(None)

    # --- requests ---------------------------------------------------------------------
    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self.residency != "resident" or self._waiting:
            # Counted before the first suspension (the worker's gauge contract): the load's
            # wait is this request's queue.
            self._waiting[req.request_id] = len(req.prompt_token_ids)
            try:
                await self.host.ensure_resident(self, list(req.pinned_models))
            except Exception as exc:  # a failed load ends this request, the host serves on
                log.exception("%s: loading %s failed", self.host.host_id, self.model)
                yield EngineOutput(request_id=req.request_id, finish_reason="error",
                                   prompt_tokens=len(req.prompt_token_ids), error=f"loading {self.model} failed: {exc!r}",
                                   timings=Timings(arrival=req.arrival_time))
                return
            finally:
                self._waiting.pop(req.request_id, None)
            if req.request_id in self._aborted or self._closed:
                self._aborted.discard(req.request_id)
                yield EngineOutput(request_id=req.request_id, finish_reason="abort",
                                   prompt_tokens=len(req.prompt_token_ids), timings=Timings(arrival=req.arrival_time))
                return
        self.in_use += 1
        try:
            async with contextlib.aclosing(self.inner.generate(req)) as stream:
                async for out in stream:
                    yield out
        finally:
            self.in_use -= 1
            self.last_used = self.host.clock()
            await self.host.notify()

    async def warm(self) -> bool:
        """Load now, in the background, if the host has room without waiting."""
        if self.residency != "cold" or self._closed or self._warming is not None:
            return False
        if victims(self.host.resident(), self.footprint_gib, self.host.memory_gib, [*self.host.pinned, self.model]) is None:
            return False
        self._warming = asyncio.create_task(self._warm(), name=f"{self.model}-warm")
        return True

    async def _warm(self) -> None:
        try:
            await self.host.ensure_resident(self, None)
        except Exception:
            log.exception("%s: loading %s ahead of its requests failed", self.host.host_id, self.model)
        finally:
            self._warming = None

    async def abort(self, request_id: str) -> None:
        if request_id in self._waiting:
            self._aborted.add(request_id)
            return
        await self.inner.abort(request_id)

    # --- observability ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        if self.residency == "resident":
            stats = self.inner.stats()
        else:
            stats = EngineStats(kv_blocks_total=self.inner.kv_blocks_total)
        if self._waiting:
            stats.waiting += len(self._waiting)
            stats.queued_prefill_tokens += sum(self._waiting.values())
        stats.residency = "evicting" if self.evicting and self.residency == "resident" else self.residency
        if self.residency == "loading":
            stats.load_remaining_s = max(self.expected_load_s - (self.host.clock() - self.load_started), 0.0)
        stats.idle_s = 0.0 if self.busy else self.host.clock() - self.last_used
        return stats

    async def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        while True:
            batch = await self._kv.get()
            if batch is None:
                self._kv.put_nowait(None)
                return
            yield batch

    def kv_snapshot(self) -> list[int]:
        return self.inner.kv_snapshot() if self.residency == "resident" else []
