"""What every ``meshserve`` command shares: one error style, and tables that keep every number.

Errors: a command raises ``CliError`` for a failure an operator can cause (bad input, no
mesh, nothing found); ``ops.cli.main`` prints it, and any ``MeshError`` or NATS error,
as one line on stderr, ``meshserve <command>: <message>``, and exits non-zero. Never a
traceback for those.

Tables: ``print_table`` prints a rich ``Table`` without ever cutting a cell. Rich fits a
table to the console by shrinking columns to ``…``, and a console that is not a
terminal is 80 columns wide, so ``meshserve bench > file`` used to lose every latency.
A file or pipe gets the table at its natural width (a file has no edge); a terminal
narrower than the table gets it transposed (one column per row: few rows, many
columns, the shape of a benchmark) or, failing that too, stacked: one block of
``header  value`` lines per row.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

    from bus import Bus

EXIT_FAILURE = 1
EXIT_USAGE = 2  # bad input on the command line


class CliError(Exception):
    """An expected failure of a command: printed as one line, exit ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def describe_failure(exc: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) for the failures ``main`` reports without a traceback;
    None for anything else (a bug keeps its traceback)."""
    import sys

    from proto.errors import MeshError

    if isinstance(exc, CliError):
        return exc.message, exc.exit_code
    if isinstance(exc, MeshError):
        return exc.message, EXIT_FAILURE
    nats_errors = sys.modules.get("nats.errors")  # only a command that used NATS can raise one
    if nats_errors is not None and isinstance(exc, nats_errors.Error):
        return str(exc) or f"NATS: {type(exc).__name__}", EXIT_FAILURE
    return None


@contextlib.asynccontextmanager
async def mesh_bus(name: str, *, initial_attempts: int = 3) -> AsyncIterator[Bus]:
    """A connection to the mesh for one command, closed after it.

    An unreachable NATS is a ``CliError`` naming the URL and what to do. The client's
    per-retry warnings are silenced meanwhile: they are for services, which wait for
    NATS; a command reports the outcome once.
    """
    from bus import Bus, BusSettings
    from proto.errors import MeshError
    from proto.subjects import subject_root_problem
    from services.common.cli_types import nats_url_problem, shown_nats_url

    settings = BusSettings.from_env()
    problem = nats_url_problem(",".join(settings.servers))  # MESHSERVE_NATS_URL: --nats-url is checked by argparse
    if problem:
        raise CliError(f"{problem} in MESHSERVE_NATS_URL", EXIT_USAGE)
    problem = subject_root_problem(settings.root)  # MESHSERVE_ROOT: --root is checked by argparse
    if problem:
        raise CliError(f"{problem} in MESHSERVE_ROOT", EXIT_USAGE)
    hint = "(is the mesh up? start it with `meshserve up`, or pass --nats-url / set MESHSERVE_NATS_URL)"
    unreachable = await unreachable_servers(settings.servers, timeout_s=settings.connect_timeout_s)
    if len(unreachable) == len(settings.servers):
        # nats-py retries a refused connection until its connect timeout and then reports
        # only TimeoutError(): ~10 s to say nothing listens there. Say it at once.
        raise CliError(f"cannot reach NATS at {'; '.join(unreachable)} {hint}")
    where = ", ".join(shown_nats_url(s) for s in settings.servers)
    client_log = logging.getLogger("bus.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)
    try:
        bus = await Bus.open(settings, name, initial_attempts=initial_attempts)
    except MeshError as exc:
        cause = exc.__cause__
        if isinstance(cause, TimeoutError):
            why = "it takes connections but did not answer as a NATS server in time"
        elif cause is not None:
            why = str(cause) or type(cause).__name__
        else:
            why = exc.message
        raise CliError(f"cannot reach NATS at {where}: {why} {hint}") from exc
    finally:
        client_log.setLevel(level)
    try:
        yield bus
    finally:
        await bus.close()


async def unreachable_servers(servers: list[str] | tuple[str, ...], timeout_s: float) -> list[str]:
    """Why each of ``servers`` (NATS URLs) takes no TCP connection, one phrase per server
    that does not ("nats://127.0.0.1:4222: connection refused, nothing listens there"); the
    servers that do are left out."""
    import asyncio

    from services.common.cli_types import shown_nats_url, split_nats_url

    async def probe(server: str) -> str | None:
        parts = split_nats_url(server)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "wss" else 80 if parts.scheme == "ws" else 4222)
        shown = shown_nats_url(server)
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            return f"{shown}: connection refused, nothing listens there"
        except TimeoutError:
            return f"{shown}: no answer within {timeout_s:g} s"
        except OSError as exc:  # a name that does not resolve, a network that is down
            return f"{shown}: {exc.strerror or exc}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None

    found = await asyncio.gather(*(probe(s) for s in servers))
    return [why for why in found if why is not None]


# ============================================================================ output paths


def output_dir_problem(directory: str | Path) -> str | None:
    """Why ``directory`` cannot be written into (created if missing), or None: checked
    before any work, by creating (and removing) the first missing folder, or a scratch file
    in an existing one, so that what the OS refuses (a file in the way, no permission, a
    read-only or virtual file system) is said before minutes of work, not after."""
    import os
    import tempfile

    path = Path(directory)
    if str(directory) == "":
        return "an empty path is no directory"
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            return f"cannot write in {path}: {exc.strerror or exc}"
        return None
    first = path.absolute()
    while not first.parent.exists() and first.parent != first:
        first = first.parent
    parent = first.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is not a directory"
    try:
        first.mkdir()
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    with contextlib.suppress(OSError):
        os.rmdir(first)
    return None


def output_file_problem(file: str | Path, create_parents: bool = True) -> str | None:
    """Why ``file`` cannot be written (its folder created if missing, with
    ``create_parents``; else it must be there), or None; an existing file is opened to
    append, nothing else, so it is left as it is."""
    path = Path(file)
    if str(file) == "":
        return "an empty path is no file"
    if path.is_dir():
        return f"{path} is a directory"
    if not create_parents and not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "no such directory"
        return f"{path.parent}: {what}"
    problem = output_dir_problem(path.parent)
    if problem:
        return problem
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
    return None


# ============================================================================ tables


def plain(value: object) -> RenderableType:
    """``value`` as a table cell that rich never reads as markup: orgs, names, paths and
    reasons come from users and stored records (an org ``acme[/]`` crashed ``keys list``;
    ``[red]evil`` printed as ``evil``)."""
    from rich.text import Text

    shown = str(value)
    return Text(shown) if shown else ""  # "" stays a str: ``stacked`` leaves empty cells out

_UNBOUNDED = 1 << 20


def natural_width(table: Table, console: Console) -> int:
    """The columns ``table`` needs for every cell whole, on one line each."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update(width=_UNBOUNDED), table).maximum


