"""Bearer JWTs from an OIDC issuer: the pure validator (``oidc``), the JWKS cache and the
verifier's 401s (``jwks``), and how ``Authenticator`` picks between tokens and API keys.

Keys are generated here; the clock is passed in, so expiry is exact to the second.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import tomllib
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from services.gateway.apikeys import generate_key
from services.gateway.auth import Authenticator
from services.gateway.config import load_oidc_config
from services.gateway.errors import ApiError
from services.gateway.jwks import JwksCache, JwksUnavailable, TokenVerifier
from services.gateway.main import add_arguments, build_config
from services.gateway.oidc import (
    InvalidToken,
    OidcConfig,
    TierLimits,
    UnknownKey,
    looks_like_jwt,
    oidc_config,
    parse_jwks,
    synthetic_key_id,
    verify_token,
)

ISSUER = "https://idp.example.com/realms/acme"
AUDIENCE = "meshserve"
NOW = 1_800_000_000.0

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OTHER_RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
ED_KEY = ed25519.Ed25519PrivateKey.generate()


def jwk(public: Any, kid: str, algorithm: Any = RSAAlgorithm) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(algorithm.to_jwk(public))
    out["kid"] = kid
    return out


JWKS = parse_jwks({"keys": [jwk(RSA_KEY.public_key(), "rsa-1"), jwk(EC_KEY.public_key(), "ec-1", ECAlgorithm),
                            jwk(ED_KEY.public_key(), "ed-1", OKPAlgorithm)]})
CONFIG = OidcConfig(issuer=ISSUER, audience=(AUDIENCE,),
                    tiers={"premium": TierLimits(rpm=600, tpm=100_000), "standard": TierLimits(rpm=60), "batch": TierLimits()})


def claims(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-42", "exp": NOW + 300, "iat": NOW - 10,
                            "org": "acme"}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def token(key: Any = RSA_KEY, alg: str = "RS256", kid: str | None = "rsa-1", **overrides: Any) -> str:
    headers = {"kid": kid} if kid is not None else {}
    return jwt.encode(claims(**overrides), key, algorithm=alg, headers=headers)


def b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def rejected(presented: str, config: OidcConfig = CONFIG, now: float = NOW) -> str:
    with pytest.raises(InvalidToken) as info:
        verify_token(presented, JWKS, config, now)
    return str(info.value)


# ---- accepted tokens and the record they make -------------------------------------------


def test_an_rs256_token_becomes_a_key_record_with_its_claims() -> None:
    record = verify_token(token(tier="premium", rpm=10, tpm=5000), JWKS, CONFIG, NOW)
    assert (record.org, record.tier, record.rpm, record.tpm) == ("acme", "premium", 10, 5000)
    assert record.key_id == synthetic_key_id(ISSUER, "user-42") and record.key_id.startswith("jwt-")
    assert record.name == "user-42" and not record.revoked and record.models == []


def test_limits_default_to_the_tiers_and_the_tier_to_the_default_tier() -> None:
    assert verify_token(token(tier="premium"), JWKS, CONFIG, NOW).rpm == 600
    record = verify_token(token(), JWKS, CONFIG, NOW)
    assert (record.tier, record.rpm, record.tpm) == ("standard", 60, None)


def test_a_callers_requests_in_flight_come_from_its_claim_or_its_tier() -> None:
    config = OidcConfig(issuer=ISSUER, audience=(AUDIENCE,), jwks_file="x",
                        tiers={"standard": TierLimits(max_concurrent=8)})
    assert verify_token(token(), JWKS, config, NOW).max_concurrent == 8
    assert verify_token(token(max_concurrent=2), JWKS, config, NOW).max_concurrent == 2
    assert "'max_concurrent' claim must be a whole number ≥ 1" in rejected(token(max_concurrent=0), config)


@pytest.mark.parametrize(("key", "alg", "kid"), [(EC_KEY, "ES256", "ec-1"), (ED_KEY, "EdDSA", "ed-1")])
def test_ec_and_eddsa_tokens_verify(key: Any, alg: str, kid: str) -> None:
    assert verify_token(token(key, alg, kid), JWKS, CONFIG, NOW).org == "acme"


def test_the_synthetic_key_id_is_stable_per_caller_and_never_an_api_key_id() -> None:
    first = verify_token(token(), JWKS, CONFIG, NOW).key_id
    assert verify_token(token(exp=NOW + 900, jti="other"), JWKS, CONFIG, NOW).key_id == first
    assert verify_token(token(sub="user-43"), JWKS, CONFIG, NOW).key_id != first
    assert synthetic_key_id("https://other-issuer", "user-42") != first
    _, api_key_record = generate_key(org="acme")
    assert len(api_key_record.key_id) == 12 and not api_key_record.key_id.startswith("jwt-")


def test_a_key_id_claim_names_the_caller_when_configured() -> None:
    config = OidcConfig(issuer=ISSUER, audience=(AUDIENCE,), key_id_claim="client_id")
    assert verify_token(token(client_id="batch-app_1"), JWKS, config, NOW).key_id == "jwt-batch-app_1"
    assert "client_id" in rejected(token(client_id="has spaces"), config)
    assert "client_id" in rejected(token(), config)


def test_an_audience_list_and_the_leeway_are_honoured() -> None:
    assert verify_token(token(aud=["other", AUDIENCE]), JWKS, CONFIG, NOW).org == "acme"
    assert verify_token(token(exp=NOW - 59), JWKS, CONFIG, NOW).org == "acme"  # within 60 s of skew
    assert verify_token(token(nbf=NOW + 59), JWKS, CONFIG, NOW).org == "acme"


def test_namespaced_claim_names_and_a_default_org() -> None:
    config = OidcConfig(issuer=ISSUER, audience=(AUDIENCE,), org_claim="https://meshserve.example/org",
                        default_org="fallback")
    assert verify_token(token(**{"https://meshserve.example/org": "beta"}), JWKS, config, NOW).org == "beta"
    assert verify_token(token(), JWKS, config, NOW).org == "fallback"
    assert "'org'" in rejected(token(org=None))  # no claim, no default


# ---- refused tokens ---------------------------------------------------------------------


def test_expired_and_not_yet_valid_tokens_are_refused() -> None:
    assert rejected(token(exp=NOW - 61)) == "the token has expired"
    assert rejected(token(nbf=NOW + 61)) == "the token is not valid yet (nbf)"
    assert rejected(token(iat=NOW + 61)) == "the token was issued in the future (iat)"
    assert rejected(token(exp=None)) == "the token has no expiry (exp)"
    assert "number" in rejected(token(exp="tomorrow"))


def test_wrong_audience_and_issuer_are_refused() -> None:
    assert "audience" in rejected(token(aud="another-app"))
    assert "audience" in rejected(token(aud=None))
    assert "issuer" in rejected(token(iss="https://evil.example"))


def test_a_token_signed_by_another_key_under_a_known_kid_is_refused() -> None:
    assert rejected(token(OTHER_RSA_KEY)) == "the token's signature does not verify"
    good = token()
    head, _, signature = good.split(".")
    forged_payload = b64(claims(org="someone-else"))
    assert rejected(f"{head}.{forged_payload}.{signature}") == "the token's signature does not verify"


def test_alg_none_is_refused_even_unsigned_with_a_known_kid() -> None:
    unsigned = f"{b64({'alg': 'none', 'kid': 'rsa-1', 'typ': 'JWT'})}.{b64(claims())}."
    assert looks_like_jwt(unsigned)
    assert rejected(unsigned) == "unsigned tokens (alg none) are not accepted"
    assert "alg none" in rejected(f"{b64({'alg': 'None', 'kid': 'rsa-1'})}.{b64(claims())}.")


def test_hs256_signed_with_the_public_key_is_refused() -> None:
    """The classic key confusion: the public key (anyone has it) used as an HMAC secret."""
    pem = RSA_KEY.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    signing_input = f"{b64({'alg': 'HS256', 'kid': 'rsa-1'})}.{b64(claims())}"
    mac = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    signed = f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    assert "'HS256' are not accepted" in rejected(signed)
    with pytest.raises(ValueError, match="HS256"):
        OidcConfig(issuer=ISSUER, audience=(AUDIENCE,), algorithms=("RS256", "HS256"))


def test_an_alg_that_does_not_fit_the_key_is_refused() -> None:
    # An RS256 token naming the EC key's kid: PyJWT must not be asked to verify it as anything else.
    assert "cannot be checked" in rejected(token(kid="ec-1"))
    with_alg = parse_jwks({"keys": [{**jwk(RSA_KEY.public_key(), "rsa-1"), "alg": "RS512"}]})
    with pytest.raises(InvalidToken, match="not the one its signing key is for"):
        verify_token(token(), with_alg, CONFIG, NOW)


def test_an_unknown_kid_is_told_apart_for_a_refetch() -> None:
    with pytest.raises(UnknownKey) as info:
        verify_token(token(kid="rotated-2"), JWKS, CONFIG, NOW)
    assert info.value.kid == "rotated-2"
    with pytest.raises(UnknownKey):
        verify_token(token(kid=None), JWKS, CONFIG, NOW)  # no kid: only a JWKS key without one would do


def test_a_token_without_a_kid_verifies_against_a_key_without_one() -> None:
    single = parse_jwks({"keys": [{k: v for k, v in jwk(RSA_KEY.public_key(), "x").items() if k != "kid"}]})
    assert verify_token(token(kid=None), single, CONFIG, NOW).org == "acme"


@pytest.mark.parametrize("garbage", ["a.b.c", "e30.e30.", "not a token", "x" * 40, "e30.e30.e30.e30"])
def test_malformed_tokens_are_refused(garbage: str) -> None:
    assert rejected(garbage)


@pytest.mark.parametrize(("extra", "why"), [
    ({"tier": "gold"}, "tier 'gold' is not one of batch, premium, standard"),
    ({"rpm": 0}, "'rpm' claim must be a whole number ≥ 1"),
    ({"tpm": "1000"}, "'tpm' claim must be a whole number ≥ 1"),
    ({"rpm": True}, "'rpm' claim must be a whole number ≥ 1"),
    ({"org": ""}, "'org' claim is not a non-empty string"),
    ({"sub": None}, "the token has no subject (sub)"),
])
def test_bad_claims_are_refused(extra: dict[str, Any], why: str) -> None:
    assert why in rejected(token(**extra))


def test_claims_left_unnamed_are_not_taken_from_the_token() -> None:
    config = OidcConfig(issuer=ISSUER, audience=(AUDIENCE,), rpm_claim="", tier_claim="",
                        tiers={"standard": TierLimits(rpm=5)})
    record = verify_token(token(rpm=10_000, tier="premium"), JWKS, config, NOW)
    assert (record.tier, record.rpm) == ("standard", 5)


# ---- which path a credential takes ------------------------------------------------------


def test_api_keys_are_never_taken_for_jwts() -> None:
    key, _ = generate_key(org="acme")
    assert not looks_like_jwt(key) and looks_like_jwt(token())
    assert not looks_like_jwt("sk-proj-abc") and not looks_like_jwt("a.b")


async def test_the_authenticator_sends_jwts_to_the_verifier_and_keys_to_the_key_path() -> None:
    key, record = generate_key(org="keys-org")
    cache = JwksCache(_fetch_returning(JWKS), refresh_s=300, min_refetch_s=30)
    await cache.refresh()
    auth = Authenticator({record.key_id: record}, TokenVerifier(CONFIG, cache, clock=lambda: NOW))
    assert (await auth.check(key)).org == "keys-org"
    assert (await auth.check(token())).org == "acme"
    without_oidc = Authenticator({record.key_id: record})
    with pytest.raises(ApiError) as info:  # no issuer configured: a JWT is just a wrong key, as before
        await without_oidc.check(token())
    assert info.value.code == "invalid_api_key" and "Incorrect API key" in info.value.message


async def test_refused_tokens_are_401_in_openais_shape_without_the_token() -> None:
    cache = JwksCache(_fetch_returning(JWKS), refresh_s=300, min_refetch_s=30)
    await cache.refresh()
    auth = Authenticator({}, TokenVerifier(CONFIG, cache, clock=lambda: NOW))
    for bad, why in [(token(exp=NOW - 3600), "expired"), (token(aud="x"), "audience"),
                     (token(OTHER_RSA_KEY), "signature"), (f"{b64({'alg': 'none'})}.{b64(claims())}.", "alg none")]:
        with pytest.raises(ApiError) as info:
            await auth.from_headers({"Authorization": f"Bearer {bad}"})
        body = json.loads(info.value.to_json())["error"]
        assert info.value.status == 401 and body["code"] == "invalid_api_key"
        assert body["type"] == "invalid_request_error" and body["param"] is None
        assert why in body["message"] and bad not in body["message"] and bad.split(".")[1] not in body["message"]


# ---- the JWKS cache ---------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fetch_returning(*answers: Any) -> Any:
    """A fetch that returns (or raises) ``answers`` in turn, then the last one forever."""
    queue = list(answers)
    calls: list[int] = []

    async def fetch() -> dict[str, dict[str, Any]]:
        calls.append(1)
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    fetch.calls = calls  # type: ignore[attr-defined]
    return fetch


async def test_a_rotated_key_is_fetched_once_and_junk_kids_do_not_hammer_the_issuer() -> None:
    old = {"rsa-1": JWKS["rsa-1"]}
    rotated = {"rsa-1": JWKS["rsa-1"], "ec-1": JWKS["ec-1"]}
    clock = FakeClock()
    fetch = _fetch_returning(old, rotated)
    cache = JwksCache(fetch, refresh_s=300, min_refetch_s=30, monotonic=clock)
    await cache.refresh()
    verifier = TokenVerifier(CONFIG, cache, clock=lambda: NOW)
    clock.now += 31
    assert (await verifier.verify(token(EC_KEY, "ES256", "ec-1"))).org == "acme"  # the new kid: one refetch
    assert fetch.calls == [1, 1]
    for i in range(20):  # tokens naming kids nobody publishes: 401, and no fetch within the interval
        with pytest.raises(ApiError) as info:
            await verifier.verify(token(kid=f"junk-{i}"))
        assert info.value.status == 401 and "is not one the issuer publishes" in info.value.message
    assert fetch.calls == [1, 1]
    clock.now += 31
    with pytest.raises(ApiError):
        await verifier.verify(token(kid="junk-late"))
    assert fetch.calls == [1, 1, 1]  # once the interval has passed, one more try


async def test_an_unreachable_issuer_keeps_the_known_keys() -> None:
    clock = FakeClock()
    cache = JwksCache(_fetch_returning(JWKS, JwksUnavailable("connection refused")), refresh_s=300,
                      min_refetch_s=0, monotonic=clock)
    assert await cache.refresh()
    assert not await cache.refresh()
    verifier = TokenVerifier(CONFIG, cache, clock=lambda: NOW)
    assert (await verifier.verify(token())).org == "acme"
    with pytest.raises(ApiError) as info:
        await verifier.verify(token(kid="new-kid"))
    assert info.value.status == 401


async def test_a_cache_that_never_loaded_answers_401_not_500() -> None:
    cache = JwksCache(_fetch_returning(JwksUnavailable("down")), refresh_s=300, min_refetch_s=30)
    await cache.refresh()
    with pytest.raises(ApiError) as info:
        await TokenVerifier(CONFIG, cache, clock=lambda: NOW).verify(token())
    assert info.value.status == 401


def test_parse_jwks_keeps_signing_keys_only() -> None:
    doc = {"keys": [jwk(RSA_KEY.public_key(), "sig"), {**jwk(RSA_KEY.public_key(), "enc"), "use": "enc"},
                    {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"}, "junk", {"kid": "no-kty"}]}
    assert list(parse_jwks(doc)) == ["sig"]
    with pytest.raises(ValueError, match="not a JWKS"):
        parse_jwks({"issuer": ISSUER})


# ---- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "problem"), [
    ({"issuer": ISSUER}, "needs an audience"),
    ({"issuer": ISSUER, "audience": "a", "algorithms": ["none"]}, "not accepted"),
    ({"issuer": ISSUER, "audience": "a", "jwks_uri": "https://x/jwks", "jwks_file": "k.json"}, "not both"),
    ({"issuer": ISSUER, "audience": "a", "default_tier": "gold"}, "default_tier 'gold'"),
    ({"issuer": ISSUER, "audience": "a", "tiers": {"standard": {"rpm": 0}}}, "rpm must be a whole number"),
    ({"issuer": ISSUER, "audience": "a", "tiers": {"standard": {"max_concurrent": 0}}},
     "max_concurrent must be a whole number"),
    ({"issuer": ISSUER, "audience": "a", "tiers": {"standard": {"rpms": 1}}}, "rpms"),
    ({"issuer": ISSUER, "audience": "a", "claims": {}}, "unknown settings"),
])
def test_config_problems_are_named(settings: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        oidc_config(settings)


def test_no_issuer_means_no_oidc() -> None:
    assert not OidcConfig().enabled and not oidc_config({}).enabled


def test_the_config_file_and_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "oidc.toml"
    path.write_text(f'[oidc]\nissuer = "{ISSUER}"\naudience = ["{AUDIENCE}", "other"]\norg_claim = "tenant"\n'
                    '[oidc.tiers.standard]\nrpm = 30\n[oidc.tiers.premium]\ntpm = 9000\n')
    config = load_oidc_config(path)
    assert config.audience == (AUDIENCE, "other") and config.org_claim == "tenant"
    assert config.tiers == {"standard": TierLimits(rpm=30), "premium": TierLimits(tpm=9000)}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--oidc-config", str(path), "--oidc-audience", "flag-aud", "--oidc-jwks-file", "k.json"])
    built = build_config(args).oidc
    assert built.audience == ("flag-aud",) and built.jwks_file == "k.json" and built.org_claim == "tenant"
    with pytest.raises(SystemExit) as info:
        build_config(parser.parse_args(["--oidc-issuer", ISSUER]))
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "meshserve serve gateway: config: oidc: an issuer needs an audience (the aud value its tokens for this "
        "gateway carry)"]


def test_the_readme_example_is_a_valid_config() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("```toml\n[oidc]", 1)[1].split("```", 1)[0]
    config = oidc_config(tomllib.loads("[oidc]" + example)["oidc"])
    assert config.enabled and config.key_id_claim == "client_id" and config.tiers["standard"] == TierLimits(600, 200000, 16)
