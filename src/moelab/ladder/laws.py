"""Scaling laws across finished runs: the compute envelope L(C) and Chinchilla's L(N, D).

Every law here is linear in some parameters and nonlinear in its exponents. Each fit solves the
linear ones exactly (non-negative least squares) for given exponents, so the search runs over the
exponents alone (variable projection; Golub & Pereyra 1973): a grid, then L-BFGS-B from the best
grid point. The curve law's fit (`fit`) searches the same way, with `best_on_grid` and `search_bounded`.

1. Compute envelope (Kaplan et al. 2020; Hoffmann et al. 2022, approach 1):

       L(C) = L_inf + A * C^-alpha

   fitted by least squares to the frontier points (`lower_envelope`), L_inf free or pinned.

2. Chinchilla (Hoffmann et al. 2022, approach 3):

       L(N, D) = E + A / N^alpha + B / D^beta

   fitted by a Huber loss (delta = 1e-3) on log L - log L_hat. For given exponents (E, A, B) come
   from a weighted NNLS on relative residuals (L - L_hat) / L, the first-order form of the log
   residual; a last joint L-BFGS-B pass over all five minimizes the exact Huber objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import optimize, special

from moelab.errors import DataError

__all__ = [
    "search_bounded",
    "best_on_grid",
    "EnvelopeFit",
    "ChinchillaFit",
    "lower_envelope",
    "fit_compute_envelope",
    "envelope_loss",
    "envelope_compute",
    "fit_chinchilla",
    "chinchilla_loss",
]


# The L-BFGS-B stopping rule is relative to max(|f|, 1): with objectives far below 1 (a Huber sum at
# delta = 1e-3 is ~1e-3 per point) the default ftol stops after a step or two. Besiroglu et al. 2024
# ("Chinchilla Scaling: A replication attempt") found Hoffmann et al.'s published estimates do not
# fit their own data and point to an optimizer that stopped early; every search here runs tight.
_LBFGS_OPTIONS = {"ftol": 1e-14, "gtol": 1e-10, "maxiter": 1000}


def _array(name: str, values, size: int | None = None, positive: bool = False) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).reshape(-1)
    if size is not None and len(out) != size:
        raise DataError(f"{name} has {len(out)} values but the other inputs have {size}; pass one per point.")
    if not np.all(np.isfinite(out)):
        raise DataError(f"{name} holds a non-finite value ({out[~np.isfinite(out)][0]}); drop that point.")
    if positive and np.any(out <= 0):
        raise DataError(f"{name}={out[out <= 0][0]} is invalid: every value must be > 0.")
    return out


def search_bounded(objective: Callable[[np.ndarray], float], start: np.ndarray, bounds,
                   gradient: Callable[[np.ndarray], tuple[float, np.ndarray]] | None = None) -> np.ndarray:
    """L-BFGS-B from `start`, kept only if it improves on it (a failed line search can end worse).

    `gradient`, when given, returns (objective, its gradient) in one call; otherwise finite differences."""
    fun, jac = (gradient, True) if gradient is not None else (objective, None)
    result = optimize.minimize(fun, start, method="L-BFGS-B", jac=jac, bounds=bounds, options=_LBFGS_OPTIONS)
    return result.x if result.fun <= objective(start) else np.asarray(start, dtype=np.float64)


def best_on_grid(objective: Callable[[np.ndarray], float], grids: Sequence[np.ndarray]) -> np.ndarray:
    """The point of the grids' product where `objective` is lowest: the start every bounded search here takes."""
    points = np.stack(np.meshgrid(*grids, indexing="ij"), -1).reshape(-1, len(grids))
    return points[int(np.argmin([objective(p) for p in points]))]


# ----------------------------------------------------------------------------------------------
# compute envelope


@dataclass(frozen=True)
class EnvelopeFit:
    """L(C) = loss_floor + coef * C^-exponent, C in training FLOPs."""

    loss_floor: float
    coef: float
    exponent: float
    floor_pinned: bool  # True: loss_floor was given, not fitted
    rmse: float  # over the fitted points, in loss units


def lower_envelope(compute, loss) -> tuple[np.ndarray, np.ndarray]:
    """The frontier: sorted by compute, the points whose loss is below every cheaper point's."""
    c = _array("compute", compute, positive=True)
    l = _array("loss", loss, len(c))
    order = np.argsort(c, kind="stable")
    c, l = c[order], l[order]
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], l[:-1]]))
    keep = l < best_before
    return c[keep], l[keep]


