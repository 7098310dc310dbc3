"""``meshserve keys create|list|revoke``: API keys in the mesh's ``mesh_keys`` bucket.

Only a key's SHA-256 hash is stored; the key itself is printed once, at creation.

``create`` refuses what the mesh could not honour before anything is stored: a limit
below 1, a tier admission does not define (its default tiers, or those of the file
given with ``--admission-config``), and a model no registered worker serves unless
``--allow-unknown-model`` says it is meant (a model whose workers start later, or a
gateway alias, which the mesh does not publish).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from bus import Bus
from bus.keys import AdapterStore, KeyStore
from ops.console import EXIT_USAGE, CliError, mesh_bus, plain, print_table
from proto import ApiKeyRecord, DecodeError, decode
from services.admission.buckets import Limits, limits_problem
from services.common.cli_types import MAX_COUNT, add_mesh_arguments, region_names
from services.gateway.apikeys import generate_key, is_valid_key_id, parse_key, redact_key


async def create_key(
    bus: Bus, *, org: str, tier: str = "standard", name: str = "", rpm: int | None = None, tpm: int | None = None,
    max_concurrent: int | None = None, models: list[str] | None = None, regions: list[str] | None = None,
) -> tuple[str, ApiKeyRecord]:
    key, record = generate_key(org=org, tier=tier, name=name, rpm=rpm, tpm=tpm, max_concurrent=max_concurrent,
                               models=models or [], regions=regions or [], created_at=time.time())
    await (await KeyStore(bus).open()).put(record)
    return key, record


def admission_tiers(config_path: str | None = None) -> list[str]:
    """The tier names admission knows: its defaults, or those of its config file."""
    from services.admission.config import load_config

    try:
        config = load_config(config_path)
    except (OSError, ValueError) as exc:
        raise CliError(f"--admission-config: {exc}", EXIT_USAGE) from exc
    return [t.name for t in config.slo.tiers]


def check_key_options(*, org: str, tier: str, rpm: int | None, tpm: int | None, tiers: Sequence[str],
                      max_concurrent: int | None = None) -> None:
    """Refuse options the mesh could not honour (``CliError``, exit 2); nothing is stored yet."""
    if not org.strip():
        raise CliError("--org must not be empty", EXIT_USAGE)
    for flag, value in (("--rpm", rpm), ("--tpm", tpm), ("--max-concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be a whole number ≥ 1, got {value} (leave it out for no limit; "
                           "`meshserve keys revoke` disables a key)", EXIT_USAGE)
        if value is not None and value > MAX_COUNT:  # a key record is msgpack: 64 bits at most
            raise CliError(f"{flag} must be at most {MAX_COUNT:,}, got {value} (leave it out for no limit)",
                           EXIT_USAGE)
    if tier not in tiers:
        raise CliError(f"unknown tier {tier!r}: admission's tiers are {', '.join(tiers)} (if admission runs "
                       "with its own tiers, pass its file with --admission-config)", EXIT_USAGE)


def check_models(models: Iterable[str], served: Iterable[str]) -> None:
    served = sorted(set(served))
    unknown = [m for m in models if m not in served]
    if unknown:
        known = ", ".join(served) if served else "none: no worker is registered"
        raise CliError(f"no worker serves model {', '.join(map(repr, unknown))} (served now: {known}); pass "
                       "--allow-unknown-model to restrict the key to it anyway (workers yet to start, or a "
                       "gateway alias)", EXIT_USAGE)


async def served_models(bus: Bus) -> set[str]:
    """Every model a registered worker serves or will serve (starting ones included), and
    the registered LoRA adapters of those models."""
    from bus.registry import WorkerRegistry

    registry = WorkerRegistry(bus)
    await registry.start()
    try:
        models = {w.model for w in registry.workers.values()}
    finally:
        await registry.stop()
    # A registered LoRA adapter of a served model is served too (the gateway lists it).
    adapters = await (await AdapterStore(bus).open()).list()
    return models | {a.name for a in adapters if a.base in models}


def key_id_of(text: str) -> str:
    """A key id from a key id or a whole key (``msk-<key_id>-<secret>``)."""
    parsed = parse_key(text.strip())
    if parsed is not None:
        return parsed.key_id
    if is_valid_key_id(text.strip()):
        return text.strip()
    # Never echo it: a mangled key is still mostly a secret.
    raise CliError(f"{redact_key(text)} is neither a key id (12 hex characters) nor a key (msk-<key id>-<secret>)",
                   EXIT_USAGE)


async def read_keys(store: KeyStore) -> tuple[list[ApiKeyRecord], list[str]]:
    """Every record, oldest first, and the ids of entries that do not decode (an operator
    should see those: the gateway ignores them, so their keys are refused)."""
    from bus.mirror import live_entries

    records: list[ApiKeyRecord] = []
    unreadable: list[str] = []
    for entry in await live_entries(store.bus, store.kv):
        try:
            records.append(decode(entry.value or b"", ApiKeyRecord))
        except DecodeError:
            unreadable.append(entry.key)
    return sorted(records, key=lambda r: r.created_at), sorted(unreadable)


def record_problem(record: ApiKeyRecord) -> str:
    problem = limits_problem(Limits(rpm=record.rpm, tpm=record.tpm, concurrent=record.max_concurrent))
    return f"invalid limit {problem}: recreate the key" if problem else ""


def add_parser(subparsers: Any) -> None:
    from services.admission.slo import DEFAULT_TIERS

    default_tiers = ", ".join(t.name for t in DEFAULT_TIERS)
    keys = subparsers.add_parser(
        "keys", help="create, list and revoke API keys",
        description="API keys in the mesh's key bucket. Only a key's SHA-256 hash is stored; the key itself is "
                    "printed once, at creation. `keys list --json` for scripts.")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create", help="create a key and print it once",
        description="Create a key and print it once (on stdout; the key id goes to stderr). Refused, exit 2 and "
                    "nothing stored: a limit below 1, a tier admission does not define, a --model no registered "
                    "worker serves (unless --allow-unknown-model).")
    create.add_argument("--org", required=True,
                        help="the organisation the key bills to (usage is reported and limited per org)")
    create.add_argument("--tier", default="standard",
                        help=f"an admission tier: {default_tiers} unless admission runs with its own "
                             "(see --admission-config)")
    create.add_argument("--admission-config", default=None, metavar="FILE",
                        help="admission's config file (JSON or TOML), when it defines its own tiers")
    create.add_argument("--name", default="", help="a label for people (keys list shows it)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute, ≥ 1 (none: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute, ≥ 1 (none: unlimited)")
    create.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                        help="requests in flight at once, ≥ 1; one more is refused with a 429 until one ends "
                             "(none: unlimited)")
    create.add_argument("--model", action="append", default=[],
                        help="restrict to this model (repeatable); it must be served by a registered worker "
                             "unless --allow-unknown-model")
    create.add_argument("--regions", type=region_names, default=[], metavar="REGION[,REGION…]",
                        help="data residency: its requests run only on workers in these regions, refused (503) "
                             "while none there can take them (default: any region)")
    create.add_argument("--allow-unknown-model", action="store_true",
                        help="accept --model names no worker serves now (workers yet to start, gateway aliases)")
    listing = actions.add_parser("list", help="list keys (ids only, never secrets)",
                                 description="List keys (ids only, never secrets): a table for people, whole at "
                                             "any width, or --json for scripts.")
    listing.add_argument("--json", action="store_true", help="print the keys as JSON (for scripts)")
    revoke = actions.add_parser("revoke", help="revoke a key by id (or by the key itself)")
    revoke.add_argument("key_id", metavar="KEY_ID_OR_KEY", help="the key id (12 hex characters) or the whole key")
    for action, sub in (("create", create), ("list", listing), ("revoke", revoke)):
        sub.set_defaults(cli_prog=f"meshserve keys {action}")
    add_mesh_arguments(keys, create, listing, revoke)
    keys.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)
    if args.action == "create":  # refuse bad input before connecting
        check_key_options(org=args.org, tier=args.tier, rpm=args.rpm, tpm=args.tpm,
                          tiers=admission_tiers(args.admission_config), max_concurrent=args.max_concurrent)
    key_id = key_id_of(args.key_id) if args.action == "revoke" else ""
    return asyncio.run(_run(args, key_id))


async def _run(args: argparse.Namespace, key_id: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    async with mesh_bus("meshserve-keys") as bus:
        if args.action == "create":
            if args.model and not args.allow_unknown_model:
                check_models(args.model, await served_models(bus))
            key, record = await create_key(bus, org=args.org, tier=args.tier, name=args.name, rpm=args.rpm,
                                           tpm=args.tpm, max_concurrent=args.max_concurrent, models=args.model,
                                           regions=args.regions)
            print(key, flush=True)  # first: the record is stored, and the secret is shown only now
            Console(stderr=True).print(f"key id [bold]{record.key_id}[/bold] for org {escape(record.org)}"
                                       f" (tier {escape(record.tier)})")
            return 0
        store = await KeyStore(bus).open()
        if args.action == "list":
            records, unreadable = await read_keys(store)
            if args.json:
                rows = [{**{f: getattr(r, f) for f in r.__struct_fields__ if f != "key_hash"},
                         "problem": record_problem(r)} for r in records]
                rows += [{"key_id": k, "problem": "unreadable record"} for k in unreadable]
                json.dump(rows, sys.stdout, indent=2)
                print()
                return 0
            if not records and not unreadable:
                console.print("no API keys in this mesh: `meshserve keys create --org ORG` makes one", markup=False,
                              soft_wrap=True)
                return 0
            print_table(console, keys_table(records, unreadable))
            return 0
        if not await store.revoke(key_id):
            raise CliError(f"no key {key_id}")
        console.print(f"revoked {key_id}", markup=False)
        return 0


def keys_table(records: Sequence[ApiKeyRecord], unreadable: Sequence[str] = ()) -> Any:
    from rich.table import Table

    problems = [record_problem(r) for r in records]
    table = Table("key id", "org", "tier", "name", "rpm", "tpm", "concurrent", "models", "regions", "revoked")
    columns = len(table.columns)
    if any(problems) or unreadable:
        table.add_column("problem", style="red")

    def limit(value: int | None) -> str:
        return str(value) if value is not None else "-"

    for r, problem in zip(records, problems, strict=True):
        row = [plain(r.key_id), plain(r.org), plain(r.tier), plain(r.name), limit(r.rpm), limit(r.tpm),
               limit(r.max_concurrent), plain(",".join(r.models) or "all"), plain(",".join(r.regions) or "any"),
               "yes" if r.revoked else ""]
        table.add_row(*row, *([plain(problem)] if len(table.columns) > columns else []))
    for key_id in unreadable:
        table.add_row(plain(key_id), *([""] * (columns - 1)), "unreadable record: recreate the key")
    return table
