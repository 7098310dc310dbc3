"""A mesh of processes with one vLLM worker on the tiny model, for the tests of this folder.

A worker runs ``--engine vllm`` (vLLM's CPU build) next to a router, a gateway and
metering on a real nats-server (``ops.up.Mesh``). vLLM's CPU build needs x86 with AVX2
(or AVX-512), or Arm/PowerPC/s390x builds; on a processor it cannot run on, the worker
fails to start and the caller's test skips with the worker's log tail as the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from bus import Bus
from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig
from proto import WorkerGauge

MODEL = "tiny-llama"
BLOCK = 128  # vLLM's CPU build caches prefixes with 128-token blocks
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8


def cpu_unsupported() -> str | None:
    """Why vLLM's CPU build cannot run here, or None."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        if " avx2" not in flags and " avx512f" not in flags:
            return "this x86 processor has neither AVX2 nor AVX-512, which vLLM's CPU build needs"
    return None


# Guided JSON without free whitespace between tokens: random weights pick whitespace as
# often as anything allowed, and a JSON value would rarely end within a test's max_tokens.
# vLLM takes this per engine only (xgrammar or guidance), not per request.
COMPACT_JSON = {"backend": "xgrammar", "disable_any_whitespace": True}


def engine_flags() -> list[str]:
    """The engine's settings, as vLLM's own flags: the differential test starts vLLM's
    server with exactly these, so both run the same engine configuration."""
    return ["--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--enforce-eager"]


@contextmanager
def vllm_mesh(model_dir: Path, state_dir: Path, extra_worker_args: Sequence[str] = ()) -> Iterator[Mesh]:
    """Start the mesh (skipping where vLLM cannot run), wait until it is steady, yield it,
    stop it and check that the vLLM worker exited cleanly."""
    reason = cpu_unsupported()
    if reason:
        pytest.skip(reason)
    worker_args = [
        *engine_flags(), "--cpu-kvcache-space", "1", "--kv-events", "engine", "--gauge-interval", "0.1",
        *extra_worker_args,
    ]
    config = MeshConfig(
        state_dir=state_dir, nats_port=0, http_port=free_port(), model=MODEL, workers=1,
        engine="vllm", model_dir=str(model_dir),
        worker_args=worker_args, services=("worker", "router", "gateway", "metering"),
        gateway_args=["--stall-timeout", "60"],
        # vLLM's own CPU binding: OMP threads leave a core to its scheduler (and, here, to the
        # rest of the mesh); OMP_NUM_THREADS=all cores starved nats, router and gateway for seconds.
        extra_env={"VLLM_LOGGING_LEVEL": "WARNING"},
    )
    m = Mesh(config)
    t0 = time.monotonic()
    try:
        asyncio.run(m.start(timeout=300))
    except BaseException as exc:
        m.stop(timeout=20)
        log = m.log_dir / "worker-1.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        if "Illegal instruction" in tail or "not supported on this CPU" in tail.lower():
            pytest.skip(f"vLLM's CPU build cannot run on this processor: {tail[-500:]}")
        raise RuntimeError(f"mesh with a vLLM worker did not start: {exc}\n--- worker log tail ---\n{tail}") from exc
    m.start_seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    asyncio.run(settled(m))
    print(f"\nmesh with a vLLM worker ready in {m.start_seconds:.1f}s")  # type: ignore[attr-defined]
    yield m
    codes = m.stop(timeout=60)
    assert codes.get("worker-1") == 0, f"vLLM worker exited {codes.get('worker-1')} (logs in {m.log_dir})"


async def settled(mesh: Mesh, steady_s: float = 3.0, timeout_s: float = 60.0) -> None:
    """Wait until the worker's 0.1 s gauges arrive steadily for ``steady_s``. On this 2-core
    VM the seconds after vLLM's start can starve every other process of CPU (gauges,
    heartbeats and clients stall for 5-20 s); the timing-sensitive tests start after."""
    arrivals: list[float] = []

    async def on_gauge(_gauge: WorkerGauge, _msg: object) -> None:
        arrivals.append(time.monotonic())

    bus = await Bus.open(mesh.settings, "test-vllm-settle", initial_attempts=10)
    try:
        await bus.subscribe(bus.subjects.gauges_all, WorkerGauge, on_gauge, answer_decode_errors=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            recent = [t for t in arrivals if t >= time.monotonic() - steady_s]
            gaps = [b - a for a, b in itertools.pairwise(recent)]
            if recent and recent[0] - (time.monotonic() - steady_s) < 0.5 and gaps and max(gaps) < 0.5:
                return
    finally:
        await bus.close()


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until ``/v1/models`` answers; its log's tail when it exits or never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited {self.proc.returncode}:\n{self._tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server not ready in {timeout_s}s:\n{self._tail()}")
            time.sleep(1.0)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def vllm_openai_server(model_dir: Path, log_dir: Path, args: Sequence[str] = (),
                       env: Mapping[str, str] | None = None) -> Iterator[VllmServer]:
    """vLLM's own OpenAI server on the model with ``engine_flags`` (the reference a
    differential test compares the mesh with), started at once: its engine loads while the
    caller starts the mesh (both take most of a minute on CPU); ``wait_ready`` before use."""
    port = free_port()
    log = log_dir / "vllm-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), *engine_flags(), *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})},
        )
    try:
        yield VllmServer(f"http://127.0.0.1:{port}", proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
