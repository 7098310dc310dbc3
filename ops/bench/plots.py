"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed).

- ``ttft_vs_load.png`` / ``tpot_vs_load.png``: p50, p90, p99 against offered load
  (or concurrency in closed loop), one colour per endpoint/series.
- ``ttft_cdf.png``: the CDF of TTFT for every run.
- ``goodput_vs_load.png``: throughput and goodput against load, with the SLO knee.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ops.bench.report import series
from ops.bench.results import BenchResult, RunResult


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _xlabel(runs: Sequence[RunResult]) -> str:
    if any(r.mode == "closed-loop" for r in runs):
        return "concurrency (closed loop)"
    if any("sessions/s" in r.load for r in runs):
        return "offered load (sessions/s, open loop)"
    return "offered load (req/s, open loop)"


def _finite_x(runs: list[RunResult]) -> list[RunResult]:
    return sorted((r for r in runs if not math.isinf(r.load_value)), key=lambda r: r.load_value)


def plot_percentiles(results: Sequence[BenchResult], metric: str, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    all_runs: list[RunResult] = []
    for ci, sr in enumerate(series(results)):
        name, runs = sr.name, _finite_x(sr.runs)
        all_runs += runs
        xs = [r.load_value for r in runs]
        for q, ls in styles.items():
            ys = [getattr(getattr(r.summary, f"{metric}_ms"), q) for r in runs]
            ys_f = [np.nan if y is None else y for y in ys]
            ax.plot(xs, ys_f, ls, marker="o", color=f"C{ci}", label=f"{name} {q}")
    slo = results[0].slo if results else None
    bound = None if slo is None else (slo.ttft_s if metric == "ttft" else slo.tpot_s)
    if bound is not None:
        ax.axhline(bound * 1000, color="grey", lw=1, ls="-.", label="SLO")
    ax.set_xlabel(_xlabel(all_runs))
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.set_title(f"{metric.upper()} percentiles against load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(results: Sequence[BenchResult], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ci, sr in enumerate(series(results)):
        name, runs = sr.name, sr.runs
        for ri, r in enumerate(sorted(runs, key=lambda r: r.load_value)):
            vals = np.sort([x.ttft_s * 1000 for x in r.requests if x.status == "ok" and x.ttft_s is not None])
            if vals.size == 0:
                continue
            ys = np.arange(1, vals.size + 1) / vals.size
            alpha = 0.35 + 0.65 * (ri + 1) / len(runs)
            ax.step(vals, ys, where="post", color=f"C{ci}", alpha=alpha, label=f"{name} · {r.load}")
    slo = results[0].slo if results else None
    if slo is not None and slo.ttft_s is not None:
        ax.axvline(slo.ttft_s * 1000, color="grey", lw=1, ls="-.", label="TTFT SLO")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("CDF of TTFT")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_goodput(results: Sequence[BenchResult], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    all_runs: list[RunResult] = []
    for ci, sr in enumerate(series(results)):
        name, runs = sr.name, _finite_x(sr.runs)
        all_runs += runs
        xs = [r.load_value for r in runs]
        ax.plot(xs, [r.summary.request_throughput for r in runs], "-", marker="o", color=f"C{ci}",
                label=f"{name} throughput")
        if any(r.summary.goodput is not None for r in runs):
            ax.plot(xs, [np.nan if r.summary.goodput is None else r.summary.goodput for r in runs],
                    "--", marker="s", color=f"C{ci}", label=f"{name} goodput")
        if sr.knee is not None:
            ax.axvline(sr.knee, color=f"C{ci}", lw=1, ls=":")
    ax.set_xlabel(_xlabel(all_runs))
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput and goodput against load (dotted: SLO knee)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: Sequence[BenchResult], out_dir: str | Path, prefix: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_percentiles(results, "ttft", out / f"{prefix}ttft_vs_load.png"),
        plot_percentiles(results, "tpot", out / f"{prefix}tpot_vs_load.png"),
        plot_ttft_cdf(results, out / f"{prefix}ttft_cdf.png"),
        plot_goodput(results, out / f"{prefix}goodput_vs_load.png"),
    ]
