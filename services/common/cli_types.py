"""Argument types the services' and the tools' command lines share."""

from __future__ import annotations

import argparse
import math
import os
from urllib.parse import SplitResult, urlsplit

from .regions import RegionLatency, parse_regions, region_problem


def port_number(text: str) -> int:
    """An argparse ``type`` for a TCP port: 0-65535 (0: the system picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, not {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse ``type`` for a duration: a finite number of seconds above 0 (``nan``
    and ``inf`` parse as floats, and a wait of either never ends)."""
    return _finite(text, "seconds", zero=False)


def non_negative_seconds(text: str) -> float:
    """An argparse ``type`` for a duration that may be 0 (0: off)."""
    return _finite(text, "seconds", zero=True)


def positive_number(text: str) -> float:
    """An argparse ``type`` for a rate or a size: a finite number above 0."""
    return _finite(text, "", zero=False)


def non_negative_number(text: str) -> float:
    """An argparse ``type`` for a size that may be 0."""
    return _finite(text, "", zero=True)


def _finite(text: str, unit: str, *, zero: bool) -> float:
    """``text`` as a finite float, at least 0 (``zero``) or above it; ``unit`` for messages."""
    of_unit = f" of {unit}" if unit else ""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number{of_unit}: {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = f"0 or more{' ' + unit if unit else ''}" if zero else f"a finite number{of_unit} above 0"
        raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type`` for a count that must be at least 1."""
    return _whole(text, 1)


def count(text: str) -> int:
    """An argparse ``type`` for a count that may be 0."""
    return _whole(text, 0)


# The largest count any flag takes: every count travels in msgpack, which stops at 64 bits.
MAX_COUNT = 2**63 - 1


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more, not {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT:,}, not {text}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type`` for a share: above 0, at most 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, not {text}")
    return value


def subject_root(text: str) -> str:
    """An argparse ``type`` for ``--root``: one NATS subject token."""
    from proto.subjects import subject_root_problem

    problem = subject_root_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


# The schemes nats-py connects with; a URL without one is taken as nats://.
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def split_nats_url(url: str) -> SplitResult:
    """``url``'s parts, read as nats-py reads it (no scheme: nats://)."""
    return urlsplit(url if "://" in url else f"nats://{url}")


def nats_url_problem(urls: str) -> str | None:
    """What is wrong with a comma-separated list of NATS URLs, or None. A typo such as
    ``http://`` or a missing host would otherwise read as an unreachable server after the
    connect timeout."""
    servers = [s.strip() for s in urls.split(",") if s.strip()]
    if not servers:
        return "no NATS URL given"
    for server in servers:
        parts = split_nats_url(server)
        try:
            port_ok = parts.port is None or 0 < parts.port
        except ValueError:  # a port that is not a number, or out of range
            port_ok = False
        if parts.scheme not in NATS_SCHEMES or not parts.hostname or not port_ok:
            return f"not a NATS URL: {server!r} (expected nats://HOST:PORT; schemes {', '.join(NATS_SCHEMES)})"
    return None


def shown_nats_url(url: str) -> str:
    """``url`` as a message may show it: a password or token in it replaced by ``***``."""
    parts = split_nats_url(url)
    if parts.username is None:
        return url
    user = f"{parts.username}:***" if parts.password is not None else "***"  # a bare user part is a token
    return url.replace(parts.netloc, f"{user}@{parts.netloc.rsplit('@', 1)[1]}", 1)


def nats_urls(text: str) -> str:
    """An argparse ``type`` for ``--nats-url``: one or more NATS URLs, comma-separated."""
    problem = nats_url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_nats_url_argument(parser: argparse.ArgumentParser,
                          help_text: str = "NATS server URL(s), comma-separated (env MESHSERVE_NATS_URL)",
                          default: str | None = None) -> None:
    """``--nats-url``, checked as a NATS URL list: every command that connects to a mesh takes it."""
    parser.add_argument("--nats-url", type=nats_urls, default=default, help=help_text)


def add_mesh_arguments(parser: argparse.ArgumentParser, *subcommands: argparse.ArgumentParser) -> None:
    """``--nats-url`` and ``--root`` for a command with subcommands (``keys``, ``adapters``),
    taken before the subcommand or after it: ``keys create --nats-url …`` was refused as an
    unrecognized argument. A subcommand's default is SUPPRESS, so its absent flag does not
    reset the one given before it."""
    for target, default in ((parser, None), *((sub, argparse.SUPPRESS) for sub in subcommands)):
        add_nats_url_argument(target, default=default)
        target.add_argument("--root", type=subject_root, default=default, help="subject root (env MESHSERVE_ROOT)")


def region_name(text: str) -> str:
    """An argparse ``type`` for a region (``--region``; DESIGN.md, Regions)."""
    problem = region_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def region_names(text: str) -> list[str]:
    """An argparse ``type`` for a comma-separated list of regions (``keys create --regions``)."""
    try:
        return parse_regions(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def region_rtt(text: str) -> RegionLatency:
    """An argparse ``type`` for ``--region-rtt-ms``: ``MS`` or ``MS,A:B=MS,…``."""
    try:
        return RegionLatency.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_region_argument(parser: argparse.ArgumentParser) -> None:
    """``--region`` (env MESHSERVE_REGION): where a worker or gateway runs."""
    parser.add_argument("--region", type=region_name, default=None,
                        help="the region this process runs in (env MESHSERVE_REGION; default: none, "
                             "a single-region mesh; DESIGN.md, Regions)")


def add_region_rtt_argument(parser: argparse.ArgumentParser) -> None:
    """``--region-rtt-ms``, for the services that weigh a region's distance (router, admission)."""
    parser.add_argument("--region-rtt-ms", type=region_rtt, default=None, metavar="MS[,A:B=MS…]",
                        help="round trips between regions, a default and per pair, weighed against a "
                             "farther region's shorter wait (default 50 ms between any two; DESIGN.md, Regions)")


def region_of_args(args: argparse.Namespace) -> str:
    """``--region``, else ``MESHSERVE_REGION``, else "" (a checked name either way)."""
    given = getattr(args, "region", None)
    if given:
        return str(given)
    env = os.environ.get("MESHSERVE_REGION", "").strip()
    if env:
        try:
            return region_name(env)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"MESHSERVE_REGION: {exc}") from None
    return ""
