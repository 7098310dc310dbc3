"""The gateway's settings: ``GatewayConfig`` holds the only defaults, ``load_config`` is the
one loader (a models file, then command-line overrides)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from bus.config import read_file

from .models import ModelLimits
from .oidc import OidcConfig, oidc_config
from .upstream import UpstreamConfig


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080  # 0 picks a free one
    gateway_id: str = ""  # empty: gateway-host-random
    region: str = ""  # where it runs: its requests' GenerateRequest.region (DESIGN.md, Regions)
    tls_cert: str | None = None
    tls_key: str | None = None
    trusted_proxies: tuple[str, ...] = ()  # CIDRs whose X-Forwarded-For is believed
    max_body_bytes: int = 4 * 1024 * 1024
    max_in_flight: int = 4096  # beyond this the gateway sheds with 429
    stall_timeout_s: float = 30.0  # no chunk for this long: the worker is considered lost
    liveness_check_s: float = 1.0  # how often a silent stream checks on its worker
    silence_fill_s: float = 2.0  # a stream this quiet re-reads TOKENS for chunks it missed
    max_migrations: int = 2  # a request moves to another replica at most this often
    # A migrating request that finds no replica ready waits this long for one to come (back).
    migration_wait_s: float = 15.0
    stream_buffer_chunks: int = 4096  # chunks held for one slow client before it is cut
    # A resumable request (header X-Meshserve-Resumable: true) whose client vanished keeps
    # generating this long, waiting for a resume, before its worker is told to stop.
    resume_window_s: float = 60.0
    model_limits: Mapping[str, ModelLimits] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    tier_priority: Mapping[str, int] = field(default_factory=lambda: {"premium": 2, "standard": 1, "batch": 0})
    # A file holding the development key (``meshserve up`` writes one): ``GET /dev-key``
    # hands it to browsers on this host only, so the chat page can offer it.
    dev_key_file: str | None = None
    # A request its client stopped waits this long for the worker's final chunk (the
    # usage it billed) before the gateway ends it with its own count.
    stop_grace_s: float = 5.0
    # The worker's usage event rides on a request's final chunk; the gateway publishes it
    # too (same dedup id) this long after that chunk, so the worker's copy usually wins,
    # retrying until USAGE stores it for up to usage_retry_s.
    usage_echo_delay_s: float = 0.5
    usage_retry_s: float = 600.0
    # Stored Responses API responses (``store``, the default) can be retrieved and
    # continued (``previous_response_id``) this long: the TTL of their KV bucket. OpenAI
    # keeps them 30 days; a week bounds the bucket's disk at a rate a mesh sustains.
    responses_ttl_s: float = 7 * 24 * 3600.0
    # Bearer JWTs from an OIDC issuer, besides API keys (no issuer: API keys only).
    oidc: OidcConfig = field(default_factory=OidcConfig)


_MODELS_KEYS = {"limits", "aliases"}


def load_oidc_config(path: str | Path | None = None, **overrides: Any) -> OidcConfig:
    """An ``OidcConfig`` from the ``oidc`` table of a file (JSON, or TOML when it ends in
    ``.toml``; see README.md, OIDC / JWT callers) with ``overrides`` (its fields) over it.
    A bad file or setting is a ValueError that names it."""
    raw = read_file(path)
    unknown = set(raw) - {"oidc"}
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)}; expected ['oidc']")
    try:
        return oidc_config(raw.get("oidc", {}), **overrides)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}" if path else str(exc)) from exc


def load_config(
    models_config: str | Path | None = None, *, upstream: Mapping[str, Any] | None = None, **overrides: Any
) -> GatewayConfig:
    """A ``GatewayConfig`` from the models file (JSON, or TOML when it ends in ``.toml``)::

        {"limits": {MODEL: {"max_tokens_cap": ...}}, "aliases": {ALIAS: MODEL}}

    with ``overrides`` (``GatewayConfig`` fields) and ``upstream`` (``UpstreamConfig``
    fields) over it. A bad file or setting is a ValueError that names it.
    """
    raw = read_file(models_config)
    unknown = set(raw) - _MODELS_KEYS
    if unknown:
        raise ValueError(f"{models_config}: unknown sections {sorted(unknown)}; expected {sorted(_MODELS_KEYS)}")
    try:
        limits = msgspec.convert(raw.get("limits", {}), dict[str, ModelLimits])
        aliases = msgspec.convert(raw.get("aliases", {}), dict[str, str])
    except msgspec.ValidationError as exc:
        raise ValueError(f"{models_config}: {exc}") from exc
    try:
        return GatewayConfig(model_limits=limits, aliases=aliases,
                             upstream=replace(UpstreamConfig(), **(upstream or {})), **overrides)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
