"""What a benchmark records: every request's raw timings, per-run summaries, the
client's own health, and the file format (JSON, ``schema`` versioned).

Units are in the field names: raw per-request times in seconds (``_s``), summary
latencies in milliseconds (``_ms``). Times are ``time.perf_counter`` readings taken
by the client, relative to the start of the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

SCHEMA = 1

# Request statuses other than "ok": an HTTP-like code ("429", "500", ...) for errors the
# target answered with, or one of these for errors on the client's side of the wire.
STATUS_OK = "ok"
STATUS_TIMEOUT = "timeout"            # no end of stream within the request timeout
STATUS_CANCELLED = "cancelled"        # still running when the drain timeout ended the run
STATUS_CONNECTION = "connection"      # could not connect / connection dropped
STATUS_INCOMPLETE = "incomplete"      # stream ended without [DONE] / Meshserve-Done
STATUS_STREAM_ERROR = "stream_error"  # an error object inside the stream
STATUS_PROTOCOL = "protocol"          # unparseable chunk
STATUS_NO_RESPONDERS = "no_responders"  # NATS: nobody subscribed to the API subject
STATUS_PAYLOAD = "payload_too_large"  # NATS: body over the server's max_payload


class RequestResult(msgspec.Struct, kw_only=True):
    index: int                 # order of creation within the run
    session: int
    turn: int
    scheduled_s: float         # when the request was due (offset from run start)
    sent_s: float = 0.0        # when it was sent
    status: str = "pending"
    error: str | None = None
    http_status: int | None = None
    input_tokens: int = 0      # content tokens the bench generated (before any chat template)
    prompt_tokens: int | None = None  # usage.prompt_tokens reported by the target
    max_tokens: int = 0
    output_tokens: int = 0     # usage.completion_tokens, else the streamed token count
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    response_id: str | None = None  # the response's ``id`` (e.g. cmpl-…): match it with the server's logs
    # Each token-bearing chunk: arrival time since sent, and its token count.
    chunk_s: list[float] = msgspec.field(default_factory=list)
    chunk_tokens: list[int] = msgspec.field(default_factory=list)
    itl_s: list[float] = msgspec.field(default_factory=list)  # per token after the first chunk


class Dist(msgspec.Struct, kw_only=True):
    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None


class SLOSpec(msgspec.Struct, kw_only=True):
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    # The SLO "holds" at a load when at least this fraction of requests meets it.
    attainment: float = 0.9

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def describe(self) -> str:
        parts = [f"{name}≤{v * 1000:g}ms" for name, v in
                 (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s)) if v is not None]
        return " and ".join(parts) if parts else "none"


class Summary(msgspec.Struct, kw_only=True):
    requests: int = 0
    ok: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    duration_s: float = 0.0
    offered_rate: float | None = None       # requests sent / span of send times
    request_throughput: float = 0.0         # ok requests / duration
    input_token_throughput: float = 0.0
    output_token_throughput: float = 0.0
    total_token_throughput: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    goodput: float | None = None            # ok requests meeting the SLO / duration
    slo_met: int | None = None
    slo_attainment: float | None = None     # slo_met / requests (errors count as misses)
    slo_holds: bool | None = None
    output_len_mismatch: int = 0            # ok requests whose output != max_tokens
    ttft_ms: Dist = msgspec.field(default_factory=Dist)
    tpot_ms: Dist = msgspec.field(default_factory=Dist)
    itl_ms: Dist = msgspec.field(default_factory=Dist)
    e2e_ms: Dist = msgspec.field(default_factory=Dist)


class ClientHealth(msgspec.Struct, kw_only=True):
    loop: str = "asyncio"
    lag_ms: Dist = msgspec.field(default_factory=Dist)       # event-loop ticker lateness
    send_late_ms: Dist = msgspec.field(default_factory=Dist)  # sent_s - scheduled_s
    late_sends: int = 0            # requests sent more than the threshold late
    cpu_util: float = 0.0          # client process CPU seconds / wall seconds
    lagged: bool = False
    reasons: list[str] = msgspec.field(default_factory=list)


class RunResult(msgspec.Struct, kw_only=True):
    endpoint: str
    target: str
    api: str
    mode: str                      # "open-loop" | "closed-loop"
    arrival: str                   # poisson | constant | gamma | burst | trace | concurrency
    rate: float | None = None      # offered requests/s (open loop; None = all at once)
    concurrency: int | None = None  # closed loop
    load: str = ""                 # human label, e.g. "poisson 4 req/s" or "closed-loop c=8"
    summary: Summary = msgspec.field(default_factory=Summary)
    client: ClientHealth = msgspec.field(default_factory=ClientHealth)
    warnings: list[str] = msgspec.field(default_factory=list)
    requests: list[RequestResult] = msgspec.field(default_factory=list)

    @property
    def load_value(self) -> float:
        """The x axis of a sweep: offered rate, or concurrency in closed loop."""
        if self.mode == "closed-loop":
            return float(self.concurrency or 0)
        return float("inf") if self.rate is None else self.rate


class BenchResult(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    created: str = ""
    label: str = ""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    slo: SLOSpec = msgspec.field(default_factory=SLOSpec)
    runs: list[RunResult] = msgspec.field(default_factory=list)
    # Per endpoint: the highest load whose SLO holds, with every lower load holding too.
    knees: dict[str, float | None] = msgspec.field(default_factory=dict)
    # True when the load generator itself lagged in any run (see runs[].client.reasons).
    client_lagged: bool = False

    @property
    def lagged(self) -> bool:
        return self.client_lagged or any(r.client.lagged for r in self.runs)

    def endpoints(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.runs:
            seen.setdefault(r.endpoint, None)
        return list(seen)


def save_result(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(result))
    return path


def load_result(path: str | Path) -> BenchResult:
    data = Path(path).read_bytes()
    result = msgspec.json.decode(data, type=BenchResult)
    if result.schema != SCHEMA:
        raise ValueError(f"{path}: result schema {result.schema}, this build reads {SCHEMA}")
    if not result.label:
        result.label = Path(path).stem
    return result
