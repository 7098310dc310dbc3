"""What the fleet cost beside what it served, through the whole mesh: sim workers report
their accelerator time, metering prices it, and ``meshserve usage --fleet`` answers.

Real processes (``meshserve up``'s machinery) on a real nats-server; requests from the
stock ``openai`` client; the report read with the real CLI, as an operator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ops.up import Mesh
from tests.conftest import running_mesh

REPO = Path(__file__).resolve().parents[2]
MODEL = "sim-llama-8b"
PRICES = """
currency = "USD"
[models."sim-llama-8b"]
input = 0.10
output = 0.40
[accelerators."H100"]      # matches the sim profile's "H100-80GB" by name
per_hour = 3.60            # 0.001 a second
"""


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    with running_mesh(tmp_path / "mesh", workers=2, speed=20.0, worker_args=["--capacity-interval", "600"],
                      service_args={"metering": ["--prices", str(prices)]}) as m:
        yield m


def fleet(mesh: Mesh, *args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "ops.cli", "usage", "--fleet", "--nats-url", mesh.nats_url, *args],
                          cwd=REPO, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def fleet_json(mesh: Mesh, *args: str) -> list[dict[str, Any]]:
    rc, out, err = fleet(mesh, "--json", *args)
    assert rc == 0, err
    rows: list[dict[str, Any]] = json.loads(out)["data"]
    return rows


def wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def test_fleet_report_prices_the_workers_time_and_sets_it_beside_their_usage(mesh: Mesh) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.config.http_port}/v1", api_key=mesh.dev_key)

    async def traffic() -> tuple[int, int]:
        async def one(i: int) -> tuple[int, int]:
            done = await client.completions.create(model=MODEL, prompt=f"request {i} " * 20, max_tokens=16,
                                                   extra_body={"ignore_eos": True})
            assert done.usage is not None
            return done.usage.prompt_tokens, done.usage.completion_tokens

        try:
            results = await asyncio.gather(*(one(i) for i in range(40)))
        finally:
            await client.close()
        return sum(p for p, _ in results), sum(c for _, c in results)

    prompt, completion = asyncio.run(traffic())
    # Periods are 10 min here, so within the test only a stop reports: a worker that stops
    # reports its last, shorter period, and its time runs to its stop.
    worker = next(p for p in mesh.processes if p.label == "worker-1")
    info = next(w for w in mesh.workers if w.worker_id.endswith("-w1"))
    worker.terminate()
    assert worker.proc is not None
    worker.proc.wait(timeout=60)
    lived = time.time() - info.started_at

    def worker_1() -> dict[str, Any] | None:
        found = [r for r in fleet_json(mesh, "--group-by", "worker,accelerator") if r["worker_id"] == info.worker_id]
        return found[0] if found else None

    row = wait_for(worker_1, "the stopped worker's last period")
    assert lived - 0.5 <= row["replica_s"] <= lived
    assert row["accelerator"] == "H100-80GB"  # the sim profile's
    # one H100 per sim replica, held whole: accelerator time is replica time
    assert row["accelerator_s"] == pytest.approx(row["replica_s"])
    assert 0 < row["busy_s"] < row["replica_s"] and 0 < row["requests"] <= 40
    # 0.001 a second (3.60 an hour), rounded to a nano unit
    assert abs(row["cost_nano"] - row["accelerator_s"] * 1_000_000) <= 1
    assert row["cost_per_million_tokens"] == pytest.approx(
        row["cost"] / (row["prompt_tokens"] + row["completion_tokens"]) * 1e6)
    assert row["margin"] == pytest.approx(row["spend"] - row["cost"])

    # Usage is the whole pool's, whichever worker served it.
    (pool,) = fleet_json(mesh, "--group-by", "model")
    assert (pool["model"], pool["requests"]) == (MODEL, 40)
    assert (pool["prompt_tokens"], pool["completion_tokens"]) == (prompt, completion)
    assert pool["spend_nano"] == prompt * 100 + completion * 400  # 0.10 / 0.40 per million, in nano
    assert pool["replica_s"] == row["replica_s"]  # the other worker has not reported yet

    # The table, as people read it; a bad flag is a usage error, not a traceback.
    rc, out, err = fleet(mesh, "--group-by", "model,accelerator")
    assert rc == 0, err
    assert "H100-80GB" in out and "cost (USD)" in out and "margin (USD)" in out
    rc, out, err = fleet(mesh, "--org", "acme")
    assert rc == 2 and "not per customer" in err
    rc, out, err = fleet(mesh, "--group-by", "org")
    assert rc == 2 and "unknown group_by" in err
