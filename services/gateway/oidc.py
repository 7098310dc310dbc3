"""OIDC / OAuth callers: a JWT bearer token from the configured issuer becomes a key record
(no I/O; the clock is passed in).

``verify_token`` checks the signature against the issuer's JWKS (kid → JWK, as
``parse_jwks`` reads it), then ``exp``/``nbf``/``iat``/``iss``/``aud`` against ``now``, and
maps the claims onto an ``ApiKeyRecord``: org, tier and limits from configurable claims
(or the tier's configured defaults), and a synthetic ``key_id`` (``jwt-...``) that is
stable per caller, so admission limits and metering bill a token's caller like a key.
Fetching and caching the JWKS is the shell's (``jwks``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jwt
from jwt import PyJWK, PyJWS

from proto.records import ApiKeyRecord

from .apikeys import parse_key

# Asymmetric algorithms only: "none" is no signature, and an HS* algorithm would verify
# with the issuer's *public* key as the shared secret, so anyone could sign.
SUPPORTED_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
KEY_ID_PREFIX = "jwt-"
# A key id from a claim travels where API key ids do (KV keys, logs): the same alphabet.
_CLAIM_KEY_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Three base64url segments (the signature is empty for alg "none").
_JWT_RE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")

Jwks = Mapping[str, Mapping[str, Any]]  # kid ("" for a key without one) → JWK


@dataclass(frozen=True, slots=True)
class TierLimits:
    """A tier's limits for token callers whose token carries none (None: unlimited)."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


def _default_tiers() -> dict[str, TierLimits]:
    return {"premium": TierLimits(), "standard": TierLimits(), "batch": TierLimits()}


@dataclass(frozen=True, slots=True)
class OidcConfig:
    issuer: str = ""  # empty: no JWT callers, API keys only
    audience: tuple[str, ...] = ()  # a token must name one of these in ``aud``
    jwks_uri: str = ""  # empty: from the issuer's /.well-known/openid-configuration
    jwks_file: str = ""  # a static JWKS (air-gapped sites); re-read like a fetched one
    algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")
    leeway_s: float = 60.0  # clock skew allowed on exp / nbf / iat
    # Claim names ("" : not taken from the token). Names are matched whole, so namespaced
    # claims ("https://example.com/org") work.
    org_claim: str = "org"
    tier_claim: str = "tier"
    rpm_claim: str = "rpm"
    tpm_claim: str = "tpm"
    max_concurrent_claim: str = "max_concurrent"
    key_id_claim: str = ""  # empty: the key id is a hash of iss and sub
    default_org: str = ""  # empty: a token without the org claim is refused
    default_tier: str = "standard"
    tiers: Mapping[str, TierLimits] = field(default_factory=_default_tiers)  # the tiers a token may name
    refresh_s: float = 300.0  # the JWKS is refetched this often
    # A token with an unknown kid refetches the JWKS (a rotation), at most this often:
    # junk tokens must not turn the gateway into a load generator against the issuer.
    min_refetch_s: float = 30.0

    @property
    def enabled(self) -> bool:
        return bool(self.issuer)

    def __post_init__(self) -> None:
        problem = config_problem(self)
        if problem:
            raise ValueError(f"oidc: {problem}")


