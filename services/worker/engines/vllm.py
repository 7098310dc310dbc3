"""``VllmEngine``: the ``vllm`` engine, vLLM's v1 ``AsyncLLM`` in the worker's process.

Requests arrive tokenized (the gateway applied the chat template and encoded once), so
they enter vLLM as token ids (``TokensPrompt``, or its rendered form ``TokensInput`` on
versions that deprecate raw prompts); sampling parameters map one to one onto vLLM's
``SamplingParams`` with ``n=1`` and ``RequestOutputKind.DELTA``, so each engine step
yields only its new tokens and text. ``abort`` (or leaving the stream) aborts the
request inside vLLM, which frees its KV blocks at once.

What the rest of the mesh sees of the engine:

- gauges: a stat logger passed to ``AsyncLLM.from_engine_args(stat_loggers=...)``
  receives vLLM's ``SchedulerStats`` and ``IterationStats`` after every step, on this
  event loop; ``vllm_stats.VllmStatsTracker`` turns them into ``EngineStats``;
- KV events: vLLM's ZMQ KV-event publisher connects to a SUB socket this engine binds
  on 127.0.0.1 (an endpoint without ``*`` makes vLLM connect); each message is
  (topic, sequence, msgpack ``KVEventBatch``) and ``vllm_kv.KvEventBridge`` re-hashes
  the stored blocks' token ids into ``proto.hashing``'s space. A vLLM that cannot
  publish events (or ``kv_events="predicted"``) gets ``vllm_kv.KvPredictor`` instead,
  and the gauges say ``kv_events_mode="predicted"``.

vLLM starts its engine core (and, for tensor parallelism, its GPU workers) as child
processes. The worker's entry points (``meshserve`` and ``python -m ops.cli``) have a
``__main__`` guard, so both fork and spawn work; the engine is built in a thread so the
worker's event loop (and its NATS connection) stays responsive during a start that
takes seconds on CPU and minutes for a large model on a GPU.

Engine arguments, the served name and weights, adapter specs and the prompt's form are
plain functions in ``vllm_args``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.messages import Timings
from proto.workers import KvEvent, SamplingDefaults

from .base import Engine, EngineOutput, EngineRequest, EngineStats
from .generation_config import read_sampling_defaults
from .kv_queue import KvEventQueue
from .vllm_args import (
    default_cpu_kvcache_gib,
    engine_arguments,
    is_validation_error,
    kv_transfer_params,
    local_model_dir,
    parse_kv_transfer_config,
    parse_lora_adapters,
    resolve_model,
    runtime_adapter_problem,
    sampling_kwargs,
    structured_kwargs,
    token_prompt,
)
from .vllm_kv import KvEventBridge, KvPredictor
from .vllm_kv_socket import KvEventSocket
from .vllm_output import OutputConverter
from .vllm_plugin import DEFAULT_CPU_SPIN_SLEEP_S, SPIN_SLEEP_ENV
from .vllm_stats import VllmStatsTracker, record_step, stat_logger_factory

log = logging.getLogger(__name__)

KV_EVENT_MODES = ("auto", "engine", "predicted")


@dataclass(slots=True)
class _Flight:
    request_id: str
    prompt_tokens: int
    aborted: bool = False


class VllmEngine(Engine):
    """vLLM behind the ``Engine`` interface.

    Options (keyword; ``None`` keeps vLLM's default):

    - ``model``: the name requests are routed by and, without ``model_dir``, the weights
      (a directory or a hub id, as vLLM's ``--model``); ``served_model_name`` overrides the
      routed name. ``model_dir`` (after start: the local directory, for a hub id vLLM's
      download) is what the worker registers for the gateway's tokenizer.
    - vLLM engine arguments, same names and meaning: ``max_num_seqs``,
      ``max_num_batched_tokens``, ``max_model_len``, ``gpu_memory_utilization``,
      ``kv_cache_dtype``, ``tensor_parallel_size``, ``enable_prefix_caching`` (default
      True), ``block_size``, ``enforce_eager``, ``dtype``, ``seed``,
      ``scheduling_policy``, ``enable_lora``, ``max_loras``, ``max_lora_rank``;
      anything else through ``engine_args`` (a mapping of ``AsyncEngineArgs`` fields).
    - ``lora_adapters``: named adapters ``{name: path}`` (or ``"name=path,..."``); a request
      naming one runs with it (``LoRARequest``); ``enable_lora`` follows.
    - ``generation_config``: vLLM's ``--generation-config``: ``auto`` (the default) takes
      the model's ``generation_config.json`` sampling defaults (temperature, top_p, top_k,
      min_p, repetition_penalty, max_new_tokens as the default max_tokens), ``vllm``
      ignores them, a directory reads that directory's file. The worker advertises them
      (``WorkerInfo.sampling_defaults``) and the gateway applies them to fields a request
      omits, as vLLM's server does.
    - ``kv_events``: ``auto`` (vLLM's publisher when it has one, else predicted),
      ``engine`` (required) or ``predicted``.
    - ``cpu_kvcache_space_gib``: the CPU build's KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``).
    - ``kv_transfer_config``: vLLM's ``--kv-transfer-config`` (a mapping or its JSON): the KV
      connector a prefill/decode split moves prompts' KV with (e.g. ``NixlConnector``,
      ``kv_role`` ``kv_both``). With one, the engine prefills for other workers and loads
      their prefills (vLLM's ``kv_transfer_params``, as its disaggregated-serving proxy sends them).
    - ``rate_window_s``, ``kv_event_buffer``: as for the sim engine.
    """

    def __init__(
        self,
        *,
        model: str,
        model_dir: str | None = None,
        served_model_name: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_dtype: str | None = None,
        tensor_parallel_size: int | None = None,
        enable_prefix_caching: bool | None = True,
        block_size: int | None = None,
        enforce_eager: bool | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        scheduling_policy: str | None = None,
        enable_lora: bool | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        lora_adapters: Mapping[str, str] | Iterable[str] | str | None = None,
        kv_events: str = "auto",
        generation_config: str = "auto",
        cpu_kvcache_space_gib: float | None = None,
        kv_transfer_config: Mapping[str, Any] | str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        rate_window_s: float = 5.0,
        kv_event_buffer: int = 10_000,
    ) -> None:
        if kv_events not in KV_EVENT_MODES:
            raise ValueError(f"kv_events must be one of {', '.join(KV_EVENT_MODES)}, not {kv_events!r}")
        self._model, directory = resolve_model(model, model_dir, served_model_name)
        path = Path(directory).expanduser()
        # A local directory is passed absolute (the gateway loads the tokenizer from it too);
        # a hub id becomes vLLM's local download once the engine has started.
        self.model_dir = str(path.resolve()) if path.is_dir() else directory
        self.lora_adapters = parse_lora_adapters(lora_adapters)
        self._lora_ids = {(name, path): i for i, (name, path) in enumerate(self.lora_adapters.items(), start=1)}
        # With LoRA on, vLLM loads any adapter a request names with a path, into its own
        # LRU slots (max_loras, default 1) and host cache: runtime adapters (issue 21).
        self._lora_on = bool(enable_lora or self.lora_adapters)
        self._max_loras = max_loras or 1
        self._max_lora_rank = max_lora_rank or 16
        self._runtime_recent: dict[str, None] = {}  # runtime adapters by last use: vLLM's LRU, as far as we see it
        options = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_dtype": kv_cache_dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "enable_prefix_caching": enable_prefix_caching,
            "block_size": block_size,
            "enforce_eager": enforce_eager,
            "dtype": dtype,
            "seed": seed,
            "scheduling_policy": scheduling_policy,
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
        }
        if enable_lora is False and self.lora_adapters:
            raise ValueError("LoRA adapters given but enable_lora is False")
        if not generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a directory")
        self.generation_config = generation_config
        # vLLM reads it too (a generation config's extra EOS ids stop generation: stop_reason).
        options["generation_config"] = generation_config
        self._sampling_defaults: SamplingDefaults | None = None
        self._defaults_read = False  # read at start, or before it when asked (sampling_defaults)
        self.engine_args = engine_arguments(
            model_dir=self.model_dir, served_model_name=self._model, options=options, extra=engine_args,
            enable_lora=bool(enable_lora or self.lora_adapters),
        )
        self.kv_events_requested = kv_events
        self.kv_events_mode = "predicted" if kv_events == "predicted" else "engine"
        self.cpu_kvcache_space_gib = cpu_kvcache_space_gib
        self.kv_transfer_config = parse_kv_transfer_config(kv_transfer_config)
        self.rate_window_s = rate_window_s
        self._llm: Any = None
        self._closed = False
        self._flights: dict[str, _Flight] = {}
        self._kv = KvEventQueue(kv_event_buffer, self.kv_snapshot, lambda: self.block_size)
        self._bridge: KvEventBridge | None = None
        self._predictor: KvPredictor | None = None
        self._kv_socket: KvEventSocket | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._stats = VllmStatsTracker(kv_blocks_total=0, rate_window_s=rate_window_s,
                                       lora_adapters=list(self.lora_adapters))
        self._limits = {"block_size": block_size or 16, "kv_blocks_total": 0, "max_model_len": max_model_len or 0,
                        "max_num_seqs": max_num_seqs or 0, "max_num_batched_tokens": max_num_batched_tokens or 0}
        self.prefix_caching = enable_prefix_caching is not False
        self.start_seconds = 0.0

    # --------------------------------------------------------------- properties

    @property
    def engine_name(self) -> str:
        return "vllm"

    @property
    def accelerator(self) -> tuple[str, int]:
        # vLLM's own name for the device ("NVIDIA H100 80GB HBM3", which a price table's
        # "H100" matches; "cpu" on its CPU build), asked of its platform, which reads NVML
        # on GPUs: initialising CUDA here would break vLLM's forked processes.
        args = self.engine_args
        count = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                return ("cpu", count)
            return (str(current_platform.get_device_name(0)), count)
        except Exception:  # no vLLM, no driver: named by what it is
            return ("cpu", count)

    @property
    def model(self) -> str:
        return self._model

    @property
    def block_size(self) -> int:
        return self._limits["block_size"]

    @property
    def kv_blocks_total(self) -> int:
        return self._limits["kv_blocks_total"]

    @property
    def max_model_len(self) -> int:
        return self._limits["max_model_len"]

    @property
    def max_num_seqs(self) -> int:
        return self._limits["max_num_seqs"]

    @property
    def max_num_batched_tokens(self) -> int:
        return self._limits["max_num_batched_tokens"]

    @property
    def tokenizer_spec(self) -> str:
        return self.model_dir

    @property
    def sampling_defaults(self) -> SamplingDefaults | None:
        if self._llm is None and not self._defaults_read:
            # Not started: a hot-swap model not resident yet registers too, and its
            # requests need the defaults its first load will read (from the local copy).
            self._defaults_read = True
            self._sampling_defaults = read_sampling_defaults(self.generation_config,
                                                             local_model_dir(self.model_dir) or self.model_dir)
        return self._sampling_defaults

    @property
    def llm(self) -> Any:
        """vLLM's ``AsyncLLM`` (None before ``start``)."""
        return self._llm

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("engine was shut down")
        if self._llm is not None:
            return
        t0 = time.monotonic()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.cpu_kvcache_space_gib is not None:
            # Read (as whole GiB) by the CPU build's worker process, which inherits the environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(self.cpu_kvcache_space_gib)))
        elif self.engine_args.get("gpu_memory_utilization") is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            if current_platform.is_cpu():
                # vLLM's CPU default reserves 92 % of the machine's memory and refuses to start
                # on any laptop running something else: a KV cache of a bounded size instead.
                import psutil

                gib = default_cpu_kvcache_gib(psutil.virtual_memory().available)
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
                log.info("vLLM CPU build: %d GiB of KV cache (set --cpu-kvcache-space or "
                         "--gpu-memory-utilization to choose)", gib)
        if current_platform.is_cpu():
            # Before vLLM loads its plugins (AsyncEngineArgs): its processes inherit this.
            os.environ.setdefault(SPIN_SLEEP_ENV, str(DEFAULT_CPU_SPIN_SLEEP_S))
        kwargs = dict(self.engine_args)
        if self.kv_events_mode == "engine" and self.prefix_caching:
            self._kv_socket = KvEventSocket.open()
            endpoint = self._kv_socket.endpoint if self._kv_socket is not None else None
            if endpoint is None and self.kv_events_requested == "engine":
                raise RuntimeError("kv_events='engine' but this vLLM cannot publish KV events (no KVEventsConfig/zmq)")
            if endpoint is None:
                self.kv_events_mode = "predicted"
            else:
                from vllm.config import KVEventsConfig

                kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint=endpoint)
        if self.kv_transfer_config is not None:
            from vllm.config import KVTransferConfig

            try:
                kwargs["kv_transfer_config"] = KVTransferConfig(**self.kv_transfer_config)
            except Exception as exc:  # pydantic's ValidationError: the operator's input
                raise ValueError(f"bad kv_transfer_config: {exc}") from exc
        try:
            engine_args = AsyncEngineArgs(**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad vLLM engine argument: {exc}") from exc
        logger_factory = stat_logger_factory(lambda sched, it: record_step(self._stats, sched, it, time.monotonic()))
        try:
            self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args, stat_loggers=[logger_factory])
        except BaseException:
            if self._kv_socket is not None:
                self._kv_socket.close()
                self._kv_socket = None
            raise
        config = self._llm.vllm_config
        blocks = int(config.cache_config.num_gpu_blocks or 0)
        self._limits = {
            "block_size": int(config.cache_config.block_size),
            "kv_blocks_total": max(0, blocks - 1),  # vLLM keeps one null block out of use
            "max_model_len": int(config.model_config.max_model_len),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
        }
        self._stats.kv_blocks_total = self._limits["kv_blocks_total"]
        self._stats.max_num_batched_tokens = self._limits["max_num_batched_tokens"]
        local = await asyncio.to_thread(local_model_dir, self.model_dir)
        if local is not None:
            self.model_dir = local
        self._sampling_defaults = read_sampling_defaults(self.generation_config, self.model_dir)
        self._defaults_read = True
        if self._sampling_defaults is not None:
            log.info("%s: the model's generation config sets sampling defaults %s (--generation-config vllm to"
                     " ignore them)", self._model, self._sampling_defaults)
        self._stats.kv_events_mode = self.kv_events_mode
        if self.kv_events_mode == "engine" and self._kv_socket is not None:
            self._bridge = KvEventBridge(self.block_size)
            self._kv_task = asyncio.create_task(self._kv_socket.read(self._bridge, self._kv.push), name="vllm-kv-events")
        elif self.prefix_caching:
            self._predictor = KvPredictor(self.block_size, max(1, self.kv_blocks_total))
        self.start_seconds = time.monotonic() - t0
        log.info("vLLM engine for %s up in %.1fs: block size %d, %d KV blocks, max_model_len %d, KV events %s",
                 self._model, self.start_seconds, self.block_size, self.kv_blocks_total, self.max_model_len,
                 self.kv_events_mode)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._flights):
            await self.abort(request_id)
        await asyncio.sleep(0)  # let aborted streams take their final outputs
        if self._llm is not None:
            # Stops the engine core (and its workers): seconds, so off the event loop.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._llm.shutdown)
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kv_task
        if self._kv_socket is not None:
            self._kv_socket.close()
        self._kv.close()

    # ---------------------------------------------------------------- requests

    def sampling_params(self, req: EngineRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = structured_kwargs(req.sampling.structured)
        transfer = kv_transfer_params(req)
        return SamplingParams(
            **sampling_kwargs(req.sampling, req.output_offset),
            structured_outputs=StructuredOutputsParams(**structured) if structured else None,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": transfer} if transfer is not None else None,
        )

    @property
    def disaggregation(self) -> bool:
        return self.kv_transfer_config is not None

    def _decode(self, token_id: int) -> str:
        """A token's text alone, where vLLM's logprobs carry none (detokenizing off)."""
        tokenizer = getattr(self._llm, "tokenizer", None)
        return str(tokenizer.decode([token_id])) if tokenizer is not None else ""

    def _check(self, req: EngineRequest) -> str | None:
        prompt = len(req.prompt_token_ids)
        if prompt == 0:
            return "empty prompt"
        remaining = max(1, req.sampling.max_tokens - req.output_offset)
        if self.max_model_len and prompt + remaining > self.max_model_len:
            return f"prompt of {prompt} tokens plus {remaining} to generate exceeds max_model_len {self.max_model_len}"
        if req.lora and req.lora not in self.lora_adapters:
            if not (self._lora_on and req.lora_path):
                return f"unknown LoRA adapter {req.lora!r}"
            # vLLM loads it in the engine core, where a failure takes the engine down:
            # what can be checked here is, and such a request alone fails.
            return runtime_adapter_problem(req.lora, req.lora_path, self._max_lora_rank)
        return None

    def _lora_request(self, name: str | None, runtime_path: str = "") -> Any:
        if not name:
            return None
        from vllm.lora.request import LoRARequest

        path = self.lora_adapters.get(name) or runtime_path
        if name not in self.lora_adapters:
            self._runtime_recent.pop(name, None)
            self._runtime_recent[name] = None
            while len(self._runtime_recent) > self._max_loras:
                del self._runtime_recent[next(iter(self._runtime_recent))]
            self._stats.lora_adapters = [*self.lora_adapters, *self._runtime_recent]
        # vLLM caches an adapter by its id: a name re-registered with other weights gets a new one
        lora_id = self._lora_ids.setdefault((name, path), len(self._lora_ids) + 1)
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)

    @property
    def lora_runtime(self) -> dict[str, float]:
        if not self._lora_on:
            return super().lora_runtime
        # Load bandwidths are not measured on vLLM: the router prices a load with its penalty.
        return {"max_loras": self._max_loras, "max_lora_rank": self._max_lora_rank, "lora_load_gb_per_s": 0.0,
                "lora_host_gb_per_s": 0.0}

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        # The request enters the engine at the first iteration (async generator).
        if self._llm is None or self._closed:
            raise RuntimeError("engine is not running (call start(), not after shutdown())")
        rid = req.request_id
        if rid in self._flights:
            raise ValueError(f"request {rid!r} is already in flight")
        prompt_ids = list(req.prompt_token_ids)
        problem = self._check(req)
        params: Any = None
        if problem is None:
            try:
                params = self.sampling_params(req)
            except Exception as exc:  # vLLM's own validation (VLLMValidationError is no ValueError)
                problem = f"bad sampling parameters: {exc}"
        if problem is not None:
            yield EngineOutput(request_id=rid, finish_reason="error", error=problem, rejected=True, prompt_tokens=len(prompt_ids),
                               timings=Timings(arrival=req.arrival_time, finished=time.time()))
            return
        flight = _Flight(rid, len(prompt_ids))
        self._flights[rid] = flight
        self._stats.add(rid, len(prompt_ids))
        stream = self._llm.generate(
            token_prompt(prompt_ids, req.arrival_time, req.cache_salt), params, rid,
            lora_request=self._lora_request(req.lora, req.lora_path), priority=-req.priority,  # vLLM: lower runs first
        )
        converter = OutputConverter(req, prompt_ids, self._decode)
        finished = False  # a final output was yielded
        error: str | None = None
        rejected = False
        try:
            async for out in stream:
                first = not converter.first_token
                new_tokens, output = converter.convert(out, time.time(), flight.aborted)
                if first and converter.first_token and self._predictor is not None:
                    self._kv.push(self._predictor.observe(prompt_ids, req.lora, req.cache_salt))
                self._stats.progress(rid, new_tokens)
                if output is None:
                    continue
                yield output
                if output.finish_reason is not None:
                    finished = True
                    break
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # engine dead, bad request, ...: the worker needs a final output
            log.warning("vLLM failed request %s: %r", rid, exc)
            error = f"vLLM: {type(exc).__name__}: {exc}"
            # vLLM refused the request as sent (its input processing validates a schema,
            # regex or grammar when the request is added): the client's error, as vLLM's
            # own server answers it (400), not an engine failure.
            rejected = not converter.output_ids and is_validation_error(exc)
            if rejected:
                error = str(exc) or error
        finally:
            self._flights.pop(rid, None)
            self._stats.finish(rid)
            if not converter.engine_done:
                # Left early (consumer closed, or an exception): vLLM's generator aborts the
                # request on close, freeing its KV blocks now.
                with contextlib.suppress(Exception):
                    await stream.aclose()
            if self._predictor is not None and converter.output_ids:
                # The last sampled token was never fed back: its K/V are not in the cache.
                self._kv.push(self._predictor.observe(prompt_ids + converter.output_ids[:-1], req.lora,
                                                      req.cache_salt))
        if not finished:
            yield converter.failed(error or "vLLM ended the request without a finish", rejected, time.time())

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is None or self._llm is None:
            return
        flight.aborted = True
        await self._llm.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM refuses while requests run); ``AllCleared`` follows."""
        if self._llm is None:
            return False
        done = bool(await self._llm.reset_prefix_cache())
        if done and self._predictor is not None:
            self._kv.push(self._predictor.clear())
        return done

    # ----------------------------------------------------------- observability

    def stats(self) -> EngineStats:
        return self._stats.snapshot(time.monotonic())

    @property
    def tracker(self) -> VllmStatsTracker:
        return self._stats

    def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        return self._kv.batches()

    def kv_snapshot(self) -> list[int]:
        if self._bridge is not None:
            return self._bridge.snapshot()
        if self._predictor is not None:
            return self._predictor.snapshot()
        return []

    def describe(self) -> dict[str, Any]:
        """What runs, for logs and reports (JSON-safe)."""
        shown = {k: v for k, v in self.engine_args.items() if k != "kv_events_config"}
        return json.loads(json.dumps({"model": self._model, "model_dir": self.model_dir, "engine_args": shown,
                                      "kv_events_mode": self.kv_events_mode, "block_size": self.block_size,
                                      "kv_blocks_total": self.kv_blocks_total, "start_seconds": self.start_seconds},
                                     default=str))

