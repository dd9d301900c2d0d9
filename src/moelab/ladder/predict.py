"""Predictions with bands from the curve law, the CSV contract, the on-track monitor and speedups.

The external-curve contract (`moelab ladder fit --curves CURVES.csv --target TARGET.csv --out PRED.csv`):

    CURVES.csv  run,params,step,tokens,lr,loss     every checkpoint of every rung (>= 2 runs)
    TARGET.csv  run,params,step,tokens,lr          the planned schedule of the run(s) to predict
    PRED.csv    TARGET.csv's rows and columns + loss_pred,lo80,hi80,lo95,hi95

`params` is the run's active non-embedding parameter count (`accounting.count_params(...).active`),
`tokens` what the run has trained on once that step is done, `lr` the LR used at that step. Rows of
one run have strictly increasing steps; the LR is taken as linear between rows, so log a row at the
end of warmup and at each schedule break (or at every logged step). Extra columns are ignored and
carried into PRED.csv. A band value is "nan" where the law says nothing (no tokens trained yet).

Watching a run (`OnTrack` is a watcher of `moelab.train.loop.train`):

    train(cfg, out, watchers=[load_on_track("PRED.csv")])  # `on_track` per eval, off_track incidents

Bands: the predictive distribution at a row is an equal-weight mixture over the bootstrap refits,
each refit's prediction plus the new run's own noise, run_sd * t(run_dof) + checkpoint_sd *
t(checkpoint_dof) (`fit.CurveBootstrap`). Student t rather than Gaussian because run_sd comes from a
handful of runs. On 40 synthetic 6-run ladders (about 2.4 dof) x 10 held-out runs, the Gaussian 95%
band covered 84.6% of rows on average and under 90% on 45% of the ladders (those whose run_sd came
out low); the t band covers 91.0% on average and under 90% on 22.5% of them. Both fall short because
an sd from 2-3 dof is often low; the t errs less, and too wide is the better error for a monitor
whose misses raise incidents. lo/hi are the mixture's 2.5/10/90/97.5% quantiles, found by bisection
on its CDF. `loss_pred` is the full-data fit.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy import signal, special

from moelab.accounting import count_params
from moelab.config import RunConfig
from moelab.errors import ConfigError, DataError
from moelab.ladder import NUM_BOOTSTRAP
from moelab.ladder.fit import (
    CurveBootstrap,
    CurveLaw,
    EnvelopeFit,
    Run,
    bootstrap_curve_law,
    curve_loss,
    curve_losses,
    envelope_compute,
    fit_curve_law,
    fitted_rows,
)

__all__ = [
    "CURVE_COLUMNS",
    "TARGET_COLUMNS",
    "BAND_COLUMNS",
    "OFF_TRACK_AFTER",
    "read_curves",
    "read_target",
    "predict_with_bands",
    "fit_curves",
    "load_prediction",
    "TrackCheck",
    "OnTrack",
    "load_on_track",
    "compute_equivalent_speedup",
]

CURVE_COLUMNS = ("run", "params", "step", "tokens", "lr", "loss")
TARGET_COLUMNS = ("run", "params", "step", "tokens", "lr")
BAND_COLUMNS = ("loss_pred", "lo80", "hi80", "lo95", "hi95")
_QUANTILES = {"lo95": 0.025, "lo80": 0.10, "hi80": 0.90, "hi95": 0.975}
OFF_TRACK_AFTER = 2  # consecutive evals outside the 95% band before a run is off track
_MIN_BOOTSTRAP = 20  # fewer refits cannot place a 2.5% quantile between two of them


# ----------------------------------------------------------------------------------------------
# reading


def _load(path: str | Path, columns: Sequence[str], what: str) -> tuple[list[str], list[tuple[int, dict]]]:
    """(header, [(line number, row)]) of a CSV that has at least `columns`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} file {path} does not exist; pass a CSV with columns {','.join(columns)}.")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise DataError(f"{path} is empty; expected a header row {','.join(columns)} and one row per step.")
        header = [name.strip() for name in reader.fieldnames]
        reader.fieldnames = header
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{path} lacks column(s) {', '.join(missing)}; it has {', '.join(header)}. "
                            f"The {what} file needs {','.join(columns)}.")
        table = []
        for row in reader:
            if None in row or None in row.values():
                raise DataError(f"{path} line {reader.line_num}: the row has a different number of fields "
                                f"than the header ({len(header)}).")
            table.append((reader.line_num, row))
    if not table:
        raise DataError(f"{path} has a header but no rows; the {what} file needs one row per step.")
    return header, table


