"""Many models on finite GPUs: the decision tree of ``meshserve plan --models FILE``
(issue 21, DESIGN.md, Sizing). Pure functions over the single-model planner (``make_plan``).

Each model of the file gets one of three strategies, and the arithmetic behind it:

1. **multiplex** — an adapter (``base:`` set) is served by its base model's pool as a LoRA
   adapter: it costs a few MB of HBM per replica and a load of ``adapter size / load
   bandwidth``, and its traffic is added to its base's.
2. **static** — a model whose traffic (its adapters' included) keeps at least
   ``static_load`` of a replica busy at the target utilisation ρ (``λ / (ρ·μ)``) gets a
   pool of its own, sized by the single-model planner (throughput and KV bounds): loading
   and evicting it would only add cold starts to a GPU it fills anyway. So does a model
   that spans several GPUs (``tp > 1``), and one whose cold start breaks its TTFT SLO
   for more than ``max_cold_share`` of its requests (pinned: at least one replica).
3. **time-share** — the rest share one pool with hot-swap: HBM is a cache of models, a
   model idle for ``keep_s`` is evicted (scale to zero) and loaded again on demand.
   With Poisson arrivals at λ, a request finds its model evicted when the gap since the
   previous one exceeds ``keep_s``: probability ``e^(−λ·keep)``, so ``3600·λ·e^(−λ·keep)``
   cold starts an hour, each ``weights / load bandwidth`` seconds. The pool needs
   ``max(⌈Σ λᵢ/(ρ·μᵢ)⌉, ⌈Σ P(resident)ᵢ·weightsᵢ / model memory per GPU⌉)`` GPUs, where
   ``P(resident) = 1 − e^(−λ·keep)`` and a GPU keeps ``kv_fraction`` of its usable HBM for
   KV.

The plan's GPU count is set against one static pool per model (each adapter served as a
merged fine-tune with a pool of its own), the fleet most teams start with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ops.plan.model import PlanInputs, load_model, make_plan
from ops.plan.presets import GB, GpuSpec
from services.worker.engines.hosted import LOAD_PRESETS

Strategy = Literal["multiplex", "static", "time-share"]

# Where a hot-swapped model's weights come from (GB/s, decimal): the bandwidths a worker's
# --load-from names, so a plan's load times are what its hosts then run with.
LOAD_SOURCES: dict[str, float] = dict(LOAD_PRESETS)

_ENTRY_KEYS = {"name", "model", "weights_gb", "base", "adapter_mb", "rate", "prompt_tokens", "output_tokens", "tp",
               "ttft_slo_s"}


@dataclass(frozen=True)
class ModelEntry:
    """One line of the models file."""

    name: str
    model: str | None = None  # a preset or config.json: the shape (None for an adapter)
    weights_gb: float | None = None  # measured weights, overrides the shape's estimate
    base: str | None = None  # an adapter of this model (another entry's name)
    adapter_mb: float = 0.0
    rate: float = 0.0  # expected requests/s
    prompt_tokens: int = 1024
    output_tokens: int = 256
    tp: int = 1
    ttft_slo_s: float | None = None

    @property
    def is_adapter(self) -> bool:
        return self.base is not None


@dataclass(frozen=True)
class FleetPolicy:
    gpu: GpuSpec
    utilization: float = 0.7
    load_gb_per_s: float = LOAD_SOURCES["nvme"]
    keep_s: float = 600.0  # a time-shared model idle this long is evicted
    static_load: float = 0.5  # replicas of traffic (at ρ) from which a model gets its own pool
    kv_fraction: float = 0.3  # of a time-share GPU's usable HBM kept for KV
    max_cold_share: float = 0.01  # of a model's requests that may meet a cold start past its SLO
    # The engines and GPUs every model runs with (the single-model planner's settings).
    kv_dtype: str = "auto"
    weights_dtype: str | None = None
    reserve_bytes: int | None = None  # per GPU; None: 10 % of HBM
    max_num_seqs: int | None = None
    bandwidth_efficiency: float = 0.8
    prefill_mfu: float = 0.5
    gpu_price_per_hour: float | None = None  # what one GPU-hour costs; None: no cost figures

    @property
    def usable_hbm_bytes(self) -> int:
        """Per GPU, what weights and KV may use: HBM less the runtime's reserve."""
        reserve = self.reserve_bytes if self.reserve_bytes is not None else self.gpu.hbm_bytes // 10
        return self.gpu.hbm_bytes - reserve

    def __post_init__(self) -> None:
        if not 0 < self.utilization < 1:
            raise ValueError("utilization must be in (0, 1)")
        if self.load_gb_per_s <= 0 or self.keep_s <= 0:
            raise ValueError("the load bandwidth and keep time must be positive")
        if self.static_load <= 0 or not 0 <= self.kv_fraction < 1 or not 0 <= self.max_cold_share <= 1:
            raise ValueError("static_load must be positive, kv_fraction in [0, 1), max_cold_share in [0, 1]")


