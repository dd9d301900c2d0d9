"""Fault injection: a run killed at any moment, or whose writes fail, resumes to the same bits.

Each fault hits a real `moelab train` subprocess; the rerun that follows happens in this process
(`run_cli`, as a user would type it) and must end bitwise equal to one uninterrupted run: params,
optimizer and router state, and every metric record. Faults:
- SIGKILL at a seeded random point after the first checkpoint (as a step's eval starts, or as its
  checkpoint call starts or returns): a point the run itself reaches, so the kill lands before the end
  however fast the machine (a kill after a delay missed a run that had finished);
- SIGKILL inside a checkpoint save, at two fixed points (`_FAULT_ENTRY`): before Orbax renames its
  temporary folder into place, and after that but before our manifest seals the step;
- SIGTERM, which saves first and exits 75;
- a file-size limit (RLIMIT_FSIZE) imposed mid-run, so the next checkpoint write fails: exit 1 with
  a message naming the step and the previous checkpoint, which stays usable.
A wider sweep of kill times is `benchmarks/fault_sweep.py`.

`slow` (issue 27): a reference subprocess run and a killed run plus a rerun per test, ~25 s each on 2 cores.
The fast suite keeps a damaged newest checkpoint moved aside and the run finished by reruns
(test_checkpoint) and a finished run recognised before anything compiles (test_train).
"""

import json
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import moelab

pytestmark = pytest.mark.slow
from helpers import assert_same_run, final_state, run_cli, train_args, train_command, wait_for

STEPS = 16

# Runs `moelab train`, SIGKILLing itself at one point of one step:
#   orbax-commit:      when Orbax renames the step's temporary folder into place (all data written);
#   manifest:          when our manifest is about to be computed (Orbax's step complete, not yet sealed);
#   eval:              as the step's eval starts (the step trained, nothing of it logged yet);
#   checkpoint-call:   as the loop's checkpoint call for the step starts (the step logged; a save due not done);
#   checkpoint-return: as that call returns (a save due at the step sealed).
_FAULT_ENTRY = """
import os, signal, sys
point, step = sys.argv.pop(1), sys.argv.pop(1)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "orbax-commit":
    real_rename = os.rename
    def rename(src, dst, *args, **kwargs):
        if "orbax-checkpoint-tmp" in str(src) and os.path.basename(str(dst)) == step:
            die()
        return real_rename(src, dst, *args, **kwargs)
    os.rename = rename
elif point == "manifest":
    from moelab.train import checkpoint
    real_digest = checkpoint._digest
    def digest(step_dir):
        if step_dir.name == step:
            die()
        return real_digest(step_dir)
    checkpoint._digest = digest
else:
    from moelab.train import loop
    name = "_evaluate" if point == "eval" else "_checkpoint"
    real = getattr(loop, name)
    def at_step(run, state, done, *args):
        if done == int(step) and point != "checkpoint-return":
            die()
        returned = real(run, state, done, *args)
        if done == int(step):
            die()
        return returned
    setattr(loop, name, at_step)

from moelab.cli import main
sys.argv[0] = "moelab"
main()
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must end equal to."""
    out = tmp_path_factory.mktemp("reference") / "run"
    subprocess.run(train_command(out, STEPS), check=True, capture_output=True, timeout=600)
    return out


def _rerun_and_compare(reference, out, monkeypatch, capsys) -> str:
    """Rerun the interrupted run to its end; it must equal `reference`. Returns the rerun's stderr."""
    code, stdout, stderr = run_cli(train_args(out, STEPS), monkeypatch, capsys)
    assert code == 0, stderr
    # one line for a person (issue 54); the JSON is summary.json's (and `--json`'s)
    assert stdout.startswith(f"Trained to step {STEPS}: loss ") and len(stdout.strip().splitlines()) == 1
    assert json.loads((out / "summary.json").read_text())["step"] == STEPS
    assert_same_run(reference, out, STEPS)
    return stderr


# Where a run is killed at random: every step after the first checkpoint (step 4), as its checkpoint call
# starts or returns, and the two evals (eval_every=12, and the last step).
_KILL_POINTS = ([(point, step) for step in range(5, STEPS + 1) for point in ("checkpoint-call", "checkpoint-return")]
                + [("eval", 12), ("eval", STEPS)])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_run_killed_at_a_random_moment_resumes_to_bitwise_the_same_run(reference, tmp_path, seed,
                                                                         monkeypatch, capsys):
    point, step = random.Random(seed).choice(_KILL_POINTS)
    out = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _FAULT_ENTRY, point, str(step), *train_args(out, STEPS)],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, f"the kill at {point} {step} never fired: {killed.stderr[-2000:]}"
    assert not (out / "summary.json").exists()
    _rerun_and_compare(reference, out, monkeypatch, capsys)


@pytest.mark.parametrize("point", ["orbax-commit", "manifest"])
def test_a_run_killed_inside_a_checkpoint_save_resumes_to_bitwise_the_same_run(reference, tmp_path, point,
                                                                              monkeypatch, capsys):
    out = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _FAULT_ENTRY, point, "8", *train_args(out, STEPS)],
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, f"the fault at {point} never fired: {killed.stderr[-2000:]}"
    step_dir = out / "checkpoints" / "8"
    assert not (step_dir / "moelab_manifest.json").exists()
    assert step_dir.exists() == (point == "manifest")  # Orbax's commit is the rename itself
    stderr = _rerun_and_compare(reference, out, monkeypatch, capsys)
    assert "Resuming from step" in stderr


def test_sigterm_saves_exits_75_and_the_rerun_ends_bitwise_the_same(reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    proc = subprocess.Popen(train_command(out, STEPS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(out / "checkpoints" / "4" / "moelab_manifest.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    assert "Rerun the same command" in stderr
    assert not (out / "summary.json").exists()
    _rerun_and_compare(reference, out, monkeypatch, capsys)


def test_a_checkpoint_write_that_fails_mid_run_exits_1_and_keeps_the_previous_checkpoint(reference, tmp_path,
                                                                                         monkeypatch, capsys):
    """A full disk, in effect: once step 4 is saved, no file may grow past 256 KiB. The logs stay under
    it; step 8's largest array file (about 2 MB) does not, so its save fails with EFBIG (Python ignores
    SIGXFSZ, so the write returns an error instead of killing the process).
"""
    out = tmp_path / "run"
    proc = subprocess.Popen(train_command(out, STEPS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(out / "checkpoints" / "4" / "moelab_manifest.json", proc)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    # No traceback from moelab; TensorStore's C++ threads may still print one for a write that was in
    # flight when the save failed, after the save has returned (the checkpointer waits for them to settle).
    ours = str(Path(moelab.__file__).parent)
    assert not [line for line in stderr.splitlines() if line.strip().startswith("File ") and ours in line], stderr
    assert "saving checkpoint step 8" in stderr and "previous checkpoint, step 4, is untouched" in stderr
    assert final_state(out, 4) is not None  # the last good checkpoint verifies and loads
    _rerun_and_compare(reference, out, monkeypatch, capsys)
