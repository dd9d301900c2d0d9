"""The ladder's task prediction (`moelab.ladder.task`, `moelab ladder task`) on synthetic rungs drawn from a
known two-step law: it recovers the target's accuracy inside its band, and says when it cannot."""

import json

import numpy as np
import pytest

from helpers import run_cli
from moelab.errors import DataError
from moelab.ladder.task import (TaskLaw, TaskPoint, fit_task_law, predict_task, read_task_points,
                               write_task_points)

TRUE = TaskLaw(E=0.8, A=2.0, alpha=0.35, c_min=1e12, k=6.0, l_half=1.6)
RUNGS = (1e12, 2.5e12, 6e12, 1.5e13)
TARGET = 6e13


def _points(seed: int, law: TaskLaw = TRUE, noise: float = 0.01, seeds_per_rung: int = 2) -> list[TaskPoint]:
    """Four checkpoints of each rung run (a quarter to all of its compute), loss and accuracy with noise."""
    rng, points = np.random.default_rng(seed), []
    for i, final_compute in enumerate(RUNGS):
        for s in range(seeds_per_rung):
            for frac in (0.25, 0.5, 0.75, 1.0):
                loss = float(law.task_loss(final_compute * frac)) * (1 + rng.normal(0, noise))
                accuracy = float(np.clip(law.accuracy(loss) + rng.normal(0, noise), 0, 1))
                points.append(TaskPoint(f"d{i}-s{s}", final_compute * frac, loss, accuracy, frac == 1.0))
    return points


def test_both_steps_recover_the_law_they_were_drawn_from():
    law = fit_task_law(_points(0, noise=0.0))
    for compute in (*RUNGS, TARGET):
        assert float(law.task_loss(compute)) == pytest.approx(float(TRUE.task_loss(compute)), rel=1e-3)
    assert (law.k, law.l_half) == pytest.approx((TRUE.k, TRUE.l_half), rel=1e-3)


def test_the_target_accuracy_lies_inside_its_band_and_within_four_points_on_noisy_rungs():
    """1% noise on every loss and accuracy, two runs per rung: measured errors -1.7 to +2.9 points."""
    truth = float(TRUE.accuracy(TRUE.task_loss(TARGET)))
    covered = 0
    for seed in range(5):
        pred = predict_task(_points(seed), TARGET, num_bootstrap=100, seed=seed)
        assert pred.lo95 <= pred.accuracy <= pred.hi95 and pred.task_loss_lo95 <= pred.task_loss <= pred.task_loss_hi95
        assert abs(pred.accuracy - truth) < 0.04, (seed, pred.accuracy, truth)
        covered += pred.lo95 <= truth <= pred.hi95
    assert covered >= 4


def test_one_run_per_compute_still_gets_a_band_from_the_targets_own_noise():
    """Resampling 3 runs at 3 computes only permutes them; the measurement's binomial noise keeps a band."""
    three = [p for p in _points(0, seeds_per_rung=1) if not p.run.startswith("d3")]
    bare = predict_task(three, TARGET, num_bootstrap=200)
    measured = predict_task(three, TARGET, num_bootstrap=200, problems=512)
    assert bare.hi95 - bare.lo95 < 1e-6 and any("no residual" in n for n in bare.notes)
    p = measured.accuracy
    assert measured.hi95 - measured.lo95 > 2 * 1.96 * np.sqrt(p * (1 - p) / 512) * 0.7
    four = predict_task(_points(0, seeds_per_rung=1), TARGET, num_bootstrap=100)  # 4 finals: 1 dof of residual
    assert not any("no residual" in n for n in four.notes)


def test_flat_accuracy_is_named_and_too_few_computes_refused():
    flat = [p._replace(accuracy=0.0) for p in _points(0)]
    assert any("not placed by the rungs" in note for note in predict_task(flat, TARGET, num_bootstrap=50).notes)
    two = [p for p in _points(0) if p.run.startswith(("d0", "d1"))]
    with pytest.raises(DataError, match="three or more computes"):
        fit_task_law(two)


