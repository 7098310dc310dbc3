"""Admission: quotas per key and org, and predictive SLO shedding per tier.

``meshserve serve admission [--config FILE] [--metrics-port N]``. Run one or more: one
instance leads (holds a lease in JetStream KV) and serves checks, the others stand by
and take over within a few seconds if it dies. ``--config`` (JSON, or TOML when it ends
in ``.toml``) sets tiers, burst and the reservation TTL; see
``services.admission.config.parse_config`` for the schema::

    {"default_tier": "standard",
     "tiers": {"premium": {"ttft_slo_s": 1.0, "priority": 2},
               "standard": {"ttft_slo_s": 2.0, "priority": 1},
               "batch": {"ttft_slo_s": 10.0, "priority": 0}},
     "limits": {"burst_s": 60, "reservation_ttl_s": 900}}
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from bus import RunOptions, run_service
from bus.config import default_of, file_problem, given, refuse
from bus.runner import listen_problem
from services.common.cli_types import add_region_rtt_argument, port_number, positive_seconds

from .buckets import LimiterConfig
from .config import AdmissionConfig, load_config

# option dest → config key (``parse_config``'s overrides: LimiterConfig's burst and
# reservation TTL, AdmissionConfig's fields)
_OPTIONS = {"burst": "burst_s", "reservation_ttl": "reservation_ttl_s", "lease_ttl": "lease_ttl_s",
            "metrics_port": "metrics_port", "metrics_host": "metrics_host"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults come from the config (None here: not given); the help quotes them.
    parser.add_argument("--config", default=None, help="JSON or TOML file: tiers, burst, reservation TTL, SLO model")
    parser.add_argument("--burst", type=positive_seconds, default=None,
                        help="seconds of a key's per-minute budget it may spend at once "
                             f"(default {default_of(LimiterConfig, 'burst_s'):g})")
    parser.add_argument("--reservation-ttl", type=positive_seconds, default=None,
                        help="seconds before a reservation with no usage event is charged in full "
                             f"(default {default_of(LimiterConfig, 'reservation_ttl_s'):g})")
    parser.add_argument("--lease-ttl", type=positive_seconds, default=None,
                        help="seconds a dead leader's lease outlives it before a standby takes over "
                             f"(default {default_of(AdmissionConfig, 'lease_ttl_s'):g}); renewed every third of it")
    add_region_rtt_argument(parser)
    parser.add_argument("--metrics-port", type=port_number, default=None, help="serve Prometheus /metrics here (0: any free port)")
    parser.add_argument("--metrics-host", default=None,
                        help=f"address of /metrics (default {default_of(AdmissionConfig, 'metrics_host')})")


def build_config(args: argparse.Namespace) -> AdmissionConfig:
    overrides = given(args, _OPTIONS)
    if "lease_ttl_s" in overrides:
        overrides["lease_renew_s"] = overrides["lease_ttl_s"] / 3
    try:
        config = load_config(args.config, **overrides)
    except (OSError, ValueError) as exc:  # bad input: one line, exit 2
        refuse("admission", file_problem("--config", args.config, exc) if args.config else f"config: {exc}")
    if args.region_rtt_ms is not None:
        config = replace(config, book=replace(config.book, regions=args.region_rtt_ms))
    return config


def run(args: argparse.Namespace) -> int:
    from .service import AdmissionService

    config = build_config(args)
    if config.metrics_port is not None and (problem := listen_problem(config.metrics_host, config.metrics_port)):
        refuse("admission", *problem)
    options = RunOptions.from_args(args)
    return run_service(lambda: AdmissionService(config, options.settings), options)
