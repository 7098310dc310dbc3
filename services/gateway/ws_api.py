"""The WebSocket front door (``GET /v1/ws``): many requests on one socket, each tagged with
the client's id, each cancellable. Authenticated once per socket (``?api_key=``, a key
header, or a first ``{"type": "auth"}`` message)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import WSMsgType, web

from proto import ApiKeyRecord

from .auth import presented_key
from .errors import ApiError, from_mesh_error, internal_error, missing_api_key
from .lifecycle import ActiveRequest
from .normalized import NormalizedRequest, parse_ws_message
from .openai_api import WsAuth, WsCancel, ws_done, ws_token
from .validation import parse_ws_request

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .service import GatewayService

Send = Callable[[bytes], Awaitable[None]]


class WsApi:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/ws", self.socket)]

    async def socket(self, http: web.Request) -> web.WebSocketResponse:
        g = self.gateway
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=g.config.max_body_bytes)
        await ws.prepare(http)
        key: ApiKeyRecord | None = None
        try:
            presented = http.query.get("api_key") or presented_key(http.headers)
            if presented:
                key = await g.auth.check(presented)
        except ApiError as exc:
            await ws.send_str(exc.to_ws(None).decode())
            await ws.close()
            return ws
        running: dict[str, _WsJob] = {}
        send_lock = asyncio.Lock()

        async def send(data: bytes) -> None:
            async with send_lock:
                await ws.send_str(data.decode())

        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    if message.type == WSMsgType.BINARY:
                        await send(ApiError(400, "send JSON text frames", "invalid_request_error").to_ws(None))
                    continue
                try:
                    parsed = parse_ws_message(message.data)
                    if isinstance(parsed, WsAuth):
                        key = await g.auth.check(parsed.api_key)
                        continue
                    if isinstance(parsed, WsCancel):
                        job = running.get(parsed.id)
                        if job is not None:
                            job.stop()
                        continue
                    if key is None:
                        raise missing_api_key()
                    if parsed.id in running:
                        # id null: an error frame under that id would read as the running request's end
                        duplicate = ApiError(400, f"request id {parsed.id!r} is already in flight on this socket: the"
                                                  " new request was refused, the running one goes on",
                                             "invalid_request_error", "id")
                        await send(duplicate.to_ws(None))
                        continue
                    request = parse_ws_request(parsed, g.models.specs(), allowed_models=key.models or None)
                except ApiError as exc:
                    await send(exc.to_ws(_message_id(message.data)))
                    continue
                except Exception:  # the gateway's own failure: an error frame, and the socket lives on
                    log.exception("WebSocket message failed")
                    await send(internal_error().to_ws(_message_id(message.data)))
                    continue
                job = _WsJob(g)
                job.task = asyncio.create_task(self._request(send, parsed.id, request, key, job))
                running[parsed.id] = job
                job.task.add_done_callback(functools.partial(_forget, running, parsed.id))
        finally:
            tasks = [job.task for job in running.values() if job.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return ws

    async def _request(self, send: Send, client_id: str, request: NormalizedRequest, key: ApiKeyRecord, job: _WsJob) -> None:
        try:
            active = await ActiveRequest.start(self.gateway, request, key)
        except ApiError as exc:
            await send(exc.to_ws(client_id))
            return
        except Exception:  # without an answer the client would wait on this id for good
            log.exception("WebSocket request %s failed to start", client_id)
            await send(internal_error().to_ws(client_id))
            return
        job.active = active
        # The socket closing cancels this task: nobody is left to tell, so the worker stops too.
        async with active.serving():
            if job.stop_requested:  # the cancel came while the request was being admitted and placed
                await active.stop("client_cancelled")
            assembler = active.assembler()
            single = request.output.n <= 1
            async for chunk in active.chunks():
                if chunk.error is not None:
                    err = from_mesh_error(chunk.error.code or "internal", chunk.error.message, chunk.error.retry_after)
                    await send(err.to_ws(client_id))
                    return
                finish: str | None = chunk.finish_reason
                for delta in assembler.deltas(chunk):
                    extra: dict[str, Any] = {"index": delta.index, "reasoning_content": delta.reasoning,
                                             "tool_calls": delta.tool_calls or None,
                                             "logprobs": delta.chat_logprobs if delta.chat_logprobs is not None
                                             else delta.completion_logprobs}
                    if single:
                        finish = delta.finish_reason or finish  # "tool_calls" where the parser found calls
                    else:
                        extra["finish_reason"] = delta.finish_reason
                    if delta.has_output or extra["tool_calls"] or (not single and delta.finish_reason):
                        await send(ws_token(client_id, chunk.seq, delta.content, delta.token_ids, **extra))
                if chunk.finish_reason is not None:
                    # After a cancel this is the worker's "abort" chunk: its usage is what was billed.
                    await send(ws_done(client_id, finish, assembler.usage(chunk.usage) if chunk.usage else None))


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
