"""Token buckets and the per-key / per-org limiter with its reservation ledger.

Pure and synchronous: every method takes the caller's clock reading ``now`` (seconds,
monotonic in practice). A multi-bucket reservation checks every bucket and takes from
all of them or from none within one synchronous call, so on an asyncio shell no other
request can interleave between the check and the take: concurrent requests cannot
slip past a limit together.

Reservations are pessimistic (``prompt_tokens + max_tokens``) and reconciled exactly
once per request id from the request's usage event: ``reserved − actual`` goes back to
the token buckets. A reservation whose usage never arrives expires after
``reservation_ttl_s`` and is settled as fully used. That is the safe side: a missing
usage event usually means the worker died or the usage stream lagged, not that the
tokens were not spent, and refunding them would let a key exceed its limit by one
reservation per lost event (a client can provoke exactly that by dropping connections).
Charging in full costs an honest key at most one request's estimate, once, for one
refill period. A usage event arriving after expiry is then a no-op, like any repeat.

A key's ``concurrent`` limit counts its open reservations (its requests in flight: admitted
and not yet settled by their usage event); at the limit a request is refused until one
ends. So a usage event that never comes holds a slot until its reservation expires
(``reservation_ttl_s``, 15 min): every request ends in one (the worker's, or the gateway's
``rejected`` for a request it gives up on, also during admission). A migrated request's
first segment settles the reservation while the request goes on elsewhere: its slot is
free again a segment early.

``Limiter.snapshot`` / ``restore`` carry the state (buckets that are not full or that an
open reservation draws on, and the open reservations) from one admission instance to
its successor; bucket times are the caller's clock, so that clock must be one both
instances share (wall-clock seconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

QuotaReason = Literal["quota_tokens", "quota_requests"]


class TokenBucket:
    """``rate`` tokens per second, refilled continuously, holding at most ``capacity``."""

    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, rate: float, capacity: float, now: float, tokens: float | None = None) -> None:
        if rate < 0 or capacity < 0:
            raise ValueError("rate and capacity must be ≥ 0")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self.tokens = self.capacity if tokens is None else min(float(tokens), self.capacity)
        self.updated = now

    def __repr__(self) -> str:
        return f"TokenBucket(rate={self.rate}, capacity={self.capacity}, tokens={self.tokens:.1f})"

    def refill(self, now: float) -> float:
        """Bring the bucket to ``now``; return the tokens available."""
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        return self.tokens

    available = refill

    def deficit(self, amount: float, now: float) -> float:
        return max(0.0, amount - self.refill(now))

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0 now; ``inf`` when it never can)."""
        if amount > self.capacity:
            return math.inf
        d = self.deficit(amount, now)
        if d <= 0:
            return 0.0
        return d / self.rate if self.rate > 0 else math.inf

    def try_reserve(self, amount: float, now: float) -> float:
        """Take ``amount`` if available and return 0.0; else take nothing, return the deficit."""
        d = self.deficit(amount, now)
        if d <= 0:
            self.tokens -= amount
        return d

    def refund(self, amount: float, now: float) -> None:
        """Give back unused tokens; the bucket never exceeds its capacity."""
        self.refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` unconditionally (usage beyond the reservation): may go into debt,
        which later requests wait out."""
        self.refill(now)
        self.tokens -= amount

    def set_limits(self, rate: float, capacity: float, now: float) -> None:
        """New limits (the key's record changed): keep the balance, capped to the new capacity."""
        self.refill(now)
        self.rate = float(rate)
        self.capacity = float(capacity)
        self.tokens = min(self.tokens, self.capacity)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """One bucket that could not cover its part of a multi-bucket reservation."""

    name: str
    amount: float
    deficit: float
    retry_after: float  # deficit / rate; inf when the amount exceeds the capacity
    capacity: float

    @property
    def retryable(self) -> bool:
        return math.isfinite(self.retry_after)


def reserve_all(demands: Sequence[tuple[str, TokenBucket, float]], now: float) -> list[Shortfall]:
    """Take each ``amount`` from its bucket, all or nothing. Empty list: reserved.

    Otherwise nothing was taken and the list names every bucket short, each with the
    time its deficit takes to refill; the request can succeed after the largest.
    """
    short: list[Shortfall] = []
    for name, bucket, amount in demands:
        d = bucket.deficit(amount, now)
        if d > 0 or amount > bucket.capacity:
            short.append(Shortfall(name, amount, d, bucket.wait_time(amount, now), bucket.capacity))
    if not short:
        for _, bucket, amount in demands:
            bucket.tokens -= amount  # refilled to ``now`` by ``deficit`` above
    return short


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits and its org's (per minute; ``concurrent``: the key's requests in
    flight at once); ``None`` is unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    org_rpm: int | None = None
    org_tpm: int | None = None
    concurrent: int | None = None


class InvalidLimits(ValueError):
    """Limits no bucket can enforce (a negative count). The key's stored record is wrong,
    not the request: the shell refuses that key's requests and serves every other key."""


def limits_problem(limits: Limits) -> str | None:
    """What makes ``limits`` unenforceable, e.g. ``"rpm -5"``; None when nothing does.

    A limit is a count: None (unlimited) or ≥ 0 (0 admits nothing, ever).
    """
    bad = [
        f"{name} {value}"
        for name, value in (("rpm", limits.rpm), ("tpm", limits.tpm), ("org rpm", limits.org_rpm),
                            ("org tpm", limits.org_tpm), ("max concurrent", limits.concurrent))
        if value is not None and value < 0
    ]
    return ", ".join(bad) or None


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    # Bucket capacity = the per-minute limit × burst_s / 60: by default a key may spend
    # a whole minute's budget at once, then refills at limit / 60 per second.
    burst_s: float = 60.0
    reservation_ttl_s: float = 900.0  # longer than any request may run
    idle_bucket_ttl_s: float = 600.0  # full, unused buckets are dropped (re-created full)


@dataclass(frozen=True, slots=True)
class QuotaResult:
    admitted: bool
    reserved_tokens: int = 0
    reason: QuotaReason | None = None
    retry_after: float = 0.0
    retryable: bool = True
    limit: str = ""  # which limit refused: "key_tpm", "key_rpm", "org_tpm", "org_rpm", "key_concurrent"
    message: str = ""


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    tokens: int
    created_at: float
    # Refunds go to the bucket objects the tokens came from, even if limits changed since.
    token_buckets: tuple[tuple[str, TokenBucket], ...]  # (bucket name, bucket)
    request_buckets: tuple[tuple[str, TokenBucket], ...]
    key_id: str = ""  # whose request in flight it is (``Limits.concurrent``)

    @property
    def bucket_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in (*self.token_buckets, *self.request_buckets))


class BucketState(msgspec.Struct, array_like=True):
    name: str
    rate: float
    capacity: float
    tokens: float
    updated: float


class ReservationState(msgspec.Struct, array_like=True):
    request_id: str
    tokens: int
    created_at: float
    token_buckets: list[str]
    request_buckets: list[str]
    key_id: str = ""  # absent in a checkpoint from before per-key concurrency: not counted


class LimiterState(msgspec.Struct, kw_only=True):
    """A limiter's state at ``taken_at``, for the instance that takes over."""

    v: int = 1
    taken_at: float
    buckets: list[BucketState] = []
    reservations: list[ReservationState] = []


_REASON: dict[str, QuotaReason] = {
    "key_tpm": "quota_tokens",
    "org_tpm": "quota_tokens",
    "key_rpm": "quota_requests",
    "org_rpm": "quota_requests",
}


class Limiter:
    """Buckets per key and per org, created lazily, plus the reservation ledger."""

    def __init__(self, config: LimiterConfig | None = None) -> None:
        self.config = config or LimiterConfig()
        self._buckets: dict[str, TokenBucket] = {}  # "key:<id>:tpm", "org:<id>:rpm", ...
        self._last_used: dict[str, float] = {}
        self._holds: dict[str, int] = {}  # bucket name → open reservations drawing on it
        # Open reservations, oldest first. Only open ones are kept: a settled id is simply
        # absent, so any repeat of its usage (USAGE redelivery) finds nothing to refund.
        self._open: dict[str, Reservation] = {}
        self._in_flight: dict[str, int] = {}  # key id → its open reservations

    # ---- buckets ----
    def bucket(self, name: str) -> TokenBucket | None:
        return self._buckets.get(name)

    def _bucket(self, name: str, per_minute: int, now: float) -> TokenBucket:
        rate = per_minute / 60.0
        capacity = per_minute * self.config.burst_s / 60.0
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = TokenBucket(rate, capacity, now)
        elif b.rate != rate or b.capacity != capacity:
            b.set_limits(rate, capacity, now)
        self._last_used.pop(name, None)  # re-inserted: the dict stays in last-use order
        self._last_used[name] = now
        return b

    # ---- reservations ----
    def reserve(
        self, request_id: str, key_id: str, org: str, tokens: int, limits: Limits, now: float
    ) -> QuotaResult:
        """Reserve ``tokens`` and one request from every limited bucket, all or nothing.

        Raises ``InvalidLimits`` (before touching any bucket) for limits no bucket can hold.
        """
        problem = limits_problem(limits)
        if problem is not None:
            raise InvalidLimits(problem)
        existing = self._open.get(request_id)
        if existing is not None:  # the same request asked twice (a retried call): no double charge
            return QuotaResult(admitted=True, reserved_tokens=existing.tokens)
        if limits.concurrent is not None and self.in_flight(key_id) >= limits.concurrent:
            return self._concurrency_refusal(self.in_flight(key_id), limits.concurrent)
        token_b: list[tuple[str, TokenBucket]] = []
        request_b: list[tuple[str, TokenBucket]] = []
        demands: list[tuple[str, TokenBucket, float]] = []
        for label, name, per_minute in (
            ("key_tpm", f"key:{key_id}:tpm", limits.tpm),
            ("key_rpm", f"key:{key_id}:rpm", limits.rpm),
            ("org_tpm", f"org:{org}:tpm", limits.org_tpm),
            ("org_rpm", f"org:{org}:rpm", limits.org_rpm),
        ):
            if per_minute is None:
                continue
            b = self._bucket(name, per_minute, now)
            is_tokens = _REASON[label] == "quota_tokens"
            (token_b if is_tokens else request_b).append((name, b))
            demands.append((label, b, float(tokens) if is_tokens else 1.0))
        short = reserve_all(demands, now)
        if short:
            return self._refusal(short, tokens)
        self._add(Reservation(request_id, tokens, now, tuple(token_b), tuple(request_b), key_id))
        return QuotaResult(admitted=True, reserved_tokens=tokens)

    def _add(self, r: Reservation) -> None:
        for n in r.bucket_names:
            self._holds[n] = self._holds.get(n, 0) + 1
        if r.key_id:
            self._in_flight[r.key_id] = self._in_flight.get(r.key_id, 0) + 1
        self._open[r.request_id] = r

    def in_flight(self, key_id: str) -> int:
        """The key's requests admitted and not yet settled (``Limits.concurrent`` counts these)."""
        return self._in_flight.get(key_id, 0)

    @staticmethod
    def _concurrency_refusal(in_flight: int, limit: int) -> QuotaResult:
        if limit == 0:
            return QuotaResult(admitted=False, reason="quota_requests", retryable=False, limit="key_concurrent",
                               message="the key's max concurrent requests is 0: it admits nothing, retrying cannot"
                                       " succeed")
        # When one of the key's requests ends is not known: a second is a client's usual wait.
        return QuotaResult(admitted=False, reason="quota_requests", retry_after=1.0, limit="key_concurrent",
                           message=f"concurrency limit reached: the key has {in_flight} requests in flight, its"
                                   f" limit is {limit}; retry when one of them has finished")

    @staticmethod
    def _refusal(short: list[Shortfall], tokens: int) -> QuotaResult:
        never = [s for s in short if not s.retryable]
        if never:
            s = never[0]
            label = s.name
            unit = "tokens" if _REASON[label] == "quota_tokens" else "requests"
            return QuotaResult(
                admitted=False,
                reason=_REASON[label],
                retry_after=0.0,
                retryable=False,
                limit=label,
                message=f"the request needs {s.amount:.0f} {unit}, more than the {label.replace('_', ' ')} "
                f"limit ever allows at once ({s.capacity:.0f}): retrying cannot succeed",
            )
        s = max(short, key=lambda x: x.retry_after)  # the request fits once the slowest refills
        label = s.name
        return QuotaResult(
            admitted=False,
            reason=_REASON[label],
            retry_after=s.retry_after,
            retryable=True,
            limit=label,
            message=f"{label.replace('_', ' ')} limit reached; retry in {s.retry_after:.2f} s",
        )

    def reconcile(self, request_id: str, actual_tokens: int, now: float) -> int | None:
        """Settle a reservation from its usage: refund ``reserved − actual`` tokens.

        Returns the tokens refunded (negative when usage exceeded the reservation and the
        excess was charged), or ``None`` when the id has no open reservation (already
        settled, expired, or never reserved here): repeats are no-ops.
        """
        r = self._close(request_id, now)
        if r is None:
            return None
        delta = r.tokens - max(actual_tokens, 0)
        for _, b in r.token_buckets:
            if delta >= 0:
                b.refund(delta, now)
            else:
                b.charge(-delta, now)
        return delta

    def charge_unreserved(self, key_id: str, org: str, tokens: int, now: float) -> int:
        """Charge usage no reservation covers (a migrated request's later segments: the
        first segment's usage settled the reservation) to the key's and org's token
        buckets that exist; returns how many buckets were charged."""
        charged = 0
        for name in (f"key:{key_id}:tpm", f"org:{org}:tpm"):
            bucket = self._buckets.get(name)
            if bucket is not None and tokens > 0:
                bucket.charge(tokens, now)
                charged += 1
        return charged

    def release(self, request_id: str, now: float) -> bool:
        """Undo a reservation entirely (the request never ran: SLO shed, no capacity)."""
        r = self._close(request_id, now)
        if r is None:
            return False
        for _, b in r.token_buckets:
            b.refund(r.tokens, now)
        for _, b in r.request_buckets:
            b.refund(1.0, now)
        return True

    def _close(self, request_id: str, now: float) -> Reservation | None:
        r = self._open.pop(request_id, None)
        if r is None:
            return None
        for n in r.bucket_names:
            left = self._holds[n] - 1
            if left:
                self._holds[n] = left
            else:
                del self._holds[n]
        if r.key_id:
            left = self._in_flight[r.key_id] - 1
            if left:
                self._in_flight[r.key_id] = left
            else:
                del self._in_flight[r.key_id]
        return r

    # ---- hand-over ----
    def snapshot(self, now: float) -> LimiterState:
        """Everything a successor needs: full buckets nothing draws on are left out (they
        are re-created identical), so the state grows with the keys in use, not all keys."""
        names = {n for n, b in self._buckets.items() if n in self._holds or b.refill(now) < b.capacity}
        return LimiterState(
            taken_at=now,
            buckets=[
                BucketState(n, b.rate, b.capacity, b.tokens, b.updated)
                for n, b in self._buckets.items()
                if n in names
            ],
            reservations=[
                ReservationState(
                    r.request_id, r.tokens, r.created_at,
                    [n for n, _ in r.token_buckets], [n for n, _ in r.request_buckets], r.key_id,
                )
                for r in self._open.values()
            ],
        )

    def restore(self, state: LimiterState, now: float) -> None:
        """Replace this limiter's state by ``state`` (an instance taking over)."""
        self._buckets = {}
        self._last_used = {}
        self._holds = {}
        self._open = {}
        self._in_flight = {}
        for bs in state.buckets:
            b = TokenBucket(bs.rate, bs.capacity, bs.updated, bs.tokens)
            b.tokens = bs.tokens  # may be negative (a debt from usage beyond a reservation)
            self._buckets[bs.name] = b
            self._last_used[bs.name] = now
        for rs in sorted(state.reservations, key=lambda r: r.created_at):
            token_b = tuple((n, self._buckets[n]) for n in rs.token_buckets if n in self._buckets)
            request_b = tuple((n, self._buckets[n]) for n in rs.request_buckets if n in self._buckets)
            self._add(Reservation(rs.request_id, rs.tokens, rs.created_at, token_b, request_b, rs.key_id))

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def expire(self, now: float) -> list[str]:
        """Settle reservations older than ``reservation_ttl_s`` as fully used and drop idle
        buckets. Returns the ids expired."""
        cfg = self.config
        expired: list[str] = []
        for rid, r in list(self._open.items()):
            if now - r.created_at < cfg.reservation_ttl_s:
                break  # insertion order is creation order
            self._close(rid, now)  # no refund: charged in full (see the module docstring)
            expired.append(rid)
        for name, used in list(self._last_used.items()):
            if now - used < cfg.idle_bucket_ttl_s:
                break  # last-use order
            b = self._buckets[name]
            # Dropping is invisible only if the bucket would be re-created identical: full,
            # and with no open reservation that will refund into it.
            if name not in self._holds and b.refill(now) >= b.capacity:
                del self._buckets[name]
                del self._last_used[name]
        return expired
