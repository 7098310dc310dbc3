"""The ``meshserve`` command line: one sub-command per operator task.

Each sub-command lives in its own module exposing ``add_parser(subparsers)``, which
registers its parser and sets ``func`` (a callable taking the parsed args and
returning an exit code). Every command reports an expected failure the same way: it
raises ``ops.console.CliError`` (or lets a ``MeshError`` or NATS error through) and
``main`` prints one line, ``meshserve <command>: <message>``, and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Sub-command → the module that contributes it, in help order.
COMMANDS: dict[str, str] = {
    "up": "ops.up_cli",
    "serve": "ops.serve",
    "keys": "ops.keys",
    "adapters": "ops.adapters",
    "status": "ops.status",
    "usage": "ops.usage",
    "bench": "ops.bench.cli",
    "plan": "ops.plan.cli",
    "make-tiny-model": "ops.tiny_model",
    "calibrate": "ops.calibrate",
    "tokenizer": "ops.tokenizer_cli",
    "services": "ops.services",
    "sim-server": "ops.simserver.main",
}
COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(COMMANDS.values()))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` the parser of that one sub-command.

    Running a command imports just its module: a service process started with
    ``meshserve serve worker`` does not pay for the bench's plotting stack.
    """
    from proto import __version__

    parser = argparse.ArgumentParser(prog="meshserve", description="meshserve: an LLM serving mesh over NATS")
    parser.add_argument("--version", action="version", version=f"meshserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[only]] if only in COMMANDS else COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ops.console import describe_failure

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        result = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`meshserve plan --json | head -1`): stop quietly, as a
        # command killed by SIGPIPE does, and keep Python's exit-time flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE
    except Exception as exc:
        failure = describe_failure(exc)
        if failure is None:
            raise  # a bug: its traceback is the report
        message, code = failure
        print(f"{getattr(args, 'cli_prog', None) or f'meshserve {args.command}'}: {message}", file=sys.stderr)
        return code
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
