"""Scaling-law fits: the compute envelope, Chinchilla's L(N, D) and a schedule-aware curve law.

Every law here is linear in some parameters and nonlinear in its exponents. Each fit solves the
linear ones exactly (non-negative least squares) for given exponents, so the search runs over the
exponents alone (variable projection; Golub & Pereyra 1973): a grid, then L-BFGS-B from the best
grid point.

1. Compute envelope (Kaplan et al. 2020; Hoffmann et al. 2022, approach 1):

       L(C) = L_inf + A * C^-alpha

   fitted by least squares to the frontier points (`lower_envelope`), L_inf free or pinned.

2. Chinchilla (Hoffmann et al. 2022, approach 3):

       L(N, D) = E + A / N^alpha + B / D^beta

   fitted by a Huber loss (delta = 1e-3) on log L - log L_hat. For given exponents (E, A, B) come
   from a weighted NNLS on relative residuals (L - L_hat) / L, the first-order form of the log
   residual; a last joint L-BFGS-B pass over all five minimizes the exact Huber objective.

3. The curve law, fitted jointly on every checkpoint of every rung:

       L(N, t) = E + A * N^-alpha + B * S1(t)^-beta - C * S2(t)

       S1(t) = integral over tokens T' <= T(t) of  lr(T') / lr_peak  dT'        (effective tokens)
       S2(t) = EMA over steps, decay lambda = exp(-1/tau), of  drop(t)
       drop(t) = max_{t' <= t} lr(t') / lr_peak  -  lr(t) / lr_peak

   This is the LR-annealing law of Tissue et al. 2024 ("Scaling Law with Learning Rate Annealing",
   L(s) = L0 + A * S1^-alpha - C * S2 with S1 the summed LR and S2 = sum_i m_i,
   m_i = lambda * m_{i-1} + (lr_{i-1} - lr_i)) with three changes that let one law span a ladder:

   - S1 counts tokens, weighted by the LR relative to the run's own peak. At constant LR S1 = D and
     S2 = 0, so the law *is* Chinchilla's L(N, D) there: the curves and the across-run fit above
     describe the same surface. Tokens rather than steps let rungs with different batch sizes
     share one axis. Relative LR because a ladder tunes the peak LR per rung: its magnitude says
     how each rung was set up, not how far it has trained (the law does not model mis-tuned LRs).
   - N enters as Chinchilla's additive A * N^-alpha, the simplest form in which a bigger model is
     lower at every S1 and the constant-LR limit stays L(N, D). C and tau are shared by all sizes.
   - S2 is normalized: (1 - lambda) * S2_Tissue equals the EMA of the LR drop (by induction:
     y_i = lambda * y_{i-1} + (1 - lambda) * d_i = d_i - lambda * m_i), so S2 lies in [0, 1] and C
     reads as "loss removed by annealing to zero, once settled". Measuring the drop from the
     running peak means warmup adds nothing and a re-warmup gives the gain back.

   The multi-power law (Luo et al. 2025, L = L0 + A (S1 + S_W)^-alpha - LD(t) with
   LD(t) = B sum_k (lr_{k-1} - lr_k) G(lr_k^-gamma S_k(t)), G(x) = 1 - (C x + 1)^-beta) is the other
   form of the annealing term, `form="multipower"` (`multipower_drop`): more faithful for deep, long
   anneals, with two more nonlinear parameters and a drop sum over every earlier step (binned,
   `_DropTerms`), so its fits and bootstrap cost ~3-10x more. Which form is the default was decided on
   real public curves by a rule fixed before scoring (docs/scaling-ladder.md, "Real public curves").
   Rows before a run first reaches its peak LR are not fitted: neither law describes warmup.
   Least squares on loss (not Huber): the curve residuals feed the Gaussian bands of `predict`.

   A ladder spans a few sizes within 2-3x, too little for E, A and alpha on their own: the data
   trade a floor E against a steep alpha. So log alpha carries a prior, Normal(log 0.35, log 2)
   (`ALPHA_PRIOR`: where Chinchilla-form fits of LMs land), weighted as one more run
   (`fit_curve_law`): a ladder whose sizes pin alpha overrules it, one that cannot leans on it.

Bands come from `bootstrap_curve_law`, a two-level residual bootstrap: every resample keeps every
run at its own size and redraws its residuals as one run offset (resampled across runs) plus the
run's own within-run residual curve with a random sign, then refits; `predict` adds each new run's
own noise (`CurveBootstrap.run_sd`, `checkpoint_sd`). Checkpoints of one run share a seed, data
order and fit error, so they are never resampled one by one. Small rungs stray further from the law
than large ones, and a run strays further early than late: where the runs show it, the fit weights
each run by how its residuals shrink with N and the bands scale a new run's noise to its size
(`fit_curve_law`, `noise_scale`) and its checkpoint noise to each row's progress through the run
(`bootstrap_curve_law`, `checkpoint_scale`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import interpolate, optimize, signal, special

from moelab.errors import DataError
from moelab.ladder import NUM_BOOTSTRAP

__all__ = [
    "EnvelopeFit",
    "ChinchillaFit",
    "Run",
    "CurveLaw",
    "CurveBootstrap",
    "lower_envelope",
    "fit_compute_envelope",
    "envelope_loss",
    "envelope_compute",
    "fit_chinchilla",
    "chinchilla_loss",
    "effective_tokens",
    "anneal_drop",
    "multipower_drop",
    "FORMS",
    "fitted_rows",
    "past_warmup",
    "curve_loss",
    "curve_losses",
    "noise_scale",
    "alpha_prior_z",
    "progress_bin",
    "checkpoint_scale",
    "fit_curve_law",
    "bootstrap_curve_law",
    "SharedNoise",
    "shared_noise",
]


# The L-BFGS-B stopping rule is relative to max(|f|, 1): with objectives far below 1 (a Huber sum at
# delta = 1e-3 is ~1e-3 per point) the default ftol stops after a step or two. Besiroglu et al. 2024
# ("Chinchilla Scaling: A replication attempt") found Hoffmann et al.'s published estimates do not
# fit their own data and point to an optimizer that stopped early; every search here runs tight.
_LBFGS_OPTIONS = {"ftol": 1e-14, "gtol": 1e-10, "maxiter": 1000}
# A row counts as "at the peak LR" within this relative distance: CSVs print LRs rounded.
_PEAK_TOLERANCE = 1e-6
EXPONENT_BOUNDS = (0.01, 3.0)  # the search range of alpha and beta in the curve law
# A prior on the size exponent, log alpha ~ Normal(log 0.35, log 2): 0.35 is where Chinchilla-form fits
# of LMs land (Hoffmann et al. 2022: 0.34; Besiroglu et al. 2024: 0.35). A ladder of a few sizes within
# 2-3x cannot pin E, A and alpha alone (docs/scaling-ladder.md, "A prior on the size exponent"). None: no prior.
ALPHA_PRIOR: tuple[float, float] | None = (0.35, math.log(2.0))
# How fast a run's noise may fall with its size, residual sd ~ N^-kappa (`fit_curve_law`). Capped at 1:
# a steeper fall, read off a few sizes and extrapolated to the target, would make its band too narrow.
NOISE_EXPONENT_BOUNDS = (0.0, 1.0)
# Early training is not a power law: a small model's loss falls from ln(vocab) through plateaus and
# bumps (n-gram statistics, then induction) that no smooth S1^-beta follows, and least squares lets
# those rows bend the exponents. Rows before this share of a run's tokens are not fitted (they are
# still predicted and checked). Measured on benchmarks/schedule_fit.py's curves (tiny, 600 steps,
# one schedule left out from the other three of constant, cosine, WSD 10%): fitting from the peak
# LR on left an rmse of 0.024 and missed the WSD run's final loss by 5.5%; from 15% on, 0.006 and
# 0.5%. From 25% on changed little, from 35% on was worse (too few rows to pin the curvature).
TRANSIENT_FRACTION = 0.15
# The law's misfit within a run falls as the run leaves its transient: on our CPU ladders the within-run
# residuals were ~3x larger at 20% of a run's tokens than from 45% on. The bootstrap measures that
# profile on these bins of run progress (tokens / the run's last tokens) over the fitted span; a row
# before the first edge takes the first bin's scale.
PROGRESS_EDGES = tuple(float(x) for x in np.linspace(TRANSIENT_FRACTION, 1.0, 9))
_MIN_ROWS_PER_BIN = 10  # fewer fitted rows in any bin: the profile is too noisy to use, and stays flat


def _array(name: str, values, size: int | None = None, positive: bool = False) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).reshape(-1)
    if size is not None and len(out) != size:
        raise DataError(f"{name} has {len(out)} values but the other inputs have {size}; pass one per point.")
    if not np.all(np.isfinite(out)):
        raise DataError(f"{name} holds a non-finite value ({out[~np.isfinite(out)][0]}); drop that point.")
    if positive and np.any(out <= 0):
        raise DataError(f"{name}={out[out <= 0][0]} is invalid: every value must be > 0.")
    return out


def _search(objective: Callable[[np.ndarray], float], start: np.ndarray, bounds) -> np.ndarray:
    """L-BFGS-B from `start`, kept only if it improves on it (a failed line search can end worse)."""
    result = optimize.minimize(objective, start, method="L-BFGS-B", bounds=bounds, options=_LBFGS_OPTIONS)
    return result.x if result.fun <= objective(start) else np.asarray(start, dtype=np.float64)


def _best_on_grid(objective: Callable[[np.ndarray], float], grids: Sequence[np.ndarray]) -> np.ndarray:
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

    start = _best_on_grid(sse, [np.geomspace(1e-3, 2.0, 40)])
    (alpha,) = _search(sse, start, [(1e-4, 3.0)])
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
    alpha, beta = _search(projected, _best_on_grid(projected, [grid, grid]), [(0.01, 3.0)] * 2)
    e, a, b = project(alpha, beta)

    def joint(q):
        return huber(q[0], q[1], q[3], q[2], q[4])

    e, a, b, alpha, beta = _search(joint, np.array([e, a, b, alpha, beta]), [(0.0, None)] * 3 + [(0.01, 3.0)] * 2)
    return ChinchillaFit(float(e), float(a * math.exp(alpha * ref_n)), float(alpha),
                         float(b * math.exp(beta * ref_d)), float(beta), huber_delta,
                         joint([e, a, b, alpha, beta]))


# ----------------------------------------------------------------------------------------------
# the curve law


@dataclass(frozen=True, eq=False)
class Run:
    """One run's rows: a rung with its observed loss, or a planned run (loss None).

    Arrays are float64, one value per row; `__post_init__` rejects anything the law cannot read,
    naming the run, the step and the value.
    """

    name: str
    params: float  # active non-embedding parameters N
    steps: np.ndarray  # [R] optimizer steps, whole numbers, strictly increasing
    tokens: np.ndarray  # [R] tokens trained on once that step is done, non-decreasing
    lr: np.ndarray  # [R] the LR used at that step, >= 0
    loss: np.ndarray | None = None  # [R] observed loss; None for a planned run

    def __post_init__(self) -> None:
        who = f"run {self.name!r}"
        if not (isinstance(self.params, numbers.Real) and math.isfinite(self.params) and self.params > 0):
            raise DataError(f"{who}: params={self.params!r} is invalid: the active non-embedding parameter "
                            "count must be a positive number.")
        arrays = {"step": self.steps, "tokens": self.tokens, "lr": self.lr}
        if self.loss is not None:
            arrays["loss"] = self.loss
        arrays = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in arrays.items()}
        sizes = {k: len(v) for k, v in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise DataError(f"{who}: columns have different lengths {sizes}; give one value per row.")
        steps = arrays["step"]
        if len(steps) == 0:
            raise DataError(f"{who} has no rows.")
        for column, values in arrays.items():
            bad = ~np.isfinite(values)
            if bad.any():
                i = int(np.argmax(bad))
                raise DataError(f"{who}, row {i + 1}: {column}={values[i]} is not finite; drop that row.")
        for column in ("step", "tokens", "lr"):
            if np.any(arrays[column] < 0):
                i = int(np.argmax(arrays[column] < 0))
                raise DataError(f"{who}, step {steps[i]:g}: {column}={arrays[column][i]:g} is negative; "
                                f"{column} must be >= 0.")
        if np.any(steps != np.round(steps)):
            i = int(np.argmax(steps != np.round(steps)))
            raise DataError(f"{who}: step={steps[i]:g} is not a whole number of optimizer steps.")
        if np.any(np.diff(steps) <= 0):
            i = int(np.argmax(np.diff(steps) <= 0)) + 1
            raise DataError(f"{who}: step {steps[i]:g} follows step {steps[i - 1]:g}; steps must strictly "
                            "increase within a run (sort the rows by step and drop repeats).")
        if np.any(np.diff(arrays["tokens"]) < 0):
            i = int(np.argmax(np.diff(arrays["tokens"]) < 0)) + 1
            raise DataError(f"{who}, step {steps[i]:g}: tokens={arrays['tokens'][i]:g} is below "
                            f"{arrays['tokens'][i - 1]:g} at step {steps[i - 1]:g}; tokens count what the run "
                            "has trained on so far and cannot go down.")
        if arrays["lr"].max() <= 0:
            raise DataError(f"{who}: lr is 0 at every row; the law measures progress in LR-weighted tokens, "
                            "so a run needs a positive LR.")
        object.__setattr__(self, "params", float(self.params))
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "tokens", arrays["tokens"])
        object.__setattr__(self, "lr", arrays["lr"])
        if self.loss is not None:
            object.__setattr__(self, "loss", arrays["loss"])


@dataclass(frozen=True)
class CurveLaw:
    """L(N, t) = e + a * N^-alpha + b * S1(t)^-beta - c * S2(t); see the module docstring."""

    e: float
    a: float
    alpha: float
    b: float  # in raw tokens: b * S1^-beta with S1 in effective tokens
    beta: float
    c: float  # loss removed by a full anneal to zero LR, once settled
    tau: float  # delay of the annealing gain, in optimizer steps (lambda = exp(-1 / tau))
    rmse: float | None = None  # over the rows it was fitted to; None for a law written down by hand
    size: float | None = None  # a schedule-only law: the one params it was fitted at (a = 0); None: any size
    # The fit's weights (`noise_scale`): a run's residuals were taken to scale as (N / noise_ref)^-noise_exponent.
    noise_exponent: float = 0.0
    noise_ref: float = 1.0
    prior_weight: float = 0.0  # the weight of ALPHA_PRIOR's penalty in the fit's sum of squares (`fit_curve_law`)
    # The annealing term's form: "tissue", S2 = EMA of the LR drop (tau in steps); "multipower", Luo et al. 2025's
    # loss drop (`multipower_drop`: tau is its LR-area scale in steps at peak LR, `power` and `gamma` its exponents).
    form: str = "tissue"
    power: float = 0.0
    gamma: float = 0.0


@dataclass(frozen=True)
class CurveBootstrap:
    """Refits on resampled residuals, plus the noise a new run adds on top of the law.

    A new run's loss at a row = the law + its own offset u (seed, data order, how its shape sits off
    the size law; shared by all its rows) + checkpoint noise e. run_sd and checkpoint_sd estimate
    the sds of u and e from the full-data residuals, with the degrees of freedom the fit left
    (`_variance_components`): R - 3 and n - R - 4 when E, A and alpha absorb three run levels and
    B, beta, C and tau nothing else, fewer runs' worth when the law's other terms also absorb run
    levels, more when a parameter sits on its bound. The dofs matter: `predict` draws u and e from
    Student t's with them, so an sd estimated from a handful of runs widens the band instead of
    being trusted. run_dof = 0 means the spread between runs cannot be estimated (run_sd is then 0
    and the bands leave it out: they are too narrow). Both sds are for a run at noise_ref params; a
    weighted law's run of N params has noise_scale(N) times them.
    """

    laws: tuple[CurveLaw, ...]
    run_sd: float  # at params = noise_ref; a run of size N has noise_scale(N) times it
    run_dof: float  # Satterthwaite's, so not always a whole number
    checkpoint_sd: float  # likewise at noise_ref
    checkpoint_dof: int
    noise_exponent: float = 0.0
    noise_ref: float = 1.0
    progress_scale: tuple[float, ...] = ()  # checkpoint sd multiplier per PROGRESS_EDGES bin; () = 1 throughout

    def noise_scale(self, params: float) -> float:
        """How much noisier than at noise_ref a run of `params` is (`fit.noise_scale`)."""
        return float(noise_scale(params, self.noise_exponent, self.noise_ref))

    def checkpoint_scale(self, progress) -> np.ndarray:
        """[R] the checkpoint sd's multiplier at each row's progress (tokens / the run's last tokens)."""
        return checkpoint_scale(progress, self.progress_scale)


def _relative_lr(run: Run) -> np.ndarray:
    return run.lr / run.lr.max()


def _dense_lr(run: Run) -> np.ndarray:
    """LR / peak LR at every step 0..last: linear between rows, the first row's value before it."""
    return np.interp(np.arange(int(run.steps[-1]) + 1), run.steps, _relative_lr(run))


def effective_tokens(run: Run) -> np.ndarray:
    """S1 at each row: sum over steps of (LR / peak LR) x (tokens that step trained on).

    LR and tokens are linear between rows, so with a row at every step this is the exact sum. Before
    the first row the LR is taken as the first row's: the rows say nothing earlier, so log a row at
    step 1 (or 0) if the warmup matters.
    """
    grid = np.arange(int(run.steps[-1]) + 1)
    tokens = np.interp(grid, run.steps, run.tokens)
    rel = _dense_lr(run)
    first = int(run.steps[0])
    s1 = np.concatenate([[0.0], np.cumsum(rel[first + 1:] * np.diff(tokens[first:]))]) + rel[first] * tokens[first]
    return s1[(run.steps - first).astype(np.int64)]


def _drop_profile(run: Run) -> np.ndarray:
    """The LR's drop below its running peak (relative units) at every step 0..last."""
    dense = _dense_lr(run)
    return np.maximum.accumulate(dense) - dense


def _ema(drop: np.ndarray, tau: float) -> np.ndarray:
    decay = math.exp(-1.0 / tau)
    return signal.lfilter([1.0 - decay], [1.0, -decay], drop)


def anneal_drop(run: Run, tau: float) -> np.ndarray:
    """S2 at each row: the EMA over steps (decay exp(-1/tau)) of the LR's drop below its running peak."""
    return _ema(_drop_profile(run), tau)[run.steps.astype(np.int64)]


# The multi-power law's drop term sums over every step before a row; its steps are grouped in bins that grow
# geometrically with their distance back from the row, this many per doubling: within 1e-3 of the exact sum on
# cosine and WSD runs at the dev cases' parameters, at ~30 bins a row instead of up to 10^5 steps.
_BINS_PER_DOUBLING = 4


@dataclass(frozen=True, eq=False)
class _DropTerms:
    """Every (row, bin) pair with LR drop in it: what `multipower_drop` sums, independent of the law's parameters."""

    row: np.ndarray  # [P] the row each pair belongs to
    mass: np.ndarray  # [P] the drop of relative LR within the bin
    lr: np.ndarray  # [P] relative LR at the bin's drop-weighted centre (floored: the LR after a drop to 0)
    area: np.ndarray  # [P] relative-LR steps from the bin's centre to the row: S_k(t) of Luo et al.
    num_rows: int

    def drop(self, tau: float, power: float, gamma: float) -> np.ndarray:
        """[rows] LD(t) / B: sum over bins of mass * (1 - (1 + lr^-gamma * area / tau)^-power)."""
        settled = 1.0 - (1.0 + self.lr ** -gamma * self.area / tau) ** -power
        return np.bincount(self.row, weights=self.mass * settled, minlength=self.num_rows)

    @staticmethod
    def concat(parts: Sequence["_DropTerms"]) -> "_DropTerms":
        offsets = np.cumsum([0] + [p.num_rows for p in parts[:-1]])
        return _DropTerms(np.concatenate([p.row + o for p, o in zip(parts, offsets)]),
                          np.concatenate([p.mass for p in parts]), np.concatenate([p.lr for p in parts]),
                          np.concatenate([p.area for p in parts]), int(sum(p.num_rows for p in parts)))


def _drop_terms(run: Run, picks: np.ndarray) -> _DropTerms:
    """The multi-power drop sum's bins at the steps `picks` of `run` (geometric in the distance back from each)."""
    rel = _dense_lr(run)
    delta = np.diff(_drop_profile(run), prepend=0.0)  # the drop's growth at each step (negative on a re-warmup)
    area = np.concatenate([[0.0], np.cumsum(rel)])  # area[k] = sum of rel over steps < k
    k = np.arange(len(rel), dtype=np.float64)
    cum_mass = np.concatenate([[0.0], np.cumsum(delta)])
    cum_moment = np.concatenate([[0.0], np.cumsum(delta * k)])
    back = np.unique(np.round(2.0 ** (np.arange(0, _BINS_PER_DOUBLING * math.log2(len(rel) + 2) + 1)
                                      / _BINS_PER_DOUBLING))).astype(np.int64) - 1  # 0, 1, 2, ...
    t = picks[:, None]
    hi = np.clip(t - back[None, :-1] + 1, 0, None)  # bin = steps [lo, hi): back from the row itself
    lo = np.clip(t - back[None, 1:] + 1, 0, None)
    mass = cum_mass[hi] - cum_mass[lo]
    keep = (hi > lo) & (np.abs(mass) > 1e-12)
    rows = np.broadcast_to(np.arange(len(picks))[:, None], hi.shape)[keep]
    mass, lo, hi = mass[keep], lo[keep], hi[keep]
    centre = np.clip((cum_moment[hi] - cum_moment[lo]) / mass, lo, hi - 1)
    lr = np.maximum(np.interp(centre, k, rel), 1e-3)
    since = area[picks[rows] + 1] - np.interp(centre, np.arange(len(area)), area)
    return _DropTerms(rows, mass, lr, np.maximum(since, 0.0), len(picks))


def multipower_drop(run: Run, tau: float, power: float, gamma: float) -> np.ndarray:
    """[R] the multi-power law's loss drop per unit B at each row (Luo et al. 2025, "A Multi-Power Law for Loss
    Curve Prediction Across Learning Rate Schedules", eq. 5), on LR relative to the run's peak:

        LD(t) / B = sum over steps k <= t of (eta_{k-1} - eta_k) * G(eta_k^-gamma * S_k(t)),
        G(x) = 1 - (1 + x / tau)^-power,  S_k(t) = sum of eta over steps k..t,

    with eta's drop taken below its running peak (warmup adds nothing, as for `anneal_drop`). Once a drop
    has settled G = 1 and the sum is the drop itself, so B reads like the Tissue form's C.
    """
    return _drop_terms(run, run.steps.astype(np.int64)).drop(tau, power, gamma)


def past_warmup(run: Run) -> np.ndarray:
    """[R] bool: the rows from the first at the run's peak LR on, with S1 > 0 (where a band can be checked)."""
    at_peak = _relative_lr(run) >= 1.0 - _PEAK_TOLERANCE
    return (np.arange(len(run.steps)) >= int(np.argmax(at_peak))) & (effective_tokens(run) > 0)


def fitted_rows(run: Run) -> np.ndarray:
    """[R] bool: the rows the law is fitted to: past warmup and past the first TRANSIENT_FRACTION of the tokens."""
    return past_warmup(run) & (run.tokens >= TRANSIENT_FRACTION * run.tokens[-1])


def curve_losses(laws: Sequence[CurveLaw], run: Run) -> np.ndarray:
    """[L, R] each law's loss at each row of `run`; NaN where S1 = 0 (before any training).

    S1 and the LR-drop profile are computed once for all laws: on a 10^6-step plan they cost more
    than evaluating a law.
    """
    if laws:
        _check_size(laws[0], run)
    s1, drop, picks = effective_tokens(run), _drop_profile(run), run.steps.astype(np.int64)
    safe_s1 = np.where(s1 > 0, s1, 1.0)
    terms = _drop_terms(run, picks) if any(law.form == "multipower" for law in laws) else None
    out = np.empty((len(laws), len(s1)))
    for i, law in enumerate(laws):
        data_term = np.where(s1 > 0, law.b * safe_s1**-law.beta, np.nan)
        anneal = (terms.drop(law.tau, law.power, law.gamma) if law.form == "multipower"
                  else _ema(drop, law.tau)[picks])
        out[i] = law.e + law.a * run.params**-law.alpha + data_term - law.c * anneal
    return out


def _check_size(law: CurveLaw, run: Run) -> None:
    if law.size is not None and abs(run.params / law.size - 1) > 1e-9:
        raise DataError(f"run {run.name!r} has params={run.params:g}, but the law was fitted on curves of one size, "
                        f"params={law.size:g}: it predicts new schedules for that size only. Fit curves of at least "
                        "2 sizes to predict another size.")


def curve_loss(law: CurveLaw, run: Run) -> np.ndarray:
    """[R] the law's loss at each row of `run`; NaN where S1 = 0 (before any training)."""
    return curve_losses([law], run)[0]


@dataclass(frozen=True, eq=False)
class _Rows:
    """Every fitted row of every run as the objective reads it, with S2 tabulated over log tau.

    S2 depends on tau through an EMA over every step of every run; the table computes those EMAs
    once per fit (and once for all its bootstrap refits, which change only the losses), so the
    search evaluates a spline instead of re-running them: 5-50x faster on long runs.
    """

    log_params: np.ndarray  # [n] log N of each row's run
    log_s1: np.ndarray  # [n]
    loss: np.ndarray  # [n]
    progress: np.ndarray  # [n] tokens / the run's last tokens (`progress_bin`)
    counts: np.ndarray  # [R] fitted rows per run, in run order
    anneal: interpolate.CubicSpline  # log tau -> [n] S2 at the fitted rows (the Tissue form)
    max_log_tau: float
    drops: _DropTerms | None  # the multi-power form's drop sum at the fitted rows; None for the Tissue form
    size: float | None  # the one params every run has, else None
    noise_exponent: float = 0.0  # the rows are weighted by 1 / noise_scale(N)^2 (`fit_curve_law`)
    noise_ref: float = 1.0
    prior_weight: float = 0.0  # ALPHA_PRIOR's penalty is prior_weight * z^2 (`fit_curve_law`)

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

    def anneal_bounds(self) -> list[tuple[float, float]]:
        return [(0.0, self.max_log_tau)] + ([] if self.drops is None else [_LOG_POWER_BOUNDS, _GAMMA_BOUNDS])

    @property
    def scale(self) -> np.ndarray:
        """[n] each row's noise_scale: residuals divided by it have one variance at every size."""
        return noise_scale(np.exp(self.log_params), self.noise_exponent, self.noise_ref)

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """[n] values -> one array per run."""
        return np.split(values, np.cumsum(self.counts)[:-1])


# S2 is smooth in log tau (an EMA's kernel moves continuously); cubic interpolation between knots
# 0.1 apart is within 3e-7 of the exact EMA (S2 lies in [0, 1]) on constant, cosine and WSD runs.
_LOG_TAU_KNOT = 0.1


_LOG_POWER_BOUNDS = (math.log(0.02), math.log(20.0))  # the multi-power G's exponent (Luo et al. fit 0.4-0.6)
_GAMMA_BOUNDS = (0.0, 1.5)  # its LR exponent (Luo et al. fit ~0.5-0.6)


def _rows(runs: Sequence[Run], form: str = "tissue") -> _Rows:
    for run in runs:
        if run.loss is None:
            raise DataError(f"run {run.name!r} has no loss column; the fit needs observed losses.")
    keeps = [fitted_rows(run) for run in runs]
    drops = [_drop_profile(run) for run in runs]
    picks = [run.steps[keep].astype(np.int64) for run, keep in zip(runs, keeps)]
    max_log_tau = math.log(10.0 * max(len(d) for d in drops))
    knots = np.linspace(0.0, max_log_tau, max(8, math.ceil(max_log_tau / _LOG_TAU_KNOT) + 1))
    table = np.array([np.concatenate([_ema(d, math.exp(k))[p] for d, p in zip(drops, picks)]) for k in knots])
    return _Rows(
        log_params=np.concatenate([np.full(keep.sum(), math.log(run.params)) for run, keep in zip(runs, keeps)]),
        log_s1=np.concatenate([np.log(effective_tokens(run)[keep]) for run, keep in zip(runs, keeps)]),
        loss=np.concatenate([run.loss[keep] for run, keep in zip(runs, keeps)]),
        progress=np.concatenate([(run.tokens / run.tokens[-1])[keep] for run, keep in zip(runs, keeps)]),
        counts=np.array([keep.sum() for keep in keeps]),
        anneal=interpolate.CubicSpline(knots, table, axis=0),
        max_log_tau=max_log_tau,
        drops=_DropTerms.concat([_drop_terms(run, p) for run, p in zip(runs, picks)]) if form == "multipower" else None,
        size=runs[0].params if len({run.params for run in runs}) == 1 else None,
    )


def _fit_rows(rows: _Rows, start: np.ndarray | None) -> CurveLaw:
    """Least squares over (alpha, beta, *q) with (E, A, B, C) >= 0 projected out by NNLS; q is the annealing
    term's nonlinear parameters (`_Rows.s2`).

    On curves of one size the size term is E's: the fit drops A and alpha and says so (`size`).
    """
    one_size = rows.one_size
    ref_n, ref_s = float(np.mean(rows.log_params)), float(np.mean(rows.log_s1))
    x_n, x_s = rows.log_params - ref_n, rows.log_s1 - ref_s
    ones = np.ones_like(rows.loss)

    weight = 1.0 / rows.scale  # generalized least squares: each row divided by its noise sd

    def design(p) -> np.ndarray:
        alpha, beta, *q = p
        size = [] if one_size else [np.exp(-alpha * x_n)]
        return np.column_stack([ones, *size, np.exp(-beta * x_s), -rows.s2(q)])

    def project(p) -> tuple[np.ndarray, float]:
        coefs, rnorm = optimize.nnls(design(p) * weight[:, None], rows.loss * weight)
        return (np.insert(coefs, 1, 0.0) if one_size else coefs), float(rnorm**2)

    def sse(p):
        return project(p)[1] + rows.prior_weight * alpha_prior_z(p[0]) ** 2

    bounds = [EXPONENT_BOUNDS, EXPONENT_BOUNDS] + rows.anneal_bounds()
    if start is None:
        multipower = rows.form == "multipower"
        exponents = np.linspace(0.05, 1.2, 5 if multipower else 8)
        taus = np.linspace(0.0, rows.max_log_tau - math.log(10.0), 5 if multipower else 7)
        extra = [np.log([0.3, 1.0]), np.array([0.0, 0.6])] if multipower else []
        start = _best_on_grid(sse, [exponents[:1] if one_size else exponents, exponents, taus, *extra])
    if one_size:  # alpha does not enter: search the others only
        bounds[0] = (start[0], start[0])
    p = _search(sse, np.clip(start, *np.array(bounds).T), bounds)
    coefs, _ = project(p)
    e, a, b, c = coefs
    fitted = design(p) @ (np.delete(coefs, 1) if one_size else coefs)
    alpha, beta, log_tau, *q = p
    mpl = {"form": "multipower", "power": math.exp(q[0]), "gamma": float(q[1])} if q else {}
    return CurveLaw(float(e), float(a * math.exp(alpha * ref_n)), 0.0 if one_size else float(alpha),
                    float(b * math.exp(beta * ref_s)), float(beta), float(c), math.exp(log_tau),
                    float(np.sqrt(np.mean((rows.loss - fitted) ** 2))), rows.size, rows.noise_exponent,
                    rows.noise_ref, rows.prior_weight, **mpl)


def _anneal_params(law: CurveLaw) -> list[float]:
    """The law's annealing parameters as `_Rows.s2` reads them."""
    q = [math.log(law.tau)]
    return q + [math.log(law.power), law.gamma] if law.form == "multipower" else q


def alpha_prior_z(alpha: float) -> float:
    """How many prior sds log alpha lies from ALPHA_PRIOR's median (0 without a prior)."""
    if ALPHA_PRIOR is None:
        return 0.0
    median, log_sd = ALPHA_PRIOR
    return (math.log(alpha) - math.log(median)) / log_sd


def _check_ladder(runs: Sequence[Run], form: str = "tissue") -> _Rows:
    names = [r.name for r in runs]
    if not runs:
        raise DataError("the curve law needs at least 1 run; got none.")
    if len(set(names)) != len(names):
        raise DataError(f"run names repeat ({sorted({n for n in names if names.count(n) > 1})}); name each run once.")
    if form not in FORMS:
        raise DataError(f"form={form!r} is not a form of the curve law's annealing term; one of {', '.join(FORMS)}.")
    rows = _rows(runs, form)
    need = (6 if rows.one_size else 8) + (2 if form == "multipower" else 0)
    if len(rows.loss) < need:
        raise DataError(f"only {len(rows.loss)} rows are past warmup with tokens > 0; the law has {need - 1} "
                        f"parameters{' on curves of one size' if rows.one_size else ''} and needs at least {need} "
                        "rows (log more evals per run).")
    return rows


def noise_scale(params, exponent: float, ref: float):
    """(params / ref)^-exponent: how much a run of `params` strays from the law, relative to one at `ref`
    (a number, or an array for an array of params)."""
    return (params / ref) ** -exponent


def _noise_exponent(rows: _Rows, law: CurveLaw) -> tuple[float, float]:
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


def progress_bin(progress) -> np.ndarray:
    """[R] the PROGRESS_EDGES bin of each progress value (tokens / the run's last tokens)."""
    return np.clip(np.searchsorted(PROGRESS_EDGES, np.asarray(progress), side="right") - 1, 0,
                   len(PROGRESS_EDGES) - 2)


def checkpoint_scale(progress, profile: Sequence[float]) -> np.ndarray:
    """[R] `profile`'s value at each row's progress bin; 1 everywhere for an empty (flat) profile."""
    progress = np.asarray(progress, dtype=np.float64)
    return np.asarray(profile)[progress_bin(progress)] if len(profile) else np.ones_like(progress)


def _progress_profile(within: Sequence[np.ndarray], progress: Sequence[np.ndarray]) -> tuple[float, ...]:
    """The checkpoint sd's multiplier per progress bin, from the runs' within-run residuals.

    Each bin's mean square, made non-increasing in progress (isotonic regression weighted by the
    bin's rows: the law's misfit does not grow as a run trains) and normalized so that its mean over
    the fitted rows is 1 (checkpoint_sd stays the average within-run sd); square-rooted.

    Kept only where the runs show it; else flat, (). Each run's log ratio of its mean square residual
    before and after the middle of the fitted span is one observation (a run's rows are correlated,
    its runs are not): their mean must exceed 3 standard errors, over at least 6 runs, and every bin
    needs _MIN_ROWS_PER_BIN rows. On equally noisy rows an unguarded isotonic profile comes out
    decreasing by chance and narrows the late bands for nothing; at 2 standard errors over 4 runs, 2
    of 8 synthetic ladders with equal noise got one.
    """
    middle = (PROGRESS_EDGES[0] + PROGRESS_EDGES[-1]) / 2
    ratios = [math.log(np.mean(w[x < middle] ** 2) / np.mean(w[x >= middle] ** 2)) for w, x in zip(within, progress)
              if (x < middle).any() and (x >= middle).any() and np.mean(w[x >= middle] ** 2) > 0
              and np.mean(w[x < middle] ** 2) > 0]
    if len(ratios) < 6 or np.mean(ratios) <= 3 * np.std(ratios, ddof=1) / math.sqrt(len(ratios)):
        return ()
    bins = progress_bin(np.concatenate(progress))
    squares = np.concatenate(within) ** 2
    counts = np.bincount(bins, minlength=len(PROGRESS_EDGES) - 1)
    if counts.min() < _MIN_ROWS_PER_BIN:
        return ()
    mean_square = np.bincount(bins, weights=squares, minlength=len(counts)) / counts
    profile = optimize.isotonic_regression(mean_square, weights=counts, increasing=False).x
    return tuple(float(v) for v in np.sqrt(profile / (profile @ counts / counts.sum())))


FORMS = ("tissue", "multipower")  # the annealing term's forms (`CurveLaw.form`)


def fit_curve_law(runs: Sequence[Run], form: str = "tissue") -> CurveLaw:
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
    checkpoint_var (m rows per run, the variances of `_variance_components`): alpha moves a run's
    rows together, so the prior weighs like one more run's level. Noiseless curves give w = 0. A ladder
    of one run per size gets one checkpoint's variance, the lower end (E, A and alpha absorb every run
    level, so run_var is unknown), which leaves the fit to the data. The degrees of freedom of the bands
    (`_variance_components`) count a penalized alpha as a whole parameter; on the tests' 3-size x
    2-seed ladder the run sd moved from 0.0121 (unpenalized) to 0.0122.
    """
    rows = _check_ladder(runs, form)
    law = _fit_rows(rows, start=None)

    def again(rows: _Rows, law: CurveLaw) -> CurveLaw:
        # the multi-power grid is 5-dimensional: its refits on reweighted rows start from the last fit instead
        if form == "multipower":
            return _fit_rows(rows, np.array([law.alpha if law.size is None else EXPONENT_BOUNDS[0], law.beta,
                                             *_anneal_params(law)]))
        return _fit_rows(rows, start=None)

    exponent, ref = _noise_exponent(rows, law)
    rows = replace(rows, noise_exponent=exponent, noise_ref=ref)
    law = again(rows, law) if exponent > 0 else replace(law, noise_ref=ref)
    if rows.one_size or ALPHA_PRIOR is None:
        return law
    run_var, _, checkpoint_var, _ = _noise_of(rows, law)[2]
    weight = float(np.mean(rows.counts)) * run_var + checkpoint_var
    return again(replace(rows, prior_weight=weight), law)


def _linearize(rows: _Rows, law: CurveLaw) -> tuple[np.ndarray, np.ndarray]:
    """([n] the law's loss at the fitted rows, [n, p] its derivatives by the parameters the fit estimated).

    A parameter on a bound was not estimated: a coefficient NNLS put at 0, with the exponent or delay
    that acts only through it, or an exponent or tau at the end of its search range. A least-squares
    fit constrained to a convex set spends as many degrees of freedom as the face it lands on has
    dimensions (Meyer & Woodroofe 2000, "On the degrees of freedom in shape-restricted regression").
    """
    def free(value: float, lo: float, hi: float) -> bool:
        return lo * (1 + 1e-9) < value < hi * (1 - 1e-9)  # L-BFGS-B returns an active bound exactly

    log_n, log_s1, q = rows.log_params, rows.log_s1, _anneal_params(law)
    size, data, s2 = np.exp(-law.alpha * log_n), np.exp(-law.beta * log_s1), rows.s2(q)
    columns = [np.ones_like(s2)] if law.e > 0 else []
    if law.a > 0:
        columns += [size] + ([-law.a * log_n * size] if free(law.alpha, *EXPONENT_BOUNDS) else [])
    if law.b > 0:
        columns += [data] + ([-law.b * log_s1 * data] if free(law.beta, *EXPONENT_BOUNDS) else [])
    if law.c > 0:
        columns.append(-s2)
        if rows.form == "tissue" and free(law.tau, 1.0, math.exp(rows.max_log_tau)):
            columns.append(-law.c * rows.anneal(q[0], 1))
        elif rows.form == "multipower":  # by central differences: the drop sum has no closed-form derivative
            for i, (lo, hi) in enumerate(rows.anneal_bounds()):
                if lo + 1e-6 < q[i] < hi - 1e-6:
                    up, down = list(q), list(q)
                    up[i], down[i] = q[i] + 1e-4, q[i] - 1e-4
                    columns.append(-law.c * (rows.s2(up) - rows.s2(down)) / 2e-4)
    loss = law.e + law.a * size + law.b * data - law.c * s2
    return loss, np.column_stack(columns) if columns else np.zeros((len(loss), 0))


def _noise_of(rows: _Rows, law: CurveLaw) -> tuple[np.ndarray, list[np.ndarray], tuple[float, float, float, int]]:
    """([n] the law at the rows, each run's residuals in units of a run at noise_ref, `_variance_components`)."""
    predicted, jacobian = _linearize(rows, law)
    residuals = rows.split((rows.loss - predicted) / rows.scale)
    return predicted, residuals, _variance_components(residuals, jacobian / rows.scale[:, None])


def _variance_components(residuals: Sequence[np.ndarray], jacobian: np.ndarray) -> tuple[float, float, float, int]:
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


def bootstrap_curve_law(runs: Sequence[Run], law: CurveLaw, num_samples: int = NUM_BOOTSTRAP,
                        seed: int = 0, progress: Callable[[Iterable], Iterable] = iter) -> CurveBootstrap:
    """Refit on `num_samples` two-level residual resamples, warm-started at `law`; estimate the run noise.

    Each resample keeps every run, its size and its rows, and replaces its residuals by

        u*_r + s_r * c * e_r        u*_r drawn with replacement from the runs' offsets, s_r = +-1,

    a residual bootstrap at both levels of the data (Davison & Hinkley 1997, "Bootstrap Methods and
    their Application", sec. 3.8), with the offsets reflated to mean 0 and mean square run_sd^2 and
    the within-run residuals e_r scaled by c to mean square checkpoint_sd^2: residuals are shrunk by
    the fit, the estimated variances are not (Carpenter, Goldstein & Rasbash 2003, "A novel bootstrap
    procedure for assessing the relationship between class size and achievement"). A run's
    within-run residual curve moves as one piece with one random sign (the wild bootstrap of Wu 1986
    and Mammen 1993, one weight per cluster as in Cameron, Gelbach & Miller 2008), so its
    autocorrelation (the law's smooth misfit more than eval noise) stays whole.

    Why not resample whole runs: each run is the only one at its size, so a resample that draws a run
    twice has lost a size and the refit extrapolates from the sizes left. With 3 runs at 3 sizes every
    resample that keeps the sizes is the data itself: all refits were identical and the band had no
    fit uncertainty. Why not a jackknife over runs: with 4 runs each leave-one-out fit stands on 3
    sizes, the very fits to avoid, and it yields a variance, not a distribution. Warm starts skip the
    grid, the usual compromise that keeps each refit local to the full-data optimum.

    With a weighted law (`fit_curve_law`: noise_exponent > 0) the residuals are divided by each row's
    noise scale before all this and multiplied back per run, and every refit keeps the law's weights:
    kappa is not re-estimated, so its own uncertainty is not in the band. Every refit also carries
    the law's prior penalty around the prior's median, as the estimator does; resampled around an
    already shrunk law, the refits shrink alpha a little further (on a 3-size x 2-seed synthetic
    ladder their median alpha was 0.27 against the law's 0.23: the band's centre moved by ~0.3% of the
    loss, an eighth of its half-width). The within-run residuals
    also give the checkpoint sd's profile over a run's progress (`_progress_profile`,
    `CurveBootstrap.progress_scale`); the refits do not use it (they resample whole residual curves,
    which carry it already), the bands and the live forecast do.
    """
    rows = replace(_check_ladder(runs, law.form), noise_exponent=law.noise_exponent, noise_ref=law.noise_ref,
                   prior_weight=law.prior_weight)
    predicted, residuals, (run_var, run_dof, checkpoint_var, checkpoint_dof) = _noise_of(rows, law)
    scale = rows.scale
    within = [r - r.mean() for r in residuals]
    profile = _progress_profile(within, rows.split(rows.progress))

    offsets = np.array([r.mean() for r in residuals])
    centred = offsets - offsets.mean()
    spread = float(np.mean(centred**2))
    run_draws = centred * math.sqrt(run_var / spread) if run_var > 0 and spread > 0 else np.zeros(len(residuals))
    mean_square = float(sum(np.sum(w**2) for w in within)) / len(rows.loss)
    shrink = math.sqrt(checkpoint_var / mean_square) if mean_square > 0 else 0.0
    rng = np.random.default_rng(seed)
    start = np.array([law.alpha if law.size is None else EXPONENT_BOUNDS[0], law.beta, *_anneal_params(law)])
    laws = []
    for _ in progress(range(num_samples)):
        draws, signs = rng.choice(run_draws, len(residuals)), rng.choice([-1.0, 1.0], len(residuals))
        noise = np.concatenate([u + sign * shrink * w for u, sign, w in zip(draws, signs, within)])
        laws.append(_fit_rows(replace(rows, loss=predicted + scale * noise), start))
    return CurveBootstrap(tuple(laws), math.sqrt(run_var), run_dof, math.sqrt(checkpoint_var), checkpoint_dof,
                          law.noise_exponent, law.noise_ref, profile)


@dataclass(frozen=True)
class SharedNoise:
    """The noise runs of one size, seed and data order share at each step, and what a new one borrows.

    Runs that read the same batches in the same order stray from the law together (the same hard
    stretch of data, the same lucky one): on tests/data/schedules-tiny.csv, five schedules of one seed,
    the runs share an sd of 0.0046 at a step and stray 0.0048 on their own (the law's RMS misfit is
    0.0067). So a residual is g(s) + e_r(s), g shared by every run at step s and e a run's own (its
    schedule's misfit, what its LR does to the batches), and a new schedule on that data order carries
    the same g. Given the
    k runs' mean residual m(s) at its step, g's best linear unbiased predictor (a random effect's
    BLUP; Robinson 1991, "That BLUP is a good thing") is rho_k * m(s), rho_k = shared_var /
    (shared_var + own_var / k). Read by moments over the fitted rows, like `_variance_components`:
    own_var from the spread of the runs around m(s) at steps with two or more runs, shared_var from
    the mean square of m(s) less own_var / k, clipped at 0 (runs on different data orders share
    nothing, and borrow nothing). Borrowed at every row past warmup, where the runs' residuals are.

    The bands keep their width: the runs' spread around m(s) comes from where their schedules differ
    (before a WSD decays it is the constant run, bit for bit), while a new schedule differs where they
    do not, so own_var understates its noise. Narrowed by it, the band of the five left-out schedules
    above covered 0.86 of a WSD's evals (40% decay) and 0.11 of cosine's; kept, 0.96 and 0.54 (0.36
    without borrowing).
    """

    steps: np.ndarray  # [S] every step where one of the runs has a row past warmup
    mean: np.ndarray  # [S] the runs' mean residual there
    counts: np.ndarray  # [S] how many runs
    shared_var: float
    own_var: float

    def at(self, steps) -> np.ndarray:
        """[R] what a new run on the same data order borrows at each step: rho_k * m(s); 0 at a step no run has."""
        steps = np.asarray(steps, dtype=np.float64)
        if self.shared_var == 0:
            return np.zeros(len(steps))
        where = np.clip(np.searchsorted(self.steps, steps), 0, len(self.steps) - 1)
        known = self.steps[where] == steps
        rho = self.shared_var / (self.shared_var + self.own_var / self.counts[where])
        return np.where(known, rho * self.mean[where], 0.0)


def shared_noise(runs: Sequence[Run], law: CurveLaw) -> SharedNoise:
    """What `runs` (one size, one seed and data order, several schedules) share at each step; see `SharedNoise`.

    DataError for curves of several sizes (their runs differ in more than the schedule) or with no step
    that two runs both evaluate (nothing to tell shared noise from a run's own).
    """
    if law.size is None:
        raise DataError("borrowing the noise runs share at each step needs curves of one size, seed and data order "
                        "(a schedule sweep); these hold several sizes. Drop --same-data-order, or fit one size's "
                        "curves.")
    keeps = [past_warmup(run) for run in runs]
    steps = np.concatenate([run.steps[keep] for run, keep in zip(runs, keeps)])
    residuals = np.concatenate([(run.loss - curve_loss(law, run))[keep] for run, keep in zip(runs, keeps)])
    fitted = np.concatenate([fitted_rows(run)[keep] for run, keep in zip(runs, keeps)])
    unique, index, counts = np.unique(steps, return_inverse=True, return_counts=True)
    mean = np.bincount(index, weights=residuals) / counts
    # the variances from steps where two or more runs have a fitted row and none an earlier one: a run's
    # first evals stray far more, and runs of different lengths leave their transient at different steps
    used = (counts >= 2) & (np.bincount(index, weights=~fitted, minlength=len(unique)) == 0)
    if not used.any():
        raise DataError("no step is evaluated by two of the curves' runs, so the noise they share cannot be told from "
                        "their own: evaluate the runs at the same steps, or drop --same-data-order.")
    own_var = float(np.sum((residuals - mean[index])[used[index]] ** 2) / np.sum(counts[used] - 1))
    shared_var = max(float(np.mean(mean[used] ** 2 - own_var / counts[used])), 0.0)
    return SharedNoise(unique, mean, counts.astype(np.float64), shared_var, own_var)
