"""Fitting the curve law (`curve`) jointly on every checkpoint of every rung.

Least squares on loss (not Huber): the curve residuals feed the bands (`bands`). The linear
coefficients (E, A, B, C) are projected out by NNLS and the search runs over the exponents and the
annealing term's delay (variable projection, as in `laws`): `sse` is that objective,
`sse_and_gradient` its exact gradient.

A ladder spans a few sizes within 2-3x, too little for E, A and alpha on their own: the data
trade a floor E against a steep alpha. So log alpha carries a prior, Normal(log 0.35, log 2)
(`ALPHA_PRIOR`: where Chinchilla-form fits of LMs land), weighted as one more run
(`fit_curve_law`): a ladder whose sizes pin alpha overrules it, one that cannot leans on it.

Small rungs stray further from the law than large ones: where the runs show it, the fit weights
each run by how its residuals shrink with N (`noise_scale`). The weights and the prior's weight come
from the run and checkpoint variance components of the fit's own residuals (`variance_components`),
which the bootstrap (`bands.bootstrap_curve_law`) starts from too: the noise model is estimated here,
beside the fit that needs it. The bootstrap refits through the same pieces: `tabulate_rows` once,
`measure_noise`, then `fit_rows` on each resample from `warm_start`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Sequence

import numpy as np
from scipy import interpolate, optimize

from moelab.errors import DataError
from moelab.ladder.curve import (  # the law's own terms, which `FitRows` tabulates once per fit
    FORMS,
    LR_LAWS,
    CurveLaw,
    DropTerms,
    Run,
    anneal_drops,
    drop_terms,
    effective_tokens,
    exposure,
    exposure_identified,
    fitted_rows,
)
from moelab.ladder.laws import best_on_grid, search_bounded

__all__ = [
    "EXPONENT_BOUNDS",
    "ALPHA_PRIOR",
    "ALPHA_PRIORS",
    "IDENTIFYING_SIZES",
    "NOISE_EXPONENT_BOUNDS",
    "RHO_BOUNDS",
    "FitRows",
    "tabulate_rows",
    "sse",
    "sse_and_gradient",
    "fit_rows",
    "warm_start",
    "fit_curve_law",
    "alpha_prior_z",
    "noise_scale",
    "measure_noise",
    "variance_components",
]

EXPONENT_BOUNDS = (0.01, 3.0)  # the search range of alpha and beta in the curve law
# A prior on the size exponent, log alpha ~ Normal(log 0.35, log 2): 0.35 is where Chinchilla-form fits
# of LMs land (Hoffmann et al. 2022: 0.34; Besiroglu et al. 2024: 0.35). A ladder of a few sizes within
# 2-3x cannot pin E, A and alpha alone (docs/scaling-ladder.md, "A prior on the size exponent"). None: no prior.
ALPHA_PRIOR: tuple[float, float] | None = (0.35, math.log(2.0))
ALPHA_PRIORS = ("always", "unidentified")  # when `fit_curve_law` applies ALPHA_PRIOR
IDENTIFYING_SIZES = 4  # "unidentified": curves of this many sizes or more are fitted without the prior
# How fast a run's noise may fall with its size, residual sd ~ N^-kappa (`fit_curve_law`). Capped at 1:
# a steeper fall, read off a few sizes and extrapolated to the target, would make its band too narrow.
NOISE_EXPONENT_BOUNDS = (0.0, 1.0)


@dataclass(frozen=True, eq=False)
class FitRows:
    """Every fitted row of every run as the objective reads it, with S2 tabulated over log tau (`tabulate_rows`).

    S2 depends on tau through an EMA over every step of every run; the table computes those EMAs
    once per fit (and once for all its bootstrap refits, which change only the losses), so the
    search evaluates a spline instead of re-running them: 5-50x faster on long runs.
    """

    log_params: np.ndarray  # [n] log N of each row's run
    log_s1: np.ndarray  # [n]
    loss: np.ndarray  # [n]
    progress: np.ndarray  # [n] tokens / the run's last tokens (`bands.progress_bin`)
    counts: np.ndarray  # [R] fitted rows per run, in run order
    anneal: interpolate.CubicSpline  # log tau -> [n] S2 at the fitted rows (the Tissue form)
    max_log_tau: float
    drops: DropTerms | None  # the multi-power form's drop sum at the fitted rows; None for the Tissue form
    size: float | None  # the one params every run has, else None
    noise_exponent: float = 0.0  # the rows are weighted by 1 / noise_scale(N)^2 (`fit_curve_law`)
    noise_ref: float = 1.0
    prior_weight: float = 0.0  # ALPHA_PRIOR's penalty is prior_weight * z^2 (`fit_curve_law`)
    # [n] log(exposure / exposure_ref) of each row's run under `lr_law` (`curve.exposure`); None under the
    # relative-LR law, or where the runs do not identify rho (`curve.exposure_identified`)
    log_exposure: np.ndarray | None = None
    lr_law: str = "relative"
    exposure_ref: float = 1.0

    @property
    def one_size(self) -> bool:
        return self.size is not None

    @property
    def form(self) -> str:
        return "tissue" if self.drops is None else "multipower"

    def s2(self, q) -> np.ndarray:
        """[n] the annealing term at the fitted rows for its nonlinear parameters q: (log tau,) for the Tissue
        form, (log tau, log power, gamma) for the multi-power one."""
        if self.drops is None:
            return self.anneal(q[0])
        return self.drops.drop(math.exp(q[0]), math.exp(q[1]), q[2])

    def s2_and_gradient(self, q) -> np.ndarray:
        """[1 + len(q), n]: `s2`, then its derivative in each of q (the Tissue form's is the spline's own)."""
        if self.drops is None:
            return np.stack([self.anneal(q[0]), self.anneal(q[0], 1)])
        return self.drops.drop_and_gradient(math.exp(q[0]), math.exp(q[1]), q[2])

    @property
    def num_anneal(self) -> int:
        """How many nonlinear parameters the annealing term has: q's length in `s2`."""
        return 1 if self.drops is None else 3

    def anneal_bounds(self) -> list[tuple[float, float]]:
        return [(0.0, self.max_log_tau)] + ([] if self.drops is None else [_LOG_POWER_BOUNDS, _GAMMA_BOUNDS])

    def tail_bounds(self) -> list[tuple[float, float]]:
        """The bounds of every nonlinear parameter after alpha and beta: the annealing term's, then rho's."""
        return self.anneal_bounds() + ([] if self.log_exposure is None else [RHO_BOUNDS])

    def exposure_terms(self, rho: float) -> tuple[np.ndarray, np.ndarray]:
        """([n] rho * log x added to log S1 (0 under `noise`), [n] the factor on the annealing gain: x^rho under
        `convex` and `noise`, else 1)."""
        if self.log_exposure is None:
            return np.zeros_like(self.loss), np.ones_like(self.loss)
        log_x = rho * self.log_exposure
        shift = np.zeros_like(log_x) if self.lr_law == "noise" else log_x
        return shift, (np.exp(log_x) if self.lr_law in ("convex", "noise") else np.ones_like(log_x))

    def anneal_column(self, gain, s2: np.ndarray) -> np.ndarray:
        """[n] C's column in the design: -gain * S2, or under `noise` gain * (1 - S2), the noise term present at the
        peak LR that an anneal removes (`curve.LR_LAWS`)."""
        return gain * (1.0 - s2) if self.lr_law == "noise" else -gain * s2

    @property
    def scale(self) -> np.ndarray:
        """[n] each row's noise_scale: residuals divided by it have one variance at every size."""
        return noise_scale(np.exp(self.log_params), self.noise_exponent, self.noise_ref)

    @cached_property
    def weight(self) -> np.ndarray:
        """[n] 1 / scale: generalized least squares divides each row by its noise sd. Cached: the search reads it
        at every point, and a refit on new losses or weights is a new `FitRows` (`dataclasses.replace`)."""
        return 1.0 / self.scale

    @cached_property
    def centre(self) -> tuple[float, float]:
        """(mean log N, mean log S1) over the rows: the search measures both from there, so N^-alpha and S1^-beta
        stay of order 1 at every exponent, and `fit_rows` moves them back into A and B."""
        return float(np.mean(self.log_params)), float(np.mean(self.log_s1))

    @cached_property
    def centred(self) -> tuple[np.ndarray, np.ndarray]:
        """([n] log N, [n] log S1) less `centre`: the coordinates the search reads at every point."""
        ref_n, ref_s = self.centre
        return self.log_params - ref_n, self.log_s1 - ref_s

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """[n] values -> one array per run."""
        return np.split(values, np.cumsum(self.counts)[:-1])


