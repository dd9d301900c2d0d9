"""The law's schedule-shaped miss, read off the curves and carried into the live forecast (issue 60).

The curve law misses a run in a pattern its schedule sets, not by one constant: on sp-size-360m the cosine
targets sit 0.9% below the prediction at half their steps and 1.7% below at the end; the WSD-20% ones 1.8%
below before their cooldown and on it at the end (docs/scaling-ladder.md, "The live forecast"). So a forecast
that carries a run's present offset to its end (`forecast.ForecastFinal` alone) misses by the change of the
offset still to come: after 50% of the steps it missed the dev cases' finals by 0.6-1.6%, more than the
prediction made before the run.

The curves ran the same schedule shapes at smaller sizes, and the law, fitted to them, leaves the same
pattern in their residuals. The *drift* of a run seen up to fraction f of its steps is how far its residual
moves from where it stands then to its last eval:

    drift(f) = r(T) - r~(f),   r = loss / law - 1,   r~(f) the forecast's own weighted mean of r over the
                                                      fitted evals up to f (`forecast.recent_mean`)

and a target's expected drift is that of its *analogs*: the curves (seeds averaged, `calibrate.seed_means`) at
the largest size whose LR schedule, on the axis of the fraction of steps, is nearest the target's (mean
|difference of relative LR| within `SAME_SHAPE` of the nearest). Its sd is the spread of the analogs' drifts at
the two largest sizes about that mean, grown as the target lies further beyond them than they lie apart (in
log N; in log steps on curves of one size), as `calibrate` grows its misfit.

Two methods (`METHODS`), fixed before scoring and chosen by the rule of docs/scaling-ladder.md:

- `analog`: the largest size's analogs' mean drift.
- `analog-size`: that, moved along log N by the change from the second-largest size's analogs to the largest's
  (the pattern grows with size on sp-size-*; a guess beyond the curves, so its sd adds that move).

`offset` is the forecast without a drift (before issue 60). `fit_curves` writes every method's table per target
run into the sidecar (`tables`), on `FRACTIONS`; the live forecast reads the one `DEFAULT_FORECAST` names.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moelab.ladder.calibrate import seed_means
from moelab.ladder.curve import CurveLaw, Run, curve_loss, fitted_rows
from moelab.ladder.forecast import recent_mean

__all__ = ["METHODS", "DEFAULT_FORECAST", "FRACTIONS", "SAME_SHAPE", "Drift", "lr_shape", "tables"]

METHODS = ("offset", "analog", "analog-size")
DEFAULT_FORECAST = "analog"  # chosen by the rule of docs/scaling-ladder.md, "The live forecast, measured"
FRACTIONS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # of a run's steps: where the tables are kept
SAME_SHAPE = 0.02  # mean |relative LR difference| within which a curve's schedule is as near as the nearest's
_SHAPE_POINTS = 101  # where two schedules are compared: fractions 0, 0.01, ..., 1 of each run's steps


@dataclass(frozen=True)
class Drift:
    """A target run's expected drift and its sd at each of `fractions` (NaN before any analog has a fitted eval)."""

    fractions: tuple[float, ...]
    mean: tuple[float, ...]
    sd: tuple[float, ...]
    analogs: tuple[str, ...]

    def at(self, fraction: float) -> tuple[float, float]:
        """(drift, sd) at `fraction` of the run's steps, linear between the table's fractions; (0, 0) where the
        table says nothing (before its first value, or NaN)."""
        known = np.isfinite(self.mean)
        if not known.any() or fraction < self.fractions[int(np.argmax(known))]:
            return 0.0, 0.0
        xs = np.asarray(self.fractions)[known]
        return (float(np.interp(fraction, xs, np.asarray(self.mean)[known])),
                float(np.interp(fraction, xs, np.asarray(self.sd)[known])))

    def as_json(self) -> dict:
        return {"mean": [None if math.isnan(v) else v for v in self.mean],
                "sd": [None if math.isnan(v) else v for v in self.sd], "analogs": list(self.analogs)}

    @classmethod
    def from_json(cls, table: dict, fractions: Sequence[float]) -> "Drift":
        """The table `as_json` wrote; ValueError for one of another length or with a negative sd."""
        mean = tuple(math.nan if v is None else float(v) for v in table["mean"])
        sd = tuple(math.nan if v is None else float(v) for v in table["sd"])
        if len(mean) != len(fractions) or len(sd) != len(fractions) or any(v < 0 for v in sd if not math.isnan(v)):
            raise ValueError(f"drift table of {len(mean)}/{len(sd)} values for {len(fractions)} fractions")
        return cls(tuple(float(f) for f in fractions), mean, sd, tuple(str(n) for n in table.get("analogs", [])))


