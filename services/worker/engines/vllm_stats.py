"""The vLLM engine's gauges, from its own scheduler statistics and the requests it serves.

vLLM calls a stat logger after every engine step with ``SchedulerStats`` (running and
waiting requests, KV cache usage, the step's prefix-cache queries and hits) and
``IterationStats`` (tokens prefilled and generated, preemptions). ``VllmStatsTracker``
folds those into ``EngineStats``; what the scheduler does not report it keeps itself
from the requests it hands to the engine:

- ``queued_prefill_tokens``: prompt tokens of requests that have not produced their
  first token yet (queued or mid-prefill; the engine reports no per-request progress);
- ``running_tokens``: context tokens (prompt + output so far) of requests past their
  first token;
- requests that arrived after the last engine step count as waiting until the next
  step reports them (the gauge goes out as they arrive), and with nothing in flight
  the engine is idle whatever its last report said;
- the speeds (prefill capacity, decode tokens per busy second, step time) from a window
  of its steps, as the sim computes them (``step_rates``); the prefill capacity reads 0
  until the first step that fills half the budget (admission then uses its default).

Plain synchronous code with the clock passed in; ``record_step`` unpacks vLLM's stats
objects by attribute and ``stat_logger_factory`` imports vLLM only when called, so the
module is unit-tested without vLLM.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import EngineStats
from .step_rates import StepRecord, StepWindow

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    prompt_tokens: int
    generated: int = 0
    started: bool = False  # produced its first token


class VllmStatsTracker:
    def __init__(self, *, kv_blocks_total: int, rate_window_s: float = 5.0, hit_window_requests: int = 1000,
                 kv_events_mode: str = "engine", lora_adapters: list[str] | None = None,
                 max_num_batched_tokens: int = 0) -> None:
        self.kv_blocks_total = kv_blocks_total
        self.hit_window_requests = hit_window_requests
        self.kv_events_mode = kv_events_mode
        self.lora_adapters = list(lora_adapters or [])
        self._requests: dict[str, _Request] = {}
        # From the engine's last report.
        self.sched_running = 0
        self.sched_waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0
        self._last_step_ts: float | None = None
        # Prefix cache: (requests, queried tokens, hit tokens) per step, recent requests only.
        self._hits: deque[tuple[int, int, int]] = deque()
        self._hit_requests = 0
        self._hit_queries = 0
        self._hit_hits = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self._window = StepWindow(rate_window_s, 1)
        self.max_num_batched_tokens = max_num_batched_tokens  # 0: unknown, any prefill step counts
        self._work_left = False  # the last step left requests running or waiting
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0

    @property
    def max_num_batched_tokens(self) -> int:
        return self._max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        # Known only once the engine has started (vLLM picks it): the prefill capacity counts
        # only the steps whose prefill fills half of it from then on.
        self._max_num_batched_tokens = value
        self._window.full_prefill = max(value / 2, 1)

    # ---- requests (from the engine shell) -------------------------------------------
    def add(self, request_id: str, prompt_tokens: int) -> None:
        self._requests[request_id] = _Request(prompt_tokens)

    def progress(self, request_id: str, new_tokens: int) -> None:
        r = self._requests.get(request_id)
        if r is None:
            return
        r.started = r.started or new_tokens > 0
        r.generated += new_tokens

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # ---- the engine's reports (stat-logger hook) --------------------------------------
    def on_scheduler(self, *, running: int, waiting: int, kv_usage: float, prefix_requests: int = 0,
                     prefix_queries: int = 0, prefix_hits: int = 0, prefix_reset: bool = False) -> None:
        self.sched_running = running
        self.sched_waiting = waiting
        self.kv_usage = max(0.0, min(1.0, kv_usage))
        if prefix_reset:
            self._hits.clear()
            self._hit_requests = self._hit_queries = self._hit_hits = 0
        if prefix_requests or prefix_queries:
            self._hits.append((prefix_requests, prefix_queries, prefix_hits))
            self._hit_requests += prefix_requests
            self._hit_queries += prefix_queries
            self._hit_hits += prefix_hits
            self.prefix_queries_total += prefix_queries
            self.prefix_hits_total += prefix_hits
            while len(self._hits) > 1 and self._hit_requests > self.hit_window_requests:
                r, q, h = self._hits.popleft()
                self._hit_requests -= r
                self._hit_queries -= q
                self._hit_hits -= h

    def on_iteration(self, now: float, *, prompt_tokens: int, generation_tokens: int, preempted: int = 0,
                     elapsed_s: float | None = None) -> None:
        """One engine step's token counts (``prompt_tokens``: computed, not cache hits)."""
        self.steps += 1
        self.preemptions += preempted
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += generation_tokens
        # The step's own duration: vLLM's figure, else the time since the previous step
        # when that one left work behind (the engine went straight on; otherwise the gap
        # holds idle time).
        gap = now - self._last_step_ts if self._last_step_ts is not None else 0.0
        duration = elapsed_s if elapsed_s is not None and elapsed_s > 0 else (gap if self._work_left and 0 < gap < 1.0 else 0.0)
        self._work_left = self.sched_running + self.sched_waiting > 0
        self._window.add(StepRecord(now, duration, prompt_tokens, generation_tokens))
        self._window.prune(now)
        self._last_step_ts = now

    # ---- the gauge --------------------------------------------------------------------
    @property
    def prefix_hit_rate(self) -> float:
        return self._hit_hits / self._hit_queries if self._hit_queries else 0.0

    def snapshot(self, now: float) -> EngineStats:
        prefill_rate, decode_rate, step_time = self._window.rates(now)
        in_flight = len(self._requests)
        # Requests in the engine are ours alone: running is the scheduler's count (never
        # above what is in flight), and every other request in flight waits, including
        # arrivals since the engine's last step (the scheduler reports them next step).
        running = min(self.sched_running, in_flight)
        waiting = in_flight - running
        kv_usage = self.kv_usage  # the engine's own figure (it reports after every step)
        queued = sum(r.prompt_tokens for r in self._requests.values() if not r.started)
        running_tokens = sum(r.prompt_tokens + r.generated for r in self._requests.values() if r.started)
        used = round(kv_usage * self.kv_blocks_total)
        return EngineStats(
            waiting=waiting,
            running=running,
            queued_prefill_tokens=queued,
            running_tokens=running_tokens,
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_used=used,
            kv_usage=kv_usage,
            prefix_hit_rate=self.prefix_hit_rate,
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            step_time_s=step_time,
            preemptions=self.preemptions,
            prefill_tokens_total=self.prompt_tokens_total,
            lora_adapters=list(self.lora_adapters),
            kv_events_mode=self.kv_events_mode,
        )


