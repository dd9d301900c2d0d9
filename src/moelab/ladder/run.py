"""Running a ladder: plan the rungs and the target, train the rungs, fit the curve law, predict the target.

    moelab ladder run experiments/ladder-cpu.yaml --out runs/ladder

`plan_ladder` and `fit_and_predict` are the one plan and the one fit of every ladder: `run_ladder`
(`moelab ladder run`, benchmarks/ladder_cpu.py) trains the rungs one after another under `--out`;
an experiment spec's `ladder:` runs the same plan and fit as steps of its DAG (`lab.experiment`).

Layout of `--out`:

    rungs/<name>/      each rung's training run (resumable: re-running the command skips or resumes)
    curves.csv         every eval of every rung, in the CURVES.csv contract (`ladder.contract`)
    target.csv         the target's planned schedule at its eval steps (TARGET.csv)
    target.yaml        the target's run config, as predicted: `moelab train target.yaml --predicted ...`
    prediction.csv     target rows + loss_pred, lo80, hi80, lo95, hi95 (PRED.csv)
    prediction.json    its sidecar: the fitted law, its noise, the leave-largest-out self-check, notes
    task_points.csv    with --task: every kept rung checkpoint on the arithmetic task (ladder.task_points)
    task_prediction.json  with --task: the target's final task accuracy and its 95% band (ladder.task)

The loss of a checkpoint is `eval/mean`, the mean held-out loss over the data domains.
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from moelab.accounting import count_params, tokens_per_step
from moelab.config import RunConfig, dump_yaml
from moelab.errors import DataError
from moelab.ladder import NUM_BOOTSTRAP
from moelab.ladder.contract import PREDICTION
from moelab.ladder.predict import fit_curves
from moelab.ladder.rungs import LadderRecipe, check_monotone, rung_flags, rungs_of, train_sizes
from moelab.ladder.task import predict_task
from moelab.ladder.task_points import TASK_PROBLEMS, checkpoint_compute, score_runs, with_task_checkpoints
from moelab.presets import EVALS_PER_RUN
from moelab.train.outputs import METRICS, SUMMARY, read_jsonl

__all__ = ["plan_ladder", "rung_dir", "curve_rows", "target_rows", "write_csv", "fit_and_predict", "run_ladder",
           "predict_ladder_task", "TASK_POINTS", "TASK_PREDICTION"]

CURVE_LOSS = "eval/mean"
TASK_POINTS, TASK_PREDICTION = "task_points.csv", "task_prediction.json"  # `run_ladder(task=True)`'s files


def curve_rows(cfg: RunConfig, run_dir: Path) -> list[dict]:
    """One CURVES.csv row per eval record of a finished run."""
    params = count_params(cfg.model).active
    rows = []
    for record in read_jsonl(run_dir / METRICS):
        if CURVE_LOSS in record:
            rows.append({"run": cfg.name, "params": params, "step": record["step"], "tokens": record["tokens"],
                         "lr": record["lr"], "loss": record[CURVE_LOSS]})
    return rows


def target_rows(cfg: RunConfig) -> list[dict]:
    """TARGET.csv rows: the planned LR and tokens at each step the target will evaluate."""
    from moelab.train.schedule import learning_rate

    lr = learning_rate(cfg.train)
    params = count_params(cfg.model).active
    step_tokens = tokens_per_step(cfg)
    evals = sorted({*range(cfg.train.eval_every, cfg.train.steps + 1, cfg.train.eval_every), cfg.train.steps})
    # The loop logs the LR it used for the step that ends at `step`, i.e. schedule(step - 1).
    return [{"run": cfg.name, "params": params, "step": s, "tokens": s * step_tokens, "lr": float(lr(s - 1))}
            for s in evals]


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plan_ladder(recipe: LadderRecipe) -> tuple[list[RunConfig], RunConfig]:
    """The rungs, smallest first, and the target as it is trained and predicted.

    ConfigError when the rungs do not grow in active parameters. The target warms up for 5% and
    evaluates every 5% of its steps, like the rungs.
    """
    rungs = rungs_of(recipe)
    check_monotone(rungs)
    cfg = recipe.target
    every = max(1, cfg.train.steps // EVALS_PER_RUN)
    return rungs, replace(cfg, train=replace(cfg.train, eval_every=every, warmup_steps=every))


def rung_dir(out: Path, cfg: RunConfig) -> Path:
    """Where `run_ladder` trains a rung: OUT/rungs/<name>."""
    return out / "rungs" / cfg.name


def fit_and_predict(rungs: list[tuple[RunConfig, Path]], target: RunConfig, out: Path,
                    num_bootstrap: int = NUM_BOOTSTRAP, progress: Callable[[Iterable], Iterable] = iter) -> dict:
    """From finished rungs (config, run dir): write curves.csv, target.csv, prediction.csv and its sidecar.

    curves.csv holds every rung; the fit leaves out the rungs the plan's checks flag (`rungs.rung_flags`:
    too short, regrouped heads, another depth, repeated data), each with its reason in the summary's
    `excluded`, while two sizes remain (`predict.fit_curves`).
    """
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "curves.csv", [row for cfg, run_dir in rungs for row in curve_rows(cfg, run_dir)])
    write_csv(out / "target.csv", target_rows(target))
    (out / "target.yaml").write_text(dump_yaml(target))  # the run the prediction is for, ready to train
    flags = rung_flags([cfg for cfg, _ in rungs], target, train_sizes(target))
    return fit_curves(out / "curves.csv", out / "target.csv", out / PREDICTION, num_bootstrap=num_bootstrap,
                      exclude=flags, progress=progress)


def run_ladder(recipe: LadderRecipe, out: Path, train_fn: Callable[[RunConfig, Path], dict],
               progress: Callable[[Iterable], Iterable] = iter, task: bool = False) -> dict:
    """Train every rung with `train_fn(cfg, dir)` (skipping finished ones), then fit and predict the target.

    With `task`, each rung keeps a checkpoint per quarter of its steps, every checkpoint is scored on the
    arithmetic task (OUT/task_points.csv) and the summary's `task` holds the target's predicted accuracy
    (`predict_task`), also written to OUT/task_prediction.json; `{"error": ...}` when the rungs cannot place it.
    """
    rungs, target = plan_ladder(recipe)
    if task:
        rungs = [with_task_checkpoints(cfg) for cfg in rungs]
    for cfg in rungs:
        if not (rung_dir(out, cfg) / SUMMARY).is_file():
            train_fn(cfg, rung_dir(out, cfg))
    summary = fit_and_predict([(cfg, rung_dir(out, cfg)) for cfg in rungs], target, out, progress=progress)
    if task:
        summary["task"] = predict_ladder_task([(cfg.name, cfg, rung_dir(out, cfg)) for cfg in rungs], target, out)
    return summary


def predict_ladder_task(rungs: list[tuple[str, RunConfig, Path]], target: RunConfig, out: Path) -> dict:
    """The target's final task accuracy from the rungs' scored checkpoints, as JSON (see `run_ladder`)."""
    points, compute = score_runs(rungs, out / TASK_POINTS), checkpoint_compute(target, target.train.steps)
    try:
        pred = predict_task(points, compute, problems=TASK_PROBLEMS)
    except DataError as e:  # e.g. two rung sizes: the task law needs three computes
        result: dict = {"error": str(e)}
    else:
        result = {**pred.as_json(), "target_compute": compute, "problems": TASK_PROBLEMS}
    (out / TASK_PREDICTION).write_text(json.dumps(result, indent=1) + "\n")
    return result
