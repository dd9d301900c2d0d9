"""Predicting a ladder's target from its rungs' curves: `moelab ladder fit` and `ladder run`'s last step.

`fit_curves` reads CURVES.csv and TARGET.csv (`contract`), fits the curve law (`fit`), predicts the target
with bands (`bands`, widened by the law's held-out misfit: `calibrate`) and writes PRED.csv and its sidecar.
The sidecar's summary says how far to trust it: the leave-largest-out `self_check`, what the data did not
pin down, what differs between the runs that the law does not model, and what to add for a +-3% band. It also
carries the drift tables the live forecast reads (`drift`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from moelab.errors import ConfigError, DataError
from moelab.ladder import DEFAULT_BAND, DEFAULT_LAW, NUM_BOOTSTRAP
from moelab.ladder.bands import (
    PROGRESS_EDGES,
    CurveBootstrap,
    bootstrap_curve_law,
    predict_with_bands,
    score,
    shared_noise,
)
from moelab.ladder.calibrate import measure_misfit, widen
from moelab.ladder.contract import BAND_COLUMNS, read_curves, read_target_table, write_prediction
from moelab.ladder.curve import CurveLaw, Run, curve_loss, fitted_rows
from moelab.ladder.drift import DEFAULT_FORECAST, FRACTIONS
from moelab.ladder.drift import tables as drift_tables
from moelab.ladder.fit import ALPHA_PRIOR, EXPONENT_BOUNDS, alpha_prior_z, fit_curve_law

__all__ = ["LAWS", "BANDS", "SELF_CHECK_MIN_COVERAGE", "SELF_CHECK_MAX_BAND", "self_check", "fit_curves"]

_MIN_BOOTSTRAP = 20  # fewer refits cannot place a 2.5% quantile between two of them
# The curve laws and band methods `fit_curves` offers (docs/scaling-ladder.md, "Real public curves": the default
# of each was chosen by a rule fixed before scoring).
# `--law`: name -> (the annealing term's form: Tissue et al.'s EMA of the LR drop or Luo et al.'s multi-power drop,
# how the peak LR and the batch enter: `curve.LR_LAWS`, when the alpha prior applies: `fit.ALPHA_PRIORS`).
# Chosen by the rule in docs/scaling-ladder.md.
LAWS = {"tissue": ("tissue", "relative", "always"), "multipower": ("multipower", "relative", "always"),
        "tissue-lr": ("tissue", "progress", "always"), "convex": ("tissue", "convex", "always"),
        "timescale": ("tissue", "timescale", "always"), "tissue-free-alpha": ("tissue", "relative", "unidentified"),
        "noise-temperature": ("tissue", "noise", "always")}
READS_BATCH = ("timescale", "noise")  # the `curve.LR_LAWS` whose exposure is the peak LR per token of batch


def _fitter(law: str) -> Callable[[Sequence[Run]], CurveLaw]:
    """`fit_curve_law` for the `--law` named `law`."""
    form, lr_law, alpha_prior = LAWS[law]
    return partial(fit_curve_law, form=form, lr_law=lr_law, alpha_prior=alpha_prior)
BANDS = ("bootstrap", "calibrated")  # calibrated: widened by the law's held-out misfit (`calibrate`)
# The self-check fails when fewer of the held-out rung's scored evals than this lie inside the 95% band predicted for
# them: its rows share one run offset, so a band that holds the rung's noise and the law's misfit holds nearly all
# of them or misses the run as a whole; under 80% the band understates the miss (docs/scaling-ladder.md).
SELF_CHECK_MIN_COVERAGE = 0.8
# A self-check whose own band is wider than this passes a recipe that misses by as much, so it cannot tell a
# good recipe from a bad one: its verdict is "uninformative" and the prediction is not marked trusted.
SELF_CHECK_MAX_BAND = 0.10


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
    `law` is the `--law` (`LAWS`). With `band="calibrated"` the held-out rung's band is widened by the misfit the
    smaller sizes show among themselves (`calibrate.measure_misfit`), as the target's is by all of them.
    """
    sizes = sorted({r.params for r in curves})
    if len(sizes) < 3:
        return {"skipped": f"the curves hold {len(sizes)} size(s); leaving the largest out needs at least 3."}
    held = [r for r in curves if r.params == sizes[-1]]
    rest = [r for r in curves if r.params != sizes[-1]]
    fit = _fitter(law)
    law = fit(rest)
    bootstrap = bootstrap_curve_law(rest, law, num_bootstrap, seed, progress)
    bands = [predict_with_bands(law, bootstrap, replace(r, loss=None)) for r in held]
    if band == "calibrated":
        try:
            misfit = measure_misfit(rest, fit)
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