# S2 is smooth in log tau (an EMA's kernel moves continuously); cubic interpolation between knots
# 0.1 apart is within 3e-7 of the exact EMA (S2 lies in [0, 1]) on constant, cosine and WSD runs.
_LOG_TAU_KNOT = 0.1


_LOG_POWER_BOUNDS = (math.log(0.02), math.log(20.0))  # the multi-power G's exponent (Luo et al. fit 0.4-0.6)
_GAMMA_BOUNDS = (0.0, 1.5)  # its LR exponent (Luo et al. fit ~0.5-0.6)
RHO_BOUNDS = (0.0, 1.0)  # the exposure's exponent (`curve.LR_LAWS`): 0 the relative-LR law, 1 the absolute LR


def tabulate_rows(runs: Sequence[Run], form: str = "tissue", lr_law: str = "relative") -> FitRows:
    """The ladder's fitted rows as the fit reads them; DataError, naming the fix, for a ladder the law cannot fit."""
    names = [r.name for r in runs]
    if not runs:
        raise DataError("the curve law needs at least 1 run; got none.")
    if len(set(names)) != len(names):
        raise DataError(f"run names repeat ({sorted({n for n in names if names.count(n) > 1})}); name each run once.")
    if form not in FORMS:
        raise DataError(f"form={form!r} is not a form of the curve law's annealing term; one of {', '.join(FORMS)}.")
    # A modelling choice, not a limit of the fit (whose objective and gradient take both forms with any lr_law):
    # issue 52's LR-aware laws were defined and scored on the Tissue form only (docs/scaling-ladder.md, "The peak
    # LR and the batch"), and `predict.LAWS` offers no multi-power one.
    if lr_law not in LR_LAWS or (lr_law != "relative" and form != "tissue"):
        raise DataError(f"lr_law={lr_law!r} with form={form!r}: one of {', '.join(LR_LAWS)}, and only the tissue form "
                        "takes a law other than 'relative'.")
    rows = _rows(runs, form, lr_law)
    need = (6 if rows.one_size else 8) + (2 if form == "multipower" else 0) + (rows.log_exposure is not None)
    if len(rows.loss) < need:
        raise DataError(f"only {len(rows.loss)} rows are past warmup with tokens > 0; the law has {need - 1} "
                        f"parameters{' on curves of one size' if rows.one_size else ''} and needs at least {need} "
                        "rows (log more evals per run).")
    return rows


