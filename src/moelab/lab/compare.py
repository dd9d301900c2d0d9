"""What two registered experiments differ in: the reviewer's first question.

    diff = compare_experiments(ledger, "demo-tiny", "demo-tiny-lr")
    diff.spec      # {"hypothesis": (a, b), "prediction.band": ([...], [...]), ...}
    diff.config    # the resolved run configs' (or ladder recipes') differing leaves
    diff.outcome   # verdict, observed value, each step's last event, the runs' commits

Configs are compared *resolved* (a preset plus overrides becomes the full RunConfig), so two specs
that spell the same run differently show no config difference, and a changed preset default shows
up where it bites. Outcomes come from the ledger and the training step's metrics, read as the report
reads them (`lab.view.experiment_verdict`); an experiment that has not run yet says so instead of failing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moelab.config import changed_fields, to_dict
from moelab.errors import ConfigError
from moelab.lab.ledger import Ledger
from moelab.lab.registry import REPRODUCTION, Experiment, load_experiment, resolve_run_config
from moelab.lab.view import experiment_verdict

__all__ = ["ExperimentDiff", "compare_experiments", "resolved_recipe", "outcome", "to_markdown", "to_json"]

_RECIPE_FIELDS = ("config", "ladder")  # compared resolved, in `config`; the rest of the spec in `spec`
_NOT_RUN = "not run"


@dataclass(frozen=True)
class ExperimentDiff:
    """The differing leaves of two experiments, each {dotted.field: (value in a, value in b)}."""

    a: str
    b: str
    spec: dict[str, tuple[Any, Any]]
    config: dict[str, tuple[Any, Any]]
    outcome: dict[str, tuple[Any, Any]]

    @property
    def identical(self) -> bool:
        return not (self.spec or self.config or self.outcome)

    def sections(self) -> list[tuple[str, dict[str, tuple[Any, Any]]]]:
        return [("spec", self.spec), ("config", self.config), ("outcome", self.outcome)]


def resolved_recipe(experiment: Experiment) -> dict:
    """{"config": the full RunConfig} for a training spec, {"ladder": the recipe} for a ladder spec."""
    spec = experiment.spec
    if spec.config is not None:
        return {"config": to_dict(resolve_run_config(spec))}
    return {"ladder": spec.ladder}


def outcome(ledger: Ledger, experiment: Experiment) -> dict[str, Any]:
    """Verdict and observed value of the prediction, each step's last event, and the commits it ran at."""
    runs = [r for r in experiment.runs if r.body.get("event") != REPRODUCTION]  # a rerun is no step of the run
    last_event = {str(r.body.get("step")): r.body.get("event") for r in runs}
    commits = sorted({str(r.body.get("git_commit"))[:12] for r in runs if r.body.get("git_commit")})
    try:
        result, value, trust = experiment_verdict(experiment)
    except ConfigError:  # no finished run (yet), or its directory is gone
        result, value, trust = _NOT_RUN, None, None
    return {"verdict": result, experiment.spec.prediction.metric: value,
            "self_check": trust["self_check"] if trust else None, "amendments": len(experiment.amendments),
            "steps": last_event or _NOT_RUN, "git_commits": commits or None}


def compare_experiments(ledger: Ledger, a: str, b: str) -> ExperimentDiff:
    """The spec, resolved-config and outcome differences of experiments `a` and `b` on one ledger.

    Raises ConfigError naming the id when either is not registered (`load_experiment`).
    """
    ea, eb = load_experiment(ledger, a), load_experiment(ledger, b)
    plain = [{k: v for k, v in e.spec_data.items() if k not in _RECIPE_FIELDS and k != "id"} for e in (ea, eb)]
    return ExperimentDiff(a, b, spec=changed_fields(*plain),
                          config=changed_fields(resolved_recipe(ea), resolved_recipe(eb)),
                          outcome=changed_fields(outcome(ledger, ea), outcome(ledger, eb)))


def _md_value(value: Any) -> str:
    text = "—" if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return " ".join(text.split()).replace("|", "\\|")


def to_markdown(diff: ExperimentDiff) -> str:
    """One table per part that differs; a sentence when nothing does."""
    lines = [f"## {diff.a} vs {diff.b}", ""]
    if diff.identical:
        return "\n".join(lines + ["Same spec, same resolved config, same outcome."]) + "\n"
    for name, fields in diff.sections():
        if not fields:
            lines += [f"**{name}**: no difference.", ""]
            continue
        lines += [f"### {name}", "", f"| field | {diff.a} | {diff.b} |", "|---|---|---|"]
        lines += [f"| `{k}` | {_md_value(va)} | {_md_value(vb)} |" for k, (va, vb) in fields.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def to_json(diff: ExperimentDiff) -> dict:
    return {"a": diff.a, "b": diff.b, "identical": diff.identical,
            **{name: {k: list(v) for k, v in fields.items()} for name, fields in diff.sections()}}
