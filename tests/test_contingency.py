"""The contingency rule: shrink the budget after an early loss, keep it (and report the delay) after a late one.

The base plan trains 1,000 steps of 16 x 64 = 1,024 tokens at 1,024 tokens/s on 8 devices: one step per
second, so a deadline of None means 1,000 s and every hand computation below counts in steps and seconds.
"""

import math
import re
from pathlib import Path

import pytest

from helpers import run_cli
from moelab.config import RunConfig, dump_yaml, load_yaml, override
from moelab.errors import ConfigError
from moelab.data.mixture import phase_boundaries
from moelab.train.contingency import (
    EARLY_FRACTION,
    Event,
    check_event,
    comparison_rows,
    parse_event,
    replan,
)
from moelab.train.schedule import decay_start

STEPS = 1000


def _plan(**overrides) -> RunConfig:
    base = {"train.steps": STEPS, "train.batch_size": 16, "model.seq_len": 64, "train.warmup_steps": 20,
            "plan.num_devices": 8, "plan.tokens_per_s": 1024.0}
    return override(RunConfig(), {**base, **{k.replace("__", "."): v for k, v in overrides.items()}})


def _raises_naming(field: str):
    return pytest.raises(ConfigError, match=re.escape(field))


# ----------------------------------------------------------------------------------------------
# the rule's edge


@pytest.mark.parametrize("kind", ["devices_lost", "steps_lost"])
@pytest.mark.parametrize("step, rule", [(249, "shrink"), (250, "shrink"), (251, "keep")])
def test_events_up_to_exactly_a_quarter_of_the_budget_shrink_it_and_later_ones_keep_it(kind, step, rule):
    """EARLY_FRACTION is inclusive: an event at exactly 25% of the budget (step 250 of 1000) still shrinks."""
    assert EARLY_FRACTION * STEPS == 250
    result = replan(_plan(), Event(kind, step, 2))
    assert result.rule == rule
    if rule == "shrink":
        assert result.budget_tokens_new < result.budget_tokens_old
        assert result.delay_hours <= 0
    else:
        assert result.budget_tokens_new == result.budget_tokens_old
        assert result.delay_hours > 0


# ----------------------------------------------------------------------------------------------
# the shrunk budget, by hand


def test_losing_devices_early_shrinks_the_budget_to_what_the_remaining_time_trains():
    # Deadline None = 1000 s. Step 200 at 200 s; 6 of 8 devices do 0.75 step/s for 800 s: 600 more steps.
    result = replan(_plan(), parse_event("devices_lost:step=200,count=2"))
    assert result.new.train.steps == 200 + 600
    assert result.budget_tokens_new == 800 * 1024
    assert result.new.plan.num_devices == 6 and result.new.plan.tokens_per_s == 768.0
    assert math.isclose(result.finish_hours_new, 1000 / 3600) and math.isclose(result.delay_hours, 0, abs_tol=1e-12)


def test_an_explicit_deadline_sets_the_time_left_and_the_new_steps_are_rounded_down():
    # Deadline 0.3 h = 1080 s. Step 100 at 100 s; 5 of 8 devices do 0.625 step/s for 980 s: 612.5 -> 612 steps.
    result = replan(_plan(plan__deadline_hours=0.3), parse_event("devices_lost:step=100,count=3"))
    assert result.new.train.steps == 100 + 612
    assert result.new.plan.deadline_hours == 0.3
    assert result.finish_hours_new <= 0.3 and result.delay_hours <= 0


@pytest.mark.parametrize("tokens_per_s", [1024.0, 1001.11, 1016.28])  # in floats the last two lose a step
def test_a_rollback_on_an_exactly_fitting_plan_loses_exactly_the_rolled_back_steps(tokens_per_s):
    """With the deadline at the plan's own finish, redoing N steps leaves room for steps - N, at any speed
    (the floor is taken on exact rationals, so float noise cannot drop one more step)."""
    result = replan(_plan(plan__tokens_per_s=tokens_per_s), parse_event("steps_lost:step=200,count=50"))
    assert result.resume_step == 150
    assert result.new.train.steps == STEPS - 50
    assert result.new.plan.tokens_per_s == tokens_per_s and result.new.plan.num_devices == 8


def test_a_deadline_with_slack_never_grows_the_budget_beyond_the_old_one():
    # Deadline 0.5 h = 1800 s: 100 + floor(1700 x 7/8) = 1587 steps would fit, but the plan only asked for 1000.
    result = replan(_plan(plan__deadline_hours=0.5), parse_event("devices_lost:step=100,count=1"))
    assert result.rule == "shrink"
    assert result.new.train.steps == STEPS and result.budget_tokens_new == result.budget_tokens_old
    assert "whole budget" in result.explanation


