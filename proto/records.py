"""What meshserve stores in its JetStream KV buckets: API keys (``mesh_keys``), LoRA
adapters (``mesh_adapters``) and resumable requests' records (``mesh_requests``), with
the output options a resuming gateway rebuilds the stream's events from. Versioned like
the messages of ``proto.messages`` (the same ``SCHEMA_VERSION``)."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from .messages import SCHEMA_VERSION, GenerateRequest


class ApiKeyRecord(Struct, kw_only=True, omit_defaults=True):
    """An API key as stored in ``mesh_keys``: never the key itself, only its SHA-256."""

    v: int = SCHEMA_VERSION
    key_id: str  # public identifier (prefix of the key), safe to log
    key_hash: str  # hex sha256 of the full secret key
    org: str
    tier: str = "standard"
    name: str = ""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None  # requests in flight at once (admission counts them)
    models: list[str] = []  # empty: all models
    # Data residency: the regions its requests may run in (empty: any; DESIGN.md, Regions).
    regions: list[str] = []
    created_at: float = 0.0
    revoked: bool = False


class AdapterRecord(Struct, kw_only=True, omit_defaults=True):
    """A LoRA adapter as stored in ``mesh_adapters`` (``meshserve adapters add``): a request
    for ``name`` goes to ``base``'s pool, whose workers load it from ``path`` when they do
    not hold it (issue 21)."""

    v: int = SCHEMA_VERSION
    name: str
    base: str
    path: str  # the adapter's directory (adapter_config.json and its weights), as the workers see it
    rank: int = 0  # adapter_config.json's ``r``
    size_bytes: int = 0  # its weights on disk: what a load reads
    created_at: float = 0.0


class OutputOptions(Struct, kw_only=True, omit_defaults=True):
    """How the gateway turns a request's chunks into OpenAI responses. It travels in the
    ``RequestRecord`` so any gateway resuming the stream builds the same events."""

    n: int = 1
    logprobs: bool = False  # chat ``logprobs`` / completions ``logprobs`` asked for
    top_logprobs: int = 0
    echo: str | None = None  # completions ``echo``: the prompt text to prefix; chat: the continued message
    echo_first_token: str = ""  # the prompt's first token as text (it has no logprob)
    prompt_logprobs: bool = False  # vLLM's ``prompt_logprobs`` answer (non-streamed responses)
    # "none", "auto" (the tool parser finds calls), "required" (a JSON array of calls,
    # forced by guided decoding), "function" (the arguments of ``tool_name``, forced)
    tool_choice: str = "none"
    tool_name: str = ""
    tool_parser: str = ""
    reasoning_parser: str = ""
    thinking: bool = True  # chat_template_kwargs.enable_thinking
    reasoning_end_token_id: int | None = None  # ``</think>`` when it is one token: exact counts
    parallel_tool_calls: bool = True  # false: only a choice's first tool call is answered (vLLM)
    mistral_call_ids: bool = False  # tool-call ids of 9 alphanumerics, which Mistral's templates require
    # ``stream_options.continuous_usage_stats`` (vLLM): every chunk carries the usage so far,
    # over the request's ``prompt_tokens``
    continuous_usage: bool = False
    prompt_tokens: int = 0


class RequestRecord(Struct, kw_only=True, omit_defaults=True):
    """What any gateway needs to resume a client's stream (``mesh_requests`` KV, TTL'd).

    Written by the gateway that accepted the request, before the first token; keyed by
    request id. Only the key that made the request may read its stream.
    """

    v: int = SCHEMA_VERSION
    request_id: str
    key_id: str
    org: str = ""
    gateway_id: str
    token_subject: str
    kind: Literal["chat", "completion"] = "chat"
    model: str = ""
    created: int = 0
    include_usage: bool = False
    worker_id: str = ""
    resumable: bool = False  # the client asked that a lost connection not cancel the request
    resumes: int = 0  # incremented by each resume, so a disconnect timer elsewhere stands down
    # Workers that lost the request (died or stalled) → the first chunk seq taken over by
    # the next worker: their chunks from that seq on are void (live and on replay).
    retired: dict[str, int] = {}
    output: OutputOptions | None = None
    # Resumable requests only: what the current worker was sent, so the gateway a client
    # resumes on can move the request to another worker if that one is lost (the first
    # gateway stopped watching when its client left).
    segment: GenerateRequest | None = None


# Every stored record type (part of ``proto.MESSAGE_TYPES``).
RECORD_TYPES: tuple[type[Struct], ...] = (ApiKeyRecord, AdapterRecord, RequestRecord)
