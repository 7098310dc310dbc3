"""What crosses into vLLM and back, as plain functions: the engine's arguments, the
served name and weights, LoRA adapter specs, a prompt as token ids, and when vLLM first
scheduled a request. No vLLM import at module level (``token_prompt`` imports it when
called), so these are unit-tested without vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def parse_lora_adapters(spec: Mapping[str, str] | Iterable[str] | str | None) -> dict[str, str]:
    """``name=path`` entries (a mapping, a list, or one comma-separated string) → {name: path}.

    A bare ``name`` means an adapter directory of that name.
    """
    if not spec:
        return {}
    if isinstance(spec, Mapping):
        return {str(k): str(v) for k, v in spec.items()}
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        out[name.strip()] = path.strip() if sep else name.strip()
    return out


def resolve_model(model: str, model_dir: str | None, served_model_name: str | None) -> tuple[str, str]:
    """(served name, weights): ``model`` names both, as in vLLM (a directory or a hub id),
    unless ``model_dir`` gives the weights; ``served_model_name`` overrides the name."""
    return served_model_name or model, model_dir or model


def local_model_dir(model: str) -> str | None:
    """The local directory of ``model``: itself, or vLLM's download of a hub id in the
    Hugging Face cache (what the gateway loads the tokenizer and chat template from)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: nothing local to point at
        return None


def engine_arguments(
    *,
    model_dir: str,
    served_model_name: str,
    options: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    enable_lora: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``AsyncEngineArgs``: ours where set, then ``extra`` as is.

    Every option keeps vLLM's name and meaning; ``None`` leaves vLLM's default.
    """
    args: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "served_model_name": served_model_name,
        "disable_log_stats": True,  # our stat logger still gets every step's stats
    }
    for name, value in options.items():
        if value is not None:
            args[name] = value
    if enable_lora:
        args["enable_lora"] = True
    args.update(dict(extra or {}))
    return args


def default_cpu_kvcache_gib(available_bytes: int) -> int:
    """The CPU build's KV cache when none is asked for: a quarter of the free memory, 1-4 GiB."""
    return max(1, min(4, int(available_bytes * 0.25) >> 30))


def token_prompt(prompt_ids: list[int], arrival: float) -> Any:
    """The prompt as token ids: vLLM's rendered ``TokensInput`` where it has one (newer
    versions warn that raw prompts are deprecated), else a ``TokensPrompt``."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt_ids)
    prompt = tokens_input(prompt_ids)
    prompt["arrival_time"] = arrival
    return prompt


def scheduled_epoch(out: Any, arrival: float, first_token: float) -> float:
    """When vLLM first scheduled the request, in epoch seconds (its stats use the monotonic
    clock, which is system-wide on Linux, so the engine core's stamps convert here)."""
    metrics = getattr(out, "metrics", None)
    ts = float(getattr(metrics, "scheduled_ts", 0.0) or 0.0)
    if ts <= 0:
        return first_token
    epoch = time.time() - time.monotonic() + ts
    return min(max(epoch, arrival), first_token)
