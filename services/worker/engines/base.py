"""The engine interface: what a worker needs from an inference engine, and nothing more.

The worker service talks to its engine only through ``Engine``; nothing outside
``services/worker/engines`` knows which engine runs (vLLM on a GPU, or the ``sim``
model of one). Requests arrive already tokenized; outputs stream back one engine step
at a time; the engine also reports its load (``EngineStats``, the engine-known part of
``proto.WorkerGauge``) and its prefix-cache contents as KV events in the shared block
hash space of ``proto.hashing``, so the router can index every worker's cache.

Lifecycle::

    engine = create_engine("sim", speed=50.0)
    await engine.start()
    async with contextlib.aclosing(engine.generate(req)) as stream:
        async for out in stream:          # one EngineOutput per step that produced tokens
            ...                           # the last one has finish_reason set
    await engine.shutdown()

Times in outputs (``EngineOutput.timings``) are Unix epoch seconds, like every time on
the wire. Rates and step times in ``EngineStats`` are in wall-clock seconds too, so the
rest of the mesh can compare them with the latencies it observes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from proto.messages import FinishReason, SamplingParams, Timings, TokenLogprob
from proto.workers import KvEvent, SamplingDefaults

# Engines the factory can build; ``vllm`` is imported only when asked for, because it
# pulls in torch and CUDA, which laptops and CI do not have.
ENGINE_NAMES: tuple[str, ...] = ("sim", "vllm", "echo")


@dataclass(kw_only=True, slots=True)
class EngineRequest:
    """One generation, already tokenized (the worker unpacks ``GenerateRequest.prompt``).

    ``output_offset`` continues an interrupted generation (a migration after a worker
    died): the last ``output_offset`` ids of ``prompt_token_ids`` are output the client
    already has. They count toward ``sampling.max_tokens`` and ``min_tokens``, and a
    deterministic engine continues exactly where an uninterrupted run would have been.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # higher runs first (proto.GenerateRequest.priority)
    arrival_time: float = field(default_factory=time.time)  # epoch s, when the worker got it
    lora: str | None = None  # adapter name; None is the base model
    lora_size_bytes: int = 0  # a runtime adapter's weights (engines that load adapters on demand)
    lora_path: str = ""  # and where they are (the adapter registry's path)
    # Requests share cached prefixes only with requests of the same salt (the org: see
    # proto.hashing.prefix_salt); vLLM's ``cache_salt``.
    cache_salt: str = ""
    output_offset: int = 0
    # Hot-swap hosts: models that must not be evicted to load this one (the router's pin list).
    pinned_models: list[str] = field(default_factory=list)
    # Prefill/decode split: the prompt's KV, computed by a prefill worker (its
    # ``KvHandoff.transfer``). The engine loads it instead of computing the prompt, and
    # computes whatever it could not load; the output is the same either way.
    kv_transfer: dict[str, Any] | None = None
    # The other side: keep the KV for another engine to load; the final output's
    # ``kv_transfer`` says where it is (``Engine.prefill``).
    hold_kv: bool = False


@dataclass(kw_only=True, slots=True)
class KvHandoff:
    """A prompt prefilled for another worker (``Engine.prefill``): what its decode
    worker's engine needs to load the KV (``EngineRequest.kv_transfer``)."""

    transfer: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int  # of the prompt, from this engine's prefix cache
    timings: Timings = field(default_factory=Timings)  # arrival, scheduled and first_token (the prefill's end)


class PrefillRefused(Exception):
    """``Engine.prefill`` could not compute the prompt (the decode worker prefills it itself)."""


def prompt_error(req: EngineRequest, max_model_len: int, detail: str = "") -> str | None:
    """Why ``req``'s prompt cannot run on an engine of ``max_model_len`` (``detail``: what
    the engine adds to the too-long message); None when it can."""
    n = len(req.prompt_token_ids)
    if n == 0:
        return "prompt is empty"
    if n > max_model_len:
        return f"prompt has {n} tokens, more than max_model_len {max_model_len}{detail}"
    if not 0 <= req.output_offset <= n:
        return f"output_offset {req.output_offset} outside the prompt of {n} tokens"
    return None


