"""Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens`` over HTTP.

Thin, like ``responses_http``: a Messages body becomes a chat completions body
(``anthropic_api.plan_messages``), which goes through ``validation.parse_request`` and
``ActiveRequest`` exactly as ``/v1/chat/completions`` does; the chat answer is
translated back. Errors, the key check's 401 included, leave in Anthropic's shape
(``http_api``'s error middleware asks ``anthropic_api.ANTHROPIC_PATH``).
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry.propagate import extract

from proto import ApiKeyRecord

from .anthropic_api import MessagesPlan, count_tokens_body, parse_messages_request, plan_messages
from .anthropic_output import MessageContext, MessageStream, message_from_chat
from .auth import REQUEST_MODEL, REQUEST_STARTED, authenticated
from .errors import ApiError, invalid_json
from .http_body import read_body
from .lifecycle import ActiveRequest, chat_event_dicts, is_error_event
from .normalized import NormalizedRequest
from .openai_api import encode_json
from .tokenize_api import tokenize
from .validation import off_loop, parse_cost, parse_request_off_loop

if TYPE_CHECKING:
    from .auth import Authenticator
    from .http_api import HttpApi  # which imports this module: only its type here

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class AnthropicHttp:
    """The Messages routes of one gateway's HTTP API."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.gateway = api.gateway

    @property
    def auth(self) -> Authenticator:
        return self.api.auth

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.create), web.post("/v1/messages/count_tokens", self.count_tokens)]

    @authenticated
    async def create(self, http: web.Request, key: ApiKeyRecord) -> web.StreamResponse:
        g = self.gateway
        plan, chat_body = chat_form(await read_body(http, g.config.max_body_bytes))
        try:
            request = await parse_request_off_loop("chat", chat_body, g.models.specs(),
                                                   allowed_models=key.models or None)
        except ApiError as exc:
            raise plan.api_error(exc) from None
        http[REQUEST_MODEL] = request.model
        active = await ActiveRequest.start(g, request, key, parent=extract(dict(http.headers)),
                                           client_address=g.client_address(http))
        http[REQUEST_STARTED] = True
        ctx = MessageContext(request_id=active.request_id, model=request.requested_model,
                             input_tokens=request.prompt_tokens)
        headers = {"X-Request-Id": active.request_id, "request-id": active.request_id}  # the latter: Anthropic's name
        async with active.serving():
            if not plan.stream:
                message = message_from_chat(json.loads(await active.collect()), ctx)
                return web.Response(body=encode_json(message), content_type="application/json", headers=headers)
            return await self._stream(http, active, request, ctx, headers)

    async def _stream(self, http: web.Request, active: ActiveRequest, request: NormalizedRequest, ctx: MessageContext,
                      headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await response.prepare(http)
        stream = MessageStream(ctx)
        await response.write(stream.start())
        async with contextlib.aclosing(chat_event_dicts(active, request, http.transport)) as chunks:
            async for events in chunks:
                frames = [stream.finish() if data is None else stream.fail(data["error"]) if is_error_event(data)
                          else stream.feed(data) for data in events]
                if any(frames):
                    await response.write(b"".join(frames))
                if stream.done:
                    break
        return response

    @authenticated
    async def count_tokens(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        """The prompt tokens the same body would take on ``/v1/messages`` (the gateway's
        tokenizer and chat template, as ``/tokenize`` counts them)."""
        body = await read_body(http, self.gateway.config.max_body_bytes)
        plan, chat_body = chat_form(body, count_only=True)
        try:
            answer = await off_loop(parse_cost(chat_body), tokenize, chat_body, self.gateway.models.specs(),
                                    allowed_models=key.models or None)
        except ApiError as exc:
            raise plan.api_error(exc) from None
        return web.json_response({"input_tokens": answer.count})


def chat_form(body: bytes, *, count_only: bool = False) -> tuple[MessagesPlan, bytes]:
    """The plan and the encoded chat body of a Messages body (``count_only``: the chat
    form of ``/tokenize`` for ``count_tokens``). A tool's input or schema nested past what
    the encoder can recurse is the body's fault, as deep JSON is elsewhere."""
    try:
        if count_only:
            chat, plan = count_tokens_body(*parse_messages_request(body, count_only=True))
            return plan, encode_json(chat)
        plan = plan_messages(*parse_messages_request(body))
        return plan, encode_json(plan.body)
    except RecursionError:
        raise invalid_json("JSON nested too deeply") from None
