"""The law's own misfit, measured on runs it did not see and carried into every band.

The bootstrap band (`bands.bootstrap_curve_law`, `bands.predict_with_bands`) holds run and
checkpoint noise and the fit's uncertainty, but not the law's error where it extrapolates: on real
public curves (docs/scaling-ladder.md, "Real public curves") its 95% band held 17-78% of the
targets' evals while the self-check passed. So the law is refitted on part of the curves and
predicts the rest, the way the target is predicted from all of them (`held_out_splits`):

- 3 or more sizes: leave size out, forward. Each of the largest sizes (up to `MAX_SPLITS`) is
  predicted from every smaller size: an extrapolation in N, as to the target.
- one size whose runs end at different horizons: leave horizon out. The runs at the longest
  horizon are predicted from the runs that end at most `HORIZON_GAP` of it: an extrapolation in
  tokens, as to a longer target.
- one size, one horizon, 3 or more runs: leave schedule out. Each run is predicted from the others.
- otherwise (two sizes, one horizon): every run is cut at half its tokens, and its second half
  predicted from the first halves of all runs.

Seeds of one held-out configuration (size, steps, tokens and LR alike) are averaged before they are
scored (`seed_means`): the target's band already holds a new run's own offset (the bootstrap's run_sd),
and a single seed's miss holds that offset on top of the law's, so scoring seeds one by one would count
it twice. On ladder-cpu's five d80 seeds (final misses -1.0% to -3.6%, mean -2.0%) that took the target's
band from +-5.1% to +-4.0%; on Pythia's seeds from +-3.2% to +-3.0% (docs/scaling-ladder.md).

Each held-out row's relative error (y - y_hat) / y_hat is one score; the band's relative half-width
at coverage p gains the misfit q_p, the weighted p-quantile of |score| (each held-out run weighs the
same: its rows are one seed, one data order and one fit error), added in quadrature:

    half'(p) = sqrt(half_bootstrap(p)^2 + (q_p * y_hat)^2)

This is split-conformal calibration (Vovk et al. 2005; Lei et al. 2018, "Distribution-free
predictive inference for regression") with the held-out fits as the calibration set, used as an
extra, independent error term rather than as the whole band: the bootstrap still sizes the noise of
rows the held-out splits say little about (a new size's own offset, early evals). The quantile is
not inflated for the finite sample (ceil((n + 1) p) / n of 6 runs is over 1 at p = 0.95): rows of a
run are correlated, so the guarantee would be loose anyway, and the benchmark measures coverage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from moelab.errors import DataError
from moelab.ladder.bands import shared_noise
from moelab.ladder.curve import CurveLaw, Run, curve_loss
from moelab.ladder.fit import fit_curve_law

__all__ = ["MAX_SPLITS", "HORIZON_GAP", "Misfit", "held_out_splits", "seed_means", "measure_misfit", "widen"]

MAX_SPLITS = 3  # leave-size-out refits: the largest sizes, each from all smaller ones; more cost more fits
HORIZON_GAP = 0.75  # leave-horizon-out fits on runs ending at most this share of the longest horizon's tokens
_SAME_HORIZON = 0.9  # runs ending within this share of the longest horizon are held out with it
_SCORED_FROM = 0.1  # held-out rows are scored past this share of the run's tokens (`bands.score`)


@dataclass(frozen=True, eq=False)
class Misfit:
    """What refits on part of the curves missed on the rest: each held-out row's |relative error| and how far
    its split extrapolated (`distance`, in log N for leave-size-out, log tokens for leave-horizon-out)."""

    scheme: str  # "leave-size-out", "leave-horizon-out", "leave-schedule-out" or "second-half"
    scores: np.ndarray  # [n] |y - y_hat| / y_hat of every scored held-out row
    weights: np.ndarray  # [n] each held-out run's rows sum to 1
    distances: np.ndarray  # [n] log(held-out size / largest fitted size), or tokens likewise; else 0
    reach: float  # the largest params (or last tokens) of all the curves: where the target's distance starts
    held_out: tuple[str, ...]  # the runs predicted
    final_errors: tuple[float, ...]  # each held-out run's signed relative error at its last row

    def distance_of(self, run: Run) -> float:
        """How far `run` lies beyond the curves on the split's axis (log units; 0 where the splits have no axis)."""
        if self.scheme == "leave-size-out":
            return math.log(run.params / self.reach)
        if self.scheme == "leave-horizon-out":
            return math.log(run.tokens[-1] / self.reach)
        return 0.0

    def quantile(self, p: float, distance: float = 0.0) -> float:
        """q_p: the weighted p-quantile of the scores, each grown by max(1, distance / its split's distance)."""
        grow = np.maximum(1.0, distance / np.where(self.distances > 0, self.distances, np.inf))
        return _weighted_quantile(self.scores * grow, self.weights, p)

    def as_json(self, distance: float = 0.0) -> dict:
        return {"scheme": self.scheme, "q80": self.quantile(0.8, distance), "q95": self.quantile(0.95, distance),
                "target_distance": distance, "held_out": list(self.held_out),
                "final_errors": list(self.final_errors), "rows": int(len(self.scores))}


