"""The ladder's downstream prediction: a target's final task accuracy from its rungs, in two steps.

    points = read_task_points("task_points.csv")         # run,compute,task_loss,accuracy,final
    pred = predict_task(points, target_compute=2.4e15)    # TaskPrediction(accuracy, lo95, hi95, task_loss, ...)

As the OLMo ladder does for its tasks, with a task loss between compute and accuracy, because accuracy itself
jumps and saturates while the loss of the right answer moves smoothly:

1. compute -> task loss: `L(C) = E + A (C / C_min)^-alpha`, fitted to each rung's final checkpoint (least
   squares on log L; at least three distinct computes);
2. task loss -> accuracy: `acc(L) = 1 / (1 + exp(k (L - L_half)))`, fitted to every checkpoint of every rung
   (the intermediate ones spread the loss range the sigmoid needs to be placed).

The target's accuracy is `acc(L(C_target))`. Its band comes from a bootstrap over whole rung runs: resample
the runs with replacement, refit both steps, predict; the 2.5% and 97.5% quantiles are the 95% band. A rung's
checkpoints move together (one init, one data order), so runs, not points, are the units resampled. Each
draw also carries what the target run adds itself: its own offset off the task-loss law (the final
checkpoints' residual sd, on a Student t with the dof the three-parameter fit leaves) and, given `problems`,
the binomial noise of an accuracy measured on that many problems. With one run per compute the resamples
only permute the same rungs, so without those terms the band would collapse onto the point prediction.

The task figures come from `moelab eval RUN --arithmetic --every-checkpoint --json` on each rung; compute is
the rung's training FLOPs at that checkpoint (`moelab.accounting`).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
from scipy.optimize import least_squares

from moelab.errors import DataError
from moelab.files import atomic_open

__all__ = ["TaskPoint", "TaskLaw", "TaskPrediction", "read_task_points", "write_task_points", "fit_task_law",
           "predict_task"]

COLUMNS = ("run", "compute", "task_loss", "accuracy", "final")
NUM_TASK_BOOTSTRAP = 400


class TaskPoint(NamedTuple):
    run: str
    compute: float  # training FLOPs at the checkpoint
    task_loss: float  # mean nats of the answer tokens
    accuracy: float  # exact match in [0, 1]
    final: bool  # the run's last checkpoint


class TaskLaw(NamedTuple):
    E: float  # the task loss at infinite compute
    A: float
    alpha: float
    c_min: float  # compute scale: the smallest rung's final compute
    k: float  # the sigmoid's steepness (> 0: accuracy falls as the loss rises)
    l_half: float  # the task loss at 50% accuracy

    def task_loss(self, compute: float | np.ndarray) -> np.ndarray:
        return self.E + self.A * (np.asarray(compute, float) / self.c_min) ** -self.alpha

    def accuracy(self, task_loss: float | np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(np.clip(self.k * (np.asarray(task_loss, float) - self.l_half), -60, 60)))


class TaskPrediction(NamedTuple):
    accuracy: float
    lo95: float
    hi95: float
    task_loss: float
    task_loss_lo95: float
    task_loss_hi95: float
    law: TaskLaw
    runs: int
    notes: tuple[str, ...]

    def as_json(self) -> dict:
        """What `ladder task --json`, `ladder run --task` and benchmarks/ladder_cpu.py report."""
        return {"task_predicted": self.accuracy, "task_lo95": self.lo95, "task_hi95": self.hi95,
                "task_loss_predicted": self.task_loss, "task_loss_lo95": self.task_loss_lo95,
                "task_loss_hi95": self.task_loss_hi95, "task_law": self.law._asdict(), "runs": self.runs,
                "notes": list(self.notes)}


def read_task_points(path: str | Path) -> list[TaskPoint]:
    """TASK_POINTS.csv rows; DataError naming the file, line and column for a missing column or a bad value."""
    path = Path(path)
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{path}: missing column(s) {', '.join(missing)}; a task points CSV has "
                                f"{','.join(COLUMNS)}.")
            points = []
            for line, row in enumerate(reader, start=2):
                try:
                    point = TaskPoint(row["run"], float(row["compute"]), float(row["task_loss"]),
                                      float(row["accuracy"]), row["final"].strip().lower() in ("1", "true", "yes"))
                except (TypeError, ValueError):
                    raise DataError(f"{path} line {line}: compute, task_loss and accuracy must be numbers "
                                    f"(got {dict(row)}).") from None
                if not (0 < point.compute < math.inf and 0 < point.task_loss < math.inf and 0 <= point.accuracy <= 1
                        and point.run):
                    raise DataError(f"{path} line {line}: needs a run name, finite compute > 0 and task_loss > 0 and "
                                    f"accuracy in [0, 1] (got {dict(row)}).")
                points.append(point)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}).") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a text CSV (byte {e.start} is not UTF-8); a task points CSV has "
                        f"{','.join(COLUMNS)}.") from None
    return points


def write_task_points(path: str | Path, points: Sequence[TaskPoint]) -> None:
    """`points` as TASK_POINTS.csv, written whole (`moelab.files`): a reader sees the old file or the new one."""
    with atomic_open(path, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows((p.run, repr(p.compute), repr(p.task_loss), repr(p.accuracy), p.final) for p in points)


def _finals(points: Sequence[TaskPoint]) -> list[TaskPoint]:
    return [p for p in points if p.final]


def fit_task_law(points: Sequence[TaskPoint]) -> TaskLaw:
    """Both steps fitted to `points` (see the module docstring); DataError when they cannot place them."""
    finals = _finals(points)
    computes = np.array([p.compute for p in finals])
    if len(set(computes.tolist())) < 3:
        raise DataError(f"the task law needs the final checkpoints of rungs at three or more computes; got "
                        f"{len(set(computes.tolist()))}. Add rungs (or mark each run's last checkpoint final).")
    losses = np.array([p.task_loss for p in finals])
    c_min, floor = computes.min(), losses.min()

    def unpack(theta):
        e = floor / (1.0 + math.exp(-theta[0]))  # E in (0, min loss)
        return e, math.exp(theta[1]), math.log1p(math.exp(theta[2]))  # A > 0, alpha > 0

    def residuals(theta):
        e, a, alpha = unpack(theta)
        return np.log(e + a * (computes / c_min) ** -alpha) - np.log(losses)

    span = max(losses.max() - floor, 1e-3 * floor)
    start = np.array([0.0, math.log(span), math.log(math.expm1(0.3))])
    E, A, alpha = unpack(least_squares(residuals, start).x)

    all_losses = np.array([p.task_loss for p in points])
    accuracies = np.array([p.accuracy for p in points])
    spread = max(np.ptp(all_losses), 1e-3)

    def sigmoid_residuals(theta):
        k, l_half = math.exp(theta[0]), theta[1]
        return 1.0 / (1.0 + np.exp(np.clip(k * (all_losses - l_half), -60, 60))) - accuracies

    k, l_half = least_squares(sigmoid_residuals, np.array([math.log(8.0 / spread), np.median(all_losses)])).x
    return TaskLaw(E, A, alpha, c_min, math.exp(k), float(l_half))


def _final_residual_noise(law: TaskLaw, points: Sequence[TaskPoint]) -> tuple[float, int]:
    """(sd, dof) of the final checkpoints' log task loss about the law; dof 0 when the law fits them exactly."""
    finals = _finals(points)
    residuals = np.log([p.task_loss for p in finals]) - np.log(law.task_loss([p.compute for p in finals]))
    dof = len(finals) - 3
    return (float(np.sqrt(np.sum(residuals ** 2) / dof)), dof) if dof > 0 else (0.0, 0)


