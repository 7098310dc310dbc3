"""``SimEngine``: the ``sim`` engine, an asyncio shell around ``sim_core.SimCore``.

One task steps the core: it computes a step, sleeps the step's simulated duration
divided by ``speed`` (1.0 = real time, tests use 50-200), then hands each output to the
queue of its request. KV events go to a queue as soon as a step is computed, which is
when the modelled engine changes its cache.

Clocks: the core runs on simulated seconds, ``sim = (monotonic − t0) · speed``. The
loop keeps simulated time contiguous (the next step starts where the last ended) as long
as it is within ``max_lag_s`` of wall time, so timer jitter averages out instead of
piling up; when Python falls further behind (very high speeds) it re-anchors to the
wall clock. Output timings are converted to epoch seconds; rates and step times in
``stats()`` are converted to wall-clock seconds (simulated rate × speed), because the
rest of the mesh compares them with latencies it measures on the wall clock.

What a request generates is the core's alone (``sim_core``, ``sim_sequence``): pseudo-text, or with
``sampling.structured`` a valid instance of the schema, regex, choice or grammar
(``guided``); log probabilities, ``logit_bias``, stop strings and special-token text
as ``sim_sampling`` and ``SimSequence.sample`` describe. The shell only moves outputs,
``logprobs`` and ``prompt_logprobs`` included, to the request's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path

from proto.messages import Timings
from proto.workers import AllCleared, KvEvent

from .base import Engine, EngineOutput, EngineRequest, EngineStats
from .kv_queue import KvEventQueue
from .sim_core import SimCore, StepResult
from .sim_lora import LoraConfig
from .sim_profile import DEFAULT_KV_TRANSFER_GB_PER_S, DEFAULT_PROFILE, SimConfig, SimProfile

log = logging.getLogger(__name__)


class SimEngine(Engine):
    """A simulated vLLM replica with the same interface, gauges and KV events.

    Options (all keyword, all optional):

    - ``model``: the name requests are routed by (default: the profile's model).
    - ``profile``: a profile name from ``profiles/`` (``llama-3.1-8b-h100``,
      ``tiny-test``), a path to a profile JSON file, or a ``SimProfile``.
    - ``speed``: simulated seconds per wall second (1.0 = real time).
    - ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``block_size``:
      scheduler and cache limits; default to the profile's ``engine_defaults``.
    - ``num_kv_blocks``: the KV block count; else computed from the profile's memory
      budget, whose figures ``hbm_bytes``, ``weights_bytes``, ``reserve_bytes`` and
      ``kv_bytes_per_token`` can each be overridden.
    - ``enable_prefix_caching`` (default True), ``seed`` (mixed into every request's
      pseudo-text; workers that may take over each other's requests must share it).
    - ``lora_adapters``: adapter names accepted in ``EngineRequest.lora`` (their blocks
      hash with the adapter name as salt).
    - ``max_loras``, ``max_cpu_loras``: load adapters at run time into that many GPU slots
      with a host cache, as vLLM does (``sim_lora``); 0 (the default): only
      ``lora_adapters``. ``lora_disk_gb_per_s``: the storage bandwidth a load reads at.
    - ``rate_window_s``: simulated seconds the rates in ``stats()`` average over.
    - ``max_lag_s``: wall seconds the step loop may run behind before re-anchoring.
    - ``kv_transfer_gb_per_s``: the link a prefill/decode split moves KV over (a decode
      replica's load of a prefill replica's KV takes its bytes over this, plus 1 ms).
    - ``kv_event_buffer``: batches buffered for a slow or absent ``kv_events`` consumer;
      on overflow the buffer is replaced by one resync batch (``AllCleared`` then one
      ``BlockStored`` of the whole snapshot, parent unknown).
    """

    def __init__(
        self,
        *,
        model: str | None = None,
        profile: str | Path | SimProfile = DEFAULT_PROFILE,
        speed: float = 1.0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        hbm_bytes: int | None = None,
        weights_bytes: int | None = None,
        reserve_bytes: int | None = None,
        kv_bytes_per_token: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        lora_adapters: Iterable[str] = (),
        max_loras: int = 0,
        max_cpu_loras: int = 0,
        max_lora_rank: int = 16,
        lora_disk_gb_per_s: float = 2.0,
        rate_window_s: float = 5.0,
        max_lag_s: float = 0.05,
        kv_event_buffer: int = 10_000,
        kv_transfer_gb_per_s: float = DEFAULT_KV_TRANSFER_GB_PER_S,
    ) -> None:
        if not (0 < speed < math.inf):  # nan fails this too
            raise ValueError("speed must be positive")
        self.config = SimConfig.build(
            profile if isinstance(profile, SimProfile) else str(profile),
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            hbm_bytes=hbm_bytes,
            weights_bytes=weights_bytes,
            reserve_bytes=reserve_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            lora_adapters=lora_adapters,
            rate_window_s=rate_window_s,
            lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank,
                            disk_bytes_per_s=lora_disk_gb_per_s * 1e9),
            kv_transfer_gb_per_s=kv_transfer_gb_per_s,
        )
        self.core = SimCore(self.config)
        self.speed = speed
        self._model = model or self.config.profile.model
        self._max_lag_sim = max_lag_s * speed
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._arrivals: dict[str, float] = {}  # request id → epoch arrival (EngineRequest)
        self._kv = KvEventQueue(kv_event_buffer, lambda: self.core.kv_snapshot(), lambda: self.block_size)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0_mono = time.monotonic()
        self._t0_epoch = time.time()
        self._prev_end: float | None = None
        self._last_arrival = 0.0
        self._closed = False
        self.steps = 0  # steps run since start (tests, benchmarks)

    # --------------------------------------------------------------- properties

    @property
    def engine_name(self) -> str:
        return "sim"

    @property
    def accelerator(self) -> tuple[str, int]:
        # What the profile models: a sim replica stands for one such accelerator.
        return (self.config.profile.accelerator or "sim", 1)

    @property
    def model(self) -> str:
        return self._model

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def kv_blocks_total(self) -> int:
        return self.config.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def lora_runtime(self) -> dict[str, float]:
        lora = self.config.lora
        if not lora.dynamic:
            return super().lora_runtime
        # A load from storage reads at the disk, then copies at PCIe: one effective rate each way.
        disk = 1 / (1 / lora.disk_bytes_per_s + 1 / lora.host_to_gpu_bytes_per_s) / 1e9
        return {"max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank, "lora_load_gb_per_s": disk,
                "lora_host_gb_per_s": lora.host_to_gpu_bytes_per_s / 1e9}

    @property
    def tokenizer_spec(self) -> str:
        return "byte"

    # ------------------------------------------------------------------ clocks

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0_mono) * self.speed

    def to_epoch(self, sim_t: float) -> float:
        return self._t0_epoch + sim_t / self.speed

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("engine was shut down")
        if self._task is None:
            self._t0_mono = time.monotonic()
            self._t0_epoch = time.time()
            self._task = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for request_id in list(self._queues):
            await self.abort(request_id)
        self._kv.close()

    # ---------------------------------------------------------------- requests

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        # The request enters the engine at the first iteration (async generator).
        if self._task is None or self._closed:
            raise RuntimeError("engine is not running (call start(), not after shutdown())")
        rid = req.request_id
        if rid in self._queues:
            raise ValueError(f"request {rid!r} is already in flight")
        now = self.sim_now()
        rejected = self.core.add_request(req, now)
        if rejected is not None:
            yield self._to_wall(rejected, req.arrival_time)
            return
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[rid] = queue
        self._arrivals[rid] = req.arrival_time
        self._last_arrival = max(self._last_arrival, now)
        self._wake.set()
        try:
            while True:
                out = await queue.get()
                if out.finish_reason in ("stop", "length") and req.hold_kv:
                    # What a decode replica loads is described, not moved (sim_core.remote_kv):
                    # the blocks stay in this replica's prefix cache.
                    out.kv_transfer = {"engine": "sim", "tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                                       "block_size": self.block_size}
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            # Still registered means the consumer left early: abort at once so the
            # blocks free now, not when the request would have finished.
            if self._queues.get(rid) is queue:
                del self._queues[rid]
                self._arrivals.pop(rid, None)
                self.core.abort(rid, self.sim_now())

    @property
    def disaggregation(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return  # unknown, finished, or already aborted
        arrival = self._arrivals.pop(request_id, 0.0)
        out = self.core.abort(request_id, self.sim_now())
        if out is not None:
            queue.put_nowait(self._to_wall(out, arrival))
        self._wake.set()  # a step loop idling for a transfer this request held

    # ----------------------------------------------------------- observability

    def stats(self) -> EngineStats:
        s = self.core.stats(self.sim_now())
        s.prefill_tokens_per_s *= self.speed
        s.decode_tokens_per_s *= self.speed
        s.step_time_s /= self.speed
        return s

    def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        return self._kv.batches()

    def kv_snapshot(self) -> list[int]:
        return self.core.kv_snapshot()

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (only when idle, as vLLM); emits ``AllCleared``."""
        done = self.core.reset_prefix_cache()
        self._kv.push(self.core.take_kv_events())
        return done

    # --------------------------------------------------------------- internals

    async def _run(self) -> None:
        while True:
            core = self.core  # replaced by _fail_all after a failed step
            if not core.has_work():
                self._wake.clear()
                self._prev_end = None
                await self._wake.wait()
                continue
            now = self.sim_now()
            start = now
            if self._prev_end is not None and now - self._prev_end <= self._max_lag_sim:
                # Contiguous: absorb timer overshoot, but never start before an arrival.
                start = max(self._prev_end, self._last_arrival)
            try:
                result = core.step(start)
            except Exception as exc:  # a core bug must not hang every caller
                log.exception("sim engine step failed")
                self._fail_all(f"sim engine step failed: {exc!r}")
                continue
            if result is None:
                continue
            if not result.num_scheduled:
                # Waiting for a transfer (P/D split) with nothing to compute: idle till it
                # lands, or till a new request or an abort, which the next step sees.
                self._kv.push(result.kv_events)
                self._wake.clear()
                woken = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({woken}, timeout=max(0.0, self._t0_mono + result.end / self.speed - time.monotonic()))
                finally:
                    woken.cancel()
                self._prev_end = None  # idle: the next step starts when it is taken
                continue
            self.steps += 1
            self._kv.push(result.kv_events)
            self._prev_end = result.end
            await asyncio.sleep(max(0.0, self._t0_mono + result.end / self.speed - time.monotonic()))
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        for out in result.outputs:
            rid = out.request_id
            queue = self._queues.get(rid)
            if queue is None:
                continue  # aborted while the step ran
            arrival = self._arrivals.get(rid, 0.0)
            if out.finish_reason is not None:
                del self._queues[rid]
                self._arrivals.pop(rid, None)
            queue.put_nowait(self._to_wall(out, arrival))

    def _to_wall(self, out: EngineOutput, arrival: float) -> EngineOutput:
        t = out.timings
        arrival = arrival or self.to_epoch(t.arrival)
        # Clamped so the phases never run backwards: the caller's arrival stamp and the
        # simulated clock's epoch anchor come from different clock reads.
        scheduled = max(arrival, self.to_epoch(t.scheduled)) if t.scheduled else 0.0
        first_token = max(scheduled, self.to_epoch(t.first_token)) if t.first_token else 0.0
        finished = max(first_token, arrival, self.to_epoch(t.finished)) if t.finished else 0.0
        out.timings = Timings(
            arrival=arrival, scheduled=scheduled, first_token=first_token, finished=finished
        )
        return out

    def _fail_all(self, message: str) -> None:
        """End every request with an error and start over on a fresh core: after an
        exception the old core's bookkeeping cannot be trusted, and a clean restart
        (cache lost, announced with ``AllCleared``) beats a worker that hangs."""
        now = self.to_epoch(self.sim_now())
        for rid in list(self._queues):
            queue = self._queues.pop(rid)
            arrival = self._arrivals.pop(rid, 0.0)
            queue.put_nowait(
                EngineOutput(
                    request_id=rid,
                    finish_reason="error",
                    timings=Timings(arrival=arrival, finished=now),
                    error=message,
                )
            )
        self.core = SimCore(self.config)
        self._prev_end = None
        self._kv.push([AllCleared()])