def _rows(runs: Sequence[Run], form: str, lr_law: str) -> FitRows:
    """`tabulate_rows` past its checks of the ladder as a whole."""
    for run in runs:
        if run.loss is None:
            raise DataError(f"run {run.name!r} has no loss column; the fit needs observed losses.")
    keeps = [fitted_rows(run) for run in runs]
    picks = [run.steps[keep].astype(np.int64) for run, keep in zip(runs, keeps)]
    max_log_tau = math.log(10.0 * max(int(run.steps[-1]) + 1 for run in runs))  # 10x the longest run's steps
    knots = np.linspace(0.0, max_log_tau, max(8, math.ceil(max_log_tau / _LOG_TAU_KNOT) + 1))
    taus = [math.exp(k) for k in knots]
    table = np.concatenate([anneal_drops(run, taus)[:, keep] for run, keep in zip(runs, keeps)], axis=1)
    return FitRows(
        log_params=np.concatenate([np.full(keep.sum(), math.log(run.params)) for run, keep in zip(runs, keeps)]),
        log_s1=np.concatenate([np.log(effective_tokens(run)[keep]) for run, keep in zip(runs, keeps)]),
        loss=np.concatenate([run.loss[keep] for run, keep in zip(runs, keeps)]),
        progress=np.concatenate([(run.tokens / run.tokens[-1])[keep] for run, keep in zip(runs, keeps)]),
        counts=np.array([keep.sum() for keep in keeps]),
        anneal=interpolate.CubicSpline(knots, table, axis=0),
        max_log_tau=max_log_tau,
        drops=DropTerms.concat([drop_terms(run, p) for run, p in zip(runs, picks)]) if form == "multipower" else None,
        size=runs[0].params if len({run.params for run in runs}) == 1 else None,
        **_exposure_rows(runs, keeps, lr_law),
    )


