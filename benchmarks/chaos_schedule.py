"""The chaos soak's fault schedule: a pure function of (seed, duration, targets).

``schedule`` returns the faults ``benchmarks/chaos.py`` injects, in time order. Each fault
is a kill -9 followed by a restart ``down_s`` later, or a SIGSTOP followed by SIGCONT
``down_s`` later (a hang). The rules keep every fault survivable by design, so that
what the invariant checker finds is meshserve's doing and not the schedule's:

- at most one fault at a time per kind (one worker, one gateway, one NATS node down at
  most: two of three NATS nodes keep the JetStream quorum, one gateway stays to resume
  on, one worker stays to migrate to);
- at most ``max_concurrent`` faults under way at once, across kinds;
- every fault has ended (restarted or continued) by ``duration_s - quiet_s``;
- kinds come in shuffled decks holding every (action, kind) pair once, so that even a
  60-second run strikes every kind; the target within a kind is drawn at random.

NATS nodes are killed but never paused: a stopped node holds its clients' sockets open
and they wait for the client ping timeout (minutes) before moving, which is a
configuration question and not a hang the mesh can act on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Action = Literal["kill", "pause"]
KINDS: tuple[str, ...] = ("worker", "gateway", "nats", "router", "admission", "metering")
PAUSABLE: frozenset[str] = frozenset(KINDS) - {"nats"}


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the soak started
    action: Action
    kind: str
    target: str  # a process label (worker-2, gateway-2, router) or nats-<i>
    down_s: float  # until the restart (kill) or SIGCONT (pause)

    @property
    def ends(self) -> float:
        return self.at + self.down_s


@dataclass(frozen=True)
class ScheduleConfig:
    mean_gap_s: float = 4.0  # between fault starts
    kill_down_s: tuple[float, float] = (1.0, 4.0)
    pause_down_s: tuple[float, float] = (1.0, 5.0)
    max_concurrent: int = 2
    warmup_s: float = 3.0  # load runs alone first
    quiet_s: float = 5.0  # every fault is over this long before the load stops


def schedule(seed: int, duration_s: float, targets: Mapping[str, Sequence[str]],
             config: ScheduleConfig = ScheduleConfig()) -> list[Fault]:
    """The faults for one soak, in time order. ``targets`` maps each kind (``KINDS``) to
    the labels of its instances; a kind missing or empty is never struck."""
    rng = random.Random(seed)
    pairs = [(action, kind) for kind in KINDS if targets.get(kind)
             for action in ("kill", "pause") if action == "kill" or kind in PAUSABLE]
    if not pairs:
        return []
    end = duration_s - config.quiet_s
    faults: list[Fault] = []
    busy_until: dict[str, float] = {}
    t = config.warmup_s
    deck: list[tuple[str, str]] = []
    while True:
        if not deck:
            deck = list(pairs)
            rng.shuffle(deck)
        action, kind = deck.pop()
        low, high = config.kill_down_s if action == "kill" else config.pause_down_s
        down = round(rng.uniform(low, high), 3)
        target = rng.choice(list(targets[kind]))
        at = max(t, busy_until.get(kind, 0.0))
        # Wait for a slot: fewer than max_concurrent faults under way at ``at``.
        while True:
            under_way = sorted(f.ends for f in faults if f.at <= at < f.ends)
            if len(under_way) < config.max_concurrent:
                break
            at = under_way[0]
        at = round(at, 3)
        if at + down > end:
            return faults
        faults.append(Fault(at=at, action=action, kind=kind, target=target, down_s=down))  # type: ignore[arg-type]
        busy_until[kind] = at + down + 0.5  # the restarted instance gets a moment to rejoin
        t = at + rng.uniform(0.5, 1.5) * config.mean_gap_s


def counts(faults: Sequence[Fault]) -> dict[str, int]:
    """Faults per ``action kind`` (e.g. ``kill worker``), for the report."""
    out: dict[str, int] = {}
    for f in faults:
        key = f"{f.action} {f.kind}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
