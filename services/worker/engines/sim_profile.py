"""Step-time and memory profiles of the modelled GPU replica, loaded from JSON.

A profile says how long one engine step takes and how much KV cache the GPU holds:

    step_s = base_s + per_prefill_token_s · prefill_tokens + per_decode_seq_s · decode_seqs
             + per_kv_token_s · kv_tokens_attended + per_prefill_seq_s · prefill_seqs
             + per_prefill_step_s · [the step prefills]

``base_s`` is the fixed cost of a forward pass (reading the weights once: decode at
small batch is memory-bound), ``per_prefill_token_s`` the compute of one prompt token,
``per_decode_seq_s`` the per-sequence cost of a decode (sampling, activations, the
growing GEMM), ``per_kv_token_s`` attention reading one cached token's K and V, and
``per_prefill_seq_s`` and ``per_prefill_step_s`` (optional, default 0) fixed costs of
prefilling: one for each sequence prefilling in the step, one for a step that prefills at
all. vLLM's CPU build took 4.1 ms for a 32-token prefill against 2.4 ms for a decode
step, a gap no per-token term explains; eight such prefills in one step took no longer
than one, so on vLLM the cost is the step's, not the sequence's (``meshserve calibrate
--engine-url`` times steps of several prefills to tell the two apart).
``idle_wake_s`` (optional, default 0) is added to a step that starts after the engine sat
idle: vLLM's CPU build parks its threads when it has no work, and its first step after
that took 2.5 ms longer than the same step with the engine busy.

Profiles live in ``profiles/<name>.json``; a path to any JSON file of the same shape
works too. The file also states the figures it was fitted to (``intended``), which
``benchmarks/sim_batch.py`` prints next to what the simulation produces.

``SimConfig`` is one replica's configuration: a profile's defaults, overridden by the
worker's flags (block size, KV block count or memory figures, batch limits).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sim_lora import LoraConfig

PROFILES_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "llama-3.1-8b-h100"
# A decode replica's KV link to prefill replicas: RDMA at 400 Gb/s per GPU (one ConnectX-7
# per H100, as NVIDIA Dynamo's and llm-d's reference P/D deployments run), at ~50 GB/s.
DEFAULT_KV_TRANSFER_GB_PER_S = 50.0


# The sim keeps a Python object per KV block: 4M of them take ~0.8 GB (10^10 ran the host out of memory).
MAX_KV_BLOCKS = 1 << 22


@dataclass(frozen=True, slots=True)
class StepCosts:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    per_prefill_seq_s: float = 0.0
    per_prefill_step_s: float = 0.0
    idle_wake_s: float = 0.0  # added to a step that starts after idle (not part of step_time)

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, prefill_seqs: int = 0) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_kv_token_s * kv_tokens
            + self.per_prefill_seq_s * prefill_seqs
            + (self.per_prefill_step_s if prefill_seqs else 0.0)
        )

    def decode_tpot(self, batch: int, context: int) -> float:
        """Steady-state seconds per output token of ``batch`` sequences of ``context`` tokens."""
        return self.step_time(0, batch, batch * context)

    def requests_per_s(self, prefill_tokens: float, output_tokens: float, batch: int = 32) -> float:
        """Requests per second one replica sustains when each prefills ``prefill_tokens``
        and decodes ``output_tokens`` in a batch of ``batch`` (mean context: the prompt
        plus half the output). A planning figure: the batch is fixed, not load-dependent."""
        context = prefill_tokens + output_tokens / 2
        # each prefill counted in a step of its own: prefills that share a step cost less
        per_request = (prefill_tokens * self.per_prefill_token_s + self.per_prefill_seq_s + self.per_prefill_step_s
                       + output_tokens * self.decode_tpot(batch, round(context)) / batch)
        return 1.0 / per_request


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How many KV blocks fit: (HBM − weights − reserve) / (KV bytes per token · block size).

    ``reserve_bytes`` covers what vLLM keeps outside the KV cache: the share of HBM left
    by ``gpu_memory_utilization`` plus activations and CUDA graphs.
    """

    hbm_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_bytes_per_token: int

    def num_blocks(self, block_size: int) -> int:
        free = self.hbm_bytes - self.weights_bytes - self.reserve_bytes
        if free <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"memory budget leaves no room for a KV cache: {self}")
        return free // (self.kv_bytes_per_token * block_size)


@dataclass(frozen=True, slots=True)
class IntendedPoint:
    """A figure the profile was fitted to: steady decode at ``batch`` sequences."""

    batch: int
    output_tokens_per_s: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    model: str
    costs: StepCosts
    memory: MemoryBudget
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    intended: tuple[IntendedPoint, ...] = ()
    reference_input_len: int = 0  # the workload the intended figures describe
    reference_output_len: int = 0
    comment: str = ""
    accelerator: str = ""  # the hardware it models (e.g. "H100-80GB"): what its replicas are priced as

    @property
    def reference_context(self) -> int:
        """Mean context length while decoding the reference workload."""
        return self.reference_input_len + math.ceil(self.reference_output_len / 2)


