"""What the worker remembers of its requests, their choices, and the usage event a
request bills. Pure.

``RequestBook`` holds the per-request state the shell reads and writes: which requests
are held here and which segment (migration) of each, when each arrived and last made
progress (probes), which engine requests each runs (n choices), which the drain timeout
ended, what the engine took in lately (gauges name them), and the copies their placers
gave up on (superseded). ``SentChunks`` keeps each request's published chunks for
resends. The clock (monotonic seconds) is passed in; the asyncio tasks stay in the shell.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from proto import GenerateRequest, SamplingParams, Timings, Usage, UsageEvent, unpack_tokens, usage_model
from proto.messages import TokenChunk, TokenLogprob, UsageStatus

from .engines.base import EngineOutput

# Gauges name each request the engine took in this many times (so a lost gauge does not
# lose a name) and within this window, at most this many of the newest. A count, not only
# a window: gauges come on every change, and a window's worth of ids in each made their
# bytes grow with the square of the request rate.
ARRIVALS_GAUGES = 8
ARRIVALS_WINDOW_S = 2.0
ARRIVALS_REPORTED = 256
# How long a superseded copy (request id, segment, placement try) is remembered: its
# cancel may come before the request itself (a router's timed-out forward), which is then
# refused. The mark names the try (``GenerateRequest.attempt``): a later try of the same
# segment (a migration that waited for this worker to come back) is no stale copy.
SUPERSEDED_MEMORY_S = 120.0

ProbeState = Literal["unknown", "waiting", "running"]


@dataclass(slots=True)
class Choice:
    """One sequence of a request on the engine (a request with n > 1 has n); the shell
    fills in what the engine gave it."""

    index: int
    engine_id: str
    prompt: list[int]  # prompt + the choice's prior output
    prior: int  # tokens of prior output at the end of ``prompt`` (a migrated request's)
    sampling: SamplingParams
    last: EngineOutput | None = None
    streamed: int = 0
    error_text: str = ""  # an engine failure
    undeliverable: str = ""  # why a chunk of it could not be sent
    tail: tuple[list[int], str, list[TokenLogprob] | None] = field(default_factory=lambda: ([], "", None))

    @property
    def ended_alone(self) -> bool:
        """Whether the engine finished it (stop, length): not a drain's to hand over."""
        return self.last is not None and self.last.finish_reason in ("stop", "length") and not self.failed

    def stop_reason(self, finish: str) -> int | str | None:
        """What stopped the choice (the engine's ``stop_reason``) when it ended "stop"."""
        return self.last.stop_reason if finish == "stop" and self.last is not None else None

    @property
    def failed(self) -> bool:
        """Whether this choice fails its request (an error anywhere fails all n)."""
        return bool(self.error_text or self.undeliverable
                    or self.last is None or self.last.finish_reason in (None, "error"))