def config_problem(config: OidcConfig) -> str | None:
    """What makes ``config`` unusable, in one phrase; None when nothing does."""
    if not config.issuer:
        return None
    if not config.audience or not all(isinstance(a, str) and a for a in config.audience):
        # Without an audience check a token the issuer made for any other application works here.
        return "an issuer needs an audience (the aud value its tokens for this gateway carry)"
    if config.jwks_uri and config.jwks_file:
        return "give jwks_uri or jwks_file, not both"
    bad = [a for a in config.algorithms if a not in SUPPORTED_ALGORITHMS]
    if bad or not config.algorithms:
        return f"algorithms {bad or '[]'} not accepted; choose from {', '.join(SUPPORTED_ALGORITHMS)}"
    if config.leeway_s < 0 or config.refresh_s <= 0 or config.min_refetch_s < 0:
        return "leeway_s and min_refetch_s must be 0 or more, refresh_s more than 0"
    if config.default_tier not in config.tiers:
        return f"default_tier {config.default_tier!r} is not one of the tiers {sorted(config.tiers)}"
    for name, limits in config.tiers.items():
        for what, value in (("rpm", limits.rpm), ("tpm", limits.tpm), ("max_concurrent", limits.max_concurrent)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return f"tier {name!r}: {what} must be a whole number ≥ 1 (leave it out for no limit), not {value!r}"
    return None


def oidc_config(section: Mapping[str, Any], **overrides: Any) -> OidcConfig:
    """An ``OidcConfig`` from a config file's ``oidc`` table (``tiers`` a table of
    ``{rpm, tpm, max_concurrent}`` tables) with ``overrides`` over it; ValueError names what is wrong."""
    spec = {**section, **overrides}
    unknown = set(spec) - set(OidcConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"oidc: unknown settings {sorted(unknown)}")
    try:
        if "tiers" in spec:
            spec["tiers"] = {str(name): TierLimits(**limits) for name, limits in dict(spec["tiers"]).items()}
        for name in ("audience", "algorithms"):
            value = spec.get(name)
            if isinstance(value, str):
                spec[name] = (value,)
            elif value is not None:
                spec[name] = tuple(value)
        return OidcConfig(**spec)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc) if str(exc).startswith("oidc:") else f"oidc: {exc}") from exc


class InvalidToken(Exception):
    """A token that is not accepted; the message says why, without quoting the token."""


class UnknownKey(InvalidToken):
    """Signed with a key the JWKS at hand does not hold (maybe newly rotated in)."""

    def __init__(self, kid: str) -> None:
        super().__init__(f"the token's signing key (kid {kid[:64]!r}) is not one the issuer publishes")
        self.kid = kid


def looks_like_jwt(presented: str) -> bool:
    """Whether a presented credential is a JWT rather than an API key (``msk-...``)."""
    return parse_key(presented) is None and _JWT_RE.fullmatch(presented) is not None


def redact_token(token: str) -> str:
    """A form of a token safe for logs: its length only (the claims may name a person)."""
    return f"JWT *** ({len(token)} chars)"


