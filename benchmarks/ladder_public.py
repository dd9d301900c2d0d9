"""The scaling ladder on real public loss curves: fit and score every case, per method.

    python benchmarks/ladder_public.py --json                                   # the default method, every case
    python benchmarks/ladder_public.py --json --method tissue:bootstrap --method tissue:calibrated \\
        --out benchmarks/results/ladder-public-2026-12-05.json                  # compare methods, keep the result

A case is a folder holding `curves.csv` (fit), `target.csv` (predict) and `truth.csv` (the target rows
with their observed `loss`), as in `../shared/ladder-dev-curves/` (its README names the sources and
licenses; the curves are read from there at run time, never copied into this repository). Each case
is fitted as `moelab ladder fit` fits it (`predict.fit_curves`; `--same-data-order` where the case's
README says so) and scored on its target rows past 10% of each run's tokens (the `bands.score`
convention). Also scored, beside them: `cpu-schedules-tiny`, the committed CPU schedule sweep
(`tests/data/schedules-tiny.csv`), each schedule predicted from the other four.

With `--forecast` every development case also scores the live forecast of `moelab train --predicted` (issue 60),
by each forecast method (`drift.METHODS`): each target's evals up to 10%, 25%, 50% and 75% of its steps are
replayed through the on-track watcher built from the case's PRED.csv and sidecar (`on_track.load_on_track`), and
its last `forecast/final` and 95% band are scored against the run's observed final loss: mean and largest |error|,
how often the band holds the final, and the relative 95% interval score. The method the live forecast uses
(`drift.DEFAULT_FORECAST`) was chosen by the same rule, fixed before scoring: the lowest mean over the four
development cases of the forecast's mean interval score over the fractions, ties within 1% to the simpler
(the order of `drift.METHODS`).

A method is LAW:BAND (`predict.LAWS`, `predict.BANDS`). The rule that picks the default among methods
was fixed before any was scored (docs/scaling-ladder.md, "Real public curves"): the lowest mean over
the four development cases of the mean relative 95% interval score.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moelab.errors import ConfigError, DataError
from moelab.ladder import DEFAULT_BAND, DEFAULT_LAW, NUM_BOOTSTRAP
from moelab.ladder.contract import load_prediction, read_curves
from moelab.ladder.drift import DEFAULT_FORECAST
from moelab.ladder.drift import METHODS as FORECASTS
from moelab.ladder.on_track import load_on_track
from moelab.ladder.predict import BANDS, LAWS, fit_curves

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = REPO.parent / "shared" / "ladder-dev-curves"
CPU_SWEEP = REPO / "tests" / "data" / "schedules-tiny.csv"
DEV_CASES = ("sp-size-210m", "sp-size-360m", "s124-longer", "pythia-size-410m")  # the selection rule's cases
SAME_DATA_ORDER = {"s124-longer"}  # one seed and data order (the cases' README: "fit with --same-data-order")
ALPHA = 0.05  # the 95% band's interval score
FORECAST_FRACTIONS = (0.10, 0.25, 0.50, 0.75)  # of a target's steps seen before its final loss is forecast


def interval_score(lo: np.ndarray, hi: np.ndarray, y: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """[R] the (1 - alpha) interval score of [lo, hi] at y, relative to y (Gneiting & Raftery 2007, eq. 43)."""
    penalty = (2 / alpha) * (np.maximum(lo - y, 0.0) + np.maximum(y - hi, 0.0))
    return (hi - lo + penalty) / y


def score_case(pred_path: Path, truth_path: Path) -> dict:
    """Every metric of one fitted case: its PRED.csv against truth.csv, rows past 10% of each run's tokens."""
    truth = {run.name: run for run in read_curves(truth_path)}
    rows = load_prediction(pred_path)
    columns = {}
    finals = {}
    for name, run in truth.items():
        pred = [r for r in rows if r["run"] == name]
        if [r["step"] for r in pred] != list(run.steps):
            raise DataError(f"{pred_path}: run {name!r} does not have truth.csv's steps.")
        band = {k: np.array([r[k] for r in pred]) for k in ("loss_pred", "lo80", "hi80", "lo95", "hi95")}
        late = (run.tokens >= 0.1 * run.tokens[-1]) & np.isfinite(band["lo95"])
        finals[name] = float(band["loss_pred"][-1] / run.loss[-1] - 1)
        for k, v in {**band, "loss": run.loss}.items():
            columns.setdefault(k, []).append(v[late])
    c = {k: np.concatenate(v) for k, v in columns.items()}
    y = c["loss"]
    errors = np.abs(list(finals.values()))
    return {
        "targets": len(finals), "rows_scored": int(len(y)),
        "mape": float(np.mean(np.abs(c["loss_pred"] / y - 1))),
        "final_error_mean_abs": float(errors.mean()), "final_error_max_abs": float(errors.max()),
        "coverage80": float(np.mean((c["lo80"] <= y) & (y <= c["hi80"]))),
        "coverage95": float(np.mean((c["lo95"] <= y) & (y <= c["hi95"]))),
        "half_width95_median": float(np.median((c["hi95"] - c["lo95"]) / 2 / c["loss_pred"])),
        "interval_score95": float(np.mean(interval_score(c["lo95"], c["hi95"], y))),
        "final_errors": finals,
    }


