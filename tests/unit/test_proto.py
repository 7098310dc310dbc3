"""The wire contract: round trips, hostile bytes, versions, subjects, the block hash."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    DecodeError,
    GenerateRequest,
    KvEventBatch,
    Subjects,
    TokenChunk,
    UnsupportedVersion,
    block_hashes,
    decode,
    encode,
    extend_block_hashes,
    pack_tokens,
    subject_token,
    unescape_token,
    unpack_tokens,
)
from services.common.tokenizer import ByteTokenizer, IncrementalDecoder

_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_FLOAT = st.floats(allow_nan=False)


def strategy_for(info: mi.Type) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for any msgspec type used in proto (built from msgspec.inspect)."""
    match info:
        case mi.IntType():
            return _INT
        case mi.FloatType():
            return _FLOAT
        case mi.StrType():
            return st.text(max_size=20)
        case mi.BytesType():
            return st.binary(max_size=64)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.ListType(item_type=item):
            return st.lists(strategy_for(item), max_size=4)
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(strategy_for(key), strategy_for(value), max_size=4)
        case mi.UnionType(types=types):
            return st.one_of([strategy_for(t) for t in types])
        case mi.StructType(cls=cls, fields=fields):
            required = {f.name: strategy_for(f.type) for f in fields if f.required}
            optional = {f.name: strategy_for(f.type) for f in fields if not f.required and f.name != "v"}
            return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))
    raise TypeError(f"no strategy for {info!r}")


def test_every_versioned_message_is_listed() -> None:
    """A top-level message (one with a schema version) missing from MESSAGE_TYPES would
    escape the round-trip and hostile-bytes properties below."""
    import proto.messages
    import proto.records
    import proto.workers

    versioned = {
        obj for module in (proto.messages, proto.records, proto.workers) for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and "v" in obj.__struct_fields__
    }
    assert versioned == set(MESSAGE_TYPES)


@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=lambda k: k.__name__)
def test_every_message_round_trips(kind: type[msgspec.Struct]) -> None:
    @settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
    @given(strategy_for(mi.type_info(kind)))
    def check(message: msgspec.Struct) -> None:
        assert decode(encode(message), kind) == message

    check()


@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=lambda k: k.__name__)
def test_arbitrary_bytes_give_only_decode_errors(kind: type[msgspec.Struct]) -> None:
    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=256))
    def check(data: bytes) -> None:
        try:
            decode(data, kind)
        except DecodeError:
            pass

    check()


@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=lambda k: k.__name__)
def test_mutated_valid_messages_give_only_decode_errors(kind: type[msgspec.Struct]) -> None:
    """Bit flips and truncations of real messages: closer to the decoder's edge cases."""

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(mi.type_info(kind)), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
    def check(message: msgspec.Struct, position: int, byte: int) -> None:
        data = bytearray(encode(message))
        cut = position % (len(data) + 1)
        for mutated in (bytes(data[:cut]), bytes(data[:cut]) + bytes([byte]) + bytes(data[cut + 1 :])):
            try:
                decode(mutated, kind)
            except DecodeError:
                pass

    check()


def test_unknown_schema_version_is_a_typed_error() -> None:
    future = msgspec.msgpack.encode({"v": SCHEMA_VERSION + 1, "request_id": "r", "seq": 0})
    with pytest.raises(UnsupportedVersion, match="schema version 2"):
        decode(future, TokenChunk)
    # a future version whose fields changed shape is still reported as a version problem
    reshaped = msgspec.msgpack.encode({"v": SCHEMA_VERSION + 1, "request_id": 7, "seq": "x"})
    with pytest.raises(UnsupportedVersion):
        decode(reshaped, TokenChunk)


def test_wrong_message_type_is_a_decode_error() -> None:
    chunk = encode(TokenChunk(request_id="r", seq=1))
    with pytest.raises(DecodeError):
        decode(chunk, KvEventBatch)


def test_long_prompt_travels_packed() -> None:
    prompt = list(range(100_000))
    request = GenerateRequest(request_id="r", model="m", prompt=pack_tokens(prompt), token_subject="t")
    data = encode(request)
    assert len(data) < 450_000  # 4 bytes a token: far below meshserve's 8 MB max_payload
    assert unpack_tokens(decode(data, GenerateRequest).prompt) == prompt


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_pack_unpack_round_trip(tokens: list[int]) -> None:
    assert unpack_tokens(pack_tokens(tokens)) == tokens


def test_unpack_rejects_ragged_bytes() -> None:
    with pytest.raises(ValueError):
        unpack_tokens(b"\x00\x01\x02")


def test_block_hash_known_vector() -> None:
    # Pinned: router and workers (and other implementations) must agree bit for bit.
    assert block_hashes(list(range(40)), 16) == [1752139416532014167, 8864902414008588125]
    assert block_hashes(list(range(15)), 16) == []  # partial blocks are never hashed


@given(st.lists(st.integers(min_value=0, max_value=50_000), max_size=200), st.sampled_from([1, 4, 16, 128]))
def test_block_hashes_are_chained(tokens: list[int], block_size: int) -> None:
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    # a prefix's hashes are a prefix of the whole's hashes
    half = (len(tokens) // 2 // block_size) * block_size
    assert block_hashes(tokens[:half], block_size) == full[: half // block_size]
    # extending from the last hash continues the same chain
    if full:
        head = block_hashes(tokens[:block_size], block_size)
        assert head + extend_block_hashes(head[-1], tokens[block_size:], block_size) == full
    # packed bytes give the same hashes as a list
    assert block_hashes(pack_tokens(tokens), block_size) == full


def test_block_hash_depends_on_salt_and_position() -> None:
    tokens = [5] * 32
    plain = block_hashes(tokens, 16)
    assert plain[0] != plain[1]  # same tokens, different parents
    assert block_hashes(tokens, 16, salt="lora-a") != plain


def test_subjects_escape_and_root() -> None:
    s = Subjects()
    assert s.gauges("meta-llama/Llama-3.1-8B", "w1") == "mesh.gauges.meta-llama%2FLlama-3%2E1-8B.w1"
    assert s.tokens("gw", "r.1") == "mesh.tokens.gw.r%2E1"
    assert unescape_token(subject_token("a.b*c>d e")) == "a.b*c>d e"
    assert s.tokens_stream == "TOKENS" and s.usage_stream == "USAGE"
    other = Subjects("blue")
    assert other.api_chat == "blue.api.v1.chat.completions"
    assert other.tokens_stream == "TOKENS_BLUE" and other.workers_bucket == "blue_workers"
    with pytest.raises(ValueError):
        Subjects("a.b")


@given(st.text(max_size=30))
def test_subject_token_is_one_safe_token(value: str) -> None:
    token = subject_token(value)
    assert token and not any(c in token for c in ". *>\t\r\n")
    assert unescape_token(token) == value


def test_incremental_decoder_never_splits_characters() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld 🙂 done"
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    out = "".join(decoder.push([i]) for i in ids)
    assert out == text
    assert tok.decode(ids) == text
