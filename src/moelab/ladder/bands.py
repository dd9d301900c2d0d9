"""Bands and noise: how far a new run strays from the curve law, and the band that follows.

Bands come from `bootstrap_curve_law`, a two-level residual bootstrap: every resample keeps every
run at its own size and redraws its residuals as one run offset (resampled across runs) plus the
run's own within-run residual curve with a random sign, then refits; `predict_with_bands` adds each
new run's own noise (`CurveBootstrap.run_sd`, `checkpoint_sd`). Checkpoints of one run share a seed, data
order and fit error, so they are never resampled one by one. Small rungs stray further from the law
than large ones, and a run strays further early than late: where the runs show it, the fit weights
each run by how its residuals shrink with N and the bands scale a new run's noise to its size
(`fit.fit_curve_law`, `fit.noise_scale`) and its checkpoint noise to each row's progress through the run
(`bootstrap_curve_law`, `checkpoint_scale`).

Bands: the predictive distribution at a row is an equal-weight mixture over the bootstrap refits,
each refit's prediction plus the new run's own noise, run_sd * t(run_dof) + checkpoint_sd *
t(checkpoint_dof) (`CurveBootstrap`), scaled to the new run's size where the fit is weighted
(`fit.noise_scale`), the checkpoint term also to the row's progress through the run where the runs
stray further early (`checkpoint_scale`). Student t rather than Gaussian because run_sd comes from a
handful of runs. On 40 synthetic 6-run ladders (about 2.4 dof) x 10 held-out runs, the Gaussian 95%
band covered 84.6% of rows on average and under 90% on 45% of the ladders (those whose run_sd came
out low); the t band covers 91.0% on average and under 90% on 22.5% of them. Both fall short because
an sd from 2-3 dof is often low; the t errs less, and too wide is the better error for a monitor
whose misses raise incidents. lo/hi are the mixture's 2.5/10/90/97.5% quantiles, found by bisection
on its CDF. `loss_pred` is the full-data fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import optimize, signal, special

from moelab.errors import DataError
from moelab.ladder import NUM_BOOTSTRAP
from moelab.ladder.contract import INTERVAL_COLUMNS
from moelab.ladder.curve import TRANSIENT_FRACTION, CurveLaw, Run, curve_loss, curve_losses, fitted_rows, past_warmup
from moelab.ladder.fit import fit_rows, measure_noise, noise_scale, tabulate_rows, warm_start

__all__ = [
    "PROGRESS_EDGES",
    "CurveBootstrap",
    "progress_bin",
    "checkpoint_scale",
    "bootstrap_curve_law",
    "SharedNoise",
    "shared_noise",
    "predict_with_bands",
    "score",
]

# The law's misfit within a run falls as the run leaves its transient: on our CPU ladders the within-run
# residuals were ~3x larger at 20% of a run's tokens than from 45% on. The bootstrap measures that
# profile on these bins of run progress (tokens / the run's last tokens) over the fitted span; a row
# before the first edge takes the first bin's scale.
PROGRESS_EDGES = tuple(float(x) for x in np.linspace(TRANSIENT_FRACTION, 1.0, 9))
_MIN_ROWS_PER_BIN = 10  # fewer fitted rows in any bin: the profile is too noisy to use, and stays flat
_QUANTILES = {"lo95": 0.025, "lo80": 0.10, "hi80": 0.90, "hi95": 0.975}


@dataclass(frozen=True)
class CurveBootstrap:
    """Refits on resampled residuals, plus the noise a new run adds on top of the law.

    A new run's loss at a row = the law + its own offset u (seed, data order, how its shape sits off
    the size law; shared by all its rows) + checkpoint noise e. run_sd and checkpoint_sd estimate
    the sds of u and e from the full-data residuals, with the degrees of freedom the fit left
    (`fit.variance_components`): R - 3 and n - R - 4 when E, A and alpha absorb three run levels and
    B, beta, C and tau nothing else, fewer runs' worth when the law's other terms also absorb run
    levels, more when a parameter sits on its bound. The dofs matter: `predict_with_bands` draws u and e from
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
    rows = replace(tabulate_rows(runs, law.form, law.lr_law), noise_exponent=law.noise_exponent, noise_ref=law.noise_ref,
                   prior_weight=law.prior_weight)
    predicted, residuals, (run_var, run_dof, checkpoint_var, checkpoint_dof) = measure_noise(rows, law)
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
    start = warm_start(law)
    laws = []
    for _ in progress(range(num_samples)):
        draws, signs = rng.choice(run_draws, len(residuals)), rng.choice([-1.0, 1.0], len(residuals))
        noise = np.concatenate([u + sign * shrink * w for u, sign, w in zip(draws, signs, within)])
        laws.append(fit_rows(replace(rows, loss=predicted + scale * noise), start))
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
    (shared_var + own_var / k). Read by moments over the fitted rows, like `fit.variance_components`:
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


# ----------------------------------------------------------------------------------------------
# bands


