"""A model's generation config as vLLM's ``--generation-config`` reads it: the sampling
defaults of its ``generation_config.json`` (pure; file reading only).

vLLM's OpenAI server (``ModelConfig.get_diff_sampling_param``) gives every request field
the client omitted the model's value, where the file sets one. A meshserve worker reads
the same file, advertises the values in ``WorkerInfo.sampling_defaults``, and the gateway
applies them (DESIGN.md: the gateway builds the engine's sampling parameters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proto.workers import SamplingDefaults

# vLLM's ``ModelConfig.get_diff_sampling_param``: the generation-config fields that become
# the server's defaults (``max_new_tokens`` as ``max_tokens``).
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def read_sampling_defaults(generation_config: str, model_dir: str) -> SamplingDefaults | None:
    """The sampling defaults vLLM's ``--generation-config`` gives a model: ``auto`` reads
    ``generation_config.json`` in ``model_dir``, ``vllm`` none (vLLM's neutral defaults),
    anything else is a directory holding that file, whose ``max_new_tokens`` then also
    caps explicit max_tokens (``max_tokens_override``). Values the file leaves out or sets
    to null are not defaults (transformers 5 keeps every value a file sets, as vLLM
    0.32 reads it); None when there are none. A file that is not JSON is an error, as
    it is for vLLM."""
    if generation_config == "vllm":
        return None
    where = Path(model_dir if generation_config == "auto" else generation_config).expanduser()
    path = where / "generation_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a JSON generation config ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a generation config is a JSON object")
    found: dict[str, Any] = {}
    for name in GENERATION_CONFIG_FIELDS:
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # absent, null or not a number: vLLM's default holds
        if name in ("top_k", "max_new_tokens"):
            if value != int(value):
                continue
            value = int(value)
        else:
            value = float(value)
        found["max_tokens" if name == "max_new_tokens" else name] = value
    if found.get("max_tokens") is not None and found["max_tokens"] < 1:
        del found["max_tokens"]  # no output at all is no default a request can run with
    if generation_config != "auto" and "max_tokens" in found:
        # vLLM's server caps every request by it then, not only those that omit max_tokens.
        found["max_tokens_override"] = found["max_tokens"]
    return SamplingDefaults(**found) if found else None
