"""Drivers: how the autoscaler's decisions become replicas (DESIGN.md, Autoscaling).

One interface, three implementations:

- ``LocalDriver`` (the embedded default under ``meshserve up``): worker processes on this
  machine, ``python -m ops.cli serve worker --model POOL --worker-id ID ...``, logs in the
  state folder. It knows each worker's id and process, so it can stop exactly one.
- ``NomadDriver``: the worker task group's count in a Nomad job, through Nomad's HTTP API.
- ``ComposeDriver``: ``docker compose -p PROJECT up -d --scale worker=N --no-recreate``.

The shell never kills a replica to scale down. It drains the replica the control law
chose (``ControlCommand(drain)``); the worker refuses new work, finishes what it holds,
deregisters and exits by itself. Only then does the shell call ``stopped(ref)``, and the
driver releases what the orchestrator holds for it (reaps the process, removes the
container, lowers the job's count). ``stop(ref)`` is the forced stop, used only once an
acknowledged drain has outlived its timeout (by then the worker has ended its requests
itself, so a worker still there is hung).

A driver that cannot act raises ``DriverError(reason, message)`` and remembers why:
``status()`` reports it and every error is counted by reason (the shell turns the counts
into ``meshserve:autoscaler_driver_errors_total{driver,reason}``). Nothing silently does
nothing.
"""

from .base import Driver, DriverError, DriverStatus, ErrorListener, Launch, WorkerRef, pool_slug
from .compose import ComposeDriver
from .local import LocalDriver, default_worker_command
from .nomad import NomadDriver

__all__ = [
    "ComposeDriver",
    "Driver",
    "DriverError",
    "DriverStatus",
    "ErrorListener",
    "Launch",
    "LocalDriver",
    "NomadDriver",
    "WorkerRef",
    "default_worker_command",
    "pool_slug",
]
