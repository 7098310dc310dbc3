"""``meshserve serve SERVICE``: run one service in the foreground.

Each service module (``services/<name>/main.py``) exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only dispatches, so every service is runnable on its
own, in a container, under Nomad, or as a child of ``meshserve up``. The common options
(``add_common_arguments``) reach a service through ``args``: its ``run`` builds
``bus.RunOptions.from_args(args)`` and hands the settings to the service.
"""

from __future__ import annotations

import argparse
import errno
import importlib
from collections.abc import Mapping
from typing import Any

from bus.config import Refusal
from ops.console import EXIT_USAGE, CliError
from services.common.cli_types import add_nats_url_argument, subject_root

# service name → module with add_arguments/run
SERVICES: dict[str, str] = {
    "worker": "services.worker.main",
    "gateway": "services.gateway.main",
    "autoscaler": "services.autoscaler.main",
    "metering": "services.metering.main",
    "router": "services.router.main",
    "admission": "services.admission.main",
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_url_argument(parser)
    parser.add_argument("--root", type=subject_root, help="subject root of this mesh (env MESHSERVE_ROOT, default mesh)")
    parser.add_argument("--log-level", type=log_level, default=None, metavar="LEVEL",
                        help="debug, info, warning, error, critical (env MESHSERVE_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=["text", "json"], default=None, help="json for JSON lines (env MESHSERVE_LOG_FORMAT)")


def log_level(text: str) -> str:
    """An argparse ``type`` for ``--log-level``: a level ``logging`` knows, in any case."""
    from bus.runner import log_level_problem

    problem = log_level_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def apply_common_arguments(args: argparse.Namespace) -> None:
    """Command-line options override the environment, which ``BusSettings.from_env`` reads
    (the CLI commands that connect to a mesh: keys, status, usage, services)."""
    import os

    if getattr(args, "nats_url", None):
        os.environ["MESHSERVE_NATS_URL"] = args.nats_url
    if getattr(args, "root", None):
        os.environ["MESHSERVE_ROOT"] = args.root
    if getattr(args, "log_level", None):
        os.environ["MESHSERVE_LOG_LEVEL"] = args.log_level
    if getattr(args, "log_format", None):
        os.environ["MESHSERVE_LOG_FORMAT"] = args.log_format


def add_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run one meshserve service in the foreground")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, module_name in SERVICES.items():
        module = importlib.import_module(module_name)
        parser = services.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        add_common_arguments(parser)
        module.add_arguments(parser)
        parser.set_defaults(func=_runner(module), cli_prog=f"meshserve serve {name}")


def _runner(module: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        if not getattr(args, "log_level", None):  # --log-level overrides it (and the parser checked that)
            check_log_level_env()
        try:
            return int(module.run(args))
        except SystemExit as exc:
            if isinstance(exc, Refusal) or not isinstance(exc.code, str):
                raise
            # A service's own "cannot be configured so" (``raise SystemExit(message)``): said as
            # ``refuse`` says it, one line naming the command, exit 2 (it exited 1, unnamed).
            raise CliError(exc.code.removeprefix(f"{args.cli_prog}: "), EXIT_USAGE) from None
        except OSError as exc:
            # A listening socket a pre-start check could not foresee (taken meanwhile): one
            # line, as sim-server says it, not a traceback. Any other OSError is a bug's.
            if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES) or "bind" not in str(exc):
                raise
            raise CliError(f"cannot listen: {exc.strerror or exc}") from None

    return run


def check_log_level_env(env: Mapping[str, str] | None = None) -> None:
    """``MESHSERVE_LOG_LEVEL`` (what ``--log-level`` overrides; the parser checks that) must
    name a level: a bad one is one line and exit 2, not ``setup_logging``'s traceback."""
    import os

    from bus.runner import log_level_problem

    level = (os.environ if env is None else env).get("MESHSERVE_LOG_LEVEL")
    problem = log_level_problem(level) if level else None
    if problem:
        raise CliError(f"MESHSERVE_LOG_LEVEL={level}: {problem}", EXIT_USAGE)
