"""A real scaling ladder on the embedded corpus, scored: predicted vs actual loss of a larger target.

    python benchmarks/ladder_cpu.py --json                       # experiments/ladder-cpu.yaml
    python benchmarks/ladder_cpu.py --recipe experiments/ladder-cpu-shallow.yaml --out runs/ladder-cpu-shallow
    python benchmarks/ladder_cpu.py --seeds 3                    # the target with train.seed 0, 1, 2
    python benchmarks/ladder_cpu.py --task                       # also predicts the arithmetic task's accuracy

Trains the recipe's rungs, fits the schedule-aware curve law on every eval of every rung (with the
leave-largest-out self-check), predicts the target's whole eval curve with bands, then trains the
target with `--seeds` seeds, replays the on-track watcher (band and live forecast) over each one's
evals, and reports, per seed and over the seeds, the final-loss error and the curve MAPE over the
evals after the first 10% of tokens, the 95% band's coverage, and the seed-to-seed spread of the
final loss: an error below that spread is the floor (likewise `seed_floor_mape` for the per-seed
MAPE: what a prediction of the recipe's true mean curve would score, from the seeds). Everything is resumable: re-running reuses finished rungs and finished targets.

With `--task` every run also keeps a checkpoint at each quarter of its steps, each checkpoint is scored on the
held-out arithmetic problems (`moelab.evals.arithmetic`, cached in OUT/task_points.csv), and the rungs'
points predict the target's final exact-match accuracy (`moelab.ladder.task.predict_task`):
`task_predicted`, its 95% band, `task_actual` (the mean over the target's seeds) and `task_abs_error`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.ladder.bands import score
from moelab.ladder.contract import load_prediction, read_curves
from moelab.ladder.on_track import load_on_track
from moelab.ladder.run import TASK_POINTS, curve_rows, plan_ladder, run_ladder, write_csv
from moelab.ladder.rungs import load_recipe
from moelab.ladder.task_points import score_runs, with_task_checkpoints
from moelab.train.loop import train
from moelab.train.outputs import SUMMARY

def task_result(predicted: dict, out: Path, targets) -> dict:
    """`run_ladder(task=True)`'s prediction (made before any target trained) against the target seeds' mean."""
    if "error" in predicted:  # e.g. two rung sizes: the task law needs three computes
        return {"task_error": predicted["error"]}
    finals = [p for p in score_runs(targets, out / TASK_POINTS) if p.final]
    actual = statistics.fmean(p.accuracy for p in finals)
    return {**predicted, "task_actual": actual, "task_abs_error": abs(predicted["task_predicted"] - actual),
            "task_inside_band": predicted["task_lo95"] <= actual <= predicted["task_hi95"],
            "task_loss_actual": statistics.fmean(p.task_loss for p in finals), "task_problems": predicted["problems"]}


def seed_dir(out: Path, seed: int) -> Path:
    return out / "target" if seed == 0 else out / f"target-seed{seed}"


def score_seed(pred_path: Path, target, run_dir: Path) -> dict:
    """One trained target against PRED.csv, by `bands.score`, and the watcher replayed over its evals.

    The targets train without a watcher, so a run can be scored against any prediction; `OnTrack`
    sees nothing but each eval's step and `eval/mean`, so replaying it is what watching live gives.
    """
    tmp = run_dir / "curve.csv"
    write_csv(tmp, curve_rows(target, run_dir))
    (run,) = read_curves(tmp)
    by_step = {int(r["step"]): r for r in load_prediction(pred_path)}
    keep = np.array([int(s) in by_step for s in run.steps])
    run = replace(run, steps=run.steps[keep], tokens=run.tokens[keep], lr=run.lr[keep], loss=run.loss[keep])
    bands = {k: np.array([by_step[int(s)][k] for s in run.steps]) for k in ("loss_pred", "lo95", "hi95")}
    watcher, rules, forecasts = load_on_track(pred_path), [], []
    for step, loss in zip(run.steps, run.loss):
        fields, incidents = watcher.watch(int(step), float(loss))
        rules += [i["rule"] for i in incidents]
        if "forecast/final" in fields:
            forecasts.append([int(step), fields["forecast/final"]])
    return {**score(bands, run), "off_track_incidents": rules.count("off_track"),
            "forecast_off_track_incidents": rules.count("forecast_off_track"), "forecast_final": forecasts}


def seed_floors(out: Path, num_seeds: int) -> dict:
    """What the seeds' own noise leaves: the prediction's MAPE against the seeds' mean curve, and the
    per-seed MAPE a prediction that knew the recipe's true mean curve would score (the floor).

    The floor is each seed's MAPE against the mean of the other k - 1 seeds times sqrt((k - 1) / k):
    that mean is itself off the true curve, which makes the difference's variance k / (k - 1) times
    one seed's (1.5x for 3 seeds), and a MAPE scales with the sd. Over the evals after the first 10%
    of tokens, like `bands.score`; empty with fewer than 2 seeds.
    """
    if num_seeds < 2:
        return {}
    runs = [read_curves(seed_dir(out, s) / "curve.csv")[0] for s in range(num_seeds)]
    by_step = {int(r["step"]): r["loss_pred"] for r in load_prediction(out / "prediction.csv")}
    late = runs[0].tokens >= 0.1 * runs[0].tokens[-1]
    losses = np.array([r.loss for r in runs])[:, late]
    pred = np.array([by_step[int(s)] for s in runs[0].steps[late]])
    others = [np.delete(losses, i, axis=0).mean(0) for i in range(num_seeds)]
    return {"mape_vs_seed_mean": float(np.mean(np.abs(pred / losses.mean(0) - 1))),
            "seed_floor_mape": float(np.mean([np.mean(np.abs(o / l - 1)) for o, l in zip(others, losses)])
                                     * np.sqrt((num_seeds - 1) / num_seeds))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="experiments/ladder-cpu.yaml")
    parser.add_argument("--out", default="runs/ladder-cpu")
    parser.add_argument("--seeds", type=int, default=3, help="train the target with train.seed 0..SEEDS-1")
    parser.add_argument("--task", action="store_true", help="also predict the arithmetic task's final accuracy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    recipe, out = load_recipe(args.recipe), Path(args.out)
    start = time.perf_counter()
    prepare = with_task_checkpoints if args.task else (lambda cfg: cfg)
    fit = run_ladder(recipe, out, train, task=args.task)
    ladder_s = time.perf_counter() - start
    _, target = plan_ladder(recipe)
    seeds, targets = {}, []
    for seed in range(args.seeds):
        cfg = replace(target, train=replace(target.train, seed=seed))
        run_dir = seed_dir(out, seed)
        targets.append((run_dir.name, cfg, run_dir))
        if not (run_dir / SUMMARY).is_file():
            train(prepare(cfg), run_dir)
        seeds[seed] = score_seed(out / "prediction.csv", cfg, run_dir)
    floors = seed_floors(out, args.seeds)
    finals = [s["final_actual"] for s in seeds.values()]
    mean_final = statistics.fmean(finals)
    predicted = fit["targets"][0]["loss_pred"]
    result = {
        "benchmark": "ladder_cpu",
        "recipe": args.recipe,
        "rungs": [str(list(s)) for s in recipe.shapes],
        "lr_exponent": recipe.lr_exponent,
        "target": target.name,
        "target_active_params": accounting.count_params(target.model).active,
        "target_tokens": accounting.train_tokens(target),
        "law": fit["law"],
        "params": fit["params"],
        "noise": fit["noise"],
        "ladder_seconds": ladder_s,
        "total_seconds": time.perf_counter() - start,
        "final_predicted": predicted,
        "final_lo95": fit["targets"][0]["lo95"],
        "final_hi95": fit["targets"][0]["hi95"],
        "band95_half_width": fit["targets"][0]["band95_half_width"],
        "final_actual_mean": mean_final,
        "final_error_vs_seed_mean": (predicted - mean_final) / mean_final,
        "final_error_max_abs": max(abs(s["final_error"]) for s in seeds.values()),
        "seed_spread": statistics.stdev(finals) / mean_final if len(finals) > 1 else None,
        "mape_after_10pct": statistics.fmean(s["mape_after_10pct"] for s in seeds.values()),
        **floors,
        "band95_coverage": statistics.fmean(s["band95_coverage"] for s in seeds.values()),
        "self_check": fit["self_check"],
        "excluded": fit.get("excluded", []),
        "advice": fit.get("advice"),
        "notes": fit["notes"],
        "seeds": seeds,
    }
    if args.task:
        result.update(task_result(fit["task"], out, targets))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
