"""What one placement decision knows: the query, the pool, the load costs, and each
worker's cached prefix, walked lazily. Pure; ``policy.Router`` builds one per decision."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from proto.hashing import prefix_salt
from services.common.fleet import FleetWorker, Pool

from .decision import Candidate, RouteDecision, RouteQuery

if TYPE_CHECKING:
    from .policy_config import PolicyConfig


class DecisionContext:
    """Per-decision inputs the policies share; the prefix walk is done lazily.

    Policies that score a few workers (round robin, least load, session) walk the index
    only for those: a worker's prefix length does not depend on the others, and a
    narrower mask ends the walk (and the prompt hashing) sooner.
    """

    __slots__ = ("blocks", "cfg", "done", "load_costs", "pool", "prompt_tokens", "q")

    def __init__(self, q: RouteQuery, cfg: PolicyConfig, pool: Pool, load_costs: dict[str, float]) -> None:
        self.q = q
        self.cfg = cfg
        self.pool = pool
        self.load_costs = load_costs  # worker id → tokens its adapter or model load costs
        self.prompt_tokens = q.prompt_tokens
        self.blocks: dict[int, int] = {}  # slot → leading cached blocks
        self.done = 0  # slots walked so far

    def ensure(self, workers: Iterable[FleetWorker]) -> dict[int, int]:
        """Walk the index for the ``workers`` not walked yet; return slot → blocks."""
        mask = self.pool.mask_of(workers) & ~self.done
        if mask:
            q = self.q
            hashed = (q.block_size, q.block_hashes) if q.block_hashes else None
            walked = self.pool.cached_prefix_blocks(q.prompt, prefix_salt(q.lora, q.org), mask, hashed)
            if self.done:
                self.blocks.update(walked)
            else:  # the first walk (every prefix decision's only one): its dict as it is
                self.blocks = walked
            self.done |= mask
        return self.blocks

    def cached(self, w: FleetWorker) -> int:
        return min(self.blocks.get(w.slot, 0) * w.block_size, self.prompt_tokens)

    def load_penalty(self, w: FleetWorker) -> float:
        return self.load_costs.get(w.worker_id, 0.0) if self.load_costs else 0.0

    def load_penalty_of(self, worker_id: str) -> float:
        return self.load_costs.get(worker_id, 0.0)

    def prefill_cost(self, w: FleetWorker) -> int:
        """Prefill tokens ahead of the request's first token on ``w``: what its TTFT grows with."""
        return self.prompt_tokens - self.cached(w) + w.queued_prefill_tokens

    def prefix_cost(self, w: FleetWorker) -> float:
        # prefill_cost + β · running + LoRA penalty, inlined (the hot loop of a placement)
        g = w.gauge
        prompt = self.prompt_tokens
        cached = min(self.blocks.get(w.slot, 0) * w.kv.block_size, prompt)
        queued = (g.queued_prefill_tokens if g is not None else 0) + w.opt_prefill_tokens
        running = (g.running_tokens if g is not None else 0) + w.opt_running_tokens
        penalty = self.load_costs.get(w.worker_id, 0.0) if self.load_costs else 0
        return prompt - cached + queued + self.cfg.beta * running + penalty

    def candidate(self, w: FleetWorker, cost: float) -> Candidate:
        return Candidate(w.worker_id, cost, self.cached(w))

    def decision(self, model: str, policy: str, best: Candidate, note: str = "", **counters: Any) -> RouteDecision:
        """The decision for ``best``; ``counters``: the policy's own fields (hint, spill terms)."""
        return RouteDecision(
            request_id=self.q.request_id,
            model=model,
            worker_id=best.worker_id,
            policy=policy,
            cached_tokens=best.cached_tokens,
            cost=best.cost,
            prompt_tokens=self.prompt_tokens,
            expected_tokens=self.q.expected_total_tokens,
            requested_model=self.q.model,
            note=note,
            **counters,
        )
