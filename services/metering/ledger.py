"""The usage ledger: one row per usage event, written idempotently, summed on demand.

Storage interface (``Ledger``): ``open()``, ``record(entries) -> inserted``,
``totals(...) -> rows``, ``close()``. Two backends, chosen by URL (``ledger_from_url``):

- SQLite (default, ``sqlite:///.meshserve/ledger.sqlite3`` or a plain path): stdlib
  ``sqlite3`` run in worker threads (``asyncio.to_thread``), WAL journal so queries read
  while a batch commits, ``synchronous=FULL`` so a committed batch survives power loss
  (we ack after commit: a commit that could vanish would lose usage). One writer
  process per file: run one metering instance on SQLite.
- PostgreSQL (``postgresql://user:pass@host:5432/db``, asyncpg): for production and for
  several metering instances sharing the durable consumer.

Idempotence: the primary key is the usage id (``proto.usage_dedup_id``: the request id,
plus the migration segment) and inserts skip existing keys (``ON CONFLICT (usage_id) DO NOTHING``
in both backends). A batch is one transaction, so a redelivered event — after
a crash between commit and ack — is counted once, and ``record`` says how many rows
were new (the rest were duplicates).

Schema. ``ledger_meta`` holds the schema version. ``open()`` creates a new ledger at
``SCHEMA_VERSION`` and upgrades an older one in place, in one transaction (version 2 added
``end_user`` and ``metadata``, with defaults, so rows of version 1 read back as ``''`` and
``{}``); it refuses a ledger of a newer version rather than write rows it cannot describe.

Errors: ``LedgerUnavailable`` means "try again later" (connection refused or lost,
locked, disk full, I/O error, anything unclassified: stalling is safer than dropping
usage); ``LedgerRejected`` means this data can never be written (a constraint or data
error) and the caller should write the batch event by event to isolate the bad one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proto.messages import UsageEvent, usage_dedup_id
from proto.metering import DEFAULT_GROUP_BY, UsageRow

from .prices import PriceTable

log = logging.getLogger(__name__)

DEFAULT_LEDGER_PATH = Path(".meshserve") / "ledger.sqlite3"
SCHEMA_VERSION = 2  # 2: end_user, metadata
MAX_TOKENS = 1 << 32  # per event; beyond any context window, and keeps SUM() far from int64 overflow
MAX_ID_CHARS = 1024
MAX_ERROR_CHARS = 4096
# OpenAI's limits on a request's ``metadata``; the gateway refuses more, so more is a bad producer.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class LedgerError(Exception):
    pass


class LedgerUnavailable(LedgerError):
    """Transient: the ledger cannot write or read now; retry the same batch later."""


class LedgerRejected(LedgerError):
    """Permanent: the ledger refuses this data (constraint or data error)."""


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


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LedgerEntry))
_COLUMN_OF_FIELD = {"user": "end_user"}
COLUMNS: tuple[str, ...] = tuple(_COLUMN_OF_FIELD.get(name, name) for name in FIELDS)  # in FIELDS' order
_METADATA_INDEX = FIELDS.index("metadata")
_INT_COLUMNS = frozenset(
    ("prompt_tokens", "cached_tokens", "completion_tokens", "reserved_tokens", "migrations", "schema_v", "stream_seq",
     "price_input_nano", "price_cached_nano", "price_output_nano", "spend_nano")
)
_FLOAT_COLUMNS = frozenset(("arrival_time", "first_token_time", "finish_time", "ts", "recorded_at"))


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
    charge = prices.charge(event.model, event.status, event.prompt_tokens, event.cached_tokens, event.completion_tokens)
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
    )


# ---- totals: one SQL shape for both backends --------------------------------------------
_DIMENSION_COLUMNS = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
                      "status": "status"}
_BUCKET_SECONDS = {"hour": 3600, "day": 86400}
_ROW_FIELD = {"org": "org", "key": "key_id", "model": "model", "tier": "tier", "worker": "worker_id",
              "status": "status", "hour": "bucket", "day": "bucket"}


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
    select = [*exprs, "status", "COUNT(*)", "SUM(prompt_tokens)", "SUM(cached_tokens)", "SUM(completion_tokens)",
              "SUM(spend_nano)", "MIN(ts)", "MAX(ts)"]
    sql = f"SELECT {', '.join(select)} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " GROUP BY " + ", ".join([*exprs, "status"])
    return TotalsSql(sql, params)


def fold_totals(records: Sequence[Sequence[Any]], group_by: Sequence[str]) -> list[UsageRow]:
    """Rows of (dims..., status, count, sums..., min ts, max ts) → one UsageRow per group."""
    n = len(group_by)
    groups: dict[tuple[Any, ...], UsageRow] = {}
    for record in records:
        dims = tuple(float(v) if group_by[i] in _BUCKET_SECONDS else v for i, v in enumerate(record[:n]))
        status, count, prompt, cached, completion, spend, first, last = record[n:]
        row = groups.get(dims)
        if row is None:
            row = UsageRow(by_status={}, first_at=float(first), last_at=float(last))
            for i, name in enumerate(group_by):
                setattr(row, _ROW_FIELD[name], dims[i])
            groups[dims] = row
        row.requests += int(count)
        row.prompt_tokens += int(prompt or 0)
        row.cached_tokens += int(cached or 0)
        row.completion_tokens += int(completion or 0)
        row.spend_nano += int(spend or 0)
        row.by_status[status] = row.by_status.get(status, 0) + int(count)
        row.first_at = min(row.first_at, float(first))
        row.last_at = max(row.last_at, float(last))
    # Deterministic order: by the grouped dimensions, in the order asked for.
    return [groups[k] for k in sorted(groups, key=lambda k: tuple((v is None, v) for v in k))]


class Ledger(ABC):
    """The storage interface the metering service writes through."""

    url: str  # for logs: never carries a password

    @abstractmethod
    async def open(self) -> None:
        """Connect and create the schema if missing. Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def record(self, entries: Sequence[LedgerEntry]) -> int:
        """Write ``entries`` in one transaction; the number that were new (not duplicates)."""

    @abstractmethod
    async def _select(self, query: TotalsSql) -> list[Sequence[Any]]: ...

    @abstractmethod
    def _placeholder(self, index: int) -> str: ...

    @abstractmethod
    def _bucket_expr(self, seconds: int) -> str: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def totals(
        self,
        org: str | None = None,
        key_id: str | None = None,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
        group_by: Sequence[str] = DEFAULT_GROUP_BY,
    ) -> list[UsageRow]:
        """Sums per group over ``since <= ts < until`` (None: unbounded)."""
        query = totals_sql(org=org, key_id=key_id, model=model, since=since, until=until, group_by=group_by,
                           placeholder=self._placeholder, bucket_expr=self._bucket_expr)
        return fold_totals(await self._select(query), group_by)


