"""A pure, deterministic fleet simulation: the real router policy and view in front of the
real sim engine cores, no NATS and no processes.

What runs is the production code: ``services.router.policy.Router`` over a
``services.common.fleet.FleetView``, placing requests on ``SimCore`` replicas (the model
each sim worker wraps: vLLM v1's scheduler, chunked prefill, an LRU prefix cache of a
bounded number of blocks, step times from the profile). What is modelled is only the
plumbing between them, with zero latency: a request reaches its worker the instant it is
placed, a step's KV events reach the view when the step ends, and every worker's gauge
reaches it every ``gauge_interval_s`` (as ``--gauge-interval`` in the mesh benchmark).
One seed fixes the arrivals, the prompts and the router's RNG, so a run is a function of
its arguments: the same figures on any machine, in a few seconds of CPU.

It exists to study the prefix policy's stability (issue 17): which equilibrium a seed
lands in, what the router's counters say on the way, and whether the fleet comes back
after a burst. ``benchmarks/routing.py`` measures the same on a real mesh.

    .venv/bin/python benchmarks/router_sim.py --seeds 1,2,3,4,5,6,7,8 --loads 0.5,0.7,0.8,0.9
    .venv/bin/python benchmarks/router_sim.py --burst --seeds 1,2,3
    .venv/bin/python benchmarks/router_sim.py --policies prefix --spill-wait-tokens 0   # before the fix
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from proto.messages import SamplingParams
from proto.workers import KvEventBatch, WorkerGauge, WorkerInfo
from services.common.fleet import FleetView
from services.common.regions import RegionLatency
from services.router.policy import PolicyConfig, RouteDecision, RouteQuery, Router, RouterConfig
from services.worker.engines.base import EngineRequest
from services.worker.engines.sim_core import SimCore, StepResult
from services.worker.engines.sim_lora import LoraConfig
from services.worker.engines.sim_profile import SimConfig

MODEL = "sim"
TOKEN_BASE = 300  # above the byte tokenizer's specials and bytes: any id is a valid token


@dataclass(frozen=True, slots=True)
class Workload:
    """Shared prefix: ``groups`` system prompts, each request one of them (uniformly)
    plus a distinct suffix; the mesh benchmark's ``shared-prefix`` scenario by default.
    ``groups=1`` is its hot spot."""

    groups: int = 64
    prefix_tokens: tuple[int, int] = (1024, 2048)  # uniform, one draw per group
    suffix_tokens: tuple[int, int] = (32, 128)  # uniform, one draw per request
    output_tokens: int = 64
    capacity: float = 120.0  # req/s: the mesh's measured knee for this workload (BENCHMARKS.md)
    # LoRA adapters (issue 21): each request names one of ``adapters``, drawn with Zipf
    # popularity (``adapter_zipf``); 0: none, every request for the base model.
    adapters: int = 0
    adapter_zipf: float = 1.1
    adapter_mb: float = 100.0


@dataclass(frozen=True, slots=True)
class Fleet:
    workers: int = 8
    kv_blocks: int = 2048
    max_model_len: int = 16384
    gauge_interval_s: float = 0.1
    max_loras: int = 0  # GPU adapter slots per worker (0: no adapters)
    max_cpu_loras: int = 0


@dataclass(frozen=True, slots=True)
class Regional:
    """Regions (DESIGN.md, Regions; ``benchmarks/regions.py``): worker ``i`` runs in
    ``worker_regions[i]``; arrivals enter by each region in proportion to ``origins``' weights;
    a request placed in another region reaches its worker half a round trip later and its
    first token reaches the client half a round trip after it is computed. ``mode``:
    ``regions``, the router's rule (home while it has room, the nearest neighbour's spare
    capacity for its overflow); ``isolated``, every region a mesh of its own (a request
    never leaves its region: ``regions`` limited to it); ``blind``, one mesh that ignores
    where anything is (no region on the request, the trip still paid)."""

    worker_regions: tuple[str, ...]
    origins: tuple[tuple[str, float], ...]
    latency: RegionLatency = field(default_factory=RegionLatency)
    mode: str = "regions"


@dataclass(frozen=True, slots=True)
class Phase:
    """Poisson arrivals at ``load`` × the workload's capacity for ``seconds``."""

    seconds: float
    load: float