def _noise_cdf(bootstrap: CurveBootstrap, params: float, progress_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(x, G(x)) on a grid: the CDF of a new run's noise, (run_sd * t(run_dof) + progress_scale * checkpoint_sd *
    t(checkpoint_dof)) times the noise scale of a run of `params` (`CurveBootstrap.noise_scale`).

    Each term's probability mass per grid bin comes from its CDF; the sum's mass is their discrete
    convolution. Bins are 1/8 of the narrower sd (one below 1% of the other is left out: it cannot
    move a quantile visibly) and the grid spans both terms' 0.01% tails.
    """
    scale = bootstrap.noise_scale(params)
    terms = [(max(scale * progress_scale * bootstrap.checkpoint_sd, 1e-9), bootstrap.checkpoint_dof)]  # keeps a CDF
    if bootstrap.run_dof > 0:
        terms.append((scale * bootstrap.run_sd, bootstrap.run_dof))
    largest = max(sd for sd, _ in terms)
    terms = [(sd, dof) for sd, dof in terms if sd >= 0.01 * largest]
    width = min(sd for sd, _ in terms) / 8
    half = int(math.ceil(sum(sd * special.stdtrit(dof, 0.9999) for sd, dof in terms) / width))
    x = width * np.arange(-half, half + 1)
    masses = [special.stdtr(dof, (x + width / 2) / sd) - special.stdtr(dof, (x - width / 2) / sd) for sd, dof in terms]
    mass = masses[0] if len(masses) == 1 else signal.fftconvolve(masses[0], masses[1], mode="same")
    return x + width / 2, np.clip(np.cumsum(mass), 0.0, 1.0)


def _mixture_quantiles(centres: np.ndarray, noise: tuple[np.ndarray, np.ndarray],
                       probs: Sequence[float]) -> np.ndarray:
    """[P, R] quantiles, per row r, of the equal-weight mixture over b of centres[b, r] + noise."""
    x, cdf = noise
    out = np.empty((len(probs), centres.shape[1]))
    for start in range(0, centres.shape[1], 2048):  # bounds the [B, rows] temporaries
        block = centres[:, start:start + 2048]
        for k, p in enumerate(probs):
            lo, hi = block.min(0) + x[0], block.max(0) + x[-1]
            for _ in range(50):  # halves the bracket to ~1e-15 of its width
                mid = (lo + hi) / 2
                below = np.interp(mid - block, x, cdf).mean(0) < p
                lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
            out[k, start:start + 2048] = (lo + hi) / 2
    return out


def predict_with_bands(law: CurveLaw, bootstrap: CurveBootstrap, run: Run,
                       shared: SharedNoise | None = None) -> dict[str, np.ndarray]:
    """`contract.BAND_COLUMNS` -> [R] arrays for each row of `run`; see the module docstring.

    With `shared` (`shared_noise`: `run` trains on the curves' seed and data order) each row also
    borrows what those runs share at its step; the band keeps its width (`SharedNoise` says why).
    """
    borrowed = shared.at(run.steps) if shared is not None else 0.0
    centres = curve_losses(bootstrap.laws, run) + borrowed
    levels = bootstrap.checkpoint_scale(run.tokens / run.tokens[-1])  # a few distinct values, one per progress bin
    quantiles = np.empty((len(_QUANTILES), len(levels)))
    for level in np.unique(levels):
        rows = levels == level
        quantiles[:, rows] = _mixture_quantiles(centres[:, rows], _noise_cdf(bootstrap, run.params, float(level)),
                                                list(_QUANTILES.values()))
    # A cross-entropy is never negative: the additive noise model's tail below 0 (a band resting on
    # one or two degrees of freedom reaches there) is mass at 0, so quantiles there read 0.
    bands = {k: np.maximum(q, 0.0) for k, q in zip(_QUANTILES, quantiles)}
    unknown = np.isnan(centres).any(0)  # rows before any tokens: the law has no value there
    return {"loss_pred": curve_loss(law, run) + borrowed,
            **{k: np.where(unknown, np.nan, bands[k]) for k in INTERVAL_COLUMNS}}


def score(bands: dict[str, np.ndarray], run: Run) -> dict:
    """A prediction's `bands` (`predict_with_bands`) against `run`'s observed losses, row for row.

    final_error is signed ((predicted - actual) / actual at the last row); the MAPE and the band's
    coverage count the rows after the first 10% of the run's tokens, where the law is meant to hold.
    """
    late = (run.tokens >= 0.1 * run.tokens[-1]) & np.isfinite(bands["loss_pred"])
    actual, pred = run.loss[late], bands["loss_pred"][late]
    inside = (bands["lo95"][late] <= actual) & (actual <= bands["hi95"][late])
    final = float(run.loss[-1])
    return {"final_actual": final, "final_predicted": float(bands["loss_pred"][-1]),
            "final_lo95": float(bands["lo95"][-1]), "final_hi95": float(bands["hi95"][-1]),
            "final_error": float(bands["loss_pred"][-1] - final) / final,
            "mape_after_10pct": float(np.mean(np.abs(pred - actual) / actual)),
            "band95_coverage": float(np.mean(inside)), "evals_scored": int(late.sum())}

