"""Training behaviour: the loss falls below the corpus's unigram entropy, schedules have their shape."""

import json
import re

import numpy as np
import pytest

from moelab import presets
from moelab.config import override
from moelab.data.mixture import unigram_entropy
from moelab.train.loop import prepare_corpus, train
from moelab.train.schedule import decay_start, learning_rate


@pytest.mark.slow
def test_tiny_model_beats_the_unigram_entropy_of_the_corpus(tmp_path):
    """A unigram model is what a bag-of-bytes learner reaches; a working LM must get clearly below it.

    `slow` (issue 27): 150 steps, ~45 s on 2 cores. The fast suite keeps learning at other scales: a few
    Adam steps fitting a batch (test_model) and the monitor's clean 60-step run with no false alarm."""
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


@pytest.mark.slow
def test_a_finished_run_is_recognised_before_anything_compiles(tmp_path, monkeypatch):
    """Rerunning a finished run used to build, compile and restore the model (13-17 s) to learn that
    there was nothing to do; now its summary and sealed last checkpoint answer before any of that.
    `slow` (issue 28's tests pushed `make test` past 8 min): a training of its own, ~19 s on 2 cores; the fast
    suite keeps a finished run left alone, unchanged, in test_checkpoint.py."""
    from moelab.train import loop

    cfg = override(presets.get("tiny"), {"train.steps": 2, "train.eval_batches": 1})
    first = train(cfg, tmp_path)

    def no_compiling(*args, **kwargs):
        raise AssertionError("a finished run must not build or compile anything")

    monkeypatch.setattr(loop, "init_sharded_state", no_compiling)
    monkeypatch.setattr(loop, "make_train_step", no_compiling)
    with pytest.warns(UserWarning, match="already finished its 2 steps"):
        assert train(cfg, tmp_path) == first


def test_throughput_is_the_steady_state_after_the_first_step_and_the_compile_is_reported_apart(tmp_path,
                                                                                             monkeypatch):
    """A clock that only moves inside train steps: the first (compiling) step takes 1000 s, every other
    one 1 s. The summary and every logged record (what the progress bar shows) must say one step's tokens
    per second, not a figure diluted by the compile (the old summary used the last log window, which held
    the compile in a short run; the first record's window held it until issue 31), and `compile_s` the 1000 s."""
    from types import SimpleNamespace

    from moelab.train import loop

    clock = {"now": 0.0, "calls": 0}
    real_make_train_step = loop.make_train_step

    def timed_make_train_step(cfg, mesh=None):
        step = real_make_train_step(cfg, mesh)

        def timed(*args):
            clock["now"] += 1000.0 if clock["calls"] == 0 else 1.0
            clock["calls"] += 1
            return step(*args)
        return timed

    monkeypatch.setattr(loop, "make_train_step", timed_make_train_step)
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    cfg = override(presets.get("tiny"), {"train.steps": 4, "train.eval_batches": 1, "train.log_every": 2})
    summary = train(cfg, tmp_path)
    assert clock["calls"] == 4
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    assert summary["tokens_per_s"] == pytest.approx(tokens_per_step) and summary["compile_s"] == pytest.approx(1000)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens_per_s"]) for r in records] == [(2, pytest.approx(tokens_per_step)),
                                                                 (4, pytest.approx(tokens_per_step))]


