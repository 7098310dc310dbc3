"""The capacity planner against hand-worked cases (GB = 10^9 bytes throughout)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from ops.plan.cli import add_parser
from ops.plan.model import (
    ModelShape,
    PlanInputs,
    concurrent_sequences,
    erlang_c,
    fleet_size,
    kv_bytes_per_token,
    load_model,
    make_plan,
    memory_bound,
    mm1_wait,
    mmc_wait,
    queueing_curve,
    throughput_bound,
)
from ops.plan.presets import GB, GPU_PRESETS, lookup_gpu


def _shape(layers: int, kv_heads: int = 8, head_dim: int = 128, dtype: str = "bfloat16") -> ModelShape:
    return ModelShape(
        name=f"{layers}l",
        layers=layers,
        hidden_size=kv_heads * head_dim * 4,
        attention_heads=kv_heads * 4,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=14336,
        vocab_size=128256,
        dtype=dtype,
    )


# ---------------------------------------------------------------- hand-worked cases


def test_8b_on_80gb_holds_223_sequences_of_2048() -> None:
    kv = kv_bytes_per_token(32, 8, 128, 2)
    assert kv == 131_072  # 128 KiB a token
    assert concurrent_sequences(80 * GB, 16 * GB, 4 * GB, kv, 2048) == 223
    # The decimal-GB convention is what gives 223: in GiB the same figures give 240.
    assert concurrent_sequences(80 * 2**30, 16 * 2**30, 4 * 2**30, kv, 2048) == 240


def test_48_layer_case_holds_57_and_needs_15_memory_bound_replicas() -> None:
    kv = kv_bytes_per_token(48, 8, 128, 2)
    assert kv == 196_608
    concurrent = concurrent_sequences(80 * GB, 30 * GB, 4 * GB, kv, 4096)
    assert concurrent == 57
    assert throughput_bound(40, 0.7, 12.5) == 5  # ⌈40 / 8.75⌉ = ⌈4.57⌉
    assert memory_bound(40, 20, concurrent) == 15  # ⌈800 / 57⌉ = ⌈14.04⌉
    fleet = fleet_size(40, 20, 12.5, 0.7, concurrent)
    assert (fleet.replicas, fleet.binding) == (15, "memory")


def test_make_plan_reproduces_the_48_layer_case() -> None:
    plan = make_plan(
        PlanInputs(
            model=_shape(48),
            gpu=GPU_PRESETS["H100-80GB"],
            weights_bytes=30 * GB,
            reserve_bytes=4 * GB,
            context_tokens=4096,
            rate=40,
            time_in_system=20,
            service_rate=12.5,
            utilization=0.7,
        )
    )
    assert plan.concurrent_per_replica == 57
    assert plan.fleet is not None
    assert (plan.fleet.throughput_bound, plan.fleet.memory_bound, plan.fleet.replicas) == (5, 15, 15)
    assert plan.fleet.binding == "memory"
    assert plan.estimate is None  # μ and W given: nothing estimated
    assert plan.fleet_utilization == pytest.approx(40 / (15 * 12.5))


def test_throughput_bound_binds_when_kv_is_plentiful() -> None:
    fleet = fleet_size(rate=40, time_in_system=2, service_rate=5, utilization=0.7, concurrent=200)
    assert fleet.throughput_bound == 12  # ⌈40 / 3.5⌉
    assert fleet.memory_bound == 1
    assert (fleet.replicas, fleet.binding) == (12, "throughput")


def test_exact_quotients_do_not_round_up_on_float_error() -> None:
    # 35 / (0.7·12.5) is 4 exactly on paper; 0.7·12.5 is 8.749999… in binary.
    assert throughput_bound(35, 0.7, 12.5) == 4
    assert memory_bound(10, 5.7, 57) == 1


def test_fp8_kv_halves_the_bytes_and_roughly_doubles_the_sequences() -> None:
    bf16 = make_plan(
        PlanInputs(
            model=_shape(32),
            gpu=GPU_PRESETS["H100-80GB"],
            weights_bytes=16 * GB,
            reserve_bytes=4 * GB,
            context_tokens=2048,
        )
    )
    fp8 = make_plan(
        PlanInputs(
            model=_shape(32),
            gpu=GPU_PRESETS["H100-80GB"],
            weights_bytes=16 * GB,
            reserve_bytes=4 * GB,
            context_tokens=2048,
            kv_dtype="fp8",
        )
    )
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token == 131_072
    assert (bf16.concurrent_per_replica, fp8.concurrent_per_replica) == (223, 447)


def test_tensor_parallelism_splits_weights_and_pools_hbm() -> None:
    plan = make_plan(
        PlanInputs(
            model=load_model("llama-3.1-70b"),
            gpu=GPU_PRESETS["H100-80GB"],
            tensor_parallel=4,
            reserve_bytes=4 * GB,
            context_tokens=4096,
        )
    )
    kv = 2 * 80 * 8 * 128 * 2
    assert plan.kv_bytes_per_token == kv
    assert plan.hbm_bytes == 320 * GB and plan.reserve_bytes == 16 * GB
    assert plan.concurrent_per_replica == (320 * GB - 16 * GB - plan.weights_bytes) // (kv * 4096)
    single = make_plan(
        PlanInputs(
            model=load_model("llama-3.1-70b"),
            gpu=GPU_PRESETS["H100-80GB"],
            reserve_bytes=4 * GB,
            context_tokens=4096,
        )
    )
    assert single.concurrent_per_replica == 0  # 141 GB of weights on one 80 GB GPU
    assert any("tensor parallelism 2 would fit" in n for n in single.notes)


# ---------------------------------------------------------------- model shapes


def test_parameter_count_of_presets_matches_published_sizes() -> None:
    # Published: Llama 3.1 8B 8.03 B, 70B 70.6 B, Qwen2.5-14B 14.7 B, Mixtral 46.7 B (12.9 B active).
    assert load_model("llama-3.1-8b").parameters == 8_030_261_248
    assert load_model("llama-3.1-70b").parameters / 1e9 == pytest.approx(70.55, abs=0.01)
    assert load_model("qwen2.5-14b").parameters / 1e9 == pytest.approx(14.77, abs=0.01)
    mixtral = load_model("mixtral-8x7b")
    assert mixtral.parameters / 1e9 == pytest.approx(46.70, abs=0.01)
    assert mixtral.active_parameters / 1e9 == pytest.approx(12.88, abs=0.01)


def test_config_json_is_parsed_with_fallbacks(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        # no num_key_value_heads → MHA; no head_dim → 256 / 8
        "intermediate_size": 512,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model(str(tmp_path))  # a directory holding config.json
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == (4, 8, 32, "float32")
    assert shape.tied_embeddings
    per_layer = 4 * 256 * 256 + 3 * 256 * 512 + 2 * 256  # q,k,v,o + gated MLP + norms
    assert shape.parameters == 4 * per_layer + 1000 * 256 + 256  # one embedding matrix: tied
    plan = make_plan(PlanInputs(model=shape, gpu=GPU_PRESETS["A10G-24GB"], context_tokens=100))
    assert plan.kv_bytes_per_token == 2 * 4 * 8 * 32 * 4  # fp32 KV: 4 bytes
    assert plan.weights_bytes == shape.parameters * 4


def test_config_with_explicit_head_dim_and_gqa(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps(
            {
                "num_hidden_layers": 26,
                "hidden_size": 2304,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "intermediate_size": 9216,
                "vocab_size": 256000,
                "torch_dtype": "bfloat16",
            }
        )
    )
    shape = load_model(str(path))
    assert (shape.kv_heads, shape.head_dim) == (4, 256)  # head_dim wins over hidden/heads = 288
    assert kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, 2) == 2 * 26 * 4 * 256 * 2


def test_unknown_model_gpu_and_mla_are_refused() -> None:
    with pytest.raises(KeyError):
        load_model("no-such-model")
    with pytest.raises(KeyError, match="ambiguous"):
        lookup_gpu("a100")
    assert lookup_gpu("h200").name == "H200-141GB"
    with pytest.raises(ValueError, match="latent"):
        ModelShape.from_config(
            {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "kv_lora_rank": 512}
        )


# ---------------------------------------------------------------- estimates and queueing


def test_service_estimate_follows_the_roofline() -> None:
    gpu = GPU_PRESETS["H100-80GB"]
    plan = make_plan(
        PlanInputs(
            model=load_model("llama-3.1-8b"),
            gpu=gpu,
            reserve_bytes=4 * GB,
            prompt_tokens=1000,
            output_tokens=200,
            bandwidth_efficiency=1.0,
            prefill_mfu=1.0,
        )
    )
    e = plan.estimate
    assert e is not None and plan.service_rate_estimated and plan.time_in_system_estimated
    read = plan.weights_bytes + plan.concurrent_per_replica * 1200 * 131_072
    assert e.step_time_s == pytest.approx(read / gpu.bandwidth_bytes_per_s)
    assert e.tokens_per_s_per_sequence == pytest.approx(gpu.bandwidth_bytes_per_s / read)
    prefill = 1000 * 2 * plan.parameters / (989e12)
    assert e.prefill_time_s == pytest.approx(prefill)
    assert plan.time_in_system == pytest.approx(prefill + 200 * e.step_time_s)
    assert plan.service_rate == pytest.approx(
        1 / (prefill + 200 * e.step_time_s / plan.concurrent_per_replica)
    )


def test_more_bandwidth_means_more_throughput() -> None:
    mus = [
        make_plan(
            PlanInputs(
                model=load_model("llama-3.1-8b"), gpu=GPU_PRESETS[g], reserve_bytes=4 * GB, hbm_bytes=80 * GB
            )
        ).service_rate
        for g in ("A100-80GB", "H100-80GB", "H200-141GB")
    ]
    assert mus[0] is not None and mus[1] is not None and mus[2] is not None
    assert mus[0] < mus[1] < mus[2]


def test_queueing_formulas() -> None:
    assert mm1_wait(0.5, 10) == pytest.approx(0.1)  # ρ/(μ(1−ρ)) = 0.5/5
    assert mm1_wait(1.0, 10) == math.inf
    assert mmc_wait(1, 0.7, 12.5) == pytest.approx(mm1_wait(0.7, 12.5))  # c = 1 is M/M/1
    # Textbook value: c = 2, a = 1 → C = 1/3.
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # Pooling servers cuts waiting at equal utilisation.
    assert mmc_wait(10, 0.8, 1) < mmc_wait(2, 0.8, 1) < mm1_wait(0.8, 1)
    curve = queueing_curve(12.5, 15)
    waits = [p.wait_mm1_s for p in curve]
    assert waits == sorted(waits)
    assert [p.growth for p in curve if p.utilization == 0.9] == [pytest.approx(10.0)]


# ---------------------------------------------------------------- the CLI end to end


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return int(args.func(args))


HAND_CASE = [
    "--model",
    "qwen2.5-14b",
    "--hbm-gb",
    "80",
    "--weights-gb",
    "30",
    "--reserve-gb",
    "4",
    "--context",
    "4096",
    "--rate",
    "40",
    "--time-in-system",
    "20",
    "--mu",
    "12.5",
    "--utilization",
    "0.7",
]


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(HAND_CASE) == 0
    out = capsys.readouterr().out
    assert "196,608" in out
    assert "concurrent sequences per replica" in out and " 57 " in out
    assert "15 replicas" in out and "memory-bound" in out
    assert "◀ target" in out  # the curve marks ρ = 0.7


def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curve.png"
    assert _run([*HAND_CASE, "--json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["concurrent_per_replica"] == 57
    assert data["fleet"] == {"replicas": 15, "throughput_bound": 5, "memory_bound": 15, "binding": "memory"}
    assert data["kv_bytes_per_token"] == 196_608
    assert png.read_bytes().startswith(b"\x89PNG")


def test_cli_fp8_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _run(
            [
                "--model",
                "llama-3.1-8b",
                "--hbm-gb",
                "80",
                "--weights-gb",
                "16",
                "--reserve-gb",
                "4",
                "--context",
                "2048",
                "--kv-dtype",
                "fp8",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert (data["kv_bytes_per_token"], data["concurrent_per_replica"]) == (65_536, 447)
    assert _run(["--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert _run(["--model", "llama-3.1-70b", "--gpu", "A10G-24GB"]) == 1  # does not fit: says so, fails
    assert "does not fit" in capsys.readouterr().out


def test_a_gpu_price_gives_the_fleets_cost_per_hour_and_per_million_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    # The hand case: 15 replicas of one GPU for 40 requests a second of 1024 + 256 tokens
    # (its default prompt and output lengths; --context sizes KV only).
    assert _run([*HAND_CASE, "--gpu-price", "2.40", "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["replica_per_hour"] == 2.40 and cost["fleet_per_hour"] == pytest.approx(36.0)
    tokens_per_hour = 40 * 3600 * (1024 + 256)
    assert cost["per_million_tokens"] == pytest.approx(36.0 / tokens_per_hour * 1e6)
    assert cost["per_million_output_tokens"] == pytest.approx(36.0 / (40 * 3600 * 256) * 1e6)
    assert _run([*HAND_CASE, "--gpu-price", "2.40"]) == 0
    out = capsys.readouterr().out
    assert "fleet cost per hour" in out and "36.00" in out and "cost per million tokens" in out
    # without a rate there is no fleet: only a replica's hour
    assert _run(["--model", "llama-3.1-8b", "--tp", "2", "--gpu-price", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"] == {
        "replica_per_hour": 6.0, "fleet_per_hour": None, "per_million_tokens": None, "per_million_output_tokens": None}
    assert _run([*HAND_CASE, "--json"]) == 0  # no price, no cost figures
    assert json.loads(capsys.readouterr().out)["cost"] is None
    with pytest.raises(SystemExit):
        _run([*HAND_CASE, "--gpu-price", "-1"])
