"""The ledger's rows, pure: what one row holds (``LedgerEntry``, validated and priced from
a usage event by ``entry_from_event``), its columns in every schema version, and the
totals query both backends run (``totals_sql``, folded by ``fold_totals``). The storage
(``Ledger``, SQLite and PostgreSQL) is :mod:`.ledger`, whose module doc tells the whole
story; import these names from there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from proto.messages import UsageEvent, usage_dedup_id
from proto.metering import UsageRow

from .prices import PriceTable

SCHEMA_VERSION = 5  # 2: end_user, metadata; 3: base_model; 4: the capacity_periods table (fleet cost); 5: region
MAX_TOKENS = 1 << 32  # per event; beyond any context window, and keeps SUM() far from int64 overflow
MAX_ID_CHARS = 1024
MAX_ERROR_CHARS = 4096
# OpenAI's limits on a request's ``metadata``; the gateway refuses more, so more is a bad producer.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class InvalidEvent(ValueError):
    """A decodable usage event that must not be billed (negative tokens, no request id...)."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One ledger row: every UsageEvent field, the event time, the charge and provenance."""

    usage_id: str
    request_id: str
    org: str
    key_id: str
    model: str
    worker_id: str
    tier: str
    status: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reserved_tokens: int
    migrations: int
    arrival_time: float
    first_token_time: float
    finish_time: float
    error: str
    schema_v: int
    ts: float  # the event's time for ranges: finish, else arrival, else recorded_at
    recorded_at: float
    stream_seq: int  # USAGE stream sequence, to find the event in the stream again
    price_input_nano: int  # the prices it was charged at (nano per million tokens)
    price_cached_nano: int
    price_output_nano: int
    spend_nano: int
    # Schema 2. Last, as ALTER TABLE appends them: a migrated table and a new one agree.
    user: str  # OpenAI's ``user`` / ``safety_identifier``; column ``end_user`` (``user`` is reserved in SQL)
    metadata: dict[str, str]  # the request's ``metadata``; column ``metadata``, JSON text
    # Schema 3.
    base_model: str  # an adapter's base model ("" for a base model's own requests)
    # Schema 5.
    region: str  # where it ran (UsageEvent.region; "" outside a multi-region mesh)


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LedgerEntry))
_COLUMN_OF_FIELD = {"user": "end_user"}
COLUMNS: tuple[str, ...] = tuple(_COLUMN_OF_FIELD.get(name, name) for name in FIELDS)  # in FIELDS' order
_METADATA_INDEX = FIELDS.index("metadata")
INT_COLUMNS = frozenset(
    ("prompt_tokens", "cached_tokens", "completion_tokens", "reserved_tokens", "migrations", "schema_v", "stream_seq",
     "price_input_nano", "price_cached_nano", "price_output_nano", "spend_nano")
)
FLOAT_COLUMNS = frozenset(("arrival_time", "first_token_time", "finish_time", "ts", "recorded_at"))


# The columns each schema version added. ALTER TABLE appends them, so they come last, in
# this order, in LedgerEntry too: a migrated table and a new one agree.
ADDED_COLUMNS: dict[int, tuple[str, ...]] = {2: ("end_user", "metadata"), 3: ("base_model",), 4: (), 5: ("region",)}
COLUMN_DEFAULTS = {"end_user": "''", "metadata": "'{}'", "base_model": "''", "region": "''"}  # what the rows of an older version get


def columns_at(version: int) -> tuple[str, ...]:
    """The columns of a ledger of schema ``version``, in order."""
    later = {name for v, added in ADDED_COLUMNS.items() if v > version for name in added}
    return tuple(name for name in COLUMNS if name not in later)


def _text(value: str, what: str, limit: int = MAX_ID_CHARS) -> str:
    # PostgreSQL text cannot hold NUL; strip it in both backends so they agree.
    value = value.replace("\x00", "")
    if len(value) > limit:
        raise InvalidEvent(f"{what} longer than {limit} characters")
    return value


def _metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidEvent(f"metadata has {len(metadata)} keys, more than {MAX_METADATA_KEYS}")
    clean = {_text(k, "metadata key", MAX_METADATA_KEY_CHARS): _text(v, "metadata value", MAX_METADATA_VALUE_CHARS)
             for k, v in metadata.items()}
    if len(clean) != len(metadata):  # keys differing only by NUL: keeping either would drop the other silently
        raise InvalidEvent("metadata keys collide once NUL characters are removed")
    return clean


def entry_row(entry: LedgerEntry) -> tuple[Any, ...]:
    """The row for ``COLUMNS``: the entry's values, metadata as JSON text."""
    row = [getattr(entry, name) for name in FIELDS]
    row[_METADATA_INDEX] = json.dumps(entry.metadata, ensure_ascii=False, separators=(",", ":"))
    return tuple(row)


def entry_from_row(row: Sequence[Any]) -> LedgerEntry:
    """The inverse of ``entry_row``: a row selected as ``COLUMNS`` back into an entry."""
    values = list(row)
    values[_METADATA_INDEX] = json.loads(values[_METADATA_INDEX])
    return LedgerEntry(**dict(zip(FIELDS, values, strict=True)))


def _time(value: float) -> float:
    # SQLite stores NaN as NULL; a non-finite time is no time.
    return value if math.isfinite(value) else 0.0


