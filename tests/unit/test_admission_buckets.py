"""Token buckets, all-or-nothing multi-bucket reserve, the limiter and its ledger."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.admission.buckets import (
    InvalidLimits,
    Limiter,
    LimiterConfig,
    Limits,
    TokenBucket,
    limits_problem,
    reserve_all,
)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


# ---- TokenBucket ----


def test_refills_continuously_up_to_capacity() -> None:
    clock = FakeClock()
    b = TokenBucket(rate=10.0, capacity=100.0, now=clock())
    assert b.available(clock()) == 100.0
    assert b.try_reserve(100, clock()) == 0.0
    assert b.available(clock()) == 0.0
    assert b.available(clock.advance(0.5)) == pytest.approx(5.0)
    assert b.available(clock.advance(2.0)) == pytest.approx(25.0)
    assert b.available(clock.advance(1000.0)) == 100.0  # capped


def test_clock_going_backwards_does_not_refill_or_drain() -> None:
    b = TokenBucket(rate=10.0, capacity=100.0, now=10.0, tokens=0.0)
    assert b.available(9.0) == 0.0
    assert b.available(11.0) == pytest.approx(10.0)


def test_reserve_fails_with_deficit_and_retry_after_is_exact() -> None:
    clock = FakeClock()
    b = TokenBucket(rate=50.0, capacity=1000.0, now=clock(), tokens=300.0)
    assert b.try_reserve(500, clock()) == pytest.approx(200.0)
    assert b.available(clock()) == pytest.approx(300.0)  # nothing taken on failure
    wait = b.wait_time(500, clock())
    assert wait == pytest.approx(4.0)  # deficit / rate
    clock.advance(wait - 0.01)
    assert b.try_reserve(500, clock()) > 0
    clock.advance(0.01)
    assert b.try_reserve(500, clock()) == 0.0


def test_amount_over_capacity_never_fits() -> None:
    b = TokenBucket(rate=50.0, capacity=1000.0, now=0.0)
    assert b.wait_time(1001, 0.0) == math.inf
    assert b.wait_time(1000, 0.0) == 0.0


def test_refund_never_exceeds_capacity() -> None:
    b = TokenBucket(rate=1.0, capacity=100.0, now=0.0)
    b.try_reserve(30, 0.0)
    b.refund(20, 0.0)
    assert b.available(0.0) == 90.0
    b.refund(50, 0.0)
    assert b.available(0.0) == 100.0


def test_charge_goes_into_debt_that_later_requests_wait_out() -> None:
    b = TokenBucket(rate=10.0, capacity=100.0, now=0.0)
    b.charge(150, 0.0)
    assert b.available(0.0) == -50.0
    assert b.wait_time(10, 0.0) == pytest.approx(6.0)


def test_set_limits_keeps_balance_capped() -> None:
    b = TokenBucket(rate=10.0, capacity=100.0, now=0.0, tokens=80.0)
    b.set_limits(1.0, 50.0, 0.0)
    assert (b.available(0.0), b.rate) == (50.0, 1.0)
    b.set_limits(10.0, 500.0, 0.0)
    assert b.available(0.0) == 50.0  # more capacity is not free tokens


# ---- reserve_all ----


def test_reserve_all_is_all_or_nothing() -> None:
    a = TokenBucket(rate=1.0, capacity=100.0, now=0.0)
    b = TokenBucket(rate=2.0, capacity=100.0, now=0.0, tokens=10.0)
    c = TokenBucket(rate=1.0, capacity=5.0, now=0.0, tokens=0.5)
    short = reserve_all([("a", a, 50.0), ("b", b, 30.0), ("c", c, 1.0)], 0.0)
    assert [s.name for s in short] == ["b", "c"]
    assert (a.available(0.0), b.available(0.0), c.available(0.0)) == (100.0, 10.0, 0.5)
    assert short[0].retry_after == pytest.approx(10.0)  # 20 / 2
    assert short[1].retry_after == pytest.approx(0.5)
    assert all(s.retryable for s in short)
    assert reserve_all([("a", a, 50.0), ("b", b, 30.0), ("c", c, 1.0)], 10.0) == []
    assert (a.available(10.0), b.available(10.0), c.available(10.0)) == (50.0, 0.0, 4.0)


def test_reserve_all_marks_impossible_amounts() -> None:
    a = TokenBucket(rate=1.0, capacity=100.0, now=0.0)
    (s,) = reserve_all([("a", a, 150.0)], 0.0)
    assert not s.retryable
    assert a.available(0.0) == 100.0


# ---- Limiter ----

LIMITS = Limits(rpm=60, tpm=6000, org_rpm=600, org_tpm=60_000)


def test_reserve_takes_tokens_and_a_request_from_key_and_org() -> None:
    lim = Limiter()
    res = lim.reserve("r1", "k1", "acme", 1500, LIMITS, 0.0)
    assert res.admitted
    assert res.reserved_tokens == 1500
    assert lim.bucket("key:k1:tpm").available(0.0) == 4500  # type: ignore[union-attr]
    assert lim.bucket("key:k1:rpm").available(0.0) == 59  # type: ignore[union-attr]
    assert lim.bucket("org:acme:tpm").available(0.0) == 58_500  # type: ignore[union-attr]
    assert lim.bucket("org:acme:rpm").available(0.0) == 599  # type: ignore[union-attr]
    assert lim.is_open("r1")


def test_unlimited_dimensions_have_no_bucket() -> None:
    lim = Limiter()
    assert lim.reserve("r1", "k1", "acme", 10**9, Limits(rpm=5), 0.0).admitted
    assert lim.bucket("key:k1:tpm") is None
    assert lim.bucket("org:acme:rpm") is None


def test_token_quota_rejection_with_retry_after() -> None:
    lim = Limiter()
    assert lim.reserve("r1", "k1", "acme", 5000, LIMITS, 0.0).admitted
    res = lim.reserve("r2", "k1", "acme", 2000, LIMITS, 0.0)
    assert not res.admitted
    assert (res.reason, res.limit, res.retryable) == ("quota_tokens", "key_tpm", True)
    assert res.retry_after == pytest.approx(1000 / 100)  # deficit 1000 at 6000/min = 100/s
    assert not lim.is_open("r2")
    # all or nothing: the failed request took no request slot either
    assert lim.bucket("key:k1:rpm").available(0.0) == 59  # type: ignore[union-attr]
    assert lim.reserve("r2", "k1", "acme", 2000, LIMITS, res.retry_after).admitted


def test_request_quota_rejection() -> None:
    lim = Limiter()
    limits = Limits(rpm=3)
    for i in range(3):
        assert lim.reserve(f"r{i}", "k", "o", 10, limits, 0.0).admitted
    res = lim.reserve("r3", "k", "o", 10, limits, 0.0)
    assert (res.admitted, res.reason, res.limit) == (False, "quota_requests", "key_rpm")
    assert res.retry_after == pytest.approx(20.0)  # one request at 3/min


def test_reason_is_the_slowest_limit_to_recover() -> None:
    lim = Limiter()
    limits = Limits(rpm=1, tpm=60_000)  # rpm refills in 60 s, tpm much faster
    assert lim.reserve("r0", "k", "o", 60_000, limits, 0.0).admitted
    res = lim.reserve("r1", "k", "o", 1000, limits, 0.0)
    assert (res.reason, res.retry_after) == ("quota_requests", pytest.approx(60.0))


def test_request_larger_than_the_bucket_is_not_retryable() -> None:
    lim = Limiter()
    res = lim.reserve("big", "k1", "acme", 6001, LIMITS, 0.0)
    assert not res.admitted
    assert (res.reason, res.retryable, res.retry_after) == ("quota_tokens", False, 0.0)
    assert "6001 tokens" in res.message and "6000" in res.message
    res = lim.reserve("none", "k1", "acme", 1, Limits(rpm=0), 0.0)
    assert (res.reason, res.retryable) == ("quota_requests", False)


def test_a_negative_limit_is_refused_for_that_key_without_touching_any_bucket() -> None:
    # A key stored with rpm -5 (written past the CLI) must not crash the limiter: the
    # shell turns InvalidLimits into a 403 for that key and serves the others.
    lim = Limiter()
    assert limits_problem(Limits(rpm=-5, tpm=100)) == "rpm -5"
    assert limits_problem(Limits(rpm=0, tpm=None, org_tpm=-1)) == "org tpm -1"
    assert limits_problem(Limits(rpm=0)) is None  # 0 is a limit: it admits nothing
    with pytest.raises(InvalidLimits, match="rpm -5"):
        lim.reserve("bad", "k-bad", "acme", 10, Limits(rpm=-5, tpm=1000), 0.0)
    assert lim.bucket("key:k-bad:tpm") is None and lim.bucket("key:k-bad:rpm") is None and len(lim) == 0
    assert lim.reserve("good", "k-good", "acme", 10, LIMITS, 0.0).admitted


def test_org_limit_is_shared_by_its_keys() -> None:
    lim = Limiter()
    limits = Limits(tpm=10_000, org_tpm=12_000)
    assert lim.reserve("a1", "key-a", "acme", 8000, limits, 0.0).admitted
    res = lim.reserve("b1", "key-b", "acme", 8000, limits, 0.0)
    assert (res.admitted, res.limit) == (False, "org_tpm")
    assert lim.bucket("key:key-b:tpm").available(0.0) == 10_000  # type: ignore[union-attr]
    assert lim.reserve("c1", "key-c", "other", 8000, limits, 0.0).admitted


def test_interleaved_requests_never_exceed_the_limit() -> None:
    lim = Limiter()
    limits = Limits(rpm=1000, tpm=10_000, org_tpm=25_000)
    admitted = 0
    for i in range(100):  # three keys of one org racing for the same budget
        if lim.reserve(f"r{i}", f"k{i % 3}", "acme", 700, limits, 0.0).admitted:
            admitted += 1
    assert admitted * 700 <= 25_000
    assert admitted == 25_000 // 700


def test_reconcile_refunds_once() -> None:
    lim = Limiter()
    lim.reserve("r1", "k1", "acme", 5000, LIMITS, 0.0)
    assert lim.reconcile("r1", 1200, 0.0) == 3800
    key_tpm = lim.bucket("key:k1:tpm")
    assert key_tpm is not None
    assert key_tpm.available(0.0) == 6000 - 1200
    assert lim.reconcile("r1", 1200, 0.0) is None  # the usage event redelivered
    assert lim.reconcile("r1", 0, 0.0) is None
    assert key_tpm.available(0.0) == 6000 - 1200
    assert lim.bucket("key:k1:rpm").available(0.0) == 59  # type: ignore[union-attr]
    assert lim.reconcile("never-seen", 10, 0.0) is None


def test_usage_beyond_the_reservation_is_charged() -> None:
    lim = Limiter()
    lim.reserve("r1", "k1", "acme", 1000, LIMITS, 0.0)
    assert lim.reconcile("r1", 1300, 0.0) == -300
    assert lim.bucket("key:k1:tpm").available(0.0) == 6000 - 1300  # type: ignore[union-attr]


def test_release_returns_everything_including_the_request() -> None:
    lim = Limiter()
    lim.reserve("r1", "k1", "acme", 1000, LIMITS, 0.0)
    assert lim.release("r1", 0.0)
    assert not lim.release("r1", 0.0)
    assert lim.reconcile("r1", 10, 0.0) is None
    assert lim.bucket("key:k1:tpm").available(0.0) == 6000  # type: ignore[union-attr]
    assert lim.bucket("key:k1:rpm").available(0.0) == 60  # type: ignore[union-attr]


def test_same_request_id_reserved_twice_is_charged_once() -> None:
    lim = Limiter()
    assert lim.reserve("r1", "k1", "acme", 1000, LIMITS, 0.0).admitted
    assert lim.reserve("r1", "k1", "acme", 1000, LIMITS, 0.0).reserved_tokens == 1000
    assert lim.bucket("key:k1:tpm").available(0.0) == 5000  # type: ignore[union-attr]


def test_unreconciled_reservations_expire_as_fully_used() -> None:
    clock = FakeClock(0.0)
    lim = Limiter(LimiterConfig(reservation_ttl_s=300.0))
    limits = Limits(tpm=600)  # refills 10 tokens/s
    lim.reserve("lost", "k", "o", 500, limits, clock())
    clock.advance(100)
    lim.reserve("late", "k", "o", 100, limits, clock())
    assert lim.expire(clock.advance(199)) == []
    assert lim.expire(clock.advance(1)) == ["lost"]
    assert len(lim) == 1
    # settled as fully used: no refund now, and none when its usage finally arrives
    bucket = lim.bucket("key:k:tpm")
    assert bucket is not None
    before = bucket.available(clock())
    assert lim.reconcile("lost", 0, clock()) is None
    assert bucket.available(clock()) == before
    assert lim.expire(clock.advance(100)) == ["late"]


def test_limits_change_when_the_key_record_changes() -> None:
    lim = Limiter()
    lim.reserve("r1", "k", "o", 1000, Limits(tpm=6000), 0.0)
    lim.reserve("r2", "k", "o", 1000, Limits(tpm=3000), 0.0)  # key downgraded
    b = lim.bucket("key:k:tpm")
    assert b is not None
    assert (b.capacity, b.rate) == (3000, 50.0)
    assert b.available(0.0) == 2000  # 5000 capped at 3000, then r2's 1000
    lim.reconcile("r1", 0, 0.0)  # an old reservation refunds, still capped by the new capacity
    assert b.available(0.0) == 3000


def test_burst_limiter_config() -> None:
    lim = Limiter(LimiterConfig(burst_s=10.0))
    lim.reserve("r1", "k", "o", 100, Limits(tpm=6000), 0.0)
    b = lim.bucket("key:k:tpm")
    assert b is not None
    assert (b.capacity, b.rate) == (1000.0, 100.0)


def test_idle_full_buckets_are_dropped_but_not_while_a_reservation_is_open() -> None:
    lim = Limiter(LimiterConfig(idle_bucket_ttl_s=60.0, reservation_ttl_s=10_000.0))
    lim.reserve("a", "k1", "o", 10, Limits(tpm=6000), 0.0)
    lim.reserve("b", "k2", "o", 10, Limits(tpm=6000), 0.0)
    lim.reconcile("a", 10, 1.0)
    lim.expire(120.0)
    assert lim.bucket("key:k1:tpm") is None  # full again and idle: re-created full on demand
    assert lim.bucket("key:k2:tpm") is not None  # "b" will refund into it


def test_cancelled_and_failed_burst_leaves_what_was_streamed() -> None:
    """A burst whose requests end early: the bucket ends where the real usage says."""
    clock = FakeClock()
    lim = Limiter()
    limits = Limits(tpm=100_000, rpm=1000)
    actual = {}
    for i in range(40):
        assert lim.reserve(f"r{i}", "k", "o", 2000, limits, clock()).admitted
    b = lim.bucket("key:k:tpm")
    assert b is not None
    assert b.available(clock()) == 100_000 - 40 * 2000
    for i in range(40):
        # prompt 500; some cancelled after a few tokens, some failed before any output
        actual[i] = 500 + (0 if i % 3 == 0 else (i * 7) % 1500)
        assert lim.reconcile(f"r{i}", actual[i], clock()) is not None
    assert b.available(clock()) == 100_000 - sum(actual.values())
    assert len(lim) == 0


# ---- property: with a frozen clock the balance is exact bookkeeping ----

ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 30), st.integers(1, 3000)),
        st.tuples(st.just("reconcile"), st.integers(0, 30), st.integers(0, 3500)),
        st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_balance_is_capacity_minus_open_reservations_minus_settled_usage(
    seq: list[tuple[str, int, int]],
) -> None:
    lim = Limiter()
    limits = Limits(tpm=20_000, rpm=20)
    open_: dict[int, int] = {}
    used = 0
    requests = 0
    for kind, i, n in seq:
        if kind == "reserve":
            res = lim.reserve(f"r{i}", "k", "o", n, limits, 0.0)
            if res.admitted and i not in open_:
                open_[i] = n
                requests += 1
        elif kind == "reconcile":
            refunded = lim.reconcile(f"r{i}", n, 0.0)
            if i in open_:
                assert refunded == open_.pop(i) - n
                used += n
            else:
                assert refunded is None
        else:
            released = lim.release(f"r{i}", 0.0)
            assert released == (i in open_)
            if released:
                open_.pop(i)
                requests -= 1
    b = lim.bucket("key:k:tpm")
    if b is not None:
        # exact unless usage beyond reservations pushed it into debt (charge), still exact
        assert b.available(0.0) == pytest.approx(20_000 - sum(open_.values()) - used)
        assert b.available(0.0) <= b.capacity
    r = lim.bucket("key:k:rpm")
    if r is not None:
        assert r.available(0.0) == 20 - requests


# ---- requests in flight ----


def test_a_keys_requests_in_flight_are_capped_until_one_is_settled() -> None:
    lim = Limiter(LimiterConfig(reservation_ttl_s=300.0))
    limits = Limits(concurrent=2)
    assert lim.reserve("a", "k", "o", 10, limits, 0.0).admitted
    assert lim.reserve("b", "k", "o", 10, limits, 0.0).admitted
    refused = lim.reserve("c", "k", "o", 10, limits, 0.0)
    assert not refused.admitted and refused.reason == "quota_requests" and refused.limit == "key_concurrent"
    assert refused.retryable and refused.retry_after > 0
    assert "2 requests in flight, its limit is 2" in refused.message
    assert not lim.is_open("c")  # a refusal holds nothing
    assert lim.reserve("a", "k", "o", 10, limits, 0.0).admitted  # the same request asked again: not a third
    assert lim.reserve("x", "other", "o", 10, limits, 0.0).admitted  # per key: another key is not held back
    lim.reconcile("a", 5, 1.0)  # finished
    assert lim.reserve("c", "k", "o", 10, limits, 1.0).admitted
    lim.release("b", 1.0)  # refused downstream
    assert lim.in_flight("k") == 1
    assert lim.expire(400.0) == ["x", "c"]
    assert lim.in_flight("k") == 0 and lim.in_flight("other") == 0  # expired reservations free their slots


def test_a_concurrency_limit_of_zero_admits_nothing_and_a_negative_one_is_invalid() -> None:
    lim = Limiter()
    refused = lim.reserve("a", "k", "o", 10, Limits(concurrent=0), 0.0)
    assert not refused.admitted and not refused.retryable
    assert limits_problem(Limits(concurrent=-1)) == "max concurrent -1"
    with pytest.raises(InvalidLimits):
        lim.reserve("a", "k", "o", 10, Limits(concurrent=-1), 0.0)
