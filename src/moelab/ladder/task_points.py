"""The task's points from runs: each kept checkpoint of each run scored on the arithmetic task.

    cfg = with_task_checkpoints(cfg)                          # a checkpoint kept at each quarter of its steps
    points = score_runs([(name, cfg, run_dir), ...], cache)   # TaskPoints, cached in a TASK_POINTS.csv

What `moelab ladder run --task` and `benchmarks/ladder_cpu.py --task` feed `ladder.task.predict_task`. A rung
keeps its final checkpoint only by default, and the sigmoid from task loss to accuracy needs the loss range a
run crosses as it trains, so a task ladder keeps one checkpoint per quarter. The cache holds whole runs: a
rerun scores only the runs it has not seen.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from moelab import accounting
from moelab.config import RunConfig
from moelab.ladder.task import TaskPoint, read_task_points, write_task_points

__all__ = ["TASK_CHECKPOINTS", "TASK_PROBLEMS", "with_task_checkpoints", "checkpoint_compute", "score_runs"]

TASK_CHECKPOINTS = 4  # checkpoints kept per run: each quarter of its steps
TASK_PROBLEMS = 512  # held-out problems scored per checkpoint


def with_task_checkpoints(cfg: RunConfig) -> RunConfig:
    """`cfg` saving and keeping a checkpoint at each quarter of its steps."""
    every = max(1, cfg.train.steps // TASK_CHECKPOINTS)
    return replace(cfg, checkpoint=replace(cfg.checkpoint, every=every, keep_every=every))


def checkpoint_compute(cfg: RunConfig, step: int) -> float:
    """Training FLOPs a run of `cfg` has spent at `step` (the task law's x axis)."""
    return float(accounting.flops_per_token(cfg.model)) * step * accounting.tokens_per_step(cfg)


def score_runs(runs: Sequence[tuple[str, RunConfig, Path]], cache: Path,
               problems: int = TASK_PROBLEMS) -> list[TaskPoint]:
    """Every checkpoint of each (name, config, run dir) on the arithmetic task, the last one marked final: the
    points of these runs only (the cache may hold others, e.g. a ladder's targets beside its rungs)."""
    from moelab.evals.arithmetic import heldout_problems, score_problems
    from moelab.train.weights import checkpoint_steps, load_run

    points = read_task_points(cache) if cache.is_file() else []
    seen = {p.run for p in points}
    for name, cfg, run_dir in runs:
        if name in seen:
            continue
        held_out = heldout_problems(cfg.data, problems)
        steps = checkpoint_steps(run_dir)
        for step in steps:
            score = score_problems(load_run(run_dir, step=step), held_out)
            points.append(TaskPoint(name, checkpoint_compute(cfg, step), score.task_loss, score.accuracy,
                                    step == steps[-1]))
        write_task_points(cache, points)  # after each run: an interrupted scoring keeps what it finished
    wanted = {name for name, _, _ in runs}
    return [p for p in points if p.run in wanted]
