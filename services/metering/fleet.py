"""What the fleet cost beside what it served (pure, no I/O): capacity events into ledger
rows, priced; the two SQL queries of the fleet report (accelerator time from
``capacity_periods``, usage from ``usage_events``, both backends); and their fold into
``FleetRow``s.

A capacity event (``proto.CapacityEvent``) is one period of one worker. It becomes one
row per model that held a share of the worker's accelerators in it (a dedicated worker:
one row; a hot-swap host's model: one row each, plus the host's unallocated share under
model ""), keyed ``<event_id>/<model>`` so a redelivered event counts once. A row's cost
is its accelerator seconds at the accelerator's hourly price, fixed when it is written
(as a usage event's spend is). Its time (``ts``) is the period's end.

The report matches usage to accelerators through the worker that served it: each
worker's rows name its accelerator. Usage is counted under its pool's model (an
adapter's under its base model: the adapter runs on its base's replicas); usage no
worker served (refused, failed before placement) has no accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

from proto.messages import MAX_ACCELERATORS, CapacityEvent
from proto.metering import FleetRow

from .ledger_rows import MAX_ID_CHARS, InvalidEvent, TotalsSql
from .prices import PriceTable, hourly_cost_nano

MAX_PERIOD_S = 7 * 86400.0  # a worker reports every minute or so; a week-long period is a broken clock
MAX_COST_NANO = 1 << 62  # a row's cost; past it the price or the event is absurd (and SQL's int64 near)
_SLACK = 1.001  # shares integrated in floating point may pass the period by a hair


@dataclass(frozen=True, slots=True)
class CapacityEntry:
    """One ledger row of ``capacity_periods``."""

    entry_id: str  # "<event_id>/<model>"
    event_id: str
    worker_id: str
    host_id: str
    model: str  # "" for a host's unallocated share
    engine: str
    accelerator: str
    accelerators: int
    start: float
    ts: float  # the period's end: ranges and buckets select on it
    replica_s: float  # the period, on the worker's own model's row; 0 on the others
    busy_s: float
    accelerator_s: float
    price_per_hour_nano: int
    priced: int  # 1: the accelerator has a price (maybe 0); 0: none, cost 0
    cost_nano: int
    schema_v: int
    recorded_at: float
    stream_seq: int


CAPACITY_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(CapacityEntry))
CAPACITY_INT_COLUMNS = frozenset(("accelerators", "price_per_hour_nano", "priced", "cost_nano", "schema_v",
                                  "stream_seq"))
CAPACITY_FLOAT_COLUMNS = frozenset(("start", "ts", "replica_s", "busy_s", "accelerator_s", "recorded_at"))
CAPACITY_TABLE = "capacity_periods"
CAPACITY_INDEXES = (f"CREATE INDEX IF NOT EXISTS {CAPACITY_TABLE}_ts ON {CAPACITY_TABLE} (ts)",)


def capacity_row(entry: CapacityEntry) -> tuple[Any, ...]:
    return astuple(entry)


def _text(value: str, what: str) -> str:
    value = value.replace("\x00", "")  # PostgreSQL text cannot hold NUL: both backends agree
    if len(value) > MAX_ID_CHARS:
        raise InvalidEvent(f"{what} longer than {MAX_ID_CHARS} characters")
    return value


def capacity_entries(event: CapacityEvent, prices: PriceTable, *, recorded_at: float,
                     stream_seq: int = 0) -> list[CapacityEntry]:
    """Validate a capacity event and price it, a row per model. Raises ``InvalidEvent``."""
    if not event.event_id or not event.worker_id:
        raise InvalidEvent("capacity event without event_id or worker_id")
    if not (math.isfinite(event.start) and math.isfinite(event.end) and 0 < event.start <= event.end):
        raise InvalidEvent(f"capacity period {event.start}..{event.end} is not a time range")
    period = event.end - event.start
    if period > MAX_PERIOD_S:
        raise InvalidEvent(f"capacity period of {period:.0f} s is longer than {MAX_PERIOD_S:.0f} s")
    if not 0 <= event.accelerators <= MAX_ACCELERATORS:
        raise InvalidEvent(f"accelerators={event.accelerators} out of range")
    if not (math.isfinite(event.busy_s) and 0 <= event.busy_s <= period * _SLACK):
        raise InvalidEvent(f"busy_s={event.busy_s} outside the period of {period} s")
    for model, held in event.held_s.items():
        if not (math.isfinite(held) and 0 <= held <= period * _SLACK):
            raise InvalidEvent(f"held_s[{model!r}]={held} outside the period of {period} s")
    if sum(event.held_s.values()) > period * _SLACK:
        raise InvalidEvent("held_s adds up to more than the period: the accelerators would be counted twice")
    per_hour = prices.accelerator_price(event.accelerator)
    held_s = dict(event.held_s)
    held_s.setdefault(event.model, 0.0)  # the worker's own row carries its replica and busy time
    entries = []
    for model, held in sorted(held_s.items()):
        own = model == event.model
        accelerator_s = held * event.accelerators
        cost = hourly_cost_nano(per_hour, accelerator_s) if per_hour else 0
        if cost >= MAX_COST_NANO:
            raise InvalidEvent(f"a cost of {cost} nano units for {accelerator_s:.0f} accelerator seconds: "
                               "the price or the period is not real")
        entries.append(CapacityEntry(
            entry_id=_text(f"{event.event_id}/{model}", "capacity entry id"),
            event_id=_text(event.event_id, "event_id"),
            worker_id=_text(event.worker_id, "worker_id"),
            host_id=_text(event.host_id, "host_id"),
            model=_text(model, "model"),
            engine=_text(event.engine, "engine"),
            accelerator=_text(event.accelerator, "accelerator"),
            accelerators=event.accelerators,
            start=event.start,
            ts=event.end,
            replica_s=period if own else 0.0,
            busy_s=min(event.busy_s, period) if own else 0.0,
            accelerator_s=accelerator_s,
            price_per_hour_nano=per_hour or 0,
            priced=int(per_hour is not None),
            cost_nano=cost,
            schema_v=event.v,
            recorded_at=recorded_at,
            stream_seq=stream_seq,
        ))
    return entries


# ---- the report's queries ------------------------------------------------------------------
_BUCKET_SECONDS = {"hour": 3600, "day": 86400}
# The usage side's pool: an adapter's requests run on (and are costed with) its base model.
_USAGE_POOL = "CASE WHEN base_model <> '' THEN base_model ELSE model END"


def _where(model_expr: str, model: str | None, since: float | None, until: float | None,
           placeholder: Callable[[int], str]) -> tuple[str, list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    for column, op, value in ((model_expr, "=", model), ("ts", ">=", since), ("ts", "<", until)):
        if value is not None:
            params.append(value)
            where.append(f"{column} {op} {placeholder(len(params))}")
    return (" WHERE " + " AND ".join(where)) if where else "", params


def _bucket(group_by: Sequence[str], bucket_expr: Callable[[int], str]) -> tuple[str, str]:
    """The bucket's SELECT expression, and what GROUP BY adds for it (a constant 0 would be
    read as a column's position there)."""
    for name in group_by:
        if name in _BUCKET_SECONDS:
            expr = bucket_expr(_BUCKET_SECONDS[name])
            return expr, f", {expr}"
    return "0", ""