@dataclass(frozen=True)
class ModelDecision:
    name: str
    strategy: Strategy
    why: str
    rate: float  # its own requests/s
    pool_rate: float  # its pool's: its own plus its adapters' (an adapter: its base's)
    weights_bytes: int
    service_rate: float | None  # μ of one replica, requests/s
    load: float  # replicas its traffic keeps busy at ρ: λ / (ρ·μ)
    load_time_s: float  # weights (or adapter) / load bandwidth
    cold_share: float  # time-share: requests that find it evicted
    cold_starts_per_hour: float
    replicas: int  # static: its pool's replicas
    gpus: int  # static: replicas × tp
    baseline_gpus: int  # in one static pool per model


@dataclass
class FleetPlan:
    policy: FleetPolicy
    decisions: list[ModelDecision]
    static_gpus: int
    timeshare_gpus: int
    timeshare_throughput_gpus: int
    timeshare_memory_gpus: int
    plan_gpus: int
    baseline_gpus: int
    notes: list[str] = field(default_factory=list)

    def cost_per_hour(self, gpus: int) -> float | None:
        """``gpus`` at the policy's GPU price; None without one."""
        price = self.policy.gpu_price_per_hour
        return None if price is None else gpus * price

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["policy"]["gpu"] = self.policy.gpu.name
        out["plan_cost_per_hour"] = self.cost_per_hour(self.plan_gpus)
        out["baseline_cost_per_hour"] = self.cost_per_hour(self.baseline_gpus)
        return out