def _number(path: Path, line: int, row: dict, column: str, allow_nan: bool = False) -> float:
    text = row[column].strip()
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path} line {line}, column {column!r}: {text!r} is not a number.") from None
    if not math.isfinite(value) and not (allow_nan and math.isnan(value)):
        raise DataError(f"{path} line {line}, column {column!r}: {text!r} is not finite; drop that row.")
    return value


def _to_runs(path: str | Path, table: list[tuple[int, dict]],
             with_loss: bool) -> tuple[list[Run], dict[str, list[int]]]:
    """Runs in order of first appearance, and for each run the indices of its rows in `table`."""
    path = Path(path)
    where: dict[str, list[int]] = {}
    for i, (line, row) in enumerate(table):
        name = row["run"].strip()
        if not name:
            raise DataError(f"{path} line {line}: column 'run' is empty; every row names its run.")
        where.setdefault(name, []).append(i)
    columns = ("params", "step", "tokens", "lr") + (("loss",) if with_loss else ())
    runs = []
    for name, indices in where.items():
        values = {c: np.array([_number(path, *table[i][:2], c) for i in indices]) for c in columns}
        params = values["params"]
        if np.any(params != params[0]):
            j = int(np.argmax(params != params[0]))
            raise DataError(f"{path} line {table[indices[j]][0]}: run {name!r} changes params from {params[0]:g} "
                            f"to {params[j]:g}; a run has one size (split it into two runs).")
        try:
            runs.append(Run(name, float(params[0]), values["step"], values["tokens"], values["lr"],
                            values["loss"] if with_loss else None))
        except DataError as err:
            raise DataError(f"{path}: {err}") from err
    return runs, where


def read_curves(path: str | Path) -> list[Run]:
    """The rungs' checkpoints from CURVES.csv (`CURVE_COLUMNS`), validated."""
    return _to_runs(path, _load(path, CURVE_COLUMNS, "curves")[1], with_loss=True)[0]


def read_target(path: str | Path) -> list[Run]:
    """The planned run(s) from TARGET.csv (`TARGET_COLUMNS`), validated."""
    return _to_runs(path, _load(path, TARGET_COLUMNS, "target")[1], with_loss=False)[0]


# ----------------------------------------------------------------------------------------------
# bands


def _noise_cdf(bootstrap: CurveBootstrap) -> tuple[np.ndarray, np.ndarray]:
    """(x, G(x)) on a grid: the CDF of a new run's noise, run_sd * t(run_dof) + checkpoint_sd * t(checkpoint_dof).

    Each term's probability mass per grid bin comes from its CDF; the sum's mass is their discrete
    convolution. Bins are 1/8 of the narrower sd (one below 1% of the other is left out: it cannot
    move a quantile visibly) and the grid spans both terms' 0.01% tails.
    """
    terms = [(max(bootstrap.checkpoint_sd, 1e-9), bootstrap.checkpoint_dof)]  # a noiseless fit keeps a CDF
    if bootstrap.run_dof > 0:
        terms.append((bootstrap.run_sd, bootstrap.run_dof))
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


def predict_with_bands(law: CurveLaw, bootstrap: CurveBootstrap, run: Run) -> dict[str, np.ndarray]:
    """`BAND_COLUMNS` -> [R] arrays for each row of `run`; see the module docstring."""
    centres = curve_losses(bootstrap.laws, run)
    quantiles = _mixture_quantiles(centres, _noise_cdf(bootstrap), list(_QUANTILES.values()))
    # A cross-entropy is never negative: the additive noise model's tail below 0 (a band resting on
    # one or two degrees of freedom reaches there) is mass at 0, so quantiles there read 0.
    bands = {k: np.maximum(q, 0.0) for k, q in zip(_QUANTILES, quantiles)}
    unknown = np.isnan(centres).any(0)  # rows before any tokens: the law has no value there
    return {"loss_pred": curve_loss(law, run), **{k: np.where(unknown, np.nan, bands[k]) for k in BAND_COLUMNS[1:]}}


