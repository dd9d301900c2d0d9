"""`moelab demo`: the whole open-lab loop on the embedded data (`lab.demo`), as `make demo` runs it.

    moelab demo                                      register, ladder rungs, fit, main run, report, site
    moelab demo --root runs/demo2 --spec experiments/demo.yaml
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli.common import err_console, out_console
from moelab.cli.lab import show_outcomes, verdict_sentence
from moelab.cli.train import training_progress
from moelab.errors import ConfigError
from moelab.lab.demo import open_demo, run_demo

__all__ = ["demo"]

DEMO_SPEC = Path("experiments/demo.yaml")


def demo(
    root: Annotated[Path, typer.Option(help="Where the demo's steps, ledger and report go.")] = Path("runs/demo"),
    spec: Annotated[Path, typer.Option(help="The pre-registered experiment to run.")] = DEMO_SPEC,
) -> None:
    """The whole open-lab loop on the embedded data: register, ladder rungs, fit, main run, report.

    Re-running reuses every finished step (seconds); the report states the hypothesis verdict.
    """
    if not spec.is_file():
        raise ConfigError(f"demo spec {spec} does not exist; run `make demo` from the repository root.")
    os.environ.setdefault("WANDB_SILENT", "true")  # the offline W&B run is written, not narrated
    ledger, exp_id, registered_now = open_demo(spec, root)
    if registered_now:
        err_console.print(f"Registered {exp_id} in {ledger.path} before running anything.")
    else:
        err_console.print(f"[dim]{exp_id} is already registered in {ledger.path}; reusing it.[/]")
    result = run_demo(ledger, exp_id, root, spec, progress=training_progress)
    err_console.print(f"Lab site: {result.site} (every experiment on {ledger.path}; reload it while a run goes)")
    show_outcomes(exp_id, result.outcomes)  # exit 1 (or 75) unless every step succeeded
    from moelab.ladder.contract import trust_text

    out_console.print(verdict_sentence(result.verdict, result.metric, result.value, "Hypothesis verdict"),
                      highlight=False)
    out_console.print(trust_text(result.trust, result.verdict), highlight=False)
    out_console.print(f"Report: {result.report}")