@pytest.mark.slow
def test_hooks_hear_each_slow_stage_before_the_first_step_and_the_resume(tmp_path):
    """What the progress bar shows while XLA compiles (it used to say "loading data" throughout), and
    the "resuming from step N" line.

    `slow` (issue 27): two trainings of their own shape, ~18 s on 2 cores."""
    from moelab.train.loop import Hooks

    heard = []
    hooks = Hooks(on_stage=lambda name: heard.append(("stage", name)),
                  on_resume=lambda step, path: heard.append(("resume", step, path.name)),
                  on_step=lambda done: heard.append(("step", done)))
    cfg = override(presets.get("tiny"), {"train.steps": 2, "train.eval_batches": 1})
    train(cfg, tmp_path, hooks)
    stages = [e[1] for e in heard if e[0] == "stage"]
    assert stages == ["building the model", "compiling the eval step", "compiling the sampler",
                      "compiling the train step"]
    assert heard.index(("stage", "compiling the train step")) < heard.index(("step", 1))

    heard.clear()
    train(override(cfg, {"train.steps": 3}), tmp_path, hooks)
    assert ("resume", 2, "2") in heard
    # A resume compiles what its first eval needs before the steps too (no stall mid-run, no compile in tok/s).
    assert [e[1] for e in heard if e[0] == "stage"] == stages
    assert heard.index(("stage", "compiling the train step")) < heard.index(("step", 3))


def test_the_progress_status_shows_how_long_the_current_stage_has_run():
    import time

    from rich.progress import Progress

    from moelab.cli.train import _StatusColumn

    progress = Progress()
    task = progress.add_task("tiny", status="compiling the train step", since=time.monotonic() - 12.2)
    assert _StatusColumn().render(progress.tasks[task]).plain == "compiling the train step 12 s"
    progress.update(task, status="loss 4.500  9,000 tok/s", since=None)
    assert _StatusColumn().render(progress.tasks[task]).plain == "loss 4.500  9,000 tok/s"


@pytest.mark.parametrize("terminal", [True, False])
def test_the_train_steps_compile_time_stays_on_a_line_and_off_a_terminal_every_stages_does(terminal, monkeypatch,
                                                                                          capsys):
    """On a terminal the bar shows each stage live and keeps the compile's time (the stage the first step ends)
    on a line; piped to a file the bar is not redrawn, and the stages' times used to vanish."""
    from moelab.cli.common import err_console
    from moelab.cli.train import training_progress

    monkeypatch.setattr(err_console, "_force_terminal", terminal)
    with training_progress(presets.get("tiny")) as hooks:
        hooks.stage("building the model")
        hooks.stage("compiling the train step")
        hooks.on_log({"step": 1, "loss": 4.5, "tokens_per_s": 9000.0})
        hooks.on_step(1)
        hooks.on_step(2)
    err = capsys.readouterr().err
    assert len(re.findall(r"compiling the train step: \d+\.\d s", err)) == 1
    assert bool(re.search(r"building the model: \d+\.\d s", err)) is not terminal


def test_weight_decay_shrinks_the_matrices_and_leaves_every_norm_gain_alone():
    """Issue 59: stacked over layers a gain is [L, D], as many dimensions as a matrix, and the rank rule decayed
    every block's gains. With a zero gradient AdamW moves a parameter only by its decay: each matrix shrinks, and
    no gain (attention, MLP, latent, QK, final norms; dense blocks' too) moves at all."""
    import jax
    import jax.numpy as jnp
    import optax

    from moelab import presets
    from moelab.config import override
    from moelab.model import transformer
    from moelab.train.state import decay_mask, make_optimizer

    from dataclasses import replace

    from moelab.presets import scale_model

    cfg = override(presets.get("tiny"), {"model.dense_layers": 1, "model.qk_norm": "head", "train.warmup_steps": 1,
                                         "train.weight_decay": 0.1})
    cfg = replace(cfg, model=scale_model(cfg.model, 32, 2))  # one dense block, one MoE block: every kind of gain
    params = jax.jit(transformer.init, static_argnums=0)(cfg.model, jax.random.key(0))
    tx = make_optimizer(cfg.train)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    update = jax.jit(tx.update)  # one compile instead of every leaf's ops dispatched one by one
    for _ in range(2):  # the first step is the warmup's lr 0
        updates, state = update(zeros, state, params)
        params_after = optax.apply_updates(params, updates)
    moved = {jax.tree_util.keystr(path): bool(jnp.any(a != b)) for (path, a), b
             in zip(jax.tree_util.tree_leaves_with_path(params_after), jax.tree.leaves(params))}
    gains = {k for k in moved if k.endswith("norm']")}
    assert len(gains) == 10  # attn, mlp, q, k norms of both stacks, the latent norm and the final norm
    assert not any(moved[k] for k in gains), {k for k in gains if moved[k]}
    assert all(moved[k] for k in moved if k not in gains)
    # A checkpoint saved under the old rank rule still restores: the mask picks values, not the state's tree.
    old_rule = optax.adamw(1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    new_rule = optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask)
    assert jax.tree.structure(old_rule.init(params)) == jax.tree.structure(new_rule.init(params))


