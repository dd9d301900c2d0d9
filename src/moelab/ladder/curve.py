"""The curve law: a run's loss at every checkpoint from its size and its LR schedule.

    L(N, t) = E + A * N^-alpha + B * S1(t)^-beta - C * S2(t)

    S1(t) = integral over tokens T' <= T(t) of  lr(T') / lr_peak  dT'        (effective tokens)
    S2(t) = EMA over steps, decay lambda = exp(-1/tau), of  drop(t)
    drop(t) = max_{t' <= t} lr(t') / lr_peak  -  lr(t) / lr_peak

This is the LR-annealing law of Tissue et al. 2024 ("Scaling Law with Learning Rate Annealing",
L(s) = L0 + A * S1^-alpha - C * S2 with S1 the summed LR and S2 = sum_i m_i,
m_i = lambda * m_{i-1} + (lr_{i-1} - lr_i)) with three changes that let one law span a ladder:

- S1 counts tokens, weighted by the LR relative to the run's own peak. At constant LR S1 = D and
  S2 = 0, so the law *is* Chinchilla's L(N, D) there: the curves and the across-run fit
  (`laws.fit_chinchilla`) describe the same surface. Tokens rather than steps let rungs with different batch sizes
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
`DropTerms`), so its fits and bootstrap cost ~3-10x more (its search has an analytic gradient,
`DropTerms.drop_and_gradient`, without which they cost twice that). Which form is the default was decided on
real public curves by a rule fixed before scoring (docs/scaling-ladder.md, "Real public curves").
Rows before a run first reaches its peak LR are not fitted: neither law describes warmup.

Where the runs of one size differ in their peak LR (or batch), three candidate laws (issue 52) let the
absolute peak LR P (and the batch B, in tokens per step) in through one exponent rho in [0, 1], each run's
exposure x = (P / P_ref) (`lr_law="progress"`, `"convex"`) or (P / B) / (P / B)_ref (`"timescale"`):

- `progress`: S1 -> x^rho * S1 (a run at twice the LR makes up to twice the progress; Luo et al. and
  Tissue et al. sum the absolute LR).
- `convex`: S1 -> x^rho * S1 and C -> x^rho * C: the structure of the convex bound of Schaipp et al. 2025,
  a term in 1 / (gamma * sum eta) and one in gamma (the noise an anneal removes grows with the LR), so the
  peak LR has an optimum.
- `timescale`: as `progress` on P / B, the AdamW timescale's variable (Bergsma et al. 2025, tau = B /
  (eta * lambda * D), weight decay fixed): the LR and the batch enter only through their ratio.
- `noise` (issue 60): the noise an anneal removes, C, is present at the peak LR and scales with the noise
  temperature P / B: - C * S2 -> + C * x^rho * (1 - S2), S1 untouched. rho = 0 is the relative-LR law with its
  floor at E + C.

rho = 0 is the relative-LR law. A ladder whose every size has one exposure cannot tell rho from the size
term: the fit then falls back to the relative-LR law (`exposure_identified`) and says so.

`fit` fits it to a ladder's checkpoints; `bands` puts a band around it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import signal

from moelab.errors import DataError

__all__ = [
    "Run",
    "CurveLaw",
    "FORMS",
    "LR_LAWS",
    "TRANSIENT_FRACTION",
    "exposure",
    "exposure_identified",
    "effective_tokens",
    "anneal_drop",
    "anneal_drops",
    "DropTerms",
    "drop_terms",
    "multipower_drop",
    "past_warmup",
    "fitted_rows",
    "curve_loss",
    "curve_losses",
]

# A row counts as "at the peak LR" within this relative distance: CSVs print LRs rounded.
_PEAK_TOLERANCE = 1e-6
# Early training is not a power law: a small model's loss falls from ln(vocab) through plateaus and
# bumps (n-gram statistics, then induction) that no smooth S1^-beta follows, and least squares lets
# those rows bend the exponents. Rows before this share of a run's tokens are not fitted (they are
# still predicted and checked). Measured on benchmarks/schedule_fit.py's curves (tiny, 600 steps,
# one schedule left out from the other three of constant, cosine, WSD 10%): fitting from the peak
# LR on left an rmse of 0.024 and missed the WSD run's final loss by 5.5%; from 15% on, 0.006 and
# 0.5%. From 25% on changed little, from 35% on was worse (too few rows to pin the curvature).
TRANSIENT_FRACTION = 0.15
FORMS = ("tissue", "multipower")  # the annealing term's forms (`CurveLaw.form`)
LR_LAWS = ("relative", "progress", "convex", "timescale", "noise")  # how the peak LR and batch enter (`CurveLaw.lr_law`)
_SAME_EXPOSURE = 0.01  # exposures of one size within this relative distance count as one (CSV rounding)


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
    """L(N, t) = e + a * N^-alpha + b * (x^rho S1(t))^-beta - c [x^rho] * S2(t), or under `noise`
    e + a * N^-alpha + b * S1(t)^-beta + c * x^rho * (1 - S2(t)); see the module docstring."""

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
    # How the absolute peak LR (and batch) enter (module docstring): "relative" (not at all), or "progress",
    # "convex", "timescale" with exponent `rho` on the run's exposure over `exposure_ref`.
    lr_law: str = "relative"
    rho: float = 0.0
    exposure_ref: float = 1.0

    def exposure_factor(self, run: "Run") -> float:
        """x^rho: the run's exposure over the reference, to the law's exponent (1 under the relative-LR law)."""
        if self.lr_law == "relative":
            return 1.0
        return (exposure(run, self.lr_law) / self.exposure_ref) ** self.rho



def exposure(run: Run, lr_law: str) -> float:
    """The run's peak LR (`progress`, `convex`) or peak LR per token of batch (`timescale`, `noise`)."""
    peak = float(run.lr.max())
    if lr_law in ("timescale", "noise"):
        return peak / float(run.tokens[-1] / run.steps[-1])
    return peak


