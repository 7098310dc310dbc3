"""The ``meshserve`` command line: one sub-command per operator task.

Each sub-command lives in its own module exposing ``add_parser(subparsers)``, which
registers its parser and sets ``func`` (a callable taking the parsed args and
returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute sub-commands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "ops.up",
    "ops.serve",
    "ops.keys",
    "ops.status",
    "ops.usage",
    "ops.bench.cli",
    "ops.plan.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="meshserve: an LLM serving mesh over NATS")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
