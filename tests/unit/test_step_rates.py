"""The step window behind both engines' speeds (``services/worker/engines/step_rates``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.worker.engines.step_rates import StepRecord, StepWindow


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.0005, 0.01, 0.4]), st.integers(0, 4096), st.integers(0, 64),
                          st.sampled_from([0.0, 0.0, 0.0, 2.5])),  # now and then an idle gap empties it
                min_size=1, max_size=200))
def test_the_step_window_keeps_the_sums_a_recount_of_its_steps_reads(
        steps: list[tuple[float, int, int, float]]) -> None:
    win = StepWindow(span=1.0, full_prefill=1024)
    now = 0.0
    for duration, prefill, sampled, idle in steps:
        now += idle
        win.prune(now)
        assert win.steps or (win.duration, win.prefill_time, win.sampling_time) == (0.0, 0.0, 0.0)
        now += duration
        win.add(StepRecord(now, duration, prefill, sampled))
        win.prune(now)
        assert all(r.duration > 0 for r in win.steps)  # a step of unknown duration is left out
        full = [r for r in win.steps if r.prefill_tokens >= 1024]
        sampling = [r for r in win.steps if r.sampled_tokens]
        assert (win.prefill_steps, win.prefill_tokens) == (len(full), sum(r.prefill_tokens for r in full))
        assert (win.sampling_steps, win.sampled_tokens) == (len(sampling), sum(r.sampled_tokens for r in sampling))
        assert win.prefill_time == pytest.approx(sum(r.duration for r in full), abs=1e-9)
        assert win.sampling_time == pytest.approx(sum(r.duration for r in sampling), abs=1e-9)
        assert win.duration == pytest.approx(sum(r.duration for r in win.steps), abs=1e-9)
        # Emptied, a time sum is nothing, not a rounding remainder a rate could divide by.
        assert full or win.prefill_time == 0.0
        assert sampling or win.sampling_time == 0.0


def test_the_speeds_are_per_busy_second_and_hold_their_last_value_when_idle() -> None:
    win = StepWindow(span=5.0, full_prefill=1024, prefill_rate=9000.0, decode_rate=50.0)
    assert win.rates(0.0) == (9000.0, 50.0, 0.0)  # the caller's estimates before a step
    # A short prompt's step, then two full prefill steps and a decode step, 0.1 s each,
    # then 10 s idle: the idle time is in no rate.
    for end, prefill, sampled in ((0.1, 300, 1), (0.2, 2048, 0), (0.3, 2000, 2), (0.4, 0, 8)):
        win.add(StepRecord(end, 0.1, prefill, sampled))
    prefill_rate, decode_rate, step_time = win.rates(0.4)
    assert prefill_rate == pytest.approx((2048 + 2000) / 0.2)  # the 300-token step says nothing of capacity
    assert decode_rate == pytest.approx(11 / 0.3) and step_time == pytest.approx(0.1)
    assert win.rates(10.4) == pytest.approx((prefill_rate, decode_rate, 0.1))
    win.add(StepRecord(10.5, 0.0, 2048, 4))  # unknown duration: no seconds to divide by
    assert win.rates(10.5) == pytest.approx((prefill_rate, decode_rate, 0.1)) and not win.steps