def _header(column: Any) -> RenderableType:
    # Two-line headers ("TTFT\np50") read as one label beside a value.
    return column.header.replace("\n", " ") if isinstance(column.header, str) else column.header


def _records(table: Table) -> list[list[RenderableType]]:
    """The table's rows, footer last, as lists of cells."""
    columns = [list(c.cells) for c in table.columns]
    rows = [[cells[i] if i < len(cells) else "" for cells in columns] for i in range(table.row_count)]
    if table.show_footer:
        rows.append([c.footer for c in table.columns])
    return rows


def transposed(table: Table) -> Table:
    """One column per row of ``table``, its headers down the left."""
    from rich.table import Table

    out = Table(show_header=False)  # no title: ``print_table`` prints it across the whole width
    out.add_column(style="bold", no_wrap=True)
    records = _records(table)
    for _ in records:
        out.add_column(no_wrap=True)
    for i, column in enumerate(table.columns):
        out.add_row(_header(column), *(record[i] for record in records))
    return out


def stacked(table: Table) -> Table:
    """One block of ``header  value`` lines per row of ``table``: fits any width, since a
    value too long for the line wraps (fold) instead of being cut."""
    from rich import box
    from rich.table import Table

    out = Table(show_header=False, box=box.SIMPLE, pad_edge=False)
    out.add_column(style="bold", no_wrap=True)
    out.add_column(overflow="fold")
    for record in _records(table):
        cells = [(_header(column), cell) for column, cell in zip(table.columns, record, strict=True) if cell != ""]
        for j, (header, cell) in enumerate(cells):
            out.add_row(header, cell, end_section=j == len(cells) - 1)
    return out


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every cell whole, whatever the console's width (module docstring)."""
    width = natural_width(table, console)
    if not console.is_terminal:
        saved = table.width
        table.width = width
        try:
            console.print(table, crop=False)
        finally:
            table.width = saved
        return
    if width <= console.width:
        console.print(table)
        return
    flipped = transposed(table)
    if table.title:
        console.print(table.title, style="table.title")
    console.print(flipped if natural_width(flipped, console) <= console.width else stacked(table))
    if table.caption:
        console.print(table.caption, style="table.caption")
