"""A live forecast of a run's final loss: the ladder's prediction as the prior, the run's evals as data.

The pre-registered band (PRED.csv) is the hypothesis and never moves. Beside it, each eval updates a
forecast of the final loss. The model: the run sits a constant relative offset rho off the
predicted curve, loss(t) = pred(t) * (1 + rho), and each eval sees it through noise,

    rho ~ N(0, s0^2)                   s0 = the prediction's own 95% half-width at the final step / 1.96,
                                             relative to loss_pred there (what the ladder knew)
    r_j = loss_j / pred_j - 1 = rho + e_j,   e_j ~ N(0, s_e^2)

so the posterior of rho is Gaussian with precision 1/s0^2 + sum_j w_j / s_e^2 and mean
sum_j w_j r_j / s_e^2 over it (a conjugate normal update). Relative, because a healthy run's
residuals scale with its loss: early evals are larger and noisier in absolute terms. The weights
w_j = 2^-(age_j / HALF_LIFE) discount older evals: a run that drifts (an LR too low closes part of
its gap, a spike opens one) is judged by where it is now, and the evidence never counts as more than
~HALF_LIFE / ln 2 + 1 evals, so the forecast keeps the per-eval noise in its band. s_e is the fit's
checkpoint noise relative to the final loss when the prediction's sidecar JSON has it (`noise`),
else s0: one eval is worth as much as the whole ladder. The checkpoint noise may be given per planned
step (s_e,j, interpolated to each eval's step): a run's early evals stray further from the law than
its late ones, so they pull the forecast less (precision 1/s0^2 + sum_j w_j / s_e,j^2, mean
sum_j w_j r_j / s_e,j^2 over it).

    forecast = ForecastFinal(pred_steps, loss_pred, lo95_final, hi95_final, checkpoint_sd)
    forecast.update(step, loss)   # -> {"forecast/final": ..., "forecast/lo95": ..., "forecast/hi95": ...}

A forecast outside [lo95, hi95] of the final step says the run will likely end off its hypothesis,
usually long before its own evals have left the per-step band twice in a row.

The offset still moves after the eval: the law's miss has a shape its schedule sets (`drift`), so with a
`drift` table (the sidecar's, measured on the curves by `drift.tables`) the forecast adds the drift expected from
the eval's fraction of the steps to the end, and its sd to the band (in quadrature):

    final = pred_T * (1 + rho_post + drift(f)),   half95 = 1.96 * sqrt(post_sd^2 + drift_sd(f)^2)

At the final step the final loss has been measured: the forecast is that eval, with the eval's own noise as
its band (issue 54: the demo's last line forecast 1.767 beside an observed 1.8035, the prior still pulling).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["HALF_LIFE", "recent_weights", "recent_mean", "ForecastFinal"]

HALF_LIFE = 2.0  # evals: an eval's weight halves every 2 evals after it
_Z95 = 1.959963984540054


def recent_weights(count: int) -> np.ndarray:
    """[count] each eval's weight by its age, oldest first: halves every HALF_LIFE evals after it."""
    return 0.5 ** (np.arange(count)[::-1] / HALF_LIFE)


def recent_mean(residuals: np.ndarray) -> float:
    """The residuals' mean weighted by age as the forecast weighs evals of equal noise (`drift` measures from it)."""
    weights = recent_weights(len(residuals))
    return float(weights @ residuals / weights.sum())


class ForecastFinal:
    """The posterior of a run's final loss after each eval; see the module docstring."""

    def __init__(self, steps: Sequence[float], loss_pred: Sequence[float], lo95: float, hi95: float,
                 checkpoint_sd: float | Sequence[float] | None = None, drift=None):
        self.drift = drift  # a `drift.Drift` (anything with at(fraction) -> (mean, sd)), or None: no drift
        self._steps = np.asarray(steps, dtype=np.float64)
        self._pred = np.asarray(loss_pred, dtype=np.float64)
        self.final_pred, self.lo95, self.hi95 = float(self._pred[-1]), float(lo95), float(hi95)
        self.prior_sd = max((self.hi95 - self.lo95) / (2 * _Z95) / self.final_pred, 1e-9)
        sd = np.broadcast_to(np.asarray(checkpoint_sd if checkpoint_sd is not None else 0.0, dtype=np.float64),
                             self._steps.shape)
        self._eval_sd = np.where(sd > 0, sd / self.final_pred, self.prior_sd)  # per planned step, relative
        self.eval_sd = float(self._eval_sd[-1])  # at the final step
        self._residuals: list[float] = []
        self._variances: list[float] = []

    def update(self, step: int, loss: float) -> dict[str, float]:
        """Take one eval (a non-finite loss is skipped); the forecast and its 95% band after it."""
        pred = float(np.interp(step, self._steps, self._pred))
        if math.isfinite(loss) and math.isfinite(pred) and pred > 0:
            self._residuals.append(loss / pred - 1.0)
            self._variances.append(float(np.interp(step, self._steps, self._eval_sd)) ** 2)
        if step >= self._steps[-1] and math.isfinite(loss):  # the final eval: nothing left to forecast
            noise = _Z95 * self.eval_sd * loss
            return {"forecast/final": float(loss), "forecast/lo95": loss - noise, "forecast/hi95": loss + noise}
        weights = recent_weights(len(self._residuals)) / np.asarray(self._variances)
        precision = 1.0 / self.prior_sd**2 + weights.sum()
        offset = float(weights @ np.asarray(self._residuals)) / precision if self._residuals else 0.0
        half = _Z95 / math.sqrt(precision)
        if self.drift is not None and self._residuals:
            drift, sd = self.drift.at(step / self._steps[-1])
            offset, half = offset + drift, math.hypot(half, _Z95 * sd)
        return {"forecast/final": self.final_pred * (1 + offset),
                "forecast/lo95": self.final_pred * (1 + offset - half),
                "forecast/hi95": self.final_pred * (1 + offset + half)}

    def inside(self, forecast: dict[str, float]) -> bool:
        """Whether a forecast lies inside the pre-registered band of the final step."""
        return self.lo95 <= forecast["forecast/final"] <= self.hi95
