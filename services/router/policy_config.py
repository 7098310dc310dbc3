"""What a routing policy is configured with (``PolicyConfig``, per model): the prefix
policy's weights and thresholds, spills, near ties, LoRA and hot-swap prices, the P/D
split and regions. Each field's comment says what it does and what measured it; the
policy itself is :mod:`.policy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["round_robin", "least_load", "prefix", "session"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "least_load", "prefix", "session")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    policy: PolicyName = "prefix"
    # Weight of running tokens, in prefill tokens. A running token slows each decode step
    # of a request placed beside it by the KV read of one token (~0.06 µs on an H100 for
    # an 8B model, vs ~70 µs of compute per prefill token), and a running sequence adds
    # its own per-step cost: over a few hundred output steps that is ~0.1 prefill token
    # per running token. 0.5 (DESIGN.md's first guess) made a holder with two more
    # running sequences lose to a replica that must prefill a 4k-token prompt again.
    beta: float = 0.1
    d: int = 2
    # Pools this small are scanned whole: a few µs per worker, and a placement that
    # matches admission's prediction (the best replica, not the best of a sample).
    full_scan_max: int = 16
    max_prefix_candidates: int = 8
    session_vnodes: int = 64
    session_overload_factor: float = 1.5
    session_overload_min_tokens: int = 4096
    session_kv_usage_max: float = 0.95
    # LoRA: a worker holding the adapter (loaded at start, or resident in a GPU slot) is a
    # candidate at no extra cost; one that loads adapters at run time (``max_loras``) is a
    # candidate at the cost of the load, in prefill tokens: the load's seconds (adapter
    # size over the worker's bandwidth from host memory or from storage) times its prefill
    # rate, half as much again when every slot is taken (an eviction another request will
    # pay for). A hot adapter so spreads to more replicas once its holders' queues cost
    # more than a load; it is never a hard filter that piles its traffic on one worker.
    # This is the cost of a load when the size or a bandwidth is not known.
    lora_load_penalty_tokens: int = 2048
    # False: loads cost nothing, adapters are placed as if resident everywhere (by prefix
    # and load alone): the residency-blind baseline of benchmarks/router_sim.py --adapters.
    lora_load_costs: bool = True
    # A load anywhere but the adapter's home worker (``adapter_home``) costs this many
    # times its price: the adapters a worker loads stay a stable share of the whole, so
    # its host cache keeps them and its slots turn over less; a hot adapter still spreads
    # once its holders' queues outweigh the dearer load. 1: no homes.
    lora_home_factor: float = 3.0
    # Anti-herding (prefix policy): a worker whose load average (``FleetWorker.load_avg``)
    # is below the eligible pool's mean / ``balance_factor`` while its current load is
    # at most the pool's current mean is underused, and takes the request even if a
    # cache holder costs less. Cost alone never sends a hot prompt to a cold replica
    # while its holders are only moderately busy (the prefill looks expensive), so a
    # replica can sit idle beside busy ones; this warms it. Off below a pool mean of
    # ``balance_min_tokens`` (an idle pool needs no balancing) and with factor 0.
    balance_factor: float = 1.3
    balance_min_tokens: int = 2048
    # ... but not with a load dearer than the cheapest worker's by more than this many
    # prefill tokens (~0.3 s on the H100 profile). An adapter load (tens of ms) may warm
    # a quiet worker; a model load (seconds) may not. benchmarks/hotswap_sim.py, seeds
    # 1-3, unbounded → bounded: plain LRU 51.7 → 61.2 % within the SLO at 30 % load and
    # 54.9 → 68.7 % at 60 %; pinned LRU 76.5 → 77.0 % and 73.7 → 76.8 %.
    balance_max_load_tokens: int = 4096
    # Admission predicted the request's TTFT on one replica and admitted it because that
    # prediction met the SLO with some slack (``RouteQuery.prefer_worker`` and
    # ``prefer_slack_tokens``). The prefix policy then chooses only among replicas whose
    # prefill work ahead of the request (uncached prompt + queue) exceeds that replica's
    # by at most the slack, so the TTFT admission promised holds wherever it lands; a
    # lightly loaded fleet leaves a large slack and the cost decides as usual.
    admission_hints: bool = True
    # Spills (issue 17). A request goes to a worker holding less of its prompt than the
    # best holder only when the holder's prefill work ahead of its first token exceeds
    # ``spill_wait_tokens`` and the other worker's (its uncached prompt included) does not
    # (an idle worker always qualifies, however long the prompt): a spill must land on
    # spare capacity, where its prefill delays nobody. Comparing raw costs instead, the
    # holder's edge is its cached prompt (1-2k tokens) while the load terms grow with the
    # queues: once queues are a few prompts long, their fluctuations outweigh the cache,
    # prompts scatter, the LRU caches thrash, the hit rate falls to a cache-blind policy's
    # and the extra prefill lengthens the queues further — a second, stable equilibrium at
    # the same load. 2048 tokens (~0.15 s of prefill on the H100 profile): in the pure fleet
    # simulation (benchmarks/router_sim.py) 8192, which lets spills into busy workers,
    # also held up to 90 % of the knee but started 3 of 4 seeds at 110 % (cold caches)
    # in a degraded state (hit 79 %, p90 TTFT 2.3 s) that 2048 avoids up to 130 %.
    # 0 restores the raw-cost choice.
    spill_wait_tokens: int = 2048
    # A spill must also save the request more prefill wait than this many times the
    # prefill it repeats (the part of the prompt the holder has cached and the other
    # has not): that prefill is work the fleet does twice, and it slows the decodes of
    # everything running where it lands, while the spilled request waits for its whole
    # prompt. Shared prefix in benchmarks/router_sim.py (8 seeds): p99 TTFT 35 ms at 80 %
    # against 100 with the wait alone deciding, 42 against 122 at 100 %, p90 equal.
    # 0: the wait alone decides.
    spill_repeat_weight: float = 1.0
    # The weight instead of spill_repeat_weight when what a spill repeats is private: a
    # prefix whose deepest cached block no earlier placement has matched (a conversation's
    # own history). Spilling a shared prompt adds a holder later requests use; spilling a
    # conversation moves its history, so its repeated prefill is pure extra work (weighing
    # every spill at 3 doubled the shared prefix's p99: BENCHMARKS.md, multi-turn).
    # Needs the gateway's block hashes (RouteQuery.block_hashes); 0: as spill_repeat_weight.
    spill_private_weight: float = 3.0
    # How many prefixes' reuse the router remembers (their deepest matched block's hash).
    spill_reuse_memory: int = 65_536
    # Near ties (prefix policy): workers whose costs are within this many tokens of the
    # cheapest and that hold at least as much of the prompt count as equal, and the one
    # placed on least recently wins. Load figures that close are noise (a gauge period
    # old, a step's prefill either side of its end) and picking their minimum bunches
    # arrivals on whichever worker reads lowest; rotating among them spaces each
    # worker's arrivals as round robin does. Distinct 1-2k-token prompts at 80 %
    # (benchmarks/router_sim.py, seeds 1-3): p90 TTFT 176 ms at 0 (the strict minimum), 162
    # at 1024, round robin's 161; the shared prefix's p99 grew at 2048.
    # 0: the strict minimum, ties at random.
    tie_tokens: int = 1024
    # The band instead of tie_tokens when no eligible worker holds any of the prompt (a
    # distinct prompt, a conversation's first turn): no cache to keep, so nothing is lost
    # by spreading wider. Distinct 1-2k-token prompts at 80 % (benchmarks/router_sim.py,
    # seeds 1-5, gauges every 0.4 s), p90 TTFT median / worst: 163 / 176 ms at 1024, 159 /
    # 170 at 2048, 160 / 170 at 4096, round robin 161 / 171.
    tie_tokens_uncached: int = 2048
    # > 0: a prompt nobody holds is also charged this many times its prompt per request
    # running or waiting on the worker, whose decodes its prefill stalls. A trade, off by
    # default (BENCHMARKS.md, multi-turn): 0.5 with tie_tokens_uncached 0 cut TPOT 3-4 %
    # but raised multi-turn's TTFT p99 and distinct prompts' p90 (more queued prefill ahead).
    prefill_harm_weight: float = 0.0
    # Prefill/decode split (pools with prefill workers, WorkerInfo.role): a prompt with at
    # least this many tokens the chosen worker does not hold is computed on a prefill
    # worker (the one with the least prefill ahead, its cached prefix counted), unless
    # every prefill worker has more than ``remote_prefill_max_queue_tokens`` queued: then
    # the chosen worker computes it (NVIDIA Dynamo's conditional disaggregation). A short
    # prompt's prefill slows the decodes beside it less than a transfer and a hop cost it.
    # The queue bound is what a prompt may wait behind there: one batch budget of the H100
    # profile (~0.6 s). At 32,768 a pool with too few prefill workers queued its prompts
    # for seconds (benchmarks/disagg.py, split:1 at 70 %: TTFT p50 / p90 1,185 / 2,593 ms
    # against 359 / 988).
    remote_prefill_min_tokens: int = 512
    remote_prefill_max_queue_tokens: int = 8192
    # Regions (DESIGN.md, Regions): a request is placed in its own region unless a farther
    # one saves it more prefill wait than the round trip costs (in the prefill tokens the
    # near worker computes meanwhile) plus this many tokens: a region's spare capacity
    # takes a neighbour's overflow, never its ordinary traffic (an idle remote worker
    # beside a moderately busy local one stays idle). The rate a round trip is counted at
    # where a worker has not measured its own yet.
    region_spill_tokens: int = 2048
    region_prefill_tokens_per_s: float = 10_000.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; expected one of {POLICIES}")
        if self.d < 1 or self.beta < 0 or self.session_vnodes < 1:
            raise ValueError("d and session_vnodes must be ≥ 1 and beta ≥ 0")
        if self.balance_factor != 0 and self.balance_factor < 1:
            raise ValueError("balance_factor must be 0 (off) or ≥ 1")
        if self.balance_max_load_tokens < 0:
            raise ValueError("balance_max_load_tokens must be ≥ 0")
        if self.spill_repeat_weight < 0 or self.spill_private_weight < 0:
            raise ValueError("spill_repeat_weight and spill_private_weight must be ≥ 0 (0: the wait alone decides a spill)")
        if self.spill_reuse_memory < 1:
            raise ValueError("spill_reuse_memory must be ≥ 1")
        if self.prefill_harm_weight < 0:
            raise ValueError("prefill_harm_weight must be ≥ 0 (0: off)")
        if self.tie_tokens < 0 or self.tie_tokens_uncached < 0:
            raise ValueError("tie_tokens and tie_tokens_uncached must be ≥ 0 (0: the strict minimum)")
        if self.spill_wait_tokens < 0:
            raise ValueError("spill_wait_tokens must be ≥ 0 (0: spills decided by cost alone)")
        if self.remote_prefill_min_tokens < 1 or self.remote_prefill_max_queue_tokens < 0:
            raise ValueError("remote_prefill_min_tokens must be ≥ 1 and remote_prefill_max_queue_tokens ≥ 0")
        if self.region_spill_tokens < 0 or self.region_prefill_tokens_per_s <= 0:
            raise ValueError("region_spill_tokens must be ≥ 0 and region_prefill_tokens_per_s > 0")
