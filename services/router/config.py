"""The router's settings: ``RouterServiceConfig`` (every default lives in its dataclasses)
and its config file (``bus.config`` reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bus.config import build, checked, read_file
from services.common.fleet import FleetConfig

from .cascade import CascadeConfig
from .policy import PolicyConfig, RouterConfig


@dataclass(frozen=True)
class RouterServiceConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    view: FleetConfig = field(default_factory=FleetConfig)
    # The worker answers a generate at once (before the first token): a slow answer means
    # a sick worker. Two attempts must fit in the gateway's route timeout (5 s).
    forward_timeout_s: float = 2.0
    snapshot_timeout_s: float = 2.0
    resync_retry_s: float = 2.0  # ask again when a snapshot has not come by then
    maintenance_interval_s: float = 0.5  # expiry and resync requests
    seed: int | None = None  # tie-breaking and candidate sampling (None: random)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


def load_config(path: str | Path | None, *, policy: str | None = None, **overrides: Any) -> RouterServiceConfig:
    """A ``RouterServiceConfig`` from a JSON or TOML (``.toml``) file, and CLI overrides.

    ``policy`` (the CLI's ``--policy``) replaces the file's default policy name.
    """
    return parse_config(read_file(path), policy=policy, **overrides)


_CONFIG_KEYS = {"policy", "default", "models", "aliases", "cascades", "view", "service"}


def parse_config(raw: Mapping[str, Any], *, policy: str | None = None, **overrides: Any) -> RouterServiceConfig:
    """The file's schema (every section optional)::

        policy = "prefix"                      # default policy name
        [default]                              # PolicyConfig fields for every model
        beta = 0.5
        d = 2
        [models."meta-llama/Llama-3.1-8B-Instruct"]   # a policy name or PolicyConfig fields
        policy = "session"
        [aliases]
        llama = "meta-llama/Llama-3.1-8B-Instruct"
        [cascades.auto]                        # CascadeConfig fields
        small = "llama-8b"
        large = "llama-70b"
        max_prompt_tokens = 1024
        hard_keywords = ["prove", "step by step"]
        [view]                                 # FleetConfig fields
        stale_after_s = 15
        [service]                              # RouterServiceConfig timing fields
        forward_timeout_s = 2.0

    ``overrides`` (RouterServiceConfig fields, from the CLI) win over the file.
    """
    unknown = set(raw) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown router config sections {sorted(unknown)}; expected {sorted(_CONFIG_KEYS)}")
    base = checked(PolicyConfig, raw.get("default") or {}, "default")
    if "policy" in raw:
        base["policy"] = raw["policy"]
    if policy is not None:
        base["policy"] = policy
    default = build(PolicyConfig, base, "default")
    models: dict[str, PolicyConfig] = {}
    for model, spec in (raw.get("models") or {}).items():
        where = f"models.{model}"
        spec = checked(PolicyConfig, {"policy": spec} if isinstance(spec, str) else spec, where)
        try:
            models[model] = replace(default, **spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    cascades: dict[str, CascadeConfig] = {}
    for name, spec in (raw.get("cascades") or {}).items():
        where = f"cascades.{name}"
        spec = checked(CascadeConfig, spec, where)
        if "hard_keywords" in spec:
            spec["hard_keywords"] = tuple(spec["hard_keywords"])
        if "hard_keyword_tokens" in spec:
            spec["hard_keyword_tokens"] = tuple(tuple(int(t) for t in seq) for seq in spec["hard_keyword_tokens"])
        cascades[name] = build(CascadeConfig, spec, where)
    aliases = {str(k): str(v) for k, v in (raw.get("aliases") or {}).items()}
    view = build(FleetConfig, raw.get("view") or {}, "view")
    service = checked(RouterServiceConfig, raw.get("service") or {}, "service")
    for bad in ("router", "view"):
        if bad in service:
            raise ValueError(f"service.{bad} is not a setting; use the [{bad if bad == 'view' else 'default'}] section")
    service.update(overrides)
    return build(
        RouterServiceConfig,
        {"router": RouterConfig(default=default, models=models, aliases=aliases, cascades=cascades), "view": view, **service},
        "service",
    )