def steady(load: float, seconds: float = 60.0) -> tuple[Phase, ...]:
    return (Phase(seconds, load),)


def burst(base: float = 0.7, factor: float = 2.0, before_s: float = 30.0, burst_s: float = 10.0,
          after_s: float = 60.0) -> tuple[Phase, ...]:
    """Issue 17's burst test: steady ``base``, ``burst_s`` at ``factor`` × it, ``base`` again."""
    return (Phase(before_s, base), Phase(burst_s, base * factor), Phase(after_s, base))


@dataclass(slots=True)
class Req:
    rid: str
    arrival: float
    group: int
    prompt_tokens: int
    worker: str = ""
    cached_tokens: int = 0  # the engine's own hit, when first scheduled
    first_token: float = 0.0
    finished: float = 0.0
    output_tokens: int = 0
    network_s: float = 0.0  # the round trip to another region's worker (Regional)
    origin: str = ""  # the region it entered by (Regional)

    @property
    def ttft(self) -> float:
        return self.first_token + self.network_s / 2 - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finished - self.first_token) / max(self.output_tokens - 1, 1)


@dataclass(slots=True)
class SimResult:
    requests: list[Req]
    decisions: list[RouteDecision]
    # (t, outstanding tokens per worker) from the gauges, every gauge interval
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    end: float = 0.0
    adapter_loads: int = 0  # slot loads over the whole fleet (from storage or host memory)
    adapter_disk_loads: int = 0  # of which from storage (the slow ones)

    def window(self, start: float = 0.0, stop: float = math.inf) -> Summary:
        return summarize([r for r in self.requests if start <= r.arrival < stop])

    def timeline(self, bucket_s: float = 5.0) -> list[tuple[float, Summary, float]]:
        """Per bucket of arrival time: its summary and the mean outstanding tokens per worker."""
        out = []
        t = 0.0
        while t < self.end:
            s = self.window(t, t + bucket_s)
            loads = [sum(v) / len(v) for ts, v in self.samples if t <= ts < t + bucket_s]
            out.append((t, s, statistics.fmean(loads) if loads else 0.0))
            t += bucket_s
        return out

    def imbalance(self, start: float = 0.0) -> float:
        """Busiest over least busy worker, on time-averaged outstanding tokens."""
        rows = [v for ts, v in self.samples if ts >= start]
        if not rows:
            return 1.0
        means = [statistics.fmean(col) for col in zip(*rows, strict=True)]
        return max(means) / max(min(means), 1.0)


@dataclass(frozen=True, slots=True)
class Summary:
    n: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    hit_rate: float
    goodput: float  # requests meeting the SLO per second of the window's span
    slo_met: float

    def __str__(self) -> str:
        return (f"TTFT p50 {self.ttft_p50 * 1000:6,.0f} p90 {self.ttft_p90 * 1000:6,.0f} "
                f"p99 {self.ttft_p99 * 1000:6,.0f} ms  hit {self.hit_rate:4.0%}  "
                f"goodput {self.goodput:6.1f}  SLO met {self.slo_met:4.0%}")


SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1


