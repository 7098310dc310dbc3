"""``meshserve adapters add|list|remove``: LoRA adapters served from their base model's pool.

``add`` refuses, before anything is stored (exit 2), what the pool could not serve: a
directory without a PEFT ``adapter_config.json`` (with its rank ``r``) and weights
(``adapter_model.safetensors`` or ``.bin``), a base model no registered worker serves, a
pool whose workers neither load adapters at run time (``--max-loras``) nor were started
with this one, a rank above what the pool's workers take (``--max-lora-rank``), and a name
that is already a model or an adapter. The path is stored as given, made absolute: the
workers load from it, so it must be the same on their machines (shared storage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bus import Bus
from bus.keys import AdapterStore
from ops.console import EXIT_USAGE, CliError, mesh_bus, plain, print_table
from proto import AdapterRecord, WorkerInfo
from services.common.cli_types import add_mesh_arguments

# What a key of the adapters' KV bucket may hold (NATS refuses ':' and '@' there).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def read_adapter_dir(path: str) -> tuple[Path, int, int]:
    """(absolute directory, rank, weights bytes) of a PEFT LoRA adapter directory."""
    where = Path(path).expanduser().resolve()
    if not where.is_dir():
        raise CliError(f"--path {path}: no such directory", EXIT_USAGE)
    config_file = where / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except OSError:
        raise CliError(f"--path {path}: no adapter_config.json (a PEFT LoRA adapter directory has one)",
                       EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(f"{config_file}: not JSON ({exc})", EXIT_USAGE) from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CliError(f"{config_file}: no LoRA rank (\"r\", a whole number ≥ 1)", EXIT_USAGE)
    weights = [where / w for w in WEIGHTS if (where / w).is_file()]
    if not weights:
        raise CliError(f"--path {path}: no weights ({' or '.join(WEIGHTS)})", EXIT_USAGE)
    empty = [w.name for w in weights if w.stat().st_size == 0]
    if empty:  # registered, every request to it was "unknown LoRA adapter" (vLLM reads safetensors first)
        raise CliError(f"--path {path}: its weights file {empty[0]} is empty", EXIT_USAGE)
    return where, rank, sum(w.stat().st_size for w in weights)


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise CliError(f"adapter name {name!r}: letters, digits and . _ / - only, starting with a letter or digit, "
                       "at most 128 characters", EXIT_USAGE)


def check_pool(name: str, base: str, rank: int, workers: Iterable[WorkerInfo], adapters: Iterable[str]) -> None:
    """Refuse an adapter the base model's pool could not serve (``CliError``, exit 2)."""
    workers = list(workers)
    models = sorted({w.model for w in workers})
    if name in models:
        raise CliError(f"{name!r} is a model served by the mesh: choose another adapter name", EXIT_USAGE)
    if name in set(adapters):
        raise CliError(f"adapter {name!r} exists: `meshserve adapters remove {name}` first", EXIT_USAGE)
    pool = [w for w in workers if w.model == base]
    if not pool:
        served = ", ".join(models) or "none: no worker is registered"
        raise CliError(f"no worker serves model {base!r} (served now: {served}): start its pool first", EXIT_USAGE)
    loading = [w for w in pool if w.max_loras > 0]
    holding = [w for w in pool if name in w.lora_adapters]
    if not loading and not holding:
        raise CliError(f"the workers of {base!r} do not load adapters at run time: start them with --max-loras N "
                       f"(or with --lora-adapters {name}=PATH)", EXIT_USAGE)
    ranks = [w.max_lora_rank for w in loading if w.max_lora_rank > 0]
    if ranks and rank > min(ranks):
        raise CliError(f"the adapter's rank is {rank}, above the {min(ranks)} the workers of {base!r} take "
                       "(their --max-lora-rank)", EXIT_USAGE)


async def registered_workers(bus: Bus) -> list[WorkerInfo]:
    from bus.registry import WorkerRegistry

    registry = WorkerRegistry(bus)
    await registry.start()
    try:
        return list(registry.workers.values())
    finally:
        await registry.stop()


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "adapters", help="add, list and remove LoRA adapters",
        description="LoRA adapters served from their base model's pool: a request with \"model\": NAME goes to the "
                    "base model's workers, which load the adapter when they do not hold it.")
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser(
        "add", help="register an adapter of a served model",
        description="Register an adapter. Refused, exit 2 and nothing stored: no adapter_config.json with a rank, "
                    "no weights, a base no worker serves, a pool that loads no adapters at run time, a rank above "
                    "the pool's, a name already used.")
    add.add_argument("name", help="the model name clients will send")
    add.add_argument("--base", required=True, help="the served model the adapter applies to")
    add.add_argument("--path", required=True, help="the PEFT adapter directory, the same path on every worker")
    listing = actions.add_parser("list", help="list adapters", description="List adapters, or --json for scripts.")
    listing.add_argument("--json", action="store_true", help="print the adapters as JSON (for scripts)")
    remove = actions.add_parser("remove", help="remove an adapter (its requests then get 404)")
    remove.add_argument("name")
    for action, sub in (("add", add), ("list", listing), ("remove", remove)):
        sub.set_defaults(cli_prog=f"meshserve adapters {action}")
    add_mesh_arguments(p, add, listing, remove)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)
    found: tuple[Path, int, int] | None = None
    if args.action in ("add", "remove"):  # bad input is refused before connecting
        check_name(args.name)
    if args.action == "add":
        found = read_adapter_dir(args.path)
    return asyncio.run(_run(args, found))


async def _run(args: argparse.Namespace, found: tuple[Path, int, int] | None) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    async with mesh_bus("meshserve-adapters") as bus:
        store = await AdapterStore(bus).open()
        if args.action == "add":
            assert found is not None
            where, rank, size = found
            existing = [a.name for a in await store.list()]
            check_pool(args.name, args.base, rank, await registered_workers(bus), existing)
            record = AdapterRecord(name=args.name, base=args.base, path=str(where), rank=rank, size_bytes=size,
                                   created_at=time.time())
            await store.put(record)
            console.print(f"adapter [bold]{escape(record.name)}[/bold] of {escape(record.base)}: rank {rank}, "
                          f"{size / 1e6:,.1f} MB, from {escape(str(where))}")
            return 0
        if args.action == "list":
            records = await store.list()
            if args.json:
                json.dump([{f: getattr(r, f) for f in r.__struct_fields__ if f != "v"} for r in records], sys.stdout,
                          indent=2)
                print()
                return 0
            if not records:
                console.print("no LoRA adapters in this mesh: `meshserve adapters add NAME --base MODEL --path DIR` "
                              "registers one", markup=False, soft_wrap=True)
                return 0
            print_table(console, adapters_table(records))
            return 0
        if not await store.delete(args.name):
            raise CliError(f"no adapter {args.name!r}")
        console.print(f"removed {args.name}", markup=False)
        return 0


def adapters_table(records: Iterable[AdapterRecord]) -> Any:
    from rich.table import Table

    table = Table("adapter", "base", "rank", "MB", "path")
    for r in records:
        table.add_row(plain(r.name), plain(r.base), str(r.rank), f"{r.size_bytes / 1e6:,.1f}", plain(r.path))
    return table
