"""The benchmark clients users already run, for a few seconds each against a mesh like
``make up``'s, with the tokenizer ``meshserve tokenizer export`` writes: the README's
commands, and every request must succeed.

guidellm and aiperf are not in the dev extra (guidellm needs torch; aiperf pins rich and
prometheus-client below ours): each test runs where its tool is on PATH, beside this
Python or in the repository's ``.venv-tools/<tool>`` (``make bench-tools``, as ``.ci/run``
builds it), and says so where it is not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.cli import main
from ops.up import Mesh
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"
SECONDS = 5  # of load per tool: enough for a few dozen requests at rate 5


TOOLS_VENV = Path(__file__).resolve().parents[2] / ".venv-tools"


def _find(name: str) -> str | None:
    return (shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
            or shutil.which(name, path=str(TOOLS_VENV / name / "bin")))


def _tool(name: str) -> str:
    found = _find(name)
    if found is None:
        pytest.skip(f"{name} is not installed in this environment (make bench-tools)")
    return found


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not any(_find(t) for t in ("guidellm", "aiperf")):
        pytest.skip("neither guidellm nor aiperf is installed in this environment")
    with running_mesh(tmp_path_factory.mktemp("bench-tools-mesh"), workers=2, speed=20.0) as m:
        yield m


@pytest.fixture(scope="module")
def tokenizer_dir(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    assert main(["tokenizer", "export", str(out), "--model", MODEL, "--nats-url", mesh.nats_url]) == 0
    return out


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{argv[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_guidellm_runs_clean(mesh: Mesh, tokenizer_dir: Path, tmp_path: Path) -> None:
    guidellm = _tool("guidellm")
    out = tmp_path / "guidellm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    _run([
        guidellm, "run",
        "--backend", f"kind=openai_http,target={mesh.gateway_url},model={MODEL},api_key={mesh.dev_key}",
        "--profile", "kind=poisson,rate=5",
        "--constraint", f"kind=max_duration,seconds={SECONDS}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=64",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ], env, tmp_path)
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 5, totals
    # The client's token counts are the gateway's: 256 prompt tokens plus the chat template's wrapping.
    requests = benchmark["requests"]["successful"]
    assert all(r["output_metrics"]["text_tokens"] == 64 for r in requests), [r["output_metrics"] for r in requests[:3]]


def test_aiperf_runs_clean(mesh: Mesh, tokenizer_dir: Path, tmp_path: Path) -> None:
    aiperf = _tool("aiperf")
    out = tmp_path / "aiperf"
    _run([
        aiperf, "profile", "--model", MODEL, "--url", mesh.gateway_url, "--endpoint-type", "chat", "--streaming",
        "--api-key", mesh.dev_key, "--tokenizer", str(tokenizer_dir), "--isl", "256", "--osl", "64",
        "--extra-inputs", "ignore_eos:true", "--request-rate", "5", "--arrival-pattern", "poisson",
        "--benchmark-duration", str(SECONDS), "--artifact-dir", str(out), "--ui-type", "none",
        "--no-gpu-telemetry",
    ], dict(os.environ), tmp_path)
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["error_summary"] == [] and not result["was_cancelled"]
    assert result["request_count"]["avg"] >= 5
    # Output tokens the client counted with the exported tokenizer are the ones the gateway billed.
    assert result["output_sequence_length"]["avg"] == 64
    assert result["usage_completion_tokens"]["avg"] == 64
