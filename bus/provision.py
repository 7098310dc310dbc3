"""Idempotent provisioning of meshserve's JetStream streams and KV buckets.

Any service may call ``provision`` at start-up: creating what is missing, updating a
stream whose limits changed, and leaving the rest alone, so start order never matters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from proto.subjects import Subjects

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Documented bounds of meshserve's streams (operators tune them per fleet)."""

    # TOKENS only needs to outlive a stream plus a client's reconnect-and-resume.
    tokens_max_age_s: float = 15 * 60
    tokens_max_bytes: int = 512 << 20
    tokens_duplicate_window_s: float = 2 * 60
    # USAGE holds events until metering commits them; a ledger outage up to max_age loses nothing.
    usage_max_age_s: float = 7 * 24 * 3600
    usage_max_bytes: int = 1 << 30
    usage_duplicate_window_s: float = 24 * 3600  # dedup by request id across a day of retries
    # CAPACITY: workers' capacity events, a period a minute each (~250 B): 256 MiB is a
    # week of 100 workers; beyond, the oldest (long since recorded) go first.
    capacity_max_age_s: float = 7 * 24 * 3600
    capacity_max_bytes: int = 256 << 20
    capacity_duplicate_window_s: float = 2 * 3600
    workers_ttl_s: float = 10.0  # a worker heartbeats every ttl/4; an expired entry means gone
    keys_history: int = 5


def tokens_stream_config(subjects: Subjects, limits: StreamLimits, replicas: int) -> api.StreamConfig:
    return api.StreamConfig(
        name=subjects.tokens_stream,
        description="meshserve token chunks, worker → gateway, replayable for resume",
        subjects=[subjects.tokens_all],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=limits.tokens_max_age_s,
        max_bytes=limits.tokens_max_bytes,
        duplicate_window=min(limits.tokens_duplicate_window_s, limits.tokens_max_age_s),
        discard=api.DiscardPolicy.OLD,
        num_replicas=replicas,
    )


def usage_stream_config(subjects: Subjects, limits: StreamLimits, replicas: int) -> api.StreamConfig:
    return api.StreamConfig(
        name=subjects.usage_stream,
        description="meshserve usage events, one per request, de-duplicated by request id",
        subjects=[subjects.usage_all],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=limits.usage_max_age_s,
        max_bytes=limits.usage_max_bytes,
        duplicate_window=min(limits.usage_duplicate_window_s, limits.usage_max_age_s),  # the server requires window <= age
        # Refuse new events rather than silently dropping unbilled old ones.
        discard=api.DiscardPolicy.NEW,
        num_replicas=replicas,
    )


def capacity_stream_config(subjects: Subjects, limits: StreamLimits, replicas: int) -> api.StreamConfig:
    return api.StreamConfig(
        name=subjects.capacity_stream,
        description="meshserve capacity events: each worker's accelerator time, a period at a time",
        subjects=[subjects.capacity_all],
        # Limits, not a work queue: events metering could not record stay to be replayed (a
        # work queue deletes what is terminated), and others may read it (nats stream view).
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=limits.capacity_max_age_s,
        max_bytes=limits.capacity_max_bytes,
        duplicate_window=min(limits.capacity_duplicate_window_s, limits.capacity_max_age_s),
        # Full, it drops its oldest events (recorded within seconds while metering runs), never
        # the workers' new ones: a period is cost data, not a bill, and the stream fills
        # with the fleet's size, not with an outage.
        discard=api.DiscardPolicy.OLD,
        num_replicas=replicas,
    )


