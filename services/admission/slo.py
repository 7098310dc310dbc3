"""Predictive SLO admission per tier: shed early rather than admit a request that will
miss its TTFT SLO and slow everyone already running.

Prediction. On replica ``w``, a request of tier ``x`` would see

    ttft_x(w) = (queued_prefill(w) · share_x + uncached(w)) / prefill_tokens_per_s(w) + step(w)

``share_x`` is the part of the queue that runs before a tier-``x`` request. Workers run
higher ``GenerateRequest.priority`` first (the gateway sets it from the tier's priority),
so a premium request waits only for queued premium work; admission estimates the queue's
composition from the prompt tokens it admitted recently per priority (exponentially
decayed, ``mix_half_life_s``). The estimate errs towards safety for higher tiers: they are
served first, so the real queue holds less of them than the admitted mix. Without
history, or with ``priority_queues=False`` (FIFO workers), ``share_x = 1``. Workers with no
measured rate yet (cold start) use ``default_prefill_tokens_per_s`` / ``default_step_time_s``.

Overtaking. The queue ahead is not all a request waits for: higher-priority work
arriving while it waits runs first too. Of the pool's prefill rate, the part that such
arrivals take is ``overtake_x = r_above(x) / Σ_w prefill_tokens_per_s(w)`` (capped at
``max_overtake``), ``r_above(x)`` being the uncached prompt tokens per second admitted
recently at a higher priority (the decayed mix: a steady rate r leaves a weight of
r · half_life / ln 2). So the queue term drains at ``rate · (1 − overtake_x)``:

    ttft_x(w) = queued_prefill(w) · share_x / (rate(w) · (1 − overtake_x)) + uncached(w) / rate(w) + step(w)

The top tier and FIFO workers have no overtaking.

Ordering guarantee: a higher tier is never shed while a lower one is admitted.
A tier-``t`` request is admitted on a replica only if it meets its own SLO there *and* a
request of the same shape from every higher tier would still be admitted there with a
margin: for a tier ``x`` that is ``k`` priority levels above ``t``

    ttft_x(w) ≤ target · headroom^k · slo_x          (k = 0: the request's own check)

(``target`` = 1 by default; below 1 it keeps a margin for prediction error, see SloConfig.)

So when the premium-visible queue of every replica grows past 0.8 · 1 s, standard
requests are refused, past 0.64 s batch ones, and premium ones only past 1 s. The proof
is one line: thresholds only shrink as ``k`` grows, and every check a higher tier makes
is one a lower tier makes too, at a larger ``k``. Lower tiers still use their own, longer
SLOs against the longer queue they really wait in: with priority queues a pool full of
batch work keeps admitting premium and standard, and batch up to its own 10 s.

Long prompts: a request whose prefill alone misses the SLO on an idle replica could
never be admitted, so its threshold is raised to ``own · (1 + long_prompt_slack · headroom^k)``
(own = its TTFT on an empty queue): it is admitted when it waits at most that fraction of
its own prefill time. The margin shrinks with ``k`` like the others, so ordering holds.

``retry_after`` for an SLO refusal is the smallest excess over all replicas: the predicted
seconds of queue that must drain before the request would pass.

Calibration. The formula predicts a mean; what the SLO is about is the tail. Under
sustained overload every admitted request is a marginal one, predicted right at its
limit, and what it then meets varies around the prediction (Poisson bursts of
higher-priority arrivals overtaking it, gauge staleness, a replica's rate drifting).
So admission learns from the outcome: for each admitted request it keeps the raw
prediction, and when the gateway reports the request's TTFT (at its first token; the
usage event, with arrival and first-token times, stands in for a lost report) it
records actual / predicted per tier. A tier's predictions are multiplied by the
``calibration_quantile`` (0.999) of the last ``calibration_window`` (500) ratios, once it
has ``calibration_min_samples`` (clamped to ``calibration_bounds``): a request is admitted
when that share of requests predicted like it met the limit. Over 500 ratios that is the
largest: at 0.995 (the third largest) one admitted standard request in ~600 still missed
its SLO at 2× overload, in two seeds of three, while the stricter bound admitted as many
requests there and the same at 1× and 1.3× (BENCHMARKS.md, Admission). An engine whose real
TTFT runs below the formula gets a factor under 1 and admits more.

Before a tier has those outcomes, the bound takes the queue term at ``calibration_prior``
(4, the most calibration may learn) times the formula's, and the whole at the largest
ratio seen so far (at least 1). Outcomes arrive a TTFT after their admission, and a mesh
overloaded from its first second admitted on the bare formula until then: in 2× runs
the only admitted requests past their SLO were standard ones admitted in the first
1.8 s, one of them at 2.45× its formula, most of it queue. It is the queue that the
formula gets wrong, and what it gets wrong is overtaking: higher-priority arrivals the
request will wait for. So the prior applies only to tiers that can be overtaken (on
priority-queue workers, every tier but the top: with it on premium too, 2 % of premium
requests were refused at 2×, where premium alone is half the fleet's capacity). An idle
mesh does not notice the prior at all: with nothing queued there is nothing to multiply,
and its outcomes soon read 1.

That product is a bound, not a prediction: under overload the tail ratio reads 2-3 while
the median reads about 1, and a bound reported as the predicted TTFT was more than twice
the TTFT seen for most admitted requests. So the two are kept apart: the decision holds
the bound (× the quantile ratio) against the limit, and the TTFT admission predicts,
reports and explains a refusal with is the point estimate (× the median ratio).

Slack. A verdict tells the router how much more prefill work it may put ahead of the
request (``slack_tokens``) and still pass every check. It is also held to what the
point prediction promises: the work ahead may add at most the prediction again, so the
TTFT reported for one replica stays within 2× of where the request really runs.

Only errors that can move a decision are learnt: both times are raised to a floor,
``calibration_floor`` × the tier's SLO, before the ratio is taken. On a light load a
prediction of 40 ms meets a TTFT of 60-90 ms, the rest gateway, bus and HTTP time the
formula does not model; taken as it is, that ratio (2-4) became the tier's factor and multiplied every
prediction, queue included, until an idle mesh refused premium requests. Raised to the
floor it reads 1 (right, as far as the SLO cares), while a miss from a small prediction
(50 ms predicted, 2 s seen) still counts in full, against the floor.

That latency outside the engine is learnt instead, as an additive ``overhead``: the
median (``overhead_quantile``) of actual − formula over the recent requests admitted
while no replica of the pool had anything queued, with a prediction below their floor;
at most the tightest tier's floor. There the formula has nothing left to get wrong but
the prompt's own prefill, wherever the router puts it. Requests admitted with queues
about are left out: what they meet besides the formula (a burst of higher-priority
arrivals, a router placing them behind work admission did not count there) only adds
time, and under overload the median over all small predictions read 0.6 s. A low
quantile over all of them would be safe but reads the mesh's fastest, not its usual
(6 ms for a typical 20 ms on a busy 2-core machine). Every prediction is ``(formula + overhead) ×
factor``: a cached prompt's 7 ms of engine time is predicted as the ~20 ms the gateway
sees, not as a third of it.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from proto.errors import NO_CAPACITY_RETRY_AFTER_S
from proto.workers import WorkerGauge

SloReason = Literal["slo", "no_capacity"]


@dataclass(frozen=True, slots=True)
class TierSLO:
    name: str
    ttft_slo_s: float
    priority: int  # higher runs first on the workers and is shed last


DEFAULT_TIERS: tuple[TierSLO, ...] = (
    TierSLO("premium", 1.0, 2),
    TierSLO("standard", 2.0, 1),
    TierSLO("batch", 10.0, 0),
)


@dataclass(frozen=True, slots=True)
class SloConfig:
    tiers: tuple[TierSLO, ...] = DEFAULT_TIERS
    default_tier: str = "standard"  # for a tier name the config does not know
    headroom: float = 0.8  # each priority level below sheds at this fraction of the one above
    long_prompt_slack: float = 0.5
    priority_queues: bool = True
    mix_half_life_s: float = 30.0
    default_prefill_tokens_per_s: float = 8000.0
    default_step_time_s: float = 0.05
    min_retry_after_s: float = 0.25
    no_capacity_retry_after_s: float = NO_CAPACITY_RETRY_AFTER_S
    max_overtake: float = 0.9  # cap: a queue is taken to drain at ≥ 10 % of the rate, however busy
    # Admit when the (calibrated) prediction is within this fraction of the SLO: below 1
    # keeps a fixed margin on top of the calibration's.
    target: float = 1.0
    calibration: bool = True
    calibration_quantile: float = 0.999
    calibration_window: int = 500
    calibration_min_samples: int = 50
    # Until a tier has ``calibration_min_samples`` outcomes, its bound takes the queue term
    # at this many times the formula's: a mesh overloaded from its first second must not
    # admit on the bare formula while the first outcomes are still on their way.
    calibration_prior: float = 4.0
    calibration_bounds: tuple[float, float] = (0.5, 4.0)
    # Fraction of the tier's SLO below which predicted and actual TTFT count as equal.
    calibration_floor: float = 0.25
    overhead_min_samples: int = 10  # light-load outcomes before the overhead is used
    overhead_quantile: float = 0.5
    # The router may put work ahead of an admitted request worth at most this fraction of
    # its point prediction (on top of every check's own room): the TTFT admission reports
    # stays within 1 + placement_slack of where the request really runs.
    placement_slack: float = 1.0

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or self.default_tier not in names:
            raise ValueError(f"tiers must be unique and include the default tier {self.default_tier!r}")
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        if not 0 <= self.max_overtake < 1:
            raise ValueError("max_overtake must be in [0, 1)")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")
        if not 0 < self.calibration_quantile < 1 or self.calibration_window < 1:
            raise ValueError("calibration_quantile must be in (0, 1) and calibration_window ≥ 1")
        if not 0 <= self.calibration_floor < 1 or self.overhead_min_samples < 1:
            raise ValueError("calibration_floor must be in [0, 1) and overhead_min_samples ≥ 1")
        if not 0 <= self.overhead_quantile < 1:
            raise ValueError("overhead_quantile must be in [0, 1)")
        if self.placement_slack < 0:
            raise ValueError("placement_slack must be ≥ 0")
        lo, hi = self.calibration_bounds
        if not 0 < lo <= 1 <= hi:
            raise ValueError("calibration_bounds must be (lo, hi) with 0 < lo ≤ 1 ≤ hi")
        if not 1 <= self.calibration_prior <= hi:
            raise ValueError("calibration_prior must be within [1, calibration_bounds[1]]")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What admission knows of one replica of the request's pool."""

    worker_id: str
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet
    step_time_s: float = 0.0
    cached_tokens: int = 0  # of this request's prompt, when the shell can estimate it
    draining: bool = False
    # Seconds before the model is ready here (a hot-swap host's load, or what is left of
    # one): waited before the queue, never forgiven as a long prompt's own time is.
    load_s: float = 0.0
    # The round trip to its region from the request's (DESIGN.md, Regions): the request's
    # trip there and its first chunk's back, added to the TTFT; 0 in the request's region.
    network_s: float = 0.0

    @classmethod
    def from_gauge(cls, g: WorkerGauge, cached_tokens: int = 0) -> ReplicaLoad:
        return cls(
            worker_id=g.worker_id,
            queued_prefill_tokens=g.queued_prefill_tokens,
            prefill_tokens_per_s=g.prefill_tokens_per_s,
            step_time_s=g.step_time_s,
            cached_tokens=cached_tokens,
            draining=g.draining,
        )