def test_ladder_task_prints_the_prediction_and_names_a_bad_row(tmp_path, monkeypatch, capsys):
    path = tmp_path / "task_points.csv"
    write_task_points(path, _points(1))
    assert read_task_points(path) == _points(1)  # exact: floats are written as repr
    code, out, err = run_cli(["ladder", "task", str(path), "--target-compute", str(TARGET), "--bootstrap", "50",
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["task_lo95"] <= result["task_predicted"] <= result["task_hi95"] and result["runs"] == 8
    path.write_text(path.read_text().replace(",1.0,", ",2.0,", 1) + "d9,big,1.0,0.5,1\n")
    code, out, err = run_cli(["ladder", "task", str(path), "--target-compute", "1e15"], monkeypatch, capsys)
    assert code == 2 and out == "" and "line " in err and "Traceback" not in err
    code, _, err = run_cli(["ladder", "task", str(path), "--target-compute", "1e15", "--bootstrap", "5"],
                           monkeypatch, capsys)
    assert code == 2 and "--bootstrap 5" in err


def test_a_ladders_task_prediction_is_written_beside_its_points_or_says_why_not(tmp_path, monkeypatch):
    """`run_ladder(task=True)`'s last step, on scored points handed in: the prediction at the target's compute
    (steps x batch x seq_len x FLOPs per token) in task_prediction.json; two computes give its reason instead."""
    from moelab import accounting, presets
    from moelab.ladder import run as run_lib

    target = presets.resolve("tiny", {"train.steps": 100})
    compute = float(accounting.flops_per_token(target.model)) * accounting.train_tokens(target)
    scale = TARGET / compute  # the synthetic law's computes, moved so the target sits where TARGET does
    points = [p._replace(compute=p.compute / scale) for p in _points(2)]
    monkeypatch.setattr(run_lib, "score_runs", lambda runs, cache: points)
    result = run_lib.predict_ladder_task([], target, tmp_path)
    assert result == json.loads((tmp_path / run_lib.TASK_PREDICTION).read_text())
    assert result["target_compute"] == compute and result["problems"] == run_lib.TASK_PROBLEMS
    expected = predict_task(points, compute, problems=run_lib.TASK_PROBLEMS)
    assert result["task_predicted"] == pytest.approx(expected.accuracy)
    assert result["task_lo95"] <= result["task_predicted"] <= result["task_hi95"]
    monkeypatch.setattr(run_lib, "score_runs", lambda runs, cache: [p for p in points if p.run[:2] in ("d0", "d1")])
    result = run_lib.predict_ladder_task([], target, tmp_path)
    assert set(result) == {"error"} and "three or more computes" in result["error"]


@pytest.mark.parametrize("damage", ["not utf-8", "infinite compute", "infinite target"])
def test_ladder_task_refuses_bytes_and_infinities_with_exit_2(tmp_path, monkeypatch, capsys, damage):
    """Each was accepted or a traceback: a UnicodeDecodeError, and `inf` FLOPs printed as invalid JSON."""
    path = tmp_path / "task_points.csv"
    write_task_points(path, _points(1))
    target = str(TARGET)
    if damage == "not utf-8":
        path.write_bytes(path.read_bytes().replace(b"d0-s0", b"d0-\xff\xfe", 1))
    elif damage == "infinite compute":
        path.write_text(path.read_text().replace("d0-s0,", "d0-s0,inf,0.9,0.1,True\nd0-s0,", 1))
    else:
        target = "inf"
    code, out, err = run_cli(["ladder", "task", str(path), "--target-compute", target, "--json"], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert {"not utf-8": "not UTF-8", "infinite compute": "finite compute",
            "infinite target": "finite number of FLOPs"}[damage] in " ".join(err.split())


def test_an_os_error_any_command_meets_is_one_error_line_naming_the_path_exit_2(monkeypatch, capsys):
    """The CLI's last net (cli.main): a path that cannot be read or written, which no check before it caught."""
    from moelab.ladder import task as task_lib

    def in_the_way(path):
        raise NotADirectoryError(20, "Not a directory", "runs/a-file/task_points.csv")

    monkeypatch.setattr(task_lib, "read_task_points", in_the_way)
    code, out, err = run_cli(["ladder", "task", "x.csv", "--target-compute", "1e12"], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "runs/a-file/task_points.csv: Not a directory" in " ".join(err.split())