def score_forecast(pred_path: Path, truth_path: Path, method: str, fractions=FORECAST_FRACTIONS) -> dict:
    """The live forecast (`method`, of `drift.METHODS`) of each target's final loss after `fractions` of its steps,
    against the observed final.

    As `moelab train --predicted` forecasts: the watcher of PRED.csv's run (with the sidecar's noise and drift
    table) sees each eval up to the fraction, in order; its last `forecast/final`, `forecast/lo95` and
    `forecast/hi95` are scored (before its first checked eval, the prediction's own final and band). The rule's
    score: the mean over the fractions of the mean relative 95% interval score of the finals."""
    truth = {run.name: run for run in read_curves(truth_path)}
    scored = {}
    for fraction in fractions:
        errors, inside, widths, scores = {}, [], [], []
        for name, run in truth.items():
            track = load_on_track(pred_path, run=name, forecast=method)
            last = {"forecast/final": track.forecast.final_pred, "forecast/lo95": track.forecast.lo95,
                    "forecast/hi95": track.forecast.hi95}
            for step, loss in zip(run.steps, run.loss):
                if step > fraction * run.steps[-1]:
                    break
                fields, _ = track.watch(int(step), float(loss))
                last = {k: fields[k] for k in last} if "forecast/final" in fields else last
            final = float(run.loss[-1])
            errors[name] = last["forecast/final"] / final - 1
            inside.append(last["forecast/lo95"] <= final <= last["forecast/hi95"])
            widths.append((last["forecast/hi95"] - last["forecast/lo95"]) / 2 / final)
            scores.append(float(interval_score(last["forecast/lo95"], last["forecast/hi95"], final)))
        magnitudes = np.abs(list(errors.values()))
        scored[f"{fraction:g}"] = {"final_error_mean_abs": float(magnitudes.mean()),
                                   "final_error_max_abs": float(magnitudes.max()),
                                   "coverage95": float(np.mean(inside)),
                                   "half_width95_median": float(np.median(widths)),
                                   "interval_score95": float(np.mean(scores)),
                                   "final_errors": errors}
    return {"rule_score": float(np.mean([s["interval_score95"] for s in scored.values()])), "fractions": scored}


def best_forecast(scores: dict[str, float], tie: float = 0.01) -> str:
    """The forecast method with the lowest rule score, or the simplest (first in `drift.METHODS`) within `tie` of it."""
    best = min(scores.values())
    return next(m for m in FORECASTS if m in scores and scores[m] <= best * (1 + tie))


