"""Running a ladder: plan the rungs and the target, train the rungs, fit the curve law, predict the target.

    moelab ladder run experiments/ladder-cpu.yaml --out runs/ladder

`plan_ladder` and `fit_and_predict` are the one plan and the one fit of every ladder: `run_ladder`
(`moelab ladder run`, benchmarks/ladder_cpu.py) trains the rungs one after another under `--out`;
an experiment spec's `ladder:` runs the same plan and fit as steps of its DAG (`lab.experiment`).

Layout of `--out`:

    rungs/<name>/      each rung's training run (resumable: re-running the command skips or resumes)
    curves.csv         every eval of every rung, in the CURVES.csv contract (`ladder.predict`)
    target.csv         the target's planned schedule at its eval steps (TARGET.csv)
    target.yaml        the target's run config, as predicted: `moelab train target.yaml --predicted ...`
    prediction.csv     target rows + loss_pred, lo80, hi80, lo95, hi95 (PRED.csv)
    prediction.json    its sidecar: the fitted law, its noise, the leave-largest-out self-check, notes

The loss of a checkpoint is `eval/mean`, the mean held-out loss over the data domains.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from moelab.accounting import count_params
from moelab.config import RunConfig, dump_yaml
from moelab.ladder import NUM_BOOTSTRAP
from moelab.ladder.predict import fit_curves
from moelab.ladder.rungs import LadderRecipe, check_monotone, rung_flags, rungs_of
from moelab.presets import EVALS_PER_RUN
from moelab.train.outputs import METRICS, SUMMARY, read_jsonl

__all__ = ["plan_ladder", "train_sizes", "rung_dir", "curve_rows", "target_rows", "write_csv", "fit_and_predict", "run_ladder"]

CURVE_LOSS = "eval/mean"


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
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    evals = sorted({*range(cfg.train.eval_every, cfg.train.steps + 1, cfg.train.eval_every), cfg.train.steps})
    # The loop logs the LR it used for the step that ends at `step`, i.e. schedule(step - 1).
    return [{"run": cfg.name, "params": params, "step": s, "tokens": s * tokens_per_step, "lr": float(lr(s - 1))}
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


def train_sizes(cfg: RunConfig) -> dict[str, int]:
    """Tokens per domain in `cfg`'s training split: what `rungs.data_epochs` counts passes over."""
    from moelab.train.loop import prepare_corpus  # builds the corpus: only when the data is checked

    return {d: len(tokens) for d, tokens in prepare_corpus(cfg).train.items()}


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
    return fit_curves(out / "curves.csv", out / "target.csv", out / "prediction.csv", num_bootstrap=num_bootstrap,
                      exclude=flags, progress=progress)


def run_ladder(recipe: LadderRecipe, out: Path, train_fn: Callable[[RunConfig, Path], dict],
               progress: Callable[[Iterable], Iterable] = iter) -> dict:
    """Train every rung with `train_fn(cfg, dir)` (skipping finished ones), then fit and predict the target."""
    rungs, target = plan_ladder(recipe)
    for cfg in rungs:
        if not (rung_dir(out, cfg) / SUMMARY).is_file():
            train_fn(cfg, rung_dir(out, cfg))
    return fit_and_predict([(cfg, rung_dir(out, cfg)) for cfg in rungs], target, out, progress=progress)
