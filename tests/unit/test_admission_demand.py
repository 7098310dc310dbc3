"""What admission refused for want of capacity, as the autoscalers read it (pure)."""

from __future__ import annotations

from services.admission.demand import RefusedDemand


def test_refusals_are_reported_over_the_window_then_once_at_zero() -> None:
    demand = RefusedDemand(window_s=5.0)
    assert demand.reports(0.0) == {}  # nothing refused: nothing said
    demand.record("m", 1000, now=1.0)
    demand.record("m", 3000, now=2.0)
    demand.record("other", 10, now=2.0)
    assert demand.reports(3.0) == {"m": (2, 4000), "other": (1, 10)}
    assert demand.reports(6.5) == {"m": (1, 3000), "other": (1, 10)}  # the first refusal left the window
    assert demand.reports(7.5) == {"m": (0, 0), "other": (0, 0)}  # gone: said once, so the report clears
    assert demand.reports(8.5) == {}
