"""A request's body over HTTP, refused before it is read when it declares more than the limit."""

from __future__ import annotations

from aiohttp import web

from .errors import payload_too_large


async def read_body(http: web.Request, limit: int) -> bytes:
    """The body; ``ApiError`` 413 when its ``Content-Length`` is over ``limit`` (aiohttp's
    ``client_max_size`` stops a longer one without the header as it streams in)."""
    if http.content_length is not None and http.content_length > limit:
        raise payload_too_large(limit, http.content_length)
    return await http.read()
