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
``{}``; version 3 ``base_model``, an adapter's base, ``''`` before; version 4 the table
``capacity_periods``, the workers' accelerator time for the fleet report: see
:mod:`.fleet`; version 5 ``region``, where the request ran, ``''`` before); it refuses a ledger of a newer version rather than write rows it cannot describe.

Capacity rows (``record``'s ``capacity``) are written in the same transaction as the
usage rows of their batch, keyed by ``entry_id`` the same idempotent way.

Errors: ``LedgerUnavailable`` means "try again later" (connection refused or lost,
locked, disk full, I/O error, anything unclassified: stalling is safer than dropping
usage); ``LedgerRejected`` means this data can never be written (a constraint or data
error) and the caller should write the batch event by event to isolate the bad one.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proto.metering import DEFAULT_FLEET_GROUP_BY, DEFAULT_GROUP_BY, FleetRow, UsageRow

from .fleet import (
    CAPACITY_COLUMNS,
    CAPACITY_FLOAT_COLUMNS,
    CAPACITY_INDEXES,
    CAPACITY_INT_COLUMNS,
    CAPACITY_TABLE,
    CapacityEntry,
    capacity_row,
    capacity_sql,
    fold_fleet,
    usage_sql,
)
from .ledger_rows import (
    ADDED_COLUMNS,
    COLUMN_DEFAULTS,
    COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    MAX_TOKENS,
    SCHEMA_VERSION,
    InvalidEvent,
    LedgerEntry,
    TotalsSql,
    columns_at,
    entry_from_event,
    entry_from_row,
    entry_row,
    fold_totals,
    totals_sql,
)

# The ledger's public names, the rows' (ledger_rows) included: importers need only this module.
__all__ = [
    "COLUMNS",
    "DEFAULT_LEDGER_PATH",
    "MAX_TOKENS",
    "SCHEMA_VERSION",
    "InvalidEvent",
    "Ledger",
    "LedgerEntry",
    "LedgerError",
    "LedgerRejected",
    "LedgerUnavailable",
    "PostgresLedger",
    "SqliteLedger",
    "columns_at",
    "entry_from_event",
    "entry_from_row",
    "entry_row",
    "fold_totals",
    "ledger_from_url",
    "postgres_schema",
    "redact_url",
    "sqlite_schema",
    "totals_sql",
]

log = logging.getLogger(__name__)

DEFAULT_LEDGER_PATH = Path(".meshserve") / "ledger.sqlite3"

class LedgerError(Exception):
    pass


class LedgerUnavailable(LedgerError):
    """Transient: the ledger cannot write or read now; retry the same batch later."""


class LedgerRejected(LedgerError):
    """Permanent: the ledger refuses this data (constraint or data error)."""


class Ledger(ABC):
    """The storage interface the metering service writes through."""

    url: str  # for logs: never carries a password

    @abstractmethod
    async def open(self) -> None:
        """Connect and create the schema if missing. Raises ``LedgerUnavailable``."""

    @abstractmethod
    async def record(self, entries: Sequence[LedgerEntry], capacity: Sequence[CapacityEntry] = ()) -> int:
        """Write ``entries`` and ``capacity`` in one transaction; the number of rows that were
        new (not duplicates)."""

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

    async def fleet(
        self,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
        group_by: Sequence[str] = DEFAULT_FLEET_GROUP_BY,
    ) -> list[FleetRow]:
        """Accelerator time, its cost and the usage served on it, per group (``.fleet``)."""
        capacity = await self._select(capacity_sql(model=model, since=since, until=until, group_by=group_by,
                                                   placeholder=self._placeholder, bucket_expr=self._bucket_expr))
        usage = await self._select(usage_sql(model=model, since=since, until=until, group_by=group_by,
                                             placeholder=self._placeholder, bucket_expr=self._bucket_expr))
        return fold_fleet(capacity, usage, group_by)


# ---- SQLite ------------------------------------------------------------------------------
def _sqlite_column(name: str) -> str:
    kind = "INTEGER" if name in INT_COLUMNS else "REAL" if name in FLOAT_COLUMNS else "TEXT"
    return (f"{name} {kind}" + (" PRIMARY KEY" if name == "usage_id" else "") + " NOT NULL"
            + (f" DEFAULT {COLUMN_DEFAULTS[name]}" if name in COLUMN_DEFAULTS else ""))


_INDEXES = (
    "CREATE INDEX IF NOT EXISTS usage_events_ts ON usage_events (ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_org_ts ON usage_events (org, ts)",
    "CREATE INDEX IF NOT EXISTS usage_events_key_ts ON usage_events (key_id, ts)",
)


def _sqlite_capacity_column(name: str) -> str:
    kind = "INTEGER" if name in CAPACITY_INT_COLUMNS else "REAL" if name in CAPACITY_FLOAT_COLUMNS else "TEXT"
    return f"{name} {kind}" + (" PRIMARY KEY" if name == "entry_id" else "") + " NOT NULL"


def sqlite_schema(version: int = SCHEMA_VERSION) -> tuple[str, ...]:
    """The statements that create a SQLite ledger of schema ``version`` (an older one: the
    upgrade tests)."""
    table = ",\n    ".join(_sqlite_column(name) for name in columns_at(version))
    capacity = ", ".join(_sqlite_capacity_column(name) for name in CAPACITY_COLUMNS)
    return (f"CREATE TABLE IF NOT EXISTS usage_events (\n    {table}\n)", *_INDEXES,
            "CREATE TABLE IF NOT EXISTS ledger_meta (name TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL)",
            *((f"CREATE TABLE IF NOT EXISTS {CAPACITY_TABLE} ({capacity})", *CAPACITY_INDEXES) if version >= 4 else ()))


# What upgrades a ledger of version v - 1 to version v; new tables are created at the latest.
_SQLITE_MIGRATIONS = {version: tuple(f"ALTER TABLE usage_events ADD COLUMN {_sqlite_column(name)}" for name in added)
                      for version, added in ADDED_COLUMNS.items()}


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
        self._insert_capacity = (f"INSERT INTO {CAPACITY_TABLE} ({', '.join(CAPACITY_COLUMNS)}) "
                                 f"VALUES ({', '.join('?' * len(CAPACITY_COLUMNS))}) ON CONFLICT (entry_id) DO NOTHING")

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
                for statement in sqlite_schema():
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

    def _record_sync(self, rows: list[tuple[Any, ...]], capacity: list[tuple[Any, ...]]) -> int:
        conn = self._writer
        if conn is None:
            raise LedgerUnavailable("SQLite ledger is not open")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                inserted = 0
                for statement, batch in ((self._insert, rows), (self._insert_capacity, capacity)):
                    if batch:
                        inserted += conn.executemany(statement, batch).rowcount  # duplicates change nothing
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:
            raise _sqlite_error(exc) from exc
        return inserted

    async def record(self, entries: Sequence[LedgerEntry], capacity: Sequence[CapacityEntry] = ()) -> int:
        if not entries and not capacity:
            return 0
        rows = [entry_row(e) for e in entries]
        capacity_rows = [capacity_row(c) for c in capacity]
        async with self._write_lock:
            return await asyncio.to_thread(self._record_sync, rows, capacity_rows)

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
_PG_TYPES = {name: ("bigint" if name in INT_COLUMNS else "double precision" if name in FLOAT_COLUMNS else "text")
             for name in COLUMNS}


def _pg_column(name: str) -> str:
    return (f"{name} {_PG_TYPES[name]} NOT NULL" + (" PRIMARY KEY" if name == "usage_id" else "")
            + (f" DEFAULT {COLUMN_DEFAULTS[name]}" if name in COLUMN_DEFAULTS else ""))


_PG_CAPACITY_TYPES = {name: ("bigint" if name in CAPACITY_INT_COLUMNS else "double precision"
                              if name in CAPACITY_FLOAT_COLUMNS else "text") for name in CAPACITY_COLUMNS}


def postgres_schema(version: int = SCHEMA_VERSION) -> tuple[str, ...]:
    """As ``sqlite_schema``, for PostgreSQL."""
    table = ", ".join(_pg_column(name) for name in columns_at(version))
    capacity = ", ".join(f"{name} {_PG_CAPACITY_TYPES[name]} NOT NULL" + (" PRIMARY KEY" if name == "entry_id" else "")
                         for name in CAPACITY_COLUMNS)
    return (f"CREATE TABLE IF NOT EXISTS usage_events ({table})", *_INDEXES,
            "CREATE TABLE IF NOT EXISTS ledger_meta (name text PRIMARY KEY, value text NOT NULL)",
            *((f"CREATE TABLE IF NOT EXISTS {CAPACITY_TABLE} ({capacity})", *CAPACITY_INDEXES) if version >= 4 else ()))


# One statement per batch: arrays of every column, unnested into rows (atomic on its own).
_PG_INSERT = (
    f"INSERT INTO usage_events ({', '.join(COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${i + 1}::{_PG_TYPES[name]}[]" for i, name in enumerate(COLUMNS))
    + ") ON CONFLICT (usage_id) DO NOTHING"
)
_PG_INSERT_CAPACITY = (
    f"INSERT INTO {CAPACITY_TABLE} ({', '.join(CAPACITY_COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${i + 1}::{_PG_CAPACITY_TYPES[name]}[]" for i, name in enumerate(CAPACITY_COLUMNS))
    + ") ON CONFLICT (entry_id) DO NOTHING"
)
_PG_MIGRATIONS = {version: tuple(f"ALTER TABLE usage_events ADD COLUMN {_pg_column(name)}" for name in added)
                  for version, added in ADDED_COLUMNS.items()}  # as _SQLITE_MIGRATIONS
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
                for statement in postgres_schema():
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

    async def record(self, entries: Sequence[LedgerEntry], capacity: Sequence[CapacityEntry] = ()) -> int:
        if not entries and not capacity:
            return 0
        if self._pool is None:
            raise LedgerUnavailable("PostgreSQL ledger is not open")
        statements = [(statement, [list(column) for column in zip(*rows, strict=True)])
                      for statement, rows in ((_PG_INSERT, [entry_row(e) for e in entries]),
                                              (_PG_INSERT_CAPACITY, [capacity_row(c) for c in capacity])) if rows]
        inserted = 0
        try:
            async with self._pool.acquire(timeout=self.timeout_s) as conn, conn.transaction():
                for statement, columns in statements:
                    status = await conn.execute(statement, *columns)
                    inserted += int(status.rsplit(" ", 1)[-1])  # "INSERT 0 <rows>"
        except Exception as exc:
            raise _pg_error(exc) from exc
        return inserted

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


def sqlite_ledger_problem(path: str | Path) -> str | None:
    """Why the SQLite ledger at ``path`` can never be opened (its directory cannot be made,
    the file cannot be opened for writing), or None when it can. Checked at start, since
    the ledger is otherwise opened after "ready" and retried for ever. It makes what
    opening the ledger makes anyway: the directory, and the file (empty: SQLite takes an
    empty file as a new database)."""
    if str(path) == ":memory:":  # SQLite's in-memory database: no file to check
        return None
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{path}: cannot make its directory {path.parent}: {exc.strerror or exc}"
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


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
