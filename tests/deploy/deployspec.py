"""What the deployment files are checked against: the real CLI and the variables meshserve reads."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from functools import cache
from pathlib import Path

from ops.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
SOURCE_DIRS = ("bus", "services", "ops", "proto")

# What the workers will export (vLLM's names); the gateway's own come from GatewayMetrics.
VLLM_METRICS = frozenset({
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
})


# A PromQL selector: a metric name and its {label matchers}.
_SELECTOR = re.compile(r"\b((?:meshserve|vllm):[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"((?:[^\"\\\\]|\\\\.)*)\"")


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: matched value}) of each selector of a PromQL expression."""
    return [(name, dict(_MATCHER.findall(body))) for name, body in _SELECTOR.findall(expr)]


def exported_labels(registry: object) -> dict[str, set[str]]:
    """Every series name a prometheus_client registry exports → its label names (from the
    metrics' definitions: a labelled metric has no sample until a child is made)."""
    out: dict[str, set[str]] = {}
    for collector, names in registry._collector_to_names.items():  # type: ignore[attr-defined]
        labels = set(getattr(collector, "_labelnames", ()))
        for name in names:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


class CliError(AssertionError):
    pass


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``argv`` (without the program name) parsed by ``meshserve``'s own parser, or CliError."""
    assert argv, "empty meshserve command"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser(argv[0]).parse_args(argv)
    except SystemExit as exc:
        raise CliError(f"`meshserve {' '.join(argv)}` does not parse: {err.getvalue().strip()}") from exc


def parse_serve(command: list[str]) -> tuple[str, argparse.Namespace]:
    """A container command that must be exactly ``meshserve serve SERVICE ...``."""
    assert command[:2] == ["meshserve", "serve"], f"not `meshserve serve ...`: {command}"
    args = parse_cli(command[1:])
    return str(args.service), args


@cache
def env_names_meshserve_reads() -> frozenset[str]:
    """Every ``MESHSERVE_*`` variable named in the code, plus what ``os.environ`` is asked for."""
    names: set[str] = set()
    settings = (ROOT / "bus" / "settings.py").read_text()
    names |= {f"MESHSERVE_{n}" for n in re.findall(r'_env\(env,\s*"([A-Z0-9_]+)"', settings)}
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(errors="replace")
            names |= set(re.findall(r'"(MESHSERVE_[A-Z0-9_]*[A-Z0-9])"', text))
            names |= set(re.findall(r'(?:environ\.get|getenv|environ)\(\s*"([A-Z][A-Z0-9_]+)"', text))
            names |= set(re.findall(r'environ\[\s*"([A-Z][A-Z0-9_]+)"\s*\]', text))
    return frozenset(names)


def env_name_is_read(name: str) -> bool:
    # OTEL_* are read by the OpenTelemetry SDK meshserve configures (bus.tracing).
    return name in env_names_meshserve_reads() or name.startswith("OTEL_")


def listening_ports(service: str, args: argparse.Namespace) -> dict[int, str]:
    """Port → the host it binds, for each listener the service's flags open."""
    ports: dict[int, str] = {}
    if service == "gateway":
        ports[int(args.port)] = str(args.host)
    if getattr(args, "metrics_port", None):
        ports[int(args.metrics_port)] = str(args.metrics_host)
    return ports


def duration_s(text: str | int | float) -> float:
    """Compose / Nomad / Go durations: 1m30s, 150s, 90, 2h."""
    if isinstance(text, (int, float)):
        return float(text)
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)?", text.strip())
    assert parts and "".join(n + (u or "") for n, u in parts) == text.strip(), f"not a duration: {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1, "": 1}
    for number, unit in parts:
        total += float(number) * scale[unit or ""]
    return total
