"""What crosses into vLLM and back, as plain functions: the engine's arguments, the
served name and weights, LoRA adapter specs, a prompt as token ids, sampling parameters
(``SamplingParams`` keyword arguments, guided decoding), when vLLM first scheduled a
request, and its log probabilities as ``proto.TokenLogprob``. No vLLM import at module
level (``token_prompt`` imports it when called), so these are unit-tested without vLLM.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proto.messages import SamplingParams, StructuredOutput, TokenLogprob, TopLogprob

from .base import EngineRequest

# vLLM's OpenAI server reports -inf (a token masked by guided decoding or logit_bias) as
# this, since JSON has no infinity; the same here, so every API path can serialise it.
LOGPROB_FLOOR = -9999.0


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


def runtime_adapter_problem(name: str, path: str, max_rank: int) -> str | None:
    """Why a runtime adapter at ``path`` cannot be loaded (None: it can, as far as files
    tell): vLLM loads it inside the engine core, where a missing file or a rank above
    ``max_lora_rank`` is an exception that stops the engine for every request."""
    where = Path(path)
    try:
        config = json.loads((where / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"cannot load LoRA adapter {name!r} from {path}: no readable adapter_config.json ({exc.__class__.__name__})"
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or rank < 1:
        return f"cannot load LoRA adapter {name!r}: adapter_config.json has no rank"
    if rank > max_rank:
        return f"cannot load LoRA adapter {name!r}: its rank {rank} is above this worker's max_lora_rank {max_rank}"
    if not any((where / w).is_file() for w in ("adapter_model.safetensors", "adapter_model.bin")):
        return f"cannot load LoRA adapter {name!r} from {path}: no adapter_model.safetensors or .bin"
    return None


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


def is_validation_error(exc: BaseException) -> bool:
    """Whether vLLM refused a request as sent: its ``VLLMClientError`` family
    (``VLLMValidationError``: a schema, regex or grammar it cannot compile) or a plain
    ``ValueError`` from input processing, which vLLM's own server answers with a 400.
    By class name, so this module needs no vLLM import."""
    if isinstance(exc, ValueError):
        return True
    return any(cls.__name__ == "VLLMClientError" for cls in type(exc).__mro__)


def default_cpu_kvcache_gib(available_bytes: int) -> int:
    """The CPU build's KV cache when none is asked for: a quarter of the free memory, 1-4 GiB."""
    return max(1, min(4, int(available_bytes * 0.25) >> 30))


def token_prompt(prompt_ids: list[int], arrival: float, cache_salt: str = "") -> Any:
    """The prompt as token ids: vLLM's rendered ``TokensInput`` where it has one (newer
    versions warn that raw prompts are deprecated), else a ``TokensPrompt``; with its
    ``cache_salt`` (the org: prefixes are shared within an org only)."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        legacy = TokensPrompt(prompt_token_ids=prompt_ids)
        if cache_salt:
            legacy["cache_salt"] = cache_salt
        return legacy
    prompt = tokens_input(prompt_ids, cache_salt=cache_salt or None)
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


def sampling_kwargs(s: SamplingParams, output_offset: int = 0) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``SamplingParams`` for one sequence (``n=1``: the worker
    fans n choices out), without ``output_kind`` and ``structured_outputs``.

    ``output_offset`` continues a migrated generation: those tokens count toward
    ``max_tokens`` and ``min_tokens``, and the prompt's logprobs went out with the first
    chunk already (the continuation's prompt holds output too), so none are asked again.
    """
    max_tokens = max(1, s.max_tokens - output_offset)
    return {
        "n": 1,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else 0,
        "min_p": s.min_p,
        "min_tokens": min(max(0, s.min_tokens - output_offset), max_tokens),
        "max_tokens": max_tokens,
        "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "seed": s.seed,
        "ignore_eos": s.ignore_eos,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "logit_bias": {int(k): float(v) for k, v in s.logit_bias.items()} or None,
        "logprobs": s.logprobs,
        "prompt_logprobs": s.prompt_logprobs if output_offset == 0 else None,
        "skip_special_tokens": s.skip_special_tokens,
        "spaces_between_special_tokens": s.spaces_between_special_tokens,
        "include_stop_str_in_output": s.include_stop_str_in_output,
    }


