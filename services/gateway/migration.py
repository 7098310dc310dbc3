"""Whether and how a request leaves its worker: a pure plan the gateway's shell executes.

A stream that went silent (or whose worker left the registry) is looked at here with
what the gateway knows of the request's current segment, the worker's answer to a probe,
and the limits. The verdict is one of:

- ``Stay``: the worker says the request is queued behind live work (``stall``); wait on.
- ``GiveUp``: the request moved as often as it may; the client gets a ``worker_lost``
  error, the worker is told to stop, and the segment it streamed is billed (``failed``).
- ``Migrate``: retire the old worker from ``cutoff`` on (its chunks from that sequence
  number on are void), bill the segment it streamed (it will never report it), and send
  the next segment, which continues at ``cutoff`` from the tokens the client already has,
  to any other worker.

No I/O and no clock: the shell passes ``now`` (wall clock, for the usage event).

Placing the next segment can find no replica ready (a 1-worker pool whose worker is
restarting, every worker of a pool down at once): ``replica_wait`` says how long the
shell waits before asking again, up to the gateway's ``migration_wait_s``, rather than
failing the request at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from proto import (
    ErrorCode,
    GenerateRequest,
    RequestProbeReply,
    Usage,
    UsageEvent,
    pack_tokens,
    segment_usage,
    usage_dedup_id,
    usage_model,
)

from .stall import queued_on_live_worker

# Placement errors that mean no replica can take the request now, though one may come (a
# restart, a scale-up; "unknown model" from a router that has not seen the pool back yet).
NO_REPLICA_YET = frozenset({ErrorCode.NO_CAPACITY.value, ErrorCode.UNKNOWN_MODEL.value})
REPLICA_POLL_S = 1.0  # at most this long between placement attempts while waiting


def replica_wait(code: str, waited_s: float, wait_limit_s: float) -> float | None:
    """Seconds to wait before placing a migrating request again after placement failed with
    ``code``, having waited ``waited_s`` so far; None: give up (another error, or waited
    ``wait_limit_s``)."""
    if code not in NO_REPLICA_YET or waited_s >= wait_limit_s:
        return None
    return min(REPLICA_POLL_S, wait_limit_s - waited_s)


@dataclass(frozen=True, slots=True)
class MigrationLimits:
    stall_timeout_s: float
    max_migrations: int


@dataclass(frozen=True, slots=True)
class Segment:
    """The request on its current worker, as the gateway sees it."""

    generate: GenerateRequest  # what the current worker was sent (its ``migrations`` counts the moves so far)
    worker_id: str
    next_seq: int  # the first sequence number the client has not been sent
    received_tokens: Sequence[int]  # every token the client has, all segments
    segment_tokens: int  # of those, how many the current worker streamed
    prompt_tokens: int
    retired: Mapping[str, int]  # workers that lost the request before → their cut-off
    # With n > 1 choices: each choice's tokens the client has (all segments), and the
    # choices that already finished (the next segment does not run them again).
    choice_tokens: Mapping[int, Sequence[int]] | None = None
    finished_choices: Sequence[int] = ()
    worker_region: str = ""  # where the current worker runs (its lost segment is billed there)


@dataclass(frozen=True, slots=True)
class Stay:
    waited_s: float  # how long the request has waited for its first output


@dataclass(frozen=True, slots=True)
class GiveUp:
    message: str
    retire: str  # the worker that lost the request
    lost_usage: UsageEvent  # its segment, which it will never report (dedup id as a migration's)
    lost_usage_id: str


@dataclass(frozen=True, slots=True)
class Migrate:
    why: str
    retire: str  # the worker that lost the request
    cutoff: int  # its chunks from this seq on are void; the next segment starts here
    lost_usage: UsageEvent  # the lost worker's segment, billed by the gateway
    lost_usage_id: str  # USAGE's dedup id of that event
    generate: GenerateRequest  # the next segment
    exclude_workers: list[str]  # every worker that lost it so far


def lost_segment_usage(segment: Segment, now: float) -> UsageEvent:
    """The usage event of a segment its worker will never report: the tokens it streamed,
    and on the first segment the prompt and admission's reservation (``segment_usage``)."""
    generate = segment.generate
    first = generate.migrations == 0
    billed = segment_usage(Usage(prompt_tokens=segment.prompt_tokens, completion_tokens=segment.segment_tokens),
                           generate.migrations)
    return UsageEvent(
        request_id=generate.request_id, org=generate.org, key_id=generate.key_id, **usage_model(generate),
        worker_id=segment.worker_id, tier=generate.tier, prompt_tokens=billed.prompt_tokens,
        completion_tokens=billed.completion_tokens, status="migrated", arrival_time=generate.arrival_time,
        finish_time=now, reserved_tokens=generate.reserved_tokens if first else 0, migrations=generate.migrations,
        error="worker lost; request migrated", user=generate.user, metadata=generate.metadata,
        region=segment.worker_region,
    )


def plan_migration(
    segment: Segment, limits: MigrationLimits, *, worker_registered: bool, silent_s: float,
    probe: RequestProbeReply | None, now: float,
) -> Stay | GiveUp | Migrate:
    """The verdict on a request whose worker is gone (``worker_registered`` False) or that has
    been silent for ``silent_s`` (at least the stall timeout) and whose worker answered the
    probe with ``probe`` (None: no answer)."""
    if not worker_registered:
        why = f"worker {segment.worker_id} is gone (its connection closed or its heartbeat expired)"
    elif queued_on_live_worker(probe, limits.stall_timeout_s):
        assert probe is not None
        return Stay(waited_s=probe.since_output_s)
    else:
        why = f"worker {segment.worker_id} stalled: no tokens for {silent_s:.0f}s"
    moved = segment.generate.migrations
    if moved >= limits.max_migrations:
        message = f"{why}; not migrated again (limit {limits.max_migrations})"
        lost = msgspec.structs.replace(lost_segment_usage(segment, now), status="failed", error=message[:500])
        return GiveUp(message, segment.worker_id, lost, usage_dedup_id(segment.generate.request_id, moved))
    cutoff = segment.next_seq
    if segment.generate.sampling.n > 1:
        tokens = segment.choice_tokens or {}
        next_segment = msgspec.structs.replace(
            segment.generate, prior_outputs=[pack_tokens(tokens.get(i, [])) for i in range(segment.generate.sampling.n)],
            finished_choices=sorted(segment.finished_choices), first_seq=cutoff, migrations=moved + 1,
        )
    else:
        next_segment = msgspec.structs.replace(
            segment.generate, prior_output=pack_tokens(segment.received_tokens), first_seq=cutoff, migrations=moved + 1,
        )
    return Migrate(
        why=why,
        retire=segment.worker_id,
        cutoff=cutoff,
        lost_usage=lost_segment_usage(segment, now),
        lost_usage_id=usage_dedup_id(segment.generate.request_id, moved),
        generate=next_segment,
        exclude_workers=[*(w for w in segment.retired if w != segment.worker_id), segment.worker_id],
    )