def _setup_notes(curves: Sequence[Run], targets: Sequence[Run], lr_law: str = "relative") -> list[str]:
    """Name what differs between the runs that the law does not model: the peak LR and the tokens per step.

    The relative-LR law reads each run's LR relative to its own peak (a ladder tunes the peak per rung) and
    counts tokens, not steps, so runs at another peak LR or batch size are taken as tuned alike. On real
    public ladders both differ (docs/scaling-ladder.md, "Real public curves"): say so rather than guess a
    term. A law with an exposure term (`lr_law` other than "relative") models the peak LR, and the
    "timescale" and "noise" laws the batch too, so those notes would be false for it.
    """
    if lr_law != "relative":
        return [] if lr_law in READS_BATCH else _batch_note(curves, targets)
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
    return notes + _batch_note(curves, targets)


def _batch_note(curves: Sequence[Run], targets: Sequence[Run]) -> list[str]:
    """A note when a target trains on another batch (tokens per step) than every curve: no law term reads it."""
    def per_step(run: Run) -> float:
        return float(run.tokens[-1] / run.steps[-1])

    curve_batches = sorted({float(f"{per_step(r):.3g}") for r in curves})
    off = [r for r in targets if all(abs(per_step(r) / b - 1) > 0.05 for b in curve_batches)]
    if off:
        batches = sorted({f"{per_step(r):.4g}" for r in off})
        return [f"{len(off)} of {len(targets)} target run(s) train on {'/'.join(batches)} tokens per step, "
                f"the curves on {'/'.join(f'{b:.4g}' for b in curve_batches)}: the law has no batch-size term (it "
                "counts tokens), so what the batch change does to the loss is not in the prediction or its band."]
    return []


def _summary_of(law: CurveLaw, bootstrap: CurveBootstrap, curves: list[Run], targets: list[Run],
                predictions: dict[str, dict[str, np.ndarray]], check: dict, num_bootstrap: int, seed: int,
                out: Path) -> dict:
    names = {"E": "e", "A": "a", "alpha": "alpha", "B": "b", "beta": "beta", "C": "c", "tau_steps": "tau"}
    if law.form == "multipower":
        names.update({"power": "power", "gamma": "gamma"})
    if law.lr_law != "relative":
        names.update({"rho": "rho", "exposure_ref": "exposure_ref"})
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
               + ("; S2 = LD(t) / B, the multi-power drop (Luo et al. 2025)" if law.form == "multipower" else "")
               + {"relative": "", "progress": "; S1 scaled by x^rho, x the run's peak LR over exposure_ref",
                  "convex": "; S1 and C scaled by x^rho, x the run's peak LR over exposure_ref (Schaipp et al. 2025)",
                  "timescale": "; S1 scaled by x^rho, x the run's peak LR per token of batch over exposure_ref",
                  "noise": "; - C*S2(t) read as + C*x^rho*(1 - S2(t)), x the run's peak LR per token of batch over "
                           "exposure_ref"}[law.lr_law],
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
    band_met = target["band95_half_width"] <= BAND_GOAL
    if band_met:  # only the self-check is missing or failed
        text = (f"The band is within +-{BAND_GOAL:.0%} already (+-{target['band95_half_width']:.1%}), but no passed "
                "self-check stands behind it")
    else:
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
    if not band_met:
        text += (". For a ladder moelab trained, `moelab ladder plan` of its recipe file with `--fix --runs` and the "
                 "ladder's output folder writes the seeds into the recipe")
    advice["text"] = text + "."
    return advice


