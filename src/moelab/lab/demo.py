"""The demo: one pre-registered experiment run end to end, as `moelab demo` (and `make demo`) runs it.

    ledger, exp_id, registered_now = open_demo("experiments/demo.yaml", "runs/demo")
    result = run_demo(ledger, exp_id, "runs/demo", "experiments/demo.yaml", progress=training_progress)

The ledger is ROOT/ledger.sqlite; a spec whose id is already on it is reused, so a rerun reuses every
finished step. The report and the verdict come only once every step has succeeded. The lab's static site
(`lab.site`) is kept in ROOT/site as the demo runs: reload ROOT/site/index.html to watch it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moelab.errors import ConfigError
from moelab.lab.dag import SUCCESS, StepOutcome
from moelab.lab.experiment import Progress, run_experiment
from moelab.lab.ledger import Ledger, open_ledger
from moelab.lab.registry import load_experiment, read_spec_file, register

__all__ = ["DemoResult", "open_demo", "run_demo"]


@dataclass(frozen=True)
class DemoResult:
    outcomes: list[StepOutcome]
    site: Path  # the lab site's index.html, brought up to date as the steps ran
    report: Path | None = None  # report.html; None unless every step succeeded (so are the fields below)
    verdict: str | None = None  # the prediction's verdict: report.CONFIRMED, REFUTED or INCONCLUSIVE
    metric: str | None = None  # the predicted metric, e.g. eval/mean
    value: float | None = None  # its observed value
    trust: dict | None = None  # the ladder prediction behind it (`ladder.contract.trust`); None without one


def open_demo(spec_path: str | Path, root: str | Path) -> tuple[Ledger, str, bool]:
    """ROOT/ledger.sqlite with the spec's experiment on it: (ledger, id, whether it was registered just now)."""
    ledger = open_ledger(Path(root) / "ledger.sqlite", create=True)
    exp_id = read_spec_file(spec_path).get("id")
    try:
        load_experiment(ledger, exp_id)
        return ledger, exp_id, False
    except ConfigError:
        return ledger, register(ledger, spec_path).id, True


def run_demo(ledger: Ledger, exp_id: str, root: str | Path, spec_path: str | Path,
             progress: Progress | None = None) -> DemoResult:
    """Run the experiment's steps (local backend, each training step under `progress`); once all have
    succeeded, write its report (HTML + Markdown) and read the prediction's verdict."""
    from moelab.lab.report import write_report  # scipy (through `view`): only once there is a report
    from moelab.lab.site import INDEX, build_site
    from moelab.lab.view import experiment_verdict  # scipy (the ladder's prediction reader): not at `moelab` start-up

    site = Path(root) / "site"

    def rebuild() -> None:
        build_site(ledger, root, site, only=exp_id)

    rebuild()
    outcomes = run_experiment(ledger, exp_id, root, spec_path=spec_path, progress=progress, on_change=rebuild)
    if any(o.status != SUCCESS for o in outcomes):
        return DemoResult(outcomes, site / INDEX)
    report = write_report(ledger, exp_id)
    experiment = load_experiment(ledger, exp_id)
    verdict, value, trust = experiment_verdict(experiment)
    metric = experiment.spec.prediction.metric
    return DemoResult(outcomes, site / INDEX, report, verdict, metric, value, trust)
