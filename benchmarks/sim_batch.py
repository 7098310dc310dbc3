"""Sim engine: output tokens/s and TPOT against batch size, three ways.

For each batch size B, B requests of fixed length (``--input-len`` prompt tokens,
``--output-len`` output tokens, ignore_eos) arrive together, and we report:

- intended: the figures the profile was fitted to (steady decode, from its JSON);
- sim: the pure core (``SimCore``) in simulated time, deterministic;
- measured: ``SimEngine`` at ``--speed`` (1.0 = real time) in wall-clock time, as a
  client of the engine sees it, Python and event-loop overhead included.

Columns: ``decode tok/s`` is the output rate while all B sequences decode (from the
last first token to the first finish), comparable with the intended steady state;
``TPOT`` is the mean over requests of (last token − first token) / (tokens − 1), which
also pays for the long mixed steps while other prompts prefill; ``ITL p50`` the median
gap between tokens; ``run tok/s`` all output over the whole run (prefill included).

    .venv/bin/python benchmarks/sim_batch.py            # about 30 s at speed 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto.messages import SamplingParams
from services.worker.engines.base import EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_core import SimCore
from services.worker.engines.sim_profile import IntendedPoint, SimConfig, load_profile


@dataclass
class Figures:
    decode_tok_s: float
    tpot_ms: float
    itl_p50_ms: float
    run_tok_s: float


@dataclass
class Row:
    batch: int
    wall_s: float
    sim: Figures
    measured: Figures
    intended: IntendedPoint | None


def figures(arrivals: dict[str, list[float]], start: float) -> Figures:
    """Figures from each request's token arrival times (any clock, seconds)."""
    window_start = max(ts[0] for ts in arrivals.values())
    window_end = min(ts[-1] for ts in arrivals.values())
    in_window = sum(1 for ts in arrivals.values() for t in ts if window_start < t <= window_end)
    decode = in_window / (window_end - window_start) if window_end > window_start else float("nan")
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in arrivals.values()]
    gaps = [b - a for ts in arrivals.values() for a, b in itertools.pairwise(ts)]
    end = max(ts[-1] for ts in arrivals.values())
    total = sum(len(ts) for ts in arrivals.values())
    return Figures(
        decode_tok_s=decode,
        tpot_ms=1000 * statistics.fmean(tpots),
        itl_p50_ms=1000 * statistics.median(gaps),
        run_tok_s=total / (end - start),
    )


def requests(batch: int, input_len: int, output_len: int) -> list[EngineRequest]:
    # Distinct prompts, so the prefix cache does not flatter larger batches.
    return [
        EngineRequest(
            request_id=f"b{batch}-{i}",
            prompt_token_ids=[3 + 32 + ((i * 131 + j * 7) % 90) for j in range(input_len)],
            sampling=SamplingParams(max_tokens=output_len, ignore_eos=True),
        )
        for i in range(batch)
    ]


def simulate(profile: str, reqs: list[EngineRequest]) -> Figures:
    core = SimCore(SimConfig.build(profile))
    for r in reqs:
        assert core.add_request(r, 0.0) is None
    arrivals: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    now = 0.0
    while (res := core.step(now)) is not None:
        now = res.end
        for out in res.outputs:
            arrivals[out.request_id].extend([res.end] * len(out.new_token_ids))
    return figures(arrivals, 0.0)


async def measure(profile: str, speed: float, reqs: list[EngineRequest]) -> Figures:
    arrivals: dict[str, list[float]] = {r.request_id: [] for r in reqs}

    async def consume(eng: SimEngine, r: EngineRequest) -> None:
        async for out in eng.generate(r):
            t = time.monotonic()
            arrivals[r.request_id].extend([t] * len(out.new_token_ids))

    async with SimEngine(profile=profile, speed=speed) as eng:
        start = time.monotonic()
        await asyncio.gather(*(consume(eng, r) for r in reqs))
    # Figures in simulated seconds, so they compare with the other columns at any speed.
    scaled = {rid: [(t - start) * speed for t in ts] for rid, ts in arrivals.items()}
    return figures(scaled, 0.0)


def fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    prof = load_profile(args.profile)
    intended = {p.batch: p for p in prof.intended}
    rows: list[Row] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        sim = simulate(args.profile, requests(batch, args.input_len, args.output_len))
        wall0 = time.monotonic()
        measured = await measure(args.profile, args.speed, requests(batch, args.input_len, args.output_len))
        wall = time.monotonic() - wall0
        rows.append(Row(batch, wall, sim, measured, intended.get(batch)))
        print(f"batch {batch}: {wall:.1f} s wall", file=sys.stderr)

    print(f"profile {prof.name}, {args.input_len} in / {args.output_len} out, ignore_eos, speed {args.speed}")
    print()
    print(
        "| batch | decode tok/s intended | sim | measured | TPOT ms intended | sim | measured "
        "| ITL p50 ms sim | measured | run tok/s sim | measured |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        s, m, i = row.sim, row.measured, row.intended
        print(
            f"| {row.batch} | {fmt(i.output_tokens_per_s) if i else '-'} | {fmt(s.decode_tok_s)} "
            f"| {fmt(m.decode_tok_s)} | {fmt(i.tpot_ms, 1) if i else '-'} | {fmt(s.tpot_ms, 1)} "
            f"| {fmt(m.tpot_ms, 1)} | {fmt(s.itl_p50_ms, 1)} | {fmt(m.itl_p50_ms, 1)} "
            f"| {fmt(s.run_tok_s)} | {fmt(m.run_tok_s)} |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    asyncio.run(main())
