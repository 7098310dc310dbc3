"""``meshserve calibrate``: measure a GPU's step times and write a sim profile for them.

The sim engine models one engine step as

    step_s = base_s + per_prefill_token_s · prefill_tokens + per_decode_seq_s · decode_seqs
             + per_kv_token_s · kv_tokens + per_prefill_seq_s · prefill_seqs
             + per_prefill_step_s · [the step prefills]

(see ``services/worker/engines/sim_profile.py``). This command measures real forward
steps of a Llama-shaped model with random weights, with PyTorch alone (a GPU node may
have PyTorch but not vLLM yet): prefill chunks of several sizes over several cached
contexts, and decode batches of several sizes over several context lengths, each step
reading a real per-layer KV cache. It fits the coefficients by non-negative least
squares on relative error (a 2 ms decode and a 200 ms prefill weigh the same), and
writes a profile JSON with the memory budget of the device, the engine limits given,
the fitted figures at a reference workload (``intended``), and every measurement.

The model is a plain PyTorch Llama (RMSNorm, GQA attention with RoPE through
``scaled_dot_product_attention``, SiLU MLP, logits for the last token of each sequence),
not vLLM's fused kernels: the profile is what a straightforward engine does on this
device, a floor for vLLM's speed. Shapes come from ``--model-dir`` (a config.json) or the
shape flags of ``meshserve make-tiny-model``. The grid is sized to the device's free
memory and ``--time-budget`` (default 420 s: under eight minutes with start-up).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.cli_types import (
    count,
    fraction,
    non_negative_number,
    positive_int,
    positive_seconds,
)

from .calibrate_fit import Point, fit, predict
from .console import CliError, output_file_problem
from .tiny_model import PRESETS, ModelShape, add_shape_arguments, shape_from_args

# ----------------------------------------------------------------------- measurement


class RandomLlama:
    """A Llama forward pass in plain PyTorch with random weights and per-layer KV caches."""

    def __init__(self, shape: ModelShape, device: str, dtype: Any, seed: int = 0) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        self.device = device
        self.dtype = dtype
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, i = shape.hidden_size, shape.intermediate_size
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        kv = self.kv_heads * self.head_dim

        def w(*dims: int) -> Any:
            # Drawn on the CPU in chunks would be slow for 8B shapes: fill on the device.
            t = torch.empty(*dims, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=None if device != "cpu" else g)

        self.embed = w(shape.vocab_size, h)
        self.layers = [
            {"qkv": w(h + 2 * kv, h), "o": w(h, h), "gate_up": w(2 * i, h), "down": w(h, i),
             "n1": torch.ones(h, device=device, dtype=dtype), "n2": torch.ones(h, device=device, dtype=dtype)}
            for _ in range(shape.num_hidden_layers)
        ]
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = self.embed if shape.tie_word_embeddings else w(shape.vocab_size, h)
        inv = 1.0 / (shape.rope_theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim))
        self.inv_freq = inv
        self._gqa: bool | None = None  # SDPA's enable_gqa works here (None: not tried yet)

    def kv_cache(self, batch: int, length: int) -> list[tuple[Any, Any]]:
        t = self.torch
        return [
            (t.randn(batch, self.kv_heads, length, self.head_dim, device=self.device, dtype=self.dtype),
             t.randn(batch, self.kv_heads, length, self.head_dim, device=self.device, dtype=self.dtype))
            for _ in self.layers
        ]

    def _rope(self, x: Any, positions: Any) -> Any:
        t = self.torch
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = freqs.cos().to(x.dtype)[:, None, :], freqs.sin().to(x.dtype)[:, None, :]  # over heads
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return t.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _rms(self, x: Any, weight: Any) -> Any:
        t = self.torch
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * t.rsqrt(v + self.shape.rms_norm_eps)).to(x.dtype) * weight

    def _attention(self, q: Any, keys: Any, values: Any, mask: Any, causal: bool) -> Any:
        f = self.torch.nn.functional
        if self.kv_heads != self.heads and self._gqa is not False:
            try:  # grouped-query attention without copying K/V (PyTorch >= 2.5)
                out = f.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
                self._gqa = True
                return out
            except TypeError:
                self._gqa = False
        if self.kv_heads != self.heads:
            keys = keys.repeat_interleave(self.heads // self.kv_heads, dim=1)
            values = values.repeat_interleave(self.heads // self.kv_heads, dim=1)
        return f.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal)

    def step(self, tokens: Any, start: int, cache: list[tuple[Any, Any]]) -> Any:
        """``tokens`` [B, T] at positions start..start+T-1; the cache holds ≥ start+T positions."""
        t = self.torch
        f = t.nn.functional
        b, n = tokens.shape
        positions = t.arange(start, start + n, device=self.device)
        x = self.embed[tokens]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        mask = None
        if n > 1 and start > 0:
            q_pos = positions[:, None]
            k_pos = t.arange(start + n, device=self.device)[None, :]
            mask = k_pos <= q_pos  # causal over the cached context and the chunk
        for layer, (kc, vc) in zip(self.layers, cache, strict=True):
            y = self._rms(x, layer["n1"])
            qkv = f.linear(y, layer["qkv"])
            q, k, v = qkv.split((hq * d, hk * d, hk * d), dim=-1)
            q = self._rope(q.view(b, n, hq, d), positions).transpose(1, 2)
            k = self._rope(k.view(b, n, hk, d), positions).transpose(1, 2)
            kc[:, :, start:start + n] = k
            vc[:, :, start:start + n] = v.view(b, n, hk, d).transpose(1, 2)
            attn = self._attention(q, kc[:, :, :start + n], vc[:, :, :start + n], mask, n > 1 and start == 0)
            x = x + f.linear(attn.transpose(1, 2).reshape(b, n, hq * d), layer["o"])
            y = self._rms(x, layer["n2"])
            gate, up = f.linear(y, layer["gate_up"]).chunk(2, dim=-1)
            x = x + f.linear(f.silu(gate) * up, layer["down"])
        last = self._rms(x[:, -1], self.norm)  # logits of each sequence's last position only
        return f.linear(last, self.lm_head).argmax(-1)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model: RandomLlama, *, batch: int, tokens: int, context: int, repeats: int, warmup: int = 2) -> float:
    """Median seconds of a step of ``batch`` sequences × ``tokens`` new tokens over ``context`` cached."""
    t = model.torch
    cache = model.kv_cache(batch, context + tokens)
    ids = t.randint(0, model.shape.vocab_size, (batch, tokens), device=model.device)
    times = []
    with t.inference_mode():
        for i in range(warmup + repeats):
            _sync(model.device)
            t0 = time.perf_counter()
            model.step(ids, context, cache)
            _sync(model.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    del cache
    return statistics.median(times)


@dataclass(frozen=True, slots=True)
class Grid:
    prefill_chunks: tuple[int, ...] = (128, 512, 2048, 8192)
    prefill_contexts: tuple[int, ...] = (0, 4096)
    decode_batches: tuple[int, ...] = (1, 8, 32, 128, 256)
    decode_contexts: tuple[int, ...] = (256, 1024, 4096)


DEFAULT_GRID = Grid()


def run_grid(model: RandomLlama, grid: Grid, *, repeats: int, time_budget_s: float, max_kv_tokens: int,
             max_len: int, log: Any = print) -> list[Point]:
    """Measure the grid, smallest steps first, within the memory and time budgets."""
    plan: list[tuple[str, int, int, int]] = []  # kind, batch, tokens, context
    for context in grid.prefill_contexts:
        for chunk in grid.prefill_chunks:
            if context + chunk <= max_len and context + chunk <= max_kv_tokens:
                plan.append(("prefill", 1, chunk, context))
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            if context + 1 <= max_len and batch * (context + 1) <= max_kv_tokens:
                plan.append(("decode", batch, 1, context))
    plan.sort(key=lambda p: p[1] * (p[2] + p[3]))
    deadline = time.monotonic() + time_budget_s
    points: list[Point] = []
    for kind, batch, tokens, context in plan:
        if time.monotonic() > deadline:
            log(f"time budget spent: {len(points)} of {len(plan)} points measured")
            break
        seconds = measure(model, batch=batch, tokens=tokens, context=context, repeats=repeats)
        point = Point(kind=kind, prefill_tokens=tokens if kind == "prefill" else 0,
                      decode_seqs=batch if kind == "decode" else 0, kv_tokens=batch * (context + tokens), seconds=seconds,
                      prefill_seqs=batch if kind == "prefill" else 0)
        points.append(point)
        log(f"  {kind:7s} batch {batch:4d} tokens {tokens:5d} context {context:5d}: {seconds * 1000:9.3f} ms")
    return points


# --------------------------------------------------------------------------- profile


def kv_bytes_per_token(shape: ModelShape, kv_itemsize: int) -> int:
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * kv_itemsize


def intended_points(coef: dict[str, float], input_len: int, output_len: int,
                    batches: Sequence[int] = (1, 8, 32, 128)) -> list[dict[str, float]]:
    context = input_len + math.ceil(output_len / 2)
    out = []
    for b in batches:
        step = coef["base_s"] + coef["per_decode_seq_s"] * b + coef["per_kv_token_s"] * b * context
        out.append({"batch": b, "output_tokens_per_s": round(b / step, 1), "tpot_ms": round(step * 1000, 3)})
    return out


def fitted_parts(coef: dict[str, float], points: Sequence[Point], *, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, input_len: int, output_len: int,
                 batches: Sequence[int] = (1, 8, 32, 128)) -> tuple[list[float], dict[str, Any]]:
    """What every calibrated profile holds whatever it measured: each point's relative fit
    error, and the ``step``, ``engine_defaults`` and ``intended`` sections."""
    errors = [abs(predict(coef, p) - p.seconds) / p.seconds for p in points]
    return errors, {
        "step": {k: float(f"{v:.6g}") for k, v in coef.items()},
        "engine_defaults": {
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
        },
        "intended": {"input_len": input_len, "output_len": output_len,
                     "points": intended_points(coef, input_len, output_len, batches)},
    }


def point_rows(coef: dict[str, float], points: Sequence[Point]) -> list[dict[str, Any]]:
    return [{**asdict(p), "predicted": predict(coef, p)} for p in points]


def build_profile(*, name: str, model: str, coef: dict[str, float], points: Sequence[Point], shape: ModelShape,
                  device_name: str, hbm_bytes: int, weight_itemsize: int, kv_itemsize: int,
                  gpu_memory_utilization: float, activation_reserve_bytes: int, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int, max_model_len: int, input_len: int, output_len: int,
                  seconds: float) -> dict[str, Any]:
    weights = shape.num_parameters() * weight_itemsize
    errors, parts = fitted_parts(coef, points, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 input_len=input_len, output_len=output_len)
    return {
        "name": name,
        "model": model,
        "comment": (f"Measured by meshserve calibrate on {device_name}: a plain PyTorch Llama forward with random "
                    f"weights ({shape.num_parameters() / 1e9:.2f}B parameters, {shape.dtype}) over a grid of "
                    f"{len(points)} prefill chunks and decode batches with real KV caches, fitted by non-negative "
                    f"least squares on relative error (median error {statistics.median(errors) * 100:.1f}%, worst "
                    f"{max(errors) * 100:.1f}%). Not vLLM's fused kernels: a floor for vLLM on this device. "
                    f"Memory: device total, weights of these shapes, reserve = (1 - gpu_memory_utilization "
                    f"{gpu_memory_utilization}) of it plus activations."),
        "step": parts["step"],
        "memory": {
            "hbm_bytes": int(hbm_bytes),
            "weights_bytes": int(weights),
            "reserve_bytes": int(hbm_bytes * (1 - gpu_memory_utilization) + activation_reserve_bytes),
            "kv_bytes_per_token": kv_bytes_per_token(shape, kv_itemsize),
        },
        "engine_defaults": parts["engine_defaults"],
        "intended": parts["intended"],
        "calibration": {
            "device": device_name,
            "shape": asdict(shape),
            "seconds": round(seconds, 1),
            "points": point_rows(coef, points),
        },
    }


def shape_from_config(path: Path) -> ModelShape:
    config = json.loads((path / "config.json").read_text())
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelShape(
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]), num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
    )


def _ints(text: str, item: Callable[[str], int]) -> tuple[int, ...]:
    values = tuple(item(x.strip()) for x in text.split(",") if x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return values


def _sizes(text: str) -> tuple[int, ...]:
    """Chunk sizes or batch sizes: each at least 1."""
    return _ints(text, positive_int)


def _lengths(text: str) -> tuple[int, ...]:
    """Context lengths: each 0 or more."""
    return _ints(text, count)


def engine_url(text: str) -> str:
    """``--engine-url``: an http(s) URL with a host (``foo`` was tried as a path, ``foo/v1/models``)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r} (e.g. http://127.0.0.1:8000)")
    return text.strip()


def missing_measurements(points: Sequence[Point]) -> str:
    """What a grid lacked when its fit is not a usable step model (a prefill or a decode
    step of no time): the measurements that would tell the costs apart."""
    wanted = []
    if len({p.prefill_tokens for p in points if p.kind == "prefill"}) < 2:
        wanted.append("prefill chunks of two sizes or more (--prefill-chunks, e.g. 32,128,512)")
    if len({p.decode_seqs for p in points if p.kind == "decode"}) < 2:
        wanted.append("decode batches of two sizes or more (--decode-batches, e.g. 1,4,16)")
    if len({p.kv_tokens for p in points if p.kind == "decode"}) < 2:
        wanted.append("decode contexts of two lengths or more (--decode-contexts)")
    return ("; it needs " + " and ".join(wanted)) if wanted else "; measure a larger grid, or more --repeats"


def save_profile(profile: dict[str, Any], out: Path, points: Sequence[Point]) -> str | None:
    """Write ``profile`` to ``out``; the problem the sim's own loader finds in it (then the
    file holds the measurements but is no profile to run), or None.

    ``out`` was checked before measuring; if writing fails all the same, the profile goes
    to stdout (the measurements are not lost) and this raises ``CliError``."""
    from services.worker.engines.sim_profile import profile_from_dict

    text = json.dumps(profile, indent=2) + "\n"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        sys.stdout.write(text)
        sys.stdout.flush()
        raise CliError(f"cannot write {out}: {exc.strerror or exc}; the profile is printed above on stdout "
                       "(save it to a file to use it)") from None
    try:
        profile_from_dict(profile, where=str(out))
    except ValueError as exc:
        return f"{exc}{missing_measurements(points)}"
    return None


def check_out(out: str) -> Path:
    """``--out``, refused before anything is measured when it cannot be written."""
    problem = output_file_problem(out)
    if problem:
        raise CliError(f"--out {out}: {problem}", exit_code=2)
    return Path(out)


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def add_parser(subparsers: Any) -> None:
    from .calibrate_engine import EnginePlan  # it builds on this module

    engine = EnginePlan()
    p = subparsers.add_parser(
        "calibrate",
        help="measure step times of a model's shapes with PyTorch and write a sim profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="calibrated-profile.json", help="profile file to write")
    p.add_argument("--name", default=None, help="profile name (default: from the shapes and device)")
    p.add_argument("--model", default=None, help="model name for the profile (default: the model directory or preset)")
    p.add_argument("--model-dir", default=None, help="take the shapes from this directory's config.json")
    add_shape_arguments(p)
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:1, cpu")
    p.add_argument("--kv-cache-dtype", default=None, help="KV cache element type (default: the model dtype)")
    p.add_argument("--engine-url", type=engine_url, default=None,
                   help="measure this running vLLM-compatible server (e.g. http://127.0.0.1:8000) instead of a "
                        "PyTorch forward: its own prefill and decode times, from its /metrics")
    p.add_argument("--prefill-chunks", type=_sizes, default=None,
                   help=f"comma-separated chunk sizes (default {_csv(DEFAULT_GRID.prefill_chunks)}; "
                        f"with --engine-url {_csv(engine.prefill_chunks)})")
    p.add_argument("--prefill-contexts", type=_lengths, default=None,
                   help=f"cached tokens before a chunk (default {_csv(DEFAULT_GRID.prefill_contexts)}; "
                        f"with --engine-url {_csv(engine.prefill_contexts)})")
    p.add_argument("--decode-batches", type=_sizes, default=None,
                   help=f"comma-separated batch sizes (default {_csv(DEFAULT_GRID.decode_batches)}; "
                        f"with --engine-url {_csv(engine.decode_batches)})")
    p.add_argument("--decode-contexts", type=_lengths, default=None,
                   help=f"context lengths while decoding (default {_csv(DEFAULT_GRID.decode_contexts)}; "
                        f"with --engine-url {_csv(engine.decode_contexts)})")
    p.add_argument("--decode-tokens", type=positive_int, default=engine.decode_tokens,
                   help="--engine-url: output tokens of each decode request")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help=f"timed steps (--engine-url: requests) per point, median (default 5; with --engine-url "
                        f"{engine.repeats})")
    p.add_argument("--time-budget", type=positive_seconds, default=420.0, help="seconds of measuring at most")
    p.add_argument("--max-kv-tokens", type=positive_int, default=None, help="largest KV cache a point may use (default: from free memory)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    p.add_argument("--activation-reserve-gib", type=non_negative_number, default=2.0)
    p.add_argument("--block-size", type=positive_int, default=None, help="engine default (16 on GPU, 128 on CPU)")
    p.add_argument("--max-num-seqs", type=positive_int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--max-model-len", type=positive_int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--input-len", type=positive_int, default=512, help="reference workload of the intended figures")
    p.add_argument("--output-len", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .calibrate_engine import EnginePlan, run_engine

    grid = DEFAULT_GRID if args.engine_url is None else EnginePlan()
    for name in ("prefill_chunks", "prefill_contexts", "decode_batches", "decode_contexts", "repeats"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(grid, name, 5))
    check_out(args.out)
    if args.engine_url is not None:
        return run_engine(args)
    try:  # before anything is measured, and before torch is looked for
        shape = shape_from_config(Path(args.model_dir)) if args.model_dir else shape_from_args(args)
        shape.validate()
    except OSError as exc:
        raise CliError(f"cannot read {args.model_dir}/config.json: {exc.strerror or exc}", exit_code=2) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CliError(f"model shape: {exc}", exit_code=2) from None
    if importlib.util.find_spec("torch") is None:
        raise CliError(f"timing the shapes with PyTorch needs torch, which this Python "
                       f"({sys.executable}) lacks. `make vllm-cpu` builds .venv-vllm with it; then run "
                       ".venv-vllm/bin/meshserve calibrate with the same arguments. Or time a running "
                       "vLLM-compatible server instead, which needs no torch: --engine-url http://HOST:PORT",
                       exit_code=2)
    import torch

    t_start = time.monotonic()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, shape.dtype)
    kv_dtype = getattr(torch, args.kv_cache_dtype) if args.kv_cache_dtype else dtype
    itemsize = torch.tensor([], dtype=dtype).element_size()
    kv_itemsize = torch.tensor([], dtype=kv_dtype).element_size()
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        device_name, hbm = props.name, int(props.total_memory)
    else:
        import os

        device_name = f"CPU ({os.cpu_count()} cores)"
        hbm = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    torch.manual_seed(args.seed)
    print(f"calibrating {shape.num_parameters() / 1e6:,.1f}M-parameter Llama shapes ({shape.num_hidden_layers} layers, "
          f"hidden {shape.hidden_size}, {shape.num_attention_heads}/{shape.num_key_value_heads} heads) on {device_name}")
    model = RandomLlama(shape, device, dtype, seed=args.seed)
    per_token = kv_bytes_per_token(shape, itemsize)
    max_kv = args.max_kv_tokens
    if max_kv is None:
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            max_kv = int(free * 0.6) // per_token  # room for activations of the largest step
        else:
            max_kv = 32768
    max_len = args.max_model_len or shape.max_position_embeddings
    grid = Grid(args.prefill_chunks, args.prefill_contexts, args.decode_batches, args.decode_contexts)
    points = run_grid(model, grid, repeats=args.repeats, time_budget_s=args.time_budget, max_kv_tokens=max_kv,
                      max_len=max_len)
    coef = fit(points)
    model_name = args.model or (Path(args.model_dir).name if args.model_dir else f"random-llama-{args.preset}")
    name = args.name or f"{model_name}-{device_name.lower().replace(' ', '-')}"
    profile = build_profile(
        name=name, model=model_name, coef=coef, points=points, shape=shape, device_name=device_name, hbm_bytes=hbm,
        weight_itemsize=itemsize, kv_itemsize=kv_itemsize, gpu_memory_utilization=args.gpu_memory_utilization,
        activation_reserve_bytes=int(args.activation_reserve_gib * (1 << 30)),
        block_size=args.block_size or (16 if device.startswith("cuda") else 128), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len, input_len=args.input_len,
        output_len=args.output_len, seconds=time.monotonic() - t_start,
    )
    out = Path(args.out)
    unusable = save_profile(profile, out, points)
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in coef.items()))
    if unusable:
        raise CliError(f"wrote the measurements to {out}, but they make no usable sim profile: {unusable}")
    for p in profile["intended"]["points"]:
        print(f"  batch {p['batch']:4d}: {p['output_tokens_per_s']:9.1f} output tokens/s, TPOT {p['tpot_ms']:.2f} ms")
    print(f"wrote {out} in {time.monotonic() - t_start:.0f}s (use it with: meshserve serve worker --engine sim "
          f"--profile {out})")
    return 0


__all__ = ["PRESETS", "Grid", "Point", "RandomLlama", "build_profile", "fit", "run_grid"]
