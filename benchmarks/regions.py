"""Regions side by side (DESIGN.md, Regions): the router's rule against two alternatives an
operator would otherwise run, on the same simulated fleet, arrivals and prompts.

Two regions of four sim replicas each (``benchmarks/router_sim.py``: the real ``Router``
and ``FleetView`` in front of real ``SimCore`` replicas, the shared-prefix workload), a
round trip between them (70 ms by default). Each region's users send at a share of their
own region's capacity (``--loads eu:us``, e.g. ``1.2:0.3``: eu at 120 % of its four
replicas' knee, us at 30 %). A request placed in the other region pays the round trip
(half on the way there, half for the first token's way back).

- ``isolated``: each region a mesh of its own (what two separate deployments behind
  GeoDNS give): nothing crosses, an overloaded region queues while its neighbour idles.
- ``blind``: one mesh that ignores where anything is: load is shared, but requests cross
  whenever the cost says so, paying the trip at every load and splitting prefix caches.
- ``regions``: meshserve's rule: home while home has room, the neighbour's spare
  capacity for the overflow only.

Per mode, the median over seeds of TTFT p50 / p90 / p99 of the requests entering by eu
(the busier region in the default scenarios) and of all requests, the prefix hit rate,
the share of requests meeting the SLO (TTFT ≤ 2 s, TPOT ≤ 100 ms) and the share placed
outside their region.

    .venv/bin/python benchmarks/regions.py --loads 0.6:0.6,0.9:0.5,1.2:0.3 --seeds 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys

from router_sim import Regional, SimResult, Summary, Workload, simulate, steady, summarize

from services.common.regions import RegionLatency
from services.router.policy import PolicyConfig

MODES = ("isolated", "blind", "regions")
REGIONS = ("eu", "us")
PER_REGION = 4
CAPACITY_PER_REGION = Workload().capacity / 2  # the 8-replica knee, halved


def run(mode: str, loads: tuple[float, float], seed: int, rtt_ms: float, duration: float,
        spill_tokens: int | None = None) -> SimResult:
    total = sum(loads) / 2  # of the whole fleet's capacity
    regional = Regional(
        worker_regions=tuple(r for r in REGIONS for _ in range(PER_REGION)),
        origins=tuple(zip(REGIONS, loads, strict=True)),
        latency=RegionLatency(rtt_ms / 1000),
        mode=mode,
    )
    policy = PolicyConfig(policy="prefix") if spill_tokens is None else PolicyConfig(region_spill_tokens=spill_tokens)
    return simulate(policy, seed, steady(total, duration), regional=regional)


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--loads", default="0.6:0.6,0.9:0.5,1.2:0.3",
                        help="eu:us shares of each region's own capacity, comma-separated scenarios")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--rtt-ms", type=float, default=70.0, help="round trip between the regions")
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals")
    parser.add_argument("--region-spill-tokens", type=int, default=None,
                        help="the router's region_spill_tokens (default: PolicyConfig's)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: some of {', '.join(MODES)}")
    try:
        scenarios = [(float(a), float(b)) for a, b in (part.split(":") for part in args.loads.split(","))]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error("--loads: eu:us pairs such as 1.2:0.3; --seeds: integers")
    print(f"two regions of {PER_REGION} sim replicas, {args.rtt_ms:g} ms apart; shared-prefix workload, "
          f"{CAPACITY_PER_REGION:g} req/s knee a region; seeds {args.seeds}; medians over seeds; the first "
          f"quarter of each run left out", file=sys.stderr)
    header = ("eu:us load", "mode", "eu TTFT p50/p90/p99 ms", "all p50/p90/p99 ms", "hit", "SLO met", "crossed")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for loads in scenarios:
        for mode in modes:
            eu: list[Summary] = []
            whole: list[Summary] = []
            crossed: list[float] = []
            for seed in seeds:
                res = run(mode, loads, seed, args.rtt_ms, args.duration, args.region_spill_tokens)
                kept = [r for r in res.requests if r.arrival >= args.duration / 4]
                eu.append(summarize([r for r in kept if r.origin == "eu"]))
                whole.append(summarize(kept))
                crossed.append(sum(1 for r in kept if r.network_s) / max(len(kept), 1))
            row = (
                f"{loads[0]:.0%}:{loads[1]:.0%}", mode,
                "/".join(_ms([getattr(s, f"ttft_{q}") for s in eu]) for q in ("p50", "p90", "p99")),
                "/".join(_ms([getattr(s, f"ttft_{q}") for s in whole]) for q in ("p50", "p90", "p99")),
                f"{statistics.median(s.hit_rate for s in whole):.0%}",
                f"{statistics.median(s.slo_met for s in whole):.0%}",
                f"{statistics.median(crossed):.1%}",
            )
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
