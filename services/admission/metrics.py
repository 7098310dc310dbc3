"""The admission service's Prometheus metrics (``meshserve:admission_*``), served on
``--metrics-port``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "meshserve:admission_decisions_total", "Verdicts by tier and outcome (admitted or the reason)",
            ["tier", "outcome"], registry=r,
        )
        self.predicted_ttft = Histogram(
            "meshserve:admission_predicted_ttft_seconds", "Predicted TTFT of admitted requests", ["tier"],
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.reconciled = Counter(
            "meshserve:admission_reconciled_total", "Usage events by what they did to a reservation", ["outcome"], registry=r
        )
        self.expired = Counter("meshserve:admission_reservations_expired_total", "Reservations charged in full", registry=r)
        self.open = Gauge("meshserve:admission_reservations_open", "Reservations awaiting their usage event", registry=r)
        self.leader = Gauge("meshserve:admission_leader", "1 while this instance holds the lease", registry=r)
        self.takeovers = Counter("meshserve:admission_takeovers_total", "Times this instance became the leader", registry=r)
        self.calibration = Gauge(
            "meshserve:admission_ttft_calibration", "Factor on predicted TTFT learned from outcomes, per tier", ["tier"],
            registry=r,
        )
