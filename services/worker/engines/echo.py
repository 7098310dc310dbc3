"""``EchoEngine``: streams each prompt's own tokens back at a fixed rate, no model.

For measuring the serving path rather than an engine: the gateway's relay, the request
path, a deployment's plumbing, on machines without a GPU (NVIDIA Dynamo ships an echo
engine for the same purpose). A request's first token comes at once; after that one
ticker hands every running request the tokens due since its last output, every
``interval_s``, so a request gets ``tokens_per_s`` tokens a second in outputs of several
tokens. A sim or vLLM worker hands out one output per token and per engine step: at the
rates a relay benchmark asks for, that per-token work costs more CPU than the gateway it
is meant to load.

What it honours: ``max_tokens`` (every request runs to it: ``finish_reason`` is
``length``), ``max_model_len``, ``max_num_seqs`` (requests beyond it wait for a slot),
``output_offset`` (a continued request goes on where its prompt's output ended),
``logprobs`` (each echoed token at log probability 0, as its own only candidate).
Everything else in the sampling parameters is ignored; guided decoding is refused (an
echo cannot follow a schema). ``generation_config``: a directory whose
``generation_config.json`` sampling defaults the worker advertises, as a vLLM worker of
that model does (the gateway applies them; of them the echo honours ``max_tokens``). No prefix cache: no KV events, an empty snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from proto.messages import Timings, TokenLogprob, TopLogprob
from proto.workers import KvEvent, SamplingDefaults
from services.common.tokenizer import IncrementalDecoder, load_tokenizer

from .base import Engine, EngineOutput, EngineRequest, EngineStats, prompt_error
from .generation_config import read_sampling_defaults


@dataclass(slots=True)
class _Echo:
    req: EngineRequest
    queue: asyncio.Queue[EngineOutput]
    decoder: IncrementalDecoder
    source: list[int]  # the tokens echoed, in a cycle
    to_generate: int
    arrival: float
    started_mono: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    generated: int = 0


class EchoEngine(Engine):
    """Options (keyword, optional): ``model`` (default ``echo``), ``tokens_per_s`` per
    request (1000), ``interval_s`` between a request's outputs (0.01), ``max_num_seqs``
    (1024), ``max_model_len`` (32768), ``block_size`` (16), ``tokenizer`` (``byte``, the
    sim's; or a directory with tokenizer.json), ``generation_config`` (a directory whose
    generation_config.json sampling defaults to advertise; "": none)."""

    def __init__(
        self,
        *,
        model: str = "echo",
        tokens_per_s: float = 1000.0,
        interval_s: float = 0.01,
        max_num_seqs: int = 1024,
        max_model_len: int = 32768,
        block_size: int = 16,
        tokenizer: str = "byte",
        generation_config: str = "",
    ) -> None:
        if tokens_per_s <= 0 or interval_s <= 0:
            raise ValueError("echo engine: tokens_per_s and interval_s must be > 0")
        if max_num_seqs < 1 or max_model_len < 2 or block_size < 1:
            raise ValueError("echo engine: max_num_seqs, max_model_len and block_size must be positive")
        self._model = model
        self.tokens_per_s = tokens_per_s
        self.interval_s = interval_s
        self._max_num_seqs = max_num_seqs
        self._max_model_len = max_model_len
        self._block_size = block_size
        self._tokenizer_spec = tokenizer
        self._tokenizer = load_tokenizer(tokenizer)
        self._sampling_defaults = read_sampling_defaults(generation_config, "") if generation_config else None
        self._running: dict[str, _Echo] = {}
        self._waiting: dict[str, _Echo] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._shut = asyncio.Event()
        self._emitted = 0  # tokens since start
        # (monotonic time, tokens emitted) at each tick of the last second: the decode rate
        self._recent: deque[tuple[float, int]] = deque()

    # ---- identity and limits ----
    @property
    def engine_name(self) -> str:
        return "echo"

    @property
    def accelerator(self) -> tuple[str, int]:
        return ("none", 0)  # no model: nothing to pay for but the CPU it shares

    @property
    def model(self) -> str:
        return self._model

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def kv_blocks_total(self) -> int:
        return self._max_num_seqs * -(-self._max_model_len // self._block_size)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self._max_model_len

    @property
    def tokenizer_spec(self) -> str:
        return self._tokenizer_spec

    @property
    def sampling_defaults(self) -> SamplingDefaults | None:
        return self._sampling_defaults

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("engine was shut down")
        if self._task is None:
            self._task = asyncio.create_task(self._tick(), name="echo-engine-ticks")

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shut.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for request_id in [*self._running, *self._waiting]:
            await self.abort(request_id)

    # ---- requests ----
    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._task is None or self._closed:
            raise RuntimeError("engine is not running (call start(), not after shutdown())")
        rid = req.request_id
        if rid in self._running or rid in self._waiting:
            raise ValueError(f"request {rid!r} is already in flight")
        arrival = req.arrival_time or time.time()
        rejected = self._check(req)
        if rejected is not None:
            yield EngineOutput(request_id=rid, finish_reason="error", prompt_tokens=len(req.prompt_token_ids),
                               timings=Timings(arrival=arrival, finished=time.time()), error=rejected, rejected=True)
            return
        n = len(req.prompt_token_ids)
        to_generate = min(req.sampling.max_tokens, self._max_model_len - n + req.output_offset) - req.output_offset
        if to_generate <= 0:
            now = time.time()
            yield EngineOutput(request_id=rid, finish_reason="length", prompt_tokens=n,
                               timings=Timings(arrival=arrival, finished=now))
            return
        source = req.prompt_token_ids[: n - req.output_offset] or req.prompt_token_ids
        echo = _Echo(req, asyncio.Queue(), IncrementalDecoder(self._tokenizer), list(source), to_generate, arrival)
        if len(self._running) < self._max_num_seqs:
            self._begin(echo)
        else:
            self._waiting[rid] = echo
        try:
            while True:
                out = await echo.queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            # Still registered: the consumer left early.
            if self._running.get(rid) is echo or self._waiting.get(rid) is echo:
                self._running.pop(rid, None)
                self._waiting.pop(rid, None)
                self._admit_waiting()

    def _check(self, req: EngineRequest) -> str | None:
        error = prompt_error(req, self._max_model_len)
        if error is not None:
            return error
        if req.sampling.max_tokens < 1:
            return "max_tokens must be at least 1"
        if req.sampling.structured is not None:
            return "the echo engine does not do structured outputs (it repeats the prompt)"
        if req.lora:
            return f"unknown LoRA adapter {req.lora!r} (the echo engine has none)"
        return None

    def _begin(self, echo: _Echo) -> None:
        """Start ``echo``: its first token at once, the rest on the ticker."""
        self._running[echo.req.request_id] = echo
        echo.started_mono = time.monotonic()
        echo.scheduled = echo.first_token = time.time()
        self._emit(echo, 1)
        self._wake.set()

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._running) < self._max_num_seqs:
            rid = next(iter(self._waiting))
            self._begin(self._waiting.pop(rid))

    def _emit(self, echo: _Echo, k: int) -> None:
        """Hand ``echo`` its next ``k`` tokens (its last ones: finished)."""
        k = min(k, echo.to_generate - echo.generated)
        src = echo.source
        start = echo.req.output_offset + echo.generated
        ids = [src[(start + i) % len(src)] for i in range(k)]
        echo.generated += k
        self._emitted += k
        text = echo.decoder.push(ids)
        done = echo.generated >= echo.to_generate
        logprobs = None
        if echo.req.sampling.logprobs is not None:
            pieces = [self._tokenizer.decode([t]) for t in ids]
            top_k = echo.req.sampling.logprobs
            logprobs = [TokenLogprob(t, p, 0.0, [TopLogprob(t, p, 0.0)] if top_k else [], rank=1)
                        for t, p in zip(ids, pieces, strict=True)]
        now = time.time()
        out = EngineOutput(
            request_id=echo.req.request_id, new_token_ids=ids, text=text,
            finish_reason="length" if done else None,
            prompt_tokens=len(echo.req.prompt_token_ids), completion_tokens=echo.generated,
            timings=Timings(arrival=echo.arrival, scheduled=echo.scheduled, first_token=echo.first_token,
                            finished=now if done else 0.0),
            logprobs=logprobs,
        )
        if done:
            del self._running[echo.req.request_id]
        echo.queue.put_nowait(out)

    async def _tick(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            for echo in list(self._running.values()):
                due = int((now - echo.started_mono) * self.tokens_per_s) + 1 - echo.generated
                if due > 0:
                    self._emit(echo, due)
            self._admit_waiting()
            recent = self._recent
            recent.append((now, self._emitted))
            while recent[0][0] < now - 1.0:
                recent.popleft()

    async def abort(self, request_id: str) -> None:
        echo = self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        if echo is None:
            return
        echo.queue.put_nowait(EngineOutput(
            request_id=request_id, finish_reason="abort", prompt_tokens=len(echo.req.prompt_token_ids),
            completion_tokens=echo.generated,
            timings=Timings(arrival=echo.arrival, scheduled=echo.scheduled, first_token=echo.first_token,
                            finished=time.time())))
        self._admit_waiting()

    # ---- observability ----
    def stats(self) -> EngineStats:
        running_tokens = sum(len(e.req.prompt_token_ids) + e.generated for e in self._running.values())
        used = -(-running_tokens // self._block_size)
        total = self.kv_blocks_total
        rate = 0.0
        if len(self._recent) > 1 and time.monotonic() - self._recent[-1][0] < 1.0:
            (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        return EngineStats(
            waiting=len(self._waiting), running=len(self._running),
            queued_prefill_tokens=sum(len(e.req.prompt_token_ids) for e in self._waiting.values()),
            running_tokens=running_tokens, kv_blocks_total=total, kv_blocks_used=used, kv_usage=used / total,
            decode_tokens_per_s=rate, step_time_s=self.interval_s,
        )

    async def kv_events(self) -> AsyncGenerator[list[KvEvent], None]:
        # No prefix cache, nothing to announce; ends when the engine shuts down.
        await self._shut.wait()
        return
        yield  # an async generator

    def kv_snapshot(self) -> list[int]:
        return []
