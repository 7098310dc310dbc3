"""The gateway service: OpenAI-compatible HTTP/SSE, WebSocket and NATS front door.
``docs/request-path.md`` follows one streaming request through it, step by step.

Pure modules (no I/O), used by the async shell:

- ``openai_api``    request/response Structs, SSE and WebSocket encoders, ids
- ``validation``    raw body → ``NormalizedRequest`` (tokenized) or ``ApiError``
- ``errors``        ``ApiError``, its builders and the mesh-code → HTTP status table
- ``models``        ``ModelSpec`` / ``ModelLimits``, and the catalog built from the worker registry
- ``chat_template`` sandboxed, bounded Jinja2 chat-template rendering
- ``apikeys``       key generation, hashing, verification, key headers (Bearer, api-key), redaction
- ``events``        token chunks → OpenAI stream events with replayable ids
- ``migration``     whether and how a request leaves a lost worker (``plan_migration``)
- ``stall``         whether a silent request is merely queued on a live worker
- ``local``         whether a request comes from this host (the development key's only audience)
- ``config``        ``GatewayConfig`` (the only defaults) and its loader

The shell:

- ``service``       ``GatewayService``: wiring, the HTTP server, resume-window timers
- ``http_api``      HTTP routes and SSE, resume; ``ws_api`` WebSocket; ``nats_api`` NATS request-reply
- ``lifecycle``     ``ActiveRequest``: one request from admission to its last chunk (``RequestState``)
- ``auth``          API key → key record, one place for every front door
- ``upstream``      ``UpstreamClient``: admission, router and worker over NATS
- ``streams``       token chunks in order, once, gaps filled from TOKENS; ``records`` resume records

``static/index.html`` is the chat page served at ``/`` (``static/favicon.svg`` its icon).
"""
