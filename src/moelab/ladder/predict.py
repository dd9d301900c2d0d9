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
t(checkpoint_dof) (`fit.CurveBootstrap`), scaled to the new run's size where the fit is weighted
(`fit.noise_scale`), the checkpoint term also to the row's progress through the run where the runs
stray further early (`fit.checkpoint_scale`). Student t rather than Gaussian because run_sd comes from a
handful of runs. On 40 synthetic 6-run ladders (about 2.4 dof) x 10 held-out runs, the Gaussian 95%
band covered 84.6% of rows on average and under 90% on 45% of the ladders (those whose run_sd came
out low); the t band covers 91.0% on average and under 90% on 22.5% of them. Both fall short because
an sd from 2-3 dof is often low; the t errs less, and too wide is the better error for a monitor
whose misses raise incidents. lo/hi are the mixture's 2.5/10/90/97.5% quantiles, found by bisection
on its CDF. `loss_pred` is the full-data fit.
"""

from __future__ import annotations

import csv
import json
import math
import os
from functools import partial
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from scipy import signal, special

from moelab.accounting import count_params
from moelab.config import RunConfig
from moelab.errors import ConfigError, DataError
from moelab.ladder import DEFAULT_BAND, DEFAULT_LAW, NUM_BOOTSTRAP
from moelab.ladder.fit import (
    ALPHA_PRIOR,
    EXPONENT_BOUNDS,
    FORMS,
    PROGRESS_EDGES,
    CurveBootstrap,
    CurveLaw,
    EnvelopeFit,
    Run,
    SharedNoise,
    alpha_prior_z,
    bootstrap_curve_law,
    curve_loss,
    curve_losses,
    envelope_compute,
    fit_curve_law,
    checkpoint_scale,
    fitted_rows,
    noise_scale,
    past_warmup,
    shared_noise,
)
from moelab.ladder.calibrate import Misfit, measure_misfit, widen
from moelab.ladder.forecast import ForecastFinal

__all__ = [
    "CURVE_COLUMNS",
    "TARGET_COLUMNS",
    "BAND_COLUMNS",
    "OFF_TRACK_AFTER",
    "read_curves",
    "read_target",
    "predict_with_bands",
    "score",
    "self_check",
    "fit_curves",
    "load_prediction",
    "TrackCheck",
    "OnTrack",
    "size_scale_of",
    "load_on_track",
    "sidecar_path",
    "compute_equivalent_speedup",
]

CURVE_COLUMNS = ("run", "params", "step", "tokens", "lr", "loss")
TARGET_COLUMNS = ("run", "params", "step", "tokens", "lr")
BAND_COLUMNS = ("loss_pred", "lo80", "hi80", "lo95", "hi95")
_QUANTILES = {"lo95": 0.025, "lo80": 0.10, "hi80": 0.90, "hi95": 0.975}
OFF_TRACK_AFTER = 2  # consecutive evals outside the 95% band before a run is off track
_MIN_BOOTSTRAP = 20  # fewer refits cannot place a 2.5% quantile between two of them
# The curve laws and band methods `fit_curves` offers (docs/scaling-ladder.md, "Real public curves": the default
# of each was chosen by a rule fixed before scoring).
LAWS = FORMS  # the annealing term's form: Tissue et al.'s EMA of the LR drop, or Luo et al.'s multi-power drop
BANDS = ("bootstrap", "calibrated")  # calibrated: widened by the law's held-out misfit (`calibrate`)
# The self-check fails when fewer of the held-out rung's scored evals than this lie inside the 95% band predicted for
# them: its rows share one run offset, so a band that holds the rung's noise and the law's misfit holds nearly all
# of them or misses the run as a whole; under 80% the band understates the miss (docs/scaling-ladder.md).
SELF_CHECK_MIN_COVERAGE = 0.8
# A self-check whose own band is wider than this passes a recipe that misses by as much, so it cannot tell a
# good recipe from a bad one: its verdict is "uninformative" and the prediction is not marked trusted.
SELF_CHECK_MAX_BAND = 0.10


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
    """`BAND_COLUMNS` -> [R] arrays for each row of `run`; see the module docstring.

    With `shared` (`fit.shared_noise`: `run` trains on the curves' seed and data order) each row also
    borrows what those runs share at its step; the band keeps its width (`fit.SharedNoise` says why).
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
            **{k: np.where(unknown, np.nan, bands[k]) for k in BAND_COLUMNS[1:]}}


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


