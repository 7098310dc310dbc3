"""Prefill and decode apart (DESIGN.md, Prefill and decode apart): the decode worker's side.

A request the router placed with a ``prefill_worker`` is still this worker's: it holds it,
answers probes and cancels for it, streams every token and bills it. Before its engine
starts the request, it asks the prefill worker to compute the prompt
(``PrefillRequest`` → ``PrefillResult``) and hands the engine the KV's description
(``EngineRequest.kv_transfer``); the engine loads it instead of computing the prompt. When
the prefill worker refuses, fails, is gone or does not answer in time, the engine computes
the prompt itself: a prefill worker can slow a request down, never lose it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from bus import Bus
from proto import (
    CancelRequest,
    ErrorCode,
    GenerateRequest,
    MeshError,
    PrefillRequest,
    PrefillResult,
    RequestTimeout,
    cache_scope,
    prefill_id,
    unpack_tokens,
)

from .engines.base import EngineRequest, KvHandoff

log = logging.getLogger(__name__)


class Cancelled:
    """``RemotePrefill.fetch``'s answer when the request was cancelled while it waited."""


CANCELLED = Cancelled()


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """A prefill worker's answer: the KV's description for the engine, and the prompt tokens
    it found in its own cache (what the request bills as cached, as vLLM's server reports a
    remote prefill: the tokens nobody computed for it)."""

    transfer: dict[str, Any]
    cached_tokens: int


def disaggregable(request: GenerateRequest) -> bool:
    """Whether a prefill worker may compute ``request``'s prompt: a first segment of one
    choice whose answer needs nothing but the prompt's KV. The router decides only for
    these; a worker checks again (a router of another version)."""
    s = request.sampling
    return (bool(request.prefill_worker) and not request.prior_output and not request.prior_outputs
            and s.n <= 1 and s.max_tokens > 0 and s.prompt_logprobs is None)


