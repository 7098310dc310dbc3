"""The metering service: USAGE stream → idempotent ledger, and usage queries.

Consumption. A durable JetStream pull consumer (``metering`` by default; explicit acks,
``max_ack_pending`` bounded, unlimited deliveries) on the USAGE stream. Each fetched batch
is decoded, validated, priced and written to the ledger in one transaction; the batch is
acked only after the commit. A crash anywhere before the acks reach the server means
redelivery, and the ledger's primary key (the usage id) makes the replay count nothing
twice. Several instances may share the consumer (the server spreads batches) when they
share a PostgreSQL ledger.

Bad input. Undecodable bytes, events of a schema version this build does not speak, and
decodable events that must not be billed (negative tokens, no request id) are logged,
counted and terminated (``term``): never redelivered, never blocking the stream. They
stay in the stream (until its max age) under the logged sequence, for an operator to
inspect. Deploy metering before workers that emit a newer usage schema.

Ledger outage. When the ledger cannot write (PostgreSQL down, disk full, locked), the
service keeps the batch unacked, stops fetching, and retries the same batch with
exponential backoff (0.2 s doubling to 10 s), telling the server it is still working
on it (``in_progress``) so the batch is not redelivered meanwhile. The events wait in the
stream. USAGE's documented limits (``bus.provision.StreamLimits``) bound that wait:
events are kept for 7 days (``usage_max_age_s``) and up to 1 GiB (``usage_max_bytes``,
roughly 5 million events of ~200 bytes); the stream discards *new* events when full
(``DiscardPolicy.NEW``: workers' publishes fail and they retry) rather than drop unbilled
old ones. A ledger outage longer than 7 days loses the oldest events.

Drain (SIGTERM). Stop answering queries and fetching, finish the batch in progress
(commit and acks), close the ledger. A batch that cannot be committed during the drain
is handed back (``nak``) for another instance or the next start.

Capacity. Workers' capacity events (``mesh.capacity.<worker>``, ``proto.CapacityEvent``)
come through a stream of their own, CAPACITY (its own limits: a week, 256 MiB, oldest
dropped first), with a durable consumer of the same name and the same loop, batches, acks
and retries; they are priced at the price table's accelerator-hour prices (``.fleet``).

Queries. ``mesh.metering.usage`` (``proto.metering.UsageQuery`` → ``UsageReport``):
totals per org/key/model/tier/worker/status/hour/day over a time range.
``mesh.metering.fleet`` (``FleetQuery`` → ``FleetReport``): accelerator time, its cost,
and the usage served on it, per model/accelerator/worker/hour/day.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

from bus import BusSettings, Service
from bus.metrics import MetricsServer
from proto.codec import decode
from proto.errors import DecodeError, ErrorCode, MeshError, UnsupportedVersion
from proto.messages import CapacityEvent, UsageEvent
from proto.metering import FleetQuery, FleetReport, UsageQuery, UsageReport, check_fleet_query, check_query

from .fleet import CapacityEntry, capacity_entries
from .ledger import (
    InvalidEvent,
    Ledger,
    LedgerEntry,
    LedgerError,
    LedgerRejected,
    entry_from_event,
    ledger_from_url,
)
from .metrics import metering_registry
from .prices import DEFAULT_PRICES, PriceTable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Written:
    """One stream message and the ledger rows it becomes (a usage event: one; a capacity
    event: one per model that held the worker's accelerators)."""

    msg: Msg
    usage: list[LedgerEntry] = field(default_factory=list)
    capacity: list[CapacityEntry] = field(default_factory=list)


def _worth_logging(count: int) -> bool:
    """The first ten, then every thousandth: a flood of garbage must not flood the logs."""
    return count <= 10 or count % 1000 == 0


@dataclass(frozen=True, slots=True)
class MeteringConfig:
    ledger_url: str | None = None  # None: SQLite at .meshserve/ledger.sqlite3
    prices: PriceTable = field(default_factory=lambda: DEFAULT_PRICES)
    durable: str = "metering"
    batch_size: int = 256  # events per fetch and per ledger transaction
    max_ack_pending: int = 2048  # bounds what one slow instance holds unacked
    ack_wait_s: float = 30.0  # redelivery after a crash waits this long
    fetch_timeout_s: float = 1.0  # also the longest a drain waits for an idle fetch
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics (0: any free port); None: not served
    metrics_host: str = "127.0.0.1"


class MeteringService(Service):
    name = "metering"
    description = "meshserve metering: usage events into an idempotent ledger, usage and spend queries"

    def __init__(
        self,
        config: MeteringConfig | None = None,
        settings: BusSettings | None = None,
        *,
        ledger: Ledger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        config = config or MeteringConfig()
        super().__init__(settings, drain_timeout_s=config.drain_timeout_s)
        self.config = config
        self.ledger = ledger if ledger is not None else ledger_from_url(config.ledger_url)
        self.clock = clock
        self._ledger_open = False
        self._ledger_opening = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._subs: dict[str, JetStreamContext.PullSubscription] = {}  # stream → its durable's subscription
        self._unpriced_models: set[str] = set()
        # figures for $SRV.STATS (and tests)
        self.ledger_ok = False
        self.events_written = 0
        self.duplicates = 0
        self.decode_errors = 0
        self.unsupported_version = 0
        self.invalid_events = 0
        self.rejected_events = 0
        self.ledger_errors = 0
        self.redelivered = 0
        self.unpriced_events = 0
        self.capacity_events = 0
        self._unpriced_accelerators: set[str] = set()
        self.batches = 0
        self.lag = 0  # usage events in USAGE not yet delivered to this consumer
        self.capacity_lag = 0  # the same of CAPACITY
        self.capacity_rows_written = 0
        self.last_commit_at = 0.0
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None

    # ---- lifecycle --------------------------------------------------------------------
    async def on_start(self) -> None:
        s = self.bus.subjects
        await self._open_ledger()  # failing here is fine: the consume loop retries
        for stream in (s.usage_stream, s.capacity_stream):
            await self._ensure_consumer(stream)
            self._subs[stream] = await self.bus.js.pull_subscribe_bind(durable=self.config.durable, stream=stream)
        await self.add_endpoint("usage", s.metering_usage, UsageQuery, self.handle_usage)
        await self.add_endpoint("fleet", s.metering_fleet, FleetQuery, self.handle_fleet)
        # Ready means the server routes to our subscriptions (no "no responders").
        await self.bus.confirm_subscriptions()
        # Spawned: the drain waits for the batch in progress to commit and ack.
        for stream in self._subs:
            self.spawn(self._consume(stream), name=f"consume-{stream}")
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(metering_registry(self.stats), host=self.config.metrics_host,
                                                 port=self.config.metrics_port)
            self.metrics_port = await self._metrics_server.start()

    async def on_drain(self) -> None:
        await self.stop_endpoints()
        self._stopping.set()

    async def on_stop(self) -> None:
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        for sub in self._subs.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._ledger_open:
            self._ledger_open = False
            await self.ledger.close()

    def stats(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger.url,
            "ledger_ok": self.ledger_ok,
            "events_written": self.events_written,
            "duplicates": self.duplicates,
            "decode_errors": self.decode_errors,
            "unsupported_version": self.unsupported_version,
            "invalid_events": self.invalid_events,
            "rejected_events": self.rejected_events,
            "ledger_errors": self.ledger_errors,
            "redelivered": self.redelivered,
            "unpriced_events": self.unpriced_events,
            "capacity_events": self.capacity_events,
            "batches": self.batches,
            "lag": self.lag,
            "capacity_lag": self.capacity_lag,
            "capacity_rows_written": self.capacity_rows_written,
            "last_commit_at": self.last_commit_at,
        }

    def _filter(self, stream: str) -> str:
        s = self.bus.subjects
        return s.capacity_all if stream == s.capacity_stream else s.usage_all

    async def _ensure_consumer(self, stream: str) -> None:
        what = "capacity events" if stream == self.bus.subjects.capacity_stream else "usage events"
        config = api.ConsumerConfig(
            name=self.config.durable,
            durable_name=self.config.durable,
            description=f"meshserve metering: {what} into the ledger",
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.config.ack_wait_s,
            max_deliver=-1,  # usage is never given up on: only term() ends an event
            max_ack_pending=self.config.max_ack_pending,
            filter_subject=self._filter(stream),
        )
        try:
            # Creates the durable, or updates the limits of an existing one.
            await self.bus.js.add_consumer(stream, config)
        except nats.js.errors.BadRequestError as exc:
            # A change the server cannot apply in place (e.g. another deliver policy):
            # keep consuming with the existing consumer rather than lose our position.
            log.warning("metering consumer %s on %s keeps its existing configuration: %s", self.config.durable,
                        stream, exc)

    async def _restore_consumer(self, stream: str) -> None:
        """After a failed fetch: when the durable is gone with its stream (deleted and
        recreated, by an operator or a recovery), create it again on the new stream, or
        billing would stop for good. The stream itself missing: the next failed fetch tries again."""
        try:
            await self.bus.js.consumer_info(stream, self.config.durable)
            return  # still there: the failure was something else (no leader, a disconnect)
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, OSError):
            return
        try:
            await self._ensure_consumer(stream)
        except (nats.errors.Error, OSError) as exc:
            log.debug("metering consumer %s on %s not created again yet: %r", self.config.durable, stream, exc)
            return
        log.warning("metering consumer %s was gone (%s recreated?): created again, from the stream's start",
                    self.config.durable, stream)

    async def _open_ledger(self) -> bool:
        async with self._ledger_opening:  # two consume loops (USAGE, CAPACITY) may both find it closed
            if self._ledger_open:
                return True
            return await self._open_ledger_now()

    async def _open_ledger_now(self) -> bool:
        try:
            await self.ledger.open()
        except LedgerError as exc:
            self.ledger_errors += 1
            self.ledger_ok = False
            log.warning("ledger %s not available: %s", self.ledger.url, exc)
            return False
        self._ledger_open = self.ledger_ok = True
        log.info("ledger %s open", self.ledger.url)
        return True

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the drain begins."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # ---- consumption ------------------------------------------------------------------
    async def _consume(self, stream: str) -> None:
        sub = self._subs[stream]
        backoff = self.config.backoff_initial_s
        while not self._stopping.is_set():
            if not self._ledger_open:
                if not await self._open_ledger():
                    await self._pause(backoff)
                    backoff = min(backoff * 2, self.config.backoff_max_s)
                    continue
                backoff = self.config.backoff_initial_s
            try:
                msgs = await sub.fetch(self.config.batch_size, timeout=self.config.fetch_timeout_s)
            except TimeoutError:  # nats' fetch timeouts derive from it: nothing to read
                self._set_lag(stream, 0)
                continue
            except (nats.errors.Error, OSError) as exc:
                if self._stopping.is_set():
                    break
                log.warning("fetching from %s failed: %r; retrying in %.1fs", stream, exc, backoff)
                await self._restore_consumer(stream)
                await self._pause(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)
                continue
            backoff = self.config.backoff_initial_s
            if not msgs:
                continue
            try:
                await self._process(msgs)
            except Exception:
                # A bug must not end consumption; the unacked batch comes back after ack_wait.
                log.exception("processing a batch of %d events from %s failed", len(msgs), stream)
                await self._pause(self.config.backoff_max_s)
            else:
                self._set_lag(stream, msgs[-1].metadata.num_pending)

    def _set_lag(self, stream: str, pending: int) -> None:
        if stream == self.bus.subjects.capacity_stream:
            self.capacity_lag = pending
        else:
            self.lag = pending

    def _capacity_rows(self, msg: Msg, now: float, seq: int) -> list[CapacityEntry]:
        event = decode(msg.data, CapacityEvent)
        rows = capacity_entries(event, self.config.prices, recorded_at=now, stream_seq=seq)
        if rows and not rows[0].priced and event.accelerators > 0 and len(self._unpriced_accelerators) < 1000 \
                and event.accelerator not in self._unpriced_accelerators:
            self._unpriced_accelerators.add(event.accelerator)
            log.warning("no price for accelerator %r (and no \"*\" entry): its time is counted, not costed",
                        event.accelerator)
        return rows

    async def _process(self, msgs: Sequence[Msg]) -> None:
        now = self.clock()
        batch: list[Written] = []
        capacity_prefix = self.bus.subjects.capacity_all.removesuffix("*")  # "mesh.capacity."
        for msg in msgs:
            meta = msg.metadata
            seq = meta.sequence.stream
            try:
                if msg.subject.startswith(capacity_prefix):
                    batch.append(Written(msg, capacity=self._capacity_rows(msg, now, seq)))
                    if meta.num_delivered > 1:
                        self.redelivered += 1
                    continue
                event = decode(msg.data, UsageEvent)
                entry = entry_from_event(event, self.config.prices, recorded_at=now, stream_seq=seq)
            except UnsupportedVersion as exc:
                self.unsupported_version += 1
                log.error("event on %s (stream seq %d) has an unsupported schema, terminated (replay it after "
                          "upgrading metering): %s", msg.subject, seq, exc)
                await self._settle(msg, "term")
                continue
            except DecodeError as exc:
                self.decode_errors += 1
                if _worth_logging(self.decode_errors):
                    log.warning("undecodable event on %s (seq %d), terminated (%d so far): %s",
                                msg.subject, seq, self.decode_errors, exc)
                await self._settle(msg, "term")
                continue
            except InvalidEvent as exc:
                self.invalid_events += 1
                if _worth_logging(self.invalid_events):
                    log.warning("invalid event on %s (seq %d), terminated (%d so far): %s",
                                msg.subject, seq, self.invalid_events, exc)
                await self._settle(msg, "term")
                continue
            if self.config.prices.price_for(event.model, event.base_model) is None:
                self.unpriced_events += 1
                if event.model not in self._unpriced_models and len(self._unpriced_models) < 1000:
                    self._unpriced_models.add(event.model)
                    log.warning("no price for model %r (and no \"*\" entry): its usage is charged zero", event.model)
            if meta.num_delivered > 1:
                self.redelivered += 1
            batch.append(Written(msg, usage=[entry]))
        await self._write(batch)

    async def _write(self, batch: list[Written]) -> None:
        """Commit the rows of ``batch`` then ack its messages; retry while the ledger is unavailable."""
        if not batch:
            return
        entries = [entry for item in batch for entry in item.usage]
        capacity = [row for item in batch for row in item.capacity]
        msgs = [item.msg for item in batch]
        backoff = self.config.backoff_initial_s
        last_touch = time.monotonic()
        while True:
            try:
                inserted = await self.ledger.record(entries, capacity)
            except LedgerRejected as exc:
                if len(batch) > 1:
                    # One bad event must not block the rest: write them one by one.
                    log.warning("ledger refused a batch of %d (%s); isolating the bad event", len(batch), exc)
                    for item in batch:
                        await self._write([item])
                    return
                self.rejected_events += 1
                log.error("ledger refused the event at stream seq %d, terminated: %s",
                          batch[0].msg.metadata.sequence.stream, exc)
                await self._settle(msgs[0], "term")
                return
            except LedgerError as exc:
                self.ledger_errors += 1
                self.ledger_ok = False
                if self._stopping.is_set():
                    log.warning("ledger unavailable during drain: %d events handed back for redelivery", len(msgs))
                    for msg in msgs:
                        await self._settle(msg, "nak")
                    return
                log.warning("ledger unavailable (%s); holding %d events, retrying in %.1fs", exc, len(entries), backoff)
                if time.monotonic() - last_touch > self.config.ack_wait_s / 3:
                    # Still ours: without this the server redelivers the batch every ack_wait.
                    for msg in msgs:
                        await self._settle(msg, "in_progress")
                    last_touch = time.monotonic()
                # Never sleep past the next in_progress that is due.
                await self._pause(min(backoff, self.config.ack_wait_s / 3))
                backoff = min(backoff * 2, self.config.backoff_max_s)
                continue
            break
        if not self.ledger_ok:
            log.info("ledger %s writable again", self.ledger.url)
        self.ledger_ok = True
        self.batches += 1
        # A batch comes from one stream: usage rows, or capacity rows.
        if capacity:
            self.capacity_rows_written += inserted
            self.capacity_events += len(batch)
        else:
            self.events_written += inserted
            self.duplicates += len(entries) - inserted
        self.last_commit_at = self.clock()
        for msg in msgs:
            await self._settle(msg, "ack")

    async def _settle(self, msg: Msg, how: str) -> None:
        # A lost ack only means a redelivery, which the ledger absorbs: never fail on it.
        try:
            if how == "ack":
                await msg.ack()
            elif how == "term":
                await msg.term()
            elif how == "nak":
                await msg.nak()
            else:
                await msg.in_progress()
        except (nats.errors.Error, OSError) as exc:
            log.debug("%s of a usage event failed: %r", how, exc)

    # ---- queries ----------------------------------------------------------------------
    async def handle_usage(self, query: UsageQuery, msg: Msg) -> None:
        await self._answer(msg, UsageReport, query, lambda: check_query(query), lambda: self.ledger.totals(
            org=query.org, key_id=query.key_id, model=query.model, since=query.since, until=query.until,
            group_by=query.group_by))

    async def handle_fleet(self, query: FleetQuery, msg: Msg) -> None:
        await self._answer(msg, FleetReport, query, lambda: check_fleet_query(query), lambda: self.ledger.fleet(
            model=query.model, since=query.since, until=query.until, group_by=query.group_by))

    async def _answer(self, msg: Msg, report: type[UsageReport] | type[FleetReport], query: UsageQuery | FleetQuery,
                      check: Callable[[], None], rows: Callable[[], Awaitable[Sequence[Any]]]) -> None:
        """A query's checks, the ledger's rows, and the report of at most ``query.limit`` of them."""
        try:
            check()
        except ValueError as exc:
            raise MeshError(str(exc), code=ErrorCode.BAD_REQUEST) from exc
        if not self._ledger_open:
            raise MeshError(f"usage ledger {self.ledger.url} is unavailable", code=ErrorCode.INTERNAL)
        try:
            found = list(await rows())
        except LedgerError as exc:
            raise MeshError(f"usage ledger unavailable: {exc}", code=ErrorCode.INTERNAL) from exc
        await self.bus.respond(msg, report(
            rows=found[: query.limit], group_by=list(query.group_by), since=query.since, until=query.until,
            currency=self.config.prices.currency, truncated=len(found) > query.limit, generated_at=self.clock()))
