"""The admission verdict: quota first, then the SLO prediction, in one synchronous step.

Quota comes first because it is the client's own budget (its refusal tells the client
to slow down, whatever the fleet's state). The SLO check runs only on a reserved
request, and a shed request gets its reservation back in full, request count
included: a client is not charged for work the fleet refused. Both steps happen in one
call with no await in between, so no other request can see the buckets half-updated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from proto.messages import AdmissionDecision, AdmissionRequest, RouteRequest, UsageEvent

from .buckets import Limiter, Limits
from .slo import ReplicaLoad, SloAdmitter, SloVerdict


def limits_of(req: AdmissionRequest) -> Limits:
    return Limits(rpm=req.rpm_limit, tpm=req.tpm_limit, org_rpm=req.org_rpm_limit, org_tpm=req.org_tpm_limit,
                  concurrent=req.concurrency_limit)


class AdmissionPolicy:
    # Predictions kept for calibration until the request's TTFT report or usage event: one
    # that has neither by then (both lost, a request still queued) is dropped.
    prediction_max_age_s = 600.0
    # Outcomes kept for ``prediction_errors`` (operators and benchmarks, not decisions).
    error_log_size = 10_000

    def __init__(self, limiter: Limiter | None = None, slo: SloAdmitter | None = None) -> None:
        self.limiter = limiter or Limiter()
        self.slo = slo or SloAdmitter()
        # request id → (tier, raw predicted TTFT, onto an idle pool, point prediction, the
        # decision's bound, admitted at): the calibration's inputs, and what was predicted
        self.predictions: dict[str, tuple[str, float, bool, float, float, float]] = {}
        # (tier, point prediction, raw prediction, actual TTFT, bound, admitted at) of recent
        # admitted requests
        self.outcomes: deque[tuple[str, float, float, float, float, float]] = deque(maxlen=self.error_log_size)
        self.slo_skipped = 0  # admitted on quota alone: the fleet was not known yet

    def check(self, req: AdmissionRequest, replicas: Iterable[ReplicaLoad], now: float) -> AdmissionDecision:
        """``replicas``: the request's pool, with ``cached_tokens`` set when known."""
        return self.check_verdict(req, replicas, now)[0]

    def check_verdict(
        self, req: AdmissionRequest, replicas: Iterable[ReplicaLoad] | None, now: float
    ) -> tuple[AdmissionDecision, SloVerdict | None]:
        """``check``, plus the SLO verdict (None when quota refused first, or when the
        fleet is not known): the shell counts an admission on the replica the prediction used.

        ``replicas`` None: the shell cannot see the fleet yet (its registry has not been read
        since it started): the quotas still hold, the SLO check is skipped, as a gateway
        that cannot reach admission fails open. An empty pool would otherwise read as "no
        replica is serving this model" for every request until the registry is read."""
        reserve = req.prompt_tokens + req.max_tokens
        quota = self.limiter.reserve(req.request_id, req.key_id, req.org, reserve, limits_of(req), now)
        if not quota.admitted:
            return AdmissionDecision(
                request_id=req.request_id,
                admitted=False,
                reason=quota.reason,
                retry_after=quota.retry_after,
                message=quota.message,
            ), None
        if replicas is None:
            self.slo_skipped += 1
            return AdmissionDecision(request_id=req.request_id, admitted=True,
                                     reserved_tokens=quota.reserved_tokens), None
        pool = list(replicas)
        verdict = self.slo.check(req.tier, req.prompt_tokens, pool, now)
        if not verdict.admitted:
            self.limiter.release(req.request_id, now)
            return AdmissionDecision(
                request_id=req.request_id,
                admitted=False,
                reason=verdict.reason,
                retry_after=verdict.retry_after,
                predicted_ttft=verdict.predicted_ttft,
                message=verdict.message,
            ), verdict
        cached = next((r.cached_tokens for r in pool if r.worker_id == verdict.worker_id), 0)
        self.slo.record_admitted(req.tier, max(req.prompt_tokens - cached, 0), now)
        if verdict.raw_predicted_ttft is not None:
            predicted = verdict.predicted_ttft if verdict.predicted_ttft is not None else verdict.raw_predicted_ttft
            bound = verdict.ttft_bound if verdict.ttft_bound is not None else predicted
            self.predictions[req.request_id] = (verdict.tier, verdict.raw_predicted_ttft, verdict.queue_free,
                                                predicted, bound, now)
        return AdmissionDecision(
            request_id=req.request_id,
            admitted=True,
            predicted_ttft=verdict.predicted_ttft,
            reserved_tokens=quota.reserved_tokens,
            worker_id=verdict.worker_id or "",
            slack_tokens=verdict.slack_tokens,
        ), verdict

    def on_usage(self, ev: UsageEvent, now: float) -> int | None:
        """Reconcile a request's reservation from its usage event (repeats are no-ops).

        A request rejected downstream never ran: its reservation is released in full.
        Anything else (finished, cut at max_tokens, stopped, cancelled, failed) is charged
        what it really consumed: the prompt it prefilled and the tokens it streamed.
        """
        # The gateway reports the TTFT at the first token (``on_ttft``); the usage event,
        # which comes only when the request ends, covers a lost report.
        if ev.migrations == 0 and ev.first_token_time > 0 and ev.arrival_time > 0:
            self.on_ttft(ev.request_id, ev.first_token_time - ev.arrival_time)
        else:
            self.predictions.pop(ev.request_id, None)
        if ev.status == "rejected":
            return 0 if self.limiter.release(ev.request_id, now) else None
        used = ev.prompt_tokens + ev.completion_tokens
        settled = self.limiter.reconcile(ev.request_id, used, now)
        if settled is None and ev.migrations > 0:
            # A later segment of a migrated request: the first segment's usage settled the
            # reservation, so what this one streamed is charged as it is (once: USAGE dedups).
            self.limiter.charge_unreserved(ev.key_id, ev.org, used, now)
        return settled

    def on_ttft(self, request_id: str, ttft_s: float) -> bool:
        """The TTFT an admitted request had: calibrates its tier's predictions (once)."""
        predicted = self.predictions.pop(request_id, None)
        if predicted is None:
            return False
        tier, raw, queue_free, point, bound, at = predicted
        self.slo.observe(tier, raw, ttft_s, queue_free)
        self.outcomes.append((tier, point, raw, ttft_s, bound, at))
        return True

    def prediction_errors(self) -> dict[str, dict[str, float]]:
        """Per tier, the recent admitted requests' predicted / actual TTFT: count,
        p1/p10/p50/p90/p99 (nearest rank), and the shares off by more than 2× either way
        (``over_2x``: predicted more than twice the actual, ``under_2x``: under half).
        The prediction is the calibrated point estimate admission reports; ``raw_*`` are
        the same figures for the formula alone, ``bound_*`` for the tail bound the decision
        held against the SLO (meant to sit above the actual, by design)."""
        point: dict[str, list[float]] = {}
        formula: dict[str, list[float]] = {}
        bounds: dict[str, list[float]] = {}
        for tier, predicted, raw, actual, bound, _ in self.outcomes:
            if actual > 0:
                point.setdefault(tier, []).append(predicted / actual)
                formula.setdefault(tier, []).append(raw / actual)
                bounds.setdefault(tier, []).append(bound / actual)
        out: dict[str, dict[str, float]] = {}
        for tier in point:
            out[tier] = {"n": float(len(point[tier])), **_spread(point[tier]),
                         **{f"raw_{k}": v for k, v in _spread(formula[tier]).items()},
                         **{f"bound_{k}": v for k, v in _spread(bounds[tier]).items()}}
        return out

    def worst_predictions(self, k: int = 5) -> dict[str, list[dict[str, float]]]:
        """Per tier, the ``k`` recent predictions furthest from the TTFT seen (in ratio,
        either way): when each was admitted (seconds after the oldest outcome kept), the
        point prediction, the formula alone and the TTFT, for an operator (or a benchmark)
        asking which requests the model misjudges."""
        if not self.outcomes:
            return {}
        start = min(o[5] for o in self.outcomes)
        by_tier: dict[str, list[tuple[float, dict[str, float]]]] = {}
        for tier, predicted, raw, actual, _, at in self.outcomes:
            if actual > 0 and predicted > 0:
                miss = max(predicted / actual, actual / predicted)
                by_tier.setdefault(tier, []).append((miss, {"at_s": at - start, "predicted_s": predicted,
                                                            "formula_s": raw, "actual_s": actual}))
        return {tier: [row for _, row in sorted(rows, key=lambda r: -r[0])[:k]] for tier, rows in by_tier.items()}

    def expire(self, now: float) -> list[str]:
        cutoff = now - self.prediction_max_age_s
        for rid in [rid for rid, (*_, at) in self.predictions.items() if at < cutoff]:
            del self.predictions[rid]
        return self.limiter.expire(now)


def forwarded_route(req: AdmissionRequest, decision: AdmissionDecision, now: float) -> RouteRequest | None:
    """The route request to forward for an admitted ``req`` that asked for it, with what
    the gateway would have added from the decision (replica, slack, reservation) and the
    block hashes the request already carries; None when refused, not asked, or past
    ``forward_by`` (the gateway may have stopped waiting and be placing it itself)."""
    route = req.route
    if not decision.admitted or route is None or not req.placement_reply or now >= req.forward_by:
        return None
    if not route.block_hashes or not route.block_size:  # the gateway sends its hashes once, in ``req``
        route = msgspec.structs.replace(route, block_hashes=route.block_hashes or req.block_hashes,
                                        block_size=route.block_size or req.block_size)
    return route.admitted_by(decision)


def _spread(ratios: list[float]) -> dict[str, float]:
    ranked = sorted(ratios)
    row = {f"p{q}": ranked[min(int(q / 100 * len(ranked)), len(ranked) - 1)] for q in (1, 10, 50, 90, 99)}
    row["over_2x"] = sum(1 for r in ranked if r > 2) / len(ranked)
    row["under_2x"] = sum(1 for r in ranked if r < 0.5) / len(ranked)
    return row