def _relative_half_width(bands: dict[str, np.ndarray]) -> float:
    """Half the 95% band at the last row, relative to the prediction there."""
    return float((bands["hi95"][-1] - bands["lo95"][-1]) / 2 / bands["loss_pred"][-1])


def self_check(curves: Sequence[Run], num_bootstrap: int = NUM_BOOTSTRAP, seed: int = 0,
               progress: Callable[[Iterable], Iterable] = iter, band: str = DEFAULT_BAND,
               law: str = DEFAULT_LAW) -> dict:
    """Refit without the largest size, predict its runs, and score that prediction (`score`).

    The one test a ladder can run on itself before its target trains: the largest rung is the
    nearest thing to the target the fit has seen. Needs runs at 3 or more sizes (2 left to fit);
    otherwise {"skipped": reason}. `final_error` and the band are averaged over the held-out runs.
    `law` is the annealing term's form (`fit.FORMS`). With `band="calibrated"` the held-out rung's band is widened by the misfit the smaller sizes
    show among themselves (`calibrate.measure_misfit`), as the target's is by all of them.
    """
    sizes = sorted({r.params for r in curves})
    if len(sizes) < 3:
        return {"skipped": f"the curves hold {len(sizes)} size(s); leaving the largest out needs at least 3."}
    held = [r for r in curves if r.params == sizes[-1]]
    rest = [r for r in curves if r.params != sizes[-1]]
    form = law
    law = fit_curve_law(rest, form)
    bootstrap = bootstrap_curve_law(rest, law, num_bootstrap, seed, progress)
    bands = [predict_with_bands(law, bootstrap, replace(r, loss=None)) for r in held]
    if band == "calibrated":
        try:
            misfit = measure_misfit(rest, partial(fit_curve_law, form=form))
            bands = [widen(b, misfit, r) for b, r in zip(bands, held)]
        except DataError:
            pass  # the check then holds the rung against the bootstrap band, the narrower: it fails sooner
    scores = [score(b, r) for b, r in zip(bands, held)]
    mean = {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}
    return {"held_out": [r.name for r in held], "params": sizes[-1], "fitted_on": [r.name for r in rest], **mean,
            "band95_half_width": float(np.mean([_relative_half_width(b) for b in bands]))}


def _identification_notes(law: CurveLaw, refits: dict[str, np.ndarray]) -> list[str]:
    """Say which of the law's terms the data did not pin down: on a bound, or spread over 10x by the bootstrap."""
    notes = []
    if law.e == 0:
        notes.append("E = 0: the fit put no floor under the loss, so the size and data terms carry it; their "
                     "exponents are then not those of a scaling law. Add longer runs or more sizes.")
    for name, value, (lo, hi) in (("alpha", law.alpha, EXPONENT_BOUNDS), ("beta", law.beta, EXPONENT_BOUNDS)):
        if (name == "beta" or law.size is None) and not lo * 1.05 < value < hi / 1.05:
            notes.append(f"{name} = {value:.3g} sits at the edge of its range [{lo}, {hi}]: not identified.")
    if law.c > 0 and law.tau <= 1.05:
        notes.append("tau_steps = 1 (its lower bound): the anneal gain is read as instant; the curves do not "
                     "show how it settles (evaluate more often around the decay).")
    for name in ("E", "A", "B", "C"):
        lo, hi = np.quantile(refits[name], [0.025, 0.975])
        if name != "A" or law.size is None:
            if hi > 0 and (lo <= 0 or hi / lo > 10):
                notes.append(f"{name}'s 95% bootstrap interval [{lo:.3g}, {hi:.3g}] spans more than 10x: the "
                             "curves do not pin it down.")
    return notes


