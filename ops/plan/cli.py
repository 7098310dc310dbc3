"""``meshserve plan``: size a fleet from a model's shape, a GPU and a workload."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from ops.plan.model import DTYPE_BYTES, PlanInputs, load_model, make_plan
from ops.plan.multi import LOAD_SOURCES, FleetPolicy, parse_entries, plan_fleet
from ops.plan.presets import GB, GPU_PRESETS, MODEL_PRESETS, lookup_gpu
from ops.plan.report import fleet_json, plot_curve, render, render_fleet, to_json
from services.common.cli_types import fraction, non_negative_number, positive_int, positive_number


def _gb(value: str) -> int:
    """A size in GB (0 or more, finite), as bytes."""
    bytes_ = non_negative_number(value) * GB
    if not math.isfinite(bytes_):  # 1e300 GB is a finite number of GB, not of bytes
        raise argparse.ArgumentTypeError(f"not a size in GB: {value}")
    return round(bytes_)


MAX_RATE = 1e6  # requests/s: far beyond any fleet; the queueing sums run once per replica (1e15 never ended)


def plot_formats() -> list[str]:
    """The file suffixes matplotlib's Agg canvas writes (png, pdf, svg, eps, tiff, webp, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return sorted(f".{suffix}" for suffix in FigureCanvasAgg.get_supported_filetypes())


def _rate(value: str) -> float:
    """λ: a positive number of requests/s, at most ``MAX_RATE`` (1e308 made the replica count NaN)."""
    rate = positive_number(value)
    if rate > MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RATE:,.0f} requests/s, not {value}")
    return rate