def run_case(curves: Path, target: Path, truth: Path, law: str, band: str, same_data_order: bool,
             num_bootstrap: int, work: Path, forecast: bool = False) -> dict:
    """Fit one case as `moelab ladder fit` does, time it, and score it (and its live forecast, with `forecast`)."""
    out = work / "pred.csv"
    start = time.perf_counter()
    summary = fit_curves(curves, target, out, num_bootstrap=num_bootstrap, same_data_order=same_data_order,
                         law=law, band=band)
    seconds = time.perf_counter() - start
    check = summary["self_check"]
    return {**score_case(out, truth), "self_check": check.get("verdict", "skipped"),
            "self_check_final_error": check.get("final_error"), "fit_seconds": seconds,
            "law": summary["law"], "notes": summary["notes"],
            **({"forecast": {m: score_forecast(out, truth, m) for m in FORECASTS}} if forecast else {})}


def _write_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def run_cpu_sweep(law: str, band: str, num_bootstrap: int, work: Path) -> dict:
    """`cpu-schedules-tiny`: each schedule of the committed CPU sweep predicted from the other four, pooled."""
    with CPU_SWEEP.open(newline="") as f:
        table = list(csv.DictReader(f))
    names = list(dict.fromkeys(r["run"] for r in table))
    columns = list(table[0].keys())
    parts, seconds, verdicts = [], [], []
    for name in names:
        case = work / name
        case.mkdir()
        _write_rows(case / "curves.csv", [r for r in table if r["run"] != name], columns)
        _write_rows(case / "target.csv", [r for r in table if r["run"] == name], [c for c in columns if c != "loss"])
        _write_rows(case / "truth.csv", [r for r in table if r["run"] == name], columns)
        parts.append(run_case(case / "curves.csv", case / "target.csv", case / "truth.csv", law, band, True,
                              num_bootstrap, case))
        seconds.append(parts[-1]["fit_seconds"])
        verdicts.append(parts[-1]["self_check"])
    rows = np.array([p["rows_scored"] for p in parts], dtype=np.float64)
    pooled = {k: float(np.average([p[k] for p in parts], weights=rows))
              for k in ("mape", "coverage80", "coverage95", "interval_score95")}
    errors = np.abs([e for p in parts for e in p["final_errors"].values()])
    return {"targets": len(parts), "rows_scored": int(rows.sum()), **pooled,
            "final_error_mean_abs": float(errors.mean()), "final_error_max_abs": float(errors.max()),
            "half_width95_median": float(np.median([p["half_width95_median"] for p in parts])),
            "final_errors": {n: e for p in parts for n, e in p["final_errors"].items()},
            "self_check": sorted(set(verdicts))[0] if len(set(verdicts)) == 1 else "mixed",
            "fit_seconds": max(seconds), "law": parts[0]["law"], "notes": []}


def run_method(cases_dir: Path, law: str, band: str, num_bootstrap: int, cases: list[str], log,
               forecast: bool = False) -> dict:
    results = {}
    for name in cases:
        log(f"{law}:{band} {name} ...")
        with tempfile.TemporaryDirectory() as tmp:
            if name == "cpu-schedules-tiny":
                results[name] = run_cpu_sweep(law, band, num_bootstrap, Path(tmp))
            else:
                case = cases_dir / name
                results[name] = run_case(case / "curves.csv", case / "target.csv", case / "truth.csv", law, band,
                                         name in SAME_DATA_ORDER, num_bootstrap, Path(tmp), forecast)
        r = results[name]
        log(f"  MAPE {r['mape']:.2%}  |final| {r['final_error_mean_abs']:.2%} (max {r['final_error_max_abs']:.2%})  "
            f"cov80 {r['coverage80']:.0%} cov95 {r['coverage95']:.0%}  half-width {r['half_width95_median']:.2%}  "
            f"IS {r['interval_score95']:.4f}  self-check {r['self_check']}  {r['fit_seconds']:.0f} s")
        for method, scored in r.get("forecast", {}).items():
            log(f"  forecast {method}: rule score {scored['rule_score']:.4f}")
            for fraction, f in scored["fractions"].items():
                log(f"    after {float(fraction):.0%}: |final| {f['final_error_mean_abs']:.2%} "
                    f"(max {f['final_error_max_abs']:.2%})  cov95 {f['coverage95']:.0%}  "
                    f"half-width {f['half_width95_median']:.2%}  IS {f['interval_score95']:.4f}")
    dev = [results[c]["interval_score95"] for c in DEV_CASES if c in results]
    complete = len(dev) == len(DEV_CASES)
    out = {"law": law, "band": band, "rule_score": float(np.mean(dev)) if complete else None, "cases": results}
    if forecast and complete:
        out["forecast_rule_scores"] = {m: float(np.mean([results[c]["forecast"][m]["rule_score"] for c in DEV_CASES]))
                                       for m in FORECASTS}
    return out


