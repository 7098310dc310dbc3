"""``meshserve bench``: open-loop load generator measuring TTFT, TPOT and goodput."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ops.bench.arrivals import KINDS as ARRIVAL_KINDS
from ops.bench.config import WORKLOADS, BenchConfig, EndpointConfig, WorkloadConfig, default_api_key
from ops.bench.results import SLOSpec
from ops.bench.workload import MAX_LENGTH, LengthDist
from ops.console import EXIT_FAILURE, EXIT_USAGE, CliError
from services.common.cli_types import (
    count,
    fraction,
    non_negative_seconds,
    positive_int,
    positive_number,
    positive_seconds,
    subject_root,
)

MAX_TURNS = 10_000  # a conversation's history past this outgrows any context


def _checked_dist(spec: str, most: int | None = None, beyond: str = "") -> str:
    """A distribution spec, checked here so a typo fails before anything connects."""
    try:
        dist = LengthDist.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if min(dist.a, dist.largest) < 0:
        raise argparse.ArgumentTypeError(f"{spec!r}: must not be negative")
    if most is not None and dist.largest > most:
        raise argparse.ArgumentTypeError(f"{spec!r}: more than {most:,} {beyond}")
    return spec


def time_dist(spec: str) -> str:
    return _checked_dist(spec)


def turns_dist(spec: str) -> str:
    return _checked_dist(spec, MAX_TURNS, "turns a session")


def token_dist(spec: str) -> str:
    return _checked_dist(spec, MAX_LENGTH, "tokens, longer than any model's context")


EPILOG = """\
examples:
  meshserve bench --target http://127.0.0.1:8000/v1 --rates 1,2,4,8 --slo-ttft 1 --slo-tpot 0.05 --out runs/a
  meshserve bench --target vllm=http://gpu1:8000/v1 --target mesh=nats://127.0.0.1:4222 --model m --rates 2,4
  meshserve bench --target nats://127.0.0.1:4222 --model sim --workload shared-prefix \\
      --prefix-groups 4 --prefix-tokens 1024 --input-tokens 128 --output-tokens 64 --rates 4
  meshserve bench --target http://127.0.0.1:8000/v1 --concurrency 1,8,32      # closed loop
  meshserve bench --compare runs/a/results.json runs/b/results.json --out runs/cmp

