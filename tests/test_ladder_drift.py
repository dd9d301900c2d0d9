"""The forecast's drift (issue 60): the law's schedule-shaped miss read off the curves' residuals.

Curves here are a known law times (1 + a residual pattern set by each run's schedule), so every drift the
tables should hold is computed by hand from the pattern: what `drift.tables` reads off is exact, not fitted.
"""

import math

import numpy as np
import pytest

from moelab.ladder.curve import CurveLaw, Run, curve_loss, fitted_rows
from moelab.ladder.drift import FRACTIONS, Drift, lr_shape, tables
from moelab.ladder.forecast import HALF_LIFE

LAW = CurveLaw(e=1.8, a=30.0, alpha=0.3, b=60.0, beta=0.3, c=0.15, tau=40.0)
STEPS = np.arange(20, 1001, 20)


def _lr(kind: str, steps: np.ndarray) -> np.ndarray:
    frac = steps / steps[-1]
    if kind == "wsd":  # constant, then a linear decay over the last 20%
        return np.where(frac > 0.8, 1 - 0.9 * (frac - 0.8) / 0.2, 1.0) * 1e-3
    return (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac))) * 1e-3  # cosine to 10%


def _pattern(kind: str, steps: np.ndarray) -> np.ndarray:
    """The residual the law leaves on a run of this schedule at a size of scale 1: WSD low until its cooldown,
    then up; cosine drifting down."""
    frac = steps / steps[-1]
    return np.where(frac > 0.8, 0.01 * (frac - 0.8) / 0.2, -0.005) if kind == "wsd" else -0.01 * frac**2


def _run(name, params, kind, scale, steps=STEPS, observed=True):
    planned = Run(name, params, steps, steps * 1e4, _lr(kind, steps))
    if not observed:
        return planned
    return Run(name, params, steps, steps * 1e4, planned.lr,
               curve_loss(LAW, planned) * (1 + scale * _pattern(kind, steps)))


def _by_hand(run: Run) -> np.ndarray:
    """drift(f) = r(T) - the age-weighted mean of r over the fitted evals up to f, weights halving every HALF_LIFE."""
    r = run.loss / curve_loss(LAW, run) - 1
    out = []
    for f in FRACTIONS:
        seen = r[fitted_rows(run) & (run.steps <= f * run.steps[-1])]
        w = 0.5 ** (np.arange(len(seen))[::-1] / HALF_LIFE)
        out.append(r[-1] - w @ seen / w.sum() if len(seen) else math.nan)
    return np.array(out)


def test_each_target_gets_the_drift_of_the_curves_with_its_schedule_shape_and_the_size_trend():
    """Two sizes, the pattern twice as large at the larger: `analog` is the larger size's drift for the target's
    schedule (sd: the spread of both sizes about it), `analog-size` extrapolates the doubling along log N."""
    curves = [_run(f"{kind}-{n:g}", n, kind, scale) for n, scale in ((1e6, 1.0), (2e6, 2.0)) for kind in ("wsd", "cos")]
    targets = [_run("big-wsd", 4e6, "wsd", 0, observed=False), _run("big-cos", 4e6, "cos", 0, observed=False)]
    got = tables(curves, LAW, targets)
    for kind, target in (("wsd", "big-wsd"), ("cos", "big-cos")):
        d1 = _by_hand(next(r for r in curves if r.name == f"{kind}-2e+06"))
        d0 = _by_hand(next(r for r in curves if r.name == f"{kind}-1e+06"))
        analog, sized = got[target]["analog"], got[target]["analog-size"]
        assert analog.analogs == (f"{kind}-2e+06",)
        known = np.isfinite(d1)
        assert known.sum() >= 15 and np.isnan(np.asarray(analog.mean)[~known]).all()  # nothing before the transient
        np.testing.assert_allclose(np.asarray(analog.mean)[known], d1[known], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(np.asarray(analog.sd)[known], np.abs(d1 - d0)[known] / math.sqrt(2), rtol=1e-9,
                                   atol=1e-12)
        np.testing.assert_allclose(np.asarray(sized.mean)[known], (2 * d1 - d0)[known], rtol=1e-9, atol=1e-12)
    cooldown = got["big-wsd"]["analog"].at(0.5)[0]
    assert cooldown == pytest.approx(0.02 + 0.01, rel=1e-6)  # at 2x: -1% before the cooldown, +2% at its end


def test_curves_of_one_size_grow_the_spread_as_the_target_runs_past_their_horizons():
    """One size at two horizons: the analogs are both; the target, twice the longest, is as far beyond it as the
    horizons lie apart (log 2 each), so the spread is not grown; at 4x it doubles."""
    curves = [_run("wsd-short", 1e6, "wsd", 1.0, steps=STEPS[:25]), _run("wsd-long", 1e6, "wsd", 1.5),
              _run("cos", 1e6, "cos", 1.0)]
    longer = [_run("t2", 1e6, "wsd", 0, steps=np.arange(40, 2001, 40), observed=False),
              _run("t4", 1e6, "wsd", 0, steps=np.arange(80, 4001, 80), observed=False)]
    got = tables(curves, LAW, longer)
    assert set(got["t2"]["analog"].analogs) == {"wsd-short", "wsd-long"}
    sd2, sd4 = (np.asarray(got[t]["analog"].sd) for t in ("t2", "t4"))
    known = np.isfinite(sd2)
    np.testing.assert_allclose(sd4[known], 2 * sd2[known], rtol=1e-9)
    for field in ("mean", "sd"):  # no second size: nothing to extrapolate
        np.testing.assert_array_equal(getattr(got["t2"]["analog-size"], field), getattr(got["t2"]["analog"], field))


def test_a_drift_table_round_trips_through_json_and_interpolates_between_its_fractions():
    drift = Drift(FRACTIONS, tuple([math.nan] * 2 + [0.01 * i for i in range(17)]), tuple([math.nan] * 2 + [0.002] * 17),
                  ("a",))
    again = Drift.from_json(drift.as_json(), FRACTIONS)
    assert again.analogs == ("a",) and np.allclose(again.mean[2:], drift.mean[2:]) and math.isnan(again.mean[0])
    assert drift.at(0.05) == (0.0, 0.0)  # before the table's first value: no drift
    assert drift.at(0.175) == pytest.approx((0.005, 0.002))
    assert drift.at(1.0) == pytest.approx((0.16, 0.002))  # past the last fraction: the last value
    with pytest.raises(ValueError):
        Drift.from_json({"mean": [0.0], "sd": [0.0]}, FRACTIONS)


def test_lr_shape_compares_schedules_on_the_fraction_of_their_steps():
    short, long = _run("s", 1e6, "cos", 0, steps=STEPS[:25], observed=False), _run("l", 1e6, "cos", 0, observed=False)
    np.testing.assert_allclose(lr_shape(short), lr_shape(long), atol=5e-3)  # rows every 2% vs 4%: linear between
    assert np.mean(np.abs(lr_shape(long) - lr_shape(_run("w", 1e6, "wsd", 0, observed=False)))) > 0.2
