"""The speeds an engine's gauge reports, from a sliding window of its steps.

Both engines (the sim and vLLM) report the same three figures, so admission, the
autoscaler and ``meshserve status`` read them alike whichever engine is behind a worker:

- ``prefill_tokens_per_s``: a capacity, what the engine prefills per busy second of the
  steps whose prefill fills at least ``full_prefill`` tokens (half the step budget).
  Tokens over wall time read near zero on an idle engine, and a step carrying a short
  or cached prompt costs mostly the fixed per-step time: neither says how fast a queue
  drains (one cached prompt per step reads as ~300 tokens/s on a 14k tokens/s profile).
- ``decode_tokens_per_s``: tokens sampled per busy second of the steps that sampled any.
- ``step_time_s``: the mean duration of the steps in the window.

With no such step in the window a figure holds its last value (the caller's estimate
before the first). A gauge reads these on every arrival and end of a request, so the
window keeps its sums as steps come and go instead of summing its steps each time (a
tenth of a busy sim worker's CPU did that). Token sums are exact; a time sum is reset
when its last step leaves, so rounding cannot leave a rate divided by a remainder of
nothing. Steps of unknown duration (vLLM's first step after idle, when it does not time
its steps) are left out: a rate per busy second needs the seconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepRecord:
    end: float
    duration: float
    prefill_tokens: int  # computed, not cache hits
    sampled_tokens: int


@dataclass
class StepWindow:
    span: float
    full_prefill: float
    prefill_rate: float = 0.0
    decode_rate: float = 0.0
    step_time: float = 0.0
    steps: deque[StepRecord] = field(default_factory=deque)
    duration: float = 0.0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    sampling_steps: int = 0
    sampled_tokens: int = 0
    sampling_time: float = 0.0

    def add(self, rec: StepRecord) -> None:
        if rec.duration <= 0:
            return
        self.steps.append(rec)
        self._count(rec, 1)
        self.step_time = rec.duration

    def _count(self, rec: StepRecord, sign: int) -> None:
        self.duration += sign * rec.duration
        if rec.prefill_tokens >= self.full_prefill:
            self.prefill_steps += sign
            self.prefill_tokens += sign * rec.prefill_tokens
            self.prefill_time += sign * rec.duration
        if rec.sampled_tokens:
            self.sampling_steps += sign
            self.sampled_tokens += sign * rec.sampled_tokens
            self.sampling_time += sign * rec.duration

    def prune(self, now: float) -> None:
        horizon = now - self.span
        steps = self.steps
        while steps and steps[0].end < horizon:
            self._count(steps.popleft(), -1)
        if not steps:
            self.duration = 0.0
        if not self.prefill_steps:
            self.prefill_time = 0.0
        if not self.sampling_steps:
            self.sampling_time = 0.0

    def rates(self, now: float) -> tuple[float, float, float]:
        """(prefill tokens/s, decode tokens/s, step seconds) as of ``now``."""
        self.prune(now)
        if self.prefill_steps and self.prefill_time > 0:
            self.prefill_rate = self.prefill_tokens / self.prefill_time
        if self.sampling_steps and self.sampling_time > 0:
            self.decode_rate = self.sampled_tokens / self.sampling_time
        step_time = self.duration / len(self.steps) if self.steps else self.step_time
        return self.prefill_rate, self.decode_rate, step_time
