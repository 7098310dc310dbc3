"""The sizing arithmetic of ``meshserve plan`` (DESIGN.md, Sizing): pure functions only.

Units. Bytes are exact integers; the human-facing unit is the decimal gigabyte
(GB = 10^9 bytes), the unit GPU data sheets and ``--weights-gb``/``--reserve-gb`` use.
The hand-worked checks fix the convention: 32 layers x 8 KV heads x 128 x bf16 is
131 072 bytes/token; (80 − 16 − 4)·10^9 / (131 072 · 2048) = 223.5 → 223 sequences,
whereas binary GiB would give exactly 240. Likewise the 48-layer case gives 57 (GiB: 61).

Model of a replica (one engine over ``tensor_parallel`` GPUs):

- KV bytes per token = 2 (K and V) · layers · kv_heads · head_dim · bytes_per_element.
- Concurrent sequences = floor((tp·HBM − weights − tp·reserve) / (KV bytes per token ·
  mean context)). Tensor parallelism splits the weights and pools the HBM; the reserve
  (activations, CUDA graphs, allocator slack) is per GPU.
- Fleet = max(throughput bound ⌈λ / (ρ·μ)⌉, memory bound ⌈λ·W / concurrent⌉). The
  memory bound is Little's law: λ·W sequences hold KV on average, where W is the time a
  request holds KV (its time in the engine, not its wait before admission).

When μ or W is not given it is estimated from the GPU's data sheet, a roofline estimate
and labelled as such in the report:

- Decode is memory-bandwidth bound: each step reads the (active) weights once plus the
  KV of every sequence in the batch, so step time = (weights + B · context · KV bytes
  per token) / (tp · bandwidth · efficiency), and each sequence gets one token per step
  (tokens/s per sequence = 1 / step time). B is the full batch (concurrent sequences,
  capped by ``max_num_seqs``): a saturated replica, which is what μ means.
- Prefill is compute bound: 2 · active parameters FLOPs per prompt token at
  ``prefill_mfu`` of the dense bf16 peak (attention's quadratic term is ignored).
- W = prefill time + output tokens · step time; μ = 1 / (prefill time + output tokens ·
  step time / B): prefill runs one request at a time, decode is shared by B sequences.

Queueing: the curve reports two waiting times against utilisation ρ. M/M/1 per replica
(Wq = ρ / (μ(1−ρ)), the 1/(1−ρ) growth of DESIGN.md) is the pessimistic case of random
placement; M/M/c Erlang C over the whole fleet (c = replicas, one shared queue) is the
optimistic case of a perfect router. Token-aware power-of-d routing lies in between.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ops.plan.presets import GB, MODEL_PRESETS, GpuSpec

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "float8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}

_EPS = 1e-9


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def _ceil(x: float) -> int:
    # λ/(ρ·μ) = 35/(0.7·12.5) must be 4, not 5 because 0.7·12.5 rounds below 8.75.
    return math.ceil(x - _EPS * max(1.0, abs(x)))


# --------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """The parts of a transformer's shape that decide its memory and bandwidth needs."""

    name: str
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    dtype: str = "bfloat16"
    attention_bias: bool = False
    experts: int = 1  # routed MLP experts per layer (1: dense)
    experts_per_token: int = 1
    expert_intermediate_size: int = 0  # 0: same as intermediate_size
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """Read a Hugging Face ``config.json`` (already parsed)."""
        if "kv_lora_rank" in config:
            # MLA (DeepSeek-V2/V3) caches a compressed latent, not K and V per head.
            raise ValueError("multi-head latent attention (kv_lora_rank) is not modelled by the planner")
        if not isinstance(config, dict):
            raise ValueError(f"a model config is a JSON object, not {type(config).__name__}")
        text = config.get("text_config")
        if isinstance(text, dict) and "num_hidden_layers" not in config:
            config = {**config, **text}  # multimodal wrappers nest the language model's shape
        try:
            layers = int(config["num_hidden_layers"])
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
        except KeyError as exc:
            raise ValueError(f"config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as exc:  # "x", null, 1e400
            raise ValueError(f"config: {exc}") from None
        if min(layers, hidden, heads) < 1:
            raise ValueError("config: num_hidden_layers, hidden_size and num_attention_heads must be 1 or more")
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 1)
        return cls(
            name=name,
            layers=layers,
            hidden_size=hidden,
            attention_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config.get("vocab_size") or 0),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 1) if experts > 1 else 1,
            expert_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        )

    def _param_count(self, experts_counted: int) -> int:
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.attention_heads * hd, self.kv_heads * hd
        attention = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        # Gated MLP (gate, up, down), the shape of every model the presets name.
        if self.experts > 1:
            inter = self.expert_intermediate_size or self.intermediate_size
            mlp = experts_counted * 3 * h * inter + h * self.experts  # + router
            mlp += 3 * h * self.shared_expert_intermediate_size
        else:
            mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h  # two RMSNorm weight vectors
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + h  # + final norm

    @property
    def parameters(self) -> int:
        """All parameters: what must sit in HBM."""
        return self._param_count(self.experts)

    @property
    def active_parameters(self) -> int:
        """Parameters one token touches: what a decode step reads and prefill computes."""
        return self._param_count(self.experts_per_token)