def predict_task(points: Sequence[TaskPoint], target_compute: float, *, num_bootstrap: int = NUM_TASK_BOOTSTRAP,
                 seed: int = 0, problems: int | None = None) -> TaskPrediction:
    """The target's final task loss and accuracy at `target_compute`, with 95% bands (run bootstrap plus the
    target's own noise; see the module docstring). `problems`: how many problems its accuracy is measured on."""
    if not 0 < target_compute < math.inf:
        raise DataError(f"the target's compute must be a finite number of FLOPs > 0 (got {target_compute}).")
    law = fit_task_law(points)
    own_sd, own_dof = _final_residual_noise(law, points)
    runs = sorted({p.run for p in points})
    by_run = {r: [p for p in points if p.run == r] for r in runs}
    rng = np.random.default_rng(seed)
    losses, accuracies, failed = [], [], 0
    for _ in range(num_bootstrap):
        sample = [p for r in rng.choice(runs, size=len(runs)) for p in by_run[r]]
        try:
            refit = fit_task_law(sample)
        except DataError:  # a resample with fewer than three computes: no law to draw from
            failed += 1
            continue
        loss = float(refit.task_loss(target_compute))
        if own_dof:
            loss *= math.exp(own_sd * rng.standard_t(own_dof))
        accuracy = float(refit.accuracy(loss))
        losses.append(loss)
        accuracies.append(rng.binomial(problems, accuracy) / problems if problems else accuracy)
    notes = []
    if failed:
        notes.append(f"{failed} of {num_bootstrap} resamples held fewer than three computes and were left out.")
    if len(losses) < 20:
        raise DataError(f"only {len(losses)} of {num_bootstrap} bootstrap resamples could be fitted: the rungs "
                        "are too few for a band; add rungs at more computes.")
    if not own_dof:
        notes.append(f"{len(_finals(points))} final checkpoints leave the task-loss law no residual to measure a run's "
                     "own offset: the band holds the fit's spread" + (" and the measurement's binomial noise"
                                                                      if problems else "") + " only; add seeds.")
    accs = [p.accuracy for p in points]
    if max(accs) - min(accs) < 0.05:
        notes.append(f"every checkpoint scores accuracy {min(accs):.2f}-{max(accs):.2f}: the sigmoid is not "
                     "placed by the rungs, so the accuracy is an extrapolation; choose problems the rungs span.")
    loss = float(law.task_loss(target_compute))
    lo_l, hi_l = np.quantile(losses, [0.025, 0.975])
    lo_a, hi_a = np.quantile(accuracies, [0.025, 0.975])
    accuracy = float(law.accuracy(loss))
    return TaskPrediction(accuracy, float(min(lo_a, accuracy)), float(max(hi_a, accuracy)), loss,
                          float(min(lo_l, loss)), float(max(hi_l, loss)), law, len(runs), tuple(notes))
