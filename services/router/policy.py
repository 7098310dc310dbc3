"""Placement: which worker serves a request. Pure decisions over a ``FleetView``.

``Router.decide`` reads the view and returns a ``RouteDecision`` (or ``NoCapacity``) without
touching it; ``Router.commit`` then adds the placement to the view's optimistic
accounting, and ``Router.place`` does both. The only state a decision mutates is policy
state (the round-robin cursor, the injected RNG, the cached session ring, the memory of
matched prefixes).

Policies, chosen per model (``RouterConfig.models``, else ``RouterConfig.default``):

- ``round_robin``: the next eligible worker in pool order.
- ``least_load``: fewest outstanding tokens (queued prefill + running), whole pool.
- ``prefix``: lowest ``(prompt − cached_prefix(w)) + queued_prefill(w) + β·running(w)``
  over power-of-d candidates. Candidates: the workers holding the longest cached
  prefix (all of them, unless more than ``max_prefix_candidates`` do, in which case a
  random sample of that many: the prefix then no longer tells them apart and sampling
  restores power-of-d's protection against many routers herding onto one minimum),
  plus ``d`` workers drawn at random from the rest. Pools with at most
  ``full_scan_max`` eligible workers are scanned whole: sampling buys nothing there.
  Hot spots: a replica holding a shared system prompt wins only while its extra load
  (queued prefill + β·running) is smaller than the prompt's cached part, so once its
  load grows by that much others win, prefill the prompt once, and become holders too.
  Below that point cost alone would leave a cold replica idle beside busy holders for
  good; a worker whose load average stays under the pool's (``balance_factor``) takes
  the next request whatever it costs, and becomes a holder.
  Spills: a cheaper worker without the prefix wins over the best holder only when the
  holder's prefill wait exceeds ``spill_wait_tokens`` and the other's does not (an idle
  worker always may), so long queues everywhere never scatter prompts (issue 17: that made a second, stable
  equilibrium with a cache-blind hit rate; ``benchmarks/router_sim.py`` shows it), and
  only when it saves the request more wait than the prefill it repeats
  (``spill_repeat_weight``; three times that when the prefix it repeats is private, one
  no earlier placement matched: ``spill_private_weight``; nothing for a shared one
  repeated on an idle worker, whose copy delays nobody and serves the next requests).
  Near ties (within ``tie_tokens`` of the cheapest, holding as much of the prompt;
  ``tie_tokens_uncached`` when nobody holds any of it) take turns: the one placed on
  least recently wins, as round robin spaces arrivals (``prefill_harm_weight``: see PolicyConfig).
- ``session``: a consistent-hash ring (``session_vnodes`` virtual nodes per worker) of
  the session key; falls back to ``prefix`` without a key or when the target is
  overloaded (outstanding tokens above ``session_overload_factor`` × the pool mean and
  at least ``session_overload_min_tokens`` above it, or KV usage ≥
  ``session_kv_usage_max``). The ring holds every registered worker, eligible or not,
  so a worker that drains for a while and comes back keeps its sessions; only the
  sessions of an ineligible worker move, to the next worker clockwise.

Model resolution: aliases (alias → model or cascade), then cascades (a cheap
classifier picks the small or the large model; the other one is the fallback when the
chosen pool has no capacity), else the name itself.

Ties are broken with the injected ``random.Random``: deterministic under a seed, and
unbiased across equal workers.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from proto import prefill_id
from services.common.fleet import FleetView, FleetWorker, Pool
from services.common.regions import RegionLatency, allowed, by_distance, region_of
from services.common.residency import swap_costs

from .adapters import adapter_home, lora_load_tokens
from .cascade import Cascade, CascadeConfig
from .context import DecisionContext
from .decision import Candidate, NoCapacity, NoCapacityReason, RouteDecision, RouteQuery
from .hotswap import Demand, pinned_models
from .policy_config import POLICIES, PolicyConfig, PolicyName
from .ring import SessionRing

_T = TypeVar("_T")


@dataclass(slots=True)
class RouterConfig:
    default: PolicyConfig = field(default_factory=PolicyConfig)
    models: dict[str, PolicyConfig] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    cascades: dict[str, CascadeConfig] = field(default_factory=dict)
    # Hot-swap hosts: this many of the busiest hosted models are pinned (never evicted to
    # load another; each on one host, and a load that waits long enough for room evicts
    # them too); 0: plain LRU. -1: every model requested at least once per its load time
    # (evicted, it would be wanted back before a reload could finish), up to as many as
    # the hosts hold together. In benchmarks/hotswap_sim.py (12 models, 4 hosts of 2) the
    # busiest 4 met the SLO for 66 % of requests at 60 % load, 6 or 8 for 74 %.
    pin_top: int = -1
    demand_window_s: float = 60.0  # the request rates the busiest are ranked by
    # Round trips between regions (``--region-rtt-ms``; DESIGN.md, Regions).
    regions: RegionLatency = field(default_factory=RegionLatency)

    def for_model(self, model: str) -> PolicyConfig:
        return self.models.get(model, self.default)


class Router:
    """Model resolution and placement policies over a ``FleetView``."""

    def __init__(
        self, view: FleetView, config: RouterConfig | None = None, rng: random.Random | None = None
    ) -> None:
        self.view = view
        self.config = config or RouterConfig()
        self.rng = rng if rng is not None else random.Random(0)
        self._rr: dict[str, int] = {}
        self._rings: dict[str, SessionRing] = {}
        # The last placeable set's load-average floor and the members under it (see
        # _underused), kept with that set: a new one is built whenever a gauge moves them.
        self._low: tuple[list[FleetWorker], PolicyConfig, float, list[FleetWorker], int] | None = None
        self._cascades = {name: Cascade(c) for name, c in self.config.cascades.items()}
        self.demand = Demand(self.config.demand_window_s)
        # Deepest matched block hash → placements that matched it (oldest first, bounded):
        # whether a spill would repeat a shared prompt or a private history.
        self._matched: OrderedDict[int, int] = OrderedDict()  # a dict's first key slows as its front is deleted

    def set_cascade(self, name: str, cascade: CascadeConfig) -> None:
        """Add or replace a cascade, e.g. once the shell has tokenized its keywords."""
        self.config.cascades[name] = cascade
        self._cascades[name] = Cascade(cascade)

    # ---- model resolution ----
    def resolve(self, query: RouteQuery) -> tuple[list[str], str]:
        """Pools to try, in order, and a note on how they were chosen."""
        name = query.model
        for _ in range(4):  # aliases may name a cascade or another alias; bounded, no cycles
            target = self.config.aliases.get(name)
            if target is None or target == name:
                break
            name = target
        cascade = self._cascades.get(name)
        if cascade is None:
            return [name], "" if name == query.model else f"alias {query.model} → {name}"
        chosen, why = cascade.classify(query)
        other = cascade.cfg.large if chosen == cascade.cfg.small else cascade.cfg.small
        return ([chosen, other] if cascade.cfg.fallback else [chosen]), why

    # ---- placement ----
    def place(self, query: RouteQuery, now: float, exclude: Collection[str] = ()) -> RouteDecision | NoCapacity:
        """Decide and record the placement in the view's optimistic accounting."""
        result = self.decide(query, now, exclude)
        if isinstance(result, RouteDecision):
            self.commit(result, now)
        return result

    def commit(self, decision: RouteDecision, now: float) -> None:
        """Count ``decision`` on its worker until a gauge reflects it (a retry moves it)."""
        self.demand.add(decision.model, now)
        self.view.record_placement(
            decision.worker_id,
            decision.request_id,
            decision.prefill_tokens,
            decision.expected_tokens,
            now,
        )
        if decision.prefill_worker:
            # Its prefill, counted there under the id the prefill runs by (its gauges name it).
            self.view.record_placement(decision.prefill_worker, prefill_id(decision.request_id),
                                       decision.remote_prefill_tokens, decision.prompt_tokens, now)

    def pinned(self, now: float) -> list[str]:
        """The hosted models a hot-swap host must not evict (``RouterConfig.pin_top``)."""
        return pinned_models(self.view, self.demand, self.config.pin_top, now)

    def release(self, request_id: str) -> bool:
        """The placed worker refused or died before taking the request."""
        self.view.release_placement(prefill_id(request_id))
        return self.view.release_placement(request_id)

    def decide(self, query: RouteQuery, now: float, exclude: Collection[str] = ()) -> RouteDecision | NoCapacity:
        models, note = self.resolve(query)
        first: NoCapacity | None = None
        for i, model in enumerate(models):
            result = self._decide_in_pool(model, query, now, exclude)
            if isinstance(result, RouteDecision):
                if i:
                    note = f"{note}; {models[0]} had no capacity" if note else f"{models[0]} had no capacity"
                return replace(result, note=_join(note, result.note)) if note else result
            first = first or result
        assert first is not None
        return first

    def _decide_in_pool(
        self, model: str, q: RouteQuery, now: float, exclude: Collection[str]
    ) -> RouteDecision | NoCapacity:
        pool = self.view.pool(model)
        if pool is None or not pool.workers:
            known = model in self.config.models or model in self.view.models_seen
            return NoCapacity(
                q.request_id,
                model,
                "empty_pool" if known else "unknown_model",
                f"no worker serves model {model!r}",
            )
        cfg = self.config.for_model(model)
        eligible = self.view.placeable_in(pool, now, exclude)
        if not eligible:
            # Only prefill workers left (P/D split): each is a whole engine, better than none.
            eligible = [w for w in self.view.prefill_placeable_in(pool, now) if w.worker_id not in exclude]
        eligible = allowed(eligible, q.regions)  # data residency: never outside the key's regions
        load_costs: dict[str, float] = {}
        if q.lora:
            serving = [w for w in eligible if q.lora in w.lora_adapters or w.max_loras > 0]
            home = adapter_home(q.lora, serving) if cfg.lora_home_factor != 1 else None
            for w in serving:
                if q.lora not in w.lora_adapters and cfg.lora_load_costs:
                    tokens = lora_load_tokens(w, q.lora, q.lora_size_bytes, cfg.lora_load_penalty_tokens)
                    load_costs[w.worker_id] = tokens if w is home else tokens * cfg.lora_home_factor
            eligible = serving
        if not eligible:
            return NoCapacity(
                q.request_id,
                model,
                "no_eligible_worker",
                f"{len(pool)} worker(s) for {model!r}, none ready, live, not draining"
                + (f" with adapter {q.lora!r}" if q.lora else "")
                + (f" in region {', '.join(q.regions)}" if q.regions else "")
                + (f", {len(exclude)} excluded" if exclude else ""),
            )
        pins: dict[str, tuple[str, ...]] = {}
        if pool.hosted:
            swap = swap_costs(eligible, self.view, self.pinned(now))
            pins = swap.pins
            if swap.blocked and len(swap.blocked) < len(eligible):
                eligible = [w for w in eligible if w.worker_id not in swap.blocked]
            for wid, tokens in swap.costs.items():
                load_costs[wid] = load_costs.get(wid, 0.0) + tokens
        ctx = DecisionContext(q, cfg, pool, load_costs)
        decision = self._by_region(model, eligible, ctx)
        if pins or load_costs:
            chosen = self.view.worker(decision.worker_id)
            host = chosen.info.host_id if chosen is not None and chosen.info is not None else ""
            decision = replace(decision, pinned_models=pins.get(host, ()), load_tokens=ctx.load_penalty_of(decision.worker_id))
        if q.disaggregable and not pool.hosted and not q.lora:
            decision = self._split(decision, pool, ctx, now, exclude)
        return decision

    def _split(self, decision: RouteDecision, pool: Pool, ctx: DecisionContext, now: float,
               exclude: Collection[str]) -> RouteDecision:
        """``decision`` with a prefill worker to compute its prompt, where the pool has one
        and the prompt is worth it (``PolicyConfig.remote_prefill_min_tokens``)."""
        cfg = ctx.cfg
        if decision.prefill_tokens < cfg.remote_prefill_min_tokens:
            return decision
        chosen = self.view.worker(decision.worker_id)
        info = chosen.info if chosen is not None else None
        if info is None or not info.disaggregation or info.role == "prefill":
            return decision  # it cannot load another worker's KV (vLLM without a KV connector)
        # A KV it can load: the same engine, in blocks of its size.
        prefill = [w for w in self.view.prefill_placeable_in(pool, now)
                   if w.worker_id not in exclude and w.info is not None and w.info.disaggregation
                   and w.info.engine == info.engine and w.info.block_size == info.block_size
                   and w.info.region == info.region  # a KV crosses a region's links, not an ocean
                   and w.queued_prefill_tokens <= cfg.remote_prefill_max_queue_tokens]
        if not prefill:
            return decision
        ctx.ensure(prefill)
        # The least prefill ahead of this prompt's end, its cached prefix counted; near ties
        # take turns, as for requests. β·running counts the KV a prefill worker still holds.
        _, best = self._pick_rotating([(ctx.prefix_cost(w), w) for w in prefill], ctx, cfg.tie_tokens)
        return replace(decision, prefill_worker=best.worker_id, prefill_cached_tokens=ctx.cached(best))

    def _by_region(self, model: str, eligible: list[FleetWorker], ctx: DecisionContext) -> RouteDecision:
        """The policy's choice in the request's region (the nearest with workers when it
        has none), unless a farther one saves more wait than its round trip costs
        (``PolicyConfig.region_spill_tokens``; DESIGN.md, Regions)."""
        groups = by_distance(ctx.q.region, eligible, self.config.regions)
        best = self._policy(model, groups[0].workers, ctx)
        if not ctx.q.region:
            return best
        cfg, chosen_rtt, chosen_ctx = ctx.cfg, groups[0].rtt_s, ctx
        hint_region: str | None = None
        if ctx.q.prefer_worker and cfg.admission_hints:
            hinted = self.view.worker(ctx.q.prefer_worker)
            hint_region = region_of(hinted) if hinted is not None else None
        for group in groups[1:]:
            worker = self.view.worker(best.worker_id)
            assert worker is not None
            wait = chosen_ctx.prefill_cost(worker)
            # Its round trip, in the prefill tokens the chosen worker computes meanwhile.
            rate = worker.gauge.prefill_tokens_per_s if worker.gauge is not None else 0.0
            trip = (group.rtt_s - chosen_rtt) * (rate or cfg.region_prefill_tokens_per_s)
            # Admission's replica is in this region: its prediction found no better one
            # nearer, so the round trip alone is weighed.
            hinted_here = group.region == hint_region
            margin = 0 if hinted_here else cfg.region_spill_tokens
            if wait <= trip + margin:
                continue  # this region cannot save more than its trip costs (a farther hinted one may)
            # The spill's target: the least wait there (its cached prefix counted), near
            # ties taking turns; judged, not placed, so no policy state moves for it.
            there_ctx = DecisionContext(ctx.q, cfg, ctx.pool, ctx.load_costs)
            there_ctx.ensure(group.workers)
            cost, there = self._pick_rotating([(there_ctx.prefix_cost(w), w) for w in group.workers], there_ctx,
                                              cfg.tie_tokens)
            there_wait = there_ctx.prefill_cost(there)
            # Only onto spare capacity (as a spill within a region): with both regions
            # past their knee, moving requests between them only splits their caches.
            spare = hinted_here or there_wait <= max(cfg.region_spill_tokens,
                                                     there_ctx.prompt_tokens - there_ctx.cached(there))
            if spare and wait - there_wait > trip + margin:
                best = there_ctx.decision(model, cfg.policy, there_ctx.candidate(there, cost),
                                          queued_tokens=there.queued_prefill_tokens, running_tokens=there.running_tokens)
                chosen_rtt, chosen_ctx = group.rtt_s, there_ctx
        chosen = self.view.worker(best.worker_id)
        region = region_of(chosen) if chosen is not None else ""
        if region != ctx.q.region:
            best = replace(best, note=_join(best.note, f"outside {ctx.q.region}"))
        return replace(best, region=region)

    def _policy(self, model: str, eligible: list[FleetWorker], ctx: DecisionContext) -> RouteDecision:
        match ctx.cfg.policy:
            case "round_robin":
                return self._round_robin(model, eligible, ctx)
            case "least_load":
                return self._least_load(model, eligible, ctx)
            case "prefix":
                return self._prefix(model, eligible, ctx)
            case "session":
                return self._session(model, eligible, ctx)

    # ---- policies ----
    def _round_robin(self, model: str, eligible: list[FleetWorker], ctx: DecisionContext) -> RouteDecision:
        start = self._rr.get(model, 0) % len(eligible)
        self._rr[model] = start + 1
        w = eligible[start]
        ctx.ensure([w])
        return ctx.decision(model, "round_robin", ctx.candidate(w, float(w.outstanding_tokens)))

    def _least_load(self, model: str, eligible: list[FleetWorker], ctx: DecisionContext) -> RouteDecision:
        scored = [(float(w.outstanding_tokens + ctx.load_penalty(w)), w) for w in eligible]
        cost, best = self._pick(scored)
        ctx.ensure([best])
        return ctx.decision(model, "least_load", ctx.candidate(best, cost))

    def _prefix(
        self, model: str, eligible: list[FleetWorker], ctx: DecisionContext, policy: str = "prefix", note: str = ""
    ) -> RouteDecision:
        cfg = ctx.cfg
        by_slot = ctx.ensure(eligible)  # the holders are needed: walk the whole eligible set
        top = max(by_slot.values(), default=0)  # the longest cached prefix, in blocks
        if len(eligible) <= max(cfg.full_scan_max, cfg.d):
            pick = eligible
        else:
            holder_slots = [s for s, n in by_slot.items() if n == top] if top else []
            if len(holder_slots) > cfg.max_prefix_candidates:
                holder_slots = _sample(self.rng, holder_slots, cfg.max_prefix_candidates)
            pool = ctx.pool
            pick = [pool.at(s) for s in holder_slots]
            # plus d random workers from the rest
            _add_others(self.rng, eligible, pick, cfg.d)
        cost_of = ctx.prefix_cost
        scored = [(cost_of(w), w) for w in pick]
        hinted, budget = self._hinted(eligible, ctx)
        if hinted is not None:
            if all(w is not hinted for _, w in scored):
                scored.append((ctx.prefix_cost(hinted), hinted))
        if not top and cfg.prefill_harm_weight:
            # nothing cached anywhere: the prefill stalls the decodes where it lands
            harm = cfg.prefill_harm_weight * ctx.prompt_tokens
            scored = [(c + harm * w.requests, w) for c, w in scored]
        # The holders the policy scored (every holder in a pool scanned whole), for the
        # spill counters; before the slack filter, which may leave none of them.
        holders = [(c, w) for c, w in scored if by_slot.get(w.slot, 0) == top] if top else []
        if hinted is not None:
            scored = [(c, w) for c, w in scored if ctx.prefill_cost(w) <= budget]  # keeps hinted
        cost, best = self._pick_rotating(scored, ctx, cfg.tie_tokens if top else cfg.tie_tokens_uncached)
        held = False
        # the hash of the deepest block any worker holds, from the gateway's hashes (when
        # the holders' block size is theirs)
        hashes = ctx.q.block_hashes
        deepest = None
        if holders and len(hashes) >= top and holders[0][1].block_size == ctx.q.block_size:
            deepest = hashes[top - 1]
        if cfg.spill_wait_tokens and top and by_slot.get(best.slot, 0) < top:
            kept = [(c, w) for c, w in scored if by_slot.get(w.slot, 0) == top]
            if kept:
                hcost, holder = self._pick(kept)
                wait = max(cfg.spill_wait_tokens, ctx.prompt_tokens - ctx.cached(best))
                holder_wait, best_wait = ctx.prefill_cost(holder), ctx.prefill_cost(best)
                repeated = ctx.cached(holder) - ctx.cached(best)
                weight, shared = cfg.spill_repeat_weight, deepest is not None and deepest in self._matched
                if cfg.spill_private_weight and deepest is not None and not shared:
                    weight = cfg.spill_private_weight
                elif shared and not best.requests:
                    weight = 0.0  # a shared prompt's copy on an idle worker: no waste (hot spot's warm-up)
                if not (holder_wait > wait >= best_wait and holder_wait - best_wait > weight * repeated):
                    cost, best, held = hcost, holder, True
        under = self._underused(eligible, cfg, ctx.pool)
        if under:
            # an adapter load may warm a quiet worker, a model load (seconds) may not
            bound = ctx.load_penalty(best) + cfg.balance_max_load_tokens
            under = [w for w in under if ctx.load_penalty(w) <= bound]
        if under and budget < math.inf:
            under = [w for w in under if ctx.prefill_cost(w) <= budget]
        if under and best not in under:
            cost, best = self._pick([(ctx.prefix_cost(w), w) for w in under])
            note = _join(note, f"{best.worker_id} underused")
        if deepest is not None and cfg.spill_private_weight:
            self._note_matched(deepest, cfg.spill_reuse_memory)
        hint = ""
        if ctx.q.prefer_worker and cfg.admission_hints:
            hint = "unavailable" if hinted is None else "kept" if best is hinted else "moved"
        return ctx.decision(
            model, policy, ctx.candidate(best, cost), note,
            hint=hint,
            rebalanced=best in under,
            spill_held=held and best not in under,
            holder_cached_tokens=ctx.cached(holders[0][1]) if holders else 0,
            holder_cost=min([c for c, _ in holders]) if holders else 0.0,
            queued_tokens=best.queued_prefill_tokens,
            running_tokens=best.running_tokens,
        )

    def _note_matched(self, block_hash: int, memory: int) -> None:
        matched = self._matched
        matched[block_hash] = matched.pop(block_hash, 0) + 1  # to the newest end
        if len(matched) > memory:
            matched.popitem(last=False)

    @staticmethod
    def _hinted(eligible: Sequence[FleetWorker], ctx: DecisionContext) -> tuple[FleetWorker | None, float]:
        """Admission's replica if it is eligible, and the prefill work (tokens) a
        placement may put ahead of the request: its own plus admission's slack."""
        wid = ctx.q.prefer_worker
        if not wid or not ctx.cfg.admission_hints:
            return None, math.inf
        w = next((w for w in eligible if w.worker_id == wid), None)
        if w is None:
            return None, math.inf
        return w, ctx.prefill_cost(w) + max(ctx.q.prefer_slack_tokens, 0)

    def _underused(self, eligible: list[FleetWorker], cfg: PolicyConfig, pool: Pool) -> list[FleetWorker]:
        """Workers left underused by cache affinity (see ``PolicyConfig.balance_factor``)."""
        if not cfg.balance_factor or len(eligible) < 2:
            return []
        n = len(eligible)
        kept = self._low
        # The view hands out one list per placeable set, rebuilt whenever a gauge changes:
        # the same list, the same load averages and gauges.
        if kept is not None and kept[0] is eligible and kept[1] is cfg:
            mean_avg, low, gauged = kept[2], kept[3], kept[4]
        else:
            avgs = [w.load_avg for w in eligible]
            mean_avg = sum([a for a in avgs if a]) / n
            floor = mean_avg / cfg.balance_factor
            low = [w for w, a in zip(eligible, avgs, strict=True) if a is not None and a < floor]
            gauged = sum(w.gauge.queued_prefill_tokens + w.gauge.running_tokens for w in eligible if w.gauge is not None)
            self._low = (eligible, cfg, mean_avg, low, gauged)
        if mean_avg < cfg.balance_min_tokens or not low:  # the common case: the current load is not needed
            return []
        # The pool's current load: its gauges' (kept above) and what was placed since (the
        # pool's running total when every member is eligible, as almost always).
        if n == len(pool):
            optimistic = pool.opt_tokens
        else:
            optimistic = sum(w.opt_prefill_tokens + w.opt_running_tokens for w in eligible)
        mean_now = (gauged + optimistic) / n
        return [w for w in low if w.outstanding_tokens <= mean_now]

    def _session(self, model: str, eligible: list[FleetWorker], ctx: DecisionContext) -> RouteDecision:
        key = ctx.q.session_key
        if not key:
            return self._prefix(model, eligible, ctx, note="session: no session key")
        pool = ctx.pool
        ring = self._rings.get(model)
        if ring is None or ring.generation != pool.generation or ring.vnodes != ctx.cfg.session_vnodes:
            ring = self._rings[model] = SessionRing(pool, ctx.cfg.session_vnodes)
        allowed = {w.worker_id: w for w in eligible}
        target = next(allowed[wid] for wid in ring.walk(key) if wid in allowed)
        cfg = ctx.cfg
        mean = sum(w.outstanding_tokens for w in eligible) / len(eligible)
        out = target.outstanding_tokens
        if (out > cfg.session_overload_factor * mean and out - mean >= cfg.session_overload_min_tokens) or (
            target.kv_usage >= cfg.session_kv_usage_max
        ):
            why = f"session target {target.worker_id} overloaded ({out} tokens, pool mean {mean:.0f}, kv {target.kv_usage:.2f})"
            return self._prefix(model, eligible, ctx, note=why)
        ctx.ensure([target])
        return ctx.decision(model, "session", ctx.candidate(target, ctx.prefix_cost(target)))

    def _pick(self, scored: list[tuple[float, FleetWorker]]) -> tuple[float, FleetWorker]:
        """Lowest cost, ties broken at random."""
        low = min(c for c, _ in scored)
        ties = [cw for cw in scored if cw[0] == low]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)

    def _pick_rotating(
        self, scored: list[tuple[float, FleetWorker]], ctx: DecisionContext, tie: int
    ) -> tuple[float, FleetWorker]:
        """Among the near ties of the cheapest (within ``tie`` tokens: ``PolicyConfig.tie_tokens``),
        the worker placed on least recently; ties of that at random."""
        cost, best = self._pick(scored)
        if not tie or len(scored) < 2:
            return cost, best
        held, penalty = ctx.cached(best), ctx.load_penalty(best)
        # as much of the prompt, and no dearer adapter or model load: rotation spreads load, never residency
        near = [(c, w) for c, w in scored
                if c <= cost + tie and ctx.cached(w) >= held and ctx.load_penalty(w) <= penalty]
        oldest = min(w.last_placed_at for _, w in near)
        if best.last_placed_at == oldest:
            return cost, best
        ties = [cw for cw in near if cw[1].last_placed_at == oldest]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)


