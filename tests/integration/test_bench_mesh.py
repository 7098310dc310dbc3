"""meshserve bench against meshserve itself, over HTTP and NATS on the same arrivals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ops.bench.report import latency_table
from ops.bench.results import load_result
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-llama-8b"


def test_short_sweep_against_the_mesh(tmp_path: Path) -> None:
    import asyncio

    mesh = Mesh(MeshConfig(state_dir=tmp_path / "mesh", nats_port=0, http_port=free_port(), model=MODEL, workers=2, speed=10.0))
    asyncio.run(mesh.start(timeout=90))
    try:
        out = tmp_path / "bench"
        run = subprocess.run(
            [sys.executable, "-m", "ops.cli", "bench", "--target", f"http={mesh.gateway_url}/v1",
             "--target", f"nats={mesh.nats_url}", "--api", "completions", "--model", MODEL, "--api-key", mesh.dev_key,
             "--rates", "4,8", "-n", "12", "--input-tokens", "uniform:50:200", "--output-tokens", "16",
             "--slo-ttft", "2", "--slo-tpot", "0.2", "--out", str(out), "--no-progress", "--seed", "3"],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "Latency (ms)" in run.stdout and "goodput" in run.stdout.lower()
        result = load_result(out / "results.json")
        assert {r.endpoint for r in result.runs} == {"http", "nats"}
        for r in result.runs:
            assert r.summary.ok == 12, (r.endpoint, r.summary.errors)
            assert all(q.output_tokens == 16 and q.ttft_s is not None for q in r.requests)
        # stdout is a pipe here, as in `bench > file`: every latency is printed whole, not cut to "…"
        assert "…" not in run.stdout
        latencies = [str(cell) for column in latency_table(result).columns[2:] for cell in column.cells]
        assert len(latencies) == 12 * len(result.runs) and all(cell in run.stdout for cell in latencies)
        # the two targets saw the same prompts
        by_endpoint = {(r.endpoint, r.rate): [q.input_tokens for q in r.requests] for r in result.runs}
        assert by_endpoint[("http", 4.0)] == by_endpoint[("nats", 4.0)]
        for name in ("ttft_vs_load.png", "tpot_vs_load.png", "ttft_cdf.png", "goodput_vs_load.png"):
            assert (out / name).stat().st_size > 1000
    finally:
        mesh.stop(timeout=30)
