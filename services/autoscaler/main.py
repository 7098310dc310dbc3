"""The autoscaler: per-pool replica counts from queue load, actuated by a driver.

``meshserve serve autoscaler --pool MODEL [--driver local|nomad|compose] ...``. Policy
flags apply to every pool; ``--config FILE`` (JSON) sets pools one by one:

    {"tick_s": 1.0, "drain_timeout_s": 120,
     "pools": {"meta-llama/Llama-3.1-8B-Instruct": {
         "min_replicas": 1, "max_replicas": 8, "warm_buffer": 1, "scale_down_cooldown_s": 300,
         "schedule": [{"start_hour": 8, "end_hour": 18, "min_replicas": 4}], "timezone": "Europe/Paris",
         "worker_args": ["--engine", "vllm"], "nomad_job": "llama-8b", "compose_service": "worker-llama"}}}

Any ``PoolPolicy`` field may appear per pool; ``worker_args`` (local driver),
``nomad_job`` and ``compose_service`` pick what the driver acts on for that pool.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import fields, replace
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfoNotFoundError

from bus import RunOptions, run_service
from bus.config import file_problem, refuse
from bus.runner import listen_problem
from services.common.cli_types import (
    count,
    fraction,
    non_negative_seconds,
    port_number,
    positive_int,
    positive_number,
    positive_seconds,
)

_DRIVER_KEYS = ("worker_args", "nomad_job", "compose_service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", action="append", default=[], metavar="MODEL",
                        help="a model whose pool to scale (repeatable; pools in --config are added)")
    parser.add_argument("--config", default=None, help="JSON file with per-pool policies (see the module help)")
    parser.add_argument("--driver", choices=["local", "nomad", "compose"], default="local")
    policy = parser.add_argument_group("policy (every pool, unless --config says otherwise)")
    policy.add_argument("--min-replicas", type=count, default=1, help="0 allows scale to zero")
    policy.add_argument("--max-replicas", type=positive_int, default=8)
    policy.add_argument("--target-utilization", type=fraction, default=0.75)
    policy.add_argument("--warm-buffer", type=count, default=0, help="spare ready replicas (cold starts take minutes)")
    policy.add_argument("--cooldown", type=non_negative_seconds, default=300.0, help="seconds a lower target must hold before a scale-down")
    policy.add_argument("--idle-to-zero", type=non_negative_seconds, default=900.0, help="idle seconds before a zero-able pool goes to zero")
    policy.add_argument("--initial-capacity", type=positive_number, default=65_536.0,
                        help="tokens a replica holds at saturation, until gauges measure it")
    shell = parser.add_argument_group("service")
    shell.add_argument("--tick", type=positive_seconds, default=1.0, help="seconds between control ticks")
    shell.add_argument("--drain-timeout", type=positive_seconds, default=120.0,
                       help="seconds a drained worker gets to finish its requests (above the longest request)")
    shell.add_argument("--drain-grace", type=non_negative_seconds, default=15.0, help="beyond the drain timeout before a forced stop")
    shell.add_argument("--start-timeout", type=positive_seconds, default=600.0, help="a launch with no gauge by then is written off")
    shell.add_argument("--history", type=positive_int, default=50, help="decisions kept per pool for status")
    shell.add_argument("--metrics-port", type=port_number, default=None, help="serve Prometheus /metrics here (0: any free port)")
    shell.add_argument("--metrics-host", default="127.0.0.1")
    local = parser.add_argument_group("local driver")
    local.add_argument("--state-dir", default=".meshserve", help="worker logs go to STATE_DIR/logs, a record of each worker started "
                       "to STATE_DIR/autoscaler/workers (a restarted autoscaler manages them again)")
    local.add_argument("--worker-args", default="", help='arguments for every worker, one string: "--engine sim --speed 20"')
    local.add_argument("--max-workers", type=positive_int, default=8, help="most worker processes on this machine, all pools")
    local.add_argument("--on-exit", choices=["drain", "leave"], default="drain",
                       help="what happens to the workers it started when the autoscaler stops")
    local.add_argument("--worker-command", default="",
                       help="command that runs one worker (default: this Python, -m ops.cli serve worker)")
    nomad = parser.add_argument_group("nomad driver")
    nomad.add_argument("--nomad-addr", default=os.environ.get("NOMAD_ADDR", "http://127.0.0.1:4646"))
    nomad.add_argument("--nomad-token", default=None, help="ACL token (env NOMAD_TOKEN)")
    nomad.add_argument("--nomad-job", action="append", default=[], metavar="MODEL=JOB", help="job id of a pool (repeatable)")
    nomad.add_argument("--nomad-job-template", default="meshserve-{pool}", help="job id of other pools; {pool} = model slug")
    nomad.add_argument("--nomad-group", default="workers", help="the workers' task group")
    nomad.add_argument("--nomad-namespace", default=os.environ.get("NOMAD_NAMESPACE"))
    nomad.add_argument("--nomad-region", default=os.environ.get("NOMAD_REGION"))
    compose = parser.add_argument_group("compose driver")
    compose.add_argument("--compose-project", default="meshserve")
    compose.add_argument("--compose-file", action="append", default=[], help="compose file (repeatable)")
    compose.add_argument("--compose-service", default="worker", help="the workers' service (per pool: --config)")
    compose.add_argument("--docker", default="docker", help="the docker executable")


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key or not val:
            raise SystemExit(f"{flag} expects MODEL=VALUE, got {value!r}")
        out[key] = val
    return out


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The ``AutoscalerConfig`` and the driver the arguments describe; a configuration
    that cannot be is one line naming what is wrong (``SystemExit``), not a traceback."""
    try:
        return _build(args)
    except OSError as exc:  # bad input: one line, exit 2, as every service says it
        refuse("autoscaler", file_problem("--config", args.config, exc))
    except json.JSONDecodeError as exc:
        refuse("autoscaler", f"--config {args.config}: not JSON: {exc}")
    except ZoneInfoNotFoundError as exc:
        raise SystemExit(f"unknown timezone: {exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise SystemExit(f"bad autoscaler configuration: {exc}") from None


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    from .control import PoolPolicy, ScheduleWindow
    from .drivers import ComposeDriver, LocalDriver, NomadDriver
    from .service import AutoscalerConfig

    raw: dict[str, Any] = {}
    if args.config:
        raw = json.loads(Path(args.config).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"--config {args.config} must hold a JSON object")
    pool_raw: dict[str, dict[str, Any]] = {name: dict(v or {}) for name, v in (raw.get("pools") or {}).items()}
    for name in args.pool:
        pool_raw.setdefault(name, {})
    if not pool_raw:
        raise SystemExit("the autoscaler needs at least one pool: --pool MODEL or pools in --config")

    base = dict(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, target_utilization=args.target_utilization,
        warm_buffer=args.warm_buffer, scale_down_cooldown_s=args.cooldown, idle_to_zero_s=args.idle_to_zero,
        initial_replica_token_capacity=args.initial_capacity,
    )
    policy_fields = {f.name for f in fields(PoolPolicy)}
    policies = []
    worker_args: dict[str, list[str]] = {}
    nomad_jobs = _pairs(args.nomad_job, "--nomad-job")
    compose_services: dict[str, str] = {}
    common_worker_args = shlex.split(args.worker_args)
    for name, spec in pool_raw.items():
        unknown = set(spec) - policy_fields - set(_DRIVER_KEYS) - {"pool"}
        if unknown:
            raise SystemExit(f"pool {name}: unknown settings {sorted(unknown)}")
        overrides = {k: v for k, v in spec.items() if k in policy_fields and k != "pool"}
        if "schedule" in overrides:
            overrides["schedule"] = tuple(ScheduleWindow(**w) for w in overrides["schedule"])
        policies.append(replace(PoolPolicy(pool=name, **base), **overrides))
        extra = spec.get("worker_args", [])
        worker_args[name] = [*common_worker_args, *(shlex.split(extra) if isinstance(extra, str) else list(extra))]
        if spec.get("nomad_job"):
            nomad_jobs[name] = str(spec["nomad_job"])
        if spec.get("compose_service"):
            compose_services[name] = str(spec["compose_service"])

    config = AutoscalerConfig(
        pools=tuple(policies),
        tick_s=float(raw.get("tick_s", args.tick)),
        drain_timeout_s=float(raw.get("drain_timeout_s", args.drain_timeout)),
        drain_grace_s=float(raw.get("drain_grace_s", args.drain_grace)),
        start_timeout_s=float(raw.get("start_timeout_s", args.start_timeout)),
        history=int(raw.get("history", args.history)),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )

    driver: Any
    if args.driver == "local":
        driver = LocalDriver(
            log_dir=Path(args.state_dir) / "logs",
            # A record per worker it starts, so that an autoscaler restarted on this folder
            # (it was killed; its workers served on) manages them again.
            pid_dir=Path(args.state_dir) / "autoscaler" / "workers",
            worker_args=worker_args,
            command=shlex.split(args.worker_command) if args.worker_command else None,
            max_workers=args.max_workers,
            env=RunOptions.from_args(args).child_env(os.environ),  # the workers join this mesh
            on_close=args.on_exit,
            # The workers drain on SIGTERM within their own --drain-timeout (60 s default).
            close_timeout_s=config.drain_timeout_s + config.drain_grace_s,
        )
    elif args.driver == "nomad":
        driver = NomadDriver(
            address=args.nomad_addr, token=args.nomad_token or os.environ.get("NOMAD_TOKEN"), jobs=nomad_jobs,
            job_template=args.nomad_job_template, group=args.nomad_group, namespace=args.nomad_namespace,
            region=args.nomad_region,
        )
    else:
        driver = ComposeDriver(
            project=args.compose_project, files=args.compose_file, services=compose_services,
            default_service=args.compose_service, docker=args.docker,
        )
    return config, driver


def run(args: argparse.Namespace) -> int:
    from .service import AutoscalerService

    config, driver = build(args)
    if config.metrics_port is not None and (problem := listen_problem(config.metrics_host, config.metrics_port)):
        refuse("autoscaler", *problem)
    options = RunOptions.from_args(args)
    return run_service(lambda: AutoscalerService(config, driver, options.settings), options)