def request_choices(request: GenerateRequest, prompt: list[int]) -> list[Choice]:
    """The engine requests of ``request``: itself when n = 1; else one per unfinished
    choice, ``<id>/<index>`` seeded ``seed + index`` (vLLM's parallel sampling does
    the same, so a seeded n gives vLLM's tokens), each continuing its own prior output."""
    sampling = request.sampling
    if sampling.n <= 1:
        return [Choice(0, request.request_id, prompt, len(request.prior_output) // 4, sampling)]
    choices = []
    for i in range(sampling.n):
        if i in request.finished_choices:
            continue
        prior = unpack_tokens(request.prior_outputs[i]) if i < len(request.prior_outputs) else []
        seed = None if sampling.seed is None else sampling.seed + i
        choices.append(Choice(i, f"{request.request_id}/{i}", prompt + prior, len(prior),
                              msgspec.structs.replace(sampling, n=1, seed=seed)))
    return choices


@dataclass(slots=True)
class EngineArrival:
    at: float
    request_id: str
    named: int = 0  # gauges that named it


class RequestBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.arrived_at: dict[str, float] = {}  # held requests: when each arrived
        self.output_at: dict[str, float] = {}  # ... and when each last had output
        self.engine_output_at = clock()  # when the engine as a whole last had output
        self.engine_arrivals: deque[EngineArrival] = deque(maxlen=ARRIVALS_REPORTED)  # what it took in lately
        self.segments: dict[str, int] = {}  # request id → the segment (migrations) held here
        self.attempts: dict[str, int] = {}  # request id → the placement try of the copy held here
        self.engine_ids: dict[str, list[str]] = {}  # request id → its engine requests (n choices)
        # Requests the drain timeout handed over: their gateway continues them elsewhere.
        self.handed_over: set[str] = set()
        # (request id, segment, placement try) of copies their placer gave up on → until when remembered
        self._superseded: dict[tuple[str, int, int], float] = {}

    # ---- a request's life here --------------------------------------------------------
    def hold(self, request_id: str, segment: int, attempt: int = 0) -> None:
        """``request_id`` (that segment of it, placed by that try) runs here from now on:
        probes find it."""
        self.arrived_at[request_id] = self.clock()
        self.segments[request_id] = segment
        self.attempts[request_id] = attempt

    def release(self, request_id: str) -> None:
        """The request ended here: nothing of it is kept (but a superseded mark, which expires)."""
        self.arrived_at.pop(request_id, None)
        self.segments.pop(request_id, None)
        self.attempts.pop(request_id, None)
        self.output_at.pop(request_id, None)
        self.engine_ids.pop(request_id, None)
        self.handed_over.discard(request_id)

    @property
    def empty(self) -> bool:
        return not (self.arrived_at or self.output_at or self.segments or self.engine_ids or self.handed_over)

    def engine_took(self, request_id: str) -> None:
        self.engine_arrivals.append(EngineArrival(self.clock(), request_id))

    def output(self, request_id: str) -> None:
        """The engine produced tokens for ``request_id``."""
        self.output_at[request_id] = self.engine_output_at = self.clock()

    def arrivals_for_gauge(self) -> list[str]:
        """For the next gauge (each call counts as one naming): what the engine took in
        over the last ``ARRIVALS_WINDOW_S`` and fewer than ``ARRIVALS_GAUGES`` gauges have
        named, once each, oldest first."""
        since = self.clock() - ARRIVALS_WINDOW_S
        arrivals = self.engine_arrivals
        while arrivals and (arrivals[0].at < since or arrivals[0].named >= ARRIVALS_GAUGES):
            arrivals.popleft()  # in arrival order: the oldest were named most
        for arrival in arrivals:
            arrival.named += 1
        return list(dict.fromkeys(arrival.request_id for arrival in arrivals))

    def progress(self, request_id: str) -> tuple[ProbeState, float, float]:
        """(state, seconds since its last output or arrival, seconds the engine has been idle)
        of ``request_id``, for a probe."""
        now = self.clock()
        state: ProbeState = "unknown"
        since_output = engine_idle = 0.0
        if request_id in self.arrived_at:
            output_at = self.output_at.get(request_id)
            state = "running" if output_at is not None else "waiting"
            since_output = now - (output_at if output_at is not None else self.arrived_at[request_id])
        if self.arrived_at:
            # Idle since its last output or since the oldest request it owes output arrived,
            # whichever is later: a worker idle for an hour is not hung the moment work arrives.
            engine_idle = now - max(self.engine_output_at, min(self.arrived_at.values()))
        return state, since_output, engine_idle

    # ---- superseded copies ------------------------------------------------------------
    def superseded(self, request_id: str, segment: int, attempt: int = 0) -> bool:
        """Whether this copy (that segment of the request, placed by that try) was
        superseded: it runs elsewhere, or a later try of it does."""
        return (request_id, segment, attempt) in self._superseded

    def held(self, request_id: str) -> tuple[int, int] | None:
        """(segment, placement try) of the copy of ``request_id`` held here, if any."""
        segment = self.segments.get(request_id)
        return None if segment is None else (segment, self.attempts.get(request_id, 0))

    def stale_copy(self, request_id: str, segment: int, attempt: int) -> tuple[int, int] | None:
        """The copy of ``request_id`` held here (segment, try) that this one arriving makes
        stale, if any: an earlier segment, or an earlier try of the same segment (its placer
        gave up on it and tried again; tries are numbered in the order they are made)."""
        held = self.held(request_id)
        if held is None:
            return None
        if segment > held[0] or (segment == held[0] and attempt > held[1] > 0):
            return held
        return None

    def later_try_held(self, request_id: str, segment: int, attempt: int) -> bool:
        """Whether a later try of this segment than ``attempt`` is held here: this copy,
        arriving after it, is one its placer gave up on."""
        held = self.held(request_id)
        return held is not None and held[0] == segment and 0 < attempt < held[1]

    def supersede(self, request_id: str, segment: int, attempt: int = 0) -> bool:
        """Remember that copy (segment, placement try) as stale, whether or not it came yet
        (one still on its way is refused; another try of the segment is not); whether it is
        held here (the shell stops it). Expired marks are forgotten, except that of a copy
        still held."""
        now = self.clock()
        for key, until in list(self._superseded.items()):
            if until <= now and self.held(key[0]) != key[1:]:
                del self._superseded[key]
        self._superseded[(request_id, segment, attempt)] = now + SUPERSEDED_MEMORY_S
        return self.held(request_id) == (segment, attempt)


def usage_event(request: GenerateRequest, usage: Usage, status: UsageStatus, timings: Timings | None, error: str,
                *, worker_id: str, region: str, now: float) -> UsageEvent:
    """What one segment of ``request`` bills (``usage``: ``Outcome.billed``); ``now``: the
    wall clock, the finish time of a request without engine timings."""
    return UsageEvent(
        request_id=request.request_id,
        org=request.org,
        key_id=request.key_id,
        **usage_model(request),
        worker_id=worker_id,
        tier=request.tier,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        status=status,
        arrival_time=request.arrival_time or (timings.arrival if timings else 0.0),
        first_token_time=timings.first_token if timings else 0.0,
        finish_time=timings.finished if timings else now,
        reserved_tokens=request.reserved_tokens,
        migrations=request.migrations,
        error=error,
        user=request.user,
        metadata=request.metadata,
        region=region,
    )


class SentChunks:
    """The chunks published for each request, kept for resends (a gateway that found a gap
    JetStream cannot fill asks for them again) until ``retention_s`` after it ended."""

    def __init__(self, retention_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retention_s = retention_s
        self.clock = clock
        self._chunks: dict[str, tuple[str, dict[int, TokenChunk]]] = {}  # id → its subject, chunks by seq
        self._until: deque[tuple[float, str]] = deque()  # (when to forget, id), in the order requests ended

    def keep(self, request_id: str, subject: str, chunk: TokenChunk) -> None:
        if self.retention_s > 0:
            self._chunks.setdefault(request_id, (subject, {}))[1][chunk.seq] = chunk

    def between(self, request_id: str, from_seq: int, to_seq: int) -> tuple[str, list[TokenChunk]]:
        """The subject and the kept chunks ``from_seq`` to ``to_seq`` (inclusive) of a request."""
        subject, chunks = self._chunks.get(request_id, ("", {}))
        return subject, [chunks[seq] for seq in range(from_seq, to_seq + 1) if seq in chunks]

    def drop(self, request_id: str) -> None:
        self._chunks.pop(request_id, None)

    def ended(self, request_id: str, held: Container[str]) -> None:
        """The request ended: keep its chunks ``retention_s`` longer, drop older ones (not
        of a request ``held`` again: an id reused by a migration back here)."""
        now = self.clock()
        if request_id in self._chunks:
            self._until.append((now + self.retention_s, request_id))
        while self._until and self._until[0][0] <= now:
            _, old = self._until.popleft()
            if old not in held:
                self._chunks.pop(old, None)
