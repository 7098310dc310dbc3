"""What workers say about themselves on the mesh: the registry entry each keeps alive
(``WorkerInfo``, with its model's sampling defaults), the periodic load report
(``WorkerGauge``), and the KV cache events and snapshots routers and admission index
prefixes by. Versioned like every message (``proto.messages``)."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from .messages import SCHEMA_VERSION, WorkerState


class SamplingDefaults(Struct, kw_only=True, omit_defaults=True):
    """A model's own sampling defaults (its ``generation_config.json``, as vLLM's
    ``--generation-config auto`` reads them): what a request that omits a field gets.
    None: the model sets none (the OpenAI/vLLM default holds). ``max_tokens`` is the
    file's ``max_new_tokens``."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    # vLLM's ``override_max_tokens``: with ``--generation-config DIR`` the file's
    # ``max_new_tokens`` also caps every request's max_tokens (silently, as vLLM does).
    max_tokens_override: int | None = None


WorkerRole = Literal["both", "prefill"]
WORKER_ROLES: tuple[WorkerRole, ...] = ("both", "prefill")


class WorkerInfo(Struct, kw_only=True, omit_defaults=True):
    """The registry entry a worker keeps alive in the ``mesh_workers`` KV bucket."""

    v: int = SCHEMA_VERSION
    worker_id: str
    model: str
    engine: str
    state: WorkerState = "starting"
    block_size: int = 16
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    kv_blocks_total: int = 0
    lora_adapters: list[str] = []  # loaded at start (always resident)
    # Runtime adapters: GPU slots (0: only ``lora_adapters``), the largest rank a slot
    # takes, and the bandwidths a load reads at from storage and from host memory (GB/s).
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_load_gb_per_s: float = 0.0
    lora_host_gb_per_s: float = 0.0
    # Hot-swap (DESIGN.md, Many models per GPU): this entry is one of the models a host
    # process may hold, sharing ``host_memory_gib`` with its other entries; ``footprint_gib``
    # is what this model takes there while resident, ``load_s`` the seconds a load takes.
    # "" host_id: a dedicated worker, always resident.
    accelerator: str = ""  # what it runs on (CapacityEvent.accelerator) and how many
    accelerators: int = 0
    # Prefill/decode split (DESIGN.md, Prefill and decode apart): "prefill" computes prompts
    # for the pool's other workers and takes no request of its own; "both" takes requests,
    # and has a long prompt prefilled on a prefill worker when the pool has one.
    role: WorkerRole = "both"
    # Its engine prefills for other workers and loads their KV (the sim; vLLM with a KV
    # connector): a request is split only between workers that both can.
    disaggregation: bool = False
    # The region it runs in (DESIGN.md, Regions; "": a single-region mesh): requests are
    # placed in their own region while it has room, never outside a key's regions.
    region: str = ""
    host_id: str = ""
    host_memory_gib: float = 0.0
    footprint_gib: float = 0.0
    load_s: float = 0.0
    tokenizer: str = ""  # tokenizer name or directory the gateway loads
    # Output parsers the gateway applies to this model's text (configured per worker):
    # tool calls (hermes, llama3_json, mistral) and reasoning (think); "" = none.
    tool_parser: str = ""
    reasoning_parser: str = ""
    # The model's generation-config sampling defaults the gateway applies to fields a
    # request omits (None: none, e.g. a sim worker or ``--generation-config vllm``).
    sampling_defaults: SamplingDefaults | None = None
    model_dir: str = ""
    # SHA-256 of this worker's tokenizer files in the ``<root>_tokenizers`` object store
    # (``bus.tokenizers``): hosts that cannot read ``model_dir`` fetch them by it.
    tokenizer_digest: str = ""
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    version: str = ""


class WorkerGauge(Struct, kw_only=True, omit_defaults=True):
    """Periodic load report of one worker (DESIGN.md, Workers and engines)."""

    v: int = SCHEMA_VERSION
    worker_id: str
    model: str
    ts: float
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    running_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    draining: bool = False
    lora_adapters: list[str] = []  # resident: usable without a load (static, or in a GPU slot)
    lora_cached: list[str] = []  # in host memory only: a fast load (engines that load at run time)
    # Hot-swap entries: "resident", "evicting" (resident, but its host waits to evict it
    # once its requests end, to load another), "loading" (``load_remaining_s`` to go) or
    # "cold" (a request waits ``WorkerInfo.load_s`` and may evict another model); "" on a
    # dedicated worker. ``idle_s``: since its last request ended (the host evicts least recently used).
    residency: str = ""
    load_remaining_s: float = 0.0
    idle_s: float = 0.0
    kv_event_seq: int = -1  # last KV event batch sequence published (gap detection)
    kv_events_mode: str = "engine"  # "engine" or "predicted" when the engine emits none
    preemptions: int = 0
    prefill_tokens_total: int = 0  # prompt tokens computed since start (cumulative; a restart resets it)
    # Ids of the requests the engine took in during the last few seconds: a router or
    # admission counting a placement optimistically drops it once a gauge names it (the
    # gauge's queue then holds it). None: a worker that does not report them (the
    # consumer falls back to timing: a gauge received a little after the placement).
    arrived: list[str] | None = None


class BlockStored(Struct, kw_only=True, tag="stored", omit_defaults=True):
    block_hashes: list[int]
    parent_hash: int | None = None
    block_size: int = 16
    lora: str | None = None


class BlockRemoved(Struct, kw_only=True, tag="removed"):
    block_hashes: list[int]


class AllCleared(Struct, kw_only=True, tag="cleared"):
    pass


KvEvent = BlockStored | BlockRemoved | AllCleared


class KvEventBatch(Struct, kw_only=True, omit_defaults=True):
    """Sequenced KV cache events of one worker; a gap in ``seq`` means resync."""

    v: int = SCHEMA_VERSION
    worker_id: str
    model: str
    seq: int
    ts: float
    events: list[KvEvent] = []


class KvSnapshotRequest(Struct, kw_only=True):
    v: int = SCHEMA_VERSION
    worker_id: str


class KvSnapshot(Struct, kw_only=True, omit_defaults=True):
    """Every block hash a worker holds, as of event batch ``seq``."""

    v: int = SCHEMA_VERSION
    worker_id: str
    model: str
    seq: int
    block_size: int
    block_hashes: list[int] = []