def _sample(rng: random.Random, items: list[_T], k: int) -> list[_T]:
    """``k`` of ``items`` (reordered in place), uniformly without replacement: the first
    ``k`` steps of a Fisher-Yates shuffle, a fifth of ``random.sample``'s time here."""
    n = len(items)
    for i in range(k):
        j = i + int(rng.random() * (n - i))
        items[i], items[j] = items[j], items[i]
    return items[:k]


def _add_others(rng: random.Random, eligible: list[FleetWorker], pick: list[FleetWorker], d: int) -> None:
    """Append ``d`` workers of ``eligible`` not in ``pick`` (fewer if fewer remain), uniformly
    without replacement; drawn by rejection while most of the pool is left to draw from,
    so no list of the rest is built on every placement."""
    n = len(eligible)
    chosen = {w.slot for w in pick}
    left = n - len(chosen)  # every picked worker is eligible
    want = min(d, left)
    if want <= 0:
        return
    if left * 2 < n:  # mostly picked already: draw from the rest as a list
        pick.extend(_sample(rng, [w for w in eligible if w.slot not in chosen], want))
        return
    while want:
        w = eligible[int(rng.random() * n)]
        if w.slot not in chosen:
            chosen.add(w.slot)
            pick.append(w)
            want -= 1


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a and b else a or b


__all__ = [
    "POLICIES",
    "Candidate",
    "CascadeConfig",
    "NoCapacity",
    "NoCapacityReason",
    "PolicyConfig",
    "PolicyName",
    "RouteDecision",
    "RouteQuery",
    "Router",
    "RouterConfig",
    "adapter_home",
]
