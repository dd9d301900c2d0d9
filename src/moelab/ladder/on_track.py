"""The on-track watcher: each eval of a training run against the band its ladder predicted.

Watching a run (`OnTrack` is a watcher of `moelab.train.loop.train`):

    train(cfg, out, watchers=[load_on_track("PRED.csv")])  # `on_track` per eval, off_track incidents

`load_on_track` reads PRED.csv and its sidecar (`contract`); `OnTrack` checks each eval and keeps a live
forecast of the final loss (`forecast`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from moelab.accounting import count_params
from moelab.config import RunConfig
from moelab.errors import DataError
from moelab.ladder.bands import PROGRESS_EDGES, checkpoint_scale
from moelab.ladder.contract import load_prediction, read_sidecar, sidecar_path, size_scale_of
from moelab.ladder.curve import Run, fitted_rows
from moelab.ladder.drift import METHODS, Drift
from moelab.ladder.fit import noise_scale
from moelab.ladder.forecast import ForecastFinal

__all__ = ["OFF_TRACK_AFTER", "TrackCheck", "OnTrack", "load_on_track"]

OFF_TRACK_AFTER = 2  # consecutive evals outside the 95% band before a run is off track


@dataclass(frozen=True)
class TrackCheck:
    """One eval against the band. `state`: "unchecked" (outside the band's steps, in warmup or the transient),
    "inside", "outside" (fewer than OFF_TRACK_AFTER in a row) or "off_track"."""

    step: int
    state: str
    opens_incident: bool  # True at the eval that makes the run off track (once per episode)
    values: dict[str, float] = field(default_factory=dict)  # actual, predicted, lo95, hi95; empty if unchecked
    rule: str = "off_track"


class OnTrack:
    """Compares each eval loss with the 95% band of one predicted run, and forecasts its final loss.

    A run is off track after OFF_TRACK_AFTER consecutive evals outside the band: one bad eval is
    noise (the band misses 5% of evals by design), two in a row happen by chance ~0.25% of the time
    for independent evals. The incident opens once; the episode closes at the next eval inside the
    band, and a later pair of misses opens a new one. Warmup steps (before the planned LR first
    reaches its peak), the transient after them (the first `curve.TRANSIENT_FRACTION` of the planned tokens)
    and steps beyond the prediction's range are not checked: the law is not fitted there, so it says nothing
    there (`curve.fitted_rows`). A non-finite loss counts as outside.

    Beside the fixed band it keeps a live forecast of the final loss (`forecast.ForecastFinal`: the
    prediction as the prior, the checked evals pulling the run's offset); a forecast that leaves the
    final step's 95% band opens a `forecast_off_track` incident, once per episode.

    As a watcher of `moelab.train.loop.train`, it warns before training if the prediction is for
    another run (`check_run`), and gives each eval's record its `on_track` state, the forecast
    (`forecast/final`, `forecast/lo95`, `forecast/hi95`) and, when the run goes off track or its
    forecast leaves the final band, the incident (`watch`). `source` names the prediction in the warning.
    `checkpoint_sd` (the fit's per-eval noise, from the prediction's sidecar JSON: one value, or one per
    planned step of the run) sets how much one eval moves the forecast; `drift` (the sidecar's table for the run,
    `drift.Drift`) how its offset is expected to move from each eval to the end.
    """

    def __init__(self, pred_rows: Sequence[dict], run: str | None = None, source: str = "the prediction",
                 checkpoint_sd: float | Sequence[float] | None = None, drift: Drift | None = None):
        names = list(dict.fromkeys(row["run"] for row in pred_rows))
        if not names:
            raise DataError("the prediction has no rows; run `moelab ladder fit` to write PRED.csv first.")
        if run is None and len(names) > 1:
            raise DataError(f"the prediction holds runs {', '.join(names)}; pass run=<name> to pick one.")
        run = names[0] if run is None else run
        if run not in names:
            raise DataError(f"run {run!r} is not in the prediction, which holds {', '.join(names)}.")
        rows = [row for row in pred_rows if row["run"] == run]
        planned = Run(run, rows[0]["params"], [r["step"] for r in rows], [r["tokens"] for r in rows],
                      [r["lr"] for r in rows])
        self.run, self.source = run, source
        self.params, self.last_step = rows[0]["params"], int(max(r["step"] for r in rows))  # the planned run
        self._steps = planned.steps
        self._band = {k: np.array([r[k] for r in rows]) for k in ("loss_pred", "lo95", "hi95")}
        self._first_step = float(planned.steps[int(np.argmax(fitted_rows(planned)))])
        self._misses = 0
        self.forecast = ForecastFinal(planned.steps, self._band["loss_pred"], self._band["lo95"][-1],
                                      self._band["hi95"][-1], checkpoint_sd, drift)
        self._forecast_outside = False

    def check(self, step: int, loss: float) -> TrackCheck:
        """Record one eval; says whether it is inside the band and whether the run just went off track."""
        if not self._first_step <= step <= self._steps[-1]:
            return TrackCheck(step, "unchecked", False)
        predicted, lo95, hi95 = (float(np.interp(step, self._steps, self._band[k]))
                                 for k in ("loss_pred", "lo95", "hi95"))
        if math.isnan(lo95) or math.isnan(hi95):
            return TrackCheck(step, "unchecked", False)
        values = {"actual": float(loss), "predicted": predicted, "lo95": lo95, "hi95": hi95}
        if math.isfinite(loss) and lo95 <= loss <= hi95:
            self._misses = 0
            return TrackCheck(step, "inside", False, values)
        self._misses += 1
        off = self._misses >= OFF_TRACK_AFTER
        return TrackCheck(step, "off_track" if off else "outside", self._misses == OFF_TRACK_AFTER, values)

    def check_run(self, cfg: RunConfig) -> None:
        """A prediction is for one planned run: another name, size or length makes its band meaningless."""
        mismatches, active = [], count_params(cfg.model).active
        if self.run != cfg.name:
            mismatches.append(f"run {self.run!r}, not {cfg.name!r}")
        if self.params and abs(self.params / active - 1) > 0.01:
            mismatches.append(f"{self.params:,.0f} active parameters, not {active:,}")
        if self.last_step != cfg.train.steps:
            mismatches.append(f"{self.last_step} steps, not {cfg.train.steps}")
        if mismatches:  # stacklevel 3: the caller of `train`, which calls this
            warnings.warn(f"{self.source} predicts {'; '.join(mismatches)}: its band is for another run. Train "
                          "the ladder's target.yaml against it, or refit the ladder for this run.", stacklevel=3)

    def watch(self, step: int, eval_mean: float) -> tuple[dict, list[dict]]:
        """One eval as the training loop sees it: its `on_track` state and forecast, and the incidents it opens."""
        check = self.check(step, eval_mean)
        incidents = [{"rule": check.rule, "module": "loss", "values": check.values}] if check.opens_incident else []
        if check.state == "unchecked":  # warmup, transient or past the prediction: the law says nothing there
            return {"on_track": check.state}, incidents
        forecast = self.forecast.update(step, eval_mean)
        outside = not self.forecast.inside(forecast)
        if outside and not self._forecast_outside:
            incidents.append({"rule": "forecast_off_track", "module": "loss",
                              "values": {**forecast, "lo95": self.forecast.lo95, "hi95": self.forecast.hi95}})
        self._forecast_outside = outside
        return {"on_track": check.state, **forecast}, incidents


def load_on_track(path: str | Path, run: str | None = None, forecast: str | None = None) -> OnTrack:
    """The on-track watcher of PRED.csv's run (its only one, or `run` of several), with the fit's noise and the
    forecast's drift table from its sidecar if present. `forecast` picks another of the sidecar's forecast methods
    (`drift.METHODS`; "offset": no drift) than the one it names, as the benchmark scores each."""
    if forecast is not None and forecast not in METHODS:
        raise DataError(f"forecast={forecast!r} is not a forecast method; one of {', '.join(METHODS)}.")
    summary, checkpoint_sd, drift, rows = read_sidecar(path), None, None, load_prediction(path)
    if run is not None:
        rows = [r for r in rows if r["run"] == run] or rows  # an unknown name: OnTrack names the runs it holds
    if summary is not None:
        try:
            noise = summary["noise"]
            exponent, ref = size_scale_of(noise)  # the noise at the predicted run's size
            params = rows[0]["params"]  # OnTrack refuses params <= 0 by name
            checkpoint_sd = float(noise["checkpoint_sd"]) * (noise_scale(params, exponent, ref) if params > 0 else 1.0)
            profile = [float(v) for v in noise.get("progress_scale", [])]
            if profile:  # per planned step: a run's early evals stray further from the law than its late ones
                if len(profile) != len(PROGRESS_EDGES) - 1 or min(profile) <= 0:
                    raise ValueError(f"noise.progress_scale={profile}")
                tokens = np.array([r["tokens"] for r in rows if r["run"] == rows[0]["run"]])
                checkpoint_sd = checkpoint_sd * checkpoint_scale(tokens / tokens[-1], profile)
            drift = _drift_of(summary, rows[0]["run"], forecast)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"{sidecar_path(path)} is not the sidecar `moelab ladder fit` writes ({err!r}); delete it "
                            "or refit to rewrite it.") from None
    try:
        return OnTrack(rows, run=run, source=str(path), checkpoint_sd=checkpoint_sd, drift=drift)
    except DataError as err:  # the rows' own checks name the run and step; the reader names the file
        raise DataError(f"{path}: {err}") from None


def _drift_of(summary: dict, run: str, method: str | None) -> Drift | None:
    """The sidecar's drift table of `run` for `method` (default: the sidecar's own); None for "offset", for a
    sidecar written before issue 60, or a run it holds no table for. KeyError/ValueError for a malformed one."""
    forecast = summary.get("forecast")
    if forecast is None:
        return None
    method = method or forecast["method"]
    if method not in METHODS:
        raise ValueError(f"forecast.method={method!r}")
    table = forecast["runs"].get(run, {}).get(method)
    return None if table is None else Drift.from_json(table, forecast["fractions"])