def _summary_of(law: CurveLaw, bootstrap: CurveBootstrap, curves: list[Run], targets: list[Run],
                predictions: dict[str, dict[str, np.ndarray]], num_bootstrap: int, seed: int, out: Path) -> dict:
    names = {"E": "e", "A": "a", "alpha": "alpha", "B": "b", "beta": "beta", "C": "c", "tau_steps": "tau"}
    refits = {k: np.array([getattr(r, v) for r in bootstrap.laws]) for k, v in names.items()}
    notes = []
    if bootstrap.run_dof == 0:
        notes.append(f"{len(curves)} runs at {len({r.params for r in curves})} sizes leave no degree of freedom for "
                     "the run-to-run spread (E, A, alpha absorb up to three run levels): the bands omit it and are "
                     "too narrow; fit at least 5 runs.")
    elif bootstrap.run_dof < 2:
        notes.append(f"the run-to-run spread rests on {bootstrap.run_dof:.1f} degrees of freedom, so its Student t "
                     "band is very wide (and its estimate can still come out low); add rungs, or a second seed at "
                     "one rung's size.")
    largest = max(r.params for r in curves)
    for run in targets:
        if run.params > 10 * largest:
            notes.append(f"run {run.name!r} has params={run.params:g}, {run.params / largest:.0f}x the largest rung: "
                         "the band covers the fit's uncertainty, not a change of law beyond the ladder.")
    final = []
    for run in targets:
        pred = predictions[run.name]
        final.append({"run": run.name, "params": run.params, "final_step": int(run.steps[-1]),
                      "final_tokens": float(run.tokens[-1]), **{k: float(pred[k][-1]) for k in BAND_COLUMNS}})
    return {
        "law": "L(N, t) = E + A*N^-alpha + B*S1(t)^-beta - C*S2(t)",
        "params": {k: getattr(law, v) for k, v in names.items()},
        "params_95": {k: [float(np.quantile(v, 0.025)), float(np.quantile(v, 0.975))] for k, v in refits.items()},
        "noise": {"run_sd": bootstrap.run_sd, "checkpoint_sd": bootstrap.checkpoint_sd, "run_dof": bootstrap.run_dof},
        "fit": {"runs": len(curves), "rows": int(sum(len(r.steps) for r in curves)),
                "rows_fitted": int(sum(fitted_rows(r).sum() for r in curves)), "rmse": law.rmse,
                "sizes": sorted({r.params for r in curves})},
        "bootstrap": {"samples": num_bootstrap, "seed": seed,
                      "unit": "runs: resampled offsets + sign-flipped residual curves"},
        "targets": final,
        "notes": notes,
        "out": str(out),
    }


def _format(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.6f}"


def fit_curves(curves_path: str | Path, target_path: str | Path, out_path: str | Path, *,
               num_bootstrap: int = NUM_BOOTSTRAP, seed: int = 0) -> dict:
    """Fit the curve law on CURVES.csv, write PRED.csv for TARGET.csv, return a JSON-able summary.

    Every input is read and checked before anything is written, and PRED.csv appears atomically
    (written beside it, then renamed), so a bad input never leaves a half-written file.
    """
    if not (isinstance(num_bootstrap, int) and num_bootstrap >= _MIN_BOOTSTRAP):
        raise ConfigError(f"num_bootstrap={num_bootstrap!r} is invalid: must be an integer >= {_MIN_BOOTSTRAP} "
                          f"({NUM_BOOTSTRAP} is the default; the 95% band needs refits beyond its 2.5% tails).")
    curves_path, target_path, out_path = Path(curves_path), Path(target_path), Path(out_path)
    curves = read_curves(curves_path)
    header, table = _load(target_path, TARGET_COLUMNS, "target")
    targets, where = _to_runs(target_path, table, with_loss=False)
    clash = [c for c in BAND_COLUMNS if c in header]
    if clash:
        raise DataError(f"{target_path} already has column(s) {', '.join(clash)}, which PRED.csv adds; "
                        "pass the planned schedule without predictions.")
    try:
        law = fit_curve_law(curves)
        bootstrap = bootstrap_curve_law(curves, law, num_bootstrap, seed)
    except DataError as err:
        raise DataError(f"{curves_path}: {err}") from err
    predictions = {run.name: predict_with_bands(law, bootstrap, run) for run in targets}

    rows = [dict(row) for _, row in table]
    for run in targets:
        for k, i in enumerate(where[run.name]):
            rows[i].update({c: _format(float(predictions[run.name][c][k])) for c in BAND_COLUMNS})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header + list(BAND_COLUMNS))
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return _summary_of(law, bootstrap, curves, targets, predictions, num_bootstrap, seed, out_path)