def _exposure_rows(runs: Sequence[Run], keeps: Sequence[np.ndarray], lr_law: str) -> dict:
    """`FitRows`' exposure fields: each row's log(x / x_ref), x_ref the geometric mean over runs, where identified."""
    if not exposure_identified(runs, lr_law):
        return {}
    logs = np.log([exposure(run, lr_law) for run in runs])
    ref = float(np.mean(logs))
    return {"log_exposure": np.concatenate([np.full(keep.sum(), x - ref) for x, keep in zip(logs, keeps)]),
            "lr_law": lr_law, "exposure_ref": math.exp(ref)}


# ----------------------------------------------------------------------------------------------
# the objective: p = (alpha, beta, *q, [rho]), q the annealing term's (`FitRows.s2`), rho where the rows have
# an exposure; log N and log S1 measured from `FitRows.centre`


def _unpack(rows: FitRows, p) -> tuple[float, float, np.ndarray, float]:
    """(alpha, beta, q, rho) at the search's point p; rho is 0 where the rows have no exposure."""
    p, k = np.asarray(p), rows.num_anneal
    return p[0], p[1], p[2:2 + k], (p[2 + k] if rows.log_exposure is not None else 0.0)


def _design(rows: FitRows, alpha: float, beta: float, rho: float, s2: np.ndarray) -> np.ndarray:
    """[n, 3 or 4] the columns of E, A (not on curves of one size), B and C, given S2 (`FitRows.s2`)."""
    x_n, x_s = rows.centred
    shift, gain = rows.exposure_terms(rho)
    size = [] if rows.one_size else [np.exp(-alpha * x_n)]
    return np.column_stack([np.ones_like(rows.loss), *size, np.exp(-beta * (x_s + shift)), rows.anneal_column(gain, s2)])


def _project(rows: FitRows, design: np.ndarray) -> tuple[np.ndarray, float]:
    """((E, A, B, C) >= 0 by weighted NNLS on `design`, A = 0 on curves of one size; the weighted sum of squares)."""
    coefs, rnorm = optimize.nnls(design * rows.weight[:, None], rows.loss * rows.weight)
    return (np.insert(coefs, 1, 0.0) if rows.one_size else coefs), float(rnorm**2)


def _fitted(rows: FitRows, design: np.ndarray, coefs: np.ndarray) -> np.ndarray:
    """[n] the law's loss at the rows from `_design`'s columns and `_project`'s coefficients (less the A = 0
    `_project` puts into a one-size fit's, which has no column)."""
    return design @ (np.delete(coefs, 1) if rows.one_size else coefs)


def sse(rows: FitRows, p) -> float:
    """The objective at p = (alpha, beta, *q, [rho]): the weighted sum of squares at the best (E, A, B, C) >= 0,
    plus ALPHA_PRIOR's penalty prior_weight * z(alpha)^2."""
    alpha, beta, q, rho = _unpack(rows, p)
    weighted = _project(rows, _design(rows, alpha, beta, rho, rows.s2(q)))[1]
    return weighted + rows.prior_weight * alpha_prior_z(alpha) ** 2


def sse_and_gradient(rows: FitRows, p) -> tuple[float, np.ndarray]:
    """`sse` at p and its exact gradient in p.

    By the envelope theorem the NNLS coefficients hold still: d sse / dp = r . (dX/dp) c, with r = 2 w^2 (fit -
    loss), X the design and c = (E, A, B, C). With x_n, x_s the centred log N and log S1, shift = rho log x and
    g the annealing gain (x^rho under `convex` and `noise`, else 1), the fit is E + A e^(-alpha x_n) + B e^(-beta
    (x_s + shift)) - C g S2(q) (under `noise`: + C g (1 - S2(q)), shift = 0), so

        d/dalpha = -A x_n e^(-alpha x_n)          d/dq = -C g dS2/dq
        d/dbeta  = -B (x_s + shift) e^(...)       d/drho = -B beta log x e^(...) - C (dg/drho) S2,

    dg/drho = g log x under `convex`, else 0 (under `noise`: d/drho = C g log x (1 - S2)). One S2 and its gradient a step, where finite differences
    re-sum the multi-power drop for every parameter: 20 bootstrap refits on sp-size-360m take 4.6 s
    instead of 11.3 s (`fit_rows` uses it for that form only).
    """
    alpha, beta, q, rho = _unpack(rows, p)
    anneal = rows.s2_and_gradient(q)
    x = _design(rows, alpha, beta, rho, anneal[0])
    coefs, value = _project(rows, x)
    residual = 2.0 * rows.weight**2 * (_fitted(rows, x, coefs) - rows.loss)
    _, a, b, c = coefs
    x_n, x_s = rows.centred
    shift, gain = rows.exposure_terms(rho)
    data = np.exp(-beta * (x_s + shift))
    grad = np.concatenate([[residual @ (-a * x_n * np.exp(-alpha * x_n)), residual @ (-b * (x_s + shift) * data)],
                           -c * ((anneal[1:] * gain) @ residual)])
    if rows.log_exposure is not None:
        d_shift = 0.0 if rows.lr_law == "noise" else -b * beta * rows.log_exposure * data
        d_gain = gain * rows.log_exposure if rows.lr_law in ("convex", "noise") else 0.0
        grad = np.append(grad, residual @ (d_shift + c * rows.anneal_column(d_gain, anneal[0])))
    z = alpha_prior_z(alpha)
    if rows.prior_weight and ALPHA_PRIOR is not None:
        grad[0] += rows.prior_weight * 2.0 * z / (alpha * ALPHA_PRIOR[1])
    return value + rows.prior_weight * z**2, grad


