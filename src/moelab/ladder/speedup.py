"""Compute-equivalent speedup: how much compute a baseline recipe needs to match a candidate's loss.

    moelab ladder compare runs/ladder-baseline runs/ladder-candidate

Each side is a `ladder run` folder. The baseline's finished rungs give its compute envelope
(`laws.fit_compute_envelope`); each finished candidate rung's final loss is placed on it, and the
speedup is the compute the baseline needs for that loss over the compute the candidate spent.
"""

from __future__ import annotations

import math
from pathlib import Path

from moelab.accounting import summarize
from moelab.config import load_yaml
from moelab.errors import DataError
from moelab.ladder.laws import EnvelopeFit, envelope_compute, fit_compute_envelope
from moelab.train.outputs import CONFIG, read_summary

__all__ = ["final_points", "compute_equivalent_speedup", "compare_ladders"]


def final_points(ladder_dir: Path) -> list[tuple[str, float, float]]:
    """(name, train FLOPs, final eval/mean) of every finished rung under a `ladder run` directory."""
    points = []
    for run_dir in sorted((ladder_dir / "rungs").glob("*")):
        summary = read_summary(run_dir)
        if summary:
            cfg = load_yaml(run_dir / CONFIG)
            points.append((cfg.name, summarize(cfg)["train_flops"], summary["eval_mean"]))
    if len(points) < 2:
        raise DataError(f"{ladder_dir} holds {len(points)} finished rungs under rungs/; a comparison needs at "
                        "least 2. Run `moelab ladder run RECIPE.yaml --out DIR` first.")
    return points


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


def compare_ladders(baseline: Path, candidate: Path) -> list[dict]:
    """[{run, train_flops, loss, speedup}] for each finished candidate rung, against the baseline's envelope."""
    base = final_points(baseline)
    envelope = fit_compute_envelope([c for _, c, _ in base], [loss for _, _, loss in base])
    return [{"run": name, "train_flops": c, "loss": loss, "speedup": compute_equivalent_speedup(envelope, loss, c)}
            for name, c, loss in final_points(candidate)]