def summarize(reqs: Sequence[Req]) -> Summary:
    done = [r for r in reqs if r.finished]
    if not reqs:
        return Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    # a request still waiting when the run ends counts with its wait so far (its TTFT is
    # at least that), so a runaway is not hidden by the requests it never served
    ttfts = sorted(r.ttft if r.first_token else math.inf for r in reqs)
    good = sum(1 for r in done if r.ttft <= SLO_TTFT_S and r.tpot <= SLO_TPOT_S)
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
    prompt = sum(r.prompt_tokens for r in reqs if r.first_token)
    cached = sum(r.cached_tokens for r in reqs if r.first_token)
    return Summary(
        n=len(reqs),
        ttft_p50=_q(ttfts, 0.5),
        ttft_p90=_q(ttfts, 0.9),
        ttft_p99=_q(ttfts, 0.99),
        hit_rate=cached / prompt if prompt else 0.0,
        goodput=good / span if span > 0 else 0.0,
        slo_met=good / len(reqs),
    )


def _q(sorted_vals: Sequence[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


class _Worker:
    __slots__ = ("busy", "core", "kv_seq", "wid")

    def __init__(self, wid: str, core: SimCore) -> None:
        self.wid = wid
        self.core = core
        self.busy = False
        self.kv_seq = 0


# an arrival's index, a step's end, a gauge tick, a request reaching another region's worker
_Payload = int | tuple[_Worker, StepResult] | EngineRequest | None


def simulate(
    policy: PolicyConfig,
    seed: int,
    phases: Sequence[Phase] = steady(0.8),
    workload: Workload = Workload(),
    fleet: Fleet = Fleet(),
    regional: Regional | None = None,
) -> SimResult:
    """One run: arrivals from ``seed`` (the same for every policy), placed by ``policy``."""
    # separate streams, so that a longer run has the same first arrivals and prompts
    arrivals = random.Random(f"arrivals-{seed}")
    rng = random.Random(f"prompts-{seed}")
    prefixes = _prefixes(workload, seed)
    view = FleetView()
    latency = regional.latency if regional is not None else RegionLatency()
    router = Router(view, RouterConfig(default=policy, regions=latency), random.Random(seed + 1_000_003))
    where = random.Random(f"regions-{seed}")  # the arrivals' regions: their own stream
    worker_region: dict[str, str] = {}
    lora = LoraConfig(max_loras=fleet.max_loras, max_cpu_loras=fleet.max_cpu_loras)
    sim_cfg = SimConfig.build(num_kv_blocks=fleet.kv_blocks, max_model_len=fleet.max_model_len, seed=seed, lora=lora)
    workers = {f"w{i}": _Worker(f"w{i}", SimCore(sim_cfg)) for i in range(fleet.workers)}
    # as a sim worker advertises its slots (SimEngine.lora_runtime)
    disk = 1 / (1 / lora.disk_bytes_per_s + 1 / lora.host_to_gpu_bytes_per_s) / 1e9
    for index, w in enumerate(workers.values()):
        worker_region[w.wid] = regional.worker_regions[index] if regional is not None else ""
        view.update_worker(WorkerInfo(worker_id=w.wid, model=MODEL, engine="sim", state="ready",
                                      region=worker_region[w.wid],
                                      max_loras=lora.max_loras, lora_load_gb_per_s=disk,
                                      lora_host_gb_per_s=lora.host_to_gpu_bytes_per_s / 1e9), 0.0)
    popularity = zipf_weights(workload.adapters, workload.adapter_zipf)
    adapter_bytes = int(workload.adapter_mb * 1e6)

    # events: (time, priority, order, kind, payload); at equal times step ends and gauges
    # come before arrivals, as a worker's step end is what a gauge at that instant reflects
    heap: list[tuple[float, int, int, str, _Payload]] = []
    order = 0

    def push(t: float, prio: int, kind: str, payload: _Payload) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, prio, order, kind, payload))

    t = 0.0
    n = 0
    for ph in phases:
        rate = ph.load * workload.capacity
        end = t + ph.seconds
        while True:
            t += arrivals.expovariate(rate)
            if t >= end:
                t = end
                break
            push(t, 2, "arrive", n)
            n += 1
    horizon = t
    g = 0.0
    while g <= horizon:
        push(g, 1, "gauge", None)
        g += fleet.gauge_interval_s

    reqs: dict[str, Req] = {}
    decisions: list[RouteDecision] = []
    result = SimResult(requests=[], decisions=decisions)

    def start_step(w: _Worker, now: float) -> None:
        res = w.core.step(now)
        w.busy = res is not None
        if res is not None:
            push(res.end, 0, "step", (w, res))

    def deliver(request: EngineRequest, now: float) -> None:
        w = workers[reqs[request.request_id].worker]
        out = w.core.add_request(request, now)
        assert out is None, out
        if not w.busy:
            start_step(w, now)

    drain_until = horizon + 120.0  # let queued work finish, within reason
    while heap:
        now, _, _, kind, payload = heapq.heappop(heap)
        if now > drain_until:
            break
        if kind == "arrive":
            i = payload
            assert isinstance(i, int)
            group = rng.randrange(workload.groups)
            suffix = [TOKEN_BASE + rng.randrange(100_000) for _ in range(rng.randint(*workload.suffix_tokens))]
            prompt = prefixes[group] + suffix
            adapter = f"a{rng.choices(range(workload.adapters), popularity)[0]}" if workload.adapters else None
            size = adapter_bytes if adapter else 0
            origin = ""
            if regional is not None:
                names, weights = zip(*regional.origins, strict=True)
                origin = where.choices(names, weights)[0]
            region = origin if regional is not None and regional.mode != "blind" else ""
            allowed = (origin,) if regional is not None and regional.mode == "isolated" else ()
            q = RouteQuery.of(f"r{i}", MODEL, prompt, max_tokens=workload.output_tokens, lora=adapter,
                              lora_size_bytes=size, region=region, regions=allowed)
            d = router.place(q, now)
            assert isinstance(d, RouteDecision), d
            decisions.append(d)
            trip = latency.rtt(origin, worker_region[d.worker_id])
            r = reqs[q.request_id] = Req(q.request_id, now, group, len(prompt), d.worker_id, network_s=trip,
                                         origin=origin)
            sampling = SamplingParams(max_tokens=workload.output_tokens, min_tokens=workload.output_tokens)
            engine_request = EngineRequest(request_id=r.rid, prompt_token_ids=prompt, sampling=sampling,
                                           arrival_time=now, lora=adapter, lora_size_bytes=size)
            if trip:
                push(now + trip / 2, 2, "deliver", engine_request)  # half a round trip to its region
            else:
                deliver(engine_request, now)
        elif kind == "deliver":
            assert isinstance(payload, EngineRequest)
            deliver(payload, now)
        elif kind == "step":
            assert isinstance(payload, tuple)
            w, res = payload
            for o in res.outputs:
                r = reqs[o.request_id]
                if not r.first_token:
                    r.first_token = res.end
                    r.cached_tokens = o.cached_tokens
                if o.finished:
                    r.finished = res.end
                    r.output_tokens = o.completion_tokens
            if res.kv_events:
                batch = KvEventBatch(worker_id=w.wid, model=MODEL, seq=w.kv_seq, ts=res.end, events=res.kv_events)
                view.apply_kv_events(batch, res.end)
                w.kv_seq += 1
            start_step(w, res.end)
        else:  # gauge
            loads = []
            for w in workers.values():
                st = w.core.stats(now)
                view.apply_gauge(
                    WorkerGauge(worker_id=w.wid, model=MODEL, ts=now, kv_event_seq=w.kv_seq - 1, **st.gauge_fields()),
                    now,
                )
                loads.append(st.queued_prefill_tokens + st.running_tokens)
            if now <= horizon:
                result.samples.append((now, loads))
    result.requests = sorted(reqs.values(), key=lambda r: r.arrival)
    result.end = horizon
    result.adapter_loads = sum(w.core.lora.loads_from_disk + w.core.lora.loads_from_host for w in workers.values())
    result.adapter_disk_loads = sum(w.core.lora.loads_from_disk for w in workers.values())
    return result


