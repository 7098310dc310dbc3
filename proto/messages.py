"""The wire contract: every message meshserve sends over NATS.

Each top-level message carries ``v`` (its schema version). Decoders reject any version
this build does not speak with ``UnsupportedVersion`` rather than guessing. Messages are
msgpack on the wire (see ``proto.codec``). Token ids of prompts travel packed (4 bytes a
token, ``proto.hashing.pack_tokens``) so a 100k-token prompt is 400 kB, well under
meshserve's 8 MB ``max_payload``.

Times are Unix epoch seconds (float) unless a field says otherwise.
"""

from __future__ import annotations

from typing import Literal, TypedDict

import msgspec
from msgspec import Struct

SCHEMA_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]
# "migrated": the segment of a request whose worker died; the gateway bills what the client received.
UsageStatus = Literal["finished", "length", "stopped", "cancelled", "failed", "rejected", "migrated"]
WorkerState = Literal["starting", "ready", "draining", "stopped"]
Tier = str  # free-form: tiers are configuration (premium, standard, batch by default)

# The NATS max_payload meshserve's own servers run with (NATS's default is 1 MB): what the
# bounds on prompts and replies are sized for.
MESH_MAX_PAYLOAD = 8 * 1024 * 1024


class ErrorInfo(Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    retryable: bool = False
    retry_after: float | None = None


class ErrorReply(Struct, kw_only=True, omit_defaults=True):
    """The reply a request-reply endpoint sends instead of its normal answer.

    It travels with the NATS micro error headers (``Nats-Service-Error``,
    ``Nats-Service-Error-Code``) so callers know to decode it instead of the answer.
    """

    v: int = SCHEMA_VERSION
    error: ErrorInfo


class StructuredOutput(Struct, kw_only=True, omit_defaults=True):
    """Guided decoding: the engine may only emit text that is an instance of exactly one
    of these (vLLM's ``StructuredOutputsParams``). ``json`` is a JSON Schema, as JSON text."""

    json: str | None = None
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), as vLLM's xgrammar backend takes it


class SamplingParams(Struct, kw_only=True, omit_defaults=True):
    # 0: completions ``echo`` without generation (vLLM's ``max_tokens: 0``): the engine runs
    # one token (for the prompt's logprobs), which the worker bills but does not stream.
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # Log probabilities: None = none; k ≥ 0 = the sampled token's plus the k most likely.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    # Choices: the worker runs n sequences of this prompt (seeds seed, seed+1, ... as vLLM
    # does), the prompt prefilled once; their chunks carry ``TokenChunk.index``.
    n: int = 1


