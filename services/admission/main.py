"""Admission: quotas per key and org, and predictive SLO shedding per tier.

``meshserve serve admission [--config FILE] [--metrics-port N]``. Run one or more: one
instance leads (holds a lease in JetStream KV) and serves checks, the others stand by
and take over within a few seconds if it dies. ``--config`` (JSON, or TOML when it ends
in ``.toml``) sets tiers, burst and the reservation TTL; see
``services.admission.service.parse_config`` for the schema::

    {"default_tier": "standard",
     "tiers": {"premium": {"ttft_slo_s": 1.0, "priority": 2},
               "standard": {"ttft_slo_s": 2.0, "priority": 1},
               "batch": {"ttft_slo_s": 10.0, "priority": 0}},
     "limits": {"burst_s": 60, "reservation_ttl_s": 900}}
"""

from __future__ import annotations

import argparse

from bus import run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="JSON or TOML file: tiers, burst, reservation TTL, SLO model")
    parser.add_argument("--burst", type=float, default=None,
                        help="seconds of a key's per-minute budget it may spend at once (default 60: one minute)")
    parser.add_argument("--reservation-ttl", type=float, default=None,
                        help="seconds before a reservation with no usage event is charged in full (default 900)")
    parser.add_argument("--lease-ttl", type=float, default=None,
                        help="seconds a dead leader's lease outlives it before a standby takes over (default 3)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1")


def build_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .service import load_config

    overrides = {
        "burst_s": args.burst, "reservation_ttl_s": args.reservation_ttl, "lease_ttl_s": args.lease_ttl,
        "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
    }
    if args.lease_ttl is not None:
        overrides["lease_renew_s"] = args.lease_ttl / 3
    try:
        return load_config(args.config, **overrides)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"admission config: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    from .service import AdmissionService

    config = build_config(args)
    return run_service(lambda: AdmissionService(config))
