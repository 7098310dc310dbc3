"""Where admission keeps its leadership: the lease bucket (``<root>_admission``, entries
live one lease TTL, in memory) and the limiter checkpoint (``<root>_admission_state``, on
file), and what can be asked of them. Why one leader, and how the lease is taken, renewed
and handed over: the service's docstring (``service.py``)."""

from __future__ import annotations

import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from bus.provision import ensure_kv
from proto.subjects import Subjects

from .buckets import LimiterState

LEASE_KEY = "leader"
STATE_KEY = "limiter"

# A lease bucket made this long after the state bucket was made again (a NATS restart).
LEASE_REMADE_AFTER_S = 1.0


def lease_bucket_name(subjects: Subjects) -> str:
    return f"{subjects.root}_admission"


def state_bucket_name(subjects: Subjects) -> str:
    return f"{subjects.root}_admission_state"


async def admission_buckets(
    js: JetStreamContext, subjects: Subjects, *, lease_ttl_s: float, replicas: int = 1
) -> tuple[KeyValue, KeyValue]:
    """The lease bucket (entries expire after the lease TTL) and the checkpoint bucket."""
    lease = await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=lease_bucket_name(subjects),
            description="meshserve admission leader lease",
            history=1,
            ttl=lease_ttl_s,
            storage=api.StorageType.MEMORY,  # a lease is worth nothing after a restart
            replicas=replicas,
        ),
    )
    state = await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=state_bucket_name(subjects),
            description="meshserve admission limiter checkpoint (for the next leader)",
            history=1,
            storage=api.StorageType.FILE,
            replicas=replicas,
        ),
    )
    return lease, state


class Checkpoint(msgspec.Struct, kw_only=True):
    """The leader's hand-over record in ``<root>_admission_state``."""

    v: int = 1
    instance_id: str
    usage_seq: int  # every USAGE event up to this stream sequence is in ``limiter``
    limiter: LimiterState


async def lease_bucket_young(js: JetStreamContext, subjects: Subjects, lease_ttl_s: float) -> float:
    """Seconds until the lease bucket is one lease TTL old, where it was made again after
    the state bucket (0: older, made with it at the mesh's start, or unknown). The lease
    is in memory, the checkpoints on file: a NATS restart loses only the lease bucket."""
    try:
        lease = await js.stream_info(f"KV_{lease_bucket_name(subjects)}")
        state = await js.stream_info(f"KV_{state_bucket_name(subjects)}")
    except (nats.errors.Error, TimeoutError):
        return 0.0  # the create that follows says what is wrong
    if lease.created is None or state.created is None:
        return 0.0
    made = lease.created.timestamp()
    if made - state.created.timestamp() < LEASE_REMADE_AFTER_S:
        return 0.0  # both made at the mesh's start: no leader before
    # Against the server's timestamps, so the host's real clock (not the quota clock,
    # which tests freeze); hosts and servers agree to well within a TTL (NTP).
    return max(0.0, lease_ttl_s - (time.time() - made))


async def missing_buckets(js: JetStreamContext, buckets: tuple[str, ...]) -> list[str]:
    """Those of ``buckets`` JetStream does not have (a single nats-server restarted: memory
    storage does not survive it)."""
    missing = []
    for bucket in buckets:
        try:
            await js.stream_info(f"KV_{bucket}")
        except nats.js.errors.NotFoundError:
            missing.append(bucket)
    return missing
