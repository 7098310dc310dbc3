"""The gateway's Prometheus metrics (one registry per gateway instance).

Latency histograms use vLLM's bucket edges and names in the ``meshserve:`` namespace
(``vllm:`` names are for engine-side figures the workers export), so dashboards built
for vLLM read them with a namespace change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.latency_buckets import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS

TPOT_BUCKETS = ITL_BUCKETS
E2E_BUCKETS = REQUEST_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # status: ok, cancelled or error for a request that ran; the HTTP status of one
        # refused before it ran (400, 401, 404, 429...; model "" when it named none served)
        self.requests = Counter("meshserve:gateway_requests_total", "Requests by API, model and status",
                                ["api", "model", "status"], registry=r)
        self.errors = Counter("meshserve:gateway_errors_total", "Errors by code", ["code"], registry=r)
        self.ttft = Histogram(
            "meshserve:time_to_first_token_seconds", "Time to first token seen by the gateway", ["model"], buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "meshserve:time_per_output_token_seconds", "Mean inter-token time per request", ["model"], buckets=TPOT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "meshserve:e2e_request_latency_seconds", "End-to-end request latency", ["model"], buckets=E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("meshserve:prompt_tokens_total", "Prompt tokens", ["model"], registry=r)
        self.generation_tokens = Counter("meshserve:generation_tokens_total", "Generated tokens", ["model"], registry=r)
        self.in_flight = Gauge("meshserve:gateway_streams_in_flight", "Open request streams", registry=r)
        self.admission_unreachable = Counter(
            "meshserve:gateway_admission_unreachable_total", "Decisions made without admission", ["outcome"], registry=r
        )
        self.cancels = Counter("meshserve:gateway_cancels_total", "Cancels sent to workers", ["reason"], registry=r)
        self.migrations = Counter("meshserve:gateway_migrations_total", "Requests moved off a lost worker", registry=r)
        self.stall_probes = Counter(
            "meshserve:gateway_stall_probes_total",
            "Workers asked about a silent request: queued (left in place) or stalled (migrated)", ["outcome"], registry=r,
        )
        self.resumes = Counter("meshserve:gateway_resumes_total", "Streams resumed with Last-Event-ID", registry=r)