Open loop: arrivals follow --arrival at each --rates value whether or not earlier
requests finished (rate 'inf' sends all at once). --concurrency switches to a closed
loop (labelled as such everywhere). A run stops after --num-requests requests or
--duration seconds of sending, then waits --drain-timeout for stragglers.
Distributions: 512 | uniform:LO:HI | normal:MEAN:STD | lognormal:MEAN:SIGMA | exponential:MEAN.
Output: tables on stdout, whole at any width (to a file at full width; a narrow terminal
gets them transposed or stacked); --json prints JSON for scripts instead.
"""


def _floats(text: str) -> list[float]:
    try:
        return [math.inf if p.strip().lower() in ("inf", "infinity") else float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="open-loop load generator: TTFT, TPOT, goodput",
        description="Offer load to OpenAI-compatible HTTP endpoints or meshserve's NATS API and "
                    "measure TTFT, TPOT/ITL, E2E latency, throughput and goodput.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("targets")
    g.add_argument("--target", action="append", default=[], metavar="[LABEL=]URL",
                   help="http(s)://host:port/v1 (OpenAI-compatible) or nats://host:port (meshserve); "
                        "repeat to compare endpoints on the same arrivals")
    g.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="which API to load: chat (/chat/completions, messages) or completions "
                        "(/completions, a prompt) (default chat)")
    g.add_argument("--model", help="model name (default: the HTTP target's first /models entry)")
    g.add_argument("--api-key", default=None,
                   help="sent as Authorization: Bearer (default: $MESHSERVE_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--root", type=subject_root, default="mesh", help="NATS subject root (default mesh)")

    g = p.add_argument_group("load")
    g.add_argument("--rates", type=_floats, default=None, metavar="R1,R2,...",
                   help="open-loop request rates to sweep, req/s ('inf' = all at once; default 1, "
                        "or a trace's own timing)")
    g.add_argument("--concurrency", type=_ints, default=None, metavar="C1,C2,...",
                   help="CLOSED LOOP instead: keep this many requests in flight")
    g.add_argument("--arrival", choices=(*ARRIVAL_KINDS, "trace"), default=None,
                   help="arrival process (default poisson; trace for the trace workload)")
    g.add_argument("--burst-size", type=positive_int, default=8, help="requests per burst (--arrival burst)")
    g.add_argument("--burstiness", type=positive_number, default=1.0,
                   help="gamma shape (--arrival gamma): 1 = Poisson, <1 burstier")
    g.add_argument("-n", "--num-requests", type=positive_int, default=None,
                   help="requests per run (default 100 unless --duration is given)")
    g.add_argument("--duration", type=positive_seconds, default=None, help="seconds of sending per run")
    g.add_argument("--request-timeout", type=positive_seconds, default=300.0, metavar="S",
                   help="a request not ended after this many seconds counts as failed (timeout) "
                        "(default 300)")
    g.add_argument("--drain-timeout", type=non_negative_seconds, default=None,
                   help="after the last arrival, wait this long for in-flight requests (default: request timeout + 1 s)")
    g.add_argument("--warmup", type=count, default=0, help="unmeasured requests per endpoint first")
    g.add_argument("--cooldown", type=non_negative_seconds, default=0.0, help="pause between runs (s)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the arrivals and prompts: the same seed sends the same load (default 0)")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="what the requests ask for: random prompts, shared-prefix groups, multi-turn "
                        "sessions, or a replayed --trace (default random; trace when --trace is given)")
    g.add_argument("--input-tokens", type=token_dist, default="512", metavar="DIST",
                   help="prompt tokens (shared-prefix: the distinct suffix; multi-turn: each user message)")
    g.add_argument("--output-tokens", type=token_dist, default="128", metavar="DIST", help="max_tokens (with ignore_eos)")
    g.add_argument("--prefix-groups", type=positive_int, default=4, help="shared-prefix: number of system prompts")
    g.add_argument("--prefix-tokens", type=token_dist, default="0", metavar="DIST",
                   help="shared-prefix: tokens per shared prompt (a distribution, one draw per prompt, "
                        "e.g. uniform:1024:2048); multi-turn: system prompt tokens")
    g.add_argument("--turns", type=turns_dist, default="4", metavar="DIST", help="multi-turn: turns per session")
    g.add_argument("--think-time", type=time_dist, default="0", metavar="DIST", help="multi-turn: s between turns")
    g.add_argument("--history", choices=("synthetic", "actual"), default="synthetic",
                   help="multi-turn: resend synthetic replies (exact lengths) or the real ones")
    g.add_argument("--trace", metavar="FILE",
                   help="JSONL trace to replay (implies --workload trace): timestamp, input_tokens|text, "
                        "output_tokens")
    g.add_argument("--trace-time-unit", choices=("s", "ms", "us"), default=None,
                   help="with --trace: unit of the trace's timestamps (default s)")
    g.add_argument("--trace-block-size", type=positive_int, default=None,
                   help="with --trace: tokens per trace hash_id block (default 512)")
    g.add_argument("--tokenizer", default="byte",
                   help="'byte' (meshserve sim) or a local HF tokenizer directory; prompt lengths are exact in it")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end early)")
    g.add_argument("--continuous-usage", action="store_true",
                   help="ask for usage in every chunk (vLLM continuous_usage_stats): exact tokens per chunk")
    g.add_argument("--extra-body", default=None, metavar="JSON", help="merged into every request body")

    g = p.add_argument_group("SLO")
    g.add_argument("--slo-ttft", type=positive_seconds, default=None, metavar="S", help="TTFT bound (s)")
    g.add_argument("--slo-tpot", type=positive_seconds, default=None, metavar="S", help="TPOT bound (s)")
    g.add_argument("--slo-e2e", type=positive_seconds, default=None, metavar="S", help="end-to-end bound (s)")
    g.add_argument("--slo-attainment", type=fraction, default=0.9, metavar="F",
                   help="the SLO holds at a load when this fraction of requests meets it (default 0.9)")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="DIR", help="write results.json (raw timings) and PNG plots")
    g.add_argument("--label", default="", help="name of this result in --compare views")
    g.add_argument("--no-plots", action="store_true", help="with --out, write results.json but no PNG plots")
    g.add_argument("--no-progress", action="store_true", help="draw no progress bar on stderr")
    g.add_argument("--compare", nargs="+", metavar="RESULT.json",
                   help="show two or more result files side by side with ratios (no load is sent)")
    g.add_argument("--json", action="store_true",
                   help="print JSON on stdout instead of tables, for scripts: the result (the results.json "
                        "format, which --compare reads), or with --compare the matched rows and ratios")
    p.set_defaults(func=main)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if not args.target:
        raise ValueError("give at least one --target (or --compare files)")
    api_key = args.api_key if args.api_key is not None else default_api_key()
    endpoints = [EndpointConfig.parse(spec, api=args.api, model=args.model, api_key=api_key, root=args.root)
                 for spec in args.target]
    kind = args.workload
    if args.trace and kind not in (None, "trace"):
        raise ValueError(f"--trace replays a trace: it goes with --workload trace, not --workload {kind} "
                         "(leave --workload out, or drop --trace)")
    if kind is None:
        kind = "trace" if args.trace else "random"
    given = [flag for flag, value in (("--trace-time-unit", args.trace_time_unit),
                                      ("--trace-block-size", args.trace_block_size)) if value is not None]
    if given and not args.trace:
        # Without a trace they would change nothing: say so rather than run another benchmark.
        raise ValueError(f"{' and '.join(given)} describe{'s' if len(given) == 1 else ''} a trace: "
                         "give the trace with --trace FILE")
    workload = WorkloadConfig(
        kind=kind, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens, turns=args.turns,
        think_time=args.think_time, history=args.history, trace=args.trace,
        trace_time_unit=args.trace_time_unit or "s", trace_block_size=args.trace_block_size or 512,
        tokenizer=args.tokenizer)
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body: not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    num = args.num_requests
    if num is None and args.duration is None:
        num = 100
    return BenchConfig(
        endpoints=endpoints, workload=workload, rates=args.rates, concurrency=args.concurrency,
        arrival=args.arrival, burst_size=args.burst_size, burstiness=args.burstiness,
        num_requests=num, duration=args.duration, request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout, warmup=args.warmup, cooldown=args.cooldown, seed=args.seed,
        ignore_eos=args.ignore_eos, continuous_usage=args.continuous_usage, extra_body=extra,
        slo=SLOSpec(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, e2e_s=args.slo_e2e,
                    attainment=args.slo_attainment),
        progress=not args.no_progress, label=args.label)


def main(args: argparse.Namespace) -> int:
    """Run the command; an expected failure is one plain line on stderr, ``meshserve bench:
    <message>``, and its exit code (2 bad input, 1 a failure at run time), never a traceback.

    The line is printed here, not left to ``ops.cli.main``, so a caller that runs ``func``
    itself gets the exit code; and it is printed plainly, not through rich, whose markup
    parser would read a ``[`` in a path or URL as a tag (and crash on ``[/]``).
    """
    try:
        return _main(args)
    except CliError as exc:
        print(f"meshserve bench: {exc.message}", file=sys.stderr)
        return exc.exit_code


def _out_dir(spec: str) -> Path:
    out = Path(spec)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {spec}: is not a directory", EXIT_USAGE)
    # Made before the run: a path that cannot be a directory failed only after it, and
    # the results were lost.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--out {spec}: {exc.strerror or exc}", EXIT_USAGE) from None
    return out


def _load_results(paths: list[str]) -> list[Any]:
    from ops.bench.results import load_result

    if len(paths) < 2:
        raise CliError("--compare needs two or more result files", EXIT_USAGE)
    results = []
    for path in paths:
        try:
            result = load_result(path)
        except OSError as exc:
            raise CliError(f"--compare {path}: {exc.strerror or exc}", EXIT_USAGE) from None
        except ValueError as exc:
            raise CliError(f"--compare {path}: cannot read results: {exc}", EXIT_USAGE) from None
        if not result.runs:
            raise CliError(f"--compare {path}: no runs in it", EXIT_USAGE)
        results.append(result)
    return results


def _main(args: argparse.Namespace) -> int:
    import msgspec
    from rich.console import Console
    from rich.markup import escape

    from ops.bench.report import compare_rows, render, render_compare
    from ops.bench.results import save_result

    console = Console()
    err = Console(stderr=True)
    out = _out_dir(args.out) if args.out else None
    if args.trace and not Path(args.trace).is_file():
        raise CliError(f"--trace {args.trace}: not a readable file", EXIT_USAGE)
    if args.compare:
        results = _load_results(args.compare)
        if args.json:
            json.dump({"results": [r.label for r in results], "rows": compare_rows(results)}, sys.stdout, indent=2)
            print()
        else:
            render_compare(results, console)
        if out is not None and not args.no_plots:
            from ops.bench.plots import write_plots

            paths = write_plots(results, out, prefix="compare_")
            (err if args.json else console).print("plots: " + escape(", ".join(str(p) for p in paths)), soft_wrap=True)
        return 0
    try:
        config = config_from_args(args)
    except (ValueError, json.JSONDecodeError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    from ops.bench.runner import run_bench, run_loop

    try:
        result = run_loop(run_bench(config, console=err))
    except ConnectionError as exc:  # a target that cannot be reached: a failure at run time
        raise CliError(str(exc), EXIT_FAILURE) from None
    except ValueError as exc:  # the workload, the trace, the tokenizer, no model
        raise CliError(str(exc), EXIT_USAGE) from None
    except KeyboardInterrupt:
        print("meshserve bench: interrupted", file=sys.stderr)
        return 130
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result)).decode() + "\n")
    else:
        render(result, console)
    if out is not None:
        path = save_result(result, out / "results.json")
        (err if args.json else console).print(f"results: {escape(str(path))}", soft_wrap=True)  # a path whole, on one line
        if not args.no_plots:
            from ops.bench.plots import write_plots

            paths = write_plots([result], out)
            (err if args.json else console).print("plots: " + escape(", ".join(str(p) for p in paths)), soft_wrap=True)
    if not any(r.summary.ok for r in result.runs):
        raise CliError("no request succeeded", EXIT_FAILURE)
    return 0


if __name__ == "__main__":  # pragma: no cover
    from ops.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