def _setup_notes(curves: Sequence[Run], targets: Sequence[Run]) -> list[str]:
    """Name what differs between the runs that the law does not model: the peak LR and the tokens per step.

    The law reads each run's LR relative to its own peak (a ladder tunes the peak per rung) and counts
    tokens, not steps, so runs at another peak LR or batch size are taken as tuned alike. On real public
    ladders both differ (docs/scaling-ladder.md, "Real public curves"): say so rather than guess a term.
    """
    notes = []
    peaks = {}
    for run in curves:
        peaks.setdefault(run.params, set()).add(float(f"{run.lr.max():.2g}"))  # logged LRs are rounded
    mixed = sorted(n for n, lrs in peaks.items() if len(lrs) > 1)
    if mixed:
        notes.append(f"runs of one size train at different peak LRs ({', '.join(f'{n:.3g}: ' + '/'.join(f'{lr:g}' for lr in sorted(peaks[n])) for n in mixed[:3])}"
                     f"{', ...' if len(mixed) > 3 else ''}); the law reads only the LR relative to each run's peak, so it "
                     "takes them as tuned alike, and what a higher peak does to a curve is read as its schedule's own effect.")
    by_size = sorted({n: max(lrs) for n, lrs in peaks.items()}.items())
    if len({lr for _, lr in by_size}) > 1:
        notes.append("the peak LR changes with size along the curves ("
                     + ", ".join(f"{n:.3g}: {lr:g}" for n, lr in by_size)
                     + "); the law has no LR term, so the size trend carries the LR rule with it: predict a target "
                       "tuned by the same rule.")

    def per_step(run: Run) -> float:
        return float(run.tokens[-1] / run.steps[-1])

    curve_batches = sorted({float(f"{per_step(r):.3g}") for r in curves})
    off = [r for r in targets if all(abs(per_step(r) / b - 1) > 0.05 for b in curve_batches)]
    if off:
        batches = sorted({f"{per_step(r):.4g}" for r in off})
        notes.append(f"{len(off)} of {len(targets)} target run(s) train on {'/'.join(batches)} tokens per step, "
                     f"the curves on {'/'.join(f'{b:.4g}' for b in curve_batches)}: the law has no batch-size term (it "
                     "counts tokens), so what the batch change does to the loss is not in the prediction or its band.")
    return notes


