"""Metering: usage events from the USAGE stream into an idempotent ledger, and usage queries.

``meshserve serve metering [--ledger-url URL] [--prices FILE] [--metrics-port N]``. The ledger is SQLite at
``.meshserve/ledger.sqlite3`` by default (one instance per file); give a
``postgresql://`` URL for production or for several instances.
"""

from __future__ import annotations

import argparse
import os
import sys

from bus import RunOptions, run_service
from bus.config import file_problem, refuse
from bus.runner import listen_problem
from services.common.cli_types import port_number, positive_int, positive_seconds

LEDGER_URL_ENV = "MESHSERVE_LEDGER_URL"
PRICES_ENV = "MESHSERVE_PRICES"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ledger-url", default=None,
        help=f"sqlite:///relative/path, sqlite:////absolute/path, a file path, or postgresql://user:pass@host/db "
             f"(env {LEDGER_URL_ENV}; default sqlite:///.meshserve/ledger.sqlite3)",
    )
    parser.add_argument("--prices", default=None,
                        help=f"price table, JSON or .toml (env {PRICES_ENV}; default: every model costs zero)")
    parser.add_argument("--durable", default="metering", help="name of the durable JetStream consumer on USAGE")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="events per fetch and per ledger transaction")
    parser.add_argument("--max-ack-pending", type=positive_int, default=2048, help="events held unacked at most (consumer-wide)")
    parser.add_argument("--ack-wait", type=positive_seconds, default=30.0, help="seconds before an unacked event is redelivered")
    parser.add_argument("--drain-timeout", type=positive_seconds, default=30.0, help="seconds the batch in progress gets on SIGTERM")
    parser.add_argument("--metrics-port", type=port_number, default=None, help="serve Prometheus /metrics here (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)")


def build_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .prices import load_prices
    from .service import MeteringConfig

    if args.max_ack_pending < args.batch_size:  # (each ≥ 1, the ack wait > 0: the parser's types)
        raise ValueError("--max-ack-pending must be >= --batch-size")
    prices_path = args.prices or os.environ.get(PRICES_ENV) or None
    try:
        prices = load_prices(prices_path)
    except ValueError as exc:
        assert prices_path is not None
        problem = file_problem("--prices", prices_path, exc.__cause__ if isinstance(exc.__cause__, OSError) else exc)
        if not args.prices:  # from the environment: name the variable
            problem = f"{PRICES_ENV}={problem.removeprefix('--prices ')}"
        raise ValueError(problem) from exc
    return MeteringConfig(
        ledger_url=args.ledger_url or os.environ.get(LEDGER_URL_ENV) or None,
        prices=prices,
        durable=args.durable,
        batch_size=args.batch_size,
        max_ack_pending=args.max_ack_pending,
        ack_wait_s=args.ack_wait,
        drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )


def run(args: argparse.Namespace) -> int:
    from .ledger import SqliteLedger, ledger_from_url, sqlite_ledger_problem
    from .service import MeteringService

    try:
        config = build_config(args)
        ledger = ledger_from_url(config.ledger_url)  # a malformed URL is an error now, not a retry loop
    except ValueError as exc:
        print(f"meshserve serve metering: {exc}", file=sys.stderr)
        return 2
    # A SQLite ledger that can never be opened too (the ledger opens after "ready", retrying).
    problem = sqlite_ledger_problem(ledger.path) if isinstance(ledger, SqliteLedger) else None
    if problem:
        refuse("metering", f"cannot open the ledger: {problem}", 1)
    if config.metrics_port is not None and (listen := listen_problem(config.metrics_host, config.metrics_port)):
        refuse("metering", *listen)
    options = RunOptions.from_args(args)
    return run_service(lambda: MeteringService(config, options.settings), options)
