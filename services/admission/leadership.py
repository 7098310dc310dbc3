"""Admission's leader lease: taking it, renewing it, keeping it through a NATS restart,
letting it go (``service``'s module doc says why there is one leader and how the lease
works). The lease's mechanics only: what leading means (the check endpoint, the USAGE
consumer, the checkpoint) is the service's, reached through ``LeaderDuties``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from bus import Bus
from bus.provision import workers_bucket

from .config import AdmissionConfig
from .lease import (
    LEASE_KEY,
    admission_buckets,
    lease_bucket_name,
    lease_bucket_young,
    missing_buckets,
    state_bucket_name,
)

log = logging.getLogger(__name__)


class LeaderDuties(Protocol):
    """What the admission service does as it starts and stops leading."""

    @property
    def leading(self) -> bool: ...

    async def take_over(self) -> None:
        """Start serving (restore the checkpoint, follow USAGE, add the endpoint)."""

    async def step_down(self, reason: str) -> None:
        """Stop serving at once (no-op when not leading)."""

    async def follow_usage(self) -> None:
        """(Re)subscribe to USAGE from the first event not yet applied."""


class LeaderLease:
    """One instance's hold on the lease (``LEASE_KEY`` in the lease bucket, entries living
    ``lease_ttl_s``): ``step()`` every ``lease_renew_s`` renews it while leading and tries
    to take it otherwise, under ``lock``, which the service also holds to hand it over."""

    def __init__(self, duties: LeaderDuties, bus: Bus, config: AdmissionConfig, instance_id: str,
                 monotonic: Callable[[], float], replicas: int, lease: KeyValue, state: KeyValue) -> None:
        self.duties = duties
        self.bus = bus
        self.config = config
        self.instance_id = instance_id
        self.monotonic = monotonic
        self.replicas = replicas
        self.lease = lease
        self.state = state  # the checkpoint's bucket, provisioned again with the lease's
        self.revision = 0
        self.lock = asyncio.Lock()
        self._renewed_at = float("-inf")
        # When a leader (this instance, or the holder of the lease) was last known to hold
        # the lease: no leader for longer than its TTL is logged as a warning.
        self._leader_seen_at = monotonic()
        self._no_leader_warned_at = float("-inf")
        # No standby takes the lease in a bucket younger than one TTL (``_try_to_lead``).
        self._hold_off_until = float("-inf")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_renew_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("admission lease step failed")

    async def step(self) -> None:
        async with self.lock:
            if self.duties.leading:
                await self._renew()
            else:
                await self._try_to_lead()
            if self.duties.leading:
                self._leader_seen_at = self.monotonic()

    async def release(self) -> None:
        """Delete the lease (a leader handing over): a standby's next create succeeds at
        once, without waiting for the TTL. Best effort."""
        with contextlib.suppress(Exception):
            await self.lease.delete(LEASE_KEY, last=self.revision)

    async def _renew(self) -> None:
        value = self.instance_id.encode()
        try:
            self.revision = await self.lease.update(LEASE_KEY, value, last=self.revision)
            self._renewed_at = self.monotonic()
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            # Someone else wrote the lease, or it is gone with its bucket (NATS restarted
            # without its memory storage, and another instance provisioned it again).
            # ``create`` tells them apart atomically: it succeeds only where nobody holds it.
            if await self._keep_lease("the lease was gone"):
                return
            await self.duties.step_down("another instance holds the lease")
            return
        except (nats.errors.Error, TimeoutError) as exc:
            failure: BaseException = exc
        stale = self.monotonic() - self._renewed_at > 0.8 * self.config.lease_ttl_s
        if isinstance(failure, nats.js.errors.NoStreamResponseError):
            # Nothing stores the lease's subject: its bucket is gone (a restarted single
            # NATS loses memory storage). Provision it again, else nobody can ever lead
            # again; while our last renewal is recent, take the lease there at once.
            try:
                await self._restore_buckets()
                if not stale:
                    if not await self._keep_lease("the lease bucket was gone"):
                        await self.duties.step_down("another instance took the lease in its new bucket")
                    return
            except (nats.errors.Error, TimeoutError) as exc:
                failure = exc
        # Stop before the lease can expire and a standby take over: two leaders must
        # never serve at once.
        if stale:
            await self.duties.step_down(f"lease not renewed: {failure!r}")

    async def _keep_lease(self, why: str) -> bool:
        """As the leader, take the lease again where nobody holds it (its bucket provisioned
        again); False when somebody does, or when it could not be written."""
        try:
            self.revision = await self.lease.create(LEASE_KEY, self.instance_id.encode())
        except (nats.errors.Error, TimeoutError):
            return False
        self._renewed_at = self.monotonic()
        # The USAGE consumer may have gone with the server's state: follow it again from
        # what this leader has applied (a leader that cannot reconcile must not lead).
        try:
            await self.duties.follow_usage()
        except Exception as exc:
            log.warning("%s: following USAGE again failed: %r", self.instance_id, exc)
            await self.duties.step_down("it cannot follow USAGE")  # before the lease is free for another
            await self.release()
            return False
        log.warning("%s: %s; it holds the lease again", self.instance_id, why)
        return True

    async def _try_to_lead(self) -> None:
        now = self.monotonic()
        if now < self._hold_off_until:
            return
        young = await lease_bucket_young(self.bus.js, self.bus.subjects, self.config.lease_ttl_s)
        if young > 0:
            # A lease bucket made less than a TTL ago (NATS lost it, someone provisioned it
            # again): a leader may still serve on its last renewal in the old one, until
            # 0.8 TTL after it. Whoever made it, nobody takes the lease before that.
            self._hold_off_until = now + young
            return
        try:
            self.revision = await self.lease.create(LEASE_KEY, self.instance_id.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            self._leader_seen_at = now  # somebody leads: the lease is held
            return
        except (nats.errors.Error, TimeoutError) as exc:
            if isinstance(exc, nats.js.errors.NoStreamResponseError):
                # The lease bucket is gone: provision it again (else nobody could ever lead
                # again); being new, it is taken only once a TTL old (``lease_bucket_young``).
                try:
                    await self._restore_buckets()
                except (nats.errors.Error, TimeoutError) as restore_exc:
                    exc = restore_exc
            self._warn_without_leader(exc)
            return
        self._renewed_at = self.monotonic()
        try:
            await self.duties.take_over()
        except Exception:
            log.exception("taking over failed; giving the lease back")
            await self.duties.step_down("take-over failed")
            await self.release()

    def _warn_without_leader(self, exc: BaseException) -> None:
        now = self.monotonic()
        without = now - self._leader_seen_at
        if without <= self.config.lease_ttl_s:
            log.debug("lease create failed: %r", exc)
            return
        if now - self._no_leader_warned_at >= 10.0:  # every 10 s while it lasts, not every attempt
            self._no_leader_warned_at = now
            log.warning("no admission leader for %.0fs (taking the lease failed: %r); gateways admit without "
                        "admission for their grace, then refuse with 503", without, exc)

    async def _restore_buckets(self) -> bool:
        """Provision admission's buckets again where they are gone (a single nats-server
        restarted: memory storage, the lease's, does not survive it). The worker registry's
        bucket is in memory too and admission predicts nothing without it, so it is
        provisioned again as well. True when something was missing."""
        s = self.bus.subjects
        missing = await missing_buckets(self.bus.js, (lease_bucket_name(s), state_bucket_name(s), s.workers_bucket))
        if not missing:
            return False
        self.lease, self.state = await admission_buckets(
            self.bus.js, s, lease_ttl_s=self.config.lease_ttl_s, replicas=self.replicas
        )
        await workers_bucket(self.bus.js, s, replicas=self.replicas)
        log.warning("JetStream had lost the buckets %s (a NATS restart loses memory storage): provisioned again",
                    ", ".join(missing))
        return True
