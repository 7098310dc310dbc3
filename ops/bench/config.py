"""Benchmark configuration: targets, load, workload, SLO (plain dataclasses)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from ops.bench.arrivals import KINDS as ARRIVAL_KINDS
from ops.bench.results import SLOSpec
from ops.bench.workload import (
    LengthDist,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    TextFactory,
    TraceWorkload,
    Workload,
    load_trace,
)

WORKLOADS = ("random", "shared-prefix", "multi-turn", "trace")


@dataclass
class EndpointConfig:
    """One target. ``url``: an OpenAI-compatible base URL (``http(s)://host:port/v1``)
    or a NATS server (``nats://host:port``) fronted by meshserve's gateway."""

    url: str
    label: str = ""
    api: str = "chat"             # chat | completions
    model: str | None = None      # None: ask the target's /models (HTTP only)
    api_key: str | None = None
    root: str = "mesh"            # NATS subject root
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {self.api!r}")
        scheme = urlparse(self.url).scheme
        if scheme not in ("http", "https", "nats", "tls"):
            raise ValueError(f"target URL must be http(s):// or nats://, got {self.url!r}")
        if not self.label:
            self.label = self.url

    @property
    def kind(self) -> str:
        return "nats" if urlparse(self.url).scheme in ("nats", "tls") else "openai"

    @classmethod
    def parse(cls, spec: str, **kw: Any) -> EndpointConfig:
        """``[LABEL=]URL``, e.g. ``vllm=http://gpu1:8000/v1`` or ``nats://127.0.0.1:4222``."""
        label, sep, url = spec.partition("=")
        if not sep or "://" in label:
            label, url = "", spec
        return cls(url=url, label=label, **kw)


@dataclass
class WorkloadConfig:
    kind: str = "random"
    input_tokens: str = "512"       # distribution spec (the suffix for shared-prefix,
    output_tokens: str = "128"      # each user message for multi-turn)
    prefix_groups: int = 4
    # shared-prefix: P, a distribution (each group draws one length); multi-turn: the
    # system prompt's tokens (a fixed number)
    prefix_tokens: int | str = 0
    turns: str = "4"
    think_time: str = "0"
    history: str = "synthetic"      # multi-turn history: synthetic | actual (real replies)
    trace: str | None = None
    trace_time_unit: str = "s"
    trace_block_size: int = 512
    tokenizer: str = "byte"

    def build(self, seed: int) -> Workload:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        if self.history not in ("synthetic", "actual"):
            raise ValueError("history must be synthetic or actual")
        text = TextFactory(self.tokenizer)
        inp, out = LengthDist.parse(self.input_tokens), LengthDist.parse(self.output_tokens)
        if self.kind == "random":
            return RandomWorkload(text, inp, out, seed)
        if self.kind == "shared-prefix":
            prefix = LengthDist.parse(self.prefix_tokens)
            if prefix.mean <= 0:
                raise ValueError("shared-prefix needs --prefix-tokens > 0")
            return SharedPrefixWorkload(text, self.prefix_groups, prefix, inp, out, seed)
        if self.kind == "multi-turn":
            system = LengthDist.parse(self.prefix_tokens)
            if system.kind != "fixed":
                raise ValueError("multi-turn takes a fixed --prefix-tokens (the system prompt's length)")
            return MultiTurnWorkload(text, LengthDist.parse(self.turns), inp, out,
                                     LengthDist.parse(self.think_time), round(system.a), seed)
        if not self.trace:
            raise ValueError("the trace workload needs a trace file (--trace)")
        return TraceWorkload(load_trace(self.trace, self.trace_time_unit), text, seed,
                             self.trace_block_size)


@dataclass
class BenchConfig:
    """Everything a benchmark run needs; ``run_bench(config)`` executes it.

    Open loop (default): for each rate in ``rates`` (requests/s, ``inf`` = all at once),
    arrivals follow ``arrival`` whether or not earlier requests finished. Closed loop:
    set ``concurrency`` to a list of levels; that many requests are kept in flight.
    Each load point runs on every endpoint in turn (rate-major, so slow drifts of the
    machine affect all endpoints alike), with the same arrivals and prompts.
    A run stops by itself after ``num_requests`` requests or ``duration`` seconds of
    sending, whichever first, then waits up to ``drain_timeout`` for stragglers.
    """

    endpoints: list[EndpointConfig]
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rates: list[float] | None = None       # None with a trace: its own timing; else [1.0]
    concurrency: list[int] | None = None   # closed loop instead of rates
    arrival: str | None = None             # poisson (default) | constant | gamma | burst | trace
    burst_size: int = 8
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration: float | None = None
    request_timeout: float = 300.0
    drain_timeout: float | None = None     # None: request_timeout + 1 s
    warmup: int = 0                        # requests per endpoint before measuring
    cooldown: float = 0.0                  # pause between runs (s)
    seed: int = 0
    ignore_eos: bool = True
    continuous_usage: bool = False         # ask vLLM for usage in every chunk
    extra_body: dict[str, Any] = field(default_factory=dict)
    slo: SLOSpec = field(default_factory=SLOSpec)
    progress: bool = False
    keep_text: bool = False                # keep generated text (needed by history=actual)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one endpoint is needed")
        labels = [e.label for e in self.endpoints]
        if len(set(labels)) != len(labels):
            raise ValueError(f"endpoint labels must be unique: {labels}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("bound the run by num_requests, duration or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.concurrency is not None:
            if self.rates is not None:
                raise ValueError("give rates (open loop) or concurrency (closed loop), not both")
            if not self.concurrency or any(c < 1 for c in self.concurrency):
                raise ValueError("concurrency levels must be >= 1")
        if self.rates is not None:
            if not self.rates or any(not r > 0 for r in self.rates):
                raise ValueError("rates must be > 0 (inf allowed)")
            if any(math.isinf(r) for r in self.rates) and self.num_requests is None:
                raise ValueError("an infinite rate needs num_requests")
        if self.arrival is not None and self.arrival not in (*ARRIVAL_KINDS, "trace"):
            raise ValueError(f"arrival must be one of {(*ARRIVAL_KINDS, 'trace')}")
        if self.arrival == "trace" and self.workload.kind != "trace":
            raise ValueError("arrival=trace needs the trace workload")
        if self.workload.history == "actual":
            self.keep_text = True

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def arrival_kind(self) -> str:
        if self.closed_loop:
            return "concurrency"
        if self.arrival is not None:
            return self.arrival
        return "trace" if self.workload.kind == "trace" else "poisson"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for ep in d["endpoints"]:
            if ep.get("api_key"):
                ep["api_key"] = "***"  # never write secrets into result files
            ep["headers"] = {k: ("***" if k.lower() == "authorization" else v)
                             for k, v in ep["headers"].items()}
        d["rates"] = None if self.rates is None else [None if math.isinf(r) else r for r in self.rates]
        return d


def default_api_key() -> str | None:
    return os.environ.get("MESHSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
