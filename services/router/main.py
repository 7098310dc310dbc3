"""The router: KV-aware placement of requests on workers.

``meshserve serve router [--policy prefix] [--config FILE] [--metrics-port N]``. Several
routers may run (one queue group); each builds the same view from the workers' events.
``--config`` (JSON, or TOML when it ends in ``.toml``) sets per-model policies, aliases
and cascades; see ``services.router.config.parse_config`` for the schema::

    {"policy": "prefix", "default": {"beta": 0.5, "d": 2},
     "models": {"meta-llama/Llama-3.1-8B-Instruct": "session"},
     "aliases": {"llama": "meta-llama/Llama-3.1-8B-Instruct"},
     "cascades": {"auto": {"small": "llama-8b", "large": "llama-70b", "max_prompt_tokens": 1024,
                           "hard_keywords": ["prove", "step by step"]}}}
"""

from __future__ import annotations

import argparse

from bus import RunOptions, run_service
from bus.config import default_of, file_problem, given, refuse
from bus.runner import listen_problem
from services.common.cli_types import add_region_rtt_argument, port_number, positive_seconds

from .config import RouterServiceConfig, load_config
from .policy import POLICIES, PolicyConfig

# option dest → RouterServiceConfig field
_OPTIONS = {"forward_timeout": "forward_timeout_s", "seed": "seed", "metrics_port": "metrics_port",
            "metrics_host": "metrics_host"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults come from the config (None here: not given); the help quotes them.
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="default policy for models the config does not name "
                             f"(default: the config's, else {default_of(PolicyConfig, 'policy')})")
    parser.add_argument("--config", default=None, help="JSON or TOML file: per-model policies, aliases, cascades")
    parser.add_argument("--forward-timeout", type=positive_seconds, default=None,
                        help="seconds a worker gets to accept a request before the next one is tried "
                             f"(default {default_of(RouterServiceConfig, 'forward_timeout_s'):g})")
    add_region_rtt_argument(parser)
    parser.add_argument("--seed", type=int, default=None, help="seed of tie-breaking and candidate sampling")
    parser.add_argument("--metrics-port", type=port_number, default=None, help="serve Prometheus /metrics here (0: any free port)")
    parser.add_argument("--metrics-host", default=None,
                        help=f"address of /metrics (default {default_of(RouterServiceConfig, 'metrics_host')})")


def build_config(args: argparse.Namespace) -> RouterServiceConfig:
    try:
        config = load_config(args.config, policy=args.policy, **given(args, _OPTIONS))
    except (OSError, ValueError) as exc:  # bad input: one line, exit 2
        refuse("router", file_problem("--config", args.config, exc) if args.config else f"config: {exc}")
    if args.region_rtt_ms is not None:
        config.router.regions = args.region_rtt_ms
    return config


def run(args: argparse.Namespace) -> int:
    from .service import RouterService

    config = build_config(args)
    if config.metrics_port is not None and (problem := listen_problem(config.metrics_host, config.metrics_port)):
        refuse("router", *problem)
    options = RunOptions.from_args(args)
    return run_service(lambda: RouterService(config, options.settings), options)
