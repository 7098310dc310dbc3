"""What one placement decision takes and gives: the request as the router sees it
(``RouteQuery``), the decision (``RouteDecision``, with its ``Candidate``), or why there
was none (``NoCapacity``). The policies that make it are in ``policy``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from proto.hashing import cache_scope
from proto.messages import GenerateRequest, Placement
from services.common.fleet import pack_prompt

NoCapacityReason = Literal["unknown_model", "empty_pool", "no_eligible_worker"]


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a decision needs to know about one request."""

    request_id: str
    model: str
    prompt: bytes  # packed uint32 token ids, as on the wire
    max_tokens: int = 16
    lora: str | None = None
    lora_size_bytes: int = 0  # a runtime adapter's size (GenerateRequest.lora_size_bytes)
    org: str = ""  # with lora, the salt of the prompt's block hashes: its cache_scope (proto.hashing.prefix_salt)
    session_key: str | None = None
    text: str | None = None  # the request text, if the caller has it (cascade keywords)
    # Output tokens to account for on the chosen worker; max_tokens when unknown.
    expected_output_tokens: int | None = None
    # Admission's replica and slack (RouteRequest): see PolicyConfig.admission_hints.
    prefer_worker: str | None = None
    prefer_slack_tokens: int = 0
    # The prompt already hashed in ``block_size`` (RouteRequest.block_hashes): the prefix
    # walk uses these for workers of that block size instead of hashing the prompt.
    block_hashes: Sequence[int] = ()
    block_size: int = 0
    # A prefill worker may compute its prompt (one choice, a first segment, no prompt
    # logprobs: what a decode worker can continue from the prompt's KV alone).
    disaggregable: bool = False
    # GenerateRequest.region / .regions: where it entered, where it may run (DESIGN.md, Regions).
    region: str = ""
    regions: Sequence[str] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt) // 4

    @property
    def expected_total_tokens(self) -> int:
        out = self.max_tokens if self.expected_output_tokens is None else self.expected_output_tokens
        return self.prompt_tokens + out

    @classmethod
    def of(cls, request_id: str, model: str, prompt: bytes | Iterable[int], **kw: object) -> RouteQuery:
        return cls(request_id=request_id, model=model, prompt=pack_prompt(prompt), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_generate(
        cls, req: GenerateRequest, prefer_worker: str | None = None, prefer_slack_tokens: int = 0,
        block_hashes: Sequence[int] = (), block_size: int = 0,
    ) -> RouteQuery:
        # A migrated request resumes with the output so far appended to its prompt; the
        # hashes sent with it are of the prompt alone, so they are not used then.
        prompt = req.prompt + req.prior_output if req.prior_output else req.prompt
        hashed = bool(block_hashes) and block_size > 0 and not req.prior_output
        s = req.sampling
        return cls(
            disaggregable=not req.prior_output and not req.prior_outputs and s.n <= 1 and s.max_tokens > 0
            and s.prompt_logprobs is None,
            block_hashes=block_hashes if hashed else (),
            block_size=block_size if hashed else 0,
            request_id=req.request_id,
            model=req.model,
            prompt=prompt,
            max_tokens=req.sampling.max_tokens,
            lora=req.lora,
            lora_size_bytes=req.lora_size_bytes,
            org=cache_scope(req.org, req.cache_salt),
            session_key=req.session_key,
            prefer_worker=prefer_worker,
            prefer_slack_tokens=prefer_slack_tokens,
            region=req.region,
            regions=tuple(req.regions),
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    cost: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    request_id: str
    model: str  # the pool's model (after alias/cascade resolution)
    worker_id: str
    policy: str  # the policy that chose: the configured one, or "prefix" after a fallback
    cached_tokens: int  # estimated prefix already cached on the worker
    cost: float
    prompt_tokens: int
    expected_tokens: int  # prompt + expected output: the optimistic running addition
    requested_model: str = ""
    note: str = ""  # why a fallback happened (cascade class, session overload, ...)
    # admission's replica (RouteQuery.prefer_worker): "kept" (placed there), "moved"
    # (elsewhere, within its slack), "unavailable" (not eligible now), "" (no hint)
    hint: str = ""
    rebalanced: bool = False  # sent to an underused worker (PolicyConfig.balance_factor)
    # prefix policy: the longest prefix any eligible worker holds, and the cost of the
    # cheapest worker holding it among those scored (every holder in a pool scanned
    # whole; the sampled ones in a larger pool); a placement with fewer cached tokens is
    # a spill, and ``holder_cost − cost`` is by how much the holder lost (issue 17's counters)
    holder_cached_tokens: int = 0
    holder_cost: float = 0.0
    # a cheaper worker without the prefix was passed over for a holder (spill_wait_tokens)
    spill_held: bool = False
    queued_tokens: int = 0  # the chosen worker's queued prefill, a term of its cost
    running_tokens: int = 0  # and its running tokens (weighted by β in the cost)
    # on a hot-swap host: the models its load must not evict (GenerateRequest.pinned_models)
    pinned_models: tuple[str, ...] = ()
    load_tokens: float = 0.0  # what the model's load on the chosen worker cost (0: resident)
    # Prefill/decode split: the prefill worker that computes the prompt ("": the chosen
    # worker does), and how much of the prompt it holds.
    prefill_worker: str = ""
    prefill_cached_tokens: int = 0
    # Regions: the chosen worker's region (set when the request names its own).
    region: str = ""

    @property
    def spilled(self) -> bool:
        return self.cached_tokens < self.holder_cached_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the chosen worker computes (with a prefill worker: the last one)."""
        if self.prefill_worker:
            return 1
        return max(self.prompt_tokens - self.cached_tokens, 0)

    @property
    def remote_prefill_tokens(self) -> int:
        """Prompt tokens the prefill worker computes (0 without one)."""
        return max(self.prompt_tokens - self.prefill_cached_tokens, 0) if self.prefill_worker else 0

    def to_placement(self) -> Placement:
        return Placement(
            request_id=self.request_id,
            worker_id=self.worker_id,
            model=self.model,
            policy=self.policy,
            cached_tokens=self.cached_tokens,
        )


@dataclass(frozen=True, slots=True)
class NoCapacity:
    request_id: str
    model: str
    reason: NoCapacityReason
    message: str

    @property
    def retryable(self) -> bool:
        # Workers come back (restart, scale-up, drain ends); an unknown model does not.
        return self.reason != "unknown_model"


__all__ = ["Candidate", "NoCapacity", "NoCapacityReason", "RouteDecision", "RouteQuery"]
