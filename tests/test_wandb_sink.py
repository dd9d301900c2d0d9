"""The W&B sink's steps, against a stand-in `wandb` module that records each `run.log`: a resumed run logs no
step its W&B run already holds. Fast: no W&B, no training (test_tracking.py runs the real W&B, `slow`)."""

import sys
from types import SimpleNamespace

import pytest

from moelab.lab import tracking


class _Run:
    def __init__(self, logged):
        self.logged, self.summary = logged, {}

    def log(self, data, step):
        self.logged.append((step, sorted(data)))

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    """`wandb` as the sink uses it; returns the list of (step, keys) every run logged, in order."""
    logged = []
    module = SimpleNamespace(init=lambda **kwargs: _Run(logged), Table=lambda columns, data: list(data),
                             Settings=lambda **kwargs: kwargs)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return logged


def _change(step):
    return {"step": step, "kind": "change", "phase": "pretrain", "weights": {"code": 1.0}, "message": "..."}


def test_a_resumed_sink_does_not_log_again_the_steps_its_run_holds(fake_wandb, tmp_path):
    """Trained to step 8, then resumed with more steps: the loop re-publishes a phase switch at step 8 (the new
    train.steps moved it there), which W&B online refuses and offline holds twice. Only steps after 8 go out."""
    first = tracking.WandbSink(tmp_path, {}, "run")
    for step in (4, 8):
        first.log({"step": step, "loss": 1.0})
    first.mixture({"step": 8, "kind": "snapshot", "tokens": {"code": 10}, "total": 10})
    first.close()
    fake_wandb.clear()

    resumed = tracking.WandbSink(tmp_path, {}, "run")
    resumed.mixture(_change(8))
    resumed.log({"step": 10, "loss": 0.5})
    resumed.samples(10, [{"step": 10, "domain": "code", "prompt": "a", "continuation": "b"}])
    resumed.close()
    assert fake_wandb == [(10, ["train/loss"]), (10, ["samples"])]
    assert resumed.run.summary["mixture/last_change"] == "...", "the switch itself is not lost"

    fake_wandb.clear()
    fresh = tracking.WandbSink(tmp_path / "another", {}, "run")  # a new OUT is a new W&B run: step 8 is new
    fresh.mixture(_change(8))
    assert fake_wandb == [(8, ["mixture/weight/code"])]
