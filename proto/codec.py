"""Encoding and decoding of proto messages (msgpack), with schema-version checks.

``decode`` never raises anything but ``DecodeError`` (or its subclass
``UnsupportedVersion``) for bad bytes: services can feed it hostile input safely.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

from .errors import DecodeError, UnsupportedVersion
from .messages import SCHEMA_VERSION

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()


class _Versioned(msgspec.Struct):
    v: int = SCHEMA_VERSION


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


@cache
def _decoder(kind: type[Any]) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(kind)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def _peek_version(data: bytes) -> int | None:
    try:
        return _version_decoder.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError):
        return None


def decode(data: bytes, kind: type[T]) -> T:
    """Decode ``data`` as a ``kind`` message, checking its schema version."""
    try:
        message = _decoder(kind).decode(data)
    except msgspec.ValidationError as exc:
        version = _peek_version(data)
        if version is not None and version != SCHEMA_VERSION:
            raise UnsupportedVersion(
                f"{kind.__name__} schema version {version} is not supported (this build speaks {SCHEMA_VERSION})"
            ) from exc
        raise DecodeError(f"invalid {kind.__name__}: {exc}") from exc
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise DecodeError(f"undecodable {kind.__name__}: {exc}") from exc
    version = getattr(message, "v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise UnsupportedVersion(
            f"{kind.__name__} schema version {version} is not supported (this build speaks {SCHEMA_VERSION})"
        )
    return message
