"""``meshserve keys create|list|revoke``: API keys in the mesh's ``mesh_keys`` bucket.

Only a key's SHA-256 hash is stored; the key itself is printed once, at creation.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from bus import Bus, BusSettings
from bus.keys import KeyStore
from proto import ApiKeyRecord
from services.gateway.apikeys import generate_key


async def create_key(
    bus: Bus, *, org: str, tier: str = "standard", name: str = "", rpm: int | None = None, tpm: int | None = None,
    models: list[str] | None = None,
) -> tuple[str, ApiKeyRecord]:
    key, record = generate_key(org=org, tier=tier, name=name, rpm=rpm, tpm=tpm, models=models or [], created_at=time.time())
    await (await KeyStore(bus).open()).put(record)
    return key, record


def add_parser(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    keys.add_argument("--nats-url", default=None, help="NATS URL (env MESHSERVE_NATS_URL)")
    keys.add_argument("--root", default=None, help="subject root (env MESHSERVE_ROOT)")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key and print it once")
    create.add_argument("--org", required=True)
    create.add_argument("--tier", default="standard", help="premium, standard or batch")
    create.add_argument("--name", default="")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (none: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute (none: unlimited)")
    create.add_argument("--model", action="append", default=[], help="restrict to this model (repeatable)")
    actions.add_parser("list", help="list keys (ids only, never secrets)")
    revoke = actions.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    keys.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .serve import apply_common_arguments

    apply_common_arguments(args)
    console = Console(width=160) if not sys.stdout.isatty() else Console()

    async def main() -> int:
        bus = await Bus.open(BusSettings.from_env(), "meshserve-keys", initial_attempts=3)
        try:
            if args.action == "create":
                key, record = await create_key(bus, org=args.org, tier=args.tier, name=args.name, rpm=args.rpm,
                                               tpm=args.tpm, models=args.model)
                console.print(f"key id [bold]{record.key_id}[/bold] for org {record.org} (tier {record.tier})")
                print(key)
                return 0
            store = await KeyStore(bus).open()
            if args.action == "list":
                table = Table("key id", "org", "tier", "name", "rpm", "tpm", "models", "revoked")
                for r in await store.list():
                    table.add_row(r.key_id, r.org, r.tier, r.name, str(r.rpm or "-"), str(r.tpm or "-"),
                                  ",".join(r.models) or "all", "yes" if r.revoked else "")
                console.print(table)
                return 0
            if await store.revoke(args.key_id):
                console.print(f"revoked {args.key_id}")
                return 0
            console.print(f"[red]no key {args.key_id}[/red]")
            return 1
        finally:
            await bus.close()

    return asyncio.run(main())
