"""Tracing set-up: spans are recorded only where they go somewhere; a caller's trace
context crosses every hop either way."""

from __future__ import annotations

from opentelemetry import trace

from bus import tracing
from bus.tracing import extract_context, inject_headers, setup_tracing

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_no_exporter_records_no_spans() -> None:
    # Nothing configured to receive spans: no provider is installed (recording them for
    # nobody cost ~2 ms of CPU per request across the mesh).
    assert setup_tracing("gateway", env={}) is None
    assert setup_tracing("gateway", env={"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None
    assert setup_tracing("gateway", env={"OTEL_SDK_DISABLED": "true", "MESHSERVE_TRACE_FILE": "/tmp/x"}) is None
    assert tracing._provider is None
    # (an exporter installs a recording provider: tests/integration/test_traces.py reads its spans)


def test_without_a_provider_the_callers_trace_passes_through_each_hop() -> None:
    """What a service does per hop (a span under the remote context, the context injected
    into the next message), with the API's no-op tracer: the caller's trace id and parent
    reach the next hop unchanged, and a request without one carries none."""
    tracer = trace.NoOpTracer()
    headers = {"traceparent": CALLER}
    for _ in range(3):  # gateway → router → worker
        with tracer.start_as_current_span("hop", context=extract_context(headers)):
            headers = inject_headers()
    assert headers["traceparent"] == CALLER
    with tracer.start_as_current_span("hop", context=extract_context({})):
        assert "traceparent" not in inject_headers()
