"""The HTTP front door: OpenAI's routes (SSE streaming included), resume, models, usage,
health, metrics and the chat page. Thin: authenticate (``auth.authenticated``), parse
(``validation``), start the request (``lifecycle.ActiveRequest``), write what it relays.
Every error leaves as OpenAI's error JSON (``error_middleware``), never a 500 page; on
Anthropic's Messages routes, as Anthropic's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry.propagate import extract
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proto import ApiKeyRecord, ErrorCode, MeshError, TokenChunk, __version__
from proto.metering import UsageReport
from services.common.usage import org_usage_query, usage_report_json

from .anthropic_api import ANTHROPIC_PATH
from .anthropic_http import AnthropicHttp
from .anthropic_output import anthropic_error_body
from .auth import AUTH_MS, REQUEST_MODEL, REQUEST_STARTED, Authenticator, authenticated
from .errors import (
    ApiError,
    from_mesh_error,
    internal_error,
    method_not_allowed,
    model_not_found,
    payload_too_large,
    unknown_url,
)
from .events import EventBuilder, parse_event_id
from .http_body import read_body
from .lifecycle import ActiveRequest, cut_slow_client, on_client_gone
from .local import is_local_request
from .models import ModelSpec
from .normalized import NormalizedRequest, model_allowed
from .openai_api import ModelCard, ModelList, RequestKind, encode_json, sse_event
from .output import merge_batch
from .responses_http import ResponsesHttp
from .resume import ResumedStream
from .tokenize_api import tokenize_routes
from .validation import looks_batched, parse_batch_off_loop, parse_request_off_loop

if TYPE_CHECKING:
    from .service import GatewayService

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


def page_security_headers(html: bytes, host: str) -> dict[str, str]:
    """The chat page's headers: it runs its own inline script and style (allowed by their
    hashes, of the bytes served) and talks to this gateway only; nothing may frame it (it
    holds a key)."""
    def sha256(tag: str) -> str:
        body = html.split(f"<{tag}>".encode(), 1)[1].split(f"</{tag}>".encode(), 1)[0]
        return "'sha256-" + base64.b64encode(hashlib.sha256(body).digest()).decode() + "'"

    sockets = f" ws://{host} wss://{host}" if re.fullmatch(r"[A-Za-z0-9.\-]+(:\d+)?|\[[0-9A-Fa-f:.]+\](:\d+)?", host) else ""
    policy = (f"default-src 'none'; script-src {sha256('script')}; style-src {sha256('style')}; img-src 'self';"
              f" connect-src 'self'{sockets}; base-uri 'none'; form-action 'none';"
              " frame-ancestors 'none'")
    return {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
# The routes that generate, and the ``api`` label their requests are counted under.
GENERATION_APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "chat",
                   "/v1/messages": "chat"}
RESUMABLE_HEADER = "X-Meshserve-Resumable"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def model_card(name: str, spec: ModelSpec, created: int) -> ModelCard:
    """The ``/v1/models`` entry of ``name``; an adapter's names its base, as vLLM's does."""
    if spec.lora is not None:
        return ModelCard(id=name, created=created, owned_by="meshserve", max_model_len=spec.limits.max_model_len,
                         root=spec.lora_path, parent=spec.name)
    return ModelCard(id=name, created=created, owned_by="meshserve", max_model_len=spec.limits.max_model_len,
                     root=spec.name)


def error_response(exc: ApiError, anthropic: bool = False) -> web.Response:
    """The error's JSON: OpenAI's shape, or Anthropic's on its Messages routes."""
    body = anthropic_error_body(exc) if anthropic else exc.to_json()
    return web.Response(status=exc.status, body=body, content_type="application/json", headers=exc.headers())


