"""The issuer's signing keys, fetched and kept current: the I/O around ``oidc``.

The JWKS comes from ``jwks_uri`` (given, or found through the issuer's
``/.well-known/openid-configuration``) or from a static file, is refetched every
``refresh_s`` and, when a token names a kid the cache does not hold (a rotation), at most
once per ``min_refetch_s``. A fetch that fails keeps the keys already held: while the
issuer is unreachable, tokens signed with known keys keep working and the others get 401.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bus import cancel_and_wait
from proto import ApiKeyRecord

from .errors import ApiError
from .oidc import InvalidToken, Jwks, OidcConfig, UnknownKey, parse_jwks, redact_token, verify_token

log = logging.getLogger(__name__)

MAX_DOCUMENT_BYTES = 1 << 20  # a discovery document or JWKS is a few KB; refuse a runaway one
FETCH_TIMEOUT_S = 10.0

Fetch = Callable[[], Awaitable[dict[str, dict[str, Any]]]]


class JwksUnavailable(Exception):
    """The JWKS could not be fetched or read; the message says why."""


def invalid_token(reason: str) -> ApiError:
    """401 for a bearer token that is not accepted: OpenAI's invalid-key error with the reason."""
    return ApiError(401, f"Invalid bearer token: {reason}.", "invalid_request_error", None, "invalid_api_key")


class JwksCache:
    def __init__(self, fetch: Fetch, *, refresh_s: float, min_refetch_s: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self.min_refetch_s = min_refetch_s
        self._monotonic = monotonic
        self.keys: dict[str, dict[str, Any]] = {}
        self.fetches = 0  # attempts, successful or not (operators and tests)
        self._last_attempt: float | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Loads the keys once (a failure is logged: API keys work without them) and keeps
        refreshing them."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def refresh(self) -> bool:
        """Fetches the keys now; False (and the old keys kept) when that fails."""
        async with self._lock:
            return await self._refresh_locked()

    async def refetch_for(self, kid: str) -> bool:
        """Whether ``kid`` is known after refetching the keys for it, unless a fetch was
        tried less than ``min_refetch_s`` ago (then only a concurrent fetch may bring it)."""
        async with self._lock:  # concurrent tokens with the new kid share one fetch
            if kid in self.keys:
                return True
            last = self._last_attempt
            if last is not None and self._monotonic() - last < self.min_refetch_s:
                return False
            await self._refresh_locked()
            return kid in self.keys

    async def _refresh_locked(self) -> bool:
        self._last_attempt = self._monotonic()
        self.fetches += 1
        try:
            keys = await self._fetch()
        except JwksUnavailable as exc:
            log.warning("OIDC: JWKS not refreshed, keeping the %d keys held: %s", len(self.keys), exc)
            return False
        if set(keys) != set(self.keys):
            log.info("OIDC: signing keys now %s", sorted(keys))
        self.keys = keys
        return True

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()


class TokenVerifier:
    """Bearer JWTs → key records for ``Authenticator``; 401 ``ApiError`` for any bad token."""

    def __init__(self, config: OidcConfig, cache: JwksCache, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.cache = cache
        self._clock = clock

    async def verify(self, token: str) -> ApiKeyRecord:
        try:
            return self._verify(token, self.cache.keys)
        except UnknownKey as exc:
            if not await self.cache.refetch_for(exc.kid):
                raise self._rejected(token, exc) from None
            try:
                return self._verify(token, self.cache.keys)
            except InvalidToken as again:
                raise self._rejected(token, again) from None
        except InvalidToken as exc:
            raise self._rejected(token, exc) from None

    def _verify(self, token: str, keys: Jwks) -> ApiKeyRecord:
        return verify_token(token, keys, self.config, self._clock())

    @staticmethod
    def _rejected(token: str, exc: InvalidToken) -> ApiError:
        log.info("rejected bearer token %s: %s", redact_token(token), exc)  # never the token itself
        return invalid_token(str(exc))


def jwks_fetcher(config: OidcConfig, session: aiohttp.ClientSession) -> Fetch:
    """How ``config`` gets its keys: the static file, the given jwks_uri, or discovery."""
    if config.jwks_file:
        path = Path(config.jwks_file)

        async def from_file() -> dict[str, dict[str, Any]]:
            try:
                return parse_jwks(json.loads(await asyncio.to_thread(path.read_text)))
            except (OSError, ValueError) as exc:
                raise JwksUnavailable(f"{path}: {exc}") from exc

        return from_file

    discovered: list[str] = []  # the jwks_uri discovery found, kept once found

    async def from_issuer() -> dict[str, dict[str, Any]]:
        uri = config.jwks_uri or (discovered[0] if discovered else "")
        if not uri:
            discovery = await _get_json(session, config.issuer.rstrip("/") + "/.well-known/openid-configuration")
            if discovery.get("issuer") != config.issuer:
                # OIDC Discovery §4.3: the document must be the issuer's own.
                raise JwksUnavailable(f"the discovery document names issuer {str(discovery.get('issuer'))[:200]!r}, "
                                      f"not {config.issuer!r}")
            found = discovery.get("jwks_uri")
            if not isinstance(found, str) or not found:
                raise JwksUnavailable("the discovery document has no jwks_uri")
            discovered.append(found)
            uri = found
        try:
            return parse_jwks(await _get_json(session, uri))
        except ValueError as exc:
            raise JwksUnavailable(f"{uri}: {exc}") from exc

    return from_issuer


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as response:
            if response.status != 200:
                raise JwksUnavailable(f"{url}: HTTP {response.status}")
            body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise JwksUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
    if len(body) > MAX_DOCUMENT_BYTES:
        raise JwksUnavailable(f"{url}: larger than {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise JwksUnavailable(f"{url}: not JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise JwksUnavailable(f"{url}: not a JSON object")
    return document


class Oidc:
    """The gateway's token callers: the HTTP session, the key cache and the verifier."""

    def __init__(self, config: OidcConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self.cache: JwksCache | None = None
        self.verifier: TokenVerifier | None = None

    async def start(self) -> TokenVerifier:
        self._session = aiohttp.ClientSession()
        self.cache = JwksCache(jwks_fetcher(self.config, self._session), refresh_s=self.config.refresh_s,
                               min_refetch_s=self.config.min_refetch_s)
        await self.cache.start()
        self.verifier = TokenVerifier(self.config, self.cache)
        return self.verifier

    async def stop(self) -> None:
        if self.cache is not None:
            await self.cache.stop()
        if self._session is not None:
            await self._session.close()