def _finite_number(value: object) -> bool:
    """YAML's ``true`` is an int to Python and ``.nan``/``.inf`` are floats: none is a rate.
    Nor is a number so large that it overflows a float, or one whose bytes do (1e300 GB)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value * GB)
    except OverflowError:  # an integer past float range
        return False


def parse_entries(raw: Any) -> list[ModelEntry]:
    """The models file, parsed (a list, or ``{"models": [...]}``), checked: one clear
    ``ValueError`` per problem found first."""
    if isinstance(raw, dict) and set(raw) == {"models"}:
        raw = raw["models"]
    if not isinstance(raw, list) or not raw:
        raise ValueError("the models file must hold a non-empty list of models (or {models: [...]})")
    entries: list[ModelEntry] = []
    for i, item in enumerate(raw):
        where = f"model {i + 1}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping with name, model or base, rate, ...")
        unknown = sorted(set(item) - _ENTRY_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_ENTRY_KEYS))}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: a name is required")
        where = f"model {name!r}"
        try:
            entry = ModelEntry(**item)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None
        for key in ("rate", "adapter_mb"):
            value = getattr(entry, key)
            if not _finite_number(value) or value < 0:
                raise ValueError(f"{where}: {key} must be a number ≥ 0, not {value!r}")
        for key in ("prompt_tokens", "output_tokens", "tp"):
            value = getattr(entry, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {key} must be an integer ≥ 1, not {value!r}")
        for key in ("weights_gb", "ttft_slo_s"):
            value = getattr(entry, key)
            if value is not None and (not _finite_number(value) or value <= 0):
                raise ValueError(f"{where}: {key} must be a positive number, not {value!r}")
        if entry.is_adapter:
            if entry.model is not None or entry.weights_gb is not None:
                raise ValueError(f"{where}: an adapter (base: set) has no model or weights_gb of its own; give adapter_mb")
        elif entry.model is None:
            raise ValueError(f"{where}: give the model's shape (model: a preset or a config.json), or base: for an adapter")
        entries.append(entry)
    names = [e.name for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"model names must be unique: {', '.join(dupes)}")
    by_name = {e.name: e for e in entries}
    for e in entries:
        if e.base is not None:
            base = by_name.get(e.base)
            if base is None:
                raise ValueError(f"adapter {e.name!r}: its base {e.base!r} is not in the file")
            if base.is_adapter:
                raise ValueError(f"adapter {e.name!r}: its base {e.base!r} is itself an adapter")
    return entries


def plan_fleet(entries: list[ModelEntry], policy: FleetPolicy) -> FleetPlan:
    by_name = {e.name: e for e in entries}
    adapters_of: dict[str, list[ModelEntry]] = {}
    for e in entries:
        if e.base is not None:
            adapters_of.setdefault(e.base, []).append(e)
    rho = policy.utilization
    bw = policy.load_gb_per_s * GB

    def replica_plan(e: ModelEntry, rate: float) -> tuple[int, float | None, int]:
        """(weights bytes, μ, replicas at ``rate``) of ``e``'s shape on the policy's GPU."""
        plan = make_plan(PlanInputs(
            model=load_model(e.model or ""), gpu=policy.gpu, tensor_parallel=e.tp,
            weights_bytes=round(e.weights_gb * GB) if e.weights_gb is not None else None,
            prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens, rate=rate if rate > 0 else None,
            utilization=rho, kv_dtype=policy.kv_dtype, weights_dtype=policy.weights_dtype,
            reserve_bytes=policy.reserve_bytes, max_num_seqs=policy.max_num_seqs,
            bandwidth_efficiency=policy.bandwidth_efficiency, prefill_mfu=policy.prefill_mfu,
        ))
        if plan.concurrent_per_replica == 0:
            raise ValueError(f"model {e.name!r} does not fit on {e.tp}× {policy.gpu.name}: {'; '.join(plan.notes)}")
        replicas = plan.fleet.replicas if plan.fleet is not None else 1
        return plan.weights_bytes, plan.service_rate, max(replicas, 1)

    decisions: list[ModelDecision] = []
    base_info: dict[str, tuple[int, float | None, float]] = {}  # name → weights, μ, pool rate
    notes: list[str] = []
    for e in entries:
        if e.is_adapter:
            continue
        pool_rate = e.rate + sum(a.rate for a in adapters_of.get(e.name, []))
        weights, mu, replicas = replica_plan(e, pool_rate)
        _, _, own_replicas = replica_plan(e, e.rate)
        base_info[e.name] = (weights, mu, pool_rate)
        load = pool_rate / (rho * mu) if mu else math.inf
        load_time = weights / bw
        cold_share = math.exp(-pool_rate * policy.keep_s)  # its adapters' requests keep it resident too
        cold_per_hour = 3600 * pool_rate * cold_share
        # Its adapters' requests meet its cold starts too: the tightest TTFT SLO of the pool.
        with_slo = [x for x in (e, *adapters_of.get(e.name, [])) if x.ttft_slo_s is not None]
        tightest = min(with_slo, key=lambda x: x.ttft_slo_s or 0.0) if with_slo else None
        strategy: Strategy
        if load >= policy.static_load:
            strategy = "static"
            why = (f"its traffic keeps {load:.2f} replicas busy at ρ {rho:.0%} (≥ {policy.static_load:g}): "
                   f"swapping it out would only add cold starts")
        elif e.tp > 1:
            strategy = "static"
            why = f"spans {e.tp} GPUs (tp {e.tp}): not swapped with single-GPU models"
        elif (tightest is not None and tightest.ttft_slo_s is not None and load_time > tightest.ttft_slo_s
              and cold_share > policy.max_cold_share):
            strategy = "static"
            whose = "its" if tightest is e else f"its adapter {tightest.name}'s"
            why = (f"pinned: a cold start ({load_time:.1f} s) breaks {whose} {tightest.ttft_slo_s:g} s TTFT SLO and "
                   f"{cold_share:.1%} of its requests would meet one (> {policy.max_cold_share:.0%})")
        else:
            strategy = "time-share"
            why = (f"{load:.2f} replicas of traffic: shares GPUs; {cold_share:.1%} of its requests find it "
                   f"evicted after {policy.keep_s:g} s idle and wait {load_time:.1f} s to load it")
        static = strategy == "static"
        decisions.append(ModelDecision(
            name=e.name, strategy=strategy, why=why, rate=e.rate, pool_rate=pool_rate, weights_bytes=weights,
            service_rate=mu, load=load, load_time_s=load_time,
            cold_share=0.0 if static else cold_share, cold_starts_per_hour=0.0 if static else cold_per_hour,
            replicas=replicas if static else 0, gpus=replicas * e.tp if static else 0,
            baseline_gpus=own_replicas * e.tp,
        ))
    for e in entries:
        if not e.is_adapter:
            continue
        assert e.base is not None
        base = by_name[e.base]
        weights, mu, pool_rate = base_info[e.base]
        # Served alone, as a merged fine-tune: a pool of the base's shape for its own traffic.
        _, _, own_replicas = replica_plan(base, e.rate)
        adapter_bytes = round(e.adapter_mb * 1e6)
        decisions.append(ModelDecision(
            name=e.name, strategy="multiplex",
            why=f"adapter of {e.base}: a LoRA slot in its pool ({e.adapter_mb:g} MB, loads in "
                f"{adapter_bytes / bw * 1000:.0f} ms); its traffic is sized with the base's",
            rate=e.rate, pool_rate=pool_rate, weights_bytes=adapter_bytes, service_rate=mu,
            load=e.rate / (rho * mu) if mu else math.inf, load_time_s=adapter_bytes / bw,
            cold_share=0.0, cold_starts_per_hour=0.0, replicas=0, gpus=0, baseline_gpus=own_replicas * base.tp,
        ))
    order = {e.name: i for i, e in enumerate(entries)}
    decisions.sort(key=lambda d: order[d.name])

    shared = [d for d in decisions if d.strategy == "time-share"]
    usable = policy.usable_hbm_bytes * (1 - policy.kv_fraction)
    thr = math.ceil(sum(d.load for d in shared) - 1e-9) if shared else 0
    resident = sum((1 - d.cold_share) * d.weights_bytes for d in shared)
    mem = math.ceil(resident / usable - 1e-9) if shared else 0
    timeshare = max(thr, mem, 1) if shared else 0
    too_big = [d.name for d in shared if d.weights_bytes > usable]
    if too_big:
        notes.append(f"{', '.join(too_big)}: weights exceed a time-share GPU's model memory "
                     f"({usable / GB:.0f} GB after the KV share): give them tp > 1 (a static pool)")
    static_gpus = sum(d.gpus for d in decisions if d.strategy == "static")
    return FleetPlan(
        policy=policy, decisions=decisions, static_gpus=static_gpus, timeshare_gpus=timeshare,
        timeshare_throughput_gpus=thr, timeshare_memory_gpus=mem, plan_gpus=static_gpus + timeshare,
        baseline_gpus=sum(d.baseline_gpus for d in decisions), notes=notes,
    )
