"""The NATS API front door: request-reply on ``mesh.api.v1.chat.completions`` /
``mesh.api.v1.completions`` (one queue group over all gateways). A streamed reply is one
message per OpenAI event, the last one marked with ``Meshserve-Done``; errors carry NATS
micro's error headers; every reply of a started request carries ``Meshserve-Request-Id``.

A requester that goes away cancels its request, as an HTTP client's disconnect does: each
streamed message names a gateway inbox as its reply subject, so NATS answers it there with a
503 status when nobody listens on the requester's inbox any more. A requester may also give
a deadline (``Meshserve-Timeout``, seconds), or cancel a streaming request itself on
``mesh.api.v1.cancel`` with the request id (only the key that made it may).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from proto import ApiKeyRecord, PayloadTooLarge

from .auth import presented_key
from .errors import (
    ApiError,
    bad_request,
    deadline_passed,
    internal_error,
    missing_nats_api_key,
    payload_too_large,
    request_not_found,
)
from .events import DONE, EventBuilder
from .lifecycle import ActiveRequest
from .normalized import NormalizedRequest
from .openai_api import RequestKind
from .validation import parse_request_off_loop

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .service import GatewayService

DONE_HEADER = "Meshserve-Done"  # marks the last message of a streamed NATS API reply
REQUEST_ID_HEADER = "Meshserve-Request-Id"
TIMEOUT_HEADER = "Meshserve-Timeout"  # the requester's deadline in seconds: the request is cancelled when it passes
KEY_ID_HEADER = "Meshserve-Key-Id"  # gateway to gateway only (a client cannot publish outside mesh.api.>)
STATUS_HEADER = "Status"  # NATS status messages: "503" answers a message nobody was listening for
# How long the gateway a cancel reached waits for the one relaying the request to answer.
PEER_CANCEL_WAIT_S = 1.0
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _Relay:
    """A NATS API request this gateway relays: whose it is, and how to end it early."""

    __slots__ = ("active", "gone", "key_id", "scope")

    def __init__(self, key_id: str, scope: asyncio.Timeout) -> None:
        self.key_id = key_id
        self.scope = scope  # fired early: the requester went away
        self.active: ActiveRequest | None = None
        self.gone = False


class NatsApi:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.relays: dict[str, _Relay] = {}  # request id → the NATS API requests relayed here
        self._probe_prefix = ""
        self._refused_reply_logged_at = -math.inf

    async def add_endpoints(self) -> None:
        g = self.gateway
        s = g.bus.subjects
        nc = g.bus.nc
        # NATS's 503 "no responders" for a streamed message lands here, under its request id.
        self._probe_prefix = nc.new_inbox()
        await nc.subscribe(f"{self._probe_prefix}.*", cb=self._on_probe_status)
        # Every gateway hears every peer's cancel: only the one relaying the request answers.
        await nc.subscribe(s.gateway_cancel, cb=self._on_peer_cancel)
        await g.add_raw_endpoint("chat", s.api_chat, self.chat, queue_group="gateway")
        await g.add_raw_endpoint("completions", s.api_completions, self.completions, queue_group="gateway")
        await g.add_raw_endpoint("cancel", s.api_cancel, self.cancel, queue_group="gateway")

    async def chat(self, msg: Msg) -> None:
        await self._generate(msg, "chat")

    async def completions(self, msg: Msg) -> None:
        await self._generate(msg, "completion")

    async def _key(self, headers: Mapping[str, str]) -> ApiKeyRecord:
        presented = presented_key(headers)
        if not presented:
            raise missing_nats_api_key()
        return await self.gateway.auth.check(presented)

    def _answerable(self, msg: Msg) -> bool:
        """Whether the gateway may answer on ``msg.reply``: a requester's inbox, not a subject
        only the mesh's services may publish to (its KV buckets and streams, ``$JS``, the
        mesh's own subjects), which a client could otherwise have the gateway write for it."""
        reply = msg.reply
        if not reply:
            return False
        if reply.startswith("$") or reply.startswith(f"{self.gateway.bus.subjects.root}."):
            now = time.monotonic()
            if now - self._refused_reply_logged_at > 60:  # a client could flood the log with them
                self._refused_reply_logged_at = now
                log.warning("NATS API request on %s names %r to answer on: not an inbox, ignored (logged once"
                            " a minute)", msg.subject, reply)
            return False
        return True

    async def _generate(self, msg: Msg, kind: RequestKind) -> None:
        g = self.gateway
        if not self._answerable(msg):
            return
        headers = msg.headers or {}
        stream = False
        try:
            key = await self._key(headers)
            timeout_s = client_timeout(headers)
            if len(msg.data) > g.config.max_body_bytes:
                raise payload_too_large(g.config.max_body_bytes, len(msg.data))
            request = await parse_request_off_loop(kind, msg.data, g.models.specs(), allowed_models=key.models or None)
            stream = request.stream
        except ApiError as exc:
            await self._error(msg.reply, exc, None, stream)
            return
        except Exception:  # the gateway's own failure: the caller still gets an answer, not a timeout
            log.exception("NATS API request on %s failed", msg.subject)
            await self._error(msg.reply, internal_error(), None, stream)
            return
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        request_id: str | None = None
        scope: asyncio.Timeout | None = None
        try:
            # Started outside the deadline: cut while it is placed, a copy a worker already
            # took would run on for nobody. A deadline passed by now fires at once below.
            active = await ActiveRequest.start(g, request, key, parent=g.bus.remote_context(msg))
            request_id = active.request_id
            async with asyncio.timeout_at(deadline) as scope:
                relay = _Relay(key.key_id, scope)
                relay.active = active
                self.relays[request_id] = relay
                try:
                    # Inside serving(): the scope firing (deadline, requester gone) cancels the
                    # relay, which stops the worker as an HTTP client's disconnect does.
                    async with active.serving():
                        if stream:
                            await self._stream(msg.reply, request, active)
                        else:
                            await self._reply(msg.reply, active)
                finally:
                    self.relays.pop(request_id, None)
        except TimeoutError:
            if scope is None or not scope.expired():
                log.exception("NATS API request %s failed", request_id)
                await self._error(msg.reply, internal_error(), request_id, stream)
            elif not relay.gone:  # the deadline: a requester still listening learns why
                assert timeout_s is not None
                await self._error(msg.reply, deadline_passed(timeout_s), request_id, stream)
        except ApiError as exc:
            await self._error(msg.reply, exc, request_id, stream)
        except Exception:
            log.exception("NATS API request %s on %s failed", request_id, msg.subject)
            await self._error(msg.reply, internal_error(), request_id, stream)

    async def _reply(self, reply: str, active: ActiveRequest) -> None:
        g = self.gateway
        body = await active.collect()
        try:  # unchecked, nats-py raises and the caller waits for its timeout
            g.bus.check_payload(body, reply)
        except PayloadTooLarge:
            raise bad_request(
                f"The response is {len(body):,} bytes, more than one NATS message carries here"
                f" (max_payload {g.bus.nc.max_payload:,}). Ask for fewer log probabilities or tokens,"
                " stream it, or use the HTTP API.", None, "response_too_large") from None
        await g.bus.nc.publish(reply, body, headers={REQUEST_ID_HEADER: active.request_id})

    async def _stream(self, reply: str, request: NormalizedRequest, active: ActiveRequest) -> None:
        nc = self.gateway.bus.nc
        builder = EventBuilder(request.kind, active.request_id, request.requested_model, int(time.time()),
                               request.include_usage, request.output)
        probe = f"{self._probe_prefix}.{active.request_id}"  # where NATS says nobody listens any more
        async for chunk in active.chunks():
            events = [e for e in builder.events(chunk, first=chunk.seq == 0) if e.data != DONE]
            last = chunk.finish_reason is not None or chunk.error is not None
            for i, event in enumerate(events):
                headers = {"Meshserve-Event-Id": event.id, REQUEST_ID_HEADER: active.request_id}
                if event.error is not None:
                    headers.update(error_headers(event.error))
                if last and i == len(events) - 1:
                    headers[DONE_HEADER] = "1"  # the last message of this reply
                await nc.publish(reply, event.data, reply=probe, headers=headers)
            if last:
                if not events:  # n > 1 without usage: each choice ended in its own chunk, this one says nothing
                    await nc.publish(reply, b"", headers={REQUEST_ID_HEADER: active.request_id, DONE_HEADER: "1"})
                return
        # Relayed to no final chunk: the reader must still learn that the stream ended.
        await nc.publish(reply, b"", headers={REQUEST_ID_HEADER: active.request_id, DONE_HEADER: "1"})

    async def _error(self, reply: str, exc: ApiError, request_id: str | None, stream: bool) -> None:
        headers = error_headers(exc)
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        if stream:
            headers[DONE_HEADER] = "1"  # a streaming reader waits for this mark: the error ends its stream
        await self.gateway.bus.nc.publish(reply, exc.to_json(), headers=headers)

    async def _on_probe_status(self, msg: Msg) -> None:
        """NATS answered a streamed message: status 503 means the requester's inbox has no
        listener any more (it unsubscribed, closed or lost its connection)."""
        if (msg.headers or {}).get(STATUS_HEADER) != "503":
            return
        relay = self.relays.get(msg.subject.rpartition(".")[2])
        if relay is not None and not relay.gone:
            relay.gone = True
            relay.scope.reschedule(asyncio.get_running_loop().time())  # ends the relay now: client_gone

    # ---- cancel ---------------------------------------------------------------------
    async def cancel(self, msg: Msg) -> None:
        """``mesh.api.v1.cancel``: stop a request of the caller's key, named by a
        ``Meshserve-Request-Id`` header or a ``{"id": ...}`` body. Answers
        ``{"id", "object": "request.cancel", "cancelled": true}`` or an OpenAI error (404 for
        an id not in flight for this key)."""
        if not self._answerable(msg):
            return
        nc = self.gateway.bus.nc
        headers = msg.headers or {}
        request_id: str | None = None
        try:
            key = await self._key(headers)
            request_id = cancel_target(headers, msg.data)
            answered = self._cancel_here(request_id, key.key_id)
            if answered is None:
                data, reply_headers = await self._cancel_elsewhere(request_id, key.key_id)
            else:
                data, reply_headers = answered
        except ApiError as exc:
            await self._error(msg.reply, exc, request_id, False)
            return
        await nc.publish(msg.reply, data, headers=reply_headers)

    def _cancel_here(self, request_id: str, key_id: str) -> tuple[bytes, dict[str, str]] | None:
        """The answer when this gateway relays ``request_id``, else None. Stopped, not cut: the
        requester still gets the worker's final chunk (finish ``abort``) and its usage."""
        relay = self.relays.get(request_id)
        if relay is None:
            return None
        if relay.key_id != key_id:  # another key's request: answered as an unknown id (ids are not revealed)
            error = request_not_found(request_id)
            return error.to_json(), {**error_headers(error), REQUEST_ID_HEADER: request_id}
        if relay.active is not None:
            g = self.gateway
            g.spawn(relay.active.stop("client_cancelled"), name=f"stop-{request_id}")
        ack = {"id": request_id, "object": "request.cancel", "cancelled": True}
        return msgspec.json.encode(ack), {REQUEST_ID_HEADER: request_id}

    async def _cancel_elsewhere(self, request_id: str, key_id: str) -> tuple[bytes, dict[str, str]]:
        nc = self.gateway.bus.nc
        try:
            answer = await nc.request(self.gateway.bus.subjects.gateway_cancel, b"", timeout=PEER_CANCEL_WAIT_S,
                                      headers={REQUEST_ID_HEADER: request_id, KEY_ID_HEADER: key_id})
        except (NatsTimeoutError, NoRespondersError):  # no gateway relays it
            raise request_not_found(request_id) from None
        return answer.data, dict(answer.headers or {})

    async def _on_peer_cancel(self, msg: Msg) -> None:
        headers = msg.headers or {}
        answered = self._cancel_here(headers.get(REQUEST_ID_HEADER, ""), headers.get(KEY_ID_HEADER, ""))
        if answered is not None and msg.reply:  # silent unless it is ours: the asker takes the first answer
            await self.gateway.bus.nc.publish(msg.reply, answered[0], headers=answered[1])


