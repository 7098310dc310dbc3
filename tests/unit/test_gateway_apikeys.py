"""API keys: format, hashing, constant-time verification, Bearer parsing, redaction."""

from __future__ import annotations

import hashlib
import re

import msgspec
import pytest

from proto import ApiKeyRecord, decode, encode
from services.common.tokenizer import ByteTokenizer
from services.gateway import apikeys


def test_generated_key_format_and_record() -> None:
    key, record = apikeys.generate_key(org="acme", tier="premium", name="ci", rpm=60, tpm=1000, models=["sim"], created_at=5.0)
    assert re.fullmatch(r"msk-[0-9a-f]{12}-[A-Za-z0-9_-]{43}", key)
    parsed = apikeys.parse_key(key)
    assert parsed is not None and parsed.key_id == record.key_id
    assert record.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert parsed.secret not in msgspec.json.encode(record).decode()  # only the hash is stored
    assert (record.org, record.tier, record.name, record.rpm, record.tpm, record.models, record.created_at) == (
        "acme", "premium", "ci", 60, 1000, ["sim"], 5.0
    )
    assert decode(encode(record), ApiKeyRecord) == record


def test_keys_are_unique() -> None:
    keys = {apikeys.generate_key(org="o")[0] for _ in range(50)}
    assert len(keys) == 50


def test_injected_randomness_pins_the_key() -> None:
    key, record = apikeys.generate_key(org="o", token_hex=lambda n: "ab" * n, token_urlsafe=lambda n: "s" * 43)
    assert key == "msk-abababababab-" + "s" * 43
    assert record.key_id == "abababababab"


def test_a_source_that_breaks_the_format_is_refused() -> None:
    with pytest.raises(ValueError):
        apikeys.generate_key(org="o", token_hex=lambda n: "ZZ-" * n)


def test_verify() -> None:
    key, record = apikeys.generate_key(org="o")
    assert apikeys.verify_key(key, record)
    wrong_secret = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert not apikeys.verify_key(wrong_secret, record)
    other, _ = apikeys.generate_key(org="o")
    assert not apikeys.verify_key(other, record)
    assert not apikeys.verify_key("garbage", record)
    assert not apikeys.verify_key("", record)
    revoked = msgspec.structs.replace(record, revoked=True)
    assert not apikeys.verify_key(key, revoked)
    # a record under another key_id never verifies, even with a matching hash
    moved = msgspec.structs.replace(record, key_id="000000000000")
    assert not apikeys.verify_key(key, moved)


def test_model_allow_list() -> None:
    """A key's models: the names, their aliases; an adapter only by its own name (a
    team's fine-tune was every user's of its base model)."""
    from services.gateway.models import ModelSpec
    from services.gateway.normalized import model_allowed

    tokenizer = ByteTokenizer()
    base, adapter = ModelSpec("sim", tokenizer), ModelSpec("sim", tokenizer, lora="team-sql")
    _, everything = apikeys.generate_key(org="o")
    _, only_sim = apikeys.generate_key(org="o", models=["sim"])
    _, with_adapter = apikeys.generate_key(org="o", models=["sim", "team-sql"])
    assert model_allowed("anything", base, everything.models) and model_allowed("team-sql", adapter, everything.models)
    assert model_allowed("sim", base, only_sim.models) and model_allowed("gpt-4o", base, only_sim.models)  # an alias
    assert not model_allowed("big", ModelSpec("big", tokenizer), only_sim.models)
    assert not model_allowed("team-sql", adapter, only_sim.models)
    assert model_allowed("team-sql", adapter, with_adapter.models)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer msk-abc", "msk-abc"),
        ("bearer msk-abc", "msk-abc"),
        ("  BEARER   msk-abc  ", "msk-abc"),
        ("Basic dXNlcjpwYXNz", None),
        ("Bearer", None),
        ("Bearer   ", None),
        ("", None),
        (None, None),
        ("msk-abc", None),
    ],
)
def test_parse_bearer(header: str | None, token: str | None) -> None:
    assert apikeys.parse_bearer(header) == token


def test_parse_key_rejects_lookalikes() -> None:
    assert apikeys.parse_key("msk-0123456789ab-" + "x" * 43) is not None
    assert apikeys.parse_key("msk-0123456789AB-" + "x" * 43) is None  # key ids are lowercase hex
    assert apikeys.parse_key("msk-0123-" + "x" * 43) is None
    assert apikeys.parse_key("sk-0123456789ab-" + "x" * 43) is None
    assert apikeys.parse_key("msk-0123456789ab-short") is None
    assert apikeys.parse_key("msk-0123456789ab-" + "x" * 43 + "\n") is None
    assert apikeys.is_valid_key_id("0123456789ab")
    assert not apikeys.is_valid_key_id("../../etc")


def test_redaction_never_shows_the_secret() -> None:
    key, record = apikeys.generate_key(org="o")
    secret = key.split("-", 2)[2]
    shown = apikeys.redact_key(key)
    assert shown == f"msk-{record.key_id}-***"
    assert secret[:4] not in shown
    foreign = "sk-proj-abcdefghijklmnopqrstuvwxyz"
    assert apikeys.redact_key(foreign) == f"*** ({len(foreign)} chars)"


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"Authorization": "Bearer msk-a"}, "msk-a"),
        ({"authorization": "bearer msk-a"}, "msk-a"),  # NATS headers are a plain, case-sensitive dict
        ({"api-key": "msk-a"}, "msk-a"),  # Azure OpenAI SDKs
        ({"X-Api-Key": " msk-a "}, "msk-a"),
        ({"Authorization": "Bearer msk-a", "api-key": "msk-b"}, "msk-a"),
        ({"Authorization": "msk-a", "api-key": "msk-b"}, "msk-b"),
        ({"api-key": "", "x-api-key": "msk-b"}, "msk-b"),
        ({}, None),
        ({"Authorization": ""}, None),
        ({"api-key": "  "}, None),
    ],
)
def test_key_from_headers(headers: dict[str, str], key: str | None) -> None:
    assert apikeys.key_from_headers(headers) == key


@pytest.mark.parametrize("authorization", ["msk-a", "Basic bXNrLWE=", "Token msk-a"])
def test_authorization_without_bearer_is_malformed(authorization: str) -> None:
    with pytest.raises(apikeys.MalformedAuthorization):
        apikeys.key_from_headers({"Authorization": authorization})


@pytest.mark.parametrize("authorization", ["Bearer", "Bearer ", "bearer   ", ""])
def test_bearer_with_an_empty_key_is_no_key(authorization: str) -> None:
    # `Authorization: Bearer $OPENAI_API_KEY` with the variable unset: the key is missing,
    # not malformed, and the client should hear "you didn't provide an API key".
    assert apikeys.key_from_headers({"Authorization": authorization}) is None
