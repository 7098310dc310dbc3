"""Router decision cost: time per placement with every worker's KV cache full.

Each worker holds ``--blocks`` cached blocks (default 10k, vLLM block size 16): a random
subset of shared "documents" (system prompts / RAG contexts, 2048 tokens each) plus
private blocks of its own. Requests reuse a document prefix with probability
``--hit-rate`` and add a private suffix; the rest are fresh prompts. Each sample times
``Router.place`` (model resolution, prompt hashing, the prefix walk over the index,
the policy, the optimistic accounting update); gauges arrive between samples, as in
a running router, and are not timed. The garbage collector stays on, as in the service.

Each policy runs twice on the same samples: with the prompt hashed by the router (a
request without ``RouteRequest.block_hashes``: a migrated segment, a NATS client's own
RouteRequest) and with the hashes the gateway computed for admission (every request
through a gateway), hashed outside the timed region as the gateway does.

Each row names the code that ran: ``compiled`` (the mypyc build ``make install`` makes,
services/common/native.py) or ``python`` (``MESHSERVE_NATIVE=0``, or no fresh build).
``--code python,compiled`` (the default) runs both, one process each, in one run.

    .venv/bin/python benchmarks/router_decision.py
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc

from proto.hashing import block_hashes
from proto.workers import BlockStored, KvEventBatch, WorkerGauge, WorkerInfo
from services.common import native
from services.common.fleet import FleetView
from services.router.policy import PolicyConfig, RouteDecision, RouteQuery, Router, RouterConfig

MODEL = "bench"
BLOCK = 16
DOC_TOKENS = 2048


def build(n_workers: int, blocks: int, docs: list[list[int]], rng: random.Random) -> FleetView:
    view = FleetView()
    doc_hashes = [block_hashes(d, BLOCK) for d in docs]
    per_doc = DOC_TOKENS // BLOCK
    for i in range(n_workers):
        wid = f"w{i}"
        view.update_worker(WorkerInfo(worker_id=wid, model=MODEL, engine="sim", state="ready"), 0.0)
        held: list[int] = []
        # about half the cache is shared documents, the rest private history
        for d in rng.sample(range(len(docs)), k=min(len(docs), blocks // 2 // per_doc)):
            held.extend(doc_hashes[d])
        held.extend(rng.getrandbits(64) for _ in range(blocks - len(held)))
        view.apply_kv_events(
            KvEventBatch(worker_id=wid, model=MODEL, seq=0, ts=0.0, events=[BlockStored(block_hashes=held)]),
            0.0,
        )
    return view


def measure(
    view: FleetView, docs: list[list[int]], policy: str, samples: int, hit_rate: float, seed: int,
    gateway_hashes: bool = False,
) -> tuple[float, float]:
    rng = random.Random(seed)
    pool = view.pool(MODEL)
    assert pool is not None
    router = Router(view, RouterConfig(default=PolicyConfig(policy=policy)), random.Random(seed))  # type: ignore[arg-type]
    times: list[float] = []
    now = 1.0
    warmup = 200  # not recorded: first session-ring build, allocator and GC settling after the build
    for k in range(samples + warmup):
        suffix = [rng.randrange(100_000) for _ in range(rng.randrange(64, 512))]
        if rng.random() < hit_rate:
            prompt = rng.choice(docs) + suffix
        else:
            prompt = [rng.randrange(100_000) for _ in range(DOC_TOKENS)] + suffix
        hashes = block_hashes(prompt, BLOCK) if gateway_hashes else []
        query = RouteQuery.of(f"r{k}", MODEL, prompt, max_tokens=256, session_key=f"user{k % 500}",
                              block_hashes=hashes, block_size=BLOCK if hashes else 0)
        t0 = time.perf_counter_ns()
        d = router.place(query, now)
        if k >= warmup:
            times.append((time.perf_counter_ns() - t0) / 1000)
        assert isinstance(d, RouteDecision)
        now += 0.001
        if k % 20 == 0:  # a gauge per worker every 20 ms of placements (not timed)
            for w in pool:
                view.apply_gauge(
                    WorkerGauge(
                        worker_id=w.worker_id,
                        model=MODEL,
                        ts=now,
                        queued_prefill_tokens=rng.randrange(0, 8000),
                        running_tokens=rng.randrange(10_000, 200_000),
                    ),
                    now,
                )
    times.sort()
    return statistics.median(times), times[int(0.99 * len(times))]


def walk_times(view: FleetView, docs: list[list[int]], samples: int, seed: int) -> dict[str, float]:
    """Median µs of the prefix walk alone (gateway's hashes, a shared document + 200 tokens)
    back to back, after 1 ms asleep, and after building a 20,000-element list: how much of
    a placement is the machine's caches going cold between requests."""
    rng = random.Random(seed)
    pool = view.pool(MODEL)
    assert pool is not None
    eligible = view.placeable_in(pool, 1.0)
    mask = pool.mask_of(eligible)
    prompts = [block_hashes(d + [rng.randrange(100_000) for _ in range(200)], BLOCK) for d in docs]
    out: dict[str, float] = {}
    for gap in ("back to back", "after 1 ms asleep", "after other work"):
        times: list[float] = []
        for _ in range(samples):
            hashes = list(rng.choice(prompts))
            if gap == "after 1 ms asleep":
                time.sleep(0.001)
            elif gap == "after other work":
                _ = [rng.random() for _ in range(20_000)]
            t0 = time.perf_counter_ns()
            pool.cached_prefix_blocks(b"", "", mask, (BLOCK, hashes))
            times.append((time.perf_counter_ns() - t0) / 1000)
        out[gap] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--policies", nargs="+", default=["prefix", "least_load", "round_robin", "session"])
    ap.add_argument("--blocks", type=int, default=10_000, help="cached blocks per worker")
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--hit-rate", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", default="python,compiled",
                    help="which placement code to time, in this order: python, compiled (the mypyc build)")
    ap.add_argument("--walk", action="store_true",
                    help="time the prefix walk alone: back to back, after 1 ms asleep, after other work")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # one code's rows, for the parent
    args = ap.parse_args()
    if not args.rows_only:
        print(
            f"cached blocks/worker {args.blocks} (block size {BLOCK}), prompts {DOC_TOKENS}+64..511 tokens, "
            f"prefix reuse {args.hit_rate:.0%}, {args.samples} placements per row"
        )
        print()
        if args.walk:
            print("| workers | code | walk back to back µs | after 1 ms asleep µs | after other work µs |")
            print("| ---: | --- | ---: | ---: | ---: |", flush=True)
        else:
            print("| workers | policy | prompt hashed by | code | median µs | p99 µs | index entries | view memory MB |")
            print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |", flush=True)
        codes = [c.strip() for c in args.code.split(",") if c.strip()]
        unknown = set(codes) - {"python", "compiled"}
        if unknown:
            raise SystemExit(f"--code: unknown {', '.join(sorted(unknown))} (python, compiled)")
        for code in codes:
            env = {**os.environ, native.ENV: "0" if code == "python" else "1"}
            # the child runs the code the environment selects; it ignores --code
            rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], "--rows-only"], env=env)
            if rc:
                raise SystemExit(rc)
        return
    code = "compiled" if native.status().startswith("compiled") else "python"
    if os.environ.get(native.ENV) == "1" and code != "compiled":
        print(f"| | | | compiled code not in use: {native.status()} | | | | |", flush=True)
        return
    for n in args.workers:
        rng = random.Random(args.seed)
        docs = [[rng.randrange(100_000) for _ in range(DOC_TOKENS)] for _ in range(64)]
        gc.collect()
        tracemalloc.start()
        view = build(n, args.blocks, docs, rng)
        mem_mb = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        entries = len(view.pools[MODEL].index)
        if args.walk:
            w = walk_times(view, docs, min(args.samples, 1500), args.seed)
            print(f"| {n} | {code} | {w['back to back']:.1f} | {w['after 1 ms asleep']:.1f} | {w['after other work']:.1f} |",
                  flush=True)
            continue
        for policy in args.policies:
            for gateway_hashes in (False, True):
                med, p99 = measure(view, docs, policy, args.samples, args.hit_rate, args.seed, gateway_hashes)
                by = "gateway" if gateway_hashes else "router"
                print(f"| {n} | {policy} | {by} | {code} | {med:.0f} | {p99:.0f} | {entries:,} | {mem_mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
