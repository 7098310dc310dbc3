"""The worker's settings: how it streams, reports and keeps what it sent."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from proto import WorkerRole


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str = ""
    coalesce_interval_s: float = 0.02  # a chunk at most every 20 ms ...
    coalesce_max_tokens: int = 16  # ... or every 16 tokens, whichever first
    max_messages_per_s: float = 1000.0  # chunk rate budget of the whole worker (widens the interval)
    gauge_interval_s: float = 0.25
    # A change (an arrival, an end) publishes a gauge at once, but never sooner than this
    # after the last (one gauge then carries many changes: fewer messages to every reader
    # in a large fleet). Off by default: a delayed gauge lands on the next request's first
    # token (+0.3 ms of added latency, sequential requests; BENCHMARKS.md, Smaller gauges).
    gauge_min_interval_s: float = 0.0
    heartbeat_interval_s: float = 2.0
    drain_timeout_s: float = 60.0
    metrics_port: int | None = None  # serve vLLM-named Prometheus metrics here (0: any free port)
    metrics_host: str = "127.0.0.1"
    tool_parser: str = ""  # advertised in WorkerInfo: the gateway parses this model's tool calls with it
    reasoning_parser: str = ""
    # Published chunks are kept this long after their request ends, so a gateway that saw
    # a gap TOKENS cannot fill (a chunk lost in a dying NATS node's socket) can have them
    # sent again (``ChunkResend``); 0 keeps none.
    chunk_retention_s: float = 10.0
    # A usage event is published in the background until USAGE stores it, for this long
    # (the gateway publishes the copy on the final chunk too).
    usage_retry_s: float = 600.0
    # What the fleet costs: the accelerator this worker runs on (the price table's key) and
    # how many; "" / None: the engine's own (the sim profile's, vLLM's device and parallelism).
    accelerator: str = ""
    accelerators: int | None = None
    # A capacity event (its accelerator time, busy time) every this many seconds, and a
    # last one at stop: a crash loses at most one period of the fleet report.
    capacity_interval_s: float = 60.0
    # Prefill/decode split (proto.WorkerInfo.role): "prefill" computes prompts for the
    # pool's other workers; "both" takes requests. How long a decode worker waits for a
    # prefill worker's answer (its queue included) before computing the prompt itself.
    role: WorkerRole = "both"
    remote_prefill_timeout_s: float = 30.0
    region: str = ""  # where it runs (WorkerInfo.region; DESIGN.md, Regions)


def default_worker_id(model: str) -> str:
    short = model.rsplit("/", 1)[-1].lower().replace(".", "-")[:24]
    return f"{short}-{socket.gethostname()[:16]}-{os.getpid()}"
