"""The WebSocket front door (``GET /v1/ws``): many requests on one socket, each tagged with
the client's id, each cancellable. Authenticated per socket (``?api_key=``, a key header,
the subprotocol ``openai-insecure-api-key.<KEY>`` as OpenAI's Realtime API takes it from
browsers, or an ``{"type": "auth"}`` message within ``AUTH_TIMEOUT_S``), and the credential
checked again before each request: a revoked key or an expired token closes the socket."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, hdrs, web

from proto import ApiKeyRecord

from .auth import presented_key
from .errors import ApiError, from_mesh_error, internal_error, missing_api_key
from .lifecycle import ActiveRequest, cut_slow_client
from .normalized import NormalizedRequest, parse_ws_message
from .openai_api import WsAuth, WsCancel, ws_done, ws_token
from .validation import parse_ws_request_off_loop

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .service import GatewayService

Send = Callable[[bytes], Awaitable[None]]

AUTH_TIMEOUT_S = 10.0  # a socket that has not authenticated by then is closed (its pings keep it open otherwise)
KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."  # OpenAI Realtime's browser convention: the key as a subprotocol
# What the server answers to a key offered as a subprotocol (a browser fails a handshake
# that selects none): ``realtime`` when offered too, as OpenAI's server does.
ANSWERED_PROTOCOLS = ("realtime",)


def key_subprotocol(header: str) -> tuple[str | None, str | None]:
    """(the key offered as ``openai-insecure-api-key.<KEY>``, the subprotocol to answer with),
    from a ``Sec-WebSocket-Protocol`` header; (None, None) without such a key."""
    offered = [p.strip() for p in header.split(",") if p.strip()]
    keyed = next((p for p in offered if p.startswith(KEY_PROTOCOL_PREFIX)), None)
    if keyed is None:
        return None, None
    # Only one the client offered may be answered; the key's own when there is no other,
    # which also keeps aiohttp from logging the offered protocols (the key) as unknown.
    answer = next((p for p in offered if p in ANSWERED_PROTOCOLS), keyed)
    return keyed[len(KEY_PROTOCOL_PREFIX):] or None, answer


class WsApi:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/ws", self.socket)]

    async def socket(self, http: web.Request) -> web.WebSocketResponse:
        g = self.gateway
        protocol_key, answer = key_subprotocol(http.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, ""))
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=g.config.max_body_bytes,
                                   protocols=(answer,) if answer else ())
        await ws.prepare(http)
        key: ApiKeyRecord | None = None
        presented: str | None = None  # checked again before each request (revocation, token expiry)
        try:
            presented = http.query.get("api_key") or presented_key(http.headers) or protocol_key
            if presented:
                key = await g.auth.check(presented)
        except ApiError as exc:
            await ws.send_str(exc.to_ws(None).decode())
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"authentication failed")
            return ws
        running: dict[str, _WsJob] = {}
        send_lock = asyncio.Lock()

        async def send(data: bytes) -> None:
            async with send_lock:
                await ws.send_str(data.decode())

        auth_deadline = asyncio.get_running_loop().time() + AUTH_TIMEOUT_S
        try:
            while True:
                try:
                    # timeout=None waits for good; unauthenticated, the socket has until auth_deadline.
                    wait = None if key is not None else max(auth_deadline - asyncio.get_running_loop().time(), 1e-3)
                    message = await ws.receive(timeout=wait)
                except TimeoutError:
                    refused = ApiError(401, f"No API key within {AUTH_TIMEOUT_S:g}s of connecting: send"
                                            ' {"type": "auth", "api_key": "msk-..."} first.', "invalid_request_error",
                                       None, "missing_api_key")
                    await send(refused.to_ws(None))
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"no authentication")
                    break
                if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
                if message.type != WSMsgType.TEXT:
                    if message.type == WSMsgType.BINARY:
                        await send(ApiError(400, "send JSON text frames", "invalid_request_error").to_ws(None))
                    continue
                try:
                    parsed = parse_ws_message(message.data)
                    if isinstance(parsed, WsAuth):
                        try:
                            key = await g.auth.check(parsed.api_key)
                        except ApiError as exc:
                            # A bad key closes the socket (README), as one in the URL or a
                            # header does: it stayed open, taking guesses until the deadline.
                            await send(exc.to_ws(None))
                            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"authentication failed")
                            break
                        presented = parsed.api_key
                        continue
                    if isinstance(parsed, WsCancel):
                        job = running.get(parsed.id)
                        if job is not None:
                            job.stop()
                        continue
                    if key is None or presented is None:
                        raise missing_api_key()
                    try:
                        # The live record, not the one of the socket's start: a key revoked
                        # since (or a token past its exp) is refused, and new limits apply.
                        key = await g.auth.check(presented)
                    except ApiError as exc:
                        await send(exc.to_ws(parsed.id))
                        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"credential no longer valid")
                        break
                    if parsed.id in running:
                        # id null: an error frame under that id would read as the running request's end
                        duplicate = ApiError(400, f"request id {parsed.id!r} is already in flight on this socket: the"
                                                  " new request was refused, the running one goes on",
                                             "invalid_request_error", "id")
                        await send(duplicate.to_ws(None))
                        continue
                    request = await parse_ws_request_off_loop(parsed, g.models.specs(), allowed_models=key.models or None)
                except ApiError as exc:
                    await send(exc.to_ws(_message_id(message.data)))
                    continue
                except Exception:  # the gateway's own failure: an error frame, and the socket lives on
                    log.exception("WebSocket message failed")
                    await send(internal_error().to_ws(_message_id(message.data)))
                    continue
                job = _WsJob(g)
                job.task = asyncio.create_task(self._request(http, send, parsed.id, request, key, job))
                running[parsed.id] = job
                job.task.add_done_callback(functools.partial(_forget, running, parsed.id))
        finally:
            tasks = [job.task for job in running.values() if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return ws

    async def _request(self, http: web.Request, send: Send, client_id: str, request: NormalizedRequest,
                       key: ApiKeyRecord, job: _WsJob) -> None:
        try:
            active = await ActiveRequest.start(self.gateway, request, key, client_address=self.gateway.client_address(http))
        except ApiError as exc:
            await send(exc.to_ws(client_id))
            return
        except Exception:  # without an answer the client would wait on this id for good
            log.exception("WebSocket request %s failed to start", client_id)
            await send(internal_error().to_ws(client_id))
            return
        job.active = active
        # A reader that stopped reading blocks every send on the socket: cut it as SSE does.
        active.stream.on_overflow = functools.partial(cut_slow_client, http.transport, active)
        # The socket closing cancels this task: nobody is left to tell, so the worker stops too.
        async with active.serving():
            if job.stop_requested:  # the cancel came while the request was being admitted and placed
                await active.stop("client_cancelled")
            assembler = active.assembler()
            single = request.output.n <= 1
            async for chunk in active.chunks():
                if chunk.error is not None:
                    err = from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
                    await send(with_request_id(err.to_ws(client_id), active.request_id))
                    return
                finish: str | None = chunk.finish_reason
                stop_reason: int | str | None = None
                for delta in assembler.deltas(chunk):
                    extra: dict[str, Any] = {"index": delta.index, "reasoning_content": delta.reasoning,
                                             "tool_calls": delta.tool_calls or None,
                                             "logprobs": delta.chat_logprobs if delta.chat_logprobs is not None
                                             else delta.completion_logprobs}
                    if single:
                        finish = delta.finish_reason or finish  # "tool_calls" where the parser found calls
                        stop_reason = delta.stop_reason if delta.finish_reason else stop_reason
                    else:
                        extra["finish_reason"] = delta.finish_reason
                        extra["stop_reason"] = delta.stop_reason
                    if delta.has_output or extra["tool_calls"] or (not single and delta.finish_reason):
                        await send(ws_token(client_id, chunk.seq, delta.content, delta.token_ids, **extra))
                if chunk.finish_reason is not None:
                    # After a cancel this is the worker's "abort" chunk: its usage is what was billed.
                    done = ws_done(client_id, finish, assembler.usage(chunk.usage) if chunk.usage else None,
                                   stop_reason)
                    await send(with_request_id(done, active.request_id))


def with_request_id(frame: bytes, request_id: str) -> bytes:
    """``frame`` (a JSON object) with the mesh request id as its last field, ``request_id``:
    the id the gateway's logs, traces and usage records know the request by."""
    return frame[:-1] + b',"request_id":' + msgspec.json.encode(request_id) + b"}"


def _message_id(data: str) -> str | None:
    """The client's request id of a WebSocket message that failed validation, if it has one."""
    try:
        value = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):  # the message may be nested past the decoder's stack
        return None
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, str) else None


class _WsJob:
    """One request on a WebSocket: its relay task and, once placed, its request."""

    __slots__ = ("active", "gateway", "stop_requested", "task")

    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.task: asyncio.Task[None] | None = None
        self.active: ActiveRequest | None = None
        self.stop_requested = False

    def stop(self) -> None:
        """The client's cancel: the worker stops, the relay runs on to its final usage."""
        self.stop_requested = True
        if self.active is not None:
            self.gateway.spawn(self.active.stop("client_cancelled"), name=f"stop-{self.active.request_id}")


def _forget(running: dict[str, _WsJob], request_id: str, _task: asyncio.Task[None]) -> None:
    running.pop(request_id, None)