class RemotePrefill:
    """The decode worker's prefills on prefill workers, with their counters."""

    def __init__(self, bus: Bus, worker_id: str, timeout_s: float) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._cancels: dict[str, asyncio.Event] = {}
        self.remote_prefills = 0  # loaded from a prefill worker
        self.fallbacks = 0  # computed here after the prefill worker failed
        self.cancelled = 0

    def cancel(self, engine_id: str) -> None:
        """Stop waiting for ``engine_id``'s prefill (its client cancelled, a drain handed it
        over): its request must not start (``started`` says so)."""
        event = self._cancels.get(engine_id)
        if event is not None:
            event.set()

    def waiting(self, engine_id: str) -> bool:
        """Whether ``engine_id`` waits for a prefill worker (work under way, not a hung engine)."""
        return engine_id in self._cancels

    def started(self, engine_id: str) -> bool:
        """``engine_id`` goes to the engine now (with no await before it does): whether it
        was cancelled first, since ``fetch`` began, and must end instead."""
        event = self._cancels.pop(engine_id, None)
        return event is not None and event.is_set()

    async def fetch(self, request: GenerateRequest, engine_id: str) -> RemoteKv | Cancelled | None:
        """The KV's description from ``request.prefill_worker`` (None: compute the prompt here;
        ``CANCELLED``: the request was cancelled meanwhile, and so was the prefill). Call
        ``started`` after it, however it ends: a cancel may come until the engine has it."""
        source = request.prefill_worker
        ask = PrefillRequest(
            request_id=prefill_id(engine_id), model=request.model, prompt=request.prompt, decode_worker=self.worker_id,
            org=request.org, cache_salt=request.cache_salt, lora=request.lora, lora_path=request.lora_path,
            lora_size_bytes=request.lora_size_bytes, priority=request.priority,
            deadline=time.time() + self.timeout_s,
        )
        cancelled = self._cancels.setdefault(engine_id, asyncio.Event())
        answer = asyncio.ensure_future(self.bus.request(self.bus.subjects.worker_prefill(source), ask, PrefillResult,
                                                        timeout=self.timeout_s))
        # Read whatever it ends with, also when nobody waits for it any more (a cancel).
        answer.add_done_callback(lambda done: done.cancelled() or done.exception())
        stop = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({answer, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not answer.done():  # cancelled, or this task was (the worker stopping)
                answer.cancel()
                await asyncio.shield(self._cancel_on(source, ask.request_id))
        if cancelled.is_set():  # whatever the answer: the client is gone
            self.cancelled += 1
            return CANCELLED
        try:
            result = answer.result()
            transfer = json.loads(result.kv_transfer)
            if not isinstance(transfer, dict):
                raise ValueError("kv_transfer is not an object")
        except Exception as exc:  # a refusal, a timeout, a bus failure, a bad answer: computed here
            self.fallbacks += 1
            log.warning("prefill of %s on %s failed (%s): prefilling here", engine_id, source, exc)
            if isinstance(exc, RequestTimeout):  # it may still be computing: for nobody
                await asyncio.shield(self._cancel_on(source, ask.request_id))
            return None
        self.remote_prefills += 1
        return RemoteKv(transfer, min(max(result.cached_tokens, 0), max(result.prompt_tokens, 0)))

    async def _cancel_on(self, source: str, prefill: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.worker_cancel(source),
                                   CancelRequest(request_id=prefill, reason="decode worker stopped waiting"))
        except Exception as exc:  # best effort: its prefill ends anyway, into its cache
            log.debug("could not cancel %s on %s: %s", prefill, source, exc)

    def stats(self) -> dict[str, int]:
        return {"remote_prefills": self.remote_prefills, "remote_prefill_fallbacks": self.fallbacks,
                "remote_prefills_cancelled": self.cancelled}


# ---- the prefill worker's side (WorkerService.handle_prefill): pure -----------------------


def prefill_problem(ask: PrefillRequest, worker_id: str, state: str, model: str, now: float,
                    running: Container[str]) -> MeshError | None:
    """Why this worker does not take ``ask`` now (None: it does)."""
    if state != "ready":
        return MeshError(f"worker {worker_id} is {state}", code=ErrorCode.DRAINING)
    if ask.model != model:
        return MeshError(f"worker {worker_id} serves {model!r}, not {ask.model!r}", code=ErrorCode.UNKNOWN_MODEL)
    if 0 < ask.deadline <= now:
        return MeshError(f"prefill of {ask.request_id} is past its deadline", code=ErrorCode.TIMEOUT)
    if ask.request_id in running:
        return MeshError(f"request {ask.request_id} is already running here", code=ErrorCode.BAD_REQUEST)
    return None


def prefill_engine_request(ask: PrefillRequest, now: float) -> EngineRequest:
    return EngineRequest(request_id=ask.request_id, prompt_token_ids=unpack_tokens(ask.prompt), priority=ask.priority,
                         arrival_time=now, lora=ask.lora, lora_size_bytes=ask.lora_size_bytes, lora_path=ask.lora_path,
                         cache_salt=cache_scope(ask.org, ask.cache_salt))


def prefill_result(ask: PrefillRequest, handoff: KvHandoff, worker_id: str) -> PrefillResult:
    """The answer: the KV's description as JSON (vLLM's connectors put plain JSON values in
    their ``kv_transfer_params``), and where the time went."""
    t = handoff.timings
    return PrefillResult(
        request_id=ask.request_id, worker_id=worker_id,
        kv_transfer=json.dumps(handoff.transfer, separators=(",", ":")).encode(),
        prompt_tokens=handoff.prompt_tokens, cached_tokens=handoff.cached_tokens,
        queue_s=max(t.scheduled - t.arrival, 0.0) if t.scheduled else 0.0,
        prefill_s=max(t.first_token - t.scheduled, 0.0) if t.first_token and t.scheduled else 0.0)
