"""A worker's time on its accelerators, period by period (pure: the caller passes the
time), for what the fleet costs (``proto.CapacityEvent``, metering's fleet report).

The worker tells the meter when its in-flight count goes from none to some and back
(``observe`` on every request's start and end) and, on every gauge tick, what share of
its accelerators each model holds (a hot-swap host's models change as they load and go).
Between two observations the last state holds, so busy time is exact to the request and
shares to the gauge interval. ``close`` ends the current period and starts the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import CapacityEvent


@dataclass(slots=True)
class CapacityMeter:
    worker_id: str
    model: str
    accelerator: str
    accelerators: int
    start: float  # epoch s: the current period's start
    engine: str = ""
    host_id: str = ""
    _last: float = field(init=False)
    _busy: bool = field(default=False, init=False)
    _busy_s: float = field(default=0.0, init=False)
    _shares: dict[str, float] = field(default_factory=dict, init=False)
    _held_s: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._last = self.start
        self._shares = {self.model: 1.0}

    def _advance(self, now: float) -> None:
        elapsed = max(0.0, now - self._last)  # a clock stepping back adds nothing
        if self._busy:
            self._busy_s += elapsed
        for model, share in self._shares.items():
            self._held_s[model] = self._held_s.get(model, 0.0) + share * elapsed
        self._last = max(self._last, now)

    def observe(self, now: float, *, busy: bool | None = None, shares: dict[str, float] | None = None) -> None:
        """From ``now`` on: busy (a request in flight) or not, and each model's share."""
        self._advance(now)
        if busy is not None:
            self._busy = busy
        if shares is not None:
            self._shares = {model: min(1.0, max(0.0, share)) for model, share in shares.items()}

    def close(self, now: float) -> CapacityEvent | None:
        """The period from its start to ``now`` (or to the latest time observed, if the clock
        stepped back); the next one starts where it ends. None when no time has passed: an
        empty period would repeat the next one's id."""
        self._advance(now)
        end = self._last  # ≥ now, ≥ start: held and busy time were counted up to it
        if end <= self.start:
            return None
        event = CapacityEvent(
            event_id=f"{self.worker_id}:{round(self.start * 1000)}",
            worker_id=self.worker_id,
            model=self.model,
            host_id=self.host_id,
            engine=self.engine,
            accelerator=self.accelerator,
            accelerators=self.accelerators,
            start=self.start,
            end=end,
            busy_s=min(self._busy_s, end - self.start),
            held_s={model: round(held, 6) for model, held in self._held_s.items() if held > 0 or model == self.model},
        )
        self.start = end
        self._busy_s = 0.0
        self._held_s = {}
        return event
