"""Who is asking: the one place a presented API key becomes a key record, or a 401.

Every front door authenticates here: HTTP routes through ``authenticated`` (the decorator
hands the handler the caller's key), the NATS API from its message headers, the
WebSocket from its query string, headers or first ``auth`` message.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

from aiohttp import web

from proto import ApiKeyRecord

from .apikeys import MalformedAuthorization, key_from_headers, parse_key, redact_key, verify_key
from .errors import invalid_api_key, malformed_authorization, missing_api_key

log = logging.getLogger(__name__)

R = TypeVar("R", bound=web.StreamResponse)


class Authenticator:
    def __init__(self, records: Mapping[str, ApiKeyRecord]) -> None:
        self.records = records  # key_id → record, kept current by the KeyStore's watch

    def check(self, presented: str | None) -> ApiKeyRecord:
        """The record of a presented key; ApiError 401 when it is missing, unknown, revoked or wrong."""
        if not presented:
            raise missing_api_key()
        parsed = parse_key(presented)
        record = self.records.get(parsed.key_id) if parsed else None
        if record is None or record.revoked or not verify_key(presented, record):
            # Never log the key in clear: only its redacted form.
            log.info("rejected API key %s", redact_key(presented))
            raise invalid_api_key(redact_key(presented))
        return record

    def from_headers(self, headers: Mapping[str, str]) -> ApiKeyRecord:
        """The record of a request's Authorization / api-key / x-api-key header."""
        return self.check(presented_key(headers))


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in the headers, if any; a malformed Authorization header is a 401."""
    try:
        return key_from_headers(headers)
    except MalformedAuthorization:
        raise malformed_authorization() from None


class _HasAuthenticator(Protocol):
    @property
    def auth(self) -> Authenticator: ...


S = TypeVar("S", bound=_HasAuthenticator)


def authenticated(
    handler: Callable[[S, web.Request, ApiKeyRecord], Awaitable[R]],
) -> Callable[[S, web.Request], Awaitable[R]]:
    """An HTTP handler that is called with the caller's key (a 401 answers for it otherwise)."""

    @functools.wraps(handler)
    async def with_key(api: S, http: web.Request) -> R:
        return await handler(api, http, api.auth.from_headers(http.headers))

    return with_key