# ----------------------------------------------------------------------------------------------
# the search


def fit_rows(rows: FitRows, start: np.ndarray | None = None) -> CurveLaw:
    """Least squares over p = (alpha, beta, *q, [rho]) with (E, A, B, C) >= 0 projected out by NNLS (`sse`).

    From the best point of a grid, or from `start` (a refit's: `warm_start`), L-BFGS-B within the bounds. The
    multi-power form searches on its exact gradient (`sse_and_gradient`); the Tissue form on L-BFGS-B's finite
    differences, cheap on its spline, with which its recorded fits were made. On curves of one size the size
    term is E's: the fit drops A and alpha and says so (`size`).
    """
    objective = partial(sse, rows)
    if start is None:
        start = _grid_start(rows)
    bounds = [EXPONENT_BOUNDS, EXPONENT_BOUNDS] + rows.tail_bounds()
    if rows.one_size:  # alpha does not enter: search the others only
        bounds[0] = (start[0], start[0])
    gradient = partial(sse_and_gradient, rows) if rows.form == "multipower" else None
    return _law_at(rows, search_bounded(objective, np.clip(start, *np.array(bounds).T), bounds, gradient))


def _grid_start(rows: FitRows) -> np.ndarray:
    """The best point of a coarse grid: alpha, beta in 0.05..1.2, log tau up to the longest run, a few values of
    the multi-power exponents and of rho. The multi-power grid is 5-dimensional, so it is coarser."""
    multipower = rows.form == "multipower"
    exponents = np.linspace(0.05, 1.2, 5 if multipower else 8)
    taus = np.linspace(0.0, rows.max_log_tau - math.log(10.0), 5 if multipower else 7)
    extra = [np.log([0.3, 1.0]), np.array([0.0, 0.6])] if multipower else []
    if rows.log_exposure is not None:
        extra.append(np.array([0.0, 0.5, 1.0]))
    return best_on_grid(partial(sse, rows), [exponents[:1] if rows.one_size else exponents, exponents, taus, *extra])


def _law_at(rows: FitRows, p: np.ndarray) -> CurveLaw:
    """The law at the search's point p, with its coefficients, its rmse and the rows' weights and prior."""
    alpha, beta, q, rho = _unpack(rows, p)
    x = _design(rows, alpha, beta, rho, rows.s2(q))
    coefs, _ = _project(rows, x)
    e, a, b, c = coefs
    rmse = float(np.sqrt(np.mean((rows.loss - _fitted(rows, x, coefs)) ** 2)))
    ref_n, ref_s = rows.centre
    mpl = {"form": "multipower", "power": math.exp(q[1]), "gamma": float(q[2])} if rows.form == "multipower" else {}
    if rows.log_exposure is not None:
        mpl.update(lr_law=rows.lr_law, rho=float(rho), exposure_ref=rows.exposure_ref)
    return CurveLaw(float(e), float(a * math.exp(alpha * ref_n)), 0.0 if rows.one_size else float(alpha),
                    float(b * math.exp(beta * ref_s)), float(beta), float(c), math.exp(q[0]),
                    rmse, rows.size, rows.noise_exponent,
                    rows.noise_ref, rows.prior_weight, **mpl)


def _anneal_params(law: CurveLaw) -> list[float]:
    """The law's nonlinear parameters after alpha and beta, as `fit_rows` searches them: the annealing term's
    (as `FitRows.s2` reads them), then rho where the law has one."""
    q = [math.log(law.tau)] + ([math.log(law.power), law.gamma] if law.form == "multipower" else [])
    return q + ([law.rho] if law.lr_law != "relative" else [])