@dataclass(frozen=True, slots=True)
class SloVerdict:
    admitted: bool
    tier: str
    predicted_ttft: float | None  # on the chosen (or, if refused, the best) replica
    worker_id: str | None = None
    reason: SloReason | None = None
    retry_after: float = 0.0
    message: str = ""
    # Admitted: how many more prefill tokens (queue ahead or uncached prompt) the request
    # could meet on top of the prediction and still pass every check. The router may
    # place it elsewhere only within that budget (RouteRequest.prefer_slack_tokens).
    slack_tokens: int = 0
    # The formula alone, before overhead and calibration: what outcomes are compared with.
    raw_predicted_ttft: float | None = None
    # The tail bound the decision held against the SLO: (formula + overhead) × the
    # calibration's quantile factor. ``predicted_ttft`` is the point estimate (× the median).
    ttft_bound: float | None = None
    queue_free: bool = False  # admitted while no replica had anything queued (teaches the overhead)


class TierMix:
    """Exponentially decayed prompt tokens admitted per priority."""

    __slots__ = ("half_life_s", "started", "updated", "weights")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.weights: dict[int, float] = {}
        self.updated = -math.inf
        self.started = math.inf  # first addition: how much history the weights hold

    def _decay(self, now: float) -> None:
        if now > self.updated:
            if self.weights and math.isfinite(self.updated):
                f = 0.5 ** ((now - self.updated) / self.half_life_s)
                for p in self.weights:
                    self.weights[p] *= f
            self.updated = now

    def add(self, priority: int, tokens: float, now: float) -> None:
        self._decay(now)
        self.started = min(self.started, now)
        self.weights[priority] = self.weights.get(priority, 0.0) + tokens

    def rate_above(self, priority: int, now: float) -> float:
        """Tokens per second recently admitted at a priority strictly above ``priority``."""
        self._decay(now)
        weight = sum(w for p, w in self.weights.items() if p > priority)
        if not weight:
            return 0.0
        # A steady rate r fills the weights up to r · half_life / ln 2 only after several
        # half-lives: early on, scale up by the part filled so far (at most 4×, so the
        # first few requests do not extrapolate wildly).
        filled = max(1.0 - 0.5 ** ((now - self.started) / self.half_life_s), 0.25)
        return weight * math.log(2) / self.half_life_s / filled

    def share_at_or_above(self, priority: int, now: float) -> float:
        """Fraction of the queued work that runs before a request of ``priority``."""
        self._decay(now)
        total = sum(self.weights.values())
        if total <= 1e-9:
            return 1.0  # no history: assume the whole queue is ahead
        return sum(w for p, w in self.weights.items() if p >= priority) / total


