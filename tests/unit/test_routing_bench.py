"""benchmarks/routing.py's stability sweep and burst test: the pure parts (no mesh)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.routing import (
    BURST_BLOCK,
    SCENARIOS,
    Burst,
    burst_trace,
    plot_burst,
    plot_sweep,
    recovery,
    sweep_cells,
    sweep_table,
)
from ops.bench.workload import TextFactory, TraceWorkload, load_trace


def test_burst_trace_has_the_phases_rates_and_shared_prefixes(tmp_path: Path) -> None:
    sc = SCENARIOS["shared-prefix"]
    burst = Burst(base=0.5, factor=2.0, before_s=20.0, burst_s=10.0, after_s=20.0)
    speed = 0.25
    n = burst_trace(sc, burst, 100.0, speed, 3, tmp_path / "t.jsonl")
    entries = load_trace(tmp_path / "t.jsonl")
    assert len(entries) == n
    sim = [e.timestamp * speed for e in entries]  # timestamps are wall seconds
    rate = [sum(1 for t in sim if a <= t < b) / (b - a) for a, b in ((0, 20), (20, 30), (30, 50))]
    assert 40 < rate[0] < 60 and 85 < rate[1] < 115 and 40 < rate[2] < 60
    # requests of one group share their prefix text, block for block; suffixes differ
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    by_group: dict[int, list[int]] = {}
    for i, line in enumerate(lines):
        by_group.setdefault(line["hash_ids"][0], []).append(i)
    a, b = next(v for v in by_group.values() if len(v) > 1)[:2]
    wl = TraceWorkload(entries, TextFactory("byte"), 3, BURST_BLOCK)
    ua, ub = wl.session(a).turns[0].user, wl.session(b).turns[0].user
    prefix = sum(1 for h in lines[a]["hash_ids"] if h < 10**9) * BURST_BLOCK
    assert prefix >= 1024 - BURST_BLOCK and ua[:prefix] == ub[:prefix] and ua != ub
    assert wl.session(a).turns[0].user_tokens == lines[a]["input_tokens"]


def _points(p90: Sequence[float], hit: Sequence[float | None]) -> list[dict[str, Any]]:
    return [{"t": 5.0 * i, "n": 100, "ttft_p90_ms": x, "hit_rate": h, "outstanding": {"w0": 1.0}}
            for i, (x, h) in enumerate(zip(p90, hit, strict=True))]


def test_recovery_is_the_time_after_which_every_point_stays_close() -> None:
    burst = Burst(before_s=30.0, burst_s=10.0, after_s=30.0)
    #         0   5  10  15  20  25 | 30  35 | 40  45  50  55  60  65
    p90 = [500, 30, 30, 31, 29, 30, 400, 900, 200, 31, 45, 30, 31, 30]
    hit = [0.5, .9, .9, .9, .9, .9, 0.8, 0.6, 0.7, .9, .9, .9, .9, .9]
    r = recovery(_points(p90, hit), burst)
    assert r["pre_p90_ms"] == 30 and r["pre_hit"] == 0.9
    assert r["recovered_after_s"] == 15.0  # 45 s came back, 50 s left again, from 55 s it stays
    hit[-1] = 0.5  # the hit rate never holds: no recovery
    assert recovery(_points(p90, hit), burst)["recovered_after_s"] is None


def _row(policy: str, load: float, seed: int, p90_ms: float, hit: float, goodput: float) -> dict[str, Any]:
    speed = 0.25
    summary = SimpleNamespace(ttft_ms=SimpleNamespace(p90=p90_ms / speed), goodput=goodput * speed,
                              slo_attainment=1.0)
    return {"scenario": "shared-prefix", "policy": policy, "load": load, "seed": seed, "rate": 96.0 * speed,
            "summary": summary, "hit_rate": hit, "imbalance": 1.1, "router": {"spills": 5, "placements": 100}}


def test_sweep_cells_report_the_median_and_the_worst_seed(tmp_path: Path) -> None:
    rows = [_row("prefix", 0.8, s, p90, hit, gp) for s, p90, hit, gp in
            ((1, 300, 0.76, 89.0), (2, 4000, 0.39, 35.0), (3, 310, 0.78, 90.0))]
    rows += [_row("round_robin", 0.8, s, 7000, 0.22, 14.0) for s in (1, 2, 3)]
    cells = sweep_cells(rows, 0.25)
    prefix = next(c for c in cells if c["policy"] == "prefix")
    assert prefix["ttft_p90_ms"]["median"] == 310 and prefix["ttft_p90_ms"]["worst"] == 4000
    assert prefix["ttft_p90_ms"]["worst_seed"] == 2
    assert (prefix["hit_rate"]["median"], prefix["hit_rate"]["worst"]) == (0.76, 0.39)
    assert (prefix["goodput"]["median"], prefix["goodput"]["worst_seed"]) == (89.0, 2)
    assert prefix["spills"]["median"] == 0.05
    table = sweep_table(cells)
    assert "| prefix | 80% | 96.0 | 310 / 4,000 (s2) | 76% / 39% (s2) | 89.0 / 35.0 (s2) |" in table
    assert plot_sweep(cells, tmp_path / "sweep.png").stat().st_size > 0


def test_burst_plot(tmp_path: Path) -> None:
    row = {"scenario": "shared-prefix", "policy": "prefix", "seed": 1,
           "timeline": _points([30.0, 40.0, float("inf")], [0.9, 0.8, None])}
    assert plot_burst([row], Burst(), tmp_path / "burst.png").stat().st_size > 0
