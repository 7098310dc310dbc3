"""What the CLI prints of stored or user-given text: never read as rich markup (an org
``acme[/]`` crashed ``keys list`` for every operator; ``[red]evil`` printed as ``evil`` in a
billing report), and a reader that goes away stops a command quietly."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from ops.adapters import adapters_table
from ops.console import print_table
from ops.keys import keys_table
from ops.status import _print_workers
from ops.usage import render
from proto import AdapterRecord, ApiKeyRecord
from proto.autoscaler import WorkerView
from proto.metering import UsageReport, UsageRow

HOSTILE = ["acme[/]", "[red]evil", "team [/] x", "[bold]"]


def shown(print_into: object) -> str:
    out = io.StringIO()
    console = Console(file=out, width=300)
    print_into(console)  # type: ignore[operator]
    return out.getvalue()


def test_keys_usage_adapters_and_workers_print_names_as_written() -> None:
    keys = [ApiKeyRecord(key_id=f"{i:012x}", key_hash="h", org=org, name=org, tier="standard", created_at=1.0)
            for i, org in enumerate(HOSTILE)]
    text = shown(lambda c: print_table(c, keys_table(keys)))
    usage = UsageReport(rows=[UsageRow(org=org, requests=1) for org in HOSTILE], group_by=["org"])
    text += shown(lambda c: print_table(c, render(usage)))
    adapters = [AdapterRecord(name="a", base="b", path=f"/x/{org}", rank=8, size_bytes=1, created_at=1.0)
                for org in HOSTILE]
    text += shown(lambda c: print_table(c, adapters_table(adapters)))
    text += shown(lambda c: _print_workers(c, [WorkerView(worker_id=org, state="ready") for org in HOSTILE], "w"))
    for value in HOSTILE:
        assert text.count(value) >= 4, (value, text)


def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path) -> None:
    """``meshserve plan --json | head -1``: the reader closes its end; the command stops
    as one killed by SIGPIPE would (141), with no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "plan", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_status_prose_keeps_its_lines_when_piped() -> None:
    """A pipe is an 80-column console to rich: a reason or a driver message wrapped there
    (``logs in \\n/path``) breaks grep and copy-paste; tables keep their own layout."""
    from ops.status import print_status
    from proto.autoscaler import AutoscalerStatus, DriverInfo, PoolStatus

    long = "workers start as local processes; logs in /very/long/state/directory/of/this/mesh/logs/worker-17.log"
    status = AutoscalerStatus(instance_id="a", at=1.0, tick_s=1.0, driver=DriverInfo(name="local", ok=True, message=long),
                              pools=[PoolStatus(pool="[p]", min_replicas=0, max_replicas=2, last_reason=long)])
    out = io.StringIO()
    print_status(status, Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert any(line.endswith(long) and line.startswith("driver local") for line in lines), lines
    assert f"[p]: {long}" in lines, lines