class GenerateRequest(Struct, kw_only=True, omit_defaults=True):
    """gateway → router → worker: one generation, already tokenized."""

    v: int = SCHEMA_VERSION
    request_id: str
    model: str
    prompt: bytes  # packed uint32 token ids (proto.hashing.pack_tokens)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    token_subject: str  # where chunks go; captured by the TOKENS stream
    gateway_id: str = ""
    org: str = ""
    # The client's (vLLM's ``cache_salt``): its prefixes are shared only with requests of
    # the same org and salt; every hasher salts with ``proto.hashing.cache_scope``.
    cache_salt: str = ""
    key_id: str = ""
    tier: str = "standard"
    priority: int = 0  # higher runs first within a worker's waiting queue
    arrival_time: float = 0.0
    deadline: float | None = None
    lora: str | None = None
    # A runtime adapter (the gateway's adapter registry): where a worker that does not
    # hold it loads it from, and its size (what the router prices a load with).
    lora_path: str = ""
    lora_size_bytes: int = 0
    session_key: str | None = None
    # Migration after a worker died: tokens the client already has, appended to the
    # prompt, and the sequence number the continuing stream starts from.
    prior_output: bytes = b""
    # With n > 1: each choice's tokens the client already has (``prior_output`` unused),
    # and the choices that had already finished (not generated again).
    prior_outputs: list[bytes] = []
    finished_choices: list[int] = []
    first_seq: int = 0
    migrations: int = 0
    reserved_tokens: int = 0  # what admission reserved, reconciled from the usage event
    user: str = ""  # OpenAI ``user``: carried to the usage record
    metadata: dict[str, str] = {}  # OpenAI ``metadata``: carried to the usage record
    # The placement's deadline (epoch seconds; 0: none), set by the gateway for each
    # placement: past it the router forwards nothing and no worker takes the request
    # (``timeout``), so a gateway that stopped waiting for its router may place it itself.
    place_by: float = 0.0
    # Hot-swap hosts (``WorkerInfo.host_id``): the models the router counts as the fleet's
    # busiest, which a host loading this request's model must not evict.
    pinned_models: list[str] = []
    # The placement try this copy belongs to (0: its placer names none), set with each
    # ``place_by``: a ``superseded`` cancel names it, so a worker refuses that try's copy
    # only, not a later try of the same segment (a migration waiting for a replica).
    attempt: int = 0
    # The client may resume it on another gateway (``X-Meshserve-Resumable``): a worker keeps
    # generating if its gateway dies; any other request stops then (services/worker/orphans.py).
    resumable: bool = False
    # Prefill/decode split: the prefill worker the router chose to compute this prompt's KV
    # ("": prefill here). The decode worker asks it (``PrefillRequest``), loads the KV it
    # answers with and decodes; it prefills itself when that fails, so the request never
    # depends on the prefill worker.
    prefill_worker: str = ""
    # Regions (DESIGN.md, Regions): the region the request entered by (its gateway's; ""
    # outside a multi-region mesh), where it is placed while that region has room, and
    # the regions its key allows it to run in (``ApiKeyRecord.regions``; empty: any), which
    # no placement, spill or migration leaves.
    region: str = ""
    regions: list[str] = []


def prefill_id(request_id: str) -> str:
    """The id a request's prefill runs under on a prefill worker (``PrefillRequest.request_id``):
    its gauges name it, and a router counts the prefill there under it until they do."""
    return f"{request_id}:prefill"


class PrefillRequest(Struct, kw_only=True, omit_defaults=True):
    """decode worker → prefill worker (``mesh.worker.<wid>.prefill``): compute the KV of
    ``prompt`` and hold it for the decode worker to load; answered with ``PrefillResult``
    once the prefill is done."""

    v: int = SCHEMA_VERSION
    request_id: str
    model: str
    prompt: bytes  # packed uint32 token ids
    decode_worker: str
    org: str = ""
    cache_salt: str = ""  # GenerateRequest's: the KV is the scope's (proto.hashing.cache_scope)
    lora: str | None = None
    lora_path: str = ""
    lora_size_bytes: int = 0
    priority: int = 0
    # Past this (epoch seconds) the decode worker has stopped waiting: not started, or aborted.
    deadline: float = 0.0


class PrefillResult(Struct, kw_only=True, omit_defaults=True):
    """prefill worker → decode worker: the prompt's KV is ready to load."""

    v: int = SCHEMA_VERSION
    request_id: str
    worker_id: str
    # The engine's own description of where the KV is (vLLM: its KV connector's
    # ``kv_transfer_params``; the sim: the tokens and bytes to move), JSON-encoded.
    kv_transfer: bytes = b""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the prefill worker's prefix cache
    queue_s: float = 0.0  # waited there before its prefill began
    prefill_s: float = 0.0  # and the prefill itself


def placement_expired(request: GenerateRequest, now: float) -> bool:
    """Whether ``request``'s placement deadline passed at wall-clock time ``now``."""
    return 0.0 < request.place_by <= now


