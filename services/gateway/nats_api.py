"""The NATS API front door: request-reply on ``mesh.api.chat`` / ``mesh.api.completions``
(one queue group over all gateways). A streamed reply is one message per OpenAI event,
the last one marked with ``Meshserve-Done``; errors carry NATS micro's error headers."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from proto import PayloadTooLarge

from .errors import ApiError, bad_request, internal_error, payload_too_large
from .events import DONE, EventBuilder
from .lifecycle import ActiveRequest
from .openai_api import RequestKind
from .validation import parse_request

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .service import GatewayService

DONE_HEADER = "Meshserve-Done"  # marks the last message of a streamed NATS API reply


class NatsApi:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    async def add_endpoints(self) -> None:
        g = self.gateway
        s = g.bus.subjects
        await g.add_raw_endpoint("chat", s.api_chat, self.chat, queue_group="gateway")
        await g.add_raw_endpoint("completions", s.api_completions, self.completions, queue_group="gateway")

    async def chat(self, msg: Msg) -> None:
        await self._generate(msg, "chat")

    async def completions(self, msg: Msg) -> None:
        await self._generate(msg, "completion")

    async def _generate(self, msg: Msg, kind: RequestKind) -> None:
        g = self.gateway
        nc = g.bus.nc
        if not msg.reply:
            return
        try:
            key = await g.auth.from_headers(msg.headers or {})
            if len(msg.data) > g.config.max_body_bytes:
                raise payload_too_large(g.config.max_body_bytes, len(msg.data))
            request = parse_request(kind, msg.data, g.models.specs(), allowed_models=key.models or None)
            active = await ActiveRequest.start(g, request, key, parent=g.bus.remote_context(msg))
        except ApiError as exc:
            await nc.publish(msg.reply, exc.to_json(), headers=error_headers(exc))
            return
        except Exception:  # the gateway's own failure: the caller still gets an answer, not a timeout
            log.exception("NATS API request on %s failed", msg.subject)
            failure = internal_error()
            await nc.publish(msg.reply, failure.to_json(), headers=error_headers(failure))
            return
        async with active.serving():
            if not request.stream:
                try:
                    body = await active.collect()
                    try:  # unchecked, nats-py raises and the caller waits for its timeout
                        g.bus.check_payload(body, msg.reply)
                    except PayloadTooLarge:
                        raise bad_request(
                            f"The response is {len(body):,} bytes, more than one NATS message carries here"
                            f" (max_payload {nc.max_payload:,}). Ask for fewer log probabilities or tokens,"
                            " stream it, or use the HTTP API.", None, "response_too_large") from None
                    await nc.publish(msg.reply, body)
                except ApiError as exc:
                    await nc.publish(msg.reply, exc.to_json(), headers=error_headers(exc))
                return
            builder = EventBuilder(request.kind, active.request_id, request.requested_model, int(time.time()),
                                   request.include_usage, request.output)
            async for chunk in active.chunks():
                events = [e for e in builder.events(chunk, first=chunk.seq == 0) if e.data != DONE]
                for i, event in enumerate(events):
                    headers = {"Meshserve-Event-Id": event.id, "Meshserve-Request-Id": active.request_id}
                    if chunk.finish_reason is not None and i == len(events) - 1:
                        headers[DONE_HEADER] = "1"  # the last message of this reply
                    await nc.publish(msg.reply, event.data, headers=headers)


def error_headers(exc: ApiError) -> dict[str, str]:
    headers = {"Nats-Service-Error": exc.message[:200], "Nats-Service-Error-Code": str(exc.status)}
    headers.update(exc.headers())
    return headers
