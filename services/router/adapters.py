"""Placing requests for runtime LoRA adapters (DESIGN.md, Routing): what a load costs
on a worker, and each adapter's home worker. Pure; the policy adds these costs to its
own (``policy.Router._decide_in_pool``)."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from services.common.fleet import FleetWorker


def adapter_home(lora: str, workers: Sequence[FleetWorker]) -> FleetWorker | None:
    """The adapter's home among ``workers`` (rendezvous hashing: stable as workers come
    and go): where it loads at the plain price (PolicyConfig.lora_home_factor)."""
    best: FleetWorker | None = None
    best_score = -1
    for w in workers:
        if w.max_loras > 0:
            score = xxhash.xxh64_intdigest(f"{lora}|{w.worker_id}".encode())
            if score > best_score:
                best, best_score = w, score
    return best


def lora_load_tokens(w: FleetWorker, lora: str, size_bytes: int, penalty_tokens: int) -> float:
    """What loading ``lora`` on ``w`` costs, in prefill tokens (``PolicyConfig``'s LoRA
    notes); ``penalty_tokens`` stands in when the size or a bandwidth is not known."""
    info, gauge = w.info, w.gauge
    rate = gauge.prefill_tokens_per_s if gauge is not None else 0.0
    bandwidth = 0.0
    if info is not None:
        bandwidth = info.lora_host_gb_per_s if lora in w.lora_cached else info.lora_load_gb_per_s
    if size_bytes <= 0 or bandwidth <= 0 or rate <= 0:
        tokens = float(penalty_tokens)
    else:
        tokens = size_bytes / (bandwidth * 1e9) * rate
    static = set(info.lora_adapters) if info is not None else set()
    in_slots = [a for a in (gauge.lora_adapters if gauge is not None else []) if a not in static]
    if len(in_slots) >= w.max_loras:  # every slot taken: an eviction someone pays for later
        tokens *= 1.5
    return tokens
