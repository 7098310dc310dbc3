#!/usr/bin/env python3
"""Health check of the meshserve service in this container (``meshserve-healthcheck``).

Docker's HEALTHCHECK and Nomad's script checks run it with no arguments. It finds the
``meshserve serve SERVICE ...`` process in the container, parses that command line with
the service's own parser (so it knows the ports and ids the service really uses), and
checks, within a few seconds:

- gateway: ``GET /healthz`` on its ``--port`` (HTTPS when ``--tls-cert``);
- a service started with ``--metrics-port``: ``GET /metrics`` answers;
- every service: this very instance answers NATS micro ``$SRV.PING.meshserve-SERVICE``
  (connected to NATS and registered), matched by its ``--gateway-id`` / ``--worker-id``
  or, by default, by the container's hostname inside its instance id.

Exit status 0: healthy; 1: not.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import ssl
import sys
import urllib.request
from pathlib import Path
from typing import Any

TIMEOUT_S = 3.0


def find_service(proc: Path = Path("/proc")) -> tuple[str, list[str]] | None:
    """The service name and its arguments, from the command line of a ``meshserve serve`` process."""
    from ops.serve import SERVICES

    for entry in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i in range(1, len(argv) - 1):
            if argv[i] == "serve" and argv[i + 1] in SERVICES and (argv[i - 1].endswith("meshserve") or argv[i - 1] == "ops.cli"):
                return argv[i + 1], [a for a in argv[i + 2 :] if a != ""]
    return None


def parse(service: str, args: list[str]) -> argparse.Namespace:
    from ops.serve import SERVICES, add_common_arguments

    parser = argparse.ArgumentParser(prog=f"meshserve serve {service}")
    add_common_arguments(parser)
    importlib.import_module(SERVICES[service]).add_arguments(parser)
    parsed, _ = parser.parse_known_args(args)
    return parsed


def http_ok(url: str) -> bool:
    context = ssl._create_unverified_context() if url.startswith("https") else None  # our own cert, maybe self-signed
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def local_address(host: str | None) -> str:
    """Where a check in the same container reaches a listener bound to ``host``."""
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host


def instance_matches(instance: str, explicit_id: str, hostname: str) -> bool:
    if explicit_id:
        return instance == explicit_id
    return hostname[:16] in instance


async def answers_ping(service: str, explicit_id: str, options: argparse.Namespace) -> bool:
    from bus import Bus, BusSettings

    env = dict(os.environ)
    if getattr(options, "nats_url", None):
        env["MESHSERVE_NATS_URL"] = options.nats_url
    settings = BusSettings.from_env(env)
    hostname = socket.gethostname()
    found = asyncio.Event()
    try:
        # Bounded here: a connect with reconnects allowed keeps trying while no server answers.
        bus = await asyncio.wait_for(Bus.open(settings, "meshserve-healthcheck", initial_attempts=1), TIMEOUT_S)
    except TimeoutError as exc:
        raise ConnectionError(f"no NATS server of {', '.join(settings.servers)} answered within {TIMEOUT_S:.0f}s") from exc
    try:

        async def on_reply(msg: Any) -> None:
            try:
                info = json.loads(msg.data)
            except ValueError:
                return
            if instance_matches(str((info.get("metadata") or {}).get("instance", "")), explicit_id, hostname):
                found.set()

        inbox = bus.nc.new_inbox()
        await bus.nc.subscribe(inbox, cb=on_reply)
        await bus.nc.publish(f"$SRV.PING.meshserve-{service}", b"", reply=inbox)
        try:
            await asyncio.wait_for(found.wait(), TIMEOUT_S)
        except TimeoutError:
            return False
        return True
    finally:
        await bus.nc.close()


def check(service: str, options: argparse.Namespace) -> list[str]:
    """What is wrong (nothing: healthy)."""
    problems = []
    if service == "gateway":
        scheme = "https" if options.tls_cert else "http"
        if not http_ok(f"{scheme}://{local_address(options.host)}:{options.port}/healthz"):
            problems.append(f"gateway /healthz on port {options.port} does not answer 200")
    metrics_port = getattr(options, "metrics_port", None)
    if metrics_port:
        if not http_ok(f"http://{local_address(options.metrics_host)}:{metrics_port}/metrics"):
            problems.append(f"/metrics on port {metrics_port} does not answer 200")
    explicit = getattr(options, "gateway_id", "") or getattr(options, "worker_id", "") or ""
    try:
        if not asyncio.run(answers_ping(service, explicit, options)):
            problems.append(f"this {service} does not answer $SRV.PING.meshserve-{service}")
    except Exception as exc:
        problems.append(f"NATS: {exc}")
    return problems


def main() -> int:
    found = find_service()
    if found is None:
        print("no `meshserve serve SERVICE` process in this container", file=sys.stderr)
        return 1
    service, args = found
    problems = check(service, parse(service, args))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
