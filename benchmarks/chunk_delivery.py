"""What chunk delivery costs, side by side in one run on the same machine:

- ``none``: chunks published at most once, nothing kept (``--chunk-retention 0``): a chunk
  lost before TOKENS stalls its stream into a migration;
- ``resend`` (the default): the worker keeps what it published (``--chunk-retention 10``)
  and sends a chunk again when a gateway finds it missing from TOKENS.

Acking every chunk instead (JetStream async publish, acks checked off the hot path,
resent when unacked) was measured with this script in commit 9794977 and rejected; its
figures are in RELIABILITY.md.

For each mode, a fresh mesh: the added latency of sequential requests (client TTFT minus
the worker's own, as ``benchmarks/gateway.py`` measures it) on a real-time sim worker,
then the relay rate through one gateway at 64 and 512 closed-loop streams on fast sim
workers, with the worker processes' CPU (the side that keeps the chunks).
The modes alternate (none, resend, none, resend) so drift on a shared machine hits both.

Run: ``.venv/bin/python benchmarks/chunk_delivery.py [--requests 100] [--duration 15]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root

from benchmarks.gateway import _cpu_seconds, added_latency, relay
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig

MODEL = "sim-llama-8b"
MODES = ("none", "resend")
RETENTION = {"none": "0", "resend": "10"}


def _workers_cpu(mesh: Mesh) -> float:
    return sum(_cpu_seconds(p.proc.pid) for p in mesh.processes if p.name == "worker" and p.proc is not None)


async def one_mode(tmp: Path, mode: str, requests: int, duration: float) -> dict[str, float]:
    out: dict[str, float] = {}
    mesh = Mesh(MeshConfig(state_dir=tmp / f"lat-{mode}", nats_port=0, http_port=free_port(), model=MODEL, workers=1,
                           speed=1.0, worker_args=["--chunk-retention", RETENTION[mode]]))
    await mesh.start()
    try:
        client, worker = await added_latency(mesh, requests)
    finally:
        mesh.stop()
    added = (client - worker) * 1000
    out["added p50"], out["added p99"] = float(np.percentile(added, 50)), float(np.percentile(added, 99))
    mesh = Mesh(MeshConfig(state_dir=tmp / f"relay-{mode}", nats_port=0, http_port=free_port(), model=MODEL, workers=2,
                           speed=50.0, worker_args=["--chunk-retention", RETENTION[mode], "--max-num-seqs", "512",
                                                    "--num-kv-blocks", "200000"]))
    await mesh.start()
    try:
        for streams in (64, 512):
            cpu0, t0 = _workers_cpu(mesh), time.monotonic()
            tps, _, itl = await relay(mesh, streams, duration)
            out[f"tok/s {streams}"] = tps
            out[f"worker CPU {streams}"] = (_workers_cpu(mesh) - cpu0) / (time.monotonic() - t0)
            out[f"ITL p50 {streams}"] = itl
    finally:
        mesh.stop()
    return out


async def main(requests: int, duration: float, rounds: int) -> None:
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in MODES:
                results[mode].append(await one_mode(Path(tmp) / f"{r}", mode, requests, duration))
    keys = list(results[MODES[0]][0])
    print(f"### Chunk delivery: {' vs '.join(MODES)} ({rounds} alternating rounds each, medians)\n")
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for mode in MODES:
        cells = [float(np.median([run[k] for run in results[mode]])) for k in keys]
        print(f"| {mode} | " + " | ".join(f"{c:,.0f}" if c >= 100 else f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import uvloop

    uvloop.run(main(args.requests, args.duration, args.rounds))