def load_model(spec: str) -> ModelShape:
    """A preset name, a ``config.json`` path, or a directory holding one."""
    if not isinstance(spec, str):
        raise ValueError(f"a model is a preset name or a config.json path, not {type(spec).__name__}")
    key = spec.strip().lower()
    if key in MODEL_PRESETS:
        return ModelShape.from_config(MODEL_PRESETS[key], name=key)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return ModelShape.from_config(config, name=name)
    raise KeyError(f"unknown model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}) nor a config.json")


# --------------------------------------------------------------------------- the formulas


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: float) -> int:
    """K and V for every layer and KV head: 2 · layers · kv_heads · head_dim · bytes."""
    return round(2 * layers * kv_heads * head_dim * bytes_per_element)


def concurrent_sequences(
    hbm_bytes: int, weights_bytes: int, reserve_bytes: int, kv_per_token: int, context_tokens: int
) -> int:
    """How many sequences of ``context_tokens`` fit in the KV space left (floor, ≥ 0)."""
    free = hbm_bytes - weights_bytes - reserve_bytes
    if free <= 0:
        return 0
    return int(free // (kv_per_token * context_tokens))


def throughput_bound(rate: float, utilization: float, service_rate: float) -> int:
    """Replicas so that each runs at ``utilization``: ⌈λ / (ρ·μ)⌉."""
    return _ceil(rate / (utilization * service_rate))


def memory_bound(rate: float, time_in_system: float, concurrent: int) -> int:
    """Replicas to hold λ·W sequences (Little's law) in KV: ⌈λ·W / concurrent⌉."""
    if concurrent <= 0:
        raise ValueError(
            "a replica holds no sequence of this context: more HBM, tensor parallelism or fp8 KV"
        )
    return _ceil(rate * time_in_system / concurrent)


Bound = Literal["throughput", "memory"]


@dataclass(frozen=True)
class FleetSize:
    replicas: int
    throughput_bound: int
    memory_bound: int
    binding: Bound  # memory when the bounds tie: KV exhaustion preempts, worse than queueing


def fleet_size(
    rate: float, time_in_system: float, service_rate: float, utilization: float, concurrent: int
) -> FleetSize:
    t = throughput_bound(rate, utilization, service_rate)
    m = memory_bound(rate, time_in_system, concurrent)
    return FleetSize(
        replicas=max(t, m, 1),
        throughput_bound=t,
        memory_bound=m,
        binding="memory" if m >= t else "throughput",
    )


# --------------------------------------------------------------------------- queueing


def mm1_wait(rho: float, service_rate: float) -> float:
    """Mean wait in queue of an M/M/1 server at utilisation ρ: ρ / (μ(1−ρ))."""
    if rho >= 1:
        return math.inf
    return rho / (service_rate * (1 - rho))


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability an arrival waits in M/M/c with offered load a = λ/μ (Erlang C)."""
    if offered_load >= servers:
        return 1.0
    # Erlang B by its recurrence (stable for any c), then C from B.
    b = 1.0
    for k in range(1, servers + 1):
        b = offered_load * b / (k + offered_load * b)
    return servers * b / (servers - offered_load * (1 - b))


def mmc_wait(servers: int, rho: float, service_rate: float) -> float:
    """Mean wait in queue of M/M/c at per-server utilisation ρ: C(c, cρ) / (cμ − λ)."""
    if rho >= 1:
        return math.inf
    load = servers * rho
    return erlang_c(servers, load) / (servers * service_rate * (1 - rho))


@dataclass(frozen=True)
class CurvePoint:
    utilization: float
    growth: float  # 1 / (1 − ρ)
    wait_mm1_s: float
    wait_mmc_s: float


DEFAULT_CURVE_POINTS: tuple[float, ...] = (
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.75,
    0.8,
    0.85,
    0.9,
    0.95,
    0.98,
)


def queueing_curve(
    service_rate: float, servers: int, utilizations: tuple[float, ...] = DEFAULT_CURVE_POINTS
) -> list[CurvePoint]:
    return [
        CurvePoint(rho, 1 / (1 - rho), mm1_wait(rho, service_rate), mmc_wait(servers, rho, service_rate))
        for rho in sorted(set(utilizations))
    ]


# --------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class ServiceEstimate:
    """The data-sheet estimate of a saturated replica (see the module docstring)."""

    batch: int
    step_time_s: float
    tokens_per_s_per_sequence: float
    decode_tokens_per_s: float
    prefill_time_s: float
    time_in_system_s: float
    service_rate: float  # requests/s


def estimate_service(
    *,
    active_weights_bytes: int,
    active_parameters: int,
    kv_per_token: int,
    batch: int,
    context_tokens: int,
    prompt_tokens: int,
    output_tokens: int,
    gpu: GpuSpec,
    tensor_parallel: int = 1,
    bandwidth_efficiency: float = 0.8,
    prefill_mfu: float = 0.5,
) -> ServiceEstimate:
    batch = max(1, batch)
    read_per_step = active_weights_bytes + batch * context_tokens * kv_per_token
    step = read_per_step / (tensor_parallel * gpu.bandwidth_bytes_per_s * bandwidth_efficiency)
    flops = tensor_parallel * gpu.bf16_tflops * 1e12 * prefill_mfu
    prefill = prompt_tokens * 2 * active_parameters / flops
    return ServiceEstimate(
        batch=batch,
        step_time_s=step,
        tokens_per_s_per_sequence=1 / step,
        decode_tokens_per_s=batch / step,
        prefill_time_s=prefill,
        time_in_system_s=prefill + output_tokens * step,
        service_rate=1 / (prefill + output_tokens * step / batch),
    )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    gpu: GpuSpec
    tensor_parallel: int = 1
    kv_dtype: str = "auto"  # auto: the model's dtype
    weights_dtype: str | None = None  # None: the model's dtype
    weights_bytes: int | None = None  # measured size overrides the estimate
    hbm_bytes: int | None = None  # per GPU; None: the preset's
    reserve_bytes: int | None = None  # per GPU; None: 10 % of HBM (vLLM's 0.9 utilisation)
    prompt_tokens: int = 1024
    output_tokens: int = 256
    context_tokens: int | None = None  # None: prompt + output (a sequence at its largest)
    rate: float | None = None  # λ, requests/s; None: size one replica only
    time_in_system: float | None = None  # W, s; None: estimated
    service_rate: float | None = None  # μ, requests/s per replica; None: estimated
    utilization: float = 0.7
    max_num_seqs: int | None = None
    bandwidth_efficiency: float = 0.8
    prefill_mfu: float = 0.5
    gpu_price_per_hour: float | None = None  # what one GPU-hour costs; None: no cost figures

    def __post_init__(self) -> None:
        if self.gpu_price_per_hour is not None and not (math.isfinite(self.gpu_price_per_hour)
                                                        and self.gpu_price_per_hour >= 0):
            raise ValueError("a GPU price must be a finite number ≥ 0")
        if not 0 < self.utilization < 1:
            raise ValueError("target utilisation must be in (0, 1)")
        if self.tensor_parallel < 1:
            raise ValueError("tensor parallelism must be ≥ 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")


@dataclass(frozen=True)
class PlanCost:
    """What the plan's fleet costs at ``PlanInputs.gpu_price_per_hour``. Per million tokens
    is at the planned rate: λ · (prompt + output) tokens a second, the fleet paid whether
    busy or not (``meshserve usage --fleet`` measures the same figures on a running mesh)."""

    replica_per_hour: float
    fleet_per_hour: float | None  # None: no rate, no fleet
    per_million_tokens: float | None
    per_million_output_tokens: float | None


def plan_cost(price: float, tensor_parallel: int, fleet_gpus: int | None, rate: float | None,
              prompt_tokens: int, output_tokens: int) -> PlanCost:
    replica = price * tensor_parallel
    if fleet_gpus is None or rate is None:
        return PlanCost(replica, None, None, None)
    fleet = price * fleet_gpus
    per_hour_tokens = rate * 3600
    return PlanCost(replica, fleet, fleet / (per_hour_tokens * (prompt_tokens + output_tokens)) * 1e6,
                    fleet / (per_hour_tokens * output_tokens) * 1e6)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    parameters: int
    active_parameters: int
    weights_bytes: int
    weights_estimated: bool
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    hbm_bytes: int  # the replica's, summed over its GPUs
    reserve_bytes: int  # the replica's
    kv_space_bytes: int
    context_tokens: int
    concurrent_per_replica: int
    batch: int  # concurrent capped by max_num_seqs
    estimate: ServiceEstimate | None
    service_rate: float | None
    service_rate_estimated: bool
    time_in_system: float | None
    time_in_system_estimated: bool
    fleet: FleetSize | None
    fleet_gpus: int | None
    fleet_utilization: float | None  # λ / (replicas · μ)
    wait_mm1_s: float | None  # at the fleet's utilisation
    wait_mmc_s: float | None
    curve: list[CurvePoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost: PlanCost | None = None  # with a GPU price

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        out = asdict(self)  # recursive: inputs, model, gpu, estimate, fleet, curve
        return finite(out)  # type: ignore[no-any-return]


def finite(v: Any) -> Any:
    """``v`` with every non-finite float as None, through dicts and lists: JSON has no Infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite(x) for x in v]
    return v