def entry_from_event(event: UsageEvent, prices: PriceTable, *, recorded_at: float, stream_seq: int = 0) -> LedgerEntry:
    """Validate an event and price it. Raises ``InvalidEvent``."""
    if not event.request_id:
        raise InvalidEvent("usage event without request_id")
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "reserved_tokens"):
        value = getattr(event, name)
        if not 0 <= value <= MAX_TOKENS:
            raise InvalidEvent(f"{name}={value} out of range")
    if not 0 <= event.migrations <= 1_000_000:
        raise InvalidEvent(f"migrations={event.migrations} out of range")
    charge = prices.charge(event.model, event.status, event.prompt_tokens, event.cached_tokens, event.completion_tokens,
                           event.base_model)
    finish, arrival = _time(event.finish_time), _time(event.arrival_time)
    return LedgerEntry(
        usage_id=_text(usage_dedup_id(event.request_id, event.migrations), "usage id", MAX_ID_CHARS + 16),
        request_id=_text(event.request_id, "request_id"),
        org=_text(event.org, "org"),
        key_id=_text(event.key_id, "key_id"),
        model=_text(event.model, "model"),
        worker_id=_text(event.worker_id, "worker_id"),
        tier=_text(event.tier, "tier"),
        status=_text(event.status, "status"),
        prompt_tokens=event.prompt_tokens,
        cached_tokens=event.cached_tokens,
        completion_tokens=event.completion_tokens,
        reserved_tokens=event.reserved_tokens,
        migrations=event.migrations,
        arrival_time=arrival,
        first_token_time=_time(event.first_token_time),
        finish_time=finish,
        error=event.error.replace("\x00", "")[:MAX_ERROR_CHARS],
        schema_v=event.v,
        ts=finish if finish > 0 else arrival if arrival > 0 else recorded_at,
        recorded_at=recorded_at,
        stream_seq=stream_seq,
        price_input_nano=charge.price.input_nano,
        price_cached_nano=charge.price.cached_input_nano,
        price_output_nano=charge.price.output_nano,
        spend_nano=charge.spend_nano,
        user=_text(event.user, "user"),
        metadata=_metadata(event.metadata),
        base_model=_text(event.base_model, "base_model"),
        region=_text(event.region, "region"),
    )


# ---- totals: one SQL shape for both backends --------------------------------------------
_DIMENSION_COLUMNS = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
                      "status": "status", "region": "region"}
_BUCKET_SECONDS = {"hour": 3600, "day": 86400}
_ROW_FIELD = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
              "status": "status", "region": "region", "hour": "bucket", "day": "bucket"}


@dataclass(frozen=True, slots=True)
class TotalsSql:
    sql: str
    params: list[Any]


def totals_sql(
    *,
    org: str | None,
    key_id: str | None,
    model: str | None,
    since: float | None,
    until: float | None,
    group_by: Sequence[str],
    placeholder: Any,
    bucket_expr: Any,
) -> TotalsSql:
    """``SELECT dims..., status, sums GROUP BY dims, status``; statuses fold into rows later.

    Dimension names are whitelisted (never interpolated from the caller); values are
    bound parameters. ``placeholder(i)`` spells the i-th parameter (``?`` / ``$i``),
    ``bucket_expr(seconds)`` the start of a time bucket.
    """
    exprs: list[str] = []
    for name in group_by:
        if name in _DIMENSION_COLUMNS:
            exprs.append(_DIMENSION_COLUMNS[name])
        elif name in _BUCKET_SECONDS:
            exprs.append(bucket_expr(_BUCKET_SECONDS[name]))
        else:
            raise ValueError(f"unknown group_by {name!r}")
    where: list[str] = []
    params: list[Any] = []
    for column, op, value in (("org", "=", org), ("key_id", "=", key_id), ("model", "=", model),
                              ("ts", ">=", since), ("ts", "<", until)):
        if value is not None:
            params.append(value)
            where.append(f"{column} {op} {placeholder(len(params))}")
    # A migrated request has a row per segment: it counts once, by its first segment's row.
    select = [*exprs, "status", "COUNT(*)", "SUM(CASE WHEN migrations = 0 THEN 1 ELSE 0 END)", "SUM(prompt_tokens)", "SUM(cached_tokens)", "SUM(completion_tokens)",
              "SUM(spend_nano)", "MIN(ts)", "MAX(ts)"]
    sql = f"SELECT {', '.join(select)} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " GROUP BY " + ", ".join([*exprs, "status"])
    return TotalsSql(sql, params)


def fold_totals(records: Sequence[Sequence[Any]], group_by: Sequence[str]) -> list[UsageRow]:
    """Rows of (dims..., status, rows, requests, sums..., min ts, max ts) → one UsageRow per
    group: ``requests`` counts each request once, ``by_status`` counts rows (a migrated
    request's first segment under ``migrated``)."""
    n = len(group_by)
    groups: dict[tuple[Any, ...], UsageRow] = {}
    for record in records:
        dims = tuple(float(v) if group_by[i] in _BUCKET_SECONDS else v for i, v in enumerate(record[:n]))
        status, count, requests, prompt, cached, completion, spend, first, last = record[n:]
        row = groups.get(dims)
        if row is None:
            row = UsageRow(by_status={}, first_at=float(first), last_at=float(last))
            for i, name in enumerate(group_by):
                setattr(row, _ROW_FIELD[name], dims[i])
            groups[dims] = row
        row.requests += int(requests or 0)
        row.prompt_tokens += int(prompt or 0)
        row.cached_tokens += int(cached or 0)
        row.completion_tokens += int(completion or 0)
        row.spend_nano += int(spend or 0)
        row.by_status[status] = row.by_status.get(status, 0) + int(count)
        row.first_at = min(row.first_at, float(first))
        row.last_at = max(row.last_at, float(last))
    # Deterministic order: by the grouped dimensions, in the order asked for.
    return [groups[k] for k in sorted(groups, key=lambda k: tuple((v is None, v) for v in k))]
