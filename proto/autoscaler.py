"""The autoscaler's status messages (``mesh.autoscaler.status``, request-reply).

``meshserve status`` sends an ``AutoscalerStatusRequest`` and prints the
``AutoscalerStatus`` it gets back: per pool the replica counts, the signals the control
law used on its last tick, the worker table it saw, and its recent decisions with their
reasons; plus the driver's health. Decode with ``proto.codec.decode``.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from .messages import SCHEMA_VERSION

DecisionAction = Literal["scale_up", "scale_down", "hold"]


class AutoscalerStatusRequest(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    pool: str = ""  # empty: every pool
    decisions: int = 10  # how many recent decisions per pool to return (newest last)


class PoolSignals(Struct, kw_only=True, omit_defaults=True):
    """The control law's inputs and intermediate figures at one tick (control.Signals)."""

    waiting_tokens: int = 0
    running_tokens: int = 0
    pending_requests: int = 0
    replica_token_capacity: float = 0.0
    capacity_source: str = ""
    target_utilization: float = 0.0
    needed: int = 0
    warm_buffer: int = 0
    floor: int = 0
    scheduled_min: int = 0
    max_replicas: int = 0
    window_max: int = 0
    cooldown_remaining_s: float = 0.0
    idle_s: float = 0.0
    starting: int = 0
    draining: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    queue_drain_s: float | None = None
    prefill_demand_tokens_per_s: float | None = None  # prompt tokens arriving a second (smoothed)
    needed_prefill: int = 0  # replicas prefill compute needs (the law takes the larger of this and needed)


class DecisionRecord(Struct, kw_only=True, omit_defaults=True):
    at: float  # epoch seconds
    action: DecisionAction
    current: int
    ready: int
    desired: int
    target: int
    count: int = 0
    drain_worker: str | None = None
    cold_start: bool = False
    reason: str = ""
    outcome: str = ""  # what acting on it did: "started 2", "drain sent (3 in flight)", a driver error


class WorkerView(Struct, kw_only=True, omit_defaults=True):
    """One worker as the autoscaler sees it (registry entry plus its latest gauge)."""

    worker_id: str
    state: str
    running: int = 0
    waiting: int = 0
    running_tokens: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    gauge_age_s: float | None = None  # None: no gauge yet
    managed: bool = False  # started by this autoscaler's driver
    region: str = ""  # WorkerInfo.region (DESIGN.md, Regions)


class DrainView(Struct, kw_only=True, omit_defaults=True):
    worker_id: str
    issued_at: float
    deadline: float  # forced stop after this (drain timeout plus grace)
    in_flight: int = 0  # what the worker reported when it accepted the drain
    acknowledged: bool = False


class PoolStatus(Struct, kw_only=True, omit_defaults=True):
    pool: str
    min_replicas: int
    max_replicas: int
    current: int = 0  # ready + starting (draining ones are leaving)
    desired: int = 0
    ready: int = 0
    starting: int = 0
    draining: int = 0
    pending_requests: int = 0
    signals: PoolSignals | None = None
    last_reason: str = ""
    workers: list[WorkerView] = []
    drains: list[DrainView] = []
    decisions: list[DecisionRecord] = []


class DriverInfo(Struct, kw_only=True, omit_defaults=True):
    name: str
    ok: bool
    message: str = ""
    errors: dict[str, int] = {}  # reason → count since start
    last_error: str = ""
    last_error_at: float = 0.0


class AutoscalerStatus(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    instance_id: str
    at: float
    tick_s: float
    driver: DriverInfo
    pools: list[PoolStatus] = []


__all__ = [
    "AutoscalerStatus",
    "AutoscalerStatusRequest",
    "DecisionRecord",
    "DrainView",
    "DriverInfo",
    "PoolSignals",
    "PoolStatus",
    "WorkerView",
]
