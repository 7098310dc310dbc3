"""The gateway service: OpenAI-compatible HTTP/SSE, WebSocket and NATS front door.

Pure modules (no I/O), used by the async shell:

- ``openai_api``    request/response Structs, SSE and WebSocket encoders, ids
- ``validation``    raw body → ``NormalizedRequest`` (tokenized) or ``ApiError``
- ``chat_template`` sandboxed, bounded Jinja2 chat-template rendering
- ``apikeys``       key generation, hashing, verification, Bearer parsing, redaction

``static/index.html`` is the chat page served at ``/``.
"""