def _summary_of(law: CurveLaw, bootstrap: CurveBootstrap, curves: list[Run], targets: list[Run],
                predictions: dict[str, dict[str, np.ndarray]], check: dict, num_bootstrap: int, seed: int,
                out: Path) -> dict:
    names = {"E": "e", "A": "a", "alpha": "alpha", "B": "b", "beta": "beta", "C": "c", "tau_steps": "tau"}
    if law.form == "multipower":
        names.update({"power": "power", "gamma": "gamma"})
    refits = {k: np.array([getattr(r, v) for r in bootstrap.laws]) for k, v in names.items()}
    notes = []
    if bootstrap.run_dof == 0:
        notes.append(f"{len(curves)} runs at {len({r.params for r in curves})} sizes leave no degree of freedom for "
                     "the run-to-run spread (E, A, alpha absorb up to three run levels): the bands omit it and are "
                     "too narrow, and the prior on alpha weighs only one checkpoint; fit at least 5 runs.")
    elif bootstrap.run_dof < 2:
        notes.append(f"the run-to-run spread rests on {bootstrap.run_dof:.1f} degrees of freedom, so its Student t "
                     "band is very wide (and its estimate can still come out low); add rungs, or a second seed at "
                     "one rung's size.")
    largest = max(r.params for r in curves)
    for run in targets:
        if run.params > 10 * largest:
            notes.append(f"run {run.name!r} has params={run.params:g}, {run.params / largest:.0f}x the largest rung: "
                         "the band covers the fit's uncertainty, not a change of law beyond the ladder.")
    notes += _identification_notes(law, refits)
    final = []
    for run in targets:
        pred = predictions[run.name]
        final.append({"run": run.name, "params": run.params, "final_step": int(run.steps[-1]),
                      "final_tokens": float(run.tokens[-1]), **{k: float(pred[k][-1]) for k in BAND_COLUMNS},
                      "band95_half_width": _relative_half_width(pred)})
    if "skipped" not in check:
        band = max(t["band95_half_width"] for t in final)
        inside = check["final_lo95"] <= check["final_actual"] <= check["final_hi95"]
        covered = check["band95_coverage"] >= SELF_CHECK_MIN_COVERAGE
        passed = bool(inside and covered and abs(check["final_error"]) <= band)
        # the miss is held against the target's band too, so a target band that wide cannot fail either
        informative = max(check["band95_half_width"], band) <= SELF_CHECK_MAX_BAND
        check["verdict"] = "failed" if not passed else "passed" if informative else "uninformative"
        check["trusted"] = check["verdict"] == "passed"
        if check["verdict"] == "uninformative":
            notes.insert(0, f"SELF-CHECK UNINFORMATIVE: refitted without the largest rung, the law misses it by "
                            f"{check['final_error']:+.2%}, inside a band of +-{check['band95_half_width']:.1%} "
                            f"(the target's: +-{band:.1%}); a check that wide (over +-{SELF_CHECK_MAX_BAND:.0%}) "
                            "would pass a recipe that far off, "
                            "so it cannot tell a good recipe from a bad one. Not trusted: see the advice below.")
        if check["verdict"] == "failed":
            notes.insert(0, f"SELF-CHECK FAILED: refitted without the largest rung, the law misses it by "
                            f"{check['final_error']:+.2%} at its last eval ("
                            + (f"outside the band it predicted for it, [{check['final_lo95']:.4f}, "
                               f"{check['final_hi95']:.4f}]" if not inside else
                               f"with only {check['band95_coverage']:.0%} of its evals inside the band predicted for "
                               f"them, under {SELF_CHECK_MIN_COVERAGE:.0%}: the band understates the law's miss"
                               if not covered else f"more than the target's 95% band, +-{band:.2%}")
                            + "). Do not trust this prediction: fix the recipe (more or longer rungs, tuned LRs) "
                            "before training the target against it.")
    for t in final:
        if t["band95_half_width"] > 0.03:
            notes.append(f"the 95% band of run {t['run']!r} at its last step is +-{t['band95_half_width']:.1%}: too "
                         "wide to tell a run 3% off its recipe from a healthy one. More rungs (or seeds at one size) "
                         "narrow it.")
    summary = {
        "law": ("L(t) = E + B*S1(t)^-beta - C*S2(t) (one size)" if law.size is not None
                else "L(N, t) = E + A*N^-alpha + B*S1(t)^-beta - C*S2(t)")
               + ("; S2 = LD(t) / B, the multi-power drop (Luo et al. 2025)" if law.form == "multipower" else ""),
        "params": {k: getattr(law, v) for k, v in names.items()},
        "params_95": {k: [float(np.quantile(v, 0.025)), float(np.quantile(v, 0.975))] for k, v in refits.items()},
        "noise": {"run_sd": bootstrap.run_sd, "checkpoint_sd": bootstrap.checkpoint_sd, "run_dof": bootstrap.run_dof,
                  "size_exponent": bootstrap.noise_exponent, "ref_params": bootstrap.noise_ref,
                  "progress_edges": list(PROGRESS_EDGES), "progress_scale": list(bootstrap.progress_scale)},
        "fit": {"runs": len(curves), "rows": int(sum(len(r.steps) for r in curves)),
                "rows_fitted": int(sum(fitted_rows(r).sum() for r in curves)), "rmse": law.rmse,
                "sizes": sorted({r.params for r in curves}),
                "alpha_prior": (None if ALPHA_PRIOR is None or law.size is not None else
                                {"median": ALPHA_PRIOR[0], "log_sd": ALPHA_PRIOR[1], "weight": law.prior_weight,
                                 "z": alpha_prior_z(law.alpha)})},
        "bootstrap": {"samples": num_bootstrap, "seed": seed,
                      "unit": "runs: resampled offsets + sign-flipped residual curves"},
        "targets": final,
        "self_check": check,
        "notes": notes,
        "out": str(out),
    }
    advice = _advice(summary, largest)
    if advice is not None:
        summary["advice"] = advice
        notes.append(advice["text"])
    return summary


