"""OpenTelemetry set-up and W3C trace context across NATS hops.

Exporters follow the standard ``OTEL_*`` variables: ``OTEL_TRACES_EXPORTER`` (``otlp``,
``console``, ``none``; comma-separated), OTLP over ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``
``http/protobuf`` (the default) or ``grpc`` (with the ``opentelemetry-exporter-otlp-proto-grpc``
package) to ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``; ``OTEL_SERVICE_NAME``, else
``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, names the service;
``OTEL_SDK_DISABLED=true`` turns tracing off. ``MESHSERVE_TRACE_FILE`` adds a JSON-lines
file exporter, which tests read to check a whole trace tree. A value none of these
takes stops the service at start, naming the variable.

One departure from the specification's defaults: without ``OTEL_TRACES_EXPORTER`` spans
are exported only where an OTLP endpoint is set, and with no exporter no spans are
recorded (recording them for nobody cost ~2 ms of CPU per request across the mesh,
0.2–0.6 ms of its added latency: BENCHMARKS.md): the OpenTelemetry API's no-op tracer
then passes a caller's ``traceparent`` through every hop unchanged, so a trace begun
upstream still reaches whatever exports downstream.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
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


class TracingConfigError(ValueError):
    """An ``OTEL_*`` value this build cannot honour (the message names the variable)."""


@dataclass(frozen=True, slots=True)
class TracingPlan:
    service_name: str
    exporters: tuple[str, ...]  # "otlp-http", "otlp-grpc", "console", "file"


def _resource_service_name(env: Mapping[str, str]) -> str:
    for pair in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = pair.partition("=")
        if key.strip() == "service.name" and value.strip():
            return unquote(value.strip())
    return ""


def tracing_plan(service_name: str, env: Mapping[str, str]) -> TracingPlan | None:
    """Which exporters the ``OTEL_*`` variables ask for, and the service's name (None:
    record nothing). Raises ``TracingConfigError`` for a value it cannot honour."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:  # meshserve's default: export where an endpoint says where to
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = ["otlp"] if endpoint else []
    exporters: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            exporters.append("console")
        elif name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                        or "http/protobuf").strip().lower()
            if protocol not in ("http/protobuf", "grpc"):
                raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: "
                                         "use http/protobuf (a collector's port 4318) or grpc (4317)")
            exporters.append("otlp-grpc" if protocol == "grpc" else "otlp-http")
        else:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp, console or none")
    if env.get("MESHSERVE_TRACE_FILE"):
        exporters.append("file")
    if not exporters:
        return None  # nowhere to send spans: record none (see the module's docstring)
    name = env.get("OTEL_SERVICE_NAME", "").strip() or _resource_service_name(env) or service_name
    return TracingPlan(service_name=name, exporters=tuple(exporters))


def _exporter(kind: str, env: Mapping[str, str]) -> SpanExporter:
    if kind == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if kind == "otlp-grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise TracingConfigError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
                                     "opentelemetry-exporter-otlp-proto-grpc (pip install it), or use http/protobuf "
                                     "and the collector's port 4318") from None
        exporter: SpanExporter = GrpcSpanExporter()
        return exporter
    if kind == "console":
        return ConsoleSpanExporter()
    return JsonLinesSpanExporter(env["MESHSERVE_TRACE_FILE"])


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install a tracer provider for this process; idempotent."""
    global _provider
    env = os.environ if env is None else env
    if _provider is not None:
        return _provider
    plan = tracing_plan(service_name, env)
    if plan is None:
        return None
    exporters = [(kind, _exporter(kind, env)) for kind in plan.exporters]
    # The plan's name wins over the resource attribute's (the specification's precedence).
    provider = TracerProvider(resource=Resource.create({"service.name": plan.service_name}))
    for kind, exporter in exporters:
        # Files are read by tests as spans end; the network ones go in batches.
        processor = SimpleSpanProcessor(exporter) if kind == "file" else BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
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
