"""Who is asking: the one place a presented API key or bearer JWT becomes a key record, or a 401.

Every front door authenticates here: HTTP routes through ``authenticated`` (the decorator
hands the handler the caller's key), the NATS API from its message headers, the
WebSocket from its query string, headers or first ``auth`` message. With an OIDC issuer
configured, a credential shaped like a JWT goes to the ``TokenVerifier`` (``jwks``); every
other one, and every one without an issuer, takes the API key path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

from aiohttp import web

from proto import ApiKeyRecord

from .apikeys import MalformedAuthorization, key_from_headers, parse_key, redact_key, verify_key
from .errors import invalid_api_key, malformed_authorization, missing_api_key
from .jwks import TokenVerifier
from .oidc import looks_like_jwt

log = logging.getLogger(__name__)

R = TypeVar("R", bound=web.StreamResponse)
AUTH_MS = web.RequestKey("auth_ms", float)  # the key check's milliseconds, on the aiohttp request
# Set on the aiohttp request once it is known: the model it asked for, and that the request
# started (its ActiveRequest counts it when it closes; one refused before is counted by the
# HTTP error handler).
REQUEST_MODEL = web.RequestKey("request_model", str)
REQUEST_STARTED = web.RequestKey("request_started", bool)


class Authenticator:
    def __init__(self, records: Mapping[str, ApiKeyRecord], tokens: TokenVerifier | None = None) -> None:
        self.records = records  # key_id → record, kept current by the KeyStore's watch
        self.tokens = tokens  # None: no OIDC issuer configured

    async def check(self, presented: str | None) -> ApiKeyRecord:
        """The record of a presented key or token; ApiError 401 when it is missing, unknown,
        revoked or wrong (async: a token signed with a newly rotated key refetches the JWKS)."""
        if not presented:
            raise missing_api_key()
        if self.tokens is not None and looks_like_jwt(presented):
            return await self.tokens.verify(presented)
        parsed = parse_key(presented)
        record = self.records.get(parsed.key_id) if parsed else None
        if record is None or record.revoked or not verify_key(presented, record):
            # Never log the key in clear: only its redacted form.
            log.info("rejected API key %s", redact_key(presented))
            raise invalid_api_key(redact_key(presented))
        return record

    async def from_headers(self, headers: Mapping[str, str]) -> ApiKeyRecord:
        """The record of a request's Authorization / api-key / x-api-key header."""
        return await self.check(presented_key(headers))


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
        started = time.perf_counter()
        key = await api.auth.from_headers(http.headers)
        http[AUTH_MS] = (time.perf_counter() - started) * 1000  # for the Server-Timing header
        return await handler(api, http, key)

    return with_key
