"""Routers side by side (issue 18, part 2): meshserve and the peers' routers in front of
the same fleet, the same arrivals and prompts.

Each run is one (system, scenario, load, seed) on a fresh fleet of ``--workers`` sims with
the same profile, speed and KV size:

- ``meshserve``: the mesh of ``benchmarks/routing.py`` (sim workers on NATS, gateway,
  router with its default ``prefix`` policy; admission off, so nothing is shed).
  ``meshserve-rr``: the same with ``round_robin``, to set beside ``vllm-rr``: the same
  assignment rule, so what differs is the path (NATS, sim workers) and not the policy.
- the peers: ``meshserve sim-server`` processes (the same sim engine behind vLLM's HTTP
  surface) with vllm-router or sglang-router in front, retries disabled so a failure is
  counted as it is for meshserve. ``*-tuned`` is ``cache_aware`` with balance thresholds
  that can act with 8 workers (peers.md); ``vllm-kv`` is vllm-router's ``kv_aware``,
  fed the sims' KV events over ZMQ.

Figures, per system: the client's TTFT and TPOT (ops.bench, open loop, Poisson, the
seed's arrivals), goodput at the SLO, the engines' own prefix hit rate (meshserve: its
usage events; peers: the sims' ``vllm:prefix_cache_*`` counters) and busiest/idlest
mean outstanding tokens per sim (gauges / ``/get_load`` sampled every 50 ms). Each as the
median and the worst over the seeds (``routing.sweep_cells``): a single seed can land a
cache-aware policy on either side of its cliff.

    make peers                                             # installs .venv-tools/peers
    .venv/bin/python benchmarks/peers.py --scenario shared-prefix --seeds 1,2,3,4,5
    .venv/bin/python benchmarks/peers.py --systems meshserve,vllm-rr --seeds 1 --duration 10   # a quick look

Latencies are the clients', converted to simulated time (× speed), as in routing.py.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import overload
import routing

from ops.bench import EndpointConfig, run_bench
from ops.bench.plots import _plt
from ops.natsserver import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Peer:
    binary: str  # in --peers-bin
    args: tuple[str, ...]
    load_format: str = "vllm"  # the /get_load shape its power_of_two reads
    kv_events: bool = False  # vllm-router kv_aware: the sims publish KV events, it subscribes


TUNED = ("--cache-threshold", "0.3", "--balance-abs-threshold", "8", "--balance-rel-threshold", "1.2")
PEERS: dict[str, Peer] = {
    "vllm-rr": Peer("vllm-router", ("--policy", "round_robin")),
    "vllm-p2c": Peer("vllm-router", ("--policy", "power_of_two")),
    "vllm-cache": Peer("vllm-router", ("--policy", "cache_aware")),
    "vllm-cache-tuned": Peer("vllm-router", ("--policy", "cache_aware", *TUNED)),
    "vllm-kv": Peer("vllm-router", ("--policy", "kv_aware", "--kv-event-block-size", "16"), kv_events=True),
    "sglang-cache": Peer("smg", ("--policy", "cache_aware"), load_format="sglang"),
    "sglang-cache-tuned": Peer("smg", ("--policy", "cache_aware", *TUNED), load_format="sglang"),
    "sglang-p2c": Peer("smg", ("--policy", "power_of_two"), load_format="sglang"),
}
# meshserve's own: its default (prefix) and round robin, which isolates the path from the
# policy when set beside vllm-rr (the same assignment rule on the same fleet)
MESHSERVE = {"meshserve": "prefix", "meshserve-rr": "round_robin"}
SYSTEMS = (*MESHSERVE, *PEERS)


class Fleet:
    """``n`` sim-servers as processes, and a peer router in front of them."""

    def __init__(self, n: int, peer: Peer, sim_args: list[str], args: argparse.Namespace, state: Path) -> None:
        self.n, self.peer, self.sim_args, self.args, self.state = n, peer, sim_args, args, state
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.kv: list[tuple[str, str]] = []  # (events, replay) endpoints per sim
        self.router_url = ""
        self._ports: set[int] = set()

    def _port(self) -> int:
        """A free port none of this fleet's processes was given: the sims bind theirs only
        once started, so the kernel may hand a port out twice before then."""
        while (port := free_port()) in self._ports:
            pass
        self._ports.add(port)
        return port

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.state / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    async def start(self, http: aiohttp.ClientSession) -> None:
        for i in range(self.n):
            port = self._port()
            argv = [sys.executable, "-m", "ops.cli", "sim-server", "--port", str(port), "--model", routing.MODEL,
                    "--speed", str(self.args.speed), *self.sim_args, "--load-format", self.peer.load_format,
                    "--seed", str(i)]
            if self.peer.kv_events:
                kv, replay = f"tcp://127.0.0.1:{self._port()}", f"tcp://127.0.0.1:{self._port()}"
                argv += ["--kv-events", kv, "--kv-events-replay", replay]
                self.kv.append((kv, replay))
            self._spawn(f"sim-{i}", argv)
            self.urls.append(f"http://127.0.0.1:{port}")
        for url in self.urls:
            await _wait_ok(http, url + "/health", 60, "a sim-server", self)
        port = self._port()
        binary = str(Path(self.args.peers_bin) / self.peer.binary)
        argv = [binary, *(["launch"] if self.peer.binary == "smg" else []), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *self.urls, *self.peer.args, "--worker-startup-check-interval", "1",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self._port()), "--disable-retries",
                "--log-level", "warn" if self.peer.binary == "smg" else "warning"]
        if self.peer.kv_events:
            argv += ["--kv-event-model", routing.MODEL]
            for url, (kv, replay) in zip(self.urls, self.kv, strict=True):
                argv += ["--kv-event-source", f"{url}={kv}", "--kv-event-replay-source", f"{url}={replay}"]
        self._spawn("router", argv)
        self.router_url = f"http://127.0.0.1:{port}"
        await _wait_ok(http, self.router_url + "/v1/models", 60, "the router", self)

    def dead(self) -> str:
        """The processes that exited, as ``name exited code``."""
        return ", ".join(f"{Path(str(p.args[0] if isinstance(p.args, list) else p.args)).name} exited {p.returncode}"
                         for p in self.procs if p.poll() is not None)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


async def _wait_ok(http: aiohttp.ClientSession, url: str, timeout: float, what: str, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        if fleet.dead():
            raise RuntimeError(f"{what} did not start ({fleet.dead()}); logs in {fleet.state}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {url} not ready after {timeout:.0f} s; logs in {fleet.state}")
        await asyncio.sleep(0.2)


class LoadSampler:
    """Each sim's outstanding tokens (running + queued prefill, its ``/get_load`` in
    sglang's shape) every ``period_s``: the same quantity routing.GaugeSampler reads from
    the mesh workers' gauges."""

    def __init__(self, http: aiohttp.ClientSession, urls: list[str], period_s: float = 0.05) -> None:
        self.http, self.urls, self.period_s = http, urls, period_s
        self.samples: dict[str, list[int]] = {u: [] for u in urls}
        self._task: asyncio.Task[None] | None = None

    async def _one(self, url: str) -> None:
        async with self.http.get(url + "/get_load?format=sglang", timeout=aiohttp.ClientTimeout(total=1)) as r:
            self.samples[url].append(sum(int(rank["num_tokens"]) for rank in await r.json()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await asyncio.gather(*(self._one(u) for u in self.urls), return_exceptions=True)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return {u: statistics.fmean(v) for u, v in self.samples.items() if v}


async def prefix_counters(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """Σ prefix cache hits and queries (tokens) over the sims' /metrics."""
    hits = queries = 0.0
    for url in urls:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        hits += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
        queries += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M))
    return hits, queries


async def run_peer(sc: routing.Scenario, system: str, args: argparse.Namespace, load: float,
                   seed: int) -> dict[str, Any]:
    peer = PEERS[system]
    state = Path(tempfile.mkdtemp(prefix=f"meshserve-peers-{system}-"))
    fleet = Fleet(args.workers, peer, ["--num-kv-blocks", str(sc.kv_blocks), "--max-model-len", "16384"], args, state)
    fleet_rate = args.capacity or sc.capacity
    sim_rates = [load * fleet_rate]
    async with aiohttp.ClientSession() as http:
        try:
            await fleet.start(http)
            sampler = LoadSampler(http, fleet.urls)
            sampler.start()
            config = routing.bench_config(sc, args, EndpointConfig(fleet.router_url + "/v1", label=system,
                                                                   api="completions", model=routing.MODEL,
                                                                   api_key="unused"), sim_rates, seed)
            t0 = time.monotonic()
            result = await run_bench(config)
            wall = time.monotonic() - t0
            outstanding = await sampler.stop()
            hits, queries = await prefix_counters(http, fleet.urls)
        finally:
            fleet.stop()
    run = result.runs[0]
    busiest = max(outstanding.values(), default=0.0)
    idlest = min(outstanding.values(), default=0.0)
    return {
        "scenario": sc.name, "policy": system, "rate": sim_rates[0] * args.speed, "load": load, "seed": seed,
        "wall_s": wall, "summary": run.summary, "client": run.client,
        "hit_rate": hits / queries if queries else 0.0,
        "outstanding": outstanding, "imbalance": busiest / idlest if idlest > 0 else math.inf,
        "busiest": busiest, "idlest": idlest, "router": {},
    }


async def run_system(sc: routing.Scenario, system: str, args: argparse.Namespace, load: float,
                     seed: int) -> dict[str, Any]:
    if system in MESHSERVE:
        row = await routing.run_policy(sc, MESHSERVE[system], args, load=load, seed=seed)
        row["policy"] = system
        return row
    return await run_peer(sc, system, args, load, seed)


# Beside routing.SWEEP_METRICS: TPOT and errors, which the issue reports per system.
PEER_METRICS: dict[str, tuple[Any, Any]] = {
    **routing.SWEEP_METRICS,
    "ttft_p50_ms": (lambda r, speed: (r["summary"].ttft_ms.p50 or math.inf) * speed, max),
    "ttft_p99_ms": (lambda r, speed: (r["summary"].ttft_ms.p99 or math.inf) * speed, max),
    "tpot_p50_ms": (lambda r, speed: (r["summary"].tpot_ms.p50 or math.inf) * speed, max),
    "tpot_p99_ms": (lambda r, speed: (r["summary"].tpot_ms.p99 or math.inf) * speed, max),
    "errors": (lambda r, speed: float(sum(r["summary"].errors.values())), max),
}


def cells(rows: list[dict[str, Any]], speed: float) -> list[dict[str, Any]]:
    saved = dict(routing.SWEEP_METRICS)
    routing.SWEEP_METRICS.clear()
    routing.SWEEP_METRICS.update(PEER_METRICS)
    try:
        return routing.sweep_cells(rows, speed)
    finally:
        routing.SWEEP_METRICS.clear()
        routing.SWEEP_METRICS.update(saved)


def table(cs: list[dict[str, Any]], order: list[str]) -> str:
    def f(c: dict[str, Any], name: str, spec: str) -> str:
        m = c[name]
        return f"{m['median']:{spec}} / {m['worst']:{spec}}"

    lines = ["| system | load | TTFT p50 | p90 | p99 ms | TPOT p50 | p99 ms | goodput req/s | SLO met | prefix hit "
             "| busiest/idlest | errors |", "| --- | ---: |" + " ---: |" * 10]
    for c in sorted(cs, key=lambda c: (c["load"], order.index(c["policy"]))):
        lines.append(
            f"| {c['policy']} | {c['load']:.0%} | {f(c, 'ttft_p50_ms', ',.0f')} | {f(c, 'ttft_p90_ms', ',.0f')} "
            f"| {f(c, 'ttft_p99_ms', ',.0f')} | {f(c, 'tpot_p50_ms', ',.0f')} | {f(c, 'tpot_p99_ms', ',.0f')} "
            f"| {f(c, 'goodput', '.1f')} | {f(c, 'slo_met', '.0%')} | {f(c, 'hit_rate', '.0%')} "
            f"| {f(c, 'imbalance', '.2f')} | {f(c, 'errors', '.0f')} |")
    return "\n".join(lines)


def plot(cs: list[dict[str, Any]], order: list[str], path: Path) -> Path:
    """TTFT p50/p90/p99 per system (median over seeds, the worst seed as a whisker)."""
    plt = _plt()
    loads = sorted({c["load"] for c in cs})
    fig, axes = plt.subplots(1, len(loads), figsize=(max(6, 5 * len(loads)), 4.5), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        row = sorted((c for c in cs if c["load"] == load), key=lambda c: order.index(c["policy"]))
        xs = range(len(row))
        for k, (name, label) in enumerate((("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99"))):
            med = [c[name]["median"] for c in row]
            worst = [c[name]["worst"] for c in row]
            ax.bar([x + (k - 1) * 0.27 for x in xs], med, 0.27, label=label, color=f"C{k}",
                   yerr=[[0] * len(row), [w - m for w, m in zip(worst, med, strict=True)]], capsize=2)
        ax.set_xticks(list(xs), [c["policy"] for c in row], rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{cs[0]['scenario']} at {load:.0%}: TTFT (ms, simulated)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --scenario overload: premium and standard traffic, distinct prompts, at --overload × the
# fleet's capacity (benchmarks/overload.py's workload, arrivals and SLOs). meshserve runs
# its admission service; the peers have none, so their sims schedule by vLLM's request
# priority instead (--scheduling-policy priority, premium first): the most a peer fleet can
# do for premium traffic without admission.
OVERLOAD = "overload"
PEER_PRIORITY = {"premium": 0, "standard": 1}  # vLLM's: lower runs first


def overload_args(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """overload.py's settings (its defaults), with this run's fleet, speed, duration and seed."""
    ov = overload.arg_parser().parse_args([])
    ov.workers, ov.speed, ov.duration, ov.seed = args.workers, args.speed, args.duration, seed
    return ov


async def run_overload(system: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One system at ``--overload``: per tier, its client's run result."""
    ov = overload_args(args, seed)
    if system == "meshserve":
        case = await overload.run_case(True, args.overload, ov)
        return {"policy": system, "seed": seed, "runs": case["runs"]}
    peer = PEERS[system]
    state = Path(tempfile.mkdtemp(prefix=f"meshserve-peers-{system}-"))
    sim_args = ["--max-model-len", "16384", "--max-num-batched-tokens", str(ov.max_num_batched_tokens),
                "--scheduling-policy", "priority"]
    fleet = Fleet(args.workers, peer, sim_args, args, state)
    async with aiohttp.ClientSession() as http:
        try:
            await fleet.start(http)
            results = await asyncio.gather(*(run_bench(overload.tier_config(
                tier, fleet.router_url + "/v1", "unused", args.overload, ov, {"priority": PEER_PRIORITY[tier]}))
                for tier in overload.TIERS))
        finally:
            fleet.stop()
    return {"policy": system, "seed": seed, "runs": {t: r.runs[0] for t, r in zip(overload.TIERS, results, strict=True)}}


def _overload_metrics(run: Any, speed: float) -> dict[str, float]:
    s = run.summary
    sent = max(s.requests, 1)
    return {"refused": s.errors.get("429", 0) / sent, "other_errors": float(sum(s.errors.values()) - s.errors.get("429", 0)),
            "ttft_p50_ms": (s.ttft_ms.p50 or math.inf) * speed, "ttft_p90_ms": (s.ttft_ms.p90 or math.inf) * speed,
            "ttft_p99_ms": (s.ttft_ms.p99 or math.inf) * speed, "goodput": (s.goodput or 0) / speed,
            "slo_sent": s.slo_attainment or 0.0, "slo_served": (s.slo_met or 0) / max(s.ok, 1)}


# the worse of two values, per metric: lower goodput and attainment, higher everything else
_OVERLOAD_WORSE_LOW = {"goodput", "slo_sent", "slo_served"}


def overload_table(rows: list[dict[str, Any]], order: list[str], speed: float) -> str:
    """Per system and tier (and the total), each metric's median / worst over the seeds."""
    lines = ["| system | tier | refused | other errors | TTFT p50 | p90 | p99 ms | goodput req/s | SLO met (sent) "
             "| SLO met (served) |", "| --- | --- |" + " ---: |" * 8]
    for system in sorted({r["policy"] for r in rows}, key=order.index):
        mine = [r for r in rows if r["policy"] == system]
        for tier in (*overload.TIERS, "total"):
            per_seed = [{"goodput": sum(_overload_metrics(run, speed)["goodput"] for run in r["runs"].values())}
                        if tier == "total" else _overload_metrics(r["runs"][tier], speed) for r in mine]

            def f(name: str, spec: str, per_seed: list[dict[str, float]] = per_seed) -> str:
                vals = [m[name] for m in per_seed]
                worst = min(vals) if name in _OVERLOAD_WORSE_LOW else max(vals)
                return f"{statistics.median(vals):{spec}} / {worst:{spec}}"

            if tier == "total":
                lines.append(f"| {system} | **total** | | | | | | **{f('goodput', '.1f')}** | | |")
                continue
            lines.append(f"| {system} | {tier} | {f('refused', '.0%')} | {f('other_errors', '.0f')} "
                         f"| {f('ttft_p50_ms', ',.0f')} | {f('ttft_p90_ms', ',.0f')} | {f('ttft_p99_ms', ',.0f')} "
                         f"| {f('goodput', '.1f')} | {f('slo_sent', '.0%')} | {f('slo_served', '.0%')} |")
    return "\n".join(lines)


async def overload_main(args: argparse.Namespace, systems: list[str], seeds: list[int]) -> None:
    rows: list[dict[str, Any]] = []
    total = len(systems) * len(seeds)
    for seed in seeds:
        for system in systems:
            row = await run_overload(system, args, seed)
            rows.append(row)
            parts = []
            for tier, run in row["runs"].items():
                m = _overload_metrics(run, args.speed)
                parts.append(f"{tier} refused {m['refused']:.0%}, TTFT p90 {m['ttft_p90_ms']:,.0f} ms, goodput "
                             f"{m['goodput']:.1f}, SLO met {m['slo_sent']:.0%} of sent / {m['slo_served']:.0%} of served")
            lag = max(run.client.lag_ms.p99 for run in row["runs"].values())
            print(f"[{len(rows)}/{total}] overload {system} seed {seed}: {'; '.join(parts)}; client lag p99 "
                  f"{lag:.1f} ms", flush=True)
    ov = overload_args(args, seeds[0])
    print(f"\noverload: {args.workers} sims, {args.overload:g}× {overload.fleet_capacity(ov) / args.speed:.1f} req/s "
          f"(distinct {ov.input_tokens}-token prompts, {ov.output_tokens} output tokens; {ov.premium_share:.0%} "
          f"premium), {args.duration:.0f} s of arrivals per run, speed {args.speed}; SLO TTFT premium ≤ "
          f"{overload.TIERS['premium'][0]} s, standard ≤ {overload.TIERS['standard'][0]} s, TPOT ≤ "
          f"{ov.slo_tpot * 1000:.0f} ms; median / worst over seeds {','.join(map(str, seeds))}\n")
    print(overload_table(rows, systems, args.speed), flush=True)
    if args.out:
        flat = [{"policy": r["policy"], "seed": r["seed"],
                 "tiers": {t: _overload_metrics(run, args.speed) for t, run in r["runs"].items()}} for r in rows]
        await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(flat))


def installed(args: argparse.Namespace, systems: list[str]) -> list[str]:
    missing = sorted({PEERS[s].binary for s in systems if s in PEERS
                      and not (Path(args.peers_bin) / PEERS[s].binary).exists()})
    return missing


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", choices=[*routing.SCENARIOS, OVERLOAD], default="shared-prefix",
                        help=f"{OVERLOAD}: premium and standard at --overload × capacity, meshserve with admission")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load over capacity (--scenario overload)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--loads", default="0.8", help="fractions of the scenario's capacity (routing.py's knee)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speed", type=float, default=0.25)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds (wall) of arrivals per run")
    parser.add_argument("--capacity", type=float, default=None, help="reference capacity (default: the scenario's)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT bound of goodput, simulated seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT bound of goodput, simulated seconds")
    parser.add_argument("--peers-bin", default=str(ROOT / ".venv-tools" / "peers" / "bin"),
                        help="where vllm-router and smg are (make peers)")
    parser.add_argument("--router-config", default=None,
                        help="meshserve's router config (TOML/JSON, as `meshserve router --config`); default: none")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    parser.add_argument("--plot-dir", default="results/peers")
    args = parser.parse_args()
    # what routing.run_policy reads besides the above
    args.load, args.seed = None, 1
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"unknown system(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        parser.error("--seeds takes integers and --loads fractions, comma-separated (e.g. 1,2,3 and 0.8)")
    if missing := installed(args, systems):
        parser.error(f"{', '.join(missing)} not found in {args.peers_bin}: run `make peers` (or pass --peers-bin)")
    if args.scenario == OVERLOAD:
        if "meshserve-rr" in systems:
            parser.error(f"{OVERLOAD} runs meshserve as deployed (prefix, admission on): leave out meshserve-rr")
        await overload_main(args, systems, seeds)
        print("versions: " + ", ".join(f"{k} {v}" for k, v in versions(args).items()))
        return
    sc = routing.SCENARIOS[args.scenario]
    rows: list[dict[str, Any]] = []
    total = len(systems) * len(loads) * len(seeds)
    for load in loads:
        for seed in seeds:  # seeds outermost within a load: a partial run still compares systems
            for system in systems:
                row = await run_system(sc, system, args, load, seed)
                rows.append(row)
                if args.out:  # after every run: a run that fails later loses nothing before it
                    await asyncio.to_thread(Path(args.out).write_bytes, msgspec.json.encode(rows))
                s = row["summary"]
                print(f"[{len(rows)}/{total}] {sc.name} {system} load {load:.0%} seed {seed}: TTFT p90 "
                      f"{routing._ms(s.ttft_ms.p90, args.speed)} ms, hit {row['hit_rate']:.0%}, goodput "
                      f"{(s.goodput or 0) / args.speed:.1f}, SLO met {s.slo_attainment or 0:.0%}, busiest/idlest "
                      f"{row['imbalance']:.2f}, errors {sum(s.errors.values())}, client lag p99 "
                      f"{row['client'].lag_ms.p99:.1f} ms{' LAGGED' if row['client'].lagged else ''}", flush=True)
    cs = cells(rows, args.speed)
    print(f"\n{sc.name}: {args.workers} sims, {args.duration:.0f} s of arrivals per run, speed {args.speed}; load as a "
          f"fraction of {args.capacity or sc.capacity:.1f} req/s ({sc.capacity_is}); median / worst over seeds "
          f"{','.join(map(str, seeds))}; SLO TTFT ≤ {args.slo_ttft} s, TPOT ≤ {args.slo_tpot * 1000:.0f} ms\n")
    print(table(cs, systems), flush=True)
    plot_dir = Path(args.plot_dir)
    await asyncio.to_thread(plot_dir.mkdir, parents=True, exist_ok=True)
    print(f"plot: {plot(cs, systems, plot_dir / f'peers-{sc.name}.png')}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions(args).items()))


def versions(args: argparse.Namespace) -> dict[str, str]:
    """The peers' package versions, for the table's caption."""
    py = Path(args.peers_bin) / "python"
    out: dict[str, str] = {}
    for pkg in ("vllm-router", "sglang-router"):
        try:
            out[pkg] = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version('{pkg}'))"],
                                      capture_output=True, text=True, timeout=30).stdout.strip() or "not installed"
        except OSError:
            out[pkg] = "not installed"
    return out


if __name__ == "__main__":
    asyncio.run(main())