class HttpApi:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    @property
    def auth(self) -> Authenticator:
        return self.gateway.auth

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            *ResponsesHttp(self).routes(),
            *AnthropicHttp(self).routes(),
            *tokenize_routes(self.gateway),
            web.get("/v1/requests/{request_id}/stream", self.resume),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
            web.get("/v1/usage", self.usage),
            web.get("/healthz", self.health),
            web.get("/health", self.health),  # vLLM's name: benchmark clients and routers probe it
            web.get("/ping", self.ping),  # vLLM's (SageMaker's health check), GET and POST
            web.post("/ping", self.ping),
            web.get("/version", self.version),  # vLLM's: {"version": ...}
            web.get("/readyz", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/", self.index),
            web.get("/favicon.ico", self.favicon),
            web.get("/dev-key", self.dev_key),
        ]

    @web.middleware
    async def error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response = await self._answer(request, handler)
        api = GENERATION_APIS.get(request.path)
        if api is not None and response.status >= 400 and not request.get(REQUEST_STARTED):
            # Refused before it ran (a bad body, key, quota or model; admission's 429): the
            # dashboard's request rates see refusals too, by their HTTP status.
            self.gateway.metrics.requests.labels(api=api, model=request.get(REQUEST_MODEL, ""),
                                                 status=str(response.status)).inc()
        return response

    async def _answer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            if isinstance(exc, web.HTTPException) and exc.status < 400:
                raise  # a redirect or another answer that is not an error
            path = request.path
            anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
            response = error_response(self._api_error(request, exc), anthropic)
            if isinstance(exc, web.HTTPMethodNotAllowed):
                response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return response

    def _api_error(self, request: web.Request, exc: Exception) -> ApiError:
        """What a handler raised, as the client's error."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return payload_too_large(self.gateway.config.max_body_bytes, getattr(exc, "actual_size", None))
        if isinstance(exc, web.HTTPMethodNotAllowed):
            return method_not_allowed(request.method, request.path, exc.allowed_methods)
        if isinstance(exc, web.HTTPNotFound):
            # Unknown paths (/v1/embeddings, typos) answer like OpenAI, not with text/plain.
            return unknown_url(request.method, request.path)
        if isinstance(exc, web.HTTPException):
            # aiohttp's own text says what was wrong (e.g. a plain GET on /v1/ws); its default is "400: Bad Request".
            detail = " ".join((exc.text or exc.reason).split())
            return ApiError(exc.status, detail, "invalid_request_error" if exc.status < 500 else "server_error")
        log.exception("unhandled error on %s", request.path, exc_info=exc)
        return internal_error()

    # ---- generation ---------------------------------------------------------------------
    @authenticated
    async def chat(self, http: web.Request, key: ApiKeyRecord) -> web.StreamResponse:
        return await self._generate(http, key, "chat")

    @authenticated
    async def completions(self, http: web.Request, key: ApiKeyRecord) -> web.StreamResponse:
        return await self._generate(http, key, "completion")

    async def _generate(self, http: web.Request, key: ApiKeyRecord, kind: RequestKind) -> web.StreamResponse:
        g = self.gateway
        started = time.perf_counter()
        body = await read_body(http, g.config.max_body_bytes)
        if kind == "completion" and looks_batched(body):
            batch = await parse_batch_off_loop(body, g.models.specs(), allowed_models=key.models or None)
            if batch is not None:
                return await self._generate_batch(http, key, batch)
        request = await parse_request_off_loop(kind, body, g.models.specs(), allowed_models=key.models or None)
        http[REQUEST_MODEL] = request.model
        # the key check, then body, validation, template, tokenizer
        parsed = [("auth", http.get(AUTH_MS, 0.0)), ("parse", (time.perf_counter() - started) * 1000)]
        resumable = request.stream and http.headers.get(RESUMABLE_HEADER, "").lower() in ("1", "true", "yes")
        active = await ActiveRequest.start(g, request, key, parent=extract(dict(http.headers)), resumable=resumable,
                                           client_address=g.client_address(http))
        http[REQUEST_STARTED] = True
        # Where the gateway's time went before the worker had the request (W3C Server-Timing).
        headers = {"X-Request-Id": active.request_id, "Server-Timing": active.phases.header(parsed)}
        async with active.serving():
            if not request.stream:
                return web.Response(body=await active.collect(), content_type="application/json", headers=headers)
            response = web.StreamResponse(headers={**SSE_HEADERS, **headers, "X-Accel-Buffering": "no"})
            await response.prepare(http)
            builder = EventBuilder(request.kind, active.request_id, request.requested_model, active.record.created,
                                   request.include_usage, request.output)
            active.stream.on_overflow = functools.partial(cut_slow_client, http.transport, active)
            await relay_sse(response, active.chunks(), builder, after=None)
            return response

    async def _generate_batch(self, http: web.Request, key: ApiKeyRecord,
                              requests: list[NormalizedRequest]) -> web.Response:
        """A completions request of several prompts (``parse_batch``): each runs as a request
        of its own (admitted, placed and billed alone), their answers merged in prompt order
        (``merge_batch``). Any one refused or failed fails the batch, and the rest are
        cancelled: a client retries the whole batch. A key with a concurrency limit runs at
        most that many of its prompts at once (more would be refused by its own limit)."""
        g = self.gateway
        http[REQUEST_MODEL] = requests[0].model
        parent, address = extract(dict(http.headers)), g.client_address(http)
        slots = asyncio.Semaphore(key.max_concurrent or len(requests))
        actives: list[ActiveRequest] = []
        answers: list[asyncio.Future[bytes]] = []
        async with contextlib.AsyncExitStack() as serving:
            try:
                for request in requests:
                    await slots.acquire()
                    failed = next((a for a in answers if a.done() and a.exception() is not None), None)
                    if failed is not None:  # a prompt failed already: start no more, the batch fails now
                        slots.release()
                        failed.result()
                    try:
                        active = await ActiveRequest.start(g, request, key, parent=parent, client_address=address)
                    except BaseException:
                        slots.release()
                        raise
                    actives.append(active)
                    await serving.enter_async_context(active.serving())
                    answer = asyncio.ensure_future(active.collect())  # read as it runs: nothing piles up
                    answer.add_done_callback(lambda _: slots.release())
                    answers.append(answer)
                http[REQUEST_STARTED] = True  # a refusal midway is counted as the batch's, by its status
                responses = await asyncio.gather(*answers)
            except Exception:
                for pending in answers:
                    pending.cancel()
                await asyncio.gather(*answers, return_exceptions=True)
                for active in actives:
                    await active.cancel("batch_failed")
                raise
            finally:  # the client gone (cancelled): serving() cancels each request, these stop reading
                for pending in answers:
                    pending.cancel()
        log.debug("batch of %d prompts: requests %s", len(actives), ", ".join(a.request_id for a in actives))
        # The response's id is the first prompt's request: its id is the one in X-Request-Id.
        return web.Response(body=merge_batch(list(responses), requests[0].output.n), content_type="application/json",
                            headers={"X-Request-Id": actives[0].request_id})

    @authenticated
    async def resume(self, http: web.Request, key: ApiKeyRecord) -> web.StreamResponse:
        """``GET /v1/requests/{id}/stream``: the stream again from TOKENS, after ``Last-Event-ID``."""
        g = self.gateway
        request_id = http.match_info["request_id"]
        record = await g.records.load(request_id)
        if record is None or record.key_id != key.key_id or not record.resumable:
            # Another key's request gets the same answer as an unknown id (ids are not
            # revealed), and so does one no longer resumable (its slow client was cut).
            raise ApiError(404, f"No resumable request {request_id!r} (unknown or expired).", "invalid_request_error", None, "not_found")
        record.resumes += 1
        await g.records.save(record)
        after = parse_event_id(http.headers.get("Last-Event-ID"))
        g.metrics.resumes.inc()
        response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": request_id})
        await response.prepare(http)
        builder = EventBuilder(record.kind, request_id, record.model, record.created, record.include_usage, record.output)
        async with on_client_gone(functools.partial(g.resumed_client_gone, record)):
            await relay_sse(response, ResumedStream(g, record).chunks(), builder, after=after)
        return response

    # ---- models, usage ------------------------------------------------------------------
    @authenticated
    async def models(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        now = int(time.time())
        cards = [model_card(name, spec, now) for name, spec in sorted(self.gateway.models.specs().items())
                 if model_allowed(name, spec, key.models)]
        return web.Response(body=encode_json(ModelList(data=cards)), content_type="application/json")

    @authenticated
    async def model(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        """``GET /v1/models/{id}``: one model object; unknown or not the key's is OpenAI's 404."""
        name = http.match_info["model_id"]
        spec = self.gateway.models.specs().get(name)
        if spec is None or not model_allowed(name, spec, key.models):
            raise model_not_found(name)
        return web.Response(body=encode_json(model_card(name, spec, int(time.time()))), content_type="application/json")

    @authenticated
    async def usage(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        """Usage and spend of the calling key's own org (from the metering ledger)."""
        bus = self.gateway.bus
        try:
            query = org_usage_query(key.org, dict(http.query), time.time())
        except ValueError as exc:
            raise ApiError(400, f"Invalid usage query: {exc}", "invalid_request_error", None, "invalid_value") from exc
        try:
            report = await bus.request(bus.subjects.metering_usage, query, UsageReport, timeout=10.0)
        except MeshError as exc:
            code = ErrorCode.NO_CAPACITY if exc.code in (ErrorCode.NO_RESPONDERS, ErrorCode.TIMEOUT) else exc.code
            raise from_mesh_error(str(code), f"usage is unavailable right now: {exc.message}", 5.0) from exc
        return web.json_response(usage_report_json(report))

    # ---- operations and the chat page ---------------------------------------------------
    async def health(self, http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ping(self, http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, http: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def ready(self, http: web.Request) -> web.Response:
        g = self.gateway
        connected = g.connected
        models = sorted(g.registry.models()) if connected else []
        ready = g.ready and connected and bool(g.registry.ready_workers())
        return web.json_response({"ready": ready, "nats": connected, "models": models}, status=200 if ready else 503)

    async def metrics(self, http: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.gateway.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def index(self, http: web.Request) -> web.StreamResponse:
        index = STATIC_DIR / "index.html"
        if not index.exists():
            raise web.HTTPNotFound()
        return web.FileResponse(index, headers=page_security_headers(index.read_bytes(), http.host))

    async def favicon(self, http: web.Request) -> web.StreamResponse:
        # An SVG icon under the name browsers ask for; they go by the content type.
        return web.FileResponse(STATIC_DIR / "favicon.svg", headers={"Content-Type": "image/svg+xml",
                                                                     "Cache-Control": "max-age=86400"})

    async def dev_key(self, http: web.Request) -> web.Response:
        """The development key, for the chat page of a browser on this host; 404 to anyone else.

        Served only with ``--dev-key-file`` (``meshserve up``). Read on every call: the
        key is created after the gateway starts, and may be replaced.
        """
        path = self.gateway.config.dev_key_file
        if not path or not is_local_request(http.remote, http.headers):
            raise web.HTTPNotFound()
        try:
            key = (await asyncio.to_thread(Path(path).read_text)).strip()
        except OSError:
            key = ""
        if not key:
            raise web.HTTPNotFound()
        return web.json_response({"api_key": key}, headers={"Cache-Control": "no-store"})


async def relay_sse(response: web.StreamResponse, chunks: AsyncIterator[TokenChunk], builder: EventBuilder,
                    *, after: tuple[int, int] | None) -> None:
    """Write each chunk's events, skipping those at or before ``after`` (a resume's Last-Event-ID)."""
    async for chunk in chunks:
        events = builder.events(chunk, first=chunk.seq == 0)
        frames = [sse_event(e.id, e.data) for e in events if after is None or (e.seq, e.index) > after]
        if frames:
            await response.write(b"".join(frames))