def test_bfloat16_moments_are_float32_moments_rounded_and_the_update_computed_in_float32():
    """`train.moment_dtype: bfloat16` (the frontier preset's): Adam's moments are stored rounded, the update is
    computed in float32. Step 1 starts from zero moments: its update is float32's exactly and its stored first
    moment float32's rounded (2^-8). Step 2 reads the rounded moments: within a few bfloat16 roundings of
    m / sqrt(v), 2^-6 of the update. (tests/test_sharded_state.py runs it in a real step, `slow`.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moelab import presets
    from moelab.config import override
    from moelab.train.state import make_optimizer

    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(keys[0], (16, 8)), "gain": jnp.ones((8,))}
    grads = [{"w": jax.random.normal(k, (16, 8)), "gain": jax.random.normal(k, (8,))} for k in keys[1:3]]
    tiny = presets.get("tiny")
    narrow, wide = (make_optimizer(override(tiny, {"train.moment_dtype": dtype, "train.warmup_steps": 0}).train)
                    for dtype in ("bfloat16", "float32"))
    states = {"narrow": narrow.init(params), "wide": wide.init(params)}
    updates = {}
    for i, g in enumerate(grads):
        updates[i] = {}
        for name, tx in (("narrow", narrow), ("wide", wide)):
            updates[i][name], states[name] = jax.jit(tx.update)(g, states[name], params)
        if i == 0:
            floats = [a for a in jax.tree.leaves(states["narrow"]) if jnp.issubdtype(a.dtype, jnp.floating)]
            assert floats and {a.dtype for a in floats} == {jnp.dtype(jnp.bfloat16)}
            for a, b in zip(jax.tree.leaves(updates[0]["narrow"]), jax.tree.leaves(updates[0]["wide"])):
                assert np.any(b != 0)  # no warmup: the first step moves every parameter
                np.testing.assert_array_equal(a, b)
            for a, b in zip(jax.tree.leaves(states["narrow"]), jax.tree.leaves(states["wide"])):
                if jnp.issubdtype(a.dtype, jnp.floating):
                    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2**-8, atol=1e-30)
    for a, b in zip(jax.tree.leaves(updates[1]["narrow"]), jax.tree.leaves(updates[1]["wide"])):
        assert np.max(np.abs(a - b)) <= 2**-6 * np.max(np.abs(b)) + 1e-12


def test_ctrl_c_before_the_first_checkpoint_leaves_nothing_half_made_and_says_rerun(tmp_path, monkeypatch):
    """Ctrl-C while the model builds (before the steps' own signal handler, issue 62): `Preempted` (exit 75, as
    the README says of Ctrl-C) with nothing saved; a run folder this run created is removed, and in a folder that
    was there before only the empty `checkpoints/` it made goes."""
    from moelab.errors import Preempted
    from moelab.train import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "init_sharded_state", interrupted)
    cfg = presets.resolve("tiny", {"train.steps": 2})
    with pytest.raises(Preempted, match=r"before the first checkpoint: nothing was saved, and .*run, which this run "
                                        r"created, is removed\. Rerun the same command to start") as stopped:
        train(cfg, tmp_path / "run")
    assert stopped.value.path is None and not (tmp_path / "run").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(Preempted, match="nothing was saved. Rerun"):
        train(cfg, mine)
    assert mine.is_dir() and not (mine / "checkpoints").exists()
