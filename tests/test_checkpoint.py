"""Checkpoints: a damaged newest step moved aside, resume policy, retention, resumed logs.

Kills and failed writes mid-run are in test_faults.py."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_same_run, run_cli, train_args

from moelab import presets
from moelab.config import load_yaml, override
from moelab.errors import ConfigError
from moelab.cli.common import resolve_config
from moelab.train.loop import train
from moelab.train.outputs import read_jsonl_until


def _biggest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte different: only the hash can tell
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "missing manifest": lambda step_dir: (step_dir / "moelab_manifest.json").unlink(),
    "corrupted data file": lambda step_dir: _flip_bytes(_biggest_file(step_dir)),
    "truncated file": lambda step_dir: _biggest_file(step_dir).write_bytes(
        _biggest_file(step_dir).read_bytes()[: _biggest_file(step_dir).stat().st_size // 2]),
    "missing commit marker": lambda step_dir: (step_dir / "commit_success.txt").unlink(),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished 8-step run with checkpoints at 4 and 8 (the config `train_args` gives the CLI), copied
    by each test that damages it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    args = train_args(out, steps=8)
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    train(resolve_config(None, "tiny", sets, **{"train.steps": 8, "checkpoint.every": 4}), out)
    return out


# Three of the four damages are `slow` (issue 27: a rerun each, ~15 s on 2 cores); a corrupted data file (the
# manifest's content check, the subtlest of the four) stays in the fast suite.
@pytest.mark.parametrize("damage", [pytest.param(name, marks=() if name == "corrupted data file" else pytest.mark.slow)
                                    for name in CORRUPTIONS])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_two_reruns_finish_the_run(finished_run, tmp_path, damage,
                                                                                  monkeypatch, capsys):
    """The README's promise: a half-written or corrupted newest checkpoint is skipped with a warning.
    It used to crash the resumed run at its next save (Orbax's StepAlreadyExistsError), on every rerun."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    CORRUPTIONS[damage](out / "checkpoints" / "8")

    code, stdout, stderr = run_cli([*train_args(out, steps=8), "--json"], monkeypatch, capsys)
    assert code == 0, stderr
    aside = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("8.corrupt-")]
    assert len(aside) == 1 and aside[0] in stderr and "Resuming from step 4" in stderr
    assert json.loads(stdout)["resumed_from"] == 4  # --json: the summary object, as before issue 54
    assert_same_run(finished_run, out, 8)

    summary = (out / "summary.json").read_bytes()
    code, stdout, stderr = run_cli(train_args(out, steps=8), monkeypatch, capsys)  # the second rerun: finished, nothing to move or train
    assert code == 0, stderr
    assert "already finished its 8 steps" in stderr and "Resuming" not in stderr
    assert (out / "summary.json").read_bytes() == summary
    assert [p.name for p in (out / "checkpoints").iterdir() if ".corrupt-" in p.name] == aside


@pytest.mark.slow
def test_resume_refuses_model_or_data_changes_and_records_safe_ones(tmp_path):
    """`slow` (issue 27): trainings of two schedules of their own, ~35 s on 2 cores; the fast suite keeps a
    resume refused past train.steps and a finished run left alone (below)."""
    cfg = override(presets.get("tiny"), {"train.steps": 4, "train.eval_batches": 1})
    train(cfg, tmp_path)
    for unsafe in ({"model.d_model": 128}, {"data.heldout_fraction": 0.2}, {"train.seed": 1}):
        with pytest.raises(ConfigError, match=list(unsafe)[0].replace(".", r"\.")):
            train(override(cfg, unsafe), tmp_path)
    summary = train(override(cfg, {"train.steps": 6, "train.log_every": 1}), tmp_path)
    assert summary["step"] == 6 and summary["resumed_from"] == 4
    resume = json.loads((tmp_path / "resumes.jsonl").read_text())
    assert resume["step"] == 4 and resume["changes"]["train.steps"] == [4, 6]


def test_a_finished_run_is_left_alone_and_a_shorter_one_refused(finished_run, tmp_path):
    """On a copy of the module's finished run, with the config it finished with (its compiles are the fixture's)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = load_yaml(run / "config.yaml")
    written = (run / "summary.json").read_bytes()
    first = json.loads(written)
    with pytest.warns(UserWarning, match="already finished its 8 steps"):
        again = train(cfg, run)
    assert again == first and (run / "summary.json").read_bytes() == written  # not the untrained eval
    with pytest.raises(ConfigError, match="checkpoint at step 8, past train.steps=7"):
        train(override(cfg, {"train.steps": 7}), run)
    # Finished, but the summary was lost (a crash after the last checkpoint): it is written again, from
    # the final state, not from the initial eval.
    (run / "summary.json").unlink()
    rebuilt = train(cfg, run)
    assert rebuilt["eval"] == first["eval"] and rebuilt["loss"] == first["loss"]


@pytest.mark.slow
def test_a_fresh_run_rewrites_foreign_logs_and_an_out_that_is_a_file_is_refused(tmp_path):
    """`slow` (issue 27): a training of its own shape, ~15 s on 2 cores; the fast suite keeps a finished run
    left alone and a damaged one finished by reruns (above)."""
    cfg = override(presets.get("tiny"), {"train.steps": 2, "train.eval_batches": 1})
    (tmp_path / "metrics.jsonl").write_text('{"not": "a moelab record"}\n')
    assert train(cfg, tmp_path)["step"] == 2
    assert all("step" in json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="is an existing file"):
        train(cfg, tmp_path / "a_file")


def test_resumed_logs_drop_a_torn_last_line_and_refuse_foreign_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')  # killed mid-write
    assert read_jsonl_until(log, 2) == ['{"step": 1}', '{"step": 2}']
    log.write_text('{"step": 1}\n{"note": "someone else\'s"}\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not a moelab log line"):
        read_jsonl_until(log, 2)


@pytest.mark.slow
def test_retention_keeps_the_newest_k_and_every_mth(tmp_path):
    """`slow` (issue 27): a 12-step training of its own, ~20 s on 2 cores; the fast suite keeps every other
    checkpoint rule of this module on the shared finished run."""
    cfg = override(presets.get("tiny"), {"train.steps": 12, "train.eval_batches": 1, "checkpoint.every": 2,
                                         "checkpoint.keep_last": 2, "checkpoint.keep_every": 4})
    train(cfg, tmp_path)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 8, 10, 12]


def test_a_read_only_checkpointer_prints_none_of_orbaxs_read_only_notes(tmp_path, caplog):
    """generate / eval / export restore read-only: Orbax's three WARNING lines about it (which options it turned
    off, "Given directory is read only") are dropped while the manager is built; other absl warnings still pass."""
    import logging

    from moelab.config import CheckpointConfig
    from moelab.train.checkpoint import Checkpointer

    caplog.set_level(logging.WARNING, logger="absl")
    Checkpointer(tmp_path, CheckpointConfig(keep_last=3, keep_every=10), read_only=True).close()
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []
    logging.getLogger("absl").warning("an unrelated absl warning")
    assert [r.getMessage() for r in caplog.records] == ["an unrelated absl warning"]