def fit_curves(curves_path: str | Path, target_path: str | Path, out_path: str | Path, *,
               num_bootstrap: int = NUM_BOOTSTRAP, seed: int = 0, same_data_order: bool = False,
               exclude: Mapping[str, str] | None = None, progress: Callable[[Iterable], Iterable] = iter,
               law: str = DEFAULT_LAW, band: str = DEFAULT_BAND) -> dict:
    """Fit the curve law on CURVES.csv, write PRED.csv for TARGET.csv and its sidecar PRED.json.

    PRED.json holds the returned summary: the law, its noise, the leave-largest-out `self_check`
    and notes. Curves of one size fit the schedule part alone and predict that size only; with
    `same_data_order` (the curves and the target share one seed and data order: a schedule sweep)
    the target's rows also borrow the noise the curves share at each step (`bands.SharedNoise`). Every input
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
    target = read_target_table(target_path)
    targets = target.runs
    clash = [c for c in BAND_COLUMNS if c in target.header]
    if clash:
        raise DataError(f"{target_path} already has column(s) {', '.join(clash)}, which PRED.csv adds; "
                        "pass the planned schedule without predictions.")
    name, fit = law, _fitter(law)
    try:
        law = fit(curves)
        for run in targets:
            curve_loss(law, run)  # a one-size law refuses another size before any bootstrap
        shared = shared_noise(curves, law) if same_data_order else None
        bootstrap = bootstrap_curve_law(curves, law, num_bootstrap, seed, progress)
        check = self_check(curves, num_bootstrap, seed, progress, band, name)
    except DataError as err:
        raise DataError(f"{curves_path}: {err}") from err
    misfit, unmeasured = None, None
    if band == "calibrated":
        try:
            misfit = measure_misfit(curves, fit, same_data_order)
        except DataError as err:
            unmeasured = (f"the law's misfit on runs it did not see could not be measured ({err}): the bands hold "
                          "the bootstrap's noise alone and are too narrow wherever the law misses.")
    predictions = {run.name: predict_with_bands(law, bootstrap, run, shared) for run in targets}
    if misfit is not None:
        predictions = {run.name: widen(predictions[run.name], misfit, run) for run in targets}
    summary = _summary_of(law, bootstrap, curves, targets, predictions, check, num_bootstrap, seed, out_path)
    drifts = drift_tables(curves, law, targets)
    summary["forecast"] = {"method": DEFAULT_FORECAST, "fractions": list(FRACTIONS),
                           "runs": {run: {m: d.as_json() for m, d in by.items()} for run, by in drifts.items()}}
    summary["band"] = band
    summary["law_name"] = name
    lr_law = LAWS[name][1]
    if lr_law != "relative" and law.lr_law == "relative":
        # First when asked for by name (the user expected the term); after the fit's own notes for the default,
        # where most ladders (one peak LR per rung) fall back and nothing is amiss.
        summary["notes"].insert(0 if name != DEFAULT_LAW else len(summary["notes"]),
                                f"--law {name}: no size of the curves has runs at two "
                                + ("values of peak LR per token of batch" if lr_law in READS_BATCH else "peak LRs")
                                + ", so the LR term cannot be told from the size term: the fit is tissue's "
                                  "(the relative-LR law), and so is the prediction.")
    elif lr_law != "relative":
        summary["notes"].append(f"--law {name}: rho = {law.rho:.3f} on the runs' "
                                + ("peak LR per token of batch" if lr_law in READS_BATCH else "peak LR")
                                + f" over {law.exposure_ref:.4g}" + (" (at its bound 0: the relative-LR law)"
                                                                     if law.rho <= 1e-6 else "") + ".")
    summary["notes"].extend(_setup_notes(curves, targets, law.lr_law))
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

    write_prediction(out_path, target, predictions, summary)
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