def _method(text: str) -> tuple[str, str]:
    law, _, band = text.partition(":")
    if law not in LAWS or band not in BANDS:
        raise argparse.ArgumentTypeError(f"{text!r}: a method is LAW:BAND with LAW in {', '.join(LAWS)} and BAND in "
                                         f"{', '.join(BANDS)}, e.g. {DEFAULT_LAW}:{DEFAULT_BAND}.")
    return law, band


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases-dir", type=Path, default=DEFAULT_CASES,
                        help=f"folder of cases (curves.csv, target.csv, truth.csv each); default {DEFAULT_CASES}")
    parser.add_argument("--method", type=_method, action="append",
                        help=f"LAW:BAND to fit and score (repeatable); default {DEFAULT_LAW}:{DEFAULT_BAND}")
    parser.add_argument("--case", action="append", help="score only this case (repeatable); default: every case")
    parser.add_argument("--bootstrap", type=int, default=NUM_BOOTSTRAP, help="bootstrap refits per fit")
    parser.add_argument("--forecast", action="store_true",
                        help="also score the live forecast after 10/25/50/75%% of each target's steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = parser.parse_args(argv)

    if not args.cases_dir.is_dir():
        print(f"Error: --cases-dir {args.cases_dir} does not exist. It should hold the public curves' cases "
              "(../shared/ladder-dev-curves beside the repository, each case a folder with curves.csv, target.csv "
              "and truth.csv); pass --cases-dir PATH.", file=sys.stderr)
        return 2
    found = sorted(p.name for p in args.cases_dir.iterdir() if (p / "curves.csv").is_file())
    cases = args.case or found + ["cpu-schedules-tiny"]
    unknown = [c for c in cases if c not in found and c != "cpu-schedules-tiny"]
    if unknown:
        print(f"Error: no case {', '.join(unknown)} under {args.cases_dir}; it holds {', '.join(found) or 'none'} "
              "(and cpu-schedules-tiny, from this repository).", file=sys.stderr)
        return 2
    methods = args.method or [(DEFAULT_LAW, DEFAULT_BAND)]

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        results = {f"{law}:{band}": run_method(args.cases_dir, law, band, args.bootstrap, cases, log, args.forecast)
                   for law, band in methods}
    except (ConfigError, DataError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    scored = {name: r["rule_score"] for name, r in results.items() if r["rule_score"] is not None}
    report = {"what": "moelab ladder fit on real public loss curves (benchmarks/ladder_public.py)",
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {platform.processor() or '?'}",
              "cases_dir": str(args.cases_dir), "bootstrap": args.bootstrap,
              "rule": "lowest mean over the dev cases of the mean relative 95% interval score (docs/scaling-ladder.md)",
              "dev_cases": list(DEV_CASES), "default": f"{DEFAULT_LAW}:{DEFAULT_BAND}",
              "best_by_rule": min(scored, key=scored.get) if scored else None, "methods": results}
    if args.forecast:
        report["default_forecast"] = DEFAULT_FORECAST
        report["forecast_best_by_rule"] = {name: best_forecast(r["forecast_rule_scores"])
                                           for name, r in results.items() if "forecast_rule_scores" in r}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        for name, r in results.items():
            print(f"{name}: rule score {r['rule_score']}")
            for case, m in r["cases"].items():
                print(f"  {case:20s} MAPE {m['mape']:.2%} |final| {m['final_error_mean_abs']:.2%} "
                      f"(max {m['final_error_max_abs']:.2%}) cov80 {m['coverage80']:.0%} cov95 {m['coverage95']:.0%} "
                      f"half-width {m['half_width95_median']:.2%} IS {m['interval_score95']:.4f} "
                      f"self-check {m['self_check']} {m['fit_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
