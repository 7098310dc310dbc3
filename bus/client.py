"""Connecting to NATS and typed publish / request / subscribe over proto Structs.

Hot paths use subscription callbacks (nats-py's per-message iteration is slow) and
plain core publishes; JetStream publishes that await an ack are for messages whose
loss matters. Every payload is size-checked against the server's ``max_payload``
before it is sent, so an oversized message fails at once with ``PayloadTooLarge``
instead of surfacing later as a timeout or a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from opentelemetry import context as otel_context

from proto.codec import decode, encode
from proto.errors import (
    DecodeError,
    ErrorCode,
    MeshError,
    NoResponders,
    PayloadTooLarge,
    RemoteError,
    RequestTimeout,
)
from proto.messages import MESH_MAX_PAYLOAD, ErrorInfo, ErrorReply
from proto.subjects import Subjects

from .settings import BusSettings
from .tracing import extract_context, inject_headers

log = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

# NATS micro's error headers: standard tooling (nats CLI) shows them.
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream de-duplication
# Headers carry a few hundred bytes besides the payload; keep that much slack.
_HEADER_SLACK = 1024
# JetStream's 409 "duplicate message id is in process": another publisher's message with
# this Nats-Msg-Id is being stored (an R3 stream) right now. Asked again, the server
# answers with the ack of the stored duplicate.
DUPLICATE_IN_PROCESS = 10158
_DUPLICATE_WAIT_S = 0.02
_MAX_DUPLICATE_WAITS = 100  # 2 s: storing one message in an R3 stream takes milliseconds


def _duplicate_in_process(exc: Exception) -> bool:
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code == DUPLICATE_IN_PROCESS


# js_publish's few quick attempts retry these.
_JS_RETRYABLE = (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.errors.ConnectionClosedError)


def _retryable_until_stored(exc: Exception) -> bool:
    """Worth retrying for minutes: the stream is without a leader (an election), missing
    (being recreated), or did not answer in time. A closed connection stays closed."""
    return isinstance(exc, TimeoutError | nats.js.errors.NoStreamResponseError
                      | nats.js.errors.ServiceUnavailableError | nats.js.errors.ServerError) or _duplicate_in_process(exc)


def backoff_delay(attempt: int, first_s: float, max_s: float, rand: Callable[[], float] = random.random) -> float:
    """The wait before retry ``attempt`` (0-based): doubling from ``first_s`` up to ``max_s``,
    each drawn from its upper half, so publishers failing together do not retry together."""
    ceiling = min(max_s, first_s * 2 ** min(attempt, 30))
    return ceiling * (0.5 + 0.5 * rand())


def _ssl_context(settings: BusSettings) -> ssl.SSLContext | None:
    if not (settings.tls_ca or settings.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=settings.tls_ca)
    if settings.tls_cert:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


async def connect(
    settings: BusSettings, name: str, *, initial_attempts: int = 0,
    on_reconnected: list[Callable[[], None]] | None = None,
) -> NATS:
    """Connect with infinite reconnect; retry the first connection with backoff.

    ``initial_attempts`` = 0 retries forever (a service waits for its NATS server);
    tools pass a small number to fail fast.
    """
    delay = 0.1
    attempt = 0

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):  # our own close is no news
            log.warning("disconnected from NATS")

    async def on_reconnect() -> None:
        log.info("reconnected to NATS at %s", nc.connected_url.netloc if nc.connected_url else "?")
        for listener in on_reconnected or ():
            try:
                listener()
            except Exception:
                log.exception("reconnect listener failed")

    denied_logged: dict[str, float] = {}

    async def on_error(exc: Exception) -> None:
        text = str(exc)
        if "violation" not in text.lower():
            log.debug("NATS error: %r", exc)
            return
        # A subject this user may not use: otherwise it only shows as timeouts (a JetStream
        # call looks like an outage). Once a minute per subject, not once per retry.
        now = time.monotonic()
        if now - denied_logged.get(text, -60.0) >= 60.0:
            denied_logged[text] = now
            log.error("NATS refused %s: %s; the NATS user %r may not use that subject (check MESHSERVE_NATS_USER "
                      "and MESHSERVE_ROOT against the server's accounts, ops/nats/PERMISSIONS.md)",
                      name, text.removeprefix("nats: "), settings.user or "(none)")

    while True:
        attempt += 1
        nc = NATS()
        options: dict[str, Any] = {
            "servers": list(settings.servers),
            "name": name,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": settings.reconnect_wait_s,
            "connect_timeout": settings.connect_timeout_s,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            "error_cb": on_error,
            "tls": _ssl_context(settings),
        }
        if settings.creds_file:
            options["user_credentials"] = settings.creds_file
        if settings.user:
            options["user"] = settings.user
            options["password"] = settings.password
        if settings.token:
            options["token"] = settings.token
        if settings.nkey_seed_file:
            options["nkeys_seed"] = settings.nkey_seed_file
        try:
            # nats-py keeps retrying inside connect() when reconnect is on; bound each try.
            await asyncio.wait_for(nc.connect(**options), timeout=settings.connect_timeout_s * max(1, len(settings.servers)) + 1)
            return nc
        except (TimeoutError, OSError, nats.errors.NoServersError, nats.errors.Error) as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            if initial_attempts and attempt >= initial_attempts:
                raise MeshError(f"cannot connect to NATS at {', '.join(settings.servers)}: {exc!r}") from exc
            log.warning("NATS not reachable at %s (%r); retrying in %.1fs", ",".join(settings.servers), exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def error_reply_headers(code: str, message: str, status: int = 500) -> dict[str, str]:
    return {ERROR_HEADER: message[:200], ERROR_CODE_HEADER: str(status), "Mesh-Error-Code": code}


class Bus:
    """A service's typed view of one NATS connection."""

    def __init__(self, nc: NATS, settings: BusSettings) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects: Subjects = settings.subjects
        self.js: JetStreamContext = nc.jetstream()
        self.decode_errors = 0  # bad messages received and dropped (counted, logged)
        # js_publish_until_stored: publishes waiting for JetStream now, and since when one
        # has been failing (None: no outage; each outage is logged once, not per attempt)
        self.js_publishes_waiting = 0
        self.js_publishes_given_up = 0
        self._js_outage_since: float | None = None
        # Called after every reconnect: state that may have missed messages re-checks itself.
        self.reconnect_listeners: list[Callable[[], None]] = []

    @classmethod
    async def open(cls, settings: BusSettings, name: str, *, initial_attempts: int = 0) -> Bus:
        listeners: list[Callable[[], None]] = []
        bus = cls(await connect(settings, name, initial_attempts=initial_attempts, on_reconnected=listeners), settings)
        bus.reconnect_listeners = listeners
        if bus.max_payload < MESH_MAX_PAYLOAD:
            log.warning("NATS at %s allows messages of %d bytes (max_payload); meshserve's limits assume %d: "
                        "long prompts' log probabilities and large replies will be refused",
                        ",".join(settings.servers), bus.max_payload, MESH_MAX_PAYLOAD)
        return bus

    async def confirm_subscriptions(self, timeout: float = 30.0) -> None:
        """Return once the server has read every SUB and UNSUB this connection sent.

        nats-py writes flush()'s PING straight to the socket, ahead of commands still
        waiting in its write buffer for the flusher task: one PONG proves nothing about
        them. So: a round trip (the flusher gets to run), the buffer seen empty (bounded:
        other publishes may keep refilling it), then a round trip behind what was written.
        """
        flush_timeout = max(1, int(timeout))
        await self.nc.flush(timeout=flush_timeout)
        for _ in range(200):  # at most about a second
            if self.nc.pending_data_size == 0:
                break
            await asyncio.sleep(0.005)
        await self.nc.flush(timeout=flush_timeout)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    def check_payload(self, data: bytes, subject: str) -> None:
        limit = self.nc.max_payload
        if len(data) + _HEADER_SLACK > limit:
            raise PayloadTooLarge(len(data), limit, subject)

    # ---- publishing -------------------------------------------------------------------
    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        headers: dict[str, str] | None = None,
        reply: str = "",
        trace: bool = True,
    ) -> None:
        data = encode(message)
        self.check_payload(data, subject)
        if trace:
            headers = inject_headers(headers)
        await self.nc.publish(subject, data, reply=reply, headers=headers or None)

    async def js_publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
        attempts: int = 3,
    ) -> None:
        """Publish into JetStream and await the ack, retrying; ``msg_id`` makes retries safe."""
        data = encode(message)
        self.check_payload(data, subject)
        headers = inject_headers(dict(headers or {}))
        if msg_id:
            headers[MSG_ID_HEADER] = msg_id
        last: Exception | None = None
        attempt = duplicates = 0
        while attempt < attempts:
            try:
                await self.js.publish(subject, data, timeout=timeout, headers=headers)
                return
            except nats.js.errors.APIError as exc:
                if not _duplicate_in_process(exc) or duplicates >= _MAX_DUPLICATE_WAITS:
                    raise
                # Not a failure: another publisher's copy is being stored; ask again for its ack.
                duplicates += 1
                await asyncio.sleep(_DUPLICATE_WAIT_S)
                continue
            except _JS_RETRYABLE as exc:
                last = exc
                await asyncio.sleep(0.1 * (2**attempt))
            attempt += 1
        raise RequestTimeout(f"JetStream publish to {subject} not acknowledged after {attempts} attempts: {last!r}")

    async def js_publish_until_stored(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str,
        give_up_after_s: float = 600.0,
        timeout: float = 5.0,
        first_delay_s: float = 0.1,
        max_delay_s: float = 10.0,
    ) -> bool:
        """Publish into JetStream until the server acks it, for up to ``give_up_after_s``
        (exponential backoff with jitter); False when it gave up. For messages whose loss
        matters and that can wait (usage events), run in the background: their stream may
        be without a leader, or missing, for a while. ``msg_id`` makes every attempt, and
        any other publisher of the same message, store it once.

        An outage is logged once per Bus (when publishes start failing, and when one is
        stored again), not per attempt nor per message; a message given up on is logged."""
        data = encode(message)
        self.check_payload(data, subject)
        headers = inject_headers({MSG_ID_HEADER: msg_id})
        deadline = time.monotonic() + give_up_after_s
        attempt = 0
        self.js_publishes_waiting += 1
        try:
            while True:
                try:
                    await self.js.publish(subject, data, timeout=timeout, headers=headers)
                except (nats.errors.Error, OSError) as exc:
                    if not _retryable_until_stored(exc):
                        self.js_publishes_given_up += 1
                        log.error("JetStream publish to %s (msg id %s) refused: %r", subject, msg_id, exc)
                        return False
                    if _duplicate_in_process(exc):  # not a failure: the other publisher's ack comes next
                        delay = _DUPLICATE_WAIT_S
                    else:
                        if self._js_outage_since is None:
                            self._js_outage_since = time.monotonic()
                            log.warning("JetStream publishes failing (%s: %r); retrying in the background for up to %.0fs",
                                        subject, exc, give_up_after_s)
                        delay = backoff_delay(attempt, first_delay_s, max_delay_s)
                        attempt += 1
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.js_publishes_given_up += 1
                        log.error("JetStream publish to %s (msg id %s) given up after %d attempts over %.0fs: %r",
                                  subject, msg_id, attempt, give_up_after_s, exc)
                        return False
                    await asyncio.sleep(min(delay, remaining))
                    continue
                if self._js_outage_since is not None:
                    log.warning("JetStream publishes stored again after %.1fs of failures (%d still waiting)",
                                time.monotonic() - self._js_outage_since, self.js_publishes_waiting - 1)
                    self._js_outage_since = None
                return True
        except asyncio.CancelledError:
            if attempt:
                log.warning("JetStream publish to %s (msg id %s) abandoned after %d failed attempts (shutting down)",
                            subject, msg_id, attempt)
            raise
        finally:
            self.js_publishes_waiting -= 1

    # ---- request / reply --------------------------------------------------------------
    async def request(
        self,
        subject: str,
        message: msgspec.Struct,
        reply_type: type[T],
        *,
        timeout: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> T:
        data = encode(message)
        self.check_payload(data, subject)
        try:
            msg = await self.nc.request(subject, data, timeout=timeout, headers=inject_headers(headers))
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no service answers on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.1f}s") from exc
        return self.decode_reply(msg, reply_type)

    @staticmethod
    def decode_reply(msg: Msg, reply_type: type[T]) -> T:
        if msg.headers and ERROR_HEADER in msg.headers:
            try:
                info = decode(msg.data, ErrorReply).error
            except DecodeError:
                info = ErrorInfo(code=msg.headers.get("Mesh-Error-Code", ErrorCode.INTERNAL), message=msg.headers[ERROR_HEADER])
            try:
                code = ErrorCode(info.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            raise RemoteError(info.message, code=code, retry_after=info.retry_after)
        return decode(msg.data, reply_type)

    async def respond(self, msg: Msg, message: msgspec.Struct) -> None:
        if not msg.reply:
            return
        data = encode(message)
        if len(data) + _HEADER_SLACK > self.nc.max_payload:
            await self.respond_error(msg, PayloadTooLarge(len(data), self.nc.max_payload, msg.reply))
            return
        await self.nc.publish(msg.reply, data)

    async def respond_error(self, msg: Msg, error: MeshError, *, status: int | None = None) -> None:
        if not msg.reply:
            return
        retry_after = getattr(error, "retry_after", None)
        info = ErrorInfo(code=error.code.value, message=error.message, retryable=error.retryable, retry_after=retry_after)
        status = status or (400 if error.code in (ErrorCode.BAD_REQUEST, ErrorCode.DECODE, ErrorCode.UNSUPPORTED_VERSION) else 500)
        await self.nc.publish(
            msg.reply, encode(ErrorReply(error=info)), headers=error_reply_headers(info.code, info.message, status)
        )

    # ---- subscribing ------------------------------------------------------------------
    async def subscribe(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        *,
        queue: str = "",
        answer_decode_errors: bool = True,
    ) -> Subscription:
        """Subscribe with a callback that receives decoded messages.

        Undecodable messages are counted, logged and (for requests) answered with a
        typed error; they never reach the handler nor kill the subscription.
        """

        async def on_message(msg: Msg) -> None:
            try:
                message = decode(msg.data, kind)
            except DecodeError as exc:
                self.decode_errors += 1
                log.warning("dropped bad %s on %s: %s", kind.__name__, msg.subject, exc)
                if answer_decode_errors:
                    await self.respond_error(msg, exc)
                return
            try:
                await handler(message, msg)
            except MeshError as exc:
                await self.respond_error(msg, exc)
            except Exception as exc:  # a handler bug must not end the subscription
                log.exception("handler for %s failed", msg.subject)
                await self.respond_error(msg, MeshError(f"internal error: {exc!r}"))

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    @staticmethod
    def remote_context(msg: Msg) -> otel_context.Context:
        """The caller's trace context carried by ``msg`` (parent for the handler's span)."""
        return extract_context(msg.headers)

    async def every_service_stats(self, service: str, wait: float = 0.5) -> list[dict[str, Any]]:
        """The figures every instance of ``service`` that answers within ``wait`` seconds
        reports through ``$SRV.STATS`` ({} from one with no endpoint: an admission standby)."""
        inbox = self.nc.new_inbox()
        found: list[dict[str, Any]] = []

        async def collect(msg: Msg) -> None:
            data = msgspec.json.decode(msg.data)
            found.append((data.get("endpoints") or [{}])[0].get("data") or {})

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(f"$SRV.STATS.meshserve-{service}", b"", reply=inbox)
            await asyncio.sleep(wait)
        finally:
            await sub.unsubscribe()
        return found

    async def service_stats(self, service: str, timeout: float = 3.0) -> dict[str, Any]:
        """The figures one instance of ``service`` reports through NATS micro
        ``$SRV.STATS`` (the first to answer; {} from one with no endpoint, such as an
        admission standby). Services register as ``meshserve-<service>`` (bus.runner)."""
        msg = await self.nc.request(f"$SRV.STATS.meshserve-{service}", b"", timeout=timeout)
        endpoints = msgspec.json.decode(msg.data).get("endpoints") or [{}]
        data: dict[str, Any] = endpoints[0].get("data") or {}
        return data

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except (TimeoutError, nats.errors.ConnectionClosedError, nats.errors.FlushTimeoutError,
                    nats.errors.ConnectionReconnectingError):  # no server to drain to (it died): just close
                try:
                    await self.nc.close()
                except (RuntimeError, OSError):
                    # While reconnecting, nats-py writes its unsent buffer into the dead socket
                    # (uvloop: "the handler is closed"; asyncio: "Connection lost") after
                    # marking the client closed: closed it is.
                    log.debug("NATS connection closed while reconnecting; unsent messages dropped")