def _get(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"profile {where}: missing {key!r}")
    return d[key]


def _section(data: dict[str, Any], key: str, where: str, required: bool = True) -> dict[str, Any]:
    value = _get(data, key, where) if required else data.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"profile {where}: {key!r} must be a mapping, not {type(value).__name__}")
    return value


def _number(d: dict[str, Any], key: str, where: str, field: str, default: float | None = None) -> float:
    """``d[key]`` as a finite float; a problem names the file and the field (``step.base_s``)."""
    value = _get(d, key, where) if default is None or key in d else default
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"profile {where}: {field} must be a number, not {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"profile {where}: {field} must be a number, not {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"profile {where}: {field} must be a finite number, not {value!r}")
    return number


def _whole(d: dict[str, Any], key: str, where: str, field: str, least: int, default: int | None = None) -> int:
    number = _number(d, key, where, field, None if default is None else float(default))
    if number != int(number) or number < least:
        raise ValueError(f"profile {where}: {field} must be a whole number of at least {least}, not {d.get(key)!r}")
    return int(number)


def step_costs_problem(costs: StepCosts) -> str | None:
    """Why ``costs`` cannot drive the sim (a step of no time divides by zero), or None.

    Every coefficient is a cost: 0 or more. A prefill step and a decode step must each take
    some time with no context cached (the sim's rates divide by them)."""
    names = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s", "per_prefill_seq_s",
             "per_prefill_step_s", "idle_wake_s")
    negative = [n for n in names if not getattr(costs, n) >= 0]
    if negative:
        return f"step costs cannot be negative: {', '.join(f'{n} {getattr(costs, n)}' for n in negative)}"
    problems = []
    if not costs.step_time(1, 0, 0, 1) > 0:
        problems.append("a prefill step takes no time (base_s, per_prefill_token_s, per_prefill_seq_s and "
                        "per_prefill_step_s are all 0)")
    if not costs.step_time(0, 1, 0) > 0:
        problems.append("a decode step takes no time (base_s and per_decode_seq_s are both 0)")
    return "; ".join(problems) or None