def fit_compute_envelope(compute, loss, loss_floor: float | None = None) -> EnvelopeFit:
    """Fit L(C) = L_inf + A * C^-alpha by least squares; `loss_floor` pins L_inf.

    Pass frontier points (`lower_envelope`) for the compute-optimal envelope. C is centred on its
    geometric mean inside the fit, so A is solved at O(1) scale and only reported in raw units.
    """
    c = _array("compute", compute, positive=True)
    l = _array("loss", loss, len(c))
    need = 2 if loss_floor is not None else 3
    if len(c) < need:
        raise DataError(f"the envelope needs at least {need} points to fit {need} parameters; got {len(c)}.")
    log_ref = float(np.mean(np.log(c)))
    centred = np.log(c) - log_ref

    def solve(alpha: float) -> tuple[float, float, float]:
        column = np.exp(-alpha * centred)
        if loss_floor is None:
            (floor, coef), rnorm = optimize.nnls(np.column_stack([np.ones_like(column), column]), l)
            return float(floor), float(coef), float(rnorm**2)
        reducible = l - loss_floor
        coef = max(float(column @ reducible / (column @ column)), 0.0)
        return float(loss_floor), coef, float(np.sum((reducible - coef * column) ** 2))

    def sse(p):
        return solve(float(p[0]))[2]

    start = best_on_grid(sse, [np.geomspace(1e-3, 2.0, 40)])
    (alpha,) = search_bounded(sse, start, [(1e-4, 3.0)])
    floor, coef, err = solve(float(alpha))
    return EnvelopeFit(floor, coef * math.exp(alpha * log_ref), float(alpha), loss_floor is not None,
                       math.sqrt(err / len(c)))


def envelope_loss(fit: EnvelopeFit, compute):
    """The envelope's loss at `compute` FLOPs."""
    return fit.loss_floor + fit.coef * np.power(np.asarray(compute, dtype=np.float64), -fit.exponent)


def envelope_compute(fit: EnvelopeFit, loss):
    """The FLOPs at which the envelope reaches `loss`; inf at or below its floor (never reached)."""
    reducible = np.asarray(loss, dtype=np.float64) - fit.loss_floor
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(reducible > 0, np.power(reducible / fit.coef, -1.0 / fit.exponent), np.inf)
    return out if out.ndim else float(out)


# ----------------------------------------------------------------------------------------------
# Chinchilla L(N, D)


@dataclass(frozen=True)
class ChinchillaFit:
    """L(N, D) = e + a / N^alpha + b / D^beta, N parameters and D tokens."""

    e: float
    a: float
    alpha: float
    b: float
    beta: float
    huber_delta: float
    objective: float  # summed Huber loss of the log residuals at the optimum


def chinchilla_loss(fit: ChinchillaFit, params, tokens):
    """Chinchilla's predicted loss for `params` parameters trained on `tokens` tokens."""
    n, d = np.asarray(params, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    return fit.e + fit.a * np.power(n, -fit.alpha) + fit.b * np.power(d, -fit.beta)


def fit_chinchilla(params, tokens, loss, huber_delta: float = 1e-3) -> ChinchillaFit:
    """Fit L(N, D) by Huber on log-loss (Hoffmann et al. 2022, approach 3); see the module docstring.

    Exponent grid 0.05..1.5 (12 x 12), bounds [0.01, 3]; N and D are centred on their geometric
    means inside the fit and A, B are reported in raw units.
    """
    n = _array("params", params, positive=True)
    d = _array("tokens", tokens, len(n), positive=True)
    l = _array("loss", loss, len(n), positive=True)
    if len(n) < 6:
        raise DataError(f"L(N, D) has 5 parameters and needs at least 6 (N, D, loss) points; got {len(n)}.")
    if huber_delta <= 0:
        raise DataError(f"huber_delta={huber_delta} is invalid: must be > 0 (Hoffmann et al. use 1e-3).")
    ref_n, ref_d = float(np.mean(np.log(n))), float(np.mean(np.log(d)))
    x_n, x_d, log_l = np.log(n) - ref_n, np.log(d) - ref_d, np.log(l)

    def huber(e, a, alpha, b, beta) -> float:
        pred = e + a * np.exp(-alpha * x_n) + b * np.exp(-beta * x_d)
        residual = np.log(np.maximum(pred, 1e-12)) - log_l
        # Divided by delta so the objective is ~sum |r| where it matters, not ~1e-3 of it.
        return float(np.sum(special.huber(huber_delta, residual)) / huber_delta)

    def project(alpha: float, beta: float) -> np.ndarray:
        design = np.column_stack([np.ones_like(x_n), np.exp(-alpha * x_n), np.exp(-beta * x_d)])
        coefs, _ = optimize.nnls(design / l[:, None], np.ones_like(l))
        return coefs

    def projected(p):
        e, a, b = project(*p)
        return huber(e, a, p[0], b, p[1])

    grid = np.linspace(0.05, 1.5, 12)
    alpha, beta = search_bounded(projected, best_on_grid(projected, [grid, grid]), [(0.01, 3.0)] * 2)
    e, a, b = project(alpha, beta)

    def joint(q):
        return huber(q[0], q[1], q[3], q[2], q[4])

    e, a, b, alpha, beta = search_bounded(joint, np.array([e, a, b, alpha, beta]), [(0.0, None)] * 3 + [(0.01, 3.0)] * 2)
    return ChinchillaFit(float(e), float(a * math.exp(alpha * ref_n)), float(alpha),
                         float(b * math.exp(beta * ref_d)), float(beta), huber_delta,
                         joint([e, a, b, alpha, beta]))
