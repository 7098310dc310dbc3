"""Metering's Prometheus metrics: its own figures (``MeteringService.stats``) read at each
scrape, so an operator sees a ledger that is down, events piling up unbilled, and events
that could not be billed, before a customer's invoice does."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# stats key → (metric name without _total, help)
_COUNTERS = {
    "events_written": ("meshserve:metering_events_written", "Usage events written to the ledger"),
    "duplicates": ("meshserve:metering_duplicates", "Usage events the ledger already had (redeliveries)"),
    "batches": ("meshserve:metering_batches", "Ledger transactions committed"),
    "ledger_errors": ("meshserve:metering_ledger_errors", "Ledger writes that failed and were retried"),
    "redelivered": ("meshserve:metering_redelivered", "Usage events delivered again by JetStream"),
    "unpriced_events": ("meshserve:metering_unpriced_events", "Usage events of a model with no price (charged zero)"),
    "capacity_events": ("meshserve:metering_capacity_events", "Workers' capacity events committed (redeliveries too)"),
    "capacity_rows_written": ("meshserve:metering_capacity_rows_written",
                              "Capacity rows written to the ledger (one per model a period's accelerators held)"),
}
# Events that are not billed, by why (they are kept in the stream: see RELIABILITY.md).
_NOT_BILLED = {"decode_errors": "undecodable", "unsupported_version": "unsupported_version",
               "invalid_events": "invalid", "rejected_events": "rejected_by_ledger"}


class MeteringCollector:
    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for key, (name, help_text) in _COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=s[key])
        not_billed = CounterMetricFamily("meshserve:metering_events_not_billed",
                                         "Usage and capacity events that could not be recorded", labels=["reason"])
        for key, reason in _NOT_BILLED.items():
            not_billed.add_metric([reason], s[key])
        yield not_billed
        yield GaugeMetricFamily("meshserve:metering_ledger_up", "1 while the ledger takes writes", value=int(s["ledger_ok"]))
        yield GaugeMetricFamily("meshserve:metering_lag_events", "Usage events in the stream not yet delivered to metering",
                                value=s["lag"])
        yield GaugeMetricFamily("meshserve:metering_capacity_lag_events",
                                "Capacity events in CAPACITY not yet delivered to metering", value=s["capacity_lag"])
        yield GaugeMetricFamily("meshserve:metering_last_commit_timestamp_seconds",
                                "When the last ledger transaction committed (Unix time; 0: none yet)",
                                value=s["last_commit_at"])


def metering_registry(stats: Callable[[], Mapping[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(MeteringCollector(stats))  # type: ignore[arg-type]
    return registry
