"""Rendering a ``Plan``: rich tables for people, JSON for scripts, a PNG of the queueing curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ops.console import print_table
from ops.plan.model import Plan, finite, gb
from ops.plan.multi import FleetPlan


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "∞"
    return f"{x:,.{digits}f}"


def _fine(x: float) -> str:
    """Three decimals, or three significant digits below 0.1: the rare models' rates and
    loads (a request an hour is 0.000278/s, which three decimals print as 0.000)."""
    if x == 0 or abs(x) >= 0.1 or not math.isfinite(x):
        return _num(x, 3)
    return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}"


def _seconds(x: float | None) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "∞"
    if x == 0:
        return "0"
    if x < 1e-7:
        return "< 0.1 µs"
    if x < 1e-3:
        return f"{x * 1e6:,.1f} µs"
    if x < 1:
        return f"{x * 1000:,.1f} ms"
    return f"{x:,.2f} s"


def _est(estimated: bool) -> str:
    return " (est.)" if estimated else ""


def sizing_table(plan: Plan) -> Table:
    p, m = plan.inputs, plan.inputs.model
    t = Table(title=f"meshserve plan: {m.name} on {p.tensor_parallel}× {p.gpu.name}", show_header=False)
    t.add_column("quantity", style="bold")
    t.add_column("value", justify="right")
    t.add_column("how", style="dim")
    kv_dtype = m.dtype if p.kv_dtype == "auto" else p.kv_dtype
    params = f"{plan.parameters / 1e9:,.2f} B params"
    if plan.active_parameters != plan.parameters:
        params += f", {plan.active_parameters / 1e9:,.2f} B active"
    t.add_row(
        "weights",
        f"{gb(plan.weights_bytes):,.2f} GB",
        params + (" × dtype bytes" if plan.weights_estimated else ", given"),
    )
    t.add_row(
        "KV bytes per token",
        f"{plan.kv_bytes_per_token:,}",
        f"2·{m.layers} layers·{m.kv_heads} kv heads·{m.head_dim}·{kv_dtype}",
    )
    t.add_row(
        "context per sequence",
        f"{plan.context_tokens:,} tokens",
        f"{gb(plan.kv_bytes_per_sequence):,.3f} GB of KV",
    )
    t.add_row(
        "KV space per replica",
        f"{gb(plan.kv_space_bytes):,.2f} GB",
        f"{gb(plan.hbm_bytes):,.0f} HBM − {gb(plan.weights_bytes):,.2f} weights − "
        f"{gb(plan.reserve_bytes):,.2f} reserve (GB = 10^9 B)",
    )
    t.add_row(
        "concurrent sequences per replica", f"{plan.concurrent_per_replica:,}", "⌊KV space / KV per sequence⌋"
    )
    if plan.batch != plan.concurrent_per_replica:
        t.add_row("batch (max_num_seqs cap)", f"{plan.batch:,}", "")
    e = plan.estimate
    if e is not None:
        t.add_row(
            "decode step at full batch",
            _seconds(e.step_time_s),
            f"(weights + {e.batch}·KV per sequence) / bandwidth",
        )
        t.add_row(
            "tokens/s per sequence",
            _num(e.tokens_per_s_per_sequence, 1),
            f"{_num(e.decode_tokens_per_s, 0)} tokens/s per replica",
        )
        t.add_row(
            "prefill per request",
            _seconds(e.prefill_time_s),
            f"{p.prompt_tokens:,} prompt tokens, compute bound",
        )
    t.add_row(
        "μ, requests/s per replica",
        _num(plan.service_rate),
        "given" if not plan.service_rate_estimated else "estimated",
    )
    t.add_row(
        "W, time in system (holding KV)",
        _seconds(plan.time_in_system),
        "given" if not plan.time_in_system_estimated else f"estimated, {p.output_tokens:,} output tokens",
    )
    t.add_row("target utilisation ρ", f"{p.utilization:.0%}", "")
    f = plan.fleet
    if f is not None and p.rate is not None:
        t.add_row("λ, arrival rate", f"{p.rate:,.2f}/s", "")
        t.add_row(
            "throughput bound",
            f"{f.throughput_bound:,}",
            "⌈λ / (ρ·μ)⌉" + (" ◀ binds" if f.binding == "throughput" else ""),
        )
        t.add_row(
            "memory bound",
            f"{f.memory_bound:,}",
            "⌈λ·W / concurrent⌉ (Little)" + (" ◀ binds" if f.binding == "memory" else ""),
        )
        t.add_row(
            "fleet", f"[bold]{f.replicas:,} replicas[/bold]", f"{plan.fleet_gpus:,} GPUs, {f.binding}-bound"
        )
        util = plan.fleet_utilization
        t.add_row(
            "utilisation at that fleet",
            f"{_num(None if util is None else util * 100, 1)} %",
            "λ / (replicas·μ)",
        )
        t.add_row(
            "queue wait there",
            f"{_seconds(plan.wait_mm1_s)} / {_seconds(plan.wait_mmc_s)}",
            "M/M/1 per replica / M/M/c fleet",
        )
        if plan.time_in_system is not None and plan.wait_mm1_s is not None:
            t.add_row(
                "time in system with queueing",
                _seconds(plan.time_in_system + plan.wait_mm1_s),
                "W + M/M/1 wait",
            )
    c = plan.cost
    if c is not None:
        price = p.gpu_price_per_hour
        t.add_row("cost per replica-hour", _num(c.replica_per_hour), f"{p.tensor_parallel} GPU × {_num(price)} an hour")
        if c.fleet_per_hour is not None and plan.fleet_gpus is not None:
            t.add_row("fleet cost per hour", f"[bold]{_num(c.fleet_per_hour)}[/bold]", f"{plan.fleet_gpus:,} GPUs")
            t.add_row("cost per million tokens", _num(c.per_million_tokens, 4),
                      f"at λ: {p.prompt_tokens + p.output_tokens:,} tokens a request, paid busy or idle")
            t.add_row("cost per million output tokens", _num(c.per_million_output_tokens, 4),
                      f"{p.output_tokens:,} output tokens a request")
    return t


def curve_table(plan: Plan) -> Table:
    servers = plan.fleet.replicas if plan.fleet else 1
    t = Table(title="queueing: mean wait before service against utilisation")
    t.add_column("ρ", justify="right")
    t.add_column("1/(1−ρ)", justify="right")
    t.add_column("M/M/1 wait (per replica)", justify="right")
    t.add_column(f"M/M/c wait (c = {servers})", justify="right")
    for pt in plan.curve:
        mark = " ◀ target" if math.isclose(pt.utilization, plan.inputs.utilization) else ""
        t.add_row(
            f"{pt.utilization:.2f}{mark}",
            f"{pt.growth:,.1f}",
            _seconds(pt.wait_mm1_s),
            _seconds(pt.wait_mmc_s),
        )
    return t


def render(plan: Plan, console: Console) -> None:
    print_table(console, sizing_table(plan))
    if plan.curve:
        print_table(console, curve_table(plan))
    for note in plan.notes:
        console.print(f"note: {note}", soft_wrap=not console.is_terminal)  # a pipe: whole lines


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, ensure_ascii=False)


def plot_curve(plan: Plan, path: Path) -> None:
    """Waiting time against utilisation, both models, the target marked (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    rhos = [i / 100 for i in range(5, 99)]
    mu = plan.service_rate
    if mu is None:
        raise ValueError("no service rate: give --mu or a GPU the estimate can use")
    from ops.plan.model import queueing_curve

    servers = plan.fleet.replicas if plan.fleet else 1
    pts = queueing_curve(mu, servers, tuple(rhos))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot([p.utilization for p in pts], [p.wait_mm1_s for p in pts], label="M/M/1 per replica")
    # Erlang C underflows to 0 at low load on a big fleet; a log axis cannot draw 0.
    mmc = [p.wait_mmc_s if p.wait_mmc_s > 0 else math.nan for p in pts]
    ax.plot([p.utilization for p in pts], mmc, label=f"M/M/c, c = {servers}")
    ax.axvline(
        plan.inputs.utilization,
        color="grey",
        linestyle="--",
        label=f"target ρ = {plan.inputs.utilization:.2f}",
    )
    ax.set_yscale("log")
    ax.set_xlabel("utilisation ρ")
    ax.set_ylabel("mean wait before service (s)")
    ax.set_title(f"{plan.inputs.model.name} on {plan.inputs.gpu.name}: μ = {mu:.2f} req/s per replica")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- many models


def fleet_table(plan: FleetPlan) -> Table:
    """One row per model: its traffic, size, cold-start arithmetic, strategy and GPUs."""
    pol = plan.policy
    t = Table(
        title=f"meshserve plan: {len(plan.decisions)} models on {pol.gpu.name} (ρ {pol.utilization:.0%}, weights "
              f"loaded at {pol.load_gb_per_s:g} GB/s, evicted after {pol.keep_s:g} s idle)",
        caption="load: replicas its traffic (a base's with its adapters') keeps busy at ρ, λ / (ρ·μ); cold: share of "
                "its requests that find it evicted, e^(−λ·keep); alone: GPUs in one static pool per model",
    )
    for col, justify in (("model", "left"), ("req/s", "right"), ("load", "right"), ("weights GB", "right"),
                         ("load time", "right"), ("cold", "right"), ("cold starts/h", "right"), ("strategy", "left"),
                         ("GPUs", "right"), ("alone", "right"), ("why", "left")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for d in plan.decisions:
        shared = d.strategy == "time-share"
        t.add_row(
            d.name, _fine(d.rate) + (f" + {_fine(d.pool_rate - d.rate)} adapters" if d.strategy != "multiplex"
                                       and d.pool_rate > d.rate else ""), _fine(d.load), _num(gb(d.weights_bytes), 3), _seconds(d.load_time_s),
            f"{d.cold_share:.1%}" if shared else "—", _num(d.cold_starts_per_hour, 1) if shared else "—",
            d.strategy, str(d.gpus) if d.strategy == "static" else "pool" if shared else "base's", str(d.baseline_gpus),
            d.why,
        )
    return t


def fleet_summary(plan: FleetPlan) -> Table:
    t = Table(title="the fleet under the plan, against one static pool per model")
    t.add_column("")
    t.add_column("GPUs", justify="right")
    t.add_column("how", justify="left")
    static = [d.name for d in plan.decisions if d.strategy == "static"]
    shared = [d.name for d in plan.decisions if d.strategy == "time-share"]
    t.add_row("static pools", str(plan.static_gpus), ", ".join(static) or "none")
    if shared:
        t.add_row("time-share pool", str(plan.timeshare_gpus),
                  f"max(throughput ⌈Σ load⌉ = {plan.timeshare_throughput_gpus}, memory ⌈Σ P(resident)·weights / model "
                  f"memory per GPU⌉ = {plan.timeshare_memory_gpus}) for {', '.join(shared)}")
    t.add_row("plan", str(plan.plan_gpus), "adapters ride in their base's pool")
    t.add_row("one static pool per model", str(plan.baseline_gpus), "each adapter as a merged model, each model ≥ 1 replica")
    saved = plan.baseline_gpus - plan.plan_gpus
    t.add_row("saved", str(saved), f"{saved / plan.baseline_gpus:.0%} of the static fleet" if plan.baseline_gpus else "")
    if plan.policy.gpu_price_per_hour is not None:
        for label, gpus in (("plan: cost per hour", plan.plan_gpus), ("static fleet: cost per hour", plan.baseline_gpus),
                            ("saved per hour", saved)):
            t.add_row(label, _num(plan.cost_per_hour(gpus)), f"{gpus} GPUs × {_num(plan.policy.gpu_price_per_hour)}")
    return t


def render_fleet(plan: FleetPlan, console: Console) -> None:
    print_table(console, fleet_table(plan))
    print_table(console, fleet_summary(plan))
    for note in plan.notes:
        console.print(f"note: {note}", soft_wrap=not console.is_terminal)  # a pipe: whole lines


def fleet_json(plan: FleetPlan) -> str:
    return json.dumps(finite(plan.to_dict()), indent=2)
