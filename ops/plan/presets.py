"""Named model shapes and GPU data sheets for the capacity planner.

Model presets are written as the subset of a Hugging Face ``config.json`` the planner
reads, so a preset and a real config go through the same parser (``ModelShape.from_config``).

GPU figures are the vendor's nominal numbers in decimal units (GB = 10^9 bytes,
TB/s = 10^12 bytes/s, dense bf16 tensor TFLOP/s without sparsity). The nominal "80 GB"
of an H100 is really 80 GiB (85.9·10^9 bytes) of which the driver exposes ~85.5·10^9;
using the smaller decimal figure leaves a few per cent of unplanned headroom, which is
the safe side for a sizing tool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: int  # per GPU
    bf16_tflops: float  # dense tensor-core peak, TFLOP/s
    bandwidth_bytes_per_s: float  # peak memory bandwidth


GB = 1_000_000_000  # the planner's unit: decimal gigabytes (see ops/plan/model.py)

GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("H100-80GB", 80 * GB, 989.0, 3.35e12),  # SXM5
        GpuSpec("H200-141GB", 141 * GB, 989.0, 4.8e12),
        GpuSpec("A100-80GB", 80 * GB, 312.0, 2.039e12),  # SXM4
        GpuSpec("A100-40GB", 40 * GB, 312.0, 1.555e12),
        GpuSpec("L40S-48GB", 48 * GB, 362.0, 0.864e12),
        # NVIDIA publishes no A10G sheet; AWS's figure is ~70 dense bf16 TFLOP/s at the
        # A10G's lower clocks (the A10 is rated 125). 600 GB/s GDDR6.
        GpuSpec("A10G-24GB", 24 * GB, 70.0, 0.6e12),
    )
}


# Shapes from the models' published config.json files.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32768,  # v0.3 tokenizer
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # The 48-layer, 8-KV-head, 128-dim shape with ~30 GB of bf16 weights that the
    # sizing examples use is Qwen2.5-14B; Qwen2.5-32B itself has 64 layers.
    "qwen2.5-14b": {
        "model_type": "qwen2",
        "num_hidden_layers": 48,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "intermediate_size": 13824,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-32b": {
        "model_type": "qwen2",
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "intermediate_size": 27648,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def lookup_gpu(name: str) -> GpuSpec:
    """A GPU preset by exact name (any case) or by an unambiguous prefix ("h200")."""
    wanted = name.strip().lower()
    for key, spec in GPU_PRESETS.items():
        if key.lower() == wanted:
            return spec
    matches = [spec for key, spec in GPU_PRESETS.items() if key.lower().startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(GPU_PRESETS)
    hint = "ambiguous" if matches else "unknown"
    raise KeyError(f"{hint} GPU {name!r}; presets: {known}")