def exposure_identified(runs: Sequence[Run], lr_law: str) -> bool:
    """Whether some size's runs differ in exposure: only then can rho be told apart from the size term."""
    if lr_law == "relative":
        return False
    by_size: dict[float, list[float]] = {}
    for run in runs:
        by_size.setdefault(run.params, []).append(exposure(run, lr_law))
    return any(max(x) > (1 + _SAME_EXPOSURE) * min(x) for x in by_size.values())


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
    return anneal_drops(run, [tau])[0]


def anneal_drops(run: Run, taus: Sequence[float]) -> np.ndarray:
    """[K, R] `anneal_drop` for each delay in `taus`, with the run's drop profile computed once (the fit tabulates
    S2 over tau this way, `fit.FitRows`)."""
    drop, rows = _drop_profile(run), run.steps.astype(np.int64)
    return np.array([_ema(drop, tau)[rows] for tau in taus])


# The multi-power law's drop term sums over every step before a row; its steps are grouped in bins that grow
# geometrically with their distance back from the row, this many per doubling: within 1e-3 of the exact sum on
# cosine and WSD runs at the dev cases' parameters, at ~30 bins a row instead of up to 10^5 steps.
_BINS_PER_DOUBLING = 4


@dataclass(frozen=True, eq=False)
class DropTerms:
    """Every (row, bin) pair with LR drop in it: what `multipower_drop` sums, independent of the law's parameters.

    Built by `drop_terms`; the fit builds it once for its rows and evaluates it at every point of its search.
    """

    row: np.ndarray  # [P] the row each pair belongs to
    mass: np.ndarray  # [P] the drop of relative LR within the bin
    lr: np.ndarray  # [P] relative LR at the bin's drop-weighted centre (floored: the LR after a drop to 0)
    area: np.ndarray  # [P] relative-LR steps from the bin's centre to the row: S_k(t) of Luo et al.
    num_rows: int

    def drop(self, tau: float, power: float, gamma: float) -> np.ndarray:
        """[rows] LD(t) / B: sum over bins of mass * (1 - (1 + lr^-gamma * area / tau)^-power)."""
        settled = 1.0 - (1.0 + self.lr ** -gamma * self.area / tau) ** -power
        return np.bincount(self.row, weights=self.mass * settled, minlength=self.num_rows)

    def drop_and_gradient(self, tau: float, power: float, gamma: float) -> np.ndarray:
        """[4, rows]: `drop`, then its derivatives in (log tau, log power, gamma), for the multi-power fit's
        analytic gradient (`fit.sse_and_gradient`). With u = lr^-gamma * area / tau and G = 1 - (1 + u)^-power:
        dG/dlog tau = -power u (1 + u)^-(power + 1), dG/dgamma = log(lr) times that, and
        dG/dlog power = power log(1 + u) (1 + u)^-power.
        """
        log_lr = np.log(self.lr)
        u = np.exp(-gamma * log_lr) * self.area / tau
        log1p_u = np.log1p(u)
        tail = np.exp(-power * log1p_u)
        slope = power * u * tail / (1.0 + u)
        parts = (1.0 - tail, -slope, power * log1p_u * tail, -log_lr * slope)
        return np.stack([np.bincount(self.row, weights=self.mass * g, minlength=self.num_rows) for g in parts])

    @staticmethod
    def concat(parts: Sequence["DropTerms"]) -> "DropTerms":
        """One `DropTerms` whose rows are `parts`' rows in order (several runs' rows as one fit reads them)."""
        offsets = np.cumsum([0] + [p.num_rows for p in parts[:-1]])
        return DropTerms(np.concatenate([p.row + o for p, o in zip(parts, offsets)]),
                         np.concatenate([p.mass for p in parts]), np.concatenate([p.lr for p in parts]),
                         np.concatenate([p.area for p in parts]), int(sum(p.num_rows for p in parts)))


