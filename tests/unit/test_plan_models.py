"""``meshserve plan --models``: the decision tree for many models (ops.plan.multi)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ops.plan.multi import FleetPolicy, ModelEntry, parse_entries, plan_fleet
from ops.plan.presets import GB, lookup_gpu
from services.worker.engines.hosted import LOAD_PRESETS

ROOT = Path(__file__).resolve().parents[2]
H100 = lookup_gpu("H100-80GB")


def policy(**kw: object) -> FleetPolicy:
    return FleetPolicy(gpu=H100, **kw)  # type: ignore[arg-type]


def by_name(entries: list[dict[str, object]], **kw: object) -> dict[str, Any]:
    plan = plan_fleet(parse_entries(entries), policy(**kw))
    return {d.name: d for d in plan.decisions} | {"_plan": plan}


def test_busy_models_get_pools_quiet_ones_share_and_adapters_ride_their_base() -> None:
    d = by_name([
        {"name": "base", "model": "llama-3.1-8b", "rate": 10},
        {"name": "a1", "base": "base", "adapter_mb": 100, "rate": 4},
        {"name": "quiet", "model": "mistral-7b", "rate": 0.01},
    ])
    assert d["base"].strategy == "static" and d["a1"].strategy == "multiplex" and d["quiet"].strategy == "time-share"
    # the adapter's traffic is sized with its base's pool
    assert d["base"].pool_rate == 14 and d["a1"].pool_rate == 14
    assert d["base"].load == pytest.approx(14 / (0.7 * d["base"].service_rate))
    # 100 MB at the default NVMe 6 GB/s (the worker's --load-from nvme)
    assert d["a1"].load_time_s == pytest.approx(0.1 / 6)


def test_cold_starts_follow_poisson_gaps_longer_than_the_keep_time() -> None:
    d = by_name([{"name": "m", "model": "mistral-7b", "rate": 0.002}], keep_s=600)
    m = d["m"]
    assert m.strategy == "time-share"
    assert m.cold_share == pytest.approx(math.exp(-0.002 * 600))
    assert m.cold_starts_per_hour == pytest.approx(3600 * 0.002 * math.exp(-1.2))
    assert m.load_time_s == pytest.approx(m.weights_bytes / (6 * GB))
    # from an object store at 1 GB/s the load is six times longer
    slow = by_name([{"name": "m", "model": "mistral-7b", "rate": 0.002}], load_gb_per_s=1.0)["m"]
    assert slow.load_time_s == pytest.approx(6 * m.load_time_s)


def test_a_cold_start_past_its_slo_pins_the_model_and_tensor_parallel_models_stay_static() -> None:
    d = by_name([
        {"name": "tight", "model": "mistral-7b", "rate": 0.001, "ttft_slo_s": 1},
        {"name": "loose", "model": "mistral-7b", "rate": 0.001, "ttft_slo_s": 30},
        {"name": "big", "model": "llama-3.1-70b", "tp": 4, "rate": 0.01},
    ])
    assert d["tight"].strategy == "static" and "pinned" in d["tight"].why and d["tight"].gpus == 1
    assert d["loose"].strategy == "time-share"
    assert d["big"].strategy == "static" and d["big"].gpus == 4


def test_the_time_share_pool_holds_the_expected_resident_models_and_beats_static_pools() -> None:
    quiet = [{"name": f"m{i}", "model": "llama-3.1-8b", "rate": 0.05} for i in range(8)]
    d = by_name(quiet)
    plan = d["_plan"]
    usable = (H100.hbm_bytes - H100.hbm_bytes // 10) * 0.7
    resident = sum((1 - d[f"m{i}"].cold_share) * d[f"m{i}"].weights_bytes for i in range(8))
    assert plan.timeshare_memory_gpus == math.ceil(resident / usable)
    assert plan.plan_gpus == plan.timeshare_gpus == max(plan.timeshare_memory_gpus, plan.timeshare_throughput_gpus)
    assert plan.baseline_gpus == 8 and plan.plan_gpus < 8


def test_the_static_threshold_moves_a_model_between_strategies() -> None:
    entries = [{"name": "m", "model": "llama-3.1-8b", "rate": 2}]
    load = by_name(entries)["m"].load
    assert by_name(entries, static_load=load * 0.9)["m"].strategy == "static"
    assert by_name(entries, static_load=load * 1.1)["m"].strategy == "time-share"


@pytest.mark.parametrize(("raw", "message"), [
    ([], "non-empty list"),
    ([{"name": "a", "model": "llama-3.1-8b", "qps": 3}], "unknown field(s) qps"),
    ([{"model": "llama-3.1-8b"}], "a name is required"),
    ([{"name": "a"}], "give the model's shape"),
    ([{"name": "a", "model": "llama-3.1-8b", "rate": -1}], "rate must be a number ≥ 0"),
    ([{"name": "a", "model": "llama-3.1-8b", "tp": 0}], "tp must be an integer ≥ 1"),
    # YAML's .nan, .inf and true are numbers to Python; none is a rate, a size or a count
    ([{"name": "a", "model": "llama-3.1-8b", "rate": float("nan")}], "rate must be a number ≥ 0, not nan"),
    ([{"name": "a", "model": "llama-3.1-8b", "rate": True}], "rate must be a number ≥ 0, not True"),
    ([{"name": "a", "model": "llama-3.1-8b", "ttft_slo_s": float("inf")}], "ttft_slo_s must be a positive number"),
    ([{"name": "a", "model": "llama-3.1-8b", "weights_gb": float("nan")}], "weights_gb must be a positive number"),
    ([{"name": "a", "base": "b", "adapter_mb": float("inf")}], "adapter_mb must be a number ≥ 0"),
    ([{"name": "a", "model": "llama-3.1-8b", "prompt_tokens": True}], "prompt_tokens must be an integer ≥ 1"),
    ([{"name": "a", "model": "llama-3.1-8b", "rate": 10**400}], "rate must be a number ≥ 0"),
    ([{"name": "a", "model": "llama-3.1-8b", "weights_gb": 1e300}], "weights_gb must be a positive number"),
    ([{"name": "a", "base": "b"}], "its base 'b' is not in the file"),
    ([{"name": "a", "base": "a2", "adapter_mb": 1}, {"name": "a2", "base": "a"}], "is itself an adapter"),
    ([{"name": "a", "base": "x", "model": "llama-3.1-8b"}, {"name": "x", "model": "llama-3.1-8b"}], "has no model"),
    ([{"name": "a", "model": "llama-3.1-8b"}, {"name": "a", "model": "mistral-7b"}], "unique: a"),
])
def test_bad_files_get_one_clear_message(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_entries(raw)
    assert message in str(info.value)


def test_an_unknown_shape_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="unknown model"):
        plan_fleet([ModelEntry(name="a", model="gpt-9")], policy())


def test_cli_prints_the_tree_for_the_readme_example_and_json_and_rejects_bad_files(tmp_path: Path) -> None:
    def plan(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ops.cli", "plan", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    out = plan("--models", "examples/models.yaml")
    assert out.returncode == 0, out.stderr
    for word in ("multiplex", "time-share", "static", "one static pool per model", "saved"):
        assert word in out.stdout
    js = plan("--models", "examples/models.yaml", "--json", "--load-from", "object-store")
    body = json.loads(js.stdout)
    assert body["policy"]["load_gb_per_s"] == LOAD_PRESETS["object-store"] and body["plan_gpus"] < body["baseline_gpus"]
    assert {d["strategy"] for d in body["decisions"]} == {"multiplex", "time-share", "static"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: a, modle: llama-3.1-8b}\n")
    out = plan("--models", str(bad))
    assert out.returncode == 2 and "unknown field(s) modle" in out.stderr and "Traceback" not in out.stderr
    bad.write_text("models: [unclosed\n")
    out = plan("--models", str(bad))
    assert out.returncode == 2 and "not YAML or JSON" in out.stderr
    out = plan("--models", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    priced = json.loads(plan("--models", "examples/models.yaml", "--json", "--gpu-price", "2.5").stdout)
    assert priced["plan_cost_per_hour"] == priced["plan_gpus"] * 2.5
    assert priced["baseline_cost_per_hour"] == priced["baseline_gpus"] * 2.5
    out = plan("--models", "examples/models.yaml", "--gpu-price", "2.5")
    assert "saved per hour" in out.stdout and "static fleet: cost per hour" in out.stdout


def test_an_adapters_ttft_slo_pins_its_base() -> None:
    """The adapter's requests meet its base's cold starts: its SLO counts as the base's
    own does (it was ignored: the base stayed time-shared)."""
    entries = [{"name": "a", "model": "mistral-7b", "rate": 0.0005},
               {"name": "a-ad", "base": "a", "adapter_mb": 50, "rate": 0.005, "ttft_slo_s": 1},
               {"name": "c", "model": "llama-3.1-8b", "rate": 0.005}]
    d = by_name(entries)
    assert d["a"].strategy == "static" and "its adapter a-ad's 1 s TTFT SLO" in d["a"].why
    entries[1].pop("ttft_slo_s")
    assert by_name(entries)["a"].strategy == "time-share"


def test_models_honours_the_fleet_wide_flags_and_refuses_one_models(tmp_path: Path) -> None:
    """With --models the engine and GPU flags (--weights-dtype, --kv-dtype, --hbm-gb...)
    were ignored, and one model's (--rate, --tp, --plot...) too, silently."""
    def plan(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ops.cli", "plan", "--models", "examples/models.yaml", "--json",
                               *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)

    base = json.loads(plan().stdout)
    int4 = json.loads(plan("--weights-dtype", "int4").stdout)
    weights = {d["name"]: d["weights_bytes"] for d in base["decisions"]}
    assert all(d["weights_bytes"] < weights[d["name"]] for d in int4["decisions"] if d["strategy"] != "multiplex")
    small = json.loads(plan("--hbm-gb", "40").stdout)
    assert small["plan_gpus"] > base["plan_gpus"]
    for flag in (["--rate", "50"], ["--tp", "2"], ["--plot", str(tmp_path / "p.png")], ["--mu", "1"]):
        out = plan(*flag)
        assert out.returncode == 2 and flag[0] in out.stderr and "each entry of the file" in out.stderr, flag
    assert not (tmp_path / "p.png").exists()


def test_small_rates_keep_their_digits_in_the_table() -> None:
    from rich.console import Console

    from ops.plan.report import render_fleet

    plan = plan_fleet(parse_entries([{"name": "rare", "model": "mistral-7b", "rate": 0.0005},
                                     {"name": "rarer", "model": "mistral-7b", "rate": 0.00004}]),
                      FleetPolicy(gpu=lookup_gpu("H100-80GB")))
    console = Console(width=300, record=True)
    render_fleet(plan, console)
    text = console.export_text()
    assert "0.000500" in text and "0.0000400" in text
