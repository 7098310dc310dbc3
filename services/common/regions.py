"""Regions (DESIGN.md, Regions): which workers a request may run on and how far each is.

A multi-region mesh is one NATS supercluster, a cluster per region, with each service and
worker told its region (``--region``). A request carries the region it entered by (its
gateway's) and the regions its key allows (``ApiKeyRecord.regions``: data residency).
Admission and the router read the same rules here: a worker outside the allowed regions
is never a candidate, and a worker in another region costs the round trip between the
two regions on top of its own wait (the request's trip there and its first chunk's back).

The round trips are the operator's (``--region-rtt-ms``): a default for any two regions
and, where known, one per pair. Pure and synchronous.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fleet import FleetWorker

# Region names go into metric labels, subjects and key records: short, lower case.
_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# A round trip between two regions nobody named: two neighbouring cloud regions on one
# continent are ~10-30 ms apart, across an ocean ~70-150 ms.
DEFAULT_RTT_MS = 50.0


def region_problem(region: str) -> str | None:
    """What is wrong with ``region`` as a region name, or None."""
    if _REGION.fullmatch(region):
        return None
    return f"region {region!r}: lower-case letters, digits and '-', at most 63, starting with a letter or digit"


def parse_regions(text: str) -> list[str]:
    """A comma-separated list of region names (e.g. ``keys create --regions eu-west,eu-central``)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:  # an empty shell variable would otherwise make a key allowed everywhere
        raise ValueError("no region named: give one or more, e.g. eu-west,eu-central")
    for name in names:
        problem = region_problem(name)
        if problem:
            raise ValueError(problem)
    return list(dict.fromkeys(names))


@dataclass(frozen=True, slots=True)
class RegionLatency:
    """Round trips between regions, in seconds: ``default_s`` for any pair not in ``pairs``."""

    default_s: float = DEFAULT_RTT_MS / 1000
    pairs: dict[frozenset[str], float] = field(default_factory=dict)

    def rtt(self, a: str, b: str) -> float:
        """The round trip from region ``a`` to ``b`` (0 within one, or where either is unnamed)."""
        if a == b or not a or not b:
            return 0.0
        return self.pairs.get(frozenset((a, b)), self.default_s)

    @classmethod
    def parse(cls, spec: str) -> RegionLatency:
        """``"50"`` (ms between any two regions) or ``"50,eu:us=85,eu:ap=220"`` (per pair)."""
        default_ms = DEFAULT_RTT_MS
        pairs: dict[frozenset[str], float] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, sep, value = part.partition("=")
            try:
                ms = float(value if sep else name)
            except ValueError:
                raise ValueError(f"--region-rtt-ms {part!r}: expected MS or A:B=MS") from None
            if not 0 <= ms < 10_000:
                raise ValueError(f"--region-rtt-ms {part!r}: a round trip is 0 to 10,000 ms")
            if not sep:
                default_ms = ms
                continue
            a, colon, b = name.partition(":")
            if not colon or a == b:
                raise ValueError(f"--region-rtt-ms {part!r}: a pair is two regions, A:B=MS")
            for region in (a, b):
                problem = region_problem(region)
                if problem:
                    raise ValueError(f"--region-rtt-ms {part!r}: {problem}")
            pairs[frozenset((a, b))] = ms / 1000
        return cls(default_ms / 1000, pairs)


def region_of(w: FleetWorker) -> str:
    return w.info.region if w.info is not None else ""


def allowed(workers: list[FleetWorker], regions: Sequence[str]) -> list[FleetWorker]:
    """The ``workers`` a request limited to ``regions`` may run on (``workers`` itself,
    when none named: the router's per-set caches know a set by its identity)."""
    if not regions:
        return workers
    return [w for w in workers if region_of(w) in regions]


@dataclass(frozen=True, slots=True)
class RegionGroup:
    region: str
    rtt_s: float  # from the request's region
    workers: list[FleetWorker]


def by_distance(origin: str, workers: list[FleetWorker], latency: RegionLatency) -> list[RegionGroup]:
    """``workers`` grouped by region, the request's own first, then the nearest; one
    group when the request names no region or every worker is in one."""
    if not origin:  # a request with no region: the placement is the one before regions
        return [RegionGroup(origin, 0.0, workers)]
    groups: dict[str, list[FleetWorker]] = {}
    for w in workers:
        groups.setdefault(region_of(w), []).append(w)
    if len(groups) == 1:
        (region,) = groups
        return [RegionGroup(region, latency.rtt(origin, region), workers)]
    out = [RegionGroup(region, latency.rtt(origin, region), members) for region, members in groups.items()]
    out.sort(key=lambda g: (g.rtt_s, g.region != origin, g.region))
    return out