def warm_start(law: CurveLaw) -> np.ndarray:
    """`law` as a point of `fit_rows`' search, where a refit on reweighted or resampled rows starts (no grid)."""
    return np.array([law.alpha if law.size is None else EXPONENT_BOUNDS[0], law.beta, *_anneal_params(law)])


def alpha_prior_z(alpha: float) -> float:
    """How many prior sds log alpha lies from ALPHA_PRIOR's median (0 without a prior)."""
    if ALPHA_PRIOR is None:
        return 0.0
    median, log_sd = ALPHA_PRIOR
    return (math.log(alpha) - math.log(median)) / log_sd


def noise_scale(params, exponent: float, ref: float):
    """(params / ref)^-exponent: how much a run of `params` strays from the law, relative to one at `ref`
    (a number, or an array for an array of params)."""
    return (params / ref) ** -exponent


def _noise_exponent(rows: FitRows, law: CurveLaw) -> tuple[float, float]:
    """(exponent, ref): minus the slope of each run's log RMS residual against log N, and N's geometric mean.

    Kept only where the runs show it: a slope within 2 standard errors of 0 (or fewer than 4 runs)
    gives 0. One run's RMS is mostly its own offset, so log RMS scatters by ~1 between runs of one
    size, and a slope read off 4-6 equally noisy runs is often +-0.3 by chance, which would shrink a
    larger target's band for nothing. Clipped to NOISE_EXPONENT_BOUNDS.
    """
    log_n = np.array([values[0] for values in rows.split(rows.log_params)])
    ref = math.exp(float(log_n.mean()))
    if rows.one_size or len(log_n) < 4:
        return 0.0, ref
    rms = np.array([math.sqrt(float(np.mean(r**2))) for r in rows.split(rows.loss - _linearize(rows, law)[0])])
    x, y = log_n - log_n.mean(), np.log(np.maximum(rms, 1e-12))
    slope, intercept = np.polyfit(x, y, 1)
    se = math.sqrt(float(np.sum((y - intercept - slope * x) ** 2)) / (len(x) - 2) / float(np.sum(x**2)))
    if -slope <= 2 * se:
        return 0.0, ref
    return float(np.clip(-slope, *NOISE_EXPONENT_BOUNDS)), ref


def fit_curve_law(runs: Sequence[Run], form: str = "tissue", lr_law: str = "relative",
                  alpha_prior: str = "always") -> CurveLaw:
    """Fit the curve law jointly on every post-warmup row of every run (least squares on loss).

    Grid: alpha, beta in 0.05..1.2 (8 each), tau in 1..last step (7, log-spaced); then L-BFGS-B
    within alpha, beta in [0.01, 3] and tau in [1, 10 x last step]. Runs of one size fit the
    schedule part alone (`CurveLaw.size`): E absorbs A * N^-alpha, and the law predicts new
    schedules for that size only.

    Small rungs stray further from any law than large ones: on our CPU ladders the final losses of one
    rung's 5 seeds span 1.6-3.8%, the 3 targets' 1.1-1.2%. Ordinary least squares lets
    the noisiest, furthest-from-the-target runs pull the fit as hard as the nearest. So the fit is
    done twice: unweighted, to measure how each run's RMS residual falls with N (`noise_scale`,
    exponent kappa), then weighted by N^(2 kappa) (generalized least squares; Carroll & Ruppert 1988,
    "Transformation and Weighting in Regression", ch. 3: estimate the variance function from a first
    fit's residuals, then refit). The bands use the same scale (`bootstrap_curve_law`).

    Then once more with ALPHA_PRIOR's penalty w * z^2 added to the sum of squares (z: how many prior
    sds log alpha lies from the median). w is the noise of one run's rows in that sum, m * run_var +
    checkpoint_var (m rows per run, the variances of `variance_components`): alpha moves a run's
    rows together, so the prior weighs like one more run's level. Noiseless curves give w = 0. A ladder
    of one run per size gets one checkpoint's variance, the lower end (E, A and alpha absorb every run
    level, so run_var is unknown), which leaves the fit to the data. The degrees of freedom of the bands
    (`variance_components`) count a penalized alpha as a whole parameter; on the tests' 3-size x
    2-seed ladder the run sd moved from 0.0121 (unpenalized) to 0.0122.

    `lr_law` lets the peak LR and batch in (`curve.LR_LAWS`, fitting rho in [0, 1]) where some size's runs
    differ in them; elsewhere the fit is the relative-LR law's, exactly (`CurveLaw.lr_law` says which).
    `alpha_prior` (`ALPHA_PRIORS`): "always" applies ALPHA_PRIOR; "unidentified" only to curves of fewer than
    IDENTIFYING_SIZES sizes, where the data cannot pin alpha (issue 60's candidate: the 308M target's alpha
    came out 0.097 against the prior's 0.35, a pull the 7 sizes may not need).
    """
    if alpha_prior not in ALPHA_PRIORS:
        raise DataError(f"alpha_prior={alpha_prior!r} is not one of {', '.join(ALPHA_PRIORS)}.")
    rows = tabulate_rows(runs, form, lr_law)
    law = fit_rows(rows)
    exponent, ref = _noise_exponent(rows, law)
    rows = replace(rows, noise_exponent=exponent, noise_ref=ref)
    law = _refit(rows, law) if exponent > 0 else replace(law, noise_ref=ref)
    identified = alpha_prior == "unidentified" and len({run.params for run in runs}) >= IDENTIFYING_SIZES
    if rows.one_size or ALPHA_PRIOR is None or identified:
        return law
    run_var, _, checkpoint_var, _ = measure_noise(rows, law)[2]
    weight = float(np.mean(rows.counts)) * run_var + checkpoint_var
    return _refit(replace(rows, prior_weight=weight), law)


