"""The router: places each request on a worker of its model's pool (DESIGN.md, Routing).

The shared ``services.common.fleet.FleetView`` keeps the live picture of the pools
(registry, gauges, optimistic accounting, the prefix index fed by KV events);
``policy`` turns it into placement decisions (``decision``: what one takes and gives;
``cascade`` classifies a cascade's requests). All are synchronous and deterministic; the async NATS shell drives them.
"""

from .cascade import CascadeConfig
from .policy import (
    POLICIES,
    Candidate,
    NoCapacity,
    PolicyConfig,
    RouteDecision,
    RouteQuery,
    Router,
    RouterConfig,
)

__all__ = [
    "POLICIES",
    "Candidate",
    "CascadeConfig",
    "NoCapacity",
    "PolicyConfig",
    "RouteDecision",
    "RouteQuery",
    "Router",
    "RouterConfig",
]