class RankedWindow:
    """The last ``size`` values, kept in arrival order and in rank order: a quantile is a
    lookup. Sorting the window on every outcome took ~5 % of admission's CPU at 200 req/s
    (py-spy); a bisected insert and remove into 500 floats is a small memmove."""

    __slots__ = ("_ranked", "_recent")

    def __init__(self, size: int) -> None:
        self._recent: deque[float] = deque(maxlen=size)
        self._ranked: list[float] = []

    def append(self, value: float) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen:
            del self._ranked[bisect.bisect_left(self._ranked, recent[0])]
        recent.append(value)
        bisect.insort(self._ranked, value)

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self) -> Iterator[float]:
        return iter(self._recent)

    def at(self, quantile: float) -> float:
        """The value at rank ``int(quantile · n)`` (capped at the largest), as indexing the
        sorted window would give. Not empty."""
        ranked = self._ranked
        return ranked[min(int(quantile * len(ranked)), len(ranked) - 1)]

    def largest(self) -> float:
        return self._ranked[-1]


class Calibration:
    """Per tier, the recent ratios of actual to predicted TTFT and their quantile; for
    the whole mesh, the latency the formula leaves out (``overhead``)."""

    __slots__ = ("_expected", "_factor", "_overhead", "bounds", "max_overhead_s", "min_samples", "overhead_min_samples",
                 "overhead_quantile", "quantile", "ratios", "residuals")

    def __init__(self, quantile: float, window: int, min_samples: int, bounds: tuple[float, float],
                 overhead_min_samples: int = 10, max_overhead_s: float = math.inf,
                 overhead_quantile: float = 0.5) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.bounds = bounds
        self.overhead_min_samples = overhead_min_samples
        self.max_overhead_s = max_overhead_s
        self.overhead_quantile = overhead_quantile
        self.ratios: dict[str, RankedWindow] = defaultdict(lambda: RankedWindow(window))
        self.residuals = RankedWindow(window)  # actual − formula, light load
        self._factor: dict[str, float] = {}  # the tail quantile: the decision's bound
        self._expected: dict[str, float] = {}  # the median: the point prediction
        self._overhead = 0.0

    def observe(self, tier: str, predicted_s: float, actual_s: float, floor_s: float = 0.0,
                queue_free: bool = False) -> None:
        """``predicted_s``: the formula's TTFT; ``floor_s``: times below it count as equal
        to it (errors the SLO cannot see); ``queue_free``: admitted onto an empty pool
        (with a prediction below the floor, it teaches the overhead)."""
        if predicted_s <= 0 or actual_s < 0 or not math.isfinite(actual_s):
            return
        if queue_free and predicted_s < floor_s:
            self.residuals.append(actual_s - predicted_s)
            if len(self.residuals) >= self.overhead_min_samples:
                q = self.residuals.at(self.overhead_quantile)
                self._overhead = min(max(q, 0.0), self.max_overhead_s)
        window = self.ratios[tier]
        window.append(max(actual_s, floor_s) / max(predicted_s + self._overhead, floor_s))
        if len(window) >= self.min_samples:
            self._factor[tier] = min(max(window.at(self.quantile), self.bounds[0]), self.bounds[1])
            self._expected[tier] = min(max(window.at(0.5), self.bounds[0]), self.bounds[1])
        else:  # too few to read a tail from: the worst seen, if it is worse than the formula
            self._factor[tier] = min(max(1.0, window.largest()), self.bounds[1])

    def calibrated(self, tier: str) -> bool:
        """Whether the tier has outcomes enough to read a tail from."""
        return len(self.ratios.get(tier, ())) >= self.min_samples

    def factor(self, tier: str) -> float:
        """The tail factor: ``quantile`` of the ratios once there are ``min_samples``,
        before that the largest ratio seen (at least 1); what admission decides on."""
        return self._factor.get(tier, 1.0)

    def expected_factor(self, tier: str) -> float:
        """The median ratio: what the point prediction is multiplied by."""
        return self._expected.get(tier, 1.0)

    def overhead(self) -> float:
        return self._overhead


