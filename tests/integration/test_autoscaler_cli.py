"""``meshserve serve autoscaler`` as a process: configuration parsing, and the command line
``meshserve up`` uses (local driver, sim workers) brought up and stopped for real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus import Bus
from ops.cli import build_parser
from ops.processes import running
from ops.status import fetch_status
from proto.errors import MeshError
from services.autoscaler.control import ScheduleWindow
from services.autoscaler.drivers import ComposeDriver, LocalDriver, NomadDriver
from services.autoscaler.main import build

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "autoscaler", *argv])


def test_flags_apply_to_every_pool_and_config_overrides(tmp_path: Path) -> None:
    config_file = tmp_path / "autoscaler.json"
    config_file.write_text(json.dumps({
        "tick_s": 2.0,
        "pools": {
            "meta-llama/Llama-3.1-8B-Instruct": {
                "min_replicas": 2, "warm_buffer": 1, "timezone": "Europe/Paris",
                "schedule": [{"start_hour": 8, "end_hour": 18, "min_replicas": 4}],
                "worker_args": ["--engine", "vllm"],
            },
        },
    }))
    args = parse("--pool", "sim-a", "--config", str(config_file), "--max-replicas", "6", "--cooldown", "60",
                 "--worker-args", "--gauge-interval 0.5", "--state-dir", str(tmp_path / "state"))
    config, driver = build(args)
    assert config.tick_s == 2.0
    big, sim = sorted(config.pools, key=lambda p: p.pool)
    assert (big.pool, big.min_replicas, big.max_replicas, big.warm_buffer, big.scale_down_cooldown_s) == (
        "meta-llama/Llama-3.1-8B-Instruct", 2, 6, 1, 60.0)
    assert big.schedule == (ScheduleWindow(8, 18, 4),) and big.timezone == "Europe/Paris"
    assert (sim.pool, sim.min_replicas, sim.max_replicas) == ("sim-a", 1, 6)
    assert isinstance(driver, LocalDriver)
    assert driver.args_for("sim-a") == ["--gauge-interval", "0.5"]
    assert driver.args_for("meta-llama/Llama-3.1-8B-Instruct") == ["--gauge-interval", "0.5", "--engine", "vllm"]
    assert driver.log_dir == tmp_path / "state" / "logs"
    # its workers join the mesh the autoscaler was told of on its command line
    _, driver = build(parse("--pool", "m", "--nats-url", "nats://10.9.8.7:4222", "--root", "mesh2", "--log-level", "DEBUG"))
    assert isinstance(driver, LocalDriver) and driver.env is not None
    assert (driver.env["MESHSERVE_NATS_URL"], driver.env["MESHSERVE_ROOT"], driver.env["MESHSERVE_LOG_LEVEL"]) == (
        "nats://10.9.8.7:4222", "mesh2", "DEBUG")


def test_orchestrator_drivers_from_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({"pools": {"m2": {"nomad_job": "job-m2", "compose_service": "worker-m2"}}}))
    _, nomad = build(parse("--pool", "m1", "--config", str(config_file), "--driver", "nomad", "--nomad-addr",
                           "http://nomad:4646", "--nomad-token", "t", "--nomad-job", "m1=job-m1"))
    assert isinstance(nomad, NomadDriver)
    assert (nomad.job_id("m1"), nomad.job_id("m2"), nomad.job_id("other/Model-X")) == ("job-m1", "job-m2", "meshserve-model-x")
    assert nomad.address == "http://nomad:4646" and nomad.token == "t"
    _, compose = build(parse("--pool", "m1", "--config", str(config_file), "--driver", "compose", "--compose-project",
                             "prod", "--compose-file", "a.yaml"))
    assert isinstance(compose, ComposeDriver)
    assert (compose.service("m1"), compose.service("m2"), compose.files) == ("worker", "worker-m2", ["a.yaml"])


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="at least one pool"):
        build(parse())
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({"pools": {"m": {"min_replica": 2}}}))
    with pytest.raises(SystemExit, match="unknown settings"):
        build(parse("--config", str(config_file)))
    with pytest.raises(SystemExit, match="MODEL=VALUE"):
        build(parse("--pool", "m", "--driver", "nomad", "--nomad-job", "m"))
    with pytest.raises(SystemExit, match="min_replicas"):
        build(parse("--pool", "m", "--min-replicas", "5", "--max-replicas", "2"))
    # The config file's own mistakes: one line each, never a traceback.
    with pytest.raises(SystemExit, match=r"--config .*missing\.json: No such file or directory"):
        build(parse("--config", str(tmp_path / "missing.json")))
    config_file.write_text("{pools: ")
    with pytest.raises(SystemExit, match=r"--config .*: not JSON"):
        build(parse("--config", str(config_file)))
    for bad in ({"pools": {"m": {"target_utilization": 1.5}}}, {"pools": {"m": {"schedule": [{"start_hour": 30}]}}},
                {"pools": {"m": {}}, "tick_s": "fast"}, ["not", "an", "object"]):
        config_file.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match="bad autoscaler configuration"):
            build(parse("--config", str(config_file)))
    config_file.write_text(json.dumps({"pools": {"m": {"timezone": "Mars/Olympus"}}}))
    with pytest.raises(SystemExit, match="unknown timezone"):
        build(parse("--config", str(config_file)))


@pytest.mark.parametrize(("flag", "value"), [
    ("--target-utilization", "1.5"), ("--max-replicas", "0"), ("--history", "-1"), ("--tick", "nan"),
    ("--cooldown", "nan"), ("--idle-to-zero", "-1"), ("--drain-timeout", "inf"), ("--min-replicas", "-1"),
])
def test_bad_flags_exit_2_naming_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--pool", "m", flag, value)
    assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


async def test_autoscaler_process_with_local_driver(tmp_path: Path, bus: Bus, nats_url: str) -> None:
    """The command line to hand ``meshserve up``: it starts the pool's minimum of sim
    workers, answers ``meshserve status``, and on SIGTERM drains its workers and exits 0."""
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url, "PYTHONUNBUFFERED": "1"}
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "ops.cli", "serve", "autoscaler", "--driver", "local", "--pool", "sim-cli",
            "--min-replicas", "2", "--max-replicas", "4", "--state-dir", str(state),
            "--worker-args", "--engine sim --speed 20 --drain-timeout 10", "--max-workers", "4", "--tick", "0.5"]
    log_path = tmp_path / "autoscaler.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status = await fetch_status(bus, timeout=1.0)
                if status.pools and status.pools[0].ready == 2:
                    break
            except MeshError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"autoscaler did not bring up 2 workers:\n{log_path.read_text()[-3000:]}")
            await asyncio.sleep(0.3)
        (pool,) = status.pools
        assert pool.pool == "sim-cli" and pool.desired == 2
        assert all(w.managed and w.state == "ready" for w in pool.workers) and len(pool.workers) == 2
        assert status.driver.name == "local" and status.driver.ok
        assert all((state / "logs" / f"autoscaler-{w.worker_id}.log").exists() for w in pool.workers)
        pids = await asyncio.to_thread(_worker_pids)
        assert len(pids) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    assert code == 0, log_path.read_text()[-3000:]
    for pid in pids:
        assert not running(pid), f"worker pid {pid} outlived the autoscaler"


def _worker_pids() -> list[int]:
    """Pids of this test's sim-cli workers (from /proc, by command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sim-cli" in cmdline and b"worker" in cmdline and b"--worker-id" in cmdline:
            pids.append(int(entry.name))
    return pids
