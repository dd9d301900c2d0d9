"""Checkpoints: exact resume after SIGKILL, fallback past a corrupted newest step, resume policy."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from moelab import presets
from moelab.config import CheckpointConfig, ConfigError, override
from moelab.train.checkpoint import Checkpointer, CheckpointWarning
from moelab.train.loop import _read_jsonl_until, train
from moelab.train.state import init_state

TIMING_KEYS = {"tokens_per_s"}  # wall-clock figures differ between runs; everything else must not


def _command(out: Path, steps: int = 24) -> list[str]:
    return [sys.executable, "-m", "moelab.cli", "train", "--preset", "tiny", "--steps", str(steps), "--out", str(out),
            "--checkpoint-every", "4", "--set", "train.log_every=2", "--set", "train.eval_every=12",
            "--set", "train.eval_batches=1"]


def _final_state(out: Path, steps: int):
    like = init_state(presets.get("tiny"))
    restored = Checkpointer(out / "checkpoints", CheckpointConfig()).restore_newest(like)
    assert restored is not None and restored.step == steps
    return restored.state


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "process ended early"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_to_bitwise_the_same_params_and_metrics(tmp_path, sig):
    """SIGKILL loses the steps since the last checkpoint; SIGTERM saves first. Both must end identical."""
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run(_command(reference), check=True, capture_output=True, timeout=300)

    proc = subprocess.Popen(_command(interrupted), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(interrupted / "checkpoints" / "8" / "moelab_manifest.json", proc)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    if sig == signal.SIGTERM:
        assert proc.returncode == 75, proc.stderr.read()
        assert "Rerun the same command" in proc.stderr.read()
    assert not (interrupted / "summary.json").exists()

    resumed = subprocess.run(_command(interrupted), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    resume_step = json.loads((interrupted / "resumes.jsonl").read_text().splitlines()[-1])["step"]
    assert 8 <= resume_step < 24

    a, b = _final_state(reference, 24), _final_state(interrupted, 24)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise: same values, same dtype
    assert _records(reference) == _records(interrupted)


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path):
    cfg = override(presets.get("tiny"), {"train.steps": 8, "checkpoint.every": 4, "train.eval_batches": 1})
    train(cfg, tmp_path)
    newest = tmp_path / "checkpoints" / "8"
    victim = max((p for p in newest.rglob("*") if p.is_file() and p.stat().st_size > 0), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    with pytest.warns(CheckpointWarning, match=str(newest)):
        restored = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint).restore_newest(init_state(cfg))
    assert restored is not None and restored.step == 4


def test_resume_refuses_model_or_data_changes_and_records_safe_ones(tmp_path):
    cfg = override(presets.get("tiny"), {"train.steps": 4, "train.eval_batches": 1})
    train(cfg, tmp_path)
    for unsafe in ({"model.d_model": 32}, {"data.heldout_fraction": 0.2}, {"train.seed": 1}):
        with pytest.raises(ConfigError, match=list(unsafe)[0].replace(".", r"\.")):
            train(override(cfg, unsafe), tmp_path)
    summary = train(override(cfg, {"train.steps": 6, "train.log_every": 1}), tmp_path)
    assert summary["step"] == 6 and summary["resumed_from"] == 4
    resume = json.loads((tmp_path / "resumes.jsonl").read_text())
    assert resume["step"] == 4 and resume["changes"]["train.steps"] == [4, 6]


def test_a_finished_run_is_left_alone_and_a_shorter_one_refused(tmp_path):
    cfg = override(presets.get("tiny"), {"train.steps": 4, "train.eval_batches": 1, "train.log_every": 2})
    first = train(cfg, tmp_path)
    written = (tmp_path / "summary.json").read_bytes()
    with pytest.warns(UserWarning, match="already finished its 4 steps"):
        again = train(cfg, tmp_path)
    assert again == first and (tmp_path / "summary.json").read_bytes() == written  # not the untrained eval
    with pytest.raises(ConfigError, match="checkpoint at step 4, past train.steps=3"):
        train(override(cfg, {"train.steps": 3}), tmp_path)
    # Finished, but the summary was lost (a crash after the last checkpoint): it is written again, from
    # the final state, not from the initial eval.
    (tmp_path / "summary.json").unlink()
    rebuilt = train(cfg, tmp_path)
    assert rebuilt["eval"] == first["eval"] and rebuilt["loss"] == first["loss"]


def test_a_fresh_run_rewrites_foreign_logs_and_an_out_that_is_a_file_is_refused(tmp_path):
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
    assert _read_jsonl_until(log, 2) == ['{"step": 1}', '{"step": 2}']
    log.write_text('{"step": 1}\n{"note": "someone else\'s"}\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not a moelab log line"):
        _read_jsonl_until(log, 2)


def test_retention_keeps_the_newest_k_and_every_mth(tmp_path):
    cfg = override(presets.get("tiny"), {"train.steps": 12, "train.eval_batches": 1, "checkpoint.every": 2,
                                         "checkpoint.keep_last": 2, "checkpoint.keep_every": 4})
    train(cfg, tmp_path)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 8, 10, 12]