def profile_from_dict(data: dict[str, Any], where: str = "<dict>") -> SimProfile:
    """A checked profile: ``ValueError`` naming ``where`` and the field for anything the sim
    cannot run with (a bad number, a zero block size, a step model that takes no time)."""
    if not isinstance(data, dict):
        raise ValueError(f"profile {where}: expected a JSON object, not {type(data).__name__}")
    step = _section(data, "step", where)
    mem = _section(data, "memory", where)
    defaults = _section(data, "engine_defaults", where)
    intended = _section(data, "intended", where, required=False)
    raw_points = intended.get("points", [])
    if not isinstance(raw_points, list) or not all(isinstance(p, dict) for p in raw_points):
        raise ValueError(f"profile {where}: intended.points must be a list of mappings")
    points = tuple(
        IntendedPoint(
            batch=_whole(p, "batch", where, f"intended.points[{i}].batch", 1),
            output_tokens_per_s=_number(p, "output_tokens_per_s", where, f"intended.points[{i}].output_tokens_per_s"),
            tpot_ms=_number(p, "tpot_ms", where, f"intended.points[{i}].tpot_ms"),
        )
        for i, p in enumerate(raw_points)
    )

    def cost(key: str, optional: bool = False) -> float:
        return _number(step, key, where, f"step.{key}", 0.0 if optional else None)

    costs = StepCosts(
        base_s=cost("base_s"),
        per_prefill_token_s=cost("per_prefill_token_s"),
        per_decode_seq_s=cost("per_decode_seq_s"),
        per_kv_token_s=cost("per_kv_token_s"),
        per_prefill_seq_s=cost("per_prefill_seq_s", optional=True),
        per_prefill_step_s=cost("per_prefill_step_s", optional=True),
        idle_wake_s=cost("idle_wake_s", optional=True),
    )
    problem = step_costs_problem(costs)
    if problem:
        raise ValueError(f"profile {where}: {problem}")
    return SimProfile(
        name=str(_get(data, "name", where)),
        model=str(_get(data, "model", where)),
        costs=costs,
        memory=MemoryBudget(
            hbm_bytes=_whole(mem, "hbm_bytes", where, "memory.hbm_bytes", 0),
            weights_bytes=_whole(mem, "weights_bytes", where, "memory.weights_bytes", 0),
            reserve_bytes=_whole(mem, "reserve_bytes", where, "memory.reserve_bytes", 0),
            kv_bytes_per_token=_whole(mem, "kv_bytes_per_token", where, "memory.kv_bytes_per_token", 1),
        ),
        block_size=_whole(defaults, "block_size", where, "engine_defaults.block_size", 1),
        max_num_seqs=_whole(defaults, "max_num_seqs", where, "engine_defaults.max_num_seqs", 1),
        max_num_batched_tokens=_whole(defaults, "max_num_batched_tokens", where,
                                      "engine_defaults.max_num_batched_tokens", 1),
        max_model_len=_whole(defaults, "max_model_len", where, "engine_defaults.max_model_len", 1),
        intended=points,
        reference_input_len=_whole(intended, "input_len", where, "intended.input_len", 0, default=0),
        reference_output_len=_whole(intended, "output_len", where, "intended.output_len", 0, default=0),
        comment=str(data.get("comment", "")),
        accelerator=str(data.get("accelerator", "")),
    )


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(spec: str | Path | SimProfile = DEFAULT_PROFILE) -> SimProfile:
    """A profile by name (a file in ``profiles/``), by path to a JSON file, or as is."""
    if isinstance(spec, SimProfile):
        return spec
    path = Path(spec)
    if path.suffix != ".json" and not path.exists():
        path = PROFILES_DIR / f"{spec}.json"
    if not path.is_file():
        raise ValueError(f"unknown sim profile {str(spec)!r}; known: {', '.join(available_profiles())}")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"profile {path} is not JSON: {exc}") from None
    return profile_from_dict(data, where=str(path))


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: SimProfile
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    seed: int = 0
    lora_adapters: tuple[str, ...] = ()
    rate_window_s: float = 5.0  # simulated seconds of steps the rates in stats cover
    lora: LoraConfig = field(default_factory=LoraConfig)  # runtime adapters (sim_lora)
    # Prefill/decode split: the KV of a token in bytes (what a transfer moves) and the link
    # a decode replica loads a prefill replica's KV over, with its per-transfer latency.
    kv_bytes_per_token: int = 0
    kv_transfer_bytes_per_s: float = DEFAULT_KV_TRANSFER_GB_PER_S * 1e9
    kv_transfer_latency_s: float = 0.001

    def kv_transfer_s(self, tokens: int) -> float:
        """Simulated seconds a decode replica spends loading ``tokens`` tokens of KV."""
        if tokens <= 0:
            return 0.0
        return self.kv_transfer_latency_s + tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s

    @classmethod
    def build(
        cls,
        profile: str | SimProfile = DEFAULT_PROFILE,
        *,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        hbm_bytes: int | None = None,
        weights_bytes: int | None = None,
        reserve_bytes: int | None = None,
        kv_bytes_per_token: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        lora_adapters: Iterable[str] = (),
        rate_window_s: float = 5.0,
        lora: LoraConfig | None = None,
        kv_transfer_gb_per_s: float = DEFAULT_KV_TRANSFER_GB_PER_S,
    ) -> SimConfig:
        """Profile defaults, overridden by whatever is given.

        The block count is ``num_kv_blocks`` if given, else the profile's memory budget
        with any of its four figures overridden. ``max_model_len`` defaults to the
        profile's, capped by what the KV cache holds; asking for more than the cache
        holds is an error, as in vLLM (one sequence must always fit, else a lone long
        sequence could never make progress).
        """
        prof = load_profile(profile)
        problem = step_costs_problem(prof.costs)  # a SimProfile given as is was not checked on loading
        if problem:
            raise ValueError(f"profile {prof.name}: {problem}")
        bs = block_size or prof.block_size
        if bs <= 0:
            raise ValueError(f"block_size must be positive, not {bs}")
        if num_kv_blocks is None:
            mem = prof.memory
            budget = MemoryBudget(
                hbm_bytes=mem.hbm_bytes if hbm_bytes is None else hbm_bytes,
                weights_bytes=mem.weights_bytes if weights_bytes is None else weights_bytes,
                reserve_bytes=mem.reserve_bytes if reserve_bytes is None else reserve_bytes,
                kv_bytes_per_token=mem.kv_bytes_per_token
                if kv_bytes_per_token is None
                else kv_bytes_per_token,
            )
            num_kv_blocks = min(budget.num_blocks(bs), MAX_KV_BLOCKS)
        if num_kv_blocks <= 0 or bs <= 0:
            raise ValueError("block_size and the KV block count must be positive")
        if num_kv_blocks > MAX_KV_BLOCKS:
            raise ValueError(f"at most {MAX_KV_BLOCKS:,} KV blocks (the sim keeps an object per block), not {num_kv_blocks:,}")
        capacity = num_kv_blocks * bs
        if max_model_len is None:
            max_model_len = min(prof.max_model_len, capacity)
        elif max_model_len > capacity:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV cache ({num_kv_blocks} blocks of {bs} "
                f"= {capacity} tokens)"
            )
        if not 0 < kv_transfer_gb_per_s < math.inf:
            raise ValueError(f"kv_transfer_gb_per_s must be positive, not {kv_transfer_gb_per_s}")
        seqs = max_num_seqs or prof.max_num_seqs
        batched = max_num_batched_tokens or prof.max_num_batched_tokens
        if seqs <= 0 or batched <= 0 or max_model_len <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
        return cls(
            profile=prof,
            num_blocks=num_kv_blocks,
            block_size=bs,
            max_num_seqs=seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            lora_adapters=tuple(lora_adapters),
            rate_window_s=rate_window_s,
            lora=lora or LoraConfig(),
            kv_bytes_per_token=prof.memory.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token,
            kv_transfer_bytes_per_s=kv_transfer_gb_per_s * 1e9,
        )