def _cut(run: Run, share: float) -> Run:
    keep = run.tokens <= share * run.tokens[-1]
    return replace(run, steps=run.steps[keep], tokens=run.tokens[keep], lr=run.lr[keep], loss=run.loss[keep])


def held_out_splits(runs: Sequence[Run]) -> tuple[str, list[tuple[list[Run], list[Run]]]]:
    """(scheme, [(runs to fit, runs to predict)]): the refits that measure the law's misfit (module docstring)."""
    sizes = sorted({r.params for r in runs})
    if len(sizes) >= 3:
        splits = [([r for r in runs if r.params < size], [r for r in runs if r.params == size])
                  for size in sizes[max(2, len(sizes) - MAX_SPLITS):]]
        return "leave-size-out", splits
    horizon = max(r.tokens[-1] for r in runs)
    shorter = [r for r in runs if r.tokens[-1] <= HORIZON_GAP * horizon]
    if len(sizes) == 1 and shorter:
        return "leave-horizon-out", [(shorter, [r for r in runs if r.tokens[-1] >= _SAME_HORIZON * horizon])]
    if len(sizes) == 1 and len(runs) >= 3:
        return "leave-schedule-out", [([r for r in runs if r is not run], [run]) for run in runs]
    # the largest size only is scored: the nearest to the target, as in the self-check (small runs stray more)
    return "second-half", [([_cut(r, 0.5) for r in runs], [r for r in runs if r.params == sizes[-1]])]


def seed_means(runs: Sequence[Run]) -> list[Run]:
    """`runs` with the seeds of one configuration (size, steps, tokens and LR alike) averaged into one run."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.params, run.steps.tobytes(), run.tokens.tobytes(), run.lr.tobytes()), []).append(run)
    return [seeds[0] if len(seeds) == 1 else
            replace(seeds[0], name=f"{seeds[0].name} (mean of {len(seeds)} seeds)",
                    loss=np.mean([r.loss for r in seeds], axis=0)) for seeds in groups.values()]


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][min(int(np.searchsorted(cumulative, p)), len(values) - 1)])


def measure_misfit(runs: Sequence[Run], fit: Callable[[Sequence[Run]], CurveLaw] = fit_curve_law,
                   same_data_order: bool = False) -> Misfit:
    """Refit on each split of `held_out_splits` and score the held-out rows; see the module docstring.

    `same_data_order`: the held-out runs borrow the noise the fitted runs share at each step
    (`bands.shared_noise`), as the target does. DataError when no held-out run has a row to score.
    """
    scheme, splits = held_out_splits(runs)
    scores, weights, distances, names, finals = [], [], [], [], []
    for fitted, held in splits:
        try:
            law = fit(fitted)
        except DataError:  # too few rows or runs left to fit: this split says nothing
            continue
        shared = shared_noise(fitted, law) if same_data_order else None
        for run in seed_means(held):
            predicted = curve_loss(law, run) + (shared.at(run.steps) if shared is not None else 0.0)
            scored = (run.tokens >= _SCORED_FROM * run.tokens[-1]) & np.isfinite(predicted)
            if scheme == "second-half":
                scored &= run.tokens > 0.5 * run.tokens[-1]
            if not scored.any():
                continue
            relative = (run.loss - predicted)[scored] / predicted[scored]
            if scheme == "leave-size-out":
                distance = math.log(run.params / max(r.params for r in fitted))
            elif scheme == "leave-horizon-out":
                distance = math.log(run.tokens[-1] / max(r.tokens[-1] for r in fitted))
            else:
                distance = 0.0
            scores.append(np.abs(relative))
            weights.append(np.full(len(relative), 1.0 / len(relative)))
            distances.append(np.full(len(relative), distance))
            names.append(run.name)
            finals.append(float(-relative[-1] / (1 + relative[-1])))  # (pred - y) / y, as `bands.score`
    if not scores:
        raise DataError(f"{scheme}: no split left enough rows to refit, or no held-out row to score.")
    reach = max(r.params for r in runs) if scheme == "leave-size-out" else max(r.tokens[-1] for r in runs)
    return Misfit(scheme, np.concatenate(scores), np.concatenate(weights), np.concatenate(distances), float(reach),
                  tuple(names), tuple(finals))


def widen(bands: dict[str, np.ndarray], misfit: Misfit, run: Run) -> dict[str, np.ndarray]:
    """`bands` of `run` (`bands.predict_with_bands`) with each half-width grown by the misfit, in quadrature."""
    centre, distance = bands["loss_pred"], misfit.distance_of(run)
    out = dict(bands)
    for p, lo, hi in ((0.8, "lo80", "hi80"), (0.95, "lo95", "hi95")):
        extra = (misfit.quantile(p, distance) * centre) ** 2
        out[lo] = np.maximum(centre - np.sqrt((centre - bands[lo]) ** 2 + extra), 0.0)
        out[hi] = centre + np.sqrt((bands[hi] - centre) ** 2 + extra)
    return out
