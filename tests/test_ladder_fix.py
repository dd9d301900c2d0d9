"""`ladder plan --fix`, the fit's exclusions of flagged rungs, the honest self-check and its advice (issue 28)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import run_cli
from test_ladder_checks import HEADER, _curve_rows, _four_rungs, _write_csv
from test_ladder_fit import _synthetic_run

from moelab.errors import ConfigError, DataError
from moelab.ladder.fix import MIN_SEEDS, fix_recipe, seeds_for_band
from moelab.ladder.predict import fit_curves
from moelab.ladder.rungs import (MIN_RUNG_STEPS, data_epochs, load_recipe, mixed_depth, regrouped_heads,
                                 rung_flags, rungs_of, short_rungs, too_few_sizes)

EXPERIMENTS = Path(__file__).parent.parent / "experiments"
PLENTY = {"code": 10**9, "prose": 10**9, "arithmetic": 10**9}  # no domain near one pass


def _warnings(recipe) -> list[str]:
    rungs = rungs_of(recipe)
    return short_rungs(rungs) + regrouped_heads(rungs, recipe.target) + mixed_depth(rungs, recipe.target)


def test_fix_keeps_short_rungs_it_cannot_drop_and_says_why_instead_of_shrinking_the_batch():
    """A smaller rung batch gives a rung more steps but more learning per token: measured 16% low, so not done."""
    recipe = load_recipe(EXPERIMENTS / "ladder-untuned-wide16.yaml")
    assert len(short_rungs(rungs_of(recipe))) == 2
    fixed, changes = fix_recipe(recipe, PLENTY)
    assert [c.field for c in changes] == ["rungs", "rung_seeds"]
    assert fixed.shapes == recipe.shapes and fixed.rung_batch_size == recipe.rung_batch_size
    assert fixed.rung_seeds == MIN_SEEDS
    assert changes[0].why.startswith("not fixed:") and "dropping them would leave 1 size(s)" in changes[0].why


def test_fix_evens_depth_moves_regrouped_widths_and_lowers_a_repeated_domain():
    recipe = load_recipe(EXPERIMENTS / "ladder-untuned-fine32.yaml")
    sizes = {"code": 3_557_343, "prose": 645_465, "arithmetic": 902_570}  # the default corpus's train split
    assert data_epochs(recipe.target, sizes)["prose"] > 1.2
    fixed, changes = fix_recipe(recipe, sizes)
    fields = [c.field for c in changes]
    assert fields[0] == "rungs" and "target's depth 4" in changes[0].why
    assert "d40 dropped" in changes[1].why and "target.data.phases" in fields
    assert all(layers == 4 for _, layers in fixed.shapes) and fixed.shapes == ((32, 4), (48, 4))
    assert max(data_epochs(fixed.target, sizes).values()) <= 1.0
    assert short_rungs(rungs_of(fixed)) and too_few_sizes(rungs_of(fixed))  # what it cannot fix: said, not hidden
    assert regrouped_heads(rungs_of(fixed), fixed.target) == [] and mixed_depth(rungs_of(fixed), fixed.target) == []


def test_fix_drops_short_rungs_while_three_sizes_remain_and_refuses_below_two():
    recipe = load_recipe(EXPERIMENTS / "ladder-untuned-wide16.yaml")
    wide = replace(recipe, shapes=((32, 2), (64, 2), (80, 2), (96, 2)), rung_batch_size=8)
    fixed, changes = fix_recipe(wide, PLENTY)
    assert fixed.shapes == ((64, 2), (80, 2), (96, 2)) and "dropped" in changes[0].why
    with pytest.raises(ConfigError, match="cannot be fixed"):  # one width at two depths: one size at the target's
        fix_recipe(replace(wide, shapes=((64, 2), (64, 3))), PLENTY)


def test_fix_keeps_regrouped_rungs_it_cannot_move_or_drop_and_says_so():
    """ladder-cpu, the tuned recipe: d48 and d80 regroup its 2:1 heads (3:1, 5:1) and no width within 25% keeps
    the grouping, but dropping both would leave one size, so they stay, said; the widths that can move still do."""
    tuned = load_recipe(EXPERIMENTS / "ladder-cpu.yaml")
    fixed, changes = fix_recipe(tuned, PLENTY)
    assert fixed.shapes == tuned.shapes and [c.field for c in changes] == ["rungs"]
    assert changes[0].why.startswith("not fixed: d48, d80") and "would leave 1 size(s)" in changes[0].why
    fine = load_recipe(EXPERIMENTS / "ladder-untuned-fine32.yaml")  # head dim 8, 2:1: widths of 16
    fixed, changes = fix_recipe(replace(fine, shapes=((24, 4), (40, 4))), PLENTY)  # d16 and d32 are too far from d24
    assert fixed.shapes == ((24, 4), (48, 4)) and "d40 -> d48" in changes[0].why
    assert changes[1].why.startswith("not fixed: d24") and changes[1].before == changes[1].after


def test_rung_flags_name_every_check_a_rung_fails():
    recipe = load_recipe(EXPERIMENTS / "ladder-untuned-fine32.yaml")
    flags = rung_flags(rungs_of(recipe), recipe.target, {"code": 10**9, "prose": 10**5, "arithmetic": 10**9})
    assert set(flags) == {"ladder-d32-l2", "ladder-d40-l3", "ladder-d48-l4"}
    assert "under 250" in flags["ladder-d40-l3"] and "query heads per KV head" in flags["ladder-d40-l3"]
    assert "layers deep" in flags["ladder-d32-l2"] and "reads prose" in flags["ladder-d48-l4"]


def test_plan_fix_writes_the_fixed_recipe_in_the_users_form_and_warns_what_it_could_not_fix(tmp_path, monkeypatch, capsys):
    out = tmp_path / "fixed.yaml"
    code, stdout, err = run_cli(["ladder", "plan", str(EXPERIMENTS / "ladder-untuned-wide16.yaml"), "--fix",
                                 "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    assert "rung_seeds: 1 -> 3" in " ".join(stdout.split()) and "trains 99 steps" in err  # the unfixed: warned
    fixed = load_recipe(out)
    assert fixed.rung_seeds == 3 and fixed.shapes == load_recipe(EXPERIMENTS / "ladder-untuned-wide16.yaml").shapes
    assert yaml.safe_load(out.read_text())["target"]["preset"] == "tiny"  # the user's form, kept
    code, _, err = run_cli(["ladder", "plan", str(out), "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "--out and --runs go with --fix" in err


def _summary(run_sd: float, half_width: float, runs: int = 6) -> dict:
    return {"targets": [{"params": 1e6, "loss_pred": 2.0, "band95_half_width": half_width}],
            "noise": {"run_sd": run_sd, "run_dof": runs - 3, "size_exponent": 0.0, "ref_params": 1e6},
            "fit": {"runs": runs}}


def test_seeds_for_band_counts_seeds_until_the_run_spread_alone_is_too_wide():
    reachable = seeds_for_band(_summary(run_sd=0.01, half_width=0.06), sizes=3)
    assert reachable["reachable"] and reachable["half_width"] <= 0.03 and reachable["seeds"] > 2
    more_fit_noise = seeds_for_band(_summary(run_sd=0.01, half_width=0.12), sizes=3)
    assert more_fit_noise["seeds"] > reachable["seeds"]
    hopeless = seeds_for_band(_summary(run_sd=0.04, half_width=0.10), sizes=3)  # 1.96 x 2% > 3%
    assert not hopeless["reachable"] and "no number" not in hopeless["why"] and "cannot bring" in hopeless["why"]


def _fit(tmp_path, runs, **kw) -> dict:
    curves, target = tmp_path / "CURVES.csv", tmp_path / "TARGET.csv"
    _write_csv(curves, HEADER, _curve_rows(runs))
    planned = _synthetic_run("target", 3e8, 1600, "wsd", np.random.default_rng(0))
    _write_csv(target, HEADER[:5], [row[:5] for row in _curve_rows([planned])])
    return fit_curves(curves, target, tmp_path / "PRED.csv", num_bootstrap=20, **kw)


def test_the_fit_leaves_flagged_rungs_out_with_the_reason_while_two_sizes_remain(tmp_path):
    runs = _four_rungs(np.random.default_rng(0))
    summary = _fit(tmp_path, runs, exclude={"r0": "trains 180 steps, under 250"})
    assert summary["excluded"] == [{"run": "r0", "reason": "trains 180 steps, under 250"}]
    assert summary["fit"]["runs"] == 3 and summary["notes"][0].startswith("left out of the fit: r0")
    kept = _fit(tmp_path, runs, exclude={"r0": "x", "r1": "x", "r2": "x"})  # one size would be left
    assert kept["excluded"] == [] and kept["fit"]["runs"] == 4 and "every run is fitted" in kept["notes"][0]
    with pytest.raises(DataError, match="no run named nope"):
        _fit(tmp_path, runs, exclude={"nope": "x"})


def test_a_self_check_too_wide_to_fail_is_uninformative_not_trusted_and_says_what_to_add(tmp_path):
    rng = np.random.default_rng(0)
    noisy = [_synthetic_run(f"r{i}-{s}", n, 400 + 200 * i, "wsd", rng, 20, 0.08, 0.01)
             for i, n in enumerate(np.geomspace(1e6, 1e8, 4)) for s in range(2)]
    summary = _fit(tmp_path, noisy)
    check = summary["self_check"]
    assert check["band95_half_width"] > 0.10 and check["verdict"] == "uninformative" and check["trusted"] is False
    assert summary["notes"][0].startswith("SELF-CHECK UNINFORMATIVE")
    assert summary["advice"]["text"].startswith("To reach a +-3% band") and summary["advice"]["seeds_per_rung"] >= 3
    good = _fit(tmp_path, _four_rungs(np.random.default_rng(0)))
    assert good["self_check"]["verdict"] == "passed" and "advice" not in good


def test_plan_fix_out_that_is_a_folder_or_under_a_file_exits_2_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    recipe = str(EXPERIMENTS / "ladder-untuned-wide16.yaml")
    (tmp_path / "a-file").write_text("x")
    for out, message in ((tmp_path, "is a folder"), (tmp_path / "a-file" / "fixed.yaml", "cannot be written")):
        code, stdout, err = run_cli(["ladder", "plan", recipe, "--fix", "--out", str(out)], monkeypatch, capsys)
        assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no .tmp left behind


def test_the_depth_warning_pairs_each_rung_with_its_own_depth_in_size_order():
    """Issue 54: the warning sorted names as strings and depths by size, so `ladder-d1024-l12` read as 8 deep."""
    from moelab import presets

    rungs = [presets.get(f"ladder-d{d}") for d in (768, 1024, 1536, 2048)]
    [warning] = mixed_depth(rungs, presets.get("frontier-535b"))
    assert warning.startswith("ladder-d768 (8), ladder-d1024 (12), ladder-d1536 (16), ladder-d2048 (22) "
                              "are not 48 layers deep")