def _advice(summary: dict, largest: float) -> dict | None:
    """What to add to reach a +-3% target band, from the fitted noise (`fix.seeds_for_band`); None when the
    band is already within it and the self-check passed."""
    from moelab.ladder.fix import BAND_GOAL, seeds_for_band

    target, check = summary["targets"][0], summary["self_check"]
    if target["band95_half_width"] <= BAND_GOAL and check.get("verdict") == "passed":
        return None
    sizes = len(summary["fit"]["sizes"])
    seeds = seeds_for_band(summary, sizes)
    advice = {"seeds_per_rung": seeds["seeds"], "expected_half_width": seeds["half_width"],
              "reachable": seeds["reachable"], "seeds_now": summary["fit"]["runs"] / sizes}
    text = f"To reach a +-{BAND_GOAL:.0%} band: {seeds['why']}"
    if seeds["reachable"]:
        text += f" (about +-{seeds['half_width']:.1%}; now {advice['seeds_now']:.3g} a rung)"
    if sizes < 3:
        advice["rung"] = "another size"
        text += "; add a third rung size, so the self-check can run"
    elif target["params"] > 3 * largest:
        advice["rung"] = target["params"] / 3
        text += (f"; add a rung of about {target['params'] / 3:.3g} active parameters (a third of the target's; the "
                 f"largest now has {largest:.3g}), so the self-check predicts a size nearer the target")
    advice["text"] = text + ". `moelab ladder plan RECIPE --fix --runs LADDER_OUT` writes the seeds into the recipe."
    return advice


def _format(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.6f}"


