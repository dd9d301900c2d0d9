"""The multi-power annealing term (Luo et al. 2025): its binned drop sum and its fit."""

from dataclasses import replace

import numpy as np
import pytest
from test_ladder_fit import _schedule

from moelab.ladder.curve import CurveLaw, Run, curve_loss, drop_terms, multipower_drop
from moelab.ladder.fit import fit_curve_law

# one size, a drop term that settles over a LR area of ~200 steps at peak LR, Luo et al.'s exponents
TRUE = CurveLaw(e=2.0, a=0.0, alpha=0.0, b=60.0, beta=0.3, c=0.4, tau=200.0, size=1e8, form="multipower",
                power=0.6, gamma=0.5)


def _run(name: str, kind: str, num_steps: int = 3000, decay_fraction: float = 0.2, every: int = 50) -> Run:
    lr = 3e-3 * _schedule(kind, num_steps, warmup=100, decay_fraction=decay_fraction)
    steps = np.arange(every, num_steps + 1, every)
    run = Run(name, 1e8, steps, steps * 2e4, lr[steps - 1])
    return replace(run, loss=curve_loss(TRUE, run))


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_the_binned_drop_sum_matches_the_per_step_sum_of_luo_et_al(kind):
    run = _run("r", kind, num_steps=8000, every=200)
    rel = np.interp(np.arange(8001), run.steps, run.lr / run.lr.max())
    delta = np.diff(np.maximum.accumulate(rel) - rel, prepend=0.0)
    exact = []
    for t in run.steps.astype(int):  # sum over k <= t of drop_k * G(lr_k^-gamma * sum of lr over k..t)
        area = np.cumsum(rel[: t + 1][::-1])[::-1]
        x = np.maximum(rel[: t + 1], 1e-3) ** -TRUE.gamma * area
        exact.append(np.sum(delta[: t + 1] * (1 - (1 + x / TRUE.tau) ** -TRUE.power)))
    # 4 bins per doubling of the distance back: well under the 1e-3 of a drop that is 0.4 of the loss at most
    assert multipower_drop(run, TRUE.tau, TRUE.power, TRUE.gamma) == pytest.approx(exact, abs=5e-4)


def test_the_drop_gradient_the_fit_searches_with_is_the_drop_sums_derivative():
    """The fit's analytic gradient (`fit.sse_and_gradient`) rests on these derivatives: central differences agree."""
    run = _run("r", "cosine", num_steps=2000, every=100)
    terms = drop_terms(run, run.steps.astype(np.int64))
    q = np.array([np.log(TRUE.tau), np.log(TRUE.power), TRUE.gamma])

    def drop(q):
        return terms.drop(np.exp(q[0]), np.exp(q[1]), q[2])

    both = terms.drop_and_gradient(np.exp(q[0]), np.exp(q[1]), q[2])
    assert both[0] == pytest.approx(drop(q), rel=1e-12)
    for i in range(3):
        step = np.eye(3)[i] * 1e-6
        assert both[1 + i] == pytest.approx((drop(q + step) - drop(q - step)) / 2e-6, rel=1e-5, abs=1e-9)
    assert (np.abs(both[1:]).max(axis=1) > 1e-3).all()  # each parameter moves the drop here: the check means something


def test_the_multipower_fit_recovers_its_parameters_and_predicts_a_schedule_it_did_not_see():
    runs = [_run("constant", "constant"), _run("cosine", "cosine"), _run("wsd20", "wsd", decay_fraction=0.2),
            _run("wsd50", "wsd", decay_fraction=0.5)]
    law = fit_curve_law(runs, form="multipower")
    assert law.form == "multipower"
    for name in ("e", "b", "beta", "c", "tau", "power", "gamma"):  # noiseless curves: the law itself
        assert getattr(law, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    held = _run("wsd80", "wsd", decay_fraction=0.8)
    assert np.max(np.abs(curve_loss(law, held) - held.loss)) < 1e-5