@pytest.mark.parametrize(
    "spec", ["devices_lost:step=0,count=1", "devices_lost:step=200,count=2", "devices_lost:step=250,count=5",
             "steps_lost:step=250,count=250", "steps_lost:step=123,count=7"],
)
@pytest.mark.parametrize("decay_fraction, pretrain", [(0.2, 0.8), (0.1, 0.7), (0.33, 0.55)])
def test_shrinking_keeps_the_decay_start_and_phase_boundary_at_the_same_share_of_the_steps(
    spec, decay_fraction, pretrain
):
    cfg = _plan(train__decay_fraction=decay_fraction)
    cfg = override(cfg, {"data.phases": [{"name": "pretrain", "fraction": pretrain, "weights": {"code": 1.0}},
                                         {"name": "midtrain", "fraction": 1 - pretrain,
                                          "weights": {"arithmetic": 1.0}}]})
    result = replan(cfg, parse_event(spec))
    scale = result.new.train.steps / STEPS
    assert result.new.train.steps < STEPS
    assert result.new.train.decay_fraction == decay_fraction and result.new.data == cfg.data
    # within one step: each side rounds its own product to the nearest step
    assert abs(result.decay_start_new - result.decay_start_old * scale) <= 1
    assert abs(result.phase_boundaries_new[0] - result.phase_boundaries_old[0] * scale) <= 1
    assert result.decay_start_new == decay_start(result.new.train)
    assert list(result.phase_boundaries_new) == phase_boundaries(cfg.data, result.new.train.steps)[1:]
    assert min(result.decay_start_new, *result.phase_boundaries_new) >= result.resume_step


# ----------------------------------------------------------------------------------------------
# later events keep the budget


@pytest.mark.parametrize(
    "spec, deadline_hours, finish_seconds",
    [
        ("devices_lost:step=500,count=4", None, 500 + 500 / 0.5),  # half the devices: the last half takes 2x
        ("devices_lost:step=800,count=2", None, 800 + 200 / 0.75),
        ("steps_lost:step=600,count=100", None, 1000 + 100),  # 100 steps redone
        ("steps_lost:step=600,count=100", 0.5, 1000 + 100),  # 1800 s deadline: on time, 700 s of slack left
        ("steps_lost:step=600,count=80", 0.3, 1000 + 80),  # 1080 s deadline: finishes right on it
    ],
)
def test_later_events_keep_the_budget_and_report_the_delay_against_the_deadline(spec, deadline_hours, finish_seconds):
    result = replan(_plan(plan__deadline_hours=deadline_hours), parse_event(spec))
    deadline_seconds = 1000 if deadline_hours is None else deadline_hours * 3600
    assert result.rule == "keep"
    assert result.new.train == result.old.train and result.budget_tokens_new == result.budget_tokens_old
    assert math.isclose(result.finish_hours_old, 1000 / 3600)
    assert math.isclose(result.finish_hours_new, finish_seconds / 3600)
    # abs_tol: a delay of 0 is compared too, and 0.3 h is not exact in binary (1e-9 h is 3.6 microseconds)
    assert math.isclose(result.delay_hours, (finish_seconds - deadline_seconds) / 3600, abs_tol=1e-9)
    timing = "h after" if finish_seconds > deadline_seconds else "h before" if finish_seconds < deadline_seconds \
        else "right at"
    assert f"{timing} the {deadline_seconds / 3600:.2f} h deadline" in result.explanation


# ----------------------------------------------------------------------------------------------
# impossible plans


@pytest.mark.parametrize(
    "overrides, spec, field",
    [
        ({"plan__tokens_per_s": None}, "devices_lost:step=100,count=1", "plan.tokens_per_s"),
        ({"plan__deadline_hours": 0.1}, "devices_lost:step=400,count=1", "plan.deadline_hours"),  # 360 s < 400 s
        ({"plan__deadline_hours": 0.05}, "steps_lost:step=200,count=10", "plan.deadline_hours"),  # 180 s < 200 s
        # 225 s deadline: 1 s left at 1/8 step/s trains no whole step
        ({"plan__deadline_hours": 0.0625}, "devices_lost:step=224,count=7", "cannot fit"),
        # 15 of 16 lost at step 250: 250 + 750/16 = 296 steps, decay from 237 < 250
        ({"plan__num_devices": 16}, "devices_lost:step=250,count=15", "train.decay_fraction"),
        ({"plan__num_devices": 16, "train__decay_fraction": 0.0}, "devices_lost:step=250,count=15",
         "data.phases[midtrain].fraction"),
        ({"train__warmup_steps": 500}, "devices_lost:step=100,count=7", "train.warmup_steps"),  # 212 steps < 500
        ({"train__schedule": "cosine"}, "devices_lost:step=100,count=2", "train.schedule"),
    ],
)
def test_impossible_plans_raise_config_error_naming_the_field(overrides, spec, field):
    with _raises_naming(field):
        replan(_plan(**overrides), parse_event(spec))