def client_timeout(headers: Mapping[str, str]) -> float | None:
    """The requester's ``Meshserve-Timeout`` in seconds, None without one; 400 when malformed."""
    value = next((v for k, v in headers.items() if k.lower() == TIMEOUT_HEADER.lower()), None)
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):
        raise bad_request(f"The {TIMEOUT_HEADER} header must be a positive number of seconds.", TIMEOUT_HEADER,
                          "invalid_value")
    return seconds


def cancel_target(headers: Mapping[str, str], data: bytes) -> str:
    """The request id a cancel names: its ``Meshserve-Request-Id`` header, else ``{"id": ...}``."""
    request_id: object = next((v for k, v in headers.items() if k.lower() == REQUEST_ID_HEADER.lower()), None)
    if request_id is None and data.strip():
        try:
            body = msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):
            body = None
        request_id = body.get("id") if isinstance(body, dict) else None
    if not isinstance(request_id, str) or not _REQUEST_ID_RE.fullmatch(request_id):
        raise bad_request(f"Name the request to cancel: its id (the {REQUEST_ID_HEADER} header of its replies) in a"
                          f" {REQUEST_ID_HEADER} header or a JSON body {{\"id\": ...}}.", "id", "invalid_value")
    return request_id


def error_headers(exc: ApiError) -> dict[str, str]:
    headers = {"Nats-Service-Error": exc.message[:200], "Nats-Service-Error-Code": str(exc.status)}
    headers.update(exc.headers())
    return headers
