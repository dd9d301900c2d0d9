"""A real scaling ladder on the embedded corpus, scored: predicted vs actual loss of a larger target.

    python benchmarks/ladder_cpu.py --json                       # experiments/ladder-cpu.yaml
    python benchmarks/ladder_cpu.py --recipe R.yaml --out DIR

Trains the recipe's rungs, fits the schedule-aware curve law on every eval of every rung, predicts
the target's whole eval curve with bands, then trains the target against that prediction and
reports the final-loss error and the curve MAPE over the evals after the first 10% of tokens.
Everything is resumable: re-running reuses finished rungs and the finished target.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.ladder.predict import load_on_track
from moelab.ladder.rungs import load_recipe
from moelab.ladder.run import curve_rows, plan_ladder, run_ladder
from moelab.train.loop import train
from moelab.train.outputs import INCIDENTS, SUMMARY


def score(pred_path: Path, actual: list[dict], total_tokens: int) -> dict:
    """Final-loss error and MAPE of the predicted curve against the actual evals."""
    pred = {int(r["step"]): r for r in csv.DictReader(open(pred_path))}
    rows = [(r, pred[r["step"]]) for r in actual if r["step"] in pred]
    late = [(a, p) for a, p in rows if a["tokens"] >= 0.1 * total_tokens]
    ape = [abs(float(p["loss_pred"]) - a["loss"]) / a["loss"] for a, p in late]
    final_actual, final_pred = rows[-1][0]["loss"], float(rows[-1][1]["loss_pred"])
    inside = [float(p["lo95"]) <= a["loss"] <= float(p["hi95"]) for a, p in late]
    return {
        "final_actual": final_actual,
        "final_predicted": final_pred,
        "final_lo95": float(rows[-1][1]["lo95"]),
        "final_hi95": float(rows[-1][1]["hi95"]),
        "final_error": abs(final_pred - final_actual) / final_actual,
        "mape_after_10pct": float(np.mean(ape)),
        "evals_scored": len(late),
        "band95_coverage": float(np.mean(inside)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="experiments/ladder-cpu.yaml")
    parser.add_argument("--out", default="runs/ladder-cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    recipe, out = load_recipe(args.recipe), Path(args.out)
    start = time.perf_counter()
    fit = run_ladder(recipe, out, lambda cfg, run_dir: train(cfg, run_dir))
    ladder_s = time.perf_counter() - start
    _, target = plan_ladder(recipe)
    target_dir = out / "target"
    if not (target_dir / SUMMARY).is_file():
        train(target, target_dir, watchers=[load_on_track(out / "prediction.csv")])
    total_s = time.perf_counter() - start
    result = {
        "benchmark": "ladder_cpu",
        "recipe": args.recipe,
        "rungs": [{"name": r["name"], "active_params": r["active_params"]} for r in fit.get("params_by_run", [])]
        or [str(s) for s in recipe.shapes],
        "target": target.name,
        "target_active_params": accounting.count_params(target.model).active,
        "target_tokens": accounting.train_tokens(target),
        "law": fit["law"],
        "ladder_seconds": ladder_s,
        "total_seconds": total_s,
        "off_track_incidents": sum(1 for line in open(target_dir / INCIDENTS)
                                   if json.loads(line)["rule"] == "off_track"),
        **score(out / "prediction.csv", curve_rows(target, target_dir), accounting.train_tokens(target)),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
