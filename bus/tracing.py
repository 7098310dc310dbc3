"""OpenTelemetry set-up and W3C trace context across NATS hops.

Exporters follow the standard ``OTEL_*`` variables: OTLP/HTTP when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific variable) is set;
``OTEL_SDK_DISABLED=true`` turns tracing off. ``MESHSERVE_TRACE_FILE`` adds a JSON-lines
file exporter, which tests read to check a whole trace tree.

With no exporter configured no spans are recorded (recording them for nobody cost ~2 ms
of CPU per request across the mesh, 0.2–0.6 ms of its added latency: BENCHMARKS.md): the
OpenTelemetry API's no-op tracer then passes a caller's ``traceparent`` through every hop
unchanged, so a trace begun upstream still reaches whatever exports downstream.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (several processes may share it)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            if ctx is None:
                continue
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
                        "kind": span.kind.name,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "status": span.status.status_code.name,
                        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
                    }
                )
            )
        if lines:
            data = ("\n".join(lines) + "\n").encode()
            with self._lock:
                # O_APPEND keeps whole lines from concurrent processes from interleaving.
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return list(value)


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install a tracer provider for this process; idempotent."""
    global _provider
    env = os.environ if env is None else env
    if _provider is not None:
        return _provider
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    otlp = bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    trace_file = env.get("MESHSERVE_TRACE_FILE")
    if not otlp and not trace_file:
        return None  # nowhere to send spans: record none (see the module's docstring)
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None, ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Add ``traceparent``/``tracestate`` of the current (or given) span to NATS headers."""
    headers = {} if headers is None else headers
    propagate.inject(headers, context=ctx)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent context carried by a message's headers (empty context if none)."""
    return propagate.extract(dict(headers) if headers else {})
