"""A worker: one inference engine (sim or vLLM) serving the mesh.

``meshserve serve worker --engine sim --model NAME --profile NAME --speed X`` plus the
engine's options. Engine options left unset keep the engine's own defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from bus import run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--model", default="sim-llama-8b", help="model name requests are routed by (vllm: model directory)")
    parser.add_argument("--worker-id", default="", help="stable id (default: model-host-pid)")
    sim = parser.add_argument_group("sim engine")
    sim.add_argument("--profile", default=None, help="step-time profile name or JSON path (default: llama-3.1-8b-h100)")
    sim.add_argument("--speed", type=float, default=None, help="simulation speed factor; 1.0 = real time")
    sim.add_argument("--seed", type=int, default=None)
    engine = parser.add_argument_group("engine arguments (vLLM meaning)")
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from the memory budget)")
    engine.add_argument("--lora-adapters", default="", help="comma-separated adapter names to serve")
    stream = parser.add_argument_group("streaming")
    stream.add_argument("--coalesce-ms", type=float, default=20.0, help="longest a generated token waits before its chunk is sent")
    stream.add_argument("--coalesce-tokens", type=int, default=16, help="a chunk goes out once this many tokens wait")
    stream.add_argument("--gauge-interval", type=float, default=0.25, help="seconds between gauge publishes")
    stream.add_argument("--drain-timeout", type=float, default=60.0, help="seconds in-flight requests get to finish on SIGTERM")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    names = ("profile", "speed", "seed", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks")
    options: dict[str, Any] = {"model": args.model}
    options.update({name: getattr(args, name) for name in names if getattr(args, name, None) is not None})
    if args.lora_adapters:
        options["lora_adapters"] = [a.strip() for a in args.lora_adapters.split(",") if a.strip()]
    return options


def run(args: argparse.Namespace) -> int:
    from .engines.base import create_engine
    from .service import WorkerConfig, WorkerService

    config = WorkerConfig(
        worker_id=args.worker_id,
        coalesce_interval_s=args.coalesce_ms / 1000.0,
        coalesce_max_tokens=args.coalesce_tokens,
        gauge_interval_s=args.gauge_interval,
        drain_timeout_s=args.drain_timeout,
    )
    return run_service(lambda: WorkerService(create_engine(args.engine, **engine_options(args)), config))