def load_prediction(path: str | Path) -> list[dict]:
    """PRED.csv's rows: `run` as text, every other contract column as a float (bands may be NaN)."""
    path = Path(path)
    _, table = _load(path, TARGET_COLUMNS + BAND_COLUMNS, "prediction")
    numeric = TARGET_COLUMNS[1:] + BAND_COLUMNS
    return [{"run": row["run"].strip(), **{c: _number(path, line, row, c, allow_nan=c in BAND_COLUMNS)
                                           for c in numeric}} for line, row in table]


# ----------------------------------------------------------------------------------------------
# on-track monitor


@dataclass(frozen=True)
class TrackCheck:
    """One eval against the band. `state`: "unchecked" (outside the band's steps or in warmup),
    "inside", "outside" (fewer than OFF_TRACK_AFTER in a row) or "off_track"."""

    step: int
    state: str
    opens_incident: bool  # True at the eval that makes the run off track (once per episode)
    values: dict[str, float] = field(default_factory=dict)  # actual, predicted, lo95, hi95; empty if unchecked
    rule: str = "off_track"


class OnTrack:
    """Compares each eval loss with the 95% band of one predicted run, interpolated at the eval's step.

    A run is off track after OFF_TRACK_AFTER consecutive evals outside the band: one bad eval is
    noise (the band misses 5% of evals by design), two in a row happen by chance ~0.25% of the time
    for independent evals. The incident opens once; the episode closes at the next eval inside the
    band, and a later pair of misses opens a new one. Warmup steps (before the planned LR first
    reaches its peak) and steps beyond the prediction's range are not checked: the law says nothing
    there. A non-finite loss counts as outside.

    As a watcher of `moelab.train.loop.train`, it warns before training if the prediction is for
    another run (`check_run`), and gives each eval's record its `on_track` state and, when the run
    goes off track, an `off_track` incident (`watch`). `source` names the prediction in the warning.
    """

    def __init__(self, pred_rows: Sequence[dict], run: str | None = None, source: str = "the prediction"):
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
        """One eval as the training loop sees it: {"on_track": state}, and the off_track incident it opens."""
        check = self.check(step, eval_mean)
        incidents = [{"rule": check.rule, "module": "loss", "values": check.values}] if check.opens_incident else []
        return {"on_track": check.state}, incidents


def load_on_track(path: str | Path) -> OnTrack:
    """The on-track watcher of PRED.csv's run (its only one)."""
    return OnTrack(load_prediction(path), source=str(path))


def compute_equivalent_speedup(baseline_fit: EnvelopeFit, candidate_loss: float, candidate_compute: float) -> float:
    """Compute the baseline needs (by its envelope) to reach `candidate_loss`, over `candidate_compute`.

    2.0 means the candidate reaches that loss with half the baseline's compute. Infinite when the
    loss is at or below the baseline's floor (no compute suffices).
    """
    if not (math.isfinite(candidate_compute) and candidate_compute > 0):
        raise DataError(f"candidate_compute={candidate_compute!r} is invalid: must be a positive number of FLOPs.")
    if not math.isfinite(candidate_loss):
        raise DataError(f"candidate_loss={candidate_loss!r} is invalid: must be a finite loss.")
    return float(envelope_compute(baseline_fit, candidate_loss)) / candidate_compute
