"""The gateway service: OpenAI-compatible HTTP/SSE, WebSocket and NATS front door.

Pure modules (no I/O), used by the async shell:

- ``openai_api``    request/response Structs, SSE and WebSocket encoders, ids
- ``validation``    raw body → ``NormalizedRequest`` (tokenized) or ``ApiError``
- ``errors``        ``ApiError``, its builders and the mesh-code → HTTP status table
- ``chat_template`` sandboxed, bounded Jinja2 chat-template rendering
- ``apikeys``       key generation, hashing, verification, key headers (Bearer, api-key), redaction
- ``local``         whether a request comes from this host (the development key's only audience)

``static/index.html`` is the chat page served at ``/`` (``static/favicon.svg`` its icon).
"""