def make_plan(p: PlanInputs) -> Plan:
    m, gpu, tp = p.model, p.gpu, p.tensor_parallel
    notes: list[str] = []
    w_dtype = p.weights_dtype or m.dtype
    weights_estimated = p.weights_bytes is None
    weights = p.weights_bytes if p.weights_bytes is not None else int(m.parameters * dtype_bytes(w_dtype))
    # A decode step reads only the experts a token is routed to; for dense models that is all.
    active_weights = int(weights * m.active_parameters / m.parameters)
    kv_dtype = m.dtype if p.kv_dtype == "auto" else p.kv_dtype
    kv_tok = kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, dtype_bytes(kv_dtype))
    context = p.context_tokens or (p.prompt_tokens + p.output_tokens)
    hbm_gpu = p.hbm_bytes if p.hbm_bytes is not None else gpu.hbm_bytes
    reserve_gpu = p.reserve_bytes if p.reserve_bytes is not None else hbm_gpu // 10
    hbm, reserve = tp * hbm_gpu, tp * reserve_gpu
    concurrent = concurrent_sequences(hbm, weights, reserve, kv_tok, context)
    if concurrent == 0:
        need = weights + kv_tok * context
        # Engines shard attention heads across GPUs, so TP must divide the head count.
        min_tp = next(
            (
                k
                for k in range(tp + 1, 65)
                if m.attention_heads % k == 0 and k * (hbm_gpu - reserve_gpu) >= need
            ),
            None,
        )
        notes.append(
            "one sequence does not fit: weights + reserve + one context exceed HBM"
            + (f"; tensor parallelism {min_tp} would fit" if min_tp else "")
        )
    batch = min(concurrent, p.max_num_seqs) if p.max_num_seqs else concurrent

    estimate = None
    if batch > 0 and (p.service_rate is None or p.time_in_system is None):
        estimate = estimate_service(
            active_weights_bytes=active_weights,
            active_parameters=m.active_parameters,
            kv_per_token=kv_tok,
            batch=batch,
            context_tokens=context,
            prompt_tokens=p.prompt_tokens,
            output_tokens=p.output_tokens,
            gpu=gpu,
            tensor_parallel=tp,
            bandwidth_efficiency=p.bandwidth_efficiency,
            prefill_mfu=p.prefill_mfu,
        )
    mu = p.service_rate if p.service_rate is not None else (estimate.service_rate if estimate else None)
    w = (
        p.time_in_system
        if p.time_in_system is not None
        else (estimate.time_in_system_s if estimate else None)
    )
    if estimate is not None:
        notes.append(
            "estimated from the GPU data sheet (decode bandwidth-bound, prefill compute-bound, "
            f"{p.bandwidth_efficiency:.0%} of peak bandwidth, {p.prefill_mfu:.0%} MFU): "
            + " and ".join(
                n for n, given in (("μ", p.service_rate), ("W", p.time_in_system)) if given is None
            )
        )
    if p.max_num_seqs and p.max_num_seqs < concurrent:
        notes.append(
            f"max_num_seqs={p.max_num_seqs} caps the batch below the {concurrent} sequences KV allows"
        )

    fleet = fleet_gpus = fleet_util = wait1 = waitc = None
    servers = 1
    if p.rate is not None and mu is not None and w is not None and batch > 0:
        # The scheduler's cap limits how many sequences hold KV as surely as HBM does.
        fleet = fleet_size(p.rate, w, mu, p.utilization, batch)
        servers = fleet.replicas
        fleet_gpus = fleet.replicas * tp
        fleet_util = p.rate / (fleet.replicas * mu)
        wait1, waitc = mm1_wait(fleet_util, mu), mmc_wait(fleet.replicas, fleet_util, mu)
        if fleet.binding == "memory":
            notes.append(
                "memory binds: replicas run below the target utilisation; more KV per replica "
                "(fp8 KV, shorter contexts, tensor parallelism, a larger GPU) would need fewer"
            )
    curve = queueing_curve(mu, servers, (*DEFAULT_CURVE_POINTS, p.utilization)) if mu else []
    return Plan(
        inputs=p,
        parameters=m.parameters,
        active_parameters=m.active_parameters,
        weights_bytes=weights,
        weights_estimated=weights_estimated,
        kv_bytes_per_token=kv_tok,
        kv_bytes_per_sequence=kv_tok * context,
        hbm_bytes=hbm,
        reserve_bytes=reserve,
        kv_space_bytes=max(0, hbm - weights - reserve),
        context_tokens=context,
        concurrent_per_replica=concurrent,
        batch=batch,
        estimate=estimate,
        service_rate=mu,
        service_rate_estimated=p.service_rate is None and mu is not None,
        time_in_system=w,
        time_in_system_estimated=p.time_in_system is None and w is not None,
        fleet=fleet,
        fleet_gpus=fleet_gpus,
        fleet_utilization=fleet_util,
        wait_mm1_s=wait1,
        wait_mmc_s=waitc,
        curve=curve,
        notes=notes,
        cost=None if p.gpu_price_per_hour is None else plan_cost(
            p.gpu_price_per_hour, tp, fleet_gpus, p.rate, p.prompt_tokens, p.output_tokens),
    )


def gb(n_bytes: float) -> float:
    return n_bytes / GB