def _prefixes(workload: Workload, seed: int) -> list[list[int]]:
    # The prompts themselves do not depend on the seed: only which one each request uses
    # and when it comes (as in the mesh benchmark, where the seed picks the arrivals).
    rng = random.Random(f"prefixes-{workload.groups}-{workload.prefix_tokens}")
    return [
        [TOKEN_BASE + rng.randrange(100_000) for _ in range(rng.randint(*workload.prefix_tokens))]
        for _ in range(workload.groups)
    ]


def spill_rate(decisions: Sequence[RouteDecision]) -> float:
    """Share of placements on a worker holding less of the prompt than the best holder did."""
    spilled = sum(1 for d in decisions if d.cached_tokens < d.holder_cached_tokens)
    return spilled / len(decisions) if decisions else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--policies", default="round_robin,prefix")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--loads", default="0.8", help="fractions of the workload's capacity (120 req/s)")
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals")
    parser.add_argument("--burst", action="store_true", help="70 %%, 10 s at 2×, 70 %% again (a timeline per seed)")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--spill-wait-tokens", type=int, default=None,
                        help="the prefix policy's spill_wait_tokens (0: spills by raw cost, before issue 17's fix)")
    parser.add_argument("--spill-repeat-weight", type=float, default=None,
                        help="the prefix policy's spill_repeat_weight (0: the wait alone decides a spill)")
    parser.add_argument("--adapters", type=int, default=0,
                        help="LoRA workload (issue 21): this many adapters, Zipf popularity, distinct 512-token "
                             "prompts, on --workers workers with --max-loras slots; policies: round_robin, "
                             "prefix-blind (prefix, loads cost nothing), prefix (the default, loads priced)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--max-cpu-loras", type=int, default=16)
    args = parser.parse_args()
    if args.adapters:
        adapter_runs(args)
        return
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
        extra: dict[str, float] = {} if args.spill_wait_tokens is None else {"spill_wait_tokens": args.spill_wait_tokens}
        if args.spill_repeat_weight is not None:
            extra["spill_repeat_weight"] = args.spill_repeat_weight
        policies = [PolicyConfig(policy=p, **extra) for p in args.policies.split(",")]  # type: ignore[arg-type]
    except ValueError as exc:
        parser.error(str(exc))
    wl = Workload(groups=args.groups)
    for cfg in policies:
        if args.burst:
            for seed in seeds:
                res = simulate(cfg, seed, burst(), wl)
                print(f"\n{cfg.policy} seed {seed}: burst 70 % → 140 % (30-40 s) → 70 %")
                for t, s, load in res.timeline(5.0):
                    print(f"  {t:5.0f} s  {s}  outstanding/worker {load:8,.0f}")
            continue
        for load in loads:
            cells = []
            for seed in seeds:
                res = simulate(cfg, seed, steady(load, args.duration), wl)
                s = res.window(args.duration / 4)
                cells.append(s)
                print(f"{cfg.policy:12s} load {load:.0%} seed {seed}: {s}  spills {spill_rate(res.decisions):4.0%}  "
                      f"busiest/idlest {res.imbalance(args.duration / 4):.2f}", flush=True)
            p90 = [c.ttft_p90 * 1000 for c in cells]
            hit = [c.hit_rate for c in cells]
            good = [c.goodput for c in cells]
            print(f"{cfg.policy:12s} load {load:.0%} median / worst seed: p90 TTFT {statistics.median(p90):,.0f} / "
                  f"{max(p90):,.0f} ms, hit {statistics.median(hit):.0%} / {min(hit):.0%}, goodput "
                  f"{statistics.median(good):.1f} / {min(good):.1f}", flush=True)


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ranks 1..n (unnormalised)."""
    return [1 / (k + 1) ** s for k in range(n)]


def activation_floor_share(adapters: int, zipf: float, slots: int) -> float:
    """The share of requests that no policy can serve without a slot activation: those
    for adapters outside the ``slots`` most popular. At any moment at most ``slots``
    adapters sit in GPU slots fleet-wide, and a Poisson arrival's adapter is independent
    of which (PASTA), so it is resident with probability at most the top ``slots``'
    popularity share."""
    popularity = zipf_weights(adapters, zipf)
    return sum(popularity[slots:]) / sum(popularity) if popularity else 0.0


def adapter_runs(args: argparse.Namespace) -> None:
    """Issue 21's adapter benchmark: adapter loads per minute, TTFT and goodput, balance."""

    seeds = [int(s) for s in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    fleet = Fleet(workers=args.workers, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
    per_worker = SimConfig.build(num_kv_blocks=fleet.kv_blocks, max_model_len=fleet.max_model_len).profile.costs
    capacity = per_worker.requests_per_s(512, 128) * fleet.workers
    # distinct prompts: one "group" per request is enough (a 1-token shared prefix)
    wl = Workload(groups=1, prefix_tokens=(1, 1), suffix_tokens=(512, 512), output_tokens=128, capacity=capacity,
                  adapters=args.adapters)
    configs = {"round_robin": PolicyConfig(policy="round_robin"),
               "prefix-blind": PolicyConfig(policy="prefix", lora_load_costs=False),
               "prefix": PolicyConfig(policy="prefix")}
    names = [p for p in args.policies.split(",") if p in configs] or list(configs)
    print(f"{args.adapters} adapters (Zipf {wl.adapter_zipf}, {wl.adapter_mb:g} MB), {fleet.workers} workers × "
          f"{fleet.max_loras} slots ({fleet.max_cpu_loras} in host memory), 512-token prompts, 128 output tokens; "
          f"capacity {capacity:.1f} req/s (profile formula); first quarter of each run left out")
    slots = fleet.workers * fleet.max_loras
    outside = activation_floor_share(args.adapters, wl.adapter_zipf, slots)
    print(f"floor: {outside:.1%} of requests name an adapter outside the {slots} most popular and need a slot "
          f"activation under any policy (the fleet holds at most {slots} adapters in GPU slots at once, and a "
          f"Poisson arrival sees that set as it is); per run as 'floor', in the same units as its loads")
    for load in loads:
        for name in names:
            rows = []
            for seed in seeds:
                res = simulate(configs[name], seed, steady(load, args.duration), wl, fleet)
                s = res.window(args.duration / 4)
                per_min = res.adapter_loads / (res.end / 60)
                disk_min = res.adapter_disk_loads / (res.end / 60)
                floor_min = len(res.requests) * outside / (res.end / 60)
                rows.append((s, per_min, res.imbalance(args.duration / 4), disk_min, floor_min))
                print(f"{name:12s} load {load:.0%} seed {seed}: {s}  adapter loads/min {per_min:7.1f} "
                      f"({disk_min:.1f} from storage; floor {floor_min:.1f})  busiest/idlest {rows[-1][2]:.2f}",
                      flush=True)
            p50, p90, p99 = ([getattr(r[0], f"ttft_p{k}") * 1000 for r in rows] for k in (50, 90, 99))
            print(f"{name:12s} load {load:.0%} median / worst seed: TTFT p50 {statistics.median(p50):,.0f} / "
                  f"{max(p50):,.0f} ms, p90 {statistics.median(p90):,.0f} / {max(p90):,.0f} ms, p99 "
                  f"{statistics.median(p99):,.0f} / {max(p99):,.0f} ms, loads/min {statistics.median(r[1] for r in rows):.1f} / "
                  f"{max(r[1] for r in rows):.1f} (from storage {statistics.median(r[3] for r in rows):.1f} / "
                  f"{max(r[3] for r in rows):.1f}; floor {statistics.median(r[4] for r in rows):.1f}), goodput {statistics.median(r[0].goodput for r in rows):.1f} / "
                  f"{min(r[0].goodput for r in rows):.1f}, "
                  f"busiest/idlest {statistics.median(r[2] for r in rows):.2f} / {max(r[2] for r in rows):.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