class SloAdmitter:
    def __init__(self, config: SloConfig | None = None) -> None:
        self.config = config or SloConfig()
        self._tiers = {t.name: t for t in self.config.tiers}
        levels = sorted({t.priority for t in self.config.tiers}, reverse=True)
        self._level = {p: i for i, p in enumerate(levels)}  # 0 = highest priority
        self.mix = TierMix(self.config.mix_half_life_s)
        cfg = self.config
        self.calibration = Calibration(
            cfg.calibration_quantile, cfg.calibration_window, cfg.calibration_min_samples, cfg.calibration_bounds,
            cfg.overhead_min_samples, cfg.calibration_floor * min(t.ttft_slo_s for t in cfg.tiers),
            cfg.overhead_quantile,
        )

    def _factor(self, t: TierSLO) -> float:
        return self.calibration.factor(t.name) if self.config.calibration else 1.0

    def _queue_prior(self, t: TierSLO) -> float:
        """How much more the bound makes of the queue term while ``t`` is uncalibrated:
        only for a tier that higher-priority arrivals can overtake (the top tier's queue
        is the work already ahead of it, which the gauges count)."""
        cfg = self.config
        if not cfg.calibration or not cfg.priority_queues or self._level[t.priority] == 0:
            return 1.0
        return 1.0 if self.calibration.calibrated(t.name) else cfg.calibration_prior

    def _expected_factor(self, t: TierSLO) -> float:
        return self.calibration.expected_factor(t.name) if self.config.calibration else 1.0

    def overhead(self) -> float:
        """Seconds of TTFT outside the engine (gateway, bus, HTTP) added to every prediction."""
        return self.calibration.overhead() if self.config.calibration else 0.0

    def observe(self, tier: str, predicted_s: float, actual_s: float, queue_free: bool = False) -> None:
        """The TTFT a request admitted with raw prediction ``predicted_s`` (onto a pool
        with nothing queued: ``queue_free``) really had."""
        t = self.tier(tier)
        self.calibration.observe(t.name, predicted_s, actual_s, self.config.calibration_floor * t.ttft_slo_s,
                                 queue_free)

    def tier(self, name: str) -> TierSLO:
        return self._tiers.get(name) or self._tiers[self.config.default_tier]

    def record_admitted(self, tier: str, uncached_tokens: int, now: float) -> None:
        """Feed the queue-composition estimate (call for every admitted request)."""
        self.mix.add(self.tier(tier).priority, uncached_tokens, now)

    def _guards(self, t: TierSLO) -> list[tuple[TierSLO, int]]:
        """The tier itself (k = 0) and every strictly higher tier with its level distance."""
        lt = self._level[t.priority]
        out = [(t, 0)]
        for x in self.config.tiers:
            if x.priority > t.priority:
                out.append((x, lt - self._level[x.priority]))
        return out

    def predict(
        self, replica: ReplicaLoad, prompt_tokens: int, tier: str, now: float, pool_rate: float | None = None
    ) -> float:
        """Predicted TTFT (the point estimate) of a ``tier`` request of ``prompt_tokens``
        on ``replica``; ``pool_rate``: the pool's prefill tokens/s (default: this replica alone)."""
        rate, step = self._rate_step(replica)
        t = self.tier(tier)
        drain = self._drain(t, pool_rate if pool_rate is not None else rate, now)
        uncached = max(prompt_tokens - replica.cached_tokens, 0)
        raw = replica.queued_prefill_tokens * self._share(t, now) / (rate * drain) + uncached / rate + step + replica.load_s + replica.network_s
        return (raw + self.overhead()) * self._expected_factor(t)

    def _rate_step(self, r: ReplicaLoad) -> tuple[float, float]:
        cfg = self.config
        rate = r.prefill_tokens_per_s if r.prefill_tokens_per_s > 0 else cfg.default_prefill_tokens_per_s
        step = r.step_time_s if r.step_time_s > 0 else cfg.default_step_time_s
        return rate, step

    def _drain(self, t: TierSLO, pool_rate: float, now: float) -> float:
        """The fraction of the prefill rate left to a tier-``t`` request's queue once
        higher-priority arrivals have overtaken it (1.0 on FIFO workers)."""
        if not self.config.priority_queues or pool_rate <= 0:
            return 1.0
        overtake = min(self.mix.rate_above(t.priority, now) / pool_rate, self.config.max_overtake)
        return 1.0 - overtake

    def _share(self, t: TierSLO, now: float) -> float:
        if not self.config.priority_queues:
            return 1.0
        return self.mix.share_at_or_above(t.priority, now)

    def check(self, tier: str, prompt_tokens: int, replicas: Iterable[ReplicaLoad], now: float) -> SloVerdict:
        """Admit when some replica meets the tier's SLO without endangering higher tiers."""
        cfg = self.config
        t = self.tier(tier)
        live = [r for r in replicas if not r.draining]
        if not live:
            return SloVerdict(
                admitted=False,
                tier=t.name,
                predicted_ttft=None,
                reason="no_capacity",
                retry_after=cfg.no_capacity_retry_after_s,
                message="no replica is serving this model",
            )
        pool_rate = sum(self._rate_step(r)[0] for r in live)
        guards = [
            (x, k, self._share(x, now), cfg.headroom**k, self._drain(x, pool_rate, now), self._factor(x),
             self._queue_prior(x))
            for x, k in self._guards(t)
        ]
        best_ok: tuple[float, ReplicaLoad, float, float, float] | None = None  # own_pred, replica, room, raw, bound
        best_any: tuple[float, ReplicaLoad] | None = None
        least_excess = math.inf
        binding = ""
        overhead = self.overhead()
        for r in live:
            rate, step = self._rate_step(r)
            uncached = max(prompt_tokens - r.cached_tokens, 0)
            own = uncached / rate + step + overhead  # TTFT on an empty queue
            excess = 0.0
            why = ""
            own_pred = raw_pred = own_bound = 0.0
            room = math.inf  # tokens of extra prefill work every check still passes with
            for x, k, share, margin, drain, factor, prior in guards:
                queue = r.queued_prefill_tokens * share / (rate * drain)
                raw = queue + uncached / rate + step + r.load_s + r.network_s
                # the tail bound: what the limit is held against
                pred = (raw + queue * (prior - 1) + overhead) * factor
                if k == 0:
                    own_pred, raw_pred, own_bound = (raw + overhead) * self._expected_factor(x), raw, pred
                    # The router may add work ahead only while the TTFT admission reports
                    # grows by at most placement_slack (1: doubles): a prediction made for
                    # one replica stays a fair prediction of where the request really runs.
                    room = min(room, cfg.placement_slack * (raw + overhead) * rate * drain)
                limit = max(cfg.target * margin * x.ttft_slo_s, own * factor * (1 + cfg.long_prompt_slack * margin))
                # Δ tokens ahead add at most factor · prior · Δ / (rate · drain) seconds (share, drain ≤ 1).
                room = min(room, (limit - pred) * rate * drain / (factor * prior))
                if pred - limit > excess:
                    excess = pred - limit
                    point = (raw + overhead) * self._expected_factor(x)
                    why = (
                        f"predicted TTFT {point:.2f} s, p{self.config.calibration_quantile * 100:g} bound"
                        f" {pred:.2f} s > {limit:.2f} s"
                        + (f" ({x.name} SLO)" if k == 0 else f" (protecting {x.name})")
                        + f" on {r.worker_id}"
                    )
            if best_any is None or own_pred < best_any[0]:
                best_any = (own_pred, r)
            if excess <= 0:
                # The request's own region while a replica there meets the SLO (its
                # neighbours take its overflow, not its traffic), else the nearest.
                if best_ok is None or (r.network_s, own_pred) < (best_ok[1].network_s, best_ok[0]):
                    best_ok = (own_pred, r, room, raw_pred, own_bound)
            elif excess < least_excess:
                least_excess, binding = excess, why
        if best_ok is not None:
            return SloVerdict(
                admitted=True,
                tier=t.name,
                predicted_ttft=best_ok[0],
                worker_id=best_ok[1].worker_id,
                slack_tokens=max(int(best_ok[2]), 0),
                raw_predicted_ttft=best_ok[3],
                ttft_bound=best_ok[4],
                queue_free=all(r.queued_prefill_tokens == 0 for r in live),
            )
        assert best_any is not None
        return SloVerdict(
            admitted=False,
            tier=t.name,
            predicted_ttft=best_any[0],
            worker_id=best_any[1].worker_id,
            reason="slo",
            retry_after=max(least_excess, cfg.min_retry_after_s),
            message=f"{t.name}: {binding}",
        )

    def thresholds(self, tier: str) -> list[tuple[str, float]]:
        """The limits a ``tier`` request is held to (tier name, seconds), before any
        long-prompt allowance; for docs and metrics."""
        t = self.tier(tier)
        cfg = self.config
        return [(x.name, cfg.target * cfg.headroom**k * x.ttft_slo_s) for x, k in self._guards(t)]
