"""``meshserve services``: every meshserve service on the mesh, by NATS micro discovery.

The same answers as ``nats micro list`` / ``nats micro info NAME`` (``$SRV.PING`` and
``$SRV.INFO``), for machines without the ``nats`` CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from bus import Bus
from services.common.cli_types import add_nats_url_argument, positive_seconds, subject_root

from .console import mesh_bus


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "services", help="list the running services (NATS micro discovery, like `nats micro list`)",
        description="List every service instance answering NATS micro discovery ($SRV.INFO), with its id, version "
                    "and endpoints. --json prints the raw INFO replies.",
    )
    parser.add_argument("name", nargs="?", default="", help="only this service (e.g. meshserve-worker)")
    add_nats_url_argument(parser)
    parser.add_argument("--root", type=subject_root, default=None, help="subject root (env MESHSERVE_ROOT)")
    parser.add_argument("--wait", type=positive_seconds, default=0.5, help="seconds to collect answers")
    parser.add_argument("--json", action="store_true", help="print the INFO replies as JSON")
    parser.set_defaults(func=run_services)


async def discover_info(bus: Bus, name: str = "", wait: float = 0.5) -> list[dict[str, Any]]:
    """Every ``$SRV.INFO`` reply (of service ``name``, or of all services) within ``wait`` seconds."""
    inbox = bus.nc.new_inbox()
    found: list[dict[str, Any]] = []

    async def collect(msg: Any) -> None:
        try:
            found.append(json.loads(msg.data))
        except ValueError:
            pass  # not a micro reply: nothing to list

    sub = await bus.nc.subscribe(inbox, cb=collect)
    await bus.nc.publish("$SRV.INFO" + (f".{name}" if name else ""), b"", reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return sorted(found, key=lambda info: (info.get("name", ""), info.get("id", "")))


def run_services(args: argparse.Namespace) -> int:
    from .serve import apply_common_arguments

    apply_common_arguments(args)

    async def main() -> int:
        async with mesh_bus("meshserve-services") as bus:  # one error line, as every command
            # This mesh's only: meshes that share a NATS (MESHSERVE_ROOT) all answer $SRV.INFO.
            root = bus.subjects.root
            infos = [info for info in await discover_info(bus, args.name, args.wait)
                     if (info.get("metadata") or {}).get("root") == root]
        if args.json:
            sys.stdout.write(json.dumps(infos, indent=2) + "\n")
            return 0
        if not infos:
            print("meshserve services: no service answered" + (f" as {args.name}" if args.name else "")
                  + f" under the subject root {root!r}", file=sys.stderr)
            return 1
        # Plain lines, one per instance: readable piped and at any width.
        for info in infos:
            endpoints = ", ".join(e.get("subject", "") for e in info.get("endpoints") or [])
            print(f"{info.get('name', '?')}  id={info.get('id', '?')}  version={info.get('version', '?')}"
                  + (f"  endpoints: {endpoints}" if endpoints else ""))
        return 0

    return asyncio.run(main())