def plot_path(given: Path) -> Path:
    """The file ``--plot`` writes: ``given``, or ``given.png`` without a suffix (as
    matplotlib does); ``CliError`` (exit 2) before anything is computed when it cannot."""
    from ops.console import EXIT_USAGE, CliError, output_file_problem

    path = given if given.suffix else given.with_name(given.name + ".png")
    formats = plot_formats()
    if path.suffix.lower() not in formats:
        raise CliError(f"--plot {given}: {path.suffix} is not an image format it writes; use "
                       f"{', '.join(formats)}", EXIT_USAGE)
    problem = output_file_problem(path, create_parents=False)  # matplotlib makes no folder
    if problem:
        raise CliError(f"--plot {given}: {problem}", EXIT_USAGE)
    return path


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="capacity planner: KV per token, sequences per replica, fleet size, queueing curve",
        description=(
            "Size a fleet (DESIGN.md, Sizing). Memory in decimal GB (10^9 bytes). "
            "Without --mu/--time-in-system both are estimated from the GPU's data sheet "
            "(decode bandwidth-bound, prefill compute-bound): a roofline estimate, not a measurement."
        ),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        "-m",
        default="llama-3.1-8b",
        help=f"preset ({', '.join(MODEL_PRESETS)}) or a config.json / model directory",
    )
    src.add_argument("--config", dest="model", help="a Hugging Face config.json (same as --model PATH)")
    src.add_argument(
        "--models",
        type=Path,
        metavar="FILE",
        help="many models (YAML or JSON list: name, model or base, rate, weights_gb, adapter_mb, tp, "
        "prompt_tokens, output_tokens, ttft_slo_s): recommend multiplex, time-share or a static pool for each",
    )
    p.add_argument("--gpu", "-g", default="H100-80GB", help=f"GPU preset: {', '.join(GPU_PRESETS)}")
    p.add_argument("--tp", type=positive_int, help="tensor parallel GPUs per replica (default 1)")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp8", "bf16", "fp16", "fp32"],
        help="KV cache element type (auto: the model's dtype; fp8: 1 byte)",
    )
    p.add_argument(
        "--weights-dtype", choices=sorted(DTYPE_BYTES), help="quantised weights (default: the model's dtype)"
    )
    p.add_argument(
        "--weights-gb", type=_gb, dest="weights_bytes", help="measured weights size, overrides the estimate"
    )
    p.add_argument("--hbm-gb", type=_gb, dest="hbm_bytes", help="HBM per GPU (default: the preset's)")
    p.add_argument(
        "--reserve-gb",
        type=_gb,
        dest="reserve_bytes",
        help="per-GPU reserve for activations and runtime (default: 10%% of HBM)",
    )
    p.add_argument("--prompt-tokens", type=positive_int, help="mean prompt length (default 1024)")
    p.add_argument("--output-tokens", type=positive_int, help="mean output length (default 256)")
    p.add_argument(
        "--context",
        type=positive_int,
        dest="context_tokens",
        help="mean context a sequence holds in KV (default: prompt + output)",
    )
    p.add_argument("--rate", "-r", type=_rate, help=f"λ: arrivals per second for the whole pool (at most {MAX_RATE:g})")
    p.add_argument(
        "--time-in-system",
        "-W",
        type=positive_number,
        dest="time_in_system",
        help="W: seconds a request holds KV (default: estimated)",
    )
    p.add_argument(
        "--mu",
        type=positive_number,
        dest="service_rate",
        help="μ: requests/s one replica completes at saturation (default: estimated)",
    )
    p.add_argument(
        "--utilization", "--rho", type=fraction, default=0.7, help="target utilisation ρ (default 0.7)"
    )
    p.add_argument("--max-num-seqs", type=positive_int, help="the engine's batch cap, if below what KV allows")
    p.add_argument(
        "--bandwidth-efficiency", type=fraction, default=0.8, help="achieved fraction of peak bandwidth"
    )
    p.add_argument(
        "--prefill-mfu", type=fraction, default=0.5, help="achieved fraction of peak FLOP/s in prefill"
    )
    p.add_argument(
        "--gpu-price", type=non_negative_number, dest="gpu_price_per_hour", metavar="PER_HOUR",
        help="what one GPU-hour costs (e.g. 2.99): the fleet's cost per hour and per million tokens at the "
             "planned rate (with --models: the plan's and the static fleet's cost per hour)",
    )
    many = p.add_argument_group("many models (--models)")
    many.add_argument(
        "--load-from",
        choices=sorted(LOAD_SOURCES),
        default="nvme",
        help="where a swapped-in model's weights come from: "
        + ", ".join(f"{k} {v:g} GB/s" for k, v in LOAD_SOURCES.items()),
    )
    many.add_argument("--load-gbps", type=positive_number, help="weights load bandwidth, GB/s (overrides --load-from)")
    many.add_argument("--keep-s", type=positive_number, default=600.0, help="a time-shared model idle this long is evicted")
    many.add_argument(
        "--static-load",
        type=positive_number,
        default=0.5,
        help="replicas of traffic (at ρ) from which a model gets a pool of its own (default 0.5)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="write the queueing curve as a PNG (or .pdf, .svg, .jpg; FILE.png without a suffix)")
    p.add_argument("--list", action="store_true", help="list model and GPU presets")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # The terminal's own width: print_table transposes or stacks a table wider than it
    # (a forced 120 columns printed 105-column tables on a 40-column terminal).
    console = Console(highlight=False)
    if args.list:
        console.print("models: " + ", ".join(MODEL_PRESETS), soft_wrap=not console.is_terminal)
        for g in GPU_PRESETS.values():
            console.print(
                f"{g.name}: {g.hbm_bytes / GB:.0f} GB, {g.bf16_tflops:.0f} TFLOP/s bf16, "
                f"{g.bandwidth_bytes_per_s / 1e12:.2f} TB/s"
            )
        return 0
    if args.models is not None:
        return run_many(args, console)
    plot = plot_path(args.plot) if args.plot is not None else None  # before the plan is printed
    try:
        inputs = PlanInputs(
            model=load_model(args.model),
            gpu=lookup_gpu(args.gpu),
            tensor_parallel=args.tp or 1,
            kv_dtype=args.kv_dtype,
            weights_dtype=args.weights_dtype,
            weights_bytes=args.weights_bytes,
            hbm_bytes=args.hbm_bytes,
            reserve_bytes=args.reserve_bytes,
            prompt_tokens=args.prompt_tokens or 1024,
            output_tokens=args.output_tokens or 256,
            context_tokens=args.context_tokens,
            rate=args.rate,
            time_in_system=args.time_in_system,
            service_rate=args.service_rate,
            utilization=args.utilization,
            max_num_seqs=args.max_num_seqs,
            bandwidth_efficiency=args.bandwidth_efficiency,
            prefill_mfu=args.prefill_mfu,
            gpu_price_per_hour=args.gpu_price_per_hour,
        )
        plan = make_plan(inputs)
    except (KeyError, ValueError, OSError) as exc:
        print(f"meshserve plan: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.json:
        print(to_json(plan))
    else:
        render(plan, console)
    if plot is not None:
        if plan.service_rate is None:
            print("meshserve plan: no service rate to plot (a sequence does not fit)", file=sys.stderr)
            return 2
        try:
            plot_curve(plan, plot)
        except OSError as exc:  # checked above; the folder changed since, or the disk filled
            print(f"meshserve plan: cannot write {plot}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if not args.json:
            console.print(f"queueing curve written to {plot}", markup=False, soft_wrap=not console.is_terminal)
    return 0 if plan.concurrent_per_replica > 0 else 1


# Flags of one model's plan (flag → its dest): with --models each entry says its own.
PER_MODEL_FLAGS = {"--tp": "tp", "--prompt-tokens": "prompt_tokens", "--output-tokens": "output_tokens",
                   "--context": "context_tokens", "--rate": "rate", "--time-in-system": "time_in_system",
                   "--mu": "service_rate", "--weights-gb": "weights_bytes", "--plot": "plot"}


def run_many(args: argparse.Namespace, console: Console) -> int:
    """``--models FILE``: the decision tree for every model of the file (ops.plan.multi)."""
    import yaml

    per_model = [flag for flag, given in PER_MODEL_FLAGS.items() if getattr(args, given) is not None]
    if per_model:
        print(f"meshserve plan: {', '.join(per_model)} describe one model: with --models each entry of the file "
              "says its own (rate, tp, prompt_tokens, output_tokens, weights_gb)", file=sys.stderr)
        return 2
    try:
        text = args.models.read_text()
        raw = yaml.safe_load(text)  # YAML is a superset of JSON: one reader for both
        gpu = lookup_gpu(args.gpu)
        policy = FleetPolicy(
            gpu=gpu if args.hbm_bytes is None else dataclasses.replace(gpu, hbm_bytes=args.hbm_bytes),
            utilization=args.utilization,
            load_gb_per_s=args.load_gbps if args.load_gbps is not None else LOAD_SOURCES[args.load_from],
            keep_s=args.keep_s,
            static_load=args.static_load,
            kv_dtype=args.kv_dtype, weights_dtype=args.weights_dtype, reserve_bytes=args.reserve_bytes,
            max_num_seqs=args.max_num_seqs, bandwidth_efficiency=args.bandwidth_efficiency,
            prefill_mfu=args.prefill_mfu, gpu_price_per_hour=args.gpu_price_per_hour,
        )
        plan = plan_fleet(parse_entries(raw), policy)
    except OSError as exc:
        print(f"meshserve plan: cannot read {args.models}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"meshserve plan: {args.models} is not YAML or JSON: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as exc:
        print(f"meshserve plan: {args.models}: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.json:
        print(fleet_json(plan))
    else:
        render_fleet(plan, console)
    return 0
