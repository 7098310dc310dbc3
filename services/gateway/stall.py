"""Whether a silent stream's worker is stalled: a pure verdict on the worker's probe reply.

A request silent for ``--stall-timeout`` is not necessarily on a dead or hung worker: on a
busy one it may simply be queued. Migrating it then moves it to the back of another
queue and repeats its prefill, which makes an overload worse. The gateway asks the
worker first (``RequestProbe``) and keeps waiting only when the worker still owes the
request its first output and is producing output for others.
"""

from __future__ import annotations

from proto import RequestProbeReply


def queued_on_live_worker(probe: RequestProbeReply | None, stall_timeout_s: float) -> bool:
    """True when the request waits its turn on a worker that is making progress.

    No reply (dead or wedged worker), ``unknown`` (the worker lost the request), a
    ``running`` request whose chunks stopped reaching us, or an engine that has produced
    nothing for a whole stall timeout all count as stalled.
    """
    return probe is not None and probe.state == "waiting" and probe.engine_idle_s < stall_timeout_s
