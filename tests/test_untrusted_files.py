"""Readers of files someone else wrote answer any damage with an error naming the file, never a traceback
(issue 29): a prediction and its sidecar (`moelab train --predicted`), a run's checkpoints (`load_run`).
The bundle, ledger and token store have theirs beside their own tests (test_bundle.py, test_store.py)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from mutations import fresh_copy, mutations
from test_ladder_checks import HEADER, _curve_rows, _four_rungs, _write_csv
from test_ladder_fit import _synthetic_run

from moelab.errors import ConfigError, DataError
from moelab.ladder.on_track import load_on_track
from moelab.ladder.predict import fit_curves

FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def prediction(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prediction")
    _write_csv(folder / "CURVES.csv", HEADER, _curve_rows(_four_rungs(np.random.default_rng(0))))
    planned = _synthetic_run("target", 3e8, 1600, "wsd", np.random.default_rng(0))
    _write_csv(folder / "TARGET.csv", HEADER[:5], [row[:5] for row in _curve_rows([planned])])
    fit_curves(folder / "CURVES.csv", folder / "TARGET.csv", folder / "PRED.csv", num_bootstrap=20)
    return folder


def test_a_damaged_prediction_or_sidecar_is_refused_by_name(prediction, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pred-fuzz")

    @settings(max_examples=40, **FUZZ)
    @given(mutation=mutations(["PRED.csv", "PRED.json"]))
    def run(mutation):
        copy = fresh_copy(prediction, tmp / "p")
        mutation.apply(copy)
        try:
            load_on_track(copy / "PRED.csv")
        except (DataError, ConfigError) as e:
            assert "PRED" in str(e), e

    run()


def test_a_watched_run_keeps_its_own_copy_of_the_prediction_under_the_contracts_name(prediction, tmp_path):
    """`contract.keep_copy`: PRED.csv and its sidecar land in the run as prediction.csv / .json, the one
    place the report and the site look (no reader guesses among paths); copying onto itself is a no-op."""
    from moelab.ladder import contract

    copy = contract.keep_copy(prediction / "PRED.csv", tmp_path / "run")
    assert copy == tmp_path / "run" / contract.PREDICTION
    assert copy.read_bytes() == (prediction / "PRED.csv").read_bytes()
    assert contract.read_sidecar(copy) == contract.read_sidecar(prediction / "PRED.csv") is not None
    assert contract.keep_copy(copy, tmp_path / "run") == copy and copy.read_bytes() == (prediction / "PRED.csv").read_bytes()
    band = contract.read_band(copy)
    assert list(band) == list(contract.BAND_SERIES) and len(band["step"]) == len(contract.load_prediction(copy))
    assert contract.self_check(copy) == contract.read_sidecar(copy)["self_check"]
    contract.sidecar_path(copy).write_text("[1, 2]")
    with pytest.raises(DataError, match="prediction.json"):
        contract.read_sidecar(copy)
    assert contract.self_check(copy) is None  # a page then says nothing about trust, rather than failing