def _refit(rows: FitRows, law: CurveLaw) -> CurveLaw:
    """`fit_rows` on reweighted rows: from the grid again, but the multi-power grid is 5-dimensional, so its refits
    start from the last fit (`warm_start`) instead."""
    return fit_rows(rows, warm_start(law) if rows.form == "multipower" else None)


def _linearize(rows: FitRows, law: CurveLaw) -> tuple[np.ndarray, np.ndarray]:
    """([n] the law's loss at the fitted rows, [n, p] its derivatives by the parameters the fit estimated).

    A parameter on a bound was not estimated: a coefficient NNLS put at 0, with the exponent or delay
    that acts only through it, or an exponent or tau at the end of its search range. A least-squares
    fit constrained to a convex set spends as many degrees of freedom as the face it lands on has
    dimensions (Meyer & Woodroofe 2000, "On the degrees of freedom in shape-restricted regression").
    """
    def free(value: float, lo: float, hi: float) -> bool:
        return lo * (1 + 1e-9) < value < hi * (1 - 1e-9)  # L-BFGS-B returns an active bound exactly

    log_n, q = rows.log_params, _anneal_params(law)
    shift, gain = rows.exposure_terms(law.rho)
    log_s1 = rows.log_s1 + shift
    anneal = rows.s2(q[:len(rows.anneal_bounds())])
    size, data, s2 = np.exp(-law.alpha * log_n), np.exp(-law.beta * log_s1), gain * anneal
    columns = [np.ones_like(s2)] if law.e > 0 else []
    if law.a > 0:
        columns += [size] + ([-law.a * log_n * size] if free(law.alpha, *EXPONENT_BOUNDS) else [])
    if law.b > 0:
        columns += [data] + ([-law.b * log_s1 * data] if free(law.beta, *EXPONENT_BOUNDS) else [])
    if rows.log_exposure is not None and free(law.rho, *RHO_BOUNDS) and (law.b > 0 or law.c > 0):
        # rho moves the data term (through log S1, except under `noise`) and, under `convex` and `noise`, the gain
        d_shift = 0.0 if rows.lr_law == "noise" else -law.b * law.beta * rows.log_exposure * data
        d_gain = (gain * rows.log_exposure) if rows.lr_law in ("convex", "noise") else 0.0
        columns.append(d_shift + law.c * rows.anneal_column(d_gain, anneal))
    if law.c > 0:
        columns.append(rows.anneal_column(gain, anneal))
        if rows.form == "tissue" and free(law.tau, 1.0, math.exp(rows.max_log_tau)):
            columns.append(-law.c * gain * rows.anneal(q[0], 1))
        elif rows.form == "multipower":
            # TODO: central differences, from before `FitRows.s2_and_gradient`; its exact derivatives would move
            # the noise estimates (and so the bands) by rounding, so they wait for a change that may move them.
            for i, (lo, hi) in enumerate(rows.anneal_bounds()):
                if lo + 1e-6 < q[i] < hi - 1e-6:
                    up, down = list(q), list(q)
                    up[i], down[i] = q[i] + 1e-4, q[i] - 1e-4
                    columns.append(-law.c * gain * (rows.s2(up) - rows.s2(down)) / 2e-4)
    loss = law.e + law.a * size + law.b * data + law.c * rows.anneal_column(gain, anneal)
    return loss, np.column_stack(columns) if columns else np.zeros((len(loss), 0))