def test_a_cosine_plan_can_still_shrink_while_it_is_warming_up():
    result = replan(_plan(train__schedule="cosine"), parse_event("devices_lost:step=10,count=2"))
    assert result.new.train.steps == 10 + math.floor(990 * 0.75)


# ----------------------------------------------------------------------------------------------
# event strings


def test_an_event_string_reads_into_an_event_and_back():
    event = parse_event(" steps_lost: step = 3000, count=500 ")
    assert event == Event("steps_lost", 3000, 500)
    assert parse_event(event.spec) == event


@pytest.mark.parametrize(
    "spec, field",
    [
        ("lost_devices:step=1,count=1", "devices_lost, steps_lost"),
        ("devices_lost", "step=S,count=N"),
        ("devices_lost:step=1", "event.count"),
        ("devices_lost:count=1", "event.step"),
        ("devices_lost:step=1,count=1,extra=2", "event.extra"),
        ("devices_lost:step=1,step=2,count=1", "event.step"),
        ("devices_lost:step=1,count", "key=value"),
        ("devices_lost:step=1.5,count=1", "event.step"),
        ("devices_lost:step=1,count=-1", "event.count"),
        ("steps_lost:step=-5,count=1", "event.step"),
        ("steps_lost:step=5,count=0", "event.count"),
    ],
)
def test_malformed_event_strings_raise_config_error_naming_the_field(spec, field):
    with _raises_naming(field):
        parse_event(spec)


@pytest.mark.parametrize(
    "spec, field",
    [
        ("devices_lost:step=1000,count=1", "train.steps=1000"),
        ("steps_lost:step=5000,count=1", "train.steps=1000"),
        ("devices_lost:step=100,count=8", "plan.num_devices=8"),
        ("steps_lost:step=100,count=101", "event.step=100"),
    ],
)
def test_events_that_cannot_happen_in_the_plan_raise_config_error_naming_the_limit(spec, field):
    with _raises_naming(field):
        check_event(parse_event(spec), _plan())
    with _raises_naming(field):
        replan(_plan(), parse_event(spec))


# ----------------------------------------------------------------------------------------------
# output


@pytest.mark.parametrize("spec", ["devices_lost:step=200,count=2", "steps_lost:step=700,count=100"])
def test_the_new_plan_round_trips_through_yaml(spec, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(dump_yaml(_plan()))
    result = replan(load_yaml(path), parse_event(spec))
    (tmp_path / "new.yaml").write_text(dump_yaml(result.new))
    assert load_yaml(tmp_path / "new.yaml") == result.new


def test_comparison_rows_put_old_and_new_numbers_side_by_side():
    rows = {field: (old, new) for field, old, new in comparison_rows(replan(_plan(), parse_event(
        "devices_lost:step=200,count=2")))}
    assert rows["train.steps"] == ("1,000", "800")
    assert rows["token budget"] == ("1,024,000", "819,200")
    assert rows["plan.num_devices"] == ("8", "6")
    assert rows["plan.tokens_per_s"] == ("1,024", "768")
    assert rows["LR decay start (step)"] == ("800", "640")
    assert rows["midtrain start (step)"] == ("800", "640")
    assert rows["deadline (h)"] == ("0.28", "0.28")
    assert rows["finish - deadline (h)"] == ("+0.00", "+0.00")


def test_replan_command_writes_the_new_plan_says_when_it_replaces_one_and_refuses_a_missing_file(
        tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(dump_yaml(_plan()))
    args = ["replan", str(plan), "--event", "devices_lost:step=200,count=2"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "replaced" not in out
    assert load_yaml(tmp_path / "plan-replanned.yaml").train.steps < STEPS
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0 and "it replaced the file there" in " ".join(out.split())
    code, _, err = run_cli(["replan", str(tmp_path / "nope.yaml"), "--event", "devices_lost:step=1,count=1"],
                           monkeypatch, capsys)
    assert code == 2 and "plan file" in err and "--preset" not in err


def test_the_shipped_plan_gives_the_readme_table():
    """experiments/plan.yaml losing 8 of 64 devices at step 1200: the README's 10,000 -> 9,206 steps."""
    plan = load_yaml(Path(__file__).resolve().parents[1] / "experiments" / "plan.yaml")
    result = replan(plan, parse_event("devices_lost:step=1200,count=8"))
    assert (plan.train.steps, result.new.train.steps, result.new.plan.num_devices) == (10_000, 9_206, 56)
