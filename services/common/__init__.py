"""Shared pure code of the services: not a service, never runs on its own.

What more than one service needs and that is neither the wire contract (``proto``) nor
NATS plumbing (``bus``): the KV prefix index (``kvindex``), the one fleet view
(``fleet``) and its async feed (``feed``), load smoothing (``smoothing``), tokenizers
(``tokenizer``) and the usage query helpers (``usage``). It imports ``proto``, ``bus``
and the standard and third-party libraries, never a service (DESIGN.md, Layout).
"""