def parse_jwks(document: Any) -> dict[str, dict[str, Any]]:
    """kid → JWK of a JWKS document (``{"keys": [...]}``): signing keys only, symmetric
    (``oct``) keys dropped. ValueError when it is not a JWKS."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError('not a JWKS: expected {"keys": [...]}')
    keys: dict[str, dict[str, Any]] = {}
    for jwk in document["keys"]:
        if not isinstance(jwk, dict) or jwk.get("kty") in (None, "oct") or jwk.get("use", "sig") != "sig":
            continue
        kid = jwk.get("kid", "")
        if isinstance(kid, str):
            keys.setdefault(kid, jwk)  # a repeated kid: the first one, as most libraries do
    return keys


def verify_token(token: str, jwks: Jwks, config: OidcConfig, now: float) -> ApiKeyRecord:
    """The key record of a valid token; ``InvalidToken`` (``UnknownKey`` for an unknown kid)
    saying what is wrong otherwise. ``now`` is the wall clock in seconds since the epoch."""
    claims = _verified_claims(token, jwks, config)
    _check_times(claims, config, now)
    if claims.get("iss") != config.issuer:
        raise InvalidToken("the token's issuer (iss) is not the one this gateway trusts")
    audience = claims.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience
    if not isinstance(audiences, list) or not set(config.audience) & {a for a in audiences if isinstance(a, str)}:
        raise InvalidToken("the token's audience (aud) is not this gateway")
    return _record(claims, config)


def _verified_claims(token: str, jwks: Jwks, config: OidcConfig) -> dict[str, Any]:
    if not _JWT_RE.fullmatch(token):
        raise InvalidToken("the bearer token is not a well-formed JWT")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise InvalidToken("the bearer token is not a well-formed JWT") from None
    alg = header.get("alg")
    if not isinstance(alg, str) or alg.lower() == "none":
        raise InvalidToken("unsigned tokens (alg none) are not accepted")
    if alg not in config.algorithms:
        raise InvalidToken(f"tokens signed with {alg[:16]!r} are not accepted (accepted: {', '.join(config.algorithms)})")
    kid = header.get("kid", "")
    if not isinstance(kid, str):
        raise InvalidToken("the token's kid is not a string")
    jwk = jwks.get(kid)
    if jwk is None:
        raise UnknownKey(kid)
    if jwk.get("alg", alg) != alg:
        raise InvalidToken(f"the token's alg {alg!r} is not the one its signing key is for")
    try:
        key = PyJWK(dict(jwk), algorithm=alg)  # a key of another type (an EC key for RS256) fails here
        payload = PyJWS().decode_complete(token, key=key, algorithms=[alg])["payload"]
    except jwt.InvalidSignatureError:
        raise InvalidToken("the token's signature does not verify") from None
    except jwt.PyJWTError:
        raise InvalidToken("the token's signature cannot be checked with the issuer's key for its kid") from None
    try:
        claims = json.loads(payload)
    except ValueError:
        raise InvalidToken("the token's payload is not JSON") from None
    if not isinstance(claims, dict):
        raise InvalidToken("the token's payload is not a JSON object")
    return claims


def _number(claims: Mapping[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidToken(f"the token's {name} is not a number of seconds")
    return float(value)


def _check_times(claims: Mapping[str, Any], config: OidcConfig, now: float) -> None:
    exp = _number(claims, "exp")
    if exp is None:
        raise InvalidToken("the token has no expiry (exp)")
    if now > exp + config.leeway_s:
        raise InvalidToken("the token has expired")
    nbf = _number(claims, "nbf")
    if nbf is not None and now + config.leeway_s < nbf:
        raise InvalidToken("the token is not valid yet (nbf)")
    iat = _number(claims, "iat")
    if iat is not None and now + config.leeway_s < iat:
        raise InvalidToken("the token was issued in the future (iat)")


def _text_claim(claims: Mapping[str, Any], name: str) -> str | None:
    if not name or name not in claims:
        return None
    value = claims[name]
    if not isinstance(value, str) or not value.strip():
        raise InvalidToken(f"the token's {name!r} claim is not a non-empty string")
    return value.strip()


def _limit_claim(claims: Mapping[str, Any], name: str, default: int | None) -> int | None:
    if not name or name not in claims:
        return default
    value = claims[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidToken(f"the token's {name!r} claim must be a whole number ≥ 1")
    return value


def _record(claims: Mapping[str, Any], config: OidcConfig) -> ApiKeyRecord:
    sub = _text_claim(claims, "sub")
    if config.key_id_claim:
        claimed = _text_claim(claims, config.key_id_claim)
        if claimed is None or not _CLAIM_KEY_ID_RE.fullmatch(claimed):
            raise InvalidToken(f"the token's {config.key_id_claim!r} claim must be 1-64 of A-Z a-z 0-9 _ -")
        key_id = KEY_ID_PREFIX + claimed
    elif sub is None:
        raise InvalidToken("the token has no subject (sub)")
    else:
        key_id = synthetic_key_id(config.issuer, sub)
    org = _text_claim(claims, config.org_claim) or config.default_org
    if not org:
        raise InvalidToken(f"the token has no {config.org_claim!r} claim naming its org")
    tier = _text_claim(claims, config.tier_claim) or config.default_tier
    limits = config.tiers.get(tier)
    if limits is None:
        raise InvalidToken(f"the token's tier {tier[:32]!r} is not one of {', '.join(sorted(config.tiers))}")
    return ApiKeyRecord(
        key_id=key_id,
        key_hash="",  # no stored secret: the signature is the proof
        org=org,
        tier=tier,
        name=(sub or "")[:128],
        rpm=_limit_claim(claims, config.rpm_claim, limits.rpm),
        tpm=_limit_claim(claims, config.tpm_claim, limits.tpm),
        max_concurrent=_limit_claim(claims, config.max_concurrent_claim, limits.max_concurrent),
    )


def synthetic_key_id(issuer: str, sub: str) -> str:
    """The key id of a token caller: stable per (issuer, subject), never an API key's id
    (those are 12 hex chars without a prefix), and not the subject itself (it may be an
    email address, and key ids appear in logs)."""
    digest = hashlib.sha256(f"{issuer}\n{sub}".encode("utf-8", "surrogatepass")).hexdigest()
    return KEY_ID_PREFIX + digest[:16]