def capacity_sql(*, model: str | None, since: float | None, until: float | None, group_by: Sequence[str],
                 placeholder: Callable[[int], str], bucket_expr: Callable[[int], str]) -> TotalsSql:
    """Per (model, worker, accelerator, bucket): replica, busy and accelerator seconds, cost,
    and the accelerator seconds without a price. Always this fine; ``fold_fleet`` coarsens."""
    bucket, grouped = _bucket(group_by, bucket_expr)
    where, params = _where("model", model, since, until, placeholder)
    sql = (f"SELECT model, worker_id, accelerator, {bucket}, SUM(replica_s), SUM(busy_s), SUM(accelerator_s), "
           f"SUM(cost_nano), SUM(CASE WHEN priced = 0 THEN accelerator_s ELSE 0 END) FROM {CAPACITY_TABLE}{where} "
           f"GROUP BY model, worker_id, accelerator{grouped}")
    return TotalsSql(sql, params)


def usage_sql(*, model: str | None, since: float | None, until: float | None, group_by: Sequence[str],
              placeholder: Callable[[int], str], bucket_expr: Callable[[int], str]) -> TotalsSql:
    """Per (pool model, worker, bucket): requests (each once), tokens, spend."""
    bucket, grouped = _bucket(group_by, bucket_expr)
    where, params = _where(_USAGE_POOL, model, since, until, placeholder)
    sql = (f"SELECT {_USAGE_POOL}, worker_id, {bucket}, SUM(CASE WHEN migrations = 0 THEN 1 ELSE 0 END), "
           f"SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(spend_nano) FROM usage_events{where} "
           f"GROUP BY {_USAGE_POOL}, worker_id{grouped}")
    return TotalsSql(sql, params)


def fold_fleet(capacity: Sequence[Sequence[Any]], usage: Sequence[Sequence[Any]],
               group_by: Sequence[str]) -> list[FleetRow]:
    """The two queries' records into one ``FleetRow`` per group of ``group_by``."""
    timed = any(name in _BUCKET_SECONDS for name in group_by)
    accelerator_of: dict[str, str] = {}
    groups: dict[tuple[Any, ...], FleetRow] = {}

    def row_for(model: str, worker: str, accelerator: str, bucket: float) -> FleetRow:
        parts = {"model": model, "worker": worker, "accelerator": accelerator, "hour": bucket, "day": bucket}
        key = tuple(parts[name] for name in group_by)
        row = groups.get(key)
        if row is None:
            row = groups[key] = FleetRow(
                model=model if "model" in group_by else None,
                accelerator=accelerator if "accelerator" in group_by else None,
                worker_id=worker if "worker" in group_by else None,
                bucket=bucket if timed else None)
        return row

    for model, worker, accelerator, bucket, replica_s, busy_s, accelerator_s, cost, unpriced in capacity:
        accelerator_of.setdefault(worker, accelerator)
        row = row_for(model, worker, accelerator, float(bucket))
        row.replica_s += float(replica_s or 0)
        row.busy_s += float(busy_s or 0)
        row.accelerator_s += float(accelerator_s or 0)
        row.cost_nano += int(cost or 0)
        row.unpriced_accelerator_s += float(unpriced or 0)
    for model, worker, bucket, requests, prompt, cached, completion, spend in usage:
        row = row_for(model, worker, accelerator_of.get(worker, ""), float(bucket))
        row.requests += int(requests or 0)
        row.prompt_tokens += int(prompt or 0)
        row.cached_tokens += int(cached or 0)
        row.completion_tokens += int(completion or 0)
        row.spend_nano += int(spend or 0)
    return [groups[k] for k in sorted(groups, key=lambda k: tuple((v is None, v) for v in k))]
