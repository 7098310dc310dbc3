"""The step-time formula's coefficients from measured steps, pure: ``Point`` (one measured
step), ``fit`` (non-negative least squares, relative error) and ``predict``. Shared by
``meshserve calibrate``'s two sources, a model timed here (``ops.calibrate``) and a
running engine timed over HTTP (``ops.calibrate_engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s", "per_prefill_seq_s",
                "per_prefill_step_s")


@dataclass(frozen=True, slots=True)
class Point:
    """One measured step."""

    kind: str  # "prefill" or "decode"
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int  # context attended, summed over the step's sequences (as the sim counts it)
    seconds: float  # median step time
    prefill_seqs: int = 0  # sequences prefilling in the step

    def features(self) -> tuple[float, float, float, float, float, float]:
        return (1.0, float(self.prefill_tokens), float(self.decode_seqs), float(self.kv_tokens),
                float(self.prefill_seqs), 1.0 if self.prefill_seqs else 0.0)


# --------------------------------------------------------------------------- fitting


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny dense systems)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("singular system")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def _lstsq(rows: Sequence[Sequence[float]], y: Sequence[float], active: Sequence[int]) -> list[float]:
    """Least squares on the ``active`` columns (normal equations, columns scaled)."""
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in active]
    x = [[r[j] / s for j, s in zip(active, scale, strict=True)] for r in rows]
    k = len(active)
    ata = [[sum(row[i] * row[j] for row in x) for j in range(k)] for i in range(k)]
    aty = [sum(row[i] * yi for row, yi in zip(x, y, strict=True)) for i in range(k)]
    for i in range(k):
        ata[i][i] += 1e-12  # keeps a rank-deficient grid solvable
    sol = _solve(ata, aty)
    return [v / s for v, s in zip(sol, scale, strict=True)]


def fit(points: Sequence[Point], relative: bool = True) -> dict[str, float]:
    """Non-negative least-squares coefficients of the step-time formula.

    Active-set NNLS: solve, drop the most negative coefficient (fix it at 0), repeat.
    With ``relative`` each point is weighted by 1/seconds, so the fit minimises relative
    error and small decode steps count as much as large prefills.
    """
    if len(points) < 4:
        raise ValueError("need at least 4 measurements to fit the step coefficients")
    rows = [list(p.features()) for p in points]
    y = [p.seconds for p in points]
    if relative:
        rows = [[v / p.seconds for v in r] for r, p in zip(rows, points, strict=True)]
        y = [1.0] * len(points)
    # A prefilling step's fixed cost shows only beside steps without prefill (otherwise it
    # is the base cost by another name), and a prefilling sequence's only beside steps with
    # a different number of them that prefill too (otherwise it is the step's by another name).
    prefilling = {p.prefill_seqs for p in points if p.prefill_seqs}
    active = [0, 1, 2, 3] + ([4] if len(prefilling) > 1 else []) + (
        [5] if prefilling and any(not p.prefill_seqs for p in points) else [])
    while True:
        sol = _lstsq(rows, y, active)
        negative = [(v, j) for v, j in zip(sol, active, strict=True) if v < 0]
        if not negative:
            break
        active.remove(min(negative)[1])
        if not active:
            sol = []
            break
    coef = dict.fromkeys(COEFFICIENTS, 0.0)
    for v, j in zip(sol, active, strict=True):
        coef[COEFFICIENTS[j]] = v
    return coef


def predict(coef: dict[str, float], p: Point) -> float:
    return sum(coef.get(name, 0.0) * f for name, f in zip(COEFFICIENTS, p.features(), strict=True))