def fit_curves(curves_path: str | Path, target_path: str | Path, out_path: str | Path, *,
               num_bootstrap: int = NUM_BOOTSTRAP, seed: int = 0, same_data_order: bool = False,
               exclude: Mapping[str, str] | None = None, progress: Callable[[Iterable], Iterable] = iter,
               law: str = DEFAULT_LAW, band: str = DEFAULT_BAND) -> dict:
    """Fit the curve law on CURVES.csv, write PRED.csv for TARGET.csv and its sidecar PRED.json.

    PRED.json holds the returned summary: the law, its noise, the leave-largest-out `self_check`
    and notes. Curves of one size fit the schedule part alone and predict that size only; with
    `same_data_order` (the curves and the target share one seed and data order: a schedule sweep)
    the target's rows also borrow the noise the curves share at each step (`fit.SharedNoise`). Every input
    is read and checked before anything is written, and both files appear atomically (written beside
    them, then renamed), so a bad input never leaves a half-written file. `progress` wraps the
    bootstrap loops (a progress bar in the CLI).

    `exclude` maps run names to why they are left out of the fit (a rung the plan's checks flag:
    `rungs.rung_flags`); the summary's `excluded` lists them with the reason. Runs are left out only while
    two sizes remain; otherwise every run is fitted and a note says what the flags would have removed.
    """
    if not (isinstance(num_bootstrap, int) and num_bootstrap >= _MIN_BOOTSTRAP):
        raise ConfigError(f"num_bootstrap={num_bootstrap!r} is invalid: must be an integer >= {_MIN_BOOTSTRAP} "
                          f"({NUM_BOOTSTRAP} is the default; the 95% band needs refits beyond its 2.5% tails).")
    if law not in LAWS:
        raise ConfigError(f"law={law!r} is invalid: one of {', '.join(LAWS)} ({DEFAULT_LAW} is the default).")
    if band not in BANDS:
        raise ConfigError(f"band={band!r} is invalid: one of {', '.join(BANDS)} ({DEFAULT_BAND} is the default).")
    curves_path, target_path, out_path = Path(curves_path), Path(target_path), Path(out_path)
    curves, excluded = _exclude(read_curves(curves_path), dict(exclude or {}), curves_path)
    header, table = _load(target_path, TARGET_COLUMNS, "target")
    targets, where = _to_runs(target_path, table, with_loss=False)
    clash = [c for c in BAND_COLUMNS if c in header]
    if clash:
        raise DataError(f"{target_path} already has column(s) {', '.join(clash)}, which PRED.csv adds; "
                        "pass the planned schedule without predictions.")
    form = law
    try:
        law = fit_curve_law(curves, form)
        for run in targets:
            curve_loss(law, run)  # a one-size law refuses another size before any bootstrap
        shared = shared_noise(curves, law) if same_data_order else None
        bootstrap = bootstrap_curve_law(curves, law, num_bootstrap, seed, progress)
        check = self_check(curves, num_bootstrap, seed, progress, band, form)
    except DataError as err:
        raise DataError(f"{curves_path}: {err}") from err
    misfit, unmeasured = None, None
    if band == "calibrated":
        try:
            misfit = measure_misfit(curves, partial(fit_curve_law, form=form), same_data_order)
        except DataError as err:
            unmeasured = (f"the law's misfit on runs it did not see could not be measured ({err}): the bands hold "
                          "the bootstrap's noise alone and are too narrow wherever the law misses.")
    predictions = {run.name: predict_with_bands(law, bootstrap, run, shared) for run in targets}
    if misfit is not None:
        predictions = {run.name: widen(predictions[run.name], misfit, run) for run in targets}
    summary = _summary_of(law, bootstrap, curves, targets, predictions, check, num_bootstrap, seed, out_path)
    summary["band"] = band
    summary["notes"].extend(_setup_notes(curves, targets))
    if misfit is not None:
        summary["misfit"] = misfit.as_json(max(misfit.distance_of(run) for run in targets))
    if unmeasured:
        summary["notes"].append(unmeasured)
    summary["excluded"] = excluded
    for item in excluded:
        summary["notes"].insert(0, f"left out of the fit: {item['run']} ({item['reason']}).")
    if exclude and not excluded:
        summary["notes"].insert(0, f"the plan's checks flag {', '.join(sorted(exclude))}, but leaving them out would "
                                   "leave fewer than 2 sizes, so every run is fitted: the prediction carries the bias "
                                   "those flags name (`moelab ladder plan RECIPE --fix`).")
    if shared is not None:
        summary["shared_noise"] = {
            "shared_sd": math.sqrt(shared.shared_var), "own_sd": math.sqrt(shared.own_var),
            "rows_borrowing": {run.name: int(np.count_nonzero(np.isin(run.steps, shared.steps))) for run in targets}}

    rows = [dict(row) for _, row in table]
    for run in targets:
        for k, i in enumerate(where[run.name]):
            rows[i].update({c: _format(float(predictions[run.name][c][k])) for c in BAND_COLUMNS})
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def write_csv(f) -> None:
        writer = csv.DictWriter(f, fieldnames=header + list(BAND_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)

    _write_atomically(sidecar_path(out_path), lambda f: f.write(json.dumps(summary, indent=2) + "\n"))
    _write_atomically(out_path, write_csv)
    return summary


def _exclude(curves: list[Run], exclude: dict[str, str], where: Path) -> tuple[list[Run], list[dict]]:
    """`curves` without the runs named in `exclude` while 2 sizes remain, and [{run, reason}] of those left out."""
    unknown = sorted(set(exclude) - {r.name for r in curves})
    if unknown:
        raise DataError(f"{where}: no run named {', '.join(unknown)} to leave out; its runs are "
                        f"{', '.join(sorted({r.name for r in curves}))}.")
    kept = [r for r in curves if r.name not in exclude]
    if len({r.params for r in kept}) < 2:
        return curves, []
    return kept, [{"run": name, "reason": exclude[name]} for name in sorted(exclude)]


def _write_atomically(path: Path, write: Callable) -> None:
    """Write `path` through `write(file)` into a temporary file beside it, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    """Compares each eval loss with the 95% band of one predicted run, and forecasts its final loss.

    A run is off track after OFF_TRACK_AFTER consecutive evals outside the band: one bad eval is
    noise (the band misses 5% of evals by design), two in a row happen by chance ~0.25% of the time
    for independent evals. The incident opens once; the episode closes at the next eval inside the
    band, and a later pair of misses opens a new one. Warmup steps (before the planned LR first
    reaches its peak) and steps beyond the prediction's range are not checked: the law says nothing
    there. A non-finite loss counts as outside.

    Beside the fixed band it keeps a live forecast of the final loss (`forecast.ForecastFinal`: the
    prediction as the prior, the checked evals pulling the run's offset); a forecast that leaves the
    final step's 95% band opens a `forecast_off_track` incident, once per episode.

    As a watcher of `moelab.train.loop.train`, it warns before training if the prediction is for
    another run (`check_run`), and gives each eval's record its `on_track` state, the forecast
    (`forecast/final`, `forecast/lo95`, `forecast/hi95`) and, when the run goes off track or its
    forecast leaves the final band, the incident (`watch`). `source` names the prediction in the warning.
    `checkpoint_sd` (the fit's per-eval noise, from the prediction's sidecar JSON: one value, or one per
    planned step of the run) sets how much one eval moves the forecast.
    """

    def __init__(self, pred_rows: Sequence[dict], run: str | None = None, source: str = "the prediction",
                 checkpoint_sd: float | Sequence[float] | None = None):
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
        self._first_step = float(planned.steps[int(np.argmax(past_warmup(planned)))])
        self._misses = 0
        self.forecast = ForecastFinal(planned.steps, self._band["loss_pred"], self._band["lo95"][-1],
                                      self._band["hi95"][-1], checkpoint_sd)
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
        if check.state == "unchecked":  # warmup or past the prediction: the law says nothing there
            return {"on_track": check.state}, incidents
        forecast = self.forecast.update(step, eval_mean)
        outside = not self.forecast.inside(forecast)
        if outside and not self._forecast_outside:
            incidents.append({"rule": "forecast_off_track", "module": "loss",
                              "values": {**forecast, "lo95": self.forecast.lo95, "hi95": self.forecast.hi95}})
        self._forecast_outside = outside
        return {"on_track": check.state, **forecast}, incidents


def sidecar_path(pred_path: str | Path) -> Path:
    """PRED.csv's sidecar JSON (the fit summary, the noise and the self-check): PRED.json beside it."""
    return Path(pred_path).with_suffix(".json")


def size_scale_of(noise: dict) -> tuple[float, float]:
    """(size_exponent, ref_params) of a sidecar's `noise`, for `fit.noise_scale`: (0, 1), no scaling,
    for a sidecar written before noise scaled with size. ValueError for values `ladder fit` never writes."""
    exponent, ref = noise.get("size_exponent", 0.0), noise.get("ref_params", 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (exponent, ref)) \
            or ref <= 0:
        raise ValueError(f"noise.size_exponent={exponent!r}, noise.ref_params={ref!r}")
    return float(exponent), float(ref)


def load_on_track(path: str | Path) -> OnTrack:
    """The on-track watcher of PRED.csv's run (its only one), with the fit's noise from its sidecar if present."""
    sidecar, checkpoint_sd, rows = sidecar_path(path), None, load_prediction(path)
    if sidecar.is_file():
        try:
            noise = json.loads(sidecar.read_text())["noise"]
            exponent, ref = size_scale_of(noise)  # the noise at the predicted run's size
            params = rows[0]["params"]  # OnTrack refuses params <= 0 by name
            checkpoint_sd = float(noise["checkpoint_sd"]) * (noise_scale(params, exponent, ref) if params > 0 else 1.0)
            profile = [float(v) for v in noise.get("progress_scale", [])]
            if profile:  # per planned step: a run's early evals stray further from the law than its late ones
                if len(profile) != len(PROGRESS_EDGES) - 1 or min(profile) <= 0:
                    raise ValueError(f"noise.progress_scale={profile}")
                tokens = np.array([r["tokens"] for r in rows if r["run"] == rows[0]["run"]])
                checkpoint_sd = checkpoint_sd * checkpoint_scale(tokens / tokens[-1], profile)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"{sidecar} is not the sidecar `moelab ladder fit` writes ({err!r}); delete it or "
                            "refit to rewrite it.") from None
    try:
        return OnTrack(rows, source=str(path), checkpoint_sd=checkpoint_sd)
    except DataError as err:  # the rows' own checks name the run and step; the reader names the file
        raise DataError(f"{path}: {err}") from None


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
