"""Training behaviour: the loss falls below the corpus's unigram entropy, schedules have their shape."""

import json

import numpy as np
import pytest

from moelab import presets
from moelab.config import override
from moelab.data.mixture import unigram_entropy
from moelab.train.loop import prepare_corpus, train
from moelab.train.schedule import decay_start, learning_rate


def test_tiny_model_beats_the_unigram_entropy_of_the_corpus(tmp_path):
    """A unigram model is what a bag-of-bytes learner reaches; a working LM must get clearly below it."""
    cfg = override(presets.get("tiny"), {"train.steps": 150, "train.eval_every": 150, "train.eval_batches": 2})
    summary = train(cfg, tmp_path)
    entropy = unigram_entropy(prepare_corpus(cfg))
    mean_eval = summary["eval_mean"]
    assert mean_eval < entropy - 0.5, (mean_eval, entropy)
    assert all(summary["eval"][d] < summary["eval_initial"][d] for d in summary["eval"])
    assert summary["incidents"] == 0  # the monitor's default rules raise no false alarm on a clean run
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    assert {r["phase"] for r in records} == {"pretrain", "midtrain"}


@pytest.mark.parametrize("schedule", ["wsd", "cosine"])
def test_schedules_warm_up_to_peak_and_end_at_the_floor(schedule):
    t = override(presets.get("tiny"), {"train.schedule": schedule, "train.steps": 100,
                                       "train.warmup_steps": 10}).train
    lr = learning_rate(t)
    assert float(lr(0)) < t.lr and np.isclose(float(lr(10)), t.lr)
    assert np.isclose(float(lr(100)), t.lr * t.min_lr_ratio)
    if schedule == "wsd":
        assert decay_start(t) == 80 and np.isclose(float(lr(79)), t.lr) and float(lr(90)) < t.lr


def test_warmup_longer_than_the_run_is_clamped_to_the_run():
    t = override(presets.get("tiny"), {"train.steps": 5, "train.warmup_steps": 30}).train
    lrs = [float(learning_rate(t)(s)) for s in range(6)]
    assert lrs[:5] == sorted(lrs[:5]) and np.isclose(lrs[5], t.lr)  # peak reached at the run's end, not step 30
