"""Issue 21's hot-swap benchmark: many models on few GPUs, in a pure, deterministic fleet
simulation (as ``router_sim.py``: the production router over a ``FleetView`` in front of
``SimCore`` replicas, zero-latency plumbing, one seed fixes everything).

12 distinct models (an 8B each: 16 GB of weights, loaded from NVMe in ~4.9 s) with
Zipf(1.1) popularity on 4 GPU hosts that each hold 2 at once. A host follows
``services.worker.engines.hosted.ModelHost``'s rule: a request for a model it does not
hold waits while the host evicts the least recently used idle, unpinned model
(``services.common.residency.victims``) and loads it, one load at a time. Compared, on
the same arrivals:

- ``pinned-lru``: every host may hold any model, the router (``Router``, ``prefix``
  policy, load costs from ``residency.swap_costs``) chooses the host, and the busiest
  models (one per host: ``RouterConfig.pin_top`` -1) are pinned, never evicted;
- ``lru``: the same with nothing pinned (``pin_top`` 0);
- ``static``: each host serves a fixed 3 of the models (round robin by popularity rank)
  and swaps among them, plain LRU;
- ``dedicated``: one always-resident GPU per model (12), the cost reference.

Reported over the run after its first quarter: cold starts (loads) per hour, TTFT p50
and p99, the share of requests meeting the SLO (TTFT ≤ 2 s, TPOT ≤ 100 ms), and
GPU-seconds per 1,000 requests served.

    .venv/bin/python benchmarks/hotswap_sim.py --seeds 1,2,3 --loads 0.3,0.6
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from router_sim import SLO_TPOT_S, SLO_TTFT_S, TOKEN_BASE, Req, _q, zipf_weights

from proto.messages import SamplingParams
from proto.workers import AllCleared, KvEventBatch, WorkerGauge, WorkerInfo
from services.common.fleet import FleetView
from services.common.residency import ResidentModel, pins_honoured, victims
from services.router.policy import PolicyConfig, RouteDecision, RouteQuery, Router, RouterConfig
from services.worker.engines.base import EngineRequest, EngineStats
from services.worker.engines.hosted import LOAD_PRESETS
from services.worker.engines.sim_core import SimCore, StepResult
from services.worker.engines.sim_profile import SimConfig

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Setup:
    models: int = 12
    zipf: float = 1.1
    hosts: int = 4
    per_host: int = 2  # models a host's memory holds at once
    weights_gib: float = 15.0  # an 8B model in bf16 (16 GB)
    load_gb_per_s: float = LOAD_PRESETS["nvme"]
    load_overhead_s: float = 2.0
    prompt_tokens: int = 512
    output_tokens: int = 128
    kv_blocks: int = 2048

    @property
    def load_s(self) -> float:
        return self.weights_gib * GIB / (self.load_gb_per_s * 1e9) + self.load_overhead_s


@dataclass(eq=False, slots=True)
class Entry:
    wid: str
    model: str
    host: Host
    core: SimCore | None = None
    state: str = "cold"
    load_done: float = 0.0
    waiting: list[tuple[Req, EngineRequest]] = field(default_factory=list)
    live: int = 0  # requests in the core, unfinished
    evicting: bool = False
    stepping: bool = False
    last_used: float = 0.0
    kv_seq: int = 0

    @property
    def busy(self) -> bool:
        return self.live > 0 or bool(self.waiting) or self.state == "loading"


@dataclass(eq=False, slots=True)
class Host:
    hid: str
    memory_gib: float
    entries: dict[str, Entry] = field(default_factory=dict)
    loading: Entry | None = None
    pinned: tuple[str, ...] = ()
    loads: int = 0  # after the warm-up
    evictions: int = 0


@dataclass(slots=True)
class Outcome:
    requests: list[Req]
    loads: int
    evictions: int
    gpus: int
    window_s: float


def simulate(config: str, seed: int, load: float, duration: float, setup: Setup = Setup(), pin_top: int = -1) -> Outcome:
    arrivals = random.Random(f"arrivals-{seed}")
    rng = random.Random(f"prompts-{seed}")
    names = [f"m{k:02d}" for k in range(setup.models)]
    popularity = zipf_weights(setup.models, setup.zipf)
    sim_cfg = SimConfig.build(num_kv_blocks=setup.kv_blocks, max_model_len=4096, seed=seed)
    per_gpu = sim_cfg.profile.costs.requests_per_s(setup.prompt_tokens, setup.output_tokens)
    rate = load * per_gpu * setup.hosts
    footprint = setup.weights_gib
    # who may hold what
    if config == "dedicated":
        hosts = [Host(f"g{k}", footprint) for k in range(setup.models)]
        allowed = {h.hid: [names[k]] for k, h in enumerate(hosts)}
    else:
        hosts = [Host(f"g{k}", footprint * setup.per_host) for k in range(setup.hosts)]
        if config == "static":
            allowed = {h.hid: [names[k] for k in range(setup.models) if k % setup.hosts == i] for i, h in enumerate(hosts)}
        else:
            allowed = {h.hid: list(names) for h in hosts}
    view = FleetView()
    router = Router(view, RouterConfig(default=PolicyConfig(policy="prefix"), pin_top=pin_top if config == "pinned-lru" else 0),
                    random.Random(seed))
    entries: dict[str, Entry] = {}
    for h in hosts:
        for m in allowed[h.hid]:
            e = Entry(f"{h.hid}-{m}", m, h)
            h.entries[m] = e
            entries[e.wid] = e
            view.update_worker(WorkerInfo(worker_id=e.wid, model=m, engine="sim", state="ready", block_size=16,
                                          host_id=h.hid, host_memory_gib=h.memory_gib, footprint_gib=footprint,
                                          load_s=setup.load_s), 0.0)
    warmup = duration / 4
    heap: list[tuple[float, int, int, str, object]] = []
    order = 0

    def push(t: float, prio: int, kind: str, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, prio, order, kind, payload))

    t, n = 0.0, 0
    while True:
        t += arrivals.expovariate(rate)
        if t >= duration:
            break
        push(t, 2, "arrive", n)
        n += 1
    g = 0.0
    while g <= duration:
        push(g, 1, "gauge", None)
        g += 0.1

    def resident(h: Host, now: float) -> list[ResidentModel]:
        return [ResidentModel(e.model, footprint, busy=e.busy, idle_s=now - e.last_used, loading=e.state == "loading")
                for e in h.entries.values() if e.state != "cold"]

    def start_step(e: Entry, now: float) -> None:
        assert e.core is not None
        res = e.core.step(now)
        e.stepping = res is not None
        if res is not None:
            push(res.end, 0, "step", (e, res))

    def try_load(h: Host, now: float) -> None:
        if h.loading is not None:
            return
        wanting = sorted((e for e in h.entries.values() if e.state == "cold" and e.waiting),
                         key=lambda e: e.waiting[0][0].arrival)
        for v in h.entries.values():
            v.evicting = False
        for e in wanting:
            keep = [*pins_honoured(h.pinned, now - e.waiting[0][0].arrival), e.model]
            out = victims(resident(h, now), footprint, h.memory_gib, keep)
            if out is None:
                # as ModelHost: the busy models that must make room take no new work, and go
                # once their requests end
                for name in victims(resident(h, now), footprint, h.memory_gib, keep, allow_busy=True) or []:
                    h.entries[name].evicting = True
                continue
            for name in out:
                v = h.entries[name]
                v.state, v.core, v.evicting = "cold", None, False
                view.apply_kv_events(KvEventBatch(worker_id=v.wid, model=v.model, seq=v.kv_seq, ts=now,
                                                  events=[AllCleared()]), now)
                v.kv_seq += 1
                h.evictions += now >= warmup
            e.state, e.load_done = "loading", now + setup.load_s
            h.loading = e
            h.loads += now >= warmup
            push(e.load_done, 0, "loaded", e)
            return

    reqs: dict[str, Req] = {}
    for h in hosts:  # the dedicated GPUs start with their model; the others start empty
        if config == "dedicated":
            for e in h.entries.values():
                e.state, e.core = "resident", SimCore(sim_cfg)
    drain_until = duration + 120.0
    while heap:
        now, _, _, kind, payload = heapq.heappop(heap)
        if now > drain_until:
            break
        if kind == "arrive":
            assert isinstance(payload, int)
            model = rng.choices(names, popularity)[0]
            prompt = [TOKEN_BASE + rng.randrange(100_000) for _ in range(setup.prompt_tokens)]
            q = RouteQuery.of(f"r{payload}", model, prompt, max_tokens=setup.output_tokens)
            d = router.place(q, now)
            assert isinstance(d, RouteDecision), d
            e = entries[d.worker_id]
            if e.state != "resident":  # a load's request carries the router's pins (GenerateRequest)
                e.host.pinned = d.pinned_models
            r = reqs[q.request_id] = Req(q.request_id, now, 0, len(prompt), e.wid)
            sampling = SamplingParams(max_tokens=setup.output_tokens, min_tokens=setup.output_tokens)
            er = EngineRequest(request_id=r.rid, prompt_token_ids=prompt, sampling=sampling, arrival_time=now)
            if e.state == "resident":
                assert e.core is not None and e.core.add_request(er, now) is None
                e.live += 1
                if not e.stepping:
                    start_step(e, now)
            else:
                e.waiting.append((r, er))
                try_load(e.host, now)
        elif kind == "loaded":
            assert isinstance(payload, Entry)
            e = payload
            e.state, e.core, e.last_used = "resident", SimCore(sim_cfg), now
            e.host.loading = None
            for _, er in e.waiting:
                assert e.core.add_request(er, now) is None
                e.live += 1
            e.waiting.clear()
            if e.live:
                start_step(e, now)
            try_load(e.host, now)
        elif kind == "step":
            assert isinstance(payload, tuple)
            e, res = payload
            assert isinstance(e, Entry) and isinstance(res, StepResult)
            if e.core is None:
                continue
            for o in res.outputs:
                r = reqs[o.request_id]
                if not r.first_token:
                    r.first_token = res.end
                if o.finished:
                    r.finished, r.output_tokens = res.end, o.completion_tokens
                    e.live -= 1
                    e.last_used = res.end
            if res.kv_events:
                view.apply_kv_events(KvEventBatch(worker_id=e.wid, model=e.model, seq=e.kv_seq, ts=res.end,
                                                  events=res.kv_events), res.end)
                e.kv_seq += 1
            start_step(e, res.end)
            if e.live == 0:
                try_load(e.host, res.end)  # a load waiting for an idle model may go now
        else:  # gauges; and, as ModelHost's waiters wake each second, loads that wait look again
            for h in hosts:
                if h.loading is None and any(e.waiting for e in h.entries.values()):
                    try_load(h, now)
            for e in entries.values():
                st = e.core.stats(now) if e.core is not None else EngineStats()
                st.waiting += len(e.waiting)
                st.queued_prefill_tokens += sum(len(er.prompt_token_ids) for _, er in e.waiting)
                st.residency = "evicting" if e.evicting and e.state == "resident" else e.state
                st.load_remaining_s = max(e.load_done - now, 0.0) if e.state == "loading" else 0.0
                st.idle_s = 0.0 if e.busy else now - e.last_used
                view.apply_gauge(WorkerGauge(worker_id=e.wid, model=e.model, ts=now, kv_event_seq=e.kv_seq - 1,
                                             **st.gauge_fields()), now)
    measured = [r for r in sorted(reqs.values(), key=lambda r: r.arrival) if r.arrival >= warmup]
    return Outcome(measured, sum(h.loads for h in hosts), sum(h.evictions for h in hosts), len(hosts),
                   duration - warmup)


@dataclass(frozen=True, slots=True)
class Row:
    cold_starts_per_h: float
    ttft_p50: float
    ttft_p99: float
    slo_met: float
    gpu_s_per_1k: float


def summarize(o: Outcome) -> Row:
    ttfts = sorted(r.ttft if r.first_token else float("inf") for r in o.requests)
    done = [r for r in o.requests if r.finished]
    good = sum(1 for r in done if r.ttft <= SLO_TTFT_S and r.tpot <= SLO_TPOT_S)
    return Row(o.loads / (o.window_s / 3600), _q(ttfts, 0.5), _q(ttfts, 0.99), good / max(len(o.requests), 1),
               o.gpus * o.window_s / max(len(done), 1) * 1000)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--configs", default="pinned-lru,lru,static,dedicated")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--loads", default="0.3,0.6", help="fractions of the 4 hosts' capacity (profile formula)")
    parser.add_argument("--duration", type=float, default=1200.0, help="simulated seconds of arrivals")
    parser.add_argument("--pin-top", type=int, default=-1, help="pinned-lru: models pinned (-1: one per host, the default)")
    args = parser.parse_args(argv)
    setup = Setup()
    per_gpu = SimConfig.build(num_kv_blocks=setup.kv_blocks).profile.costs.requests_per_s(setup.prompt_tokens,
                                                                                           setup.output_tokens)
    print(f"{setup.models} models (Zipf {setup.zipf}, {setup.weights_gib:g} GiB each, load {setup.load_s:.1f} s), "
          f"{setup.hosts} hosts × {setup.per_host} resident; {setup.prompt_tokens}-token prompts, "
          f"{setup.output_tokens} output tokens; capacity {per_gpu * setup.hosts:.1f} req/s; {args.duration:g} s per run, "
          f"the first quarter left out; SLO TTFT ≤ {SLO_TTFT_S:g} s, TPOT ≤ {SLO_TPOT_S * 1000:g} ms")
    for load in (float(x) for x in args.loads.split(",")):
        print(f"\nload {load:.0%} ({load * per_gpu * setup.hosts:.1f} req/s): median over seeds {args.seeds} "
              "(worst in brackets)")
        print("| config | GPUs | cold starts / h | TTFT p50 ms | TTFT p99 ms | SLO met | GPU-s / 1k req |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for config in args.configs.split(","):
            rows = [summarize(simulate(config, int(s), load, args.duration, setup, args.pin_top))
                    for s in args.seeds.split(",")]
            gpus = setup.models if config == "dedicated" else setup.hosts
            med = statistics.median
            print(f"| {config} | {gpus} | {med(r.cold_starts_per_h for r in rows):,.0f} "
                  f"({max(r.cold_starts_per_h for r in rows):,.0f}) | {med(r.ttft_p50 for r in rows) * 1000:,.0f} | "
                  f"{med(r.ttft_p99 for r in rows) * 1000:,.0f} ({max(r.ttft_p99 for r in rows) * 1000:,.0f}) | "
                  f"{med(r.slo_met for r in rows):.1%} ({min(r.slo_met for r in rows):.1%}) | "
                  f"{med(r.gpu_s_per_1k for r in rows):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
