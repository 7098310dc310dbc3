"""``meshserve sim-server``: one simulated vLLM server on an HTTP port (no NATS).

    meshserve sim-server --port 9001 --profile llama-3.1-8b-h100 --speed 1 \\
        --kv-events tcp://127.0.0.1:5601 --kv-events-replay tcp://127.0.0.1:5701 --load-format vllm

Bad options are one line and exit 2 (``CliError``), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
from typing import Any

from ops.console import EXIT_USAGE, CliError
from services.common.cli_types import port_number, positive_int, positive_number


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim-server", help="a simulated vLLM server: OpenAI API, /metrics, /get_load, KV events over ZMQ",
        description="The mesh's sim engine (batching, chunked prefill, paged KV, prefix cache, preemption) behind"
                    " vLLM's HTTP surface, for routers, proxies and benchmark clients. No NATS.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (vLLM's default 8000; 0: any free port)")
    p.add_argument("--model", default=None, help="served model name (default: the profile's model)")
    p.add_argument("--profile", default=None, help="step-time profile name or JSON path (default: llama-3.1-8b-h100)")
    p.add_argument("--speed", type=positive_number, default=1.0, help="simulated seconds per wall second (1.0 = real time)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated text (and of --error-rate's draws)")
    p.add_argument("--block-size", type=positive_int, default=None, help="KV block size in tokens (default: the profile's, 16)")
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=None)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    p.add_argument("--num-kv-blocks", type=positive_int, default=None, help="KV blocks (default: from the memory budget)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="vLLM's: priority runs a request's `priority` (lower first) ahead of arrival order;"
                        " fcfs refuses a non-zero priority")
    p.add_argument("--load-format", choices=["vllm", "sglang"], default="vllm",
                   help='/get_load shape: vllm-router\'s {"load": N} or sglang-router\'s [{"num_tokens": N, ...}]')
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish vLLM's KV events on this ZMQ endpoint (bound), e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="ZMQ ROUTER endpoint (bound) that replays past KV event batches from a sequence number")
    p.add_argument("--kv-events-topic", default="", help="topic frame of every KV event message (vLLM's default: empty)")
    p.add_argument("--kv-events-buffer", type=positive_int, default=10_000, help="KV event batches kept for replay")
    p.add_argument("--error-rate", type=float, default=0.0,
                   help="fraction of generation requests answered with an injected 500 (tests; 0 to 1)")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per finished request: its response id and the engine's own"
                        " arrival, first-token and finish times (wall clock)")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    def bad(message: str) -> None:
        raise CliError(message, EXIT_USAGE)

    # (speed, sizes and counts: the parser's types)
    if not 0.0 <= args.error_rate <= 1.0:
        bad("--error-rate must be between 0 and 1")
    if args.kv_events_replay and not args.kv_events:
        bad("--kv-events-replay needs --kv-events")


def run(args: argparse.Namespace) -> int:
    _check(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.worker.engines.sim import SimEngine

    from .app import SimServer
    from .publisher import KvEventPublisher

    options = {name: getattr(args, name) for name in ("profile", "block_size", "max_model_len", "max_num_seqs",
                                                      "max_num_batched_tokens", "num_kv_blocks")
               if getattr(args, name) is not None}
    try:
        engine = SimEngine(model=args.model, speed=args.speed, seed=args.seed,
                           enable_prefix_caching=not args.no_prefix_caching, **options)
    except (ValueError, OSError) as exc:  # an unknown profile, limits that do not fit
        raise CliError(str(exc), EXIT_USAGE) from None
    publisher = None
    if args.kv_events:
        import zmq

        try:
            publisher = KvEventPublisher(args.kv_events, replay_endpoint=args.kv_events_replay,
                                         topic=args.kv_events_topic, buffer_steps=args.kv_events_buffer)
        except zmq.ZMQError as exc:
            raise CliError(f"cannot bind the KV event endpoint: {exc}") from None
    try:
        request_log = open(args.request_log, "ab") if args.request_log else None
    except OSError as exc:
        raise CliError(f"--request-log: {exc.strerror or exc}: {args.request_log}", EXIT_USAGE) from None
    server = SimServer(engine, model=args.model, load_format=args.load_format, error_rate=args.error_rate,
                       rng=random.Random(args.seed), publisher=publisher,
                       priority_scheduling=args.scheduling_policy == "priority", request_log=request_log)
    try:
        asyncio.run(_serve(server, args.host, args.port))
    finally:
        if request_log is not None:
            request_log.close()
    return 0


async def _serve(server: Any, host: str, port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound = runner.addresses[0][1] if runner.addresses else port
        kv = server.publisher
        # One line a launcher (or a test) can wait for: where everything listens.
        print(f"sim-server: serving {server.model} on http://{host}:{bound}"
              + (f", KV events on {kv.endpoint}" if kv else "")
              + (f", replay on {kv.replay_endpoint}" if kv and kv.replay_endpoint else ""), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
