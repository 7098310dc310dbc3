"""The chaos soak's 60-second version, as issue 20 asks of CI: ``benchmarks/chaos.py``
(a 3-node JetStream cluster, two gateways, two sim workers, router, admission and
metering, each a process, under open-loop load from four kinds of client) while a seeded
schedule kills and pauses them. Every invariant the script checks must hold; RELIABILITY.md
("Chaos soak") says what each one means and has the longer runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_60_second_chaos_soak_keeps_every_invariant(tmp_path: Path) -> None:
    results = tmp_path / "chaos.json"
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--duration", "60", "--seed", "1", "--workers", "2",
         "--rate", "2", "--json", str(results), "--state-dir", str(state)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    report = proc.stdout[-8000:] + "\n" + proc.stderr[-4000:]
    assert results.exists(), f"the soak ended without results (exit {proc.returncode}):\n{report}"
    checks = json.loads(results.read_text())["checks"]
    failed = [f"{c['name']}: {c['detail']}" for c in checks if not c["ok"]]
    assert not failed, "invariants failed:\n" + "\n".join(failed) + f"\n\n{report}"
    assert len(checks) == 7 and proc.returncode == 0, report