def lr_shape(run: Run) -> np.ndarray:
    """[101] the run's LR relative to its peak at fractions 0, 0.01, ..., 1 of its steps: its schedule's shape."""
    return np.interp(np.linspace(0.0, 1.0, _SHAPE_POINTS) * run.steps[-1], run.steps, run.lr / run.lr.max())


def _drifts(run: Run, law: CurveLaw) -> np.ndarray:
    """[len(FRACTIONS)] the run's own drift r(T) - r~(f) at each fraction; NaN before its first fitted eval."""
    residual = run.loss / curve_loss(law, run) - 1.0
    fitted = fitted_rows(run)
    out = np.full(len(FRACTIONS), np.nan)
    for i, f in enumerate(FRACTIONS):
        seen = fitted & (run.steps <= f * run.steps[-1])
        if seen.any():
            out[i] = residual[-1] - recent_mean(residual[seen])
    return out


def _analogs(target: Run, runs: Sequence[Run]) -> list[Run]:
    """The runs whose schedule shape is nearest the target's (within SAME_SHAPE of the nearest)."""
    shape = lr_shape(target)
    distance = np.array([np.mean(np.abs(lr_shape(r) - shape)) for r in runs])
    return [r for r, d in zip(runs, distance) if d <= distance.min() + SAME_SHAPE]


def tables(curves: Sequence[Run], law: CurveLaw, targets: Sequence[Run]) -> dict[str, dict[str, Drift]]:
    """{target run: {method: its Drift}} for the `METHODS` with a drift, from `law` fitted on `curves`."""
    means = seed_means(curves)
    sizes = sorted({r.params for r in means})
    top = [r for r in means if r.params == sizes[-1]]
    second = [r for r in means if len(sizes) > 1 and r.params == sizes[-2]]
    out = {}
    for target in targets:
        near = _analogs(target, top)
        d1 = np.array([_drifts(r, law) for r in near])
        d0 = np.array([_drifts(r, law) for r in _analogs(target, second)]) if second else d1
        with warnings.catch_warnings():  # nanmean of an all-NaN column (before any fitted eval) is NaN, as meant
            warnings.simplefilter("ignore", RuntimeWarning)
            mean1 = np.nanmean(d1, axis=0)
            spread = np.sqrt(np.nanmean((np.concatenate([d1, d0]) - mean1) ** 2, axis=0))
            slope = np.zeros_like(mean1)
            if second:
                apart = math.log(sizes[-1] / sizes[-2])
                slope = (mean1 - np.nanmean(d0, axis=0)) / apart
                beyond = math.log(target.params / sizes[-1])
            else:  # one size: the analogs differ in horizon, and the target may run longer than any of them
                steps = sorted({r.steps[-1] for r in near})
                apart = math.log(steps[-1] / steps[0]) if len(steps) > 1 else 0.0
                beyond = math.log(target.steps[-1] / steps[-1])
        grow = max(1.0, beyond / apart) if apart > 0 else 1.0
        names = tuple(r.name for r in near)
        out[target.name] = {
            "analog": Drift(FRACTIONS, tuple(mean1), tuple(spread * grow), names),
            "analog-size": Drift(FRACTIONS, tuple(mean1 + slope * max(beyond, 0.0) if second else mean1),
                                 tuple(np.hypot(spread * grow, slope * max(beyond, 0.0)) if second else spread * grow),
                                 names)}
    return out

