"""Multi-host writes: only process 0 writes a run's files and publishes; every process trains the same run.

One process stands in for process 1 by patching `mesh.is_writer`, the one place moelab asks. Patching
`jax.process_index` itself would also make Orbax act as a non-primary host, which waits (600 s) for a
process 0 that does not exist to create the checkpoint's directories.

`slow` (issue 27): four trainings in the module fixture, ~30 s on 2 cores. The fast suite keeps the
multi-host start's rules (test_parallel); `make test-slow` runs this and the two-process tests.
"""

import json
import shutil

import jax
import pytest

pytestmark = pytest.mark.slow

from moelab import presets
from moelab.config import override
from moelab.lab import tracking
from moelab.parallel import mesh as mesh_lib
from moelab.train.checkpoint import MANIFEST
from moelab.train.loop import Hooks, train

from helpers import without_timing

RUN_FILES = {"config.yaml", "metrics.jsonl", "incidents.jsonl", "mixture_log.jsonl", "samples.jsonl",
             "router_load.jsonl", "summary.json", "mirror/metrics.jsonl", "mirror/incidents.jsonl",
             "mirror/mixture_log.jsonl", "mirror/samples.jsonl", "ledger.sqlite"}


class RecordingSink:
    """A caller's own sink (not one of tracking's): records what `train` publishes to it."""

    def __init__(self):
        self.calls, self.closed = [], False

    def log(self, record):
        self.calls.append(("log", record))

    def incident(self, incident):
        self.calls.append(("incident", incident))

    def mixture(self, entry):
        self.calls.append(("mixture", entry))

    def samples(self, step, rows):
        self.calls.append(("samples", rows))

    def close(self):
        self.closed = True


def _cfg(steps: int = 8):
    return override(presets.get("tiny"), {"train.steps": steps, "train.eval_every": 4, "train.log_every": 2,
                                          "train.eval_batches": 1, "checkpoint.every": 4})


def _run(out, writer: bool, steps: int = 8) -> dict:
    """One tiny run into `out` as process 0 (`writer`) or as process 1, with tracking's sinks and our own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mesh_lib, "is_writer", lambda: writer)
        cfg = _cfg(steps)
        records, recorder = [], RecordingSink()
        sinks = [tracking.JsonlSink(out / "mirror"), tracking.LedgerSink(out / "ledger.sqlite", "exp", cfg.name),
                 recorder]
        summary = train(cfg, out, Hooks(on_log=records.append), sinks=sinks)
    return {"summary": summary, "records": records, "recorder": recorder}


def _files(out) -> dict[str, bytes]:
    """Every file under `out` outside `checkpoints/`, by relative path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.relative_to(out).parts[0] != "checkpoints"}


def _step_dirs(out) -> dict[int, bool]:
    """Checkpoint steps on disk -> whether each has its manifest."""
    return {int(p.name): (p / MANIFEST).is_file() for p in (out / "checkpoints").iterdir() if p.name.isdigit()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 8-step run as process 0 and as process 1, then each resumed to 10 steps as process 1 and 0."""
    process_0, process_1 = tmp_path_factory.mktemp("process_0"), tmp_path_factory.mktemp("process_1")
    fresh = {0: _run(process_0, writer=True), 1: _run(process_1, writer=False)}
    resumed_0, resumed_1 = tmp_path_factory.mktemp("resumed_0"), tmp_path_factory.mktemp("resumed_1")
    for target in (resumed_0, resumed_1):
        shutil.copytree(process_0, target, dirs_exist_ok=True)
    before_resume = _files(resumed_1)
    resumed = {0: _run(resumed_0, writer=True, steps=10), 1: _run(resumed_1, writer=False, steps=10)}
    return {"dirs": {0: process_0, 1: process_1}, "fresh": fresh, "resumed": resumed,
            "resumed_dirs": {0: resumed_0, 1: resumed_1}, "before_resume": before_resume}


def test_process_0_writes_every_run_file_and_seals_every_checkpoint(runs):
    out = runs["dirs"][0]
    assert set(_files(out)) == RUN_FILES
    assert _step_dirs(out) == {4: True, 8: True}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [2, 4, 6, 8]
    recorder = runs["fresh"][0]["recorder"]
    assert [payload for kind, payload in recorder.calls if kind == "log"] == metrics
    assert recorder.closed


def test_process_1_writes_no_run_file_and_no_manifest_but_saves_every_checkpoint(runs):
    """Orbax's own step directories are all a non-writer leaves: every process must take part in a save."""
    out = runs["dirs"][1]
    assert _files(out) == {}
    assert _step_dirs(out) == {4: False, 8: False}
    recorder = runs["fresh"][1]["recorder"]
    assert recorder.calls == [] and recorder.closed  # a caller's own sink hears nothing, and is still closed


def test_process_1_trains_the_same_run_as_process_0(runs):
    """Same losses, evals and summary (timing aside): the non-writer skips no step, eval or decode."""
    writer, other = runs["fresh"][0], runs["fresh"][1]
    assert [r["step"] for r in writer["records"]] == [2, 4, 6, 8]
    assert [without_timing(r) for r in other["records"]] == [without_timing(r) for r in writer["records"]]
    assert without_timing(other["summary"]) == without_timing(writer["summary"])


def test_a_resume_on_process_1_leaves_the_run_files_untouched_and_returns_process_0s_summary(runs):
    assert _files(runs["resumed_dirs"][1]) == runs["before_resume"]  # no truncated log, no resumes.jsonl
    writer, other = runs["resumed"][0]["summary"], runs["resumed"][1]["summary"]
    assert writer["resumed_from"] == 8 and writer["step"] == 10
    assert without_timing(other) == without_timing(writer)
    assert json.loads((runs["resumed_dirs"][0] / "resumes.jsonl").read_text())["step"] == 8


def test_sinks_built_on_another_process_open_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(mesh_lib, "is_writer", lambda: False)
    sinks = [tracking.JsonlSink(tmp_path / "mirror"), tracking.LedgerSink(tmp_path / "ledger.sqlite", "exp", "r"),
             tracking.WandbSink(tmp_path, {"name": "r"}, "r")]
    for sink in sinks:
        assert isinstance(sink, tracking.NullSink)
        sink.log({"step": 1, "loss": 1.0})
        sink.samples(1, [{"step": 1, "domain": "code", "prompt": "a", "continuation": "b"}])
        sink.close()
    assert list(tmp_path.iterdir()) == []  # no mirror files, no ledger, no wandb/ run


@pytest.mark.parametrize(("index", "writes"), [(0, True), (1, False), (7, False)])
def test_only_process_0_is_the_writer(monkeypatch, index, writes):
    monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: index)
    assert mesh_lib.is_writer() is writes
