"""Rich tables for a benchmark: latency and throughput per run, the queueing picture
(latency against offered load with the goodput knee marked), warnings, and the
side-by-side comparison of several result files.

Tables go through ``ops.console.print_table``: whole at any width (a file gets them at
full width, a narrow terminal transposed or stacked), never a number cut to ``…``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ops.bench.results import BenchResult, Dist, RunResult
from ops.console import print_table


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _mode_note(result: BenchResult) -> str:
    modes = {r.mode for r in result.runs}
    if "closed-loop" in modes:
        return ("[yellow]CLOSED LOOP[/]: load is a fixed number of requests in flight; "
                "it cannot find the saturation cliff. Latency is not comparable with open-loop runs.")
    return "open loop: arrivals independent of completions"


def latency_table(result: BenchResult) -> Table:
    t = Table(title="Latency (ms) — " + _mode_note(result), title_justify="left")
    for col in ("endpoint", "load"):
        t.add_column(col, no_wrap=True)
    # Each header names its metric: a narrow terminal shows them stacked, away from their neighbours.
    for metric_name, stats in (("TTFT", ("mean", "p50", "p90", "p99")), ("TPOT", ("mean", "p50", "p90", "p99")),
                               ("ITL", ("p50", "p99")), ("E2E", ("p50", "p99"))):
        for stat in stats:
            t.add_column(f"{metric_name}\n{stat}", justify="right")
    for r in result.runs:
        s = r.summary
        t.add_row(Text(r.endpoint), Text(r.load),
                  _ms(s.ttft_ms.mean), _ms(s.ttft_ms.p50), _ms(s.ttft_ms.p90), _ms(s.ttft_ms.p99),
                  _ms(s.tpot_ms.mean), _ms(s.tpot_ms.p50), _ms(s.tpot_ms.p90), _ms(s.tpot_ms.p99),
                  _ms(s.itl_ms.p50), _ms(s.itl_ms.p99), _ms(s.e2e_ms.p50), _ms(s.e2e_ms.p99))
    return t


def throughput_table(result: BenchResult) -> Table:
    slo = result.slo
    title = "Throughput and goodput"
    if slo.active:
        title += f" — SLO {slo.describe()}, holds when ≥{slo.attainment:.0%} of requests meet it"
    t = Table(title=title, title_justify="left")
    for col in ("endpoint", "load"):
        t.add_column(col, no_wrap=True)
    for head in ("sent", "ok", "errors", "offered req/s", "req/s", "in tok/s", "out tok/s"):
        t.add_column(head, justify="right")
    if slo.active:
        for head in ("goodput req/s", "SLO met", "holds"):
            t.add_column(head, justify="right")
    t.add_column("client", justify="left")
    for r in result.runs:
        s = r.summary
        errors = ", ".join(f"{k}:{v}" for k, v in s.errors.items()) or "0"
        row: list[str | Text] = [Text(r.endpoint), Text(r.load), str(s.requests), str(s.ok), Text(errors),
                                 _num(s.offered_rate),
               _num(s.request_throughput), _num(s.input_token_throughput, "{:.0f}"),
               _num(s.output_token_throughput, "{:.0f}")]
        if slo.active:
            knee = result.knees.get(r.endpoint)
            mark = "✓" if s.slo_holds else "✗"
            if knee is not None and r.load_value == knee:
                mark += " knee"
            row += [_num(s.goodput), _num(s.slo_attainment, "{:.1%}"), mark]
        row.append("[red]LAGGED[/]" if r.client.lagged else
                   f"ok (lag p99 {_ms(r.client.lag_ms.p99)} ms)")
        t.add_row(*row)
    return t


def queueing_picture(result: BenchResult, width: int = 40) -> Table | None:
    """Latency against offered load, one bar per load point (p99 TTFT)."""
    by_ep: dict[str, list[RunResult]] = {}
    for r in result.runs:
        by_ep.setdefault(r.endpoint, []).append(r)
    if all(len(v) < 2 for v in by_ep.values()):
        return None
    closed = any(r.mode == "closed-loop" for r in result.runs)
    t = Table(title="Queueing picture — p99 TTFT against " +
              ("concurrency (closed loop)" if closed else "offered load (open loop)"),
              title_justify="left", show_lines=False)
    t.add_column("endpoint", no_wrap=True)
    t.add_column("load", no_wrap=True)
    t.add_column("achieved req/s", justify="right")
    t.add_column("TTFT p50/p99 ms", justify="right")
    t.add_column("TPOT p50/p99 ms", justify="right")
    t.add_column("p99 TTFT (bar: 0 to max)", no_wrap=True)
    vals = [r.summary.ttft_ms.p99 for r in result.runs if r.summary.ttft_ms.p99]
    hi = max(vals) if vals else 1.0
    for ep, runs in by_ep.items():
        knee = result.knees.get(ep)
        for r in sorted(runs, key=lambda x: x.load_value):
            s = r.summary
            p99 = s.ttft_ms.p99
            # Linear from zero: the queueing blow-up near saturation shows as it is.
            n = max(1, round(width * p99 / hi)) if p99 and p99 > 0 else 0
            style = "green" if s.slo_holds or s.slo_holds is None else "red"
            bar = Text("█" * n, style=style)
            if knee is not None and r.load_value == knee:
                bar.append(" ◀ knee", style="bold")
            t.add_row(Text(ep), Text(r.load), _num(s.request_throughput),
                      f"{_ms(s.ttft_ms.p50)}/{_ms(s.ttft_ms.p99)}",
                      f"{_ms(s.tpot_ms.p50)}/{_ms(s.tpot_ms.p99)}", bar)
    return t


def render(result: BenchResult, console: Console) -> None:
    """The end-of-run report."""
    print_table(console, latency_table(result))
    print_table(console, throughput_table(result))
    picture = queueing_picture(result)
    if picture is not None:
        print_table(console, picture)
    if result.slo.active:
        for ep in result.endpoints():
            knee = result.knees.get(ep)
            closed = any(r.mode == "closed-loop" for r in result.runs if r.endpoint == ep)
            sessions = any("sessions/s" in r.load for r in result.runs if r.endpoint == ep)
            unit = ("concurrent requests (closed loop)" if closed else
                    "sessions/s" if sessions else "req/s")
            console.print(f"[bold]{escape(ep)}[/]: goodput knee " +
                          (f"[green]{knee:g} {unit}[/]" if knee is not None else
                           "[red]none — the SLO fails at the lowest load[/]"))
    warnings = [f"{r.endpoint} · {r.load}: {w}" for r in result.runs for w in r.warnings]
    if warnings:
        style = "red" if result.lagged else "yellow"
        # Text, not markup: the warnings carry labels and the target's own error messages.
        console.print(Panel(Text("\n".join(warnings)), title="warnings", border_style=style))
    if result.lagged:
        console.print("[bold red]WARNING: the load generator lagged in at least one run; "
                      "its latencies are not trustworthy. Use fewer rates per process, a faster "
                      "machine, or several client processes.[/]")


# ---------------------------------------------------------------------------- compare


COMPARE_METRICS: tuple[tuple[str, str, bool], ...] = (
    # (label, path, higher is better)
    ("req/s", "request_throughput", True),
    ("out tok/s", "output_token_throughput", True),
    ("goodput req/s", "goodput", True),
    ("SLO met", "slo_attainment", True),
    ("TTFT p50 ms", "ttft_ms.p50", False),
    ("TTFT p99 ms", "ttft_ms.p99", False),
    ("TPOT p50 ms", "tpot_ms.p50", False),
    ("TPOT p99 ms", "tpot_ms.p99", False),
    ("ITL p99 ms", "itl_ms.p99", False),
    ("E2E p50 ms", "e2e_ms.p50", False),
    ("E2E p99 ms", "e2e_ms.p99", False),
)


def metric(run: RunResult, path: str) -> float | None:
    obj: Any = run.summary
    for part in path.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, Dist):
        return obj.mean
    return None if obj is None else float(obj)


@dataclass
class Series:
    name: str
    result: BenchResult
    endpoint: str
    runs: list[RunResult]

    @property
    def knee(self) -> float | None:
        return self.result.knees.get(self.endpoint)


def series(results: Sequence[BenchResult]) -> list[Series]:
    """One series per endpoint of each result; names carry the file label if needed."""
    out: list[Series] = []
    for res in results:
        for ep in res.endpoints():
            runs = [r for r in res.runs if r.endpoint == ep]
            name = ep if len(results) == 1 else f"{res.label}:{ep}"
            out.append(Series(name, res, ep, runs))
    return out


def _load_key(run: RunResult) -> tuple[str, float]:
    return (run.mode, run.load_value)


def compare_rows(results: Sequence[BenchResult]) -> list[dict[str, Any]]:
    """The comparison as data: one row per (load, metric), each series' value and its ratio
    against the first series (``None`` where a series has no run at that load)."""
    ser = series(results)
    keys: dict[tuple[str, float], str] = {}
    for sr in ser:
        for r in sr.runs:
            keys.setdefault(_load_key(r), r.load)
    index = [{_load_key(r): r for r in sr.runs} for sr in ser]
    rows: list[dict[str, Any]] = []
    for key in sorted(keys, key=lambda k: (k[0], k[1])):
        for label, path, higher in COMPARE_METRICS:
            values = {sr.name: (metric(idx[key], path) if key in idx else None) for sr, idx in zip(ser, index, strict=True)}
            base = values[ser[0].name]
            ratios = {name: (None if v is None or base is None or base == 0 else v / base)
                      for name, v in list(values.items())[1:]}
            rows.append({"load": keys[key], "metric": label, "path": path, "higher_is_better": higher,
                         "values": values, "ratios": ratios})
    return rows


def compare_table(results: Sequence[BenchResult]) -> Table:
    """Runs matched by load (mode and rate/concurrency); ratios against the first series."""
    ser = series(results)
    base_name = ser[0].name
    t = Table(title=Text(f"Comparison (ratios against {base_name}; ▲ better, ▼ worse)"), title_justify="left")
    t.add_column("load", no_wrap=True)
    t.add_column("metric", no_wrap=True)
    for i, sr in enumerate(ser):
        t.add_column(Text(sr.name), justify="right")
        if i:
            t.add_column("ratio", justify="right")
    rows = compare_rows(results)
    for n, row in enumerate(rows):
        first = n == 0 or rows[n - 1]["load"] != row["load"]
        last = n == len(rows) - 1 or rows[n + 1]["load"] != row["load"]
        # Every row names its load (dim after the first): a narrow terminal shows rows apart.
        cells: list[str | Text] = [Text(row["load"], style="" if first else "dim"), row["metric"]]
        path = row["path"]
        for i, val in enumerate(row["values"].values()):
            cells.append("—" if val is None else f"{val:.1%}" if path == "slo_attainment" else
                         _ms(val) if path.endswith(("p50", "p99")) else f"{val:.2f}")
            if i:
                cells.append(_ratio(val, row["values"][base_name], row["higher_is_better"]))
        t.add_row(*cells, end_section=last)
    return t


def _ratio(val: float | None, base: float | None, higher_better: bool) -> str:
    if val is None or base is None or base == 0:
        return "—"
    ratio = val / base
    if abs(ratio - 1) < 0.02:
        return f"{ratio:.2f}×"
    better = ratio > 1 if higher_better else ratio < 1
    return f"[green]{ratio:.2f}× ▲[/]" if better else f"[red]{ratio:.2f}× ▼[/]"


def render_compare(results: Sequence[BenchResult], console: Console) -> None:
    print_table(console, compare_table(results))
    for res in results:
        if res.knees:
            knees = ", ".join(f"{ep}: {k:g}" if k is not None else f"{ep}: none"
                              for ep, k in res.knees.items())
            console.print(f"[bold]{escape(res.label)}[/] goodput knee ({res.slo.describe()}): {escape(knees)}")
        if res.lagged:
            console.print(f"[bold red]WARNING: {escape(res.label)}: the load generator lagged; "
                          "treat its latencies with suspicion[/]")
    workloads = {str(res.meta.get("workload")) for res in results}
    if len(workloads) > 1:
        console.print("[yellow]WARNING: the results used different workloads; ratios compare "
                      "unlike things[/]")
    modes = {r.mode for res in results for r in res.runs}
    if len(modes) > 1:
        console.print("[yellow]WARNING: comparing open-loop with closed-loop runs[/]")
