"""Ladder rungs and the `moelab ladder` commands: plan reproduces the presets; bad recipes exit 2."""

import csv
from dataclasses import replace
import json
import warnings

import numpy as np
import pytest

from helpers import run_cli

from moelab import accounting, presets
from moelab.config import load_yaml, override
from moelab.errors import ConfigError
from moelab.ladder.on_track import load_on_track
from moelab.ladder.rungs import LadderRecipe, fit_lr_rule, load_recipe, preset_recipe, rungs_of
from moelab.presets import make_rung, scale_model, tokens_per_active_param
from moelab.ladder.run import target_rows, write_csv


@pytest.mark.parametrize("d, layers", presets.FRONTIER_LADDER)
def test_rungs_of_the_frontier_reproduce_the_ladder_presets(d, layers):
    frontier = presets.get("frontier-535b")
    rung = make_rung(frontier, d, layers, batch_size=256)
    preset = presets.get(f"ladder-d{d}")
    assert rung.model == preset.model
    assert rung.train.steps == preset.train.steps
    m = rung.model
    assert (m.num_heads, m.resolved_head_dim, m.moe.num_experts, m.moe.num_experts_per_token) == (d // 128, 128, 384, 8)
    assert m.moe.expert_dim == m.moe.latent_dim == m.moe.resolved_shared_expert_dim == d // 2


def test_rungs_keep_the_targets_tokens_per_active_parameter():
    frontier = presets.get("frontier-535b")
    ratio = tokens_per_active_param(frontier)
    for d, layers in presets.FRONTIER_LADDER:
        rung = make_rung(frontier, d, layers, batch_size=256)
        # steps are whole: the ratio holds to within one step's tokens
        assert abs(tokens_per_active_param(rung) - ratio) * accounting.count_params(rung.model).active \
            <= 256 * 4096


def test_the_frontiers_published_ladder_is_the_ladder_presets_on_the_frontiers_mesh():
    recipe = preset_recipe("frontier-535b")
    rungs = rungs_of(recipe)
    assert [r.model for r in rungs] == [presets.get(f"ladder-d{d}").model for d, _ in presets.FRONTIER_LADDER]
    # A rung keeps the target's rack (expert parallelism and layout) but runs on one rack in one pass:
    # how the target's 11 racks and 16 microbatches split its batch is not recipe (issue 38).
    one_rack = replace(recipe.target.mesh, replica=1)
    assert all(r.mesh == one_rack and r.train.microbatches == 1 and r.model.moe.dispatch == "ep" for r in rungs)
    assert recipe.target.mesh.replica == 11
    with pytest.raises(ConfigError, match="'tiny' has no published ladder.*frontier-535b"):
        preset_recipe("tiny")


def test_scale_model_rejects_a_width_that_breaks_the_head_size():
    with pytest.raises(ConfigError, match="d_model=100"):
        scale_model(presets.get("frontier-535b").model, 100, 4)


def test_a_recipe_needs_two_rungs():
    with pytest.raises(ConfigError, match="at least 2"):
        LadderRecipe(presets.get("tiny"), ((32, 2),))


def test_target_rows_carry_the_planned_lr_at_each_eval():
    cfg = override(presets.get("tiny"), {"train.steps": 100, "train.eval_every": 10})
    rows = target_rows(cfg)
    assert [r["step"] for r in rows] == list(range(10, 101, 10))
    assert rows[-1]["lr"] < rows[0]["lr"] or cfg.train.warmup_steps >= 10


def test_ladder_plan_preset_prints_the_rungs_and_target_as_json(monkeypatch, capsys):
    code, out, _ = run_cli(["ladder", "plan", "--preset", "frontier-535b", "--json"], monkeypatch, capsys)
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == ["ladder-d768-l8", "ladder-d1024-l12", "ladder-d1536-l16",
                                                       "ladder-d2048-l22", "frontier-535b"]
    assert rows[0]["steps"] == presets.get("ladder-d768").train.steps
    code, out, err = run_cli(["ladder", "plan", "--preset", "frontier-535b"], monkeypatch, capsys)
    assert code == 0 and "not 48 layers deep" in " ".join(err.split())  # the depth warning stands ...
    assert "published rung shapes, kept as published" in " ".join(out.split())  # ... and says it is intended


def test_ladder_plan_of_a_recipe_file(tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target: {preset: tiny}\nrungs: [[32, 1], [48, 2]]\nrung_batch_size: 8\n")
    code, out, _ = run_cli(["ladder", "plan", str(recipe), "--json"], monkeypatch, capsys)
    rows = json.loads(out)
    assert code == 0 and [r["d_model"] for r in rows] == [32, 48, 64]


@pytest.mark.parametrize("content, message", [
    ("target: {preset: tiny}\n", "must have the keys target and rungs"),
    ("target: {preset: tiny}\nrungs: [[32, 1]]\n", "at least 2"),
    ("target: {preset: tiny}\nrungs: [[48, 2], [32, 1]]\n", "must grow in active parameters"),
    ("target: {preset: nope}\nrungs: [[32, 1], [48, 2]]\n", "unknown preset"),
    ("target: {preset: tiny, steps: 3}\nrungs: [[32, 1], [48, 2]]\n", "steps cannot sit beside preset"),
    ("target: [unclosed\n", "not valid YAML at line"),
])
def test_bad_recipes_exit_2_with_a_clear_message(content, message, tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(content)
    code, _, err = run_cli(["ladder", "plan", str(recipe)], monkeypatch, capsys)
    assert code == 2 and message in " ".join(err.split())


def test_ladder_fit_command_bad_csv_exits_2(tmp_path, monkeypatch, capsys):
    curves = tmp_path / "curves.csv"
    curves.write_text("run,params,step,tokens,lr\nA,1,1,1,0.1\n")  # no loss column
    target = tmp_path / "target.csv"
    write_csv(target, [{"run": "T", "params": 10, "step": 1, "tokens": 1, "lr": 0.1}])
    code, _, err = run_cli(["ladder", "fit", "--curves", str(curves), "--target", str(target),
                            "--out", str(tmp_path / "pred.csv")], monkeypatch, capsys)
    assert code == 2 and "loss" in err
    assert not (tmp_path / "pred.csv").exists()


@pytest.mark.slow
def test_ladder_run_trains_rungs_fits_and_predicts_the_target(tmp_path, monkeypatch, capsys):
    """Two tiny rungs end to end: curves.csv has every eval, prediction.csv every target eval with bands.

    `slow` (issue 27): two rungs trained and fitted, ~60-80 s on 2 cores. The fast suite keeps `ladder plan`,
    the rung rules above and below, and the fit and its bands on synthetic curves (test_ladder_fit)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "target: {preset: tiny, overrides: {train.steps: 60, train.eval_batches: 1}}\n"
        "rungs: [[16, 1], [32, 1]]\nrung_batch_size: 8\n")
    out = tmp_path / "ladder"
    code, stdout, err = run_cli(["ladder", "run", str(recipe), "--out", str(out), "--json"], monkeypatch, capsys)
    assert code == 0, err
    curves = list(csv.DictReader(open(out / "curves.csv")))
    assert {r["run"] for r in curves} == {"ladder-d16-l1", "ladder-d32-l1"}
    pred = list(csv.DictReader(open(out / "prediction.csv")))
    assert len(pred) == 20 and all(float(r["lo95"]) <= float(r["loss_pred"]) <= float(r["hi95"]) for r in pred)
    assert json.loads(stdout)["law"]
    # target.yaml is the run the prediction is for: training it against the prediction raises no warning,
    # another length does.
    target = load_yaml(out / "target.yaml")
    track = load_on_track(out / "prediction.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        track.check_run(target)
    with pytest.warns(UserWarning, match="prediction.csv predicts 60 steps, not 90: its band is for another run"):
        track.check_run(override(target, {"train.steps": 90}))
    # A second run reuses the finished rungs; with --task it scores their checkpoints (one each: they were
    # trained without --task) and, with two computes, says why it cannot place the task law.
    mtime = (out / "rungs" / "ladder-d16-l1" / "summary.json").stat().st_mtime
    code, stdout, err = run_cli(["ladder", "run", str(recipe), "--out", str(out), "--task"], monkeypatch, capsys)
    assert code == 0, err
    assert (out / "rungs" / "ladder-d16-l1" / "summary.json").stat().st_mtime == mtime
    points = list(csv.DictReader(open(out / "task_points.csv")))
    assert [(r["run"], r["final"]) for r in points] == [("ladder-d16-l1", "True"), ("ladder-d32-l1", "True")]
    assert "no task prediction" in err and "three or more computes" in " ".join(err.split())
    assert "error" in json.loads((out / "task_prediction.json").read_text())
    assert len(rungs_of(LadderRecipe(presets.get("tiny"), ((16, 1), (32, 1)), 8))) == 2


def test_data_epochs_count_the_passes_over_each_domain_and_warn_past_one():
    """The old ladder-cpu target (default mixture, 3.35M tokens) read the ~0.65M-token prose split
    2.1 times; the recipe's own phases keep every domain under one pass."""
    from moelab.ladder.rungs import data_epochs, load_recipe, repeated_data

    cfg = load_recipe("experiments/ladder-cpu.yaml").target
    sizes = {"code": 3_557_343, "prose": 645_465, "arithmetic": 901_890}
    tokens = accounting.train_tokens(cfg)
    epochs = data_epochs(cfg, sizes)
    assert epochs["prose"] == pytest.approx(0.15 * tokens / sizes["prose"])
    assert epochs["arithmetic"] == pytest.approx((0.8 * 0.10 + 0.2 * 0.35) * tokens / sizes["arithmetic"])
    assert repeated_data([cfg], sizes) == []
    default_mix = override(cfg, {"data.phases": []})
    (warning,) = repeated_data([default_mix], sizes)
    assert warning.startswith("ladder-cpu-target reads prose 2.13x: repeated data bends its loss away")


def test_rungs_too_short_to_be_tuned_like_the_others_are_warned_once_per_shape(tmp_path, monkeypatch, capsys):
    """ladder-cpu's old d32 rung (186 steps, 5 seeds) is flagged once; its rungs from d48 (401 steps) are not."""
    from moelab.ladder.rungs import MIN_RUNG_STEPS, short_rungs

    recipe = replace(load_recipe("experiments/ladder-cpu.yaml"), shapes=((32, 3), (48, 3), (64, 3)), rung_seeds=5)
    (warning,) = short_rungs(rungs_of(recipe))
    assert warning.startswith(f"ladder-d32-l3 trains 186 steps, under {MIN_RUNG_STEPS}: a rung this short")
    assert short_rungs(rungs_of(replace(recipe, shapes=((48, 3), (64, 3))))) == []
    path = tmp_path / "recipe.yaml"
    path.write_text("target: {preset: tiny, overrides: {train.steps: 1000}}\nrungs: [[16, 1], [64, 2]]\n")
    code, out, err = run_cli(["ladder", "plan", str(path)], monkeypatch, capsys)
    assert code == 0 and "ladder-d16-l1 trains" in " ".join((out + err).split())
    assert "ladder-d64-l2 trains" not in " ".join((out + err).split())


def test_rungs_that_cannot_keep_the_targets_head_grouping_are_warned_once_per_width(tmp_path, monkeypatch, capsys):
    """ladder-cpu's target groups 2 query heads per KV head (6/3); its d48 and d80 rungs have 3 and 5
    heads of the same head dim, which 2 does not divide, so they get 3:1 and 5:1. With every KV head
    its own (num_kv_heads = num_heads) every rung keeps the target's grouping."""
    from moelab.ladder.rungs import regrouped_heads

    recipe = replace(load_recipe("experiments/ladder-cpu.yaml"), rung_seeds=2)
    warnings = regrouped_heads(rungs_of(recipe), recipe.target)
    assert [w.split(" groups")[0] for w in warnings] == ["ladder-d48-l3", "ladder-d80-l3"]
    assert warnings[0].startswith("ladder-d48-l3 groups 3 query heads per KV head (3/1), the target 2 (6/3)")
    mha = replace(recipe, target=override(recipe.target, {"model.num_kv_heads": 6}))
    assert regrouped_heads(rungs_of(mha), mha.target) == []
    code, out, err = run_cli(["ladder", "plan", "experiments/ladder-cpu.yaml"], monkeypatch, capsys)
    assert code == 0 and "ladder-d80-l3 groups 5 query heads per KV head" in " ".join((out + err).split())


def test_rungs_take_the_recipes_lr_rule():
    recipe = LadderRecipe(presets.get("tiny"), ((32, 2), (64, 2)), 8, lr_exponent=1.0)
    lrs = [cfg.train.lr for cfg in rungs_of(recipe)]
    assert lrs == pytest.approx([3e-3 * 64 / 32, 3e-3])
    with pytest.raises(ConfigError, match=r"lr_exponent=-1 is invalid: must be a number in \[0, 3\]"):
        LadderRecipe(presets.get("tiny"), ((32, 2), (64, 2)), 8, lr_exponent=-1)


def test_ladder_plan_says_how_the_rungs_lrs_are_set(tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target: {preset: tiny}\nrungs: [[32, 1], [48, 2]]\nrung_batch_size: 8\nlr_exponent: 0.75\n")
    code, out, _ = run_cli(["ladder", "plan", str(recipe)], monkeypatch, capsys)
    assert code == 0 and "lr(d) = 0.003 x (64 / d)^0.75 (lr_exponent 0.75)" in " ".join(out.split())
    recipe.write_text("target: {preset: tiny}\nrungs: [[32, 1], [48, 2]]\n")
    code, out, _ = run_cli(["ladder", "plan", str(recipe)], monkeypatch, capsys)
    assert code == 0 and "Every rung trains at the target's LR 0.003 (lr_exponent 0" in " ".join(out.split())


def test_fit_lr_rule_recovers_the_optimum_line_from_a_noisy_sweep():
    """Bowls around lr*(d) = 0.1 * d^-0.7 at levels falling with width, 1e-3 noise, grids not centred on it."""
    rng = np.random.default_rng(0)
    d = np.repeat([32, 48, 64, 96], 4)
    lr = np.tile([1e-3, 2e-3, 4e-3, 8e-3], 4) * np.repeat([2.0, 1.5, 1.0, 0.75], 4)
    loss = 3 - 0.5 * np.log(d) + 0.08 * np.log(lr / (0.1 * d ** -0.7)) ** 2 + rng.normal(0, 1e-3, d.size)
    rule = fit_lr_rule(d, lr, loss)
    assert rule.k == pytest.approx(0.7, abs=0.05)  # 1e-3 noise on bowls 0.08 deep per e-fold moves k by ~0.02
    assert rule.lr(96) == pytest.approx(0.1 * 96 ** -0.7, rel=0.05)
    assert rule.curvature == pytest.approx([0.08] * 4, rel=0.2) and rule.rmse < 2e-3


def test_fit_lr_rule_refuses_a_sweep_that_cannot_place_an_optimum():
    with pytest.raises(ConfigError, match="at least 2 widths with 3 or more LRs"):
        fit_lr_rule([32, 32, 64, 64, 64], [1e-3, 2e-3] + [1e-3, 2e-3, 4e-3], [2, 1.9, 1.8, 1.7, 1.6])
    falling = [3 - 0.1 * np.log(x) for x in [1e-3, 2e-3, 4e-3]]  # lower at every larger LR: no optimum
    with pytest.raises(ConfigError, match="best LR of d=32, d=64 is at an end of its LR grid"):
        fit_lr_rule([32] * 3 + [64] * 3, [1e-3, 2e-3, 4e-3] * 2, falling + falling)


def test_rung_seeds_train_each_shape_with_more_init_seeds_under_their_own_names():
    recipe = LadderRecipe(presets.get("tiny"), ((32, 2), (64, 2)), 8, rung_seeds=2)
    rungs = rungs_of(recipe)
    assert [(c.name, c.train.seed) for c in rungs] == [("ladder-d32-l2", 0), ("ladder-d32-l2-seed1", 1),
                                                       ("ladder-d64-l2", 0), ("ladder-d64-l2-seed1", 1)]
    assert rungs[0].model == rungs[1].model and rungs[0].train.steps == rungs[1].train.steps
    with pytest.raises(ConfigError, match=r"rung_seeds=0 is invalid"):
        LadderRecipe(presets.get("tiny"), ((32, 2), (64, 2)), 8, rung_seeds=0)