def record_step(tracker: VllmStatsTracker, scheduler_stats: Any, iteration_stats: Any, now: float) -> None:
    """vLLM's stats of one step into ``tracker``: its ``SchedulerStats`` and
    ``IterationStats`` (either may be None), read by attribute so that fields missing
    from an older vLLM read as zero."""
    elapsed: float | None = None
    if scheduler_stats is not None:
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        tracker.on_scheduler(
            running=int(scheduler_stats.num_running_reqs),
            waiting=int(scheduler_stats.num_waiting_reqs) + int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)),
            kv_usage=float(scheduler_stats.kv_cache_usage),
            prefix_requests=int(getattr(prefix, "requests", 0) or 0),
            prefix_queries=int(getattr(prefix, "queries", 0) or 0),
            prefix_hits=int(getattr(prefix, "hits", 0) or 0),
            prefix_reset=bool(getattr(prefix, "reset", False)),
        )
        details = getattr(scheduler_stats, "iteration_details", None)
        elapsed_ms = float(getattr(details, "elapsed_ms", 0.0) or 0.0)
        if elapsed_ms > 0:
            elapsed = elapsed_ms / 1000.0
    if iteration_stats is not None:
        token_stats = getattr(iteration_stats, "prompt_token_stats", None)
        computed = getattr(token_stats, "computed", None)
        prompt = int(computed if computed is not None else getattr(iteration_stats, "num_prompt_tokens", 0))
        tracker.on_iteration(
            now, prompt_tokens=prompt, generation_tokens=int(iteration_stats.num_generation_tokens),
            preempted=int(getattr(iteration_stats, "num_preempted_reqs", 0)), elapsed_s=elapsed,
        )


def stat_logger_factory(on_step: Callable[[Any, Any], None]) -> Any:
    """A ``StatLoggerBase`` subclass for ``AsyncLLM.from_engine_args(stat_loggers=...)``
    that hands each step's (scheduler, iteration) stats to ``on_step`` (vLLM calls it on
    the engine's event loop). vLLM is imported only here."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class MeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            try:
                on_step(scheduler_stats, iteration_stats)
            except Exception:  # stats must never break vLLM's output loop
                log.exception("recording vLLM stats failed")

        def log_engine_initialized(self) -> None:
            pass

    return MeshStatLogger