@dataclass(kw_only=True, slots=True)
class EngineOutput:
    """What one engine step produced for one request.

    ``new_token_ids`` and ``text`` are deltas. Token ids include a terminating EOS or stop
    token and the tokens of a matched stop string; ``text`` excludes all of those (as
    vLLM does), so concatenated ``text`` deltas are exactly the response text.
    ``completion_tokens`` counts the tokens this engine generated for the request so far
    (not the ``output_offset`` ones); ``prompt_tokens`` is ``len(prompt_token_ids)``
    (those included); ``cached_tokens`` is the prompt prefix served from the prefix
    cache when the request was first scheduled.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    # With a "stop" finish: the stop string matched or the stop token id (not the
    # tokenizer's EOS), as vLLM's ``CompletionOutput.stop_reason``; else None.
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings = field(default_factory=Timings)  # epoch s; 0.0 where not reached yet
    error: str | None = None
    # The engine refused the request as sent (never started it): the client's error, not
    # the engine's (a 400, where an engine failure is a 500).
    rejected: bool = False
    # When ``sampling.logprobs`` is set: one entry per id in ``new_token_ids``.
    logprobs: list[TokenLogprob] | None = None
    # When ``sampling.prompt_logprobs`` is set, on the request's first output: one entry
    # per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On the final output of a ``hold_kv`` request: where its KV is (vLLM: its KV
    # connector's ``kv_transfer_params``), for ``EngineRequest.kv_transfer`` elsewhere.
    kv_transfer: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True, slots=True)
class EngineStats:
    """The part of ``proto.WorkerGauge`` an engine knows; the worker adds identity and time.

    Build a gauge with ``WorkerGauge(worker_id=..., model=..., ts=..., **stats.gauge_fields())``.
    """

    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens not yet prefilled (waiting + partial)
    running_tokens: int = 0  # context tokens (prompt + output) of running sequences
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    preemptions: int = 0  # cumulative since start
    # Prompt tokens computed since start (cache hits not): the autoscaler's prefill demand.
    prefill_tokens_total: int = 0
    lora_adapters: list[str] = field(default_factory=list)
    lora_cached: list[str] = field(default_factory=list)  # adapters in host memory only: a fast load
    kv_events_mode: str = "engine"  # "predicted" when the engine emits no KV events itself
    # Hot-swap entries (``hosted.HostedEngine``); "" on an engine that is always resident.
    residency: str = ""
    load_remaining_s: float = 0.0
    idle_s: float = 0.0

    def gauge_fields(self) -> dict[str, Any]:
        """Keyword arguments for ``proto.WorkerGauge`` (copies, safe to hand over)."""
        # Shallow, then the two lists copied: dataclasses.asdict's deep copy took 15 µs a
        # gauge, this 1 (a worker builds one per request arrival and end, and per interval).
        out = {name: getattr(self, name) for name in _STATS_FIELDS}
        out["lora_adapters"] = list(self.lora_adapters)
        out["lora_cached"] = list(self.lora_cached)
        return out


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))


class Engine(ABC):
    """An inference engine as the worker sees it. Implementations: ``sim``, ``vllm`` and ``echo``.

    Concurrency contract: every method is called from one asyncio event loop. ``generate``
    may be iterated by many tasks at once (one per request); ``kv_events`` by one.
    """

    # --- identity and limits (constant after construction) ---------------------------

    @property
    @abstractmethod
    def engine_name(self) -> str:
        """``"sim"``, ``"vllm"`` or ``"echo"``: goes into ``WorkerInfo.engine``."""

    @property
    @abstractmethod
    def model(self) -> str:
        """The model name requests are routed by."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Tokens per KV block: the block size of ``proto.hashing`` for this pool."""

    @property
    @abstractmethod
    def kv_blocks_total(self) -> int: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine accepts."""

    @property
    @abstractmethod
    def max_num_seqs(self) -> int: ...

    @property
    @abstractmethod
    def max_num_batched_tokens(self) -> int: ...

    @property
    def lora_runtime(self) -> dict[str, float]:
        """Runtime adapters, as ``WorkerInfo`` advertises them: ``max_loras`` (GPU slots;
        0: only the start-up adapters), ``max_lora_rank``, ``lora_load_gb_per_s`` and
        ``lora_host_gb_per_s``."""
        return {"max_loras": 0, "max_lora_rank": 0, "lora_load_gb_per_s": 0.0, "lora_host_gb_per_s": 0.0}

    @property
    def hosting(self) -> dict[str, float | str]:
        """Hot-swap: ``WorkerInfo``'s ``host_id``, ``host_memory_gib``, ``footprint_gib``
        and ``load_s``; empty for an engine that is always resident."""
        return {}

    @property
    def accelerator(self) -> tuple[str, int]:
        """What this engine runs on, for what the fleet costs: the accelerator's name (the
        price table's key) and how many this replica holds. Workers may override it
        (``--accelerator``, ``--accelerators``)."""
        return ("", 0)

    def capacity_shares(self) -> dict[str, float]:
        """Now: the share of this replica's accelerators each model holds (``CapacityEvent.held_s``);
        "" is a hot-swap host's unallocated share."""
        return {self.model: 1.0}

    @property
    def sampling_defaults(self) -> SamplingDefaults | None:
        """The model's own sampling defaults (its generation config), which ``WorkerInfo``
        advertises and the gateway applies to fields a request omits; None: none."""
        return None

    @property
    @abstractmethod
    def tokenizer_spec(self) -> str:
        """What ``services.common.tokenizer.load_tokenizer`` takes to load this model's tokenizer."""

    # --- lifecycle -------------------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Load and begin stepping; ``generate`` may be called once this returns."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Abort everything in flight (each stream ends with ``finish_reason="abort"``),
        end the ``kv_events`` iterator and release resources. Idempotent."""

    # --- requests --------------------------------------------------------------------

    @abstractmethod
    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream the outputs of one request; the last output has ``finish_reason`` set.

        Implementations are async generators: the request enters the engine at the
        first ``__anext__``, not when ``generate`` is called, and counts in ``stats()``
        before that call first suspends (the worker's gauges rely on it: a gauge that
        names a request must count its tokens). Invalid requests (prompt longer than
        ``max_model_len``, unknown LoRA adapter, ...) yield one output with
        ``finish_reason="error"`` rather than raising, so the worker always has a final
        chunk to publish; a ``request_id`` already in flight raises ``ValueError``.
        When the consumer stops iterating (``aclose()``, or the generator being
        collected) the request is aborted and its KV blocks are freed at once, so wrap
        the iteration in ``contextlib.aclosing`` when breaking out early.
        """

    @property
    def disaggregation(self) -> bool:
        """Whether it can prefill for another engine and load a prompt's KV from one
        (``prefill``, ``EngineRequest.kv_transfer``): a prefill/decode split's engine."""
        return False

    async def prefill(self, req: EngineRequest) -> KvHandoff:
        """Compute ``req``'s prompt and keep its KV for a decode worker to load; raises
        ``PrefillRefused`` when it cannot (then the decode worker prefills itself).

        The prompt runs as a request of one token (vLLM's prefill instance samples one
        too, then drops it), sampled plainly: what the answer must look like is the
        decode worker's to enforce."""
        if not self.disaggregation:
            raise PrefillRefused(f"the {self.engine_name} engine does not prefill for other workers")
        # ignore_eos: a length finish, on which vLLM's connectors keep the KV for the decode side
        one = SamplingParams(max_tokens=1, ignore_eos=True, seed=req.sampling.seed)
        last: EngineOutput | None = None
        async with contextlib.aclosing(self.generate(dataclasses.replace(
                req, sampling=one, output_offset=0, kv_transfer=None, hold_kv=True))) as stream:
            async for out in stream:
                last = out
        if last is None:
            raise PrefillRefused("the prefill produced nothing")
        if last.finish_reason not in ("stop", "length") or last.kv_transfer is None:
            raise PrefillRefused(last.error or f"the prefill ended {last.finish_reason}")
        t = last.timings
        return KvHandoff(transfer=last.kv_transfer, prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens,
                         timings=Timings(arrival=t.arrival, scheduled=t.scheduled, first_token=t.first_token))

    async def warm(self) -> bool:
        """Start loading the model ahead of a request, where the engine loads on demand
        (hot-swap); whether a load started. Always resident engines: False."""
        return False

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with
        ``finish_reason="abort"``. Unknown or finished ids are ignored."""

    # --- observability ---------------------------------------------------------------

    @abstractmethod
    def stats(self) -> EngineStats:
        """A load snapshot, cheap enough to call for every gauge publish."""

    @abstractmethod
    def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        """Batches of ``BlockStored``/``BlockRemoved``/``AllCleared`` as the prefix cache
        changes, in the hash space of ``proto.hashing`` (salt: the LoRA name or "").

        ``BlockStored.parent_hash`` is None for a sequence's first block. Applying every
        batch yielded so far, plus those still buffered, to an empty set gives
        ``kv_snapshot()``. Ends after ``shutdown()``. One consumer at a time.
        """

    @abstractmethod
    def kv_snapshot(self) -> list[int]:
        """Every block hash the prefix cache holds now (for a router resync)."""

    # --- conveniences ------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()


def create_engine(name: str, **options: Any) -> Engine:
    """Build the engine called ``name`` with its own keyword options.

    ``sim`` takes the options of ``services.worker.engines.sim.SimEngine``, ``echo``
    those of ``services.worker.engines.echo.EchoEngine``. Engines are
    imported here, on demand, so a worker running ``sim`` never imports vLLM.
    """
    if name == "sim":
        from .sim import SimEngine

        return SimEngine(**options)
    if name == "echo":
        from .echo import EchoEngine

        return EchoEngine(**options)
    if name == "vllm":
        try:
            from .vllm import VllmEngine  # type: ignore[import-not-found]
        except ImportError as exc:  # the module or vLLM itself is missing
            raise RuntimeError(f"engine 'vllm' is not available here: {exc}") from exc
        engine: Engine = VllmEngine(**options)
        return engine
    raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINE_NAMES)}")