def measure_noise(rows: FitRows, law: CurveLaw) -> tuple[np.ndarray, list[np.ndarray], tuple[float, float, float, int]]:
    """How far the rows stray from `law`, fitted to them: ([n] the law at the rows, each run's residuals in units of
    a run at noise_ref, `variance_components` of those residuals with the fit's linearization)."""
    predicted, jacobian = _linearize(rows, law)
    residuals = rows.split((rows.loss - predicted) / rows.scale)
    return predicted, residuals, variance_components(residuals, jacobian / rows.scale[:, None])


def variance_components(residuals: Sequence[np.ndarray], jacobian: np.ndarray) -> tuple[float, float, float, int]:
    """(run_var, run_dof, checkpoint_var, checkpoint_dof) from the residuals of each run, by moments.

    With Z the [n, R] run indicators, D = diag(1 / rows of each run), P = I - H the residual
    projector of the fit linearized at its optimum (H projects on the columns of `jacobian`) and
    M = Z'PZ, the sum of squared run means Q1 and the within-run sum of squares Q2 of the residuals
    have expectations

        E[Q1] = run_var * tr(D^2 M^2)               + checkpoint_var * tr(D^2 M)
        E[Q2] = run_var * (tr(M) - tr(D M^2))       + checkpoint_var * (n - p - tr(D M)),

    solved for the two variances (the ANOVA method: equate quadratic forms to their expectations;
    Searle, Casella & McCulloch 1992, "Variance Components", ch. 5). If only E, A and alpha absorb
    run levels and every run has m rows, this is the count run_var = Q1 / (R - 3) - checkpoint_var / m,
    checkpoint_var = Q2 / (n - R - 4). But the data and anneal terms absorb run levels too (runs
    differ in length, schedule and tokens per step): on 30 synthetic 6-run ladders the count left
    run_var at 0.65 of the truth on average, this at 0.88. run_dof is Satterthwaite's (1946)
    effective dof of Q1, tr(K)^2 / tr(K^2) with K = D^2 M^2.
    """
    counts = np.array([len(r) for r in residuals], dtype=np.float64)
    num_runs, num_rows = len(residuals), int(counts.sum())
    basis = np.zeros((num_rows, 0))
    if jacobian.shape[1]:
        u, s, _ = np.linalg.svd(jacobian / np.linalg.norm(jacobian, axis=0), full_matrices=False)
        basis = u[:, s > 1e-10 * s[0]]  # drops directions the rows cannot tell apart
    per_run = np.zeros((num_runs, basis.shape[1]))
    np.add.at(per_run, np.repeat(np.arange(num_runs), counts.astype(np.int64)), basis)
    m = np.diag(counts) - per_run @ per_run.T
    d = 1.0 / counts
    m2 = m @ m
    k = (d**2)[:, None] * m2
    q1 = float(sum(r.mean() ** 2 for r in residuals))
    q2 = float(sum(np.sum((r - r.mean()) ** 2) for r in residuals))
    checkpoint_dof = max(num_rows - basis.shape[1] - float(d @ np.diag(m)), 1.0)
    checkpoint_var, run_var, run_dof = q2 / checkpoint_dof, 0.0, 0.0
    if np.trace(k) > 1e-9 * num_runs:  # else every run level is absorbed by the law
        run_dof = float(np.trace(k) ** 2 / np.trace(k @ k))
        moments = np.array([[np.trace(k), float(d**2 @ np.diag(m))],
                            [np.trace(m) - float(d @ np.diag(m2)), checkpoint_dof]])
        run_var, checkpoint_var = (float(v) for v in np.linalg.solve(moments, [q1, q2]))
        if run_var < 0:
            run_var, checkpoint_var = 0.0, q2 / checkpoint_dof
        elif checkpoint_var < 0:
            run_var, checkpoint_var = q1 / moments[0, 0], 0.0
    return run_var, run_dof, checkpoint_var, max(round(checkpoint_dof), 1)