async def ensure_stream(js: JetStreamContext, config: api.StreamConfig) -> api.StreamInfo:
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        log.info("creating stream %s", config.name)
        return await js.add_stream(config)
    current = info.config
    if config.retention is not None and current.retention != config.retention:
        # The server refuses to change a stream's retention: updating would fail every start.
        log.error("stream %s has retention %s where meshserve wants %s: its limits are left as they are; "
                  "delete it (nats stream rm %s) for meshserve to make it again", config.name, current.retention,
                  config.retention, config.name)
        return info
    wanted = (config.subjects, config.max_age, config.max_bytes, config.duplicate_window, config.num_replicas)
    have = (current.subjects, current.max_age, current.max_bytes, current.duplicate_window, current.num_replicas)
    if wanted != have:
        log.info("updating stream %s limits", config.name)
        return await js.update_stream(config)
    return info


async def ensure_kv(js: JetStreamContext, config: api.KeyValueConfig) -> KeyValue:
    try:
        kv = await js.key_value(config.bucket)
    except BucketNotFoundError:
        log.info("creating KV bucket %s", config.bucket)
        return await js.create_key_value(config)
    # A bucket made earlier at another replication factor (e.g. by a tool run without
    # MESHSERVE_JS_REPLICAS) is brought to the configured one, data kept.
    stream = f"KV_{config.bucket}"
    info = await js.stream_info(stream)
    if info.config.num_replicas != config.replicas:
        log.info("updating KV bucket %s to %d replicas", config.bucket, config.replicas)
        info.config.num_replicas = config.replicas
        await js.update_stream(info.config)
    return kv


async def provision(
    js: JetStreamContext, subjects: Subjects, *, replicas: int = 1, limits: StreamLimits | None = None
) -> None:
    limits = limits or StreamLimits()
    await ensure_stream(js, tokens_stream_config(subjects, limits, replicas))
    await ensure_stream(js, usage_stream_config(subjects, limits, replicas))
    await ensure_stream(js, capacity_stream_config(subjects, limits, replicas))
    await workers_bucket(js, subjects, replicas=replicas, limits=limits)
    await keys_bucket(js, subjects, replicas=replicas, limits=limits)
    await adapters_bucket(js, subjects, replicas=replicas, limits=limits)
    await requests_bucket(js, subjects, replicas=replicas, limits=limits)


async def workers_bucket(
    js: JetStreamContext, subjects: Subjects, *, replicas: int = 1, limits: StreamLimits | None = None
) -> KeyValue:
    limits = limits or StreamLimits()
    return await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=subjects.workers_bucket,
            description="meshserve worker registry (heartbeat with TTL)",
            history=1,
            ttl=limits.workers_ttl_s,
            # Expiry leaves a delete marker, so watchers learn a worker is gone.
            limit_marker_ttl=limits.workers_ttl_s,
            storage=api.StorageType.MEMORY,
            replicas=replicas,
        ),
    )


async def keys_bucket(
    js: JetStreamContext, subjects: Subjects, *, replicas: int = 1, limits: StreamLimits | None = None
) -> KeyValue:
    limits = limits or StreamLimits()
    return await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=subjects.keys_bucket,
            description="meshserve API keys (SHA-256 hashes only), org, tier, limits",
            history=limits.keys_history,
            storage=api.StorageType.FILE,
            replicas=replicas,
        ),
    )


async def adapters_bucket(
    js: JetStreamContext, subjects: Subjects, *, replicas: int = 1, limits: StreamLimits | None = None
) -> KeyValue:
    return await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=subjects.adapters_bucket,
            description="meshserve LoRA adapters: name → base model, path, rank, size",
            history=1,
            storage=api.StorageType.FILE,
            replicas=replicas,
        ),
    )


async def requests_bucket(
    js: JetStreamContext, subjects: Subjects, *, replicas: int = 1, limits: StreamLimits | None = None
) -> KeyValue:
    """Resumable requests: lives as long as their tokens do in TOKENS."""
    limits = limits or StreamLimits()
    return await ensure_kv(
        js,
        api.KeyValueConfig(
            bucket=subjects.requests_bucket,
            description="meshserve requests in flight: owner key and token subject, for resume",
            history=1,
            ttl=limits.tokens_max_age_s,
            storage=api.StorageType.FILE,
            replicas=replicas,
        ),
    )