def drop_terms(run: Run, picks: np.ndarray) -> DropTerms:
    """The multi-power drop sum's bins at the steps `picks` of `run` (geometric in the distance back from each).

    `picks`: whole optimizer steps of `run`'s rows (int64), e.g. `run.steps[fitted_rows(run)].astype(np.int64)`.
    """
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
    return DropTerms(rows, mass, lr, np.maximum(since, 0.0), len(picks))


def multipower_drop(run: Run, tau: float, power: float, gamma: float) -> np.ndarray:
    """[R] the multi-power law's loss drop per unit B at each row (Luo et al. 2025, "A Multi-Power Law for Loss
    Curve Prediction Across Learning Rate Schedules", eq. 5), on LR relative to the run's peak:

        LD(t) / B = sum over steps k <= t of (eta_{k-1} - eta_k) * G(eta_k^-gamma * S_k(t)),
        G(x) = 1 - (1 + x / tau)^-power,  S_k(t) = sum of eta over steps k..t,

    with eta's drop taken below its running peak (warmup adds nothing, as for `anneal_drop`). Once a drop
    has settled G = 1 and the sum is the drop itself, so B reads like the Tissue form's C.
    """
    return drop_terms(run, run.steps.astype(np.int64)).drop(tau, power, gamma)


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
    terms = drop_terms(run, picks) if any(law.form == "multipower" for law in laws) else None
    out = np.empty((len(laws), len(s1)))
    for i, law in enumerate(laws):
        x = law.exposure_factor(run)
        progress = 1.0 if law.lr_law == "noise" else x  # x^rho on S1, except under `noise`
        data_term = np.where(s1 > 0, law.b * (progress * safe_s1)**-law.beta, np.nan)
        anneal = (terms.drop(law.tau, law.power, law.gamma) if law.form == "multipower"
                  else _ema(drop, law.tau)[picks])
        gain = law.c * (x if law.lr_law in ("convex", "noise") else 1.0)
        noise = gain * (1.0 - anneal) if law.lr_law == "noise" else -gain * anneal
        out[i] = law.e + law.a * run.params**-law.alpha + data_term + noise
    return out


def _check_size(law: CurveLaw, run: Run) -> None:
    if law.size is not None and abs(run.params / law.size - 1) > 1e-9:
        raise DataError(f"run {run.name!r} has params={run.params:g}, but the law was fitted on curves of one size, "
                        f"params={law.size:g}: it predicts new schedules for that size only. Fit curves of at least "
                        "2 sizes to predict another size.")


def curve_loss(law: CurveLaw, run: Run) -> np.ndarray:
    """[R] the law's loss at each row of `run`; NaN where S1 = 0 (before any training)."""
    return curve_losses([law], run)[0]

