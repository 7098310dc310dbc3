"""Tracing set-up: spans are recorded only where they go somewhere; a caller's trace
context crosses every hop either way."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from bus import tracing
from bus.tracing import (
    TracingConfigError,
    TracingPlan,
    extract_context,
    inject_headers,
    setup_tracing,
    tracing_plan,
)

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


def test_the_otel_variables_choose_the_exporters_and_the_name() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert tracing_plan("gateway", {}) is None
    assert tracing_plan("gateway", endpoint) == TracingPlan("gateway", ("otlp-http",))
    grpc = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert tracing_plan("gateway", grpc) == TracingPlan("gateway", ("otlp-grpc",))
    # The traces-specific variable wins over the general one.
    assert tracing_plan("gateway", {**grpc, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) \
        == TracingPlan("gateway", ("otlp-http",))
    assert tracing_plan("gateway", {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing_plan("gateway", {"OTEL_TRACES_EXPORTER": "console"}) == TracingPlan("gateway", ("console",))
    # Named explicitly, OTLP goes to the specification's default endpoint.
    assert tracing_plan("gateway", {"OTEL_TRACES_EXPORTER": "otlp,console"}) \
        == TracingPlan("gateway", ("otlp-http", "console"))
    with pytest.raises(TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        tracing_plan("gateway", {**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(TracingConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        tracing_plan("gateway", {"OTEL_TRACES_EXPORTER": "zipkin"})
    # OTEL_SERVICE_NAME, then service.name among the resource attributes, then meshserve's.
    attrs = {**endpoint, "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=edge%20gw"}
    assert tracing_plan("gateway", attrs) == TracingPlan("edge gw", ("otlp-http",))
    assert tracing_plan("gateway", {**attrs, "OTEL_SERVICE_NAME": "gw-eu"}) == TracingPlan("gw-eu", ("otlp-http",))
    assert tracing_plan("gateway", {**endpoint, "OTEL_SERVICE_NAME": ""}) == TracingPlan("gateway", ("otlp-http",))


def test_grpc_without_its_package_is_a_clear_error() -> None:
    import importlib.util

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None:
        pytest.skip("the gRPC exporter is installed here")
    with pytest.raises(TracingConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        setup_tracing("gateway", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert tracing._provider is None