def structured_kwargs(structured: StructuredOutput | None) -> dict[str, Any] | None:
    """Keyword arguments of vLLM's ``StructuredOutputsParams`` (None: no guided decoding).

    vLLM takes exactly one constraint; ``json_object`` is ``True`` or unset (``None``), never
    ``False``, which vLLM would count as a constraint.
    """
    if structured is None:
        return None
    kinds: dict[str, Any] = {
        "json": structured.json,
        "regex": structured.regex,
        "choice": list(structured.choice) if structured.choice is not None else None,
        "grammar": structured.grammar,
        "json_object": True if structured.json_object else None,
    }
    chosen = {name: value for name, value in kinds.items() if value is not None}
    if len(chosen) > 1:
        raise ValueError(f"structured output sets {', '.join(chosen)}: exactly one is allowed")
    return chosen or None


def sample_logprobs(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None], top: int, decode: Callable[[int], str],
) -> list[TokenLogprob]:
    """vLLM's logprobs of generated tokens (one ``{token_id: Logprob}`` dict per id of
    ``token_ids``) → ``proto.TokenLogprob``, each with the ``top`` most likely tokens."""
    out: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=True):
        if not position:
            raise ValueError(f"vLLM returned no logprobs for generated token {token_id}")
        out.append(position_logprob(token_id, position, top, decode))
    return out


def prompt_logprobs(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None], top: int, decode: Callable[[int], str],
) -> list[TokenLogprob | None]:
    """The same for the prompt: None where vLLM has none (the first token: nothing precedes
    it), which its flat container gives as an empty dict."""
    return [None if not position else position_logprob(token_id, position, top, decode)
            for token_id, position in zip(token_ids, positions, strict=True)]


def position_logprob(token_id: int, position: Mapping[int, Any], top: int, decode: Callable[[int], str]) -> TokenLogprob:
    """One position's ``{token_id: Logprob}`` → ``TokenLogprob`` of ``token_id``.

    vLLM puts the sampled (or prompt) token first, then the ``top`` most likely by rank;
    when the sampled one is among them the dict holds ``top`` entries, else ``top + 1``.
    ``TokenLogprob.top`` is the ``top`` most likely alone, most likely first. Token strings
    are vLLM's ``decoded_token`` (what its own server answers in ``token``), ``decode``
    where vLLM has none.
    """
    entry = position.get(token_id)
    if entry is None:
        raise ValueError(f"vLLM returned no logprob for token {token_id}")
    items = list(position.items())
    ranked = items[1:] if len(items) > top else sorted(items, key=lambda item: _rank(item[1]))
    rank = getattr(entry, "rank", None)
    return TokenLogprob(
        token_id=token_id, token=_decoded(entry, token_id, decode), logprob=_logprob(entry),
        top=[TopLogprob(token_id=tid, token=_decoded(lp, tid, decode), logprob=_logprob(lp))
             for tid, lp in ranked[:top]],
        rank=int(rank) if rank is not None else 0,
    )


def _rank(lp: Any) -> int:
    rank = getattr(lp, "rank", None)
    return int(rank) if rank is not None else 1 << 62


def _decoded(lp: Any, token_id: int, decode: Callable[[int], str]) -> str:
    token = getattr(lp, "decoded_token", None)
    return str(token) if token is not None else decode(token_id)


def _logprob(lp: Any) -> float:
    return max(float(lp.logprob), LOGPROB_FLOOR)


# What vLLM's disaggregated-serving proxy sends a prefill instance (its toy proxy and
# llm-d's sidecar alike): compute the prompt, keep the KV for a decode instance, say where.
REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def parse_kv_transfer_config(spec: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` as a mapping (given as one or as its JSON); None: none."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_transfer_config is not JSON: {exc}") from exc
    if not isinstance(spec, Mapping) or not spec.get("kv_connector"):
        raise ValueError("kv_transfer_config must be an object naming its kv_connector, e.g."
                         ' {"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    return dict(spec)


def kv_transfer_params(req: EngineRequest) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` for vLLM: a decode's, the prefill worker's answer
    with ``do_remote_prefill`` (as vLLM's proxy passes it on; none when the answer names
    nothing: such a connector finds the KV by the prompt); a prefill's, ``REMOTE_DECODE``."""
    if req.kv_transfer:
        return {**req.kv_transfer, "do_remote_prefill": True, "do_remote_decode": False}
    if req.hold_kv:
        return dict(REMOTE_DECODE)
    return None