# ---- SQLite ------------------------------------------------------------------------------
_SQLITE_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS usage_events (
    usage_id TEXT PRIMARY KEY NOT NULL,
    request_id TEXT NOT NULL,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    status TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    reserved_tokens INTEGER NOT NULL,
    migrations INTEGER NOT NULL,
    arrival_time REAL NOT NULL,
    first_token_time REAL NOT NULL,
    finish_time REAL NOT NULL,
    error TEXT NOT NULL,
    schema_v INTEGER NOT NULL,
    ts REAL NOT NULL,
    recorded_at REAL NOT NULL,
    stream_seq INTEGER NOT NULL,
    price_input_nano INTEGER NOT NULL,
    price_cached_nano INTEGER NOT NULL,
    price_output_nano INTEGER NOT NULL,
    spend_nano INTEGER NOT NULL,
    end_user TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}'
)""",
    "CREATE INDEX IF NOT EXISTS usage_events_ts ON usage_events (ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_org_ts ON usage_events (org, ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_key_ts ON usage_events (key_id, ts)",
    "CREATE TABLE IF NOT EXISTS ledger_meta (name TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL)",
)
# What upgrades a ledger of version v - 1 to version v; new tables are created at the latest.
_SQLITE_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE usage_events ADD COLUMN end_user TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE usage_events ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}'"),
}


def _sqlite_error(exc: BaseException) -> LedgerError:
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.DataError):
        return LedgerRejected(f"SQLite refused the data: {exc}")
    return LedgerUnavailable(f"SQLite ledger unavailable: {exc!r}")


class SqliteLedger(Ledger):
    def __init__(self, path: str | Path, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self.synchronous = synchronous
        self.busy_timeout_s = busy_timeout_s
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        # sqlite3 connections are not safe for concurrent use: one call at a time on each.
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        # ON CONFLICT (usage_id), not INSERT OR IGNORE: OR IGNORE would also silently skip
        # a row breaking NOT NULL, and an acked event would vanish as a "duplicate".
        self._insert = (f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
                        "ON CONFLICT (usage_id) DO NOTHING")

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per batch.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
        return conn

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        writer = self._connect()
        try:
            # One transaction: a crash mid-upgrade leaves the old version whole, never half of each.
            writer.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SQLITE_SCHEMA:
                    writer.execute(statement)
                writer.execute("INSERT OR IGNORE INTO ledger_meta (name, value) VALUES ('schema', ?)",
                               (str(SCHEMA_VERSION),))
                (found,) = writer.execute("SELECT value FROM ledger_meta WHERE name = 'schema'").fetchone()
                if int(found) > SCHEMA_VERSION:
                    raise LedgerRejected(f"{self.path} has ledger schema {found}; this build knows {SCHEMA_VERSION}")
                if int(found) < SCHEMA_VERSION:
                    for version in range(int(found) + 1, SCHEMA_VERSION + 1):
                        for statement in _SQLITE_MIGRATIONS[version]:
                            writer.execute(statement)
                        log.info("ledger %s upgraded to schema %d", self.path, version)
                    writer.execute("UPDATE ledger_meta SET value = ? WHERE name = 'schema'", (str(SCHEMA_VERSION),))
                writer.execute("COMMIT")
            except BaseException:
                if writer.in_transaction:
                    writer.execute("ROLLBACK")
                raise
            reader = self._connect()
            reader.execute("PRAGMA query_only=ON")
        except BaseException:
            writer.close()
            raise
        self._writer, self._reader = writer, reader

    async def open(self) -> None:
        if self._writer is not None:
            return
        try:
            await asyncio.to_thread(self._open_sync)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerUnavailable(f"cannot open SQLite ledger {self.path}: {exc!r}") from exc

    def _record_sync(self, rows: list[tuple[Any, ...]]) -> int:
        conn = self._writer
        if conn is None:
            raise LedgerUnavailable("SQLite ledger is not open")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                cursor = conn.executemany(self._insert, rows)
                inserted = cursor.rowcount  # ignored (duplicate) rows change nothing
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:
            raise _sqlite_error(exc) from exc
        return inserted

    async def record(self, entries: Sequence[LedgerEntry]) -> int:
        if not entries:
            return 0
        rows = [entry_row(e) for e in entries]
        async with self._write_lock:
            return await asyncio.to_thread(self._record_sync, rows)

    def _select_sync(self, query: TotalsSql) -> list[Sequence[Any]]:
        if self._reader is None:
            raise LedgerUnavailable("SQLite ledger is not open")
        try:
            return list(self._reader.execute(query.sql, query.params).fetchall())
        except (sqlite3.Error, OSError) as exc:
            raise _sqlite_error(exc) from exc

    async def _select(self, query: TotalsSql) -> list[Sequence[Any]]:
        async with self._read_lock:
            return await asyncio.to_thread(self._select_sync, query)

    def _placeholder(self, index: int) -> str:
        return "?"

    def _bucket_expr(self, seconds: int) -> str:
        # ts > 0, so truncation is floor.
        return f"(CAST(ts / {seconds} AS INTEGER) * {seconds})"

    async def close(self) -> None:
        async with self._write_lock, self._read_lock:
            for conn in (self._writer, self._reader):
                if conn is not None:
                    await asyncio.to_thread(conn.close)
            self._writer = self._reader = None


# ---- PostgreSQL --------------------------------------------------------------------------
_PG_TYPES = {name: ("bigint" if name in _INT_COLUMNS else "double precision" if name in _FLOAT_COLUMNS else "text")
             for name in COLUMNS}
_PG_DEFAULTS = {"end_user": "''", "metadata": "'{}'"}  # schema 2's columns: what version 1's rows get


def _pg_column(name: str) -> str:
    return (f"{name} {_PG_TYPES[name]} NOT NULL" + (" PRIMARY KEY" if name == "usage_id" else "")
            + (f" DEFAULT {_PG_DEFAULTS[name]}" if name in _PG_DEFAULTS else ""))


_PG_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS usage_events (" + ", ".join(_pg_column(name) for name in COLUMNS) + ")",
    "CREATE INDEX IF NOT EXISTS usage_events_ts ON usage_events (ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_org_ts ON usage_events (org, ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_key_ts ON usage_events (key_id, ts)",
    "CREATE TABLE IF NOT EXISTS ledger_meta (name text PRIMARY KEY, value text NOT NULL)",
)
# One statement per batch: arrays of every column, unnested into rows (atomic on its own).
_PG_INSERT = (
    f"INSERT INTO usage_events ({', '.join(COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${i + 1}::{_PG_TYPES[name]}[]" for i, name in enumerate(COLUMNS))
    + ") ON CONFLICT (usage_id) DO NOTHING"
)
_PG_MIGRATIONS: dict[int, tuple[str, ...]] = {  # as _SQLITE_MIGRATIONS
    2: (f"ALTER TABLE usage_events ADD COLUMN {_pg_column('end_user')}",
        f"ALTER TABLE usage_events ADD COLUMN {_pg_column('metadata')}"),
}
_PG_MIGRATION_LOCK = 0x6D65746572  # "meter": serialises schema creation across instances


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _pg_error(exc: BaseException) -> LedgerError:
    sqlstate = getattr(exc, "sqlstate", None) or ""
    # Class 22 (data exception) and 23 (integrity violation) are about the rows; everything
    # else — connection, shutdown, disk full, timeouts, our own bugs — may pass: retry.
    if sqlstate[:2] in ("22", "23"):
        return LedgerRejected(f"PostgreSQL refused the data ({sqlstate}): {exc}")
    return LedgerUnavailable(f"PostgreSQL ledger unavailable: {exc!r}")


class PostgresLedger(Ledger):
    def __init__(self, url: str, *, max_connections: int = 4, timeout_s: float = 10.0) -> None:
        self._dsn = url
        self.url = redact_url(url)
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._pool: Any = None

    async def open(self) -> None:
        if self._pool is not None:
            return
        import asyncpg

        try:
            pool = await asyncpg.create_pool(
                self._dsn, min_size=1, max_size=self.max_connections, timeout=self.timeout_s,
                command_timeout=self.timeout_s,
            )
        except Exception as exc:  # refused, DNS, auth, timeout: all mean "not now"
            raise LedgerUnavailable(f"cannot connect to PostgreSQL ledger {self.url}: {exc!r}") from exc
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _PG_MIGRATION_LOCK)
                for statement in _PG_SCHEMA:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO ledger_meta (name, value) VALUES ('schema', $1) ON CONFLICT DO NOTHING",
                                   str(SCHEMA_VERSION))
                found = await conn.fetchval("SELECT value FROM ledger_meta WHERE name = 'schema'")
                if int(found) < SCHEMA_VERSION:
                    # Under the advisory lock: one instance upgrades, the others then find it done.
                    for version in range(int(found) + 1, SCHEMA_VERSION + 1):
                        for statement in _PG_MIGRATIONS[version]:
                            await conn.execute(statement)
                        log.info("ledger %s upgraded to schema %d", self.url, version)
                    await conn.execute("UPDATE ledger_meta SET value = $1 WHERE name = 'schema'", str(SCHEMA_VERSION))
        except Exception as exc:
            await pool.close()
            raise _pg_error(exc) from exc
        if int(found) > SCHEMA_VERSION:
            await pool.close()
            raise LedgerRejected(f"{self.url} has ledger schema {found}; this build knows {SCHEMA_VERSION}")
        self._pool = pool

    async def record(self, entries: Sequence[LedgerEntry]) -> int:
        if not entries:
            return 0
        if self._pool is None:
            raise LedgerUnavailable("PostgreSQL ledger is not open")
        columns = [list(column) for column in zip(*(entry_row(e) for e in entries), strict=True)]
        try:
            async with self._pool.acquire(timeout=self.timeout_s) as conn:
                status = await conn.execute(_PG_INSERT, *columns)
        except Exception as exc:
            raise _pg_error(exc) from exc
        return int(status.rsplit(" ", 1)[-1])  # "INSERT 0 <rows>"

    async def _select(self, query: TotalsSql) -> list[Sequence[Any]]:
        if self._pool is None:
            raise LedgerUnavailable("PostgreSQL ledger is not open")
        try:
            async with self._pool.acquire(timeout=self.timeout_s) as conn:
                return [tuple(r) for r in await conn.fetch(query.sql, *query.params)]
        except Exception as exc:
            raise _pg_error(exc) from exc

    def _placeholder(self, index: int) -> str:
        return f"${index}"

    def _bucket_expr(self, seconds: int) -> str:
        return f"(floor(ts / {seconds}) * {seconds})"

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), self.timeout_s)
            except Exception:  # a dead server: do not hang the drain on a polite goodbye
                pool.terminate()


def ledger_from_url(url: str | None) -> Ledger:
    """``sqlite:///relative/path``, ``sqlite:////absolute/path``, a plain path, or ``postgresql://...``."""
    if not url:
        return SqliteLedger(DEFAULT_LEDGER_PATH)
    scheme = url.split(":", 1)[0].lower() if "://" in url else ""
    if scheme in ("postgresql", "postgres"):
        return PostgresLedger(url)
    if scheme == "sqlite":
        path = url[len("sqlite://"):]
        if not path.startswith("/") or len(path) < 2:
            raise ValueError(f"SQLite ledger URL must be sqlite:///relative/path or sqlite:////absolute/path: {url!r}")
        return SqliteLedger(path[1:])
    if scheme:
        raise ValueError(f"unknown ledger URL scheme {scheme!r} (sqlite or postgresql)")
    return SqliteLedger(url)
