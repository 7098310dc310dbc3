"""bus.client.backoff_delay: doubling, capped, jittered within the upper half."""

from __future__ import annotations

from bus.client import backoff_delay


def test_doubles_up_to_the_cap_within_the_upper_half() -> None:
    assert [backoff_delay(a, 0.1, 1.0, rand=lambda: 1.0) for a in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert [backoff_delay(a, 0.1, 1.0, rand=lambda: 0.0) for a in range(3)] == [0.05, 0.1, 0.2]
    assert backoff_delay(10_000, 0.1, 10.0, rand=lambda: 1.0) == 10.0  # no overflow after days of retries