class Usage(Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(Struct, kw_only=True, omit_defaults=True):
    arrival: float = 0.0  # worker received the request
    scheduled: float = 0.0  # first scheduled (end of queueing)
    first_token: float = 0.0
    finished: float = 0.0


class TopLogprob(Struct, array_like=True):
    """One candidate token: id, its text (as the engine decoded it alone), log probability."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(Struct, array_like=True):
    """The log probability of one token, and the ``top`` most likely at its position
    (most likely first). array_like: these ride on every chunk that asked for them.
    ``rank``: the token's place in the model's ranking at its position (1 = most likely;
    0 = not known), which vLLM's ``prompt_logprobs`` answers carry."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []
    rank: int = 0


class TokenChunk(Struct, kw_only=True, omit_defaults=True):
    """worker → gateway over TOKENS: a coalesced run of generated tokens.

    ``seq`` counts chunks from 0 (or the request's ``first_seq`` after migration); the
    last chunk of a request has ``finish_reason`` set and carries usage and timings (and,
    from a worker, its ``usage_event``).

    With ``SamplingParams.n`` > 1 each chunk holds one choice's tokens (``index``) and a
    choice's end is a chunk with ``choice_finish_reason``; ``finish_reason`` still marks
    the request's last chunk (all choices ended), whose usage counts every choice.
    """

    v: int = SCHEMA_VERSION
    request_id: str
    seq: int
    index: int = 0
    token_ids: list[int] = []
    text: str = ""
    # One per token id, when SamplingParams.logprobs asked for them.
    logprobs: list[TokenLogprob] | None = None
    # On a request's first chunk, when SamplingParams.prompt_logprobs asked: one per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    choice_finish_reason: FinishReason | None = None
    finish_reason: FinishReason | None = None
    # With a "stop" finish (on the chunk that ends the choice): the stop string matched, or
    # the stop token id (a ``stop_token_ids`` one, or an extra EOS id of the model's
    # generation config); None for the tokenizer's EOS and every other finish (vLLM's
    # ``CompletionOutput.stop_reason``).
    stop_reason: int | str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    worker_id: str = ""
    # On the request's last chunk: the usage event its worker publishes into USAGE. The
    # gateway publishes it too, under the same de-duplication id, so the request is billed
    # even when the worker dies before its own publish is stored (a USAGE election).
    usage_event: UsageEvent | None = None


class AdmissionRequest(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    request_id: str
    org: str
    key_id: str
    tier: str = "standard"
    model: str
    prompt_tokens: int
    max_tokens: int
    rpm_limit: int | None = None  # the key's limits, from its ApiKeyRecord
    tpm_limit: int | None = None
    org_rpm_limit: int | None = None
    org_tpm_limit: int | None = None
    concurrency_limit: int | None = None  # the key's requests in flight at once (ApiKeyRecord.max_concurrent)
    # The prompt's chained block hashes in the pool's block size (proto.hashing, salt = LoRA
    # name or ""): admission matches them against workers' KV events to find cached prefixes.
    block_hashes: list[int] = []
    block_size: int = 0
    lora: str | None = None
    # GenerateRequest's: the gateway's region and the key's allowed ones (DESIGN.md, Regions).
    region: str = ""
    regions: list[str] = []
    # Admit and place in one trip: when admitted, admission forwards ``route`` (with its
    # replica, slack, reservation and these block hashes filled in) to the router, whose
    # Placement goes to ``placement_reply`` (the gateway's), so the request reaches its
    # worker without first coming back to the gateway. Only before ``forward_by`` (epoch
    # seconds): past it the gateway may have stopped waiting and placed the request itself.
    route: RouteRequest | None = None
    placement_reply: str = ""
    forward_by: float = 0.0


AdmissionReason = Literal["quota_tokens", "quota_requests", "slo", "no_capacity"]


class AdmissionDecision(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    request_id: str
    admitted: bool
    reason: AdmissionReason | None = None
    retry_after: float = 0.0
    predicted_ttft: float | None = None
    reserved_tokens: int = 0
    message: str = ""
    # The replica the SLO prediction was made for (admitted requests): admission counts
    # the request on it until its gauges do, and the gateway passes it to the router,
    # with the prefill tokens the request could wait for on top and still meet its SLO.
    worker_id: str = ""
    slack_tokens: int = 0
    forwarded: bool = False  # AdmissionRequest.route went on to the router: its Placement comes to placement_reply


class TtftObservation(Struct, kw_only=True, omit_defaults=True):
    """gateway → admission (core NATS, best effort): the TTFT an admitted request had, as
    soon as its first token reached the gateway, for the calibration of predictions
    (a usage event says the same, but only once the whole request has finished)."""

    v: int = SCHEMA_VERSION
    request_id: str
    tier: str
    ttft_s: float


class PoolDemand(Struct, kw_only=True, omit_defaults=True):
    """admission → autoscalers (core NATS, every second while it refuses, then once at 0):
    the requests of one pool it refused for want of capacity (its SLO, no replica) over the
    last ``window_s`` and their prompt tokens: load the pool's queues never show, because
    admission kept it out of them. Quota refusals are not demand. The latest report of
    each ``source`` (an admission instance) holds; sources add up."""

    v: int = SCHEMA_VERSION
    pool: str
    source: str
    requests: int = 0
    tokens: int = 0
    window_s: float = 0.0


class RouteRequest(Struct, kw_only=True, omit_defaults=True):
    """gateway → router: place this request and forward it to the chosen worker."""

    v: int = SCHEMA_VERSION
    request: GenerateRequest
    exclude_workers: list[str] = []  # e.g. a worker that died under this request
    # Admission's replica (AdmissionDecision.worker_id), where the TTFT it promised holds,
    # and its slack: the prefix policy places only where the prefill work ahead of the
    # request (uncached prompt + queue) exceeds that replica's by at most the slack.
    prefer_worker: str = ""
    prefer_slack_tokens: int = 0
    # The prompt's chained block hashes in the pool's block size (as AdmissionRequest's,
    # which the gateway computes anyway): the router walks its prefix index with them
    # instead of hashing the prompt again. Only for the request's own prompt (salt: the
    # LoRA name or ""); a migrated segment, whose prompt grew, sends none.
    block_hashes: list[int] = []
    block_size: int = 0

    def admitted_by(self, decision: AdmissionDecision) -> RouteRequest:
        """This route with what admission decided: its replica and slack for the router,
        its token reservation on the request. One mapping for both places that send an
        admitted request to the router (the gateway, or admission forwarding it)."""
        request = self.request
        if decision.reserved_tokens:
            request = msgspec.structs.replace(request, reserved_tokens=decision.reserved_tokens)
        return msgspec.structs.replace(self, request=request, prefer_worker=decision.worker_id,
                                       prefer_slack_tokens=decision.slack_tokens)


class Placement(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    request_id: str
    worker_id: str
    model: str
    policy: str = ""
    cached_tokens: int = 0  # the router's estimate of the prefix already cached there
    attempt: int = 0  # the placed copy's GenerateRequest.attempt (a superseded cancel names it)


class UsageEvent(Struct, kw_only=True, omit_defaults=True):
    """Exactly one per request, whatever way it ended; USAGE dedups by request id."""

    v: int = SCHEMA_VERSION
    request_id: str
    org: str
    key_id: str
    model: str  # as the client named it: an adapter's request under the adapter's name (vLLM's)
    base_model: str = ""  # an adapter's base model: its price when the adapter has none
    worker_id: str = ""
    tier: str = "standard"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: UsageStatus = "finished"
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    reserved_tokens: int = 0
    migrations: int = 0
    error: str = ""
    user: str = ""
    metadata: dict[str, str] = {}
    region: str = ""  # where it ran: its worker's ``WorkerInfo.region``


MAX_ACCELERATORS = 1 << 16  # per worker: beyond any node, and keeps a period's cost far from int64


class CapacityEvent(Struct, kw_only=True, omit_defaults=True):
    """worker → CAPACITY (``mesh.capacity.<worker>``): one period of a worker's time on its
    accelerators, for what the fleet costs (metering's fleet report). A worker sends one
    every ``--capacity-interval`` and a last, shorter one when it stops; CAPACITY dedups by
    ``event_id``. A worker that dies loses at most its current period.

    ``held_s`` splits the period among models, in seconds of the whole of the worker's
    ``accelerators``: a dedicated worker holds all of them for its model the whole period;
    a hot-swap host's model holds its memory's share of them while resident, and the
    host's unallocated share is held by ``""``. ``busy_s`` is the time the worker had at
    least one request in flight (never more than the period)."""

    v: int = SCHEMA_VERSION
    event_id: str  # "<worker_id>:<start in ms>": unique per period
    worker_id: str
    model: str  # the worker's own model (the pool it is registered in)
    host_id: str = ""  # a hot-swap host's id
    engine: str = ""
    accelerator: str = ""  # e.g. "H100-80GB" or vLLM's device name: the price table's key
    accelerators: int = 0  # how many (tensor x pipeline parallel); 0: none to pay for
    start: float
    end: float
    busy_s: float = 0.0
    held_s: dict[str, float] = {}


class UsageModel(TypedDict):
    model: str
    base_model: str


def usage_model(request: GenerateRequest) -> UsageModel:
    """The model fields of ``request``'s usage event (``UsageEvent.model``, ``base_model``)."""
    if request.lora:
        return {"model": request.lora, "base_model": request.model}
    return {"model": request.model, "base_model": ""}


def usage_dedup_id(request_id: str, migrations: int = 0) -> str:
    """USAGE's de-duplication id: one event per request, or per segment of a migrated request."""
    return request_id if migrations == 0 else f"{request_id}#m{migrations}"


def segment_usage(usage: Usage, migrations: int) -> Usage:
    """What the usage event of one segment of a request bills, so that each token is billed
    once: the segment's own output, and the prompt (its cached part too) on the first
    segment only. A migrated request's later segments resume a prompt already billed."""
    return usage if migrations == 0 else Usage(completion_tokens=usage.completion_tokens)


class ControlCommand(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    # load: a hot-swap entry loads its model now, if its host has room (admission refused
    # a request for the load's time; its retry then finds the model loading or resident)
    command: Literal["drain", "stop", "status", "load"]
    timeout_s: float = 60.0
    reason: str = ""


class ControlReply(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    worker_id: str
    state: WorkerState
    in_flight: int = 0
    message: str = ""


# CancelRequest.reason of a copy its placer gave up on (a timed-out forward, a second
# holder): it must not run, and a copy already running stops and streams and bills nothing.
SUPERSEDED = "superseded"


class CancelRequest(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    request_id: str
    reason: str = "client disconnected"
    migrations: int = 0  # the segment cancelled (GenerateRequest.migrations); read with SUPERSEDED
    attempt: int = 0  # ... and its placement try (GenerateRequest.attempt); read with SUPERSEDED


class RequestProbe(Struct, kw_only=True, omit_defaults=True):
    """gateway → worker: how is this request doing? Asked before a silent stream is
    declared stalled, so a request merely queued on a busy, live worker stays put."""

    v: int = SCHEMA_VERSION
    request_id: str


class ChunkResend(Struct, kw_only=True, omit_defaults=True):
    """gateway → worker: publish again the chunks ``from_seq`` … ``to_seq`` of a request.

    Chunks are published at most once (no ack per chunk on the hot path); one written into
    a dying NATS node's socket never reaches TOKENS. The gateway sees the gap when a later
    chunk (at the latest the final one, which is acked) arrives, finds TOKENS lacks it, and
    asks the worker, which keeps what it published for a while (``--chunk-retention``).
    Answered with a ``ControlReply`` saying how many were sent."""

    v: int = SCHEMA_VERSION
    request_id: str
    from_seq: int
    to_seq: int


class RequestProbeReply(Struct, kw_only=True, omit_defaults=True):
    v: int = SCHEMA_VERSION
    worker_id: str
    request_id: str
    # unknown: not in flight here; waiting: in flight, no output yet; running: has output.
    state: Literal["unknown", "waiting", "running"]
    since_output_s: float = 0.0  # since this request's last engine output (or its arrival)
    engine_idle_s: float = 0.0  # since the engine last produced output for any request
    attempt: int = 0  # the placement try (GenerateRequest.attempt) of the copy held here
