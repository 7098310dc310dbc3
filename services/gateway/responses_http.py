"""``/v1/responses`` over HTTP: create (streamed or not), retrieve, list its input items, delete.

Thin, like ``http_api``: a Responses body becomes a chat completions body
(``responses_api.plan_chat``), which goes through ``validation.parse_request`` and
``ActiveRequest`` exactly as ``/v1/chat/completions`` does; the chat answer is
translated back (``responses_output``). Stored responses live in the ``response_store``
KV bucket, under the caller's org: another org's id is a 404 like an unknown one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry.propagate import extract

from proto import ApiKeyRecord

from .auth import REQUEST_MODEL, REQUEST_STARTED, authenticated
from .errors import ApiError, bad_request, overloaded
from .http_body import read_body
from .lifecycle import ActiveRequest, chat_event_dicts, is_error_event
from .normalized import NormalizedRequest
from .openai_api import encode_json
from .response_store import ResponseStore, StoredResponse, responses_bucket
from .responses_api import (
    RESPONSE_ID,
    ChatPlan,
    parse_responses_request,
    plan_chat,
)
from .responses_output import (
    ResponseContext,
    ResponseStream,
    input_items_page,
    response_from_chat,
    stored_history,
)
from .validation import parse_request_off_loop

if TYPE_CHECKING:
    from .auth import Authenticator
    from .http_api import HttpApi  # which imports this module: only its type here

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def response_not_found(response_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return ApiError(404, f"{what} with id '{response_id[:80]}' not found.", "invalid_request_error", param, "not_found")


class ResponsesHttp:
    """The Responses routes of one gateway's HTTP API."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.gateway = api.gateway
        self._store: ResponseStore | None = None
        self._store_lock = asyncio.Lock()

    @property
    def auth(self) -> Authenticator:
        return self.api.auth

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{response_id}", self.retrieve),
            web.get("/v1/responses/{response_id}/input_items", self.input_items),
            web.delete("/v1/responses/{response_id}", self.delete),
            web.post("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    async def store(self) -> ResponseStore:
        """The store, its bucket opened (created) on first use; 503 while JetStream cannot."""
        async with self._store_lock:
            if self._store is None:
                g = self.gateway
                try:
                    kv = await responses_bucket(g.bus.js, g.bus.subjects, ttl_s=g.config.responses_ttl_s,
                                                replicas=g.settings.js_replicas)
                except Exception as exc:
                    raise store_unavailable(exc) from exc
                self._store = ResponseStore(kv, g.bus.max_payload)
            return self._store

    async def _load(self, key: ApiKeyRecord, response_id: str, param: str | None = None) -> StoredResponse:
        if not RESPONSE_ID.match(response_id):
            raise response_not_found(response_id, param)
        store = await self.store()
        try:
            stored = await store.load(key.org, response_id)
        except Exception as exc:
            raise store_unavailable(exc) from exc
        if stored is None:
            raise response_not_found(response_id, param)
        return stored

    # ---- create -------------------------------------------------------------------------
    @authenticated
    async def create(self, http: web.Request, key: ApiKeyRecord) -> web.StreamResponse:
        g = self.gateway
        parsed = parse_responses_request(await read_body(http, g.config.max_body_bytes))
        history = None
        previous_id = parsed.request.previous_response_id
        if previous_id is not None:
            previous = await self._load(key, previous_id, "previous_response_id")
            history = stored_history(previous.conversation, previous.response)
        plan = plan_chat(parsed, history)
        try:
            request = await parse_request_off_loop("chat", encode_json(plan.body), g.models.specs(),
                                                   allowed_models=key.models or None)
        except ApiError as exc:
            raise plan.api_error(exc) from None
        store = await self.store() if parsed.store else None  # before generating: a store that cannot open is a 503 now
        http[REQUEST_MODEL] = request.model
        active = await ActiveRequest.start(g, request, key, parent=extract(dict(http.headers)),
                                           client_address=g.client_address(http))
        http[REQUEST_STARTED] = True
        ctx = ResponseContext(request_id=active.request_id, created_at=active.record.created, model=request.requested_model,
                              plan=plan, request=parsed.request, temperature=request.sampling.temperature,
                              top_p=request.sampling.top_p, store=parsed.store)
        async with active.serving():
            if not parsed.stream:
                completion = json.loads(await active.collect())
                response = response_from_chat(completion, ctx)
                await self._save(store, key, plan, response)
                return web.Response(body=encode_json(response), content_type="application/json",
                                    headers={"X-Request-Id": active.request_id})
            return await self._stream(http, active, request, ctx, store, key, plan)

    async def _stream(self, http: web.Request, active: ActiveRequest, request: NormalizedRequest, ctx: ResponseContext,
                      store: ResponseStore | None, key: ApiKeyRecord, plan: ChatPlan) -> web.StreamResponse:
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": active.request_id})
        await response.prepare(http)
        stream = ResponseStream(ctx)
        await response.write(stream.start())
        async with contextlib.aclosing(chat_event_dicts(active, request, http.transport)) as chunks:
            async for events in chunks:
                frames: list[bytes] = []
                for data in events:
                    if data is None:
                        frames.append(stream.finish())
                    else:
                        frames.append(stream.fail(data["error"]) if is_error_event(data) else stream.feed(data))
                    if stream.response is not None:
                        # Stored before its last event goes out: a client that continues from
                        # response.completed at once finds it.
                        await self._save(store, key, plan, stream.response)
                        frames.append(stream.final())
                        break
                if any(frames):
                    await response.write(b"".join(frames))
                if stream.response is not None:
                    break
        return response

    async def _save(self, store: ResponseStore | None, key: ApiKeyRecord, plan: ChatPlan, response: dict[str, Any]) -> None:
        if store is None:
            return
        if not await store.save(key.org, StoredResponse(response=response, conversation=plan.conversation)):
            response["store"] = False  # the truth: it cannot be retrieved or continued

    # ---- retrieve, delete ---------------------------------------------------------------
    @authenticated
    async def retrieve(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        if http.query.get("stream", "").lower() in ("1", "true"):
            raise bad_request("Streaming a stored response is not supported: retrieve it without 'stream'.", "stream",
                              "unsupported_parameter")
        stored = await self._load(key, http.match_info["response_id"])
        return web.Response(body=encode_json(stored.response), content_type="application/json")

    @authenticated
    async def input_items(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        """The items a stored response answered, paged as OpenAI's (``after``, ``limit``,
        ``order``; ``include`` adds nothing: the items carry all they have)."""
        stored = await self._load(key, http.match_info["response_id"])
        query = http.query
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise bad_request(f"Invalid 'limit': {query['limit'][:40]!r} is not an integer.", "limit", "invalid_value") from None
        try:
            page = input_items_page(stored.response["id"], stored.conversation, after=query.get("after"), limit=limit,
                                    order=query.get("order", "desc"))
        except ValueError as exc:
            param, _, detail = str(exc).partition(": ")
            raise bad_request(f"Invalid '{param}': {detail}.", param, "invalid_value") from None
        return web.Response(body=encode_json(page), content_type="application/json")

    @authenticated
    async def delete(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        response_id = http.match_info["response_id"]
        if not RESPONSE_ID.match(response_id):
            raise response_not_found(response_id)
        store = await self.store()
        try:
            deleted = await store.delete(key.org, response_id)
        except Exception as exc:
            raise store_unavailable(exc) from exc
        if not deleted:
            raise response_not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})


    @authenticated
    async def cancel(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        """OpenAI cancels background responses only; this server answers every response
        in the foreground, so a stored one is finished: OpenAI's 400 for it, 404 unknown."""
        await self._load(key, http.match_info["response_id"])
        raise bad_request("Cannot cancel a synchronous response: only responses created with background true can"
                          " be cancelled, and this server runs none in the background.", None, "invalid_request")


def store_unavailable(exc: BaseException) -> ApiError:
    return overloaded(f"The response store is unavailable right now ({type(exc).__name__}); try again.", 1.0, 503,
                      "store_unavailable")
