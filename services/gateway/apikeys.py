"""API keys: generation, hashing, verification, header parsing, redaction (no I/O).

A key reads ``msk-<key_id>-<secret>``. ``key_id`` (12 hex chars) is public: it names
the key's record in the ``mesh_keys`` KV bucket, appears in logs, usage events and
metering. ``secret`` (43 url-safe base64 chars, 256 bits) is never stored: the record
holds the SHA-256 of the whole key. A plain fast hash is right here, unlike for
passwords: a 256-bit random secret cannot be brute-forced, and verification runs on
every request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from proto.records import ApiKeyRecord

KEY_PREFIX = "msk"
KEY_ID_HEX_CHARS = 12
SECRET_BYTES = 32

# key_id is also a NATS KV key, so it must stay within [A-Za-z0-9_-]; we generate hex.
_KEY_RE = re.compile(r"msk-([0-9a-f]{12})-([A-Za-z0-9_-]{20,128})")
_KEY_ID_RE = re.compile(r"[0-9a-f]{12}")


class ParsedKey(NamedTuple):
    key_id: str
    secret: str


def generate_key(
    *,
    org: str,
    tier: str = "standard",
    name: str = "",
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    models: Iterable[str] = (),
    regions: Iterable[str] = (),
    created_at: float = 0.0,
    token_hex: Callable[[int], str] = secrets.token_hex,
    token_urlsafe: Callable[[int], str] = secrets.token_urlsafe,
) -> tuple[str, ApiKeyRecord]:
    """A new key and the record to store for it. Show the key once; keep only the record.

    The randomness sources are injectable so tests can pin keys.
    """
    key_id = token_hex(KEY_ID_HEX_CHARS // 2)
    secret = token_urlsafe(SECRET_BYTES)
    key = f"{KEY_PREFIX}-{key_id}-{secret}"
    if parse_key(key) is None:  # an injected source that breaks the format
        raise ValueError("generated key does not match the msk-<key_id>-<secret> format")
    record = ApiKeyRecord(
        key_id=key_id,
        key_hash=hash_key(key),
        org=org,
        tier=tier,
        name=name,
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        models=list(models),
        regions=list(regions),
        created_at=created_at,
    )
    return key, record


def hash_key(key: str) -> str:
    """Hex SHA-256 of the full key string, as stored in ``ApiKeyRecord.key_hash``."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def parse_key(key: str) -> ParsedKey | None:
    """Split a presented key into (key_id, secret); None when it is not a meshserve key.

    Callers look the record up by ``key_id`` only after this succeeds, so garbage never
    reaches the KV bucket.
    """
    match = _KEY_RE.fullmatch(key)  # fullmatch: "$" would accept a trailing newline
    return ParsedKey(match.group(1), match.group(2)) if match else None


def is_valid_key_id(key_id: str) -> bool:
    return bool(_KEY_ID_RE.fullmatch(key_id))


def verify_key(key: str, record: ApiKeyRecord) -> bool:
    """True when ``key`` is the (unrevoked) key ``record`` was made for.

    The hash comparison is constant-time (hmac.compare_digest) so response timing does
    not leak how much of a guessed key's hash matched.
    """
    parsed = parse_key(key)
    if parsed is None or record.revoked or parsed.key_id != record.key_id:
        return False
    return hmac.compare_digest(hash_key(key), record.key_hash)


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None.

    The scheme is case-insensitive (RFC 7235); surrounding whitespace is ignored.
    """
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


class MalformedAuthorization(ValueError):
    """An ``Authorization`` header that is present but not ``Bearer <token>``."""


# Header names (lower case) other clients put the key in: Azure OpenAI's SDKs send
# ``api-key``; Anthropic-style and many gateway clients send ``x-api-key``.
API_KEY_HEADERS = ("api-key", "x-api-key")


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents, or None when it presents none.

    ``Authorization: Bearer <key>`` first, then ``api-key`` / ``x-api-key``. Raises
    ``MalformedAuthorization`` when an Authorization header is there but is not Bearer
    auth and no other header carries a key: a key pasted without ``Bearer`` deserves
    a better answer than "you didn't provide an API key". Header names are matched
    case-insensitively (NATS headers are a plain dict).
    """
    authorization: str | None = None
    others: dict[str, str] = {}
    for name, value in headers.items():
        lowered = name.lower()
        if lowered == "authorization":
            authorization = value
        elif lowered in API_KEY_HEADERS and value.strip():
            others.setdefault(lowered, value.strip())
    bearer = parse_bearer(authorization)
    if bearer is not None:
        return bearer
    for name in API_KEY_HEADERS:
        if name in others:
            return others[name]
    if authorization is not None and authorization.strip().lower() not in ("", "bearer"):
        raise MalformedAuthorization(authorization)
    return None  # nothing, or "Bearer" with an empty key (an unset $OPENAI_API_KEY): no key given


def redact_key(key: str) -> str:
    """A form of ``key`` safe for logs: the public key_id, never a character of the secret.

    Strings that are not meshserve keys (a pasted OpenAI key, garbage) show only their
    length: a mistyped key is often a real secret from somewhere else.
    """
    parsed = parse_key(key)
    if parsed is not None:
        return f"{KEY_PREFIX}-{parsed.key_id}-***"
    return f"*** ({len(key)} chars)"
