"""What the report and the site state about one experiment, read once: the lab's data layer.

    view = experiment_view(experiment, streams, root)   # the site: status, verdict, runs from ledger records
    out, record = find_run_dir(experiment)              # the report: the main run's directory ...
    run = read_run(out, record)                         # ... and every file in it it states

Two renderers (`lab.report`, `lab.site`) and `lab verify` read an experiment; each file and each number
has one reader here or in the ladder's contract, so they cannot disagree: a run's prediction is the
copy it keeps as `contract.PREDICTION` (`find_prediction`), read by `contract.read_band`;
`locate_run_dir` the one lookup of a recorded run directory (moved with
ROOT or not), `series` the one metric series and `final_value` the one observed value.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from moelab.config import MoEConfig, from_dict, read_yaml
from moelab.errors import ConfigError, DataError
from moelab.lab.ledger import Record
from moelab.lab.registry import (FINISHED, TRAIN_STEP, Experiment, experiment_status, resolve_run_config,
                                 verdict)
from moelab.ladder import contract
from moelab.ladder.rungs import recipe_from_data
from moelab.train.outputs import (CONFIG, DATA, INCIDENTS, METRICS, MIXTURE_LOG, ROUTER_LOAD, SAMPLES, read_jsonl,
                                   read_summary)

__all__ = ["series", "final_value", "locate_run_dir", "find_run_dir", "find_prediction",
           "read_band", "read_moe_config", "when", "router_settings", "drops_by_phase", "RunFiles", "read_run", "experiment_verdict", "RunView", "ExperimentView", "experiment_view"]

def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that logged it as a number."""
    kept = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in kept], [v for _, v in kept]


def against_band(metrics: list[dict], band: dict | None, metric: str = "eval/mean") -> str | None:
    """How `metric`'s evals sat against the ladder's predicted 95% band, in one sentence for the pages that show the
    curve: how many fell outside it (from the first eval past the band's start) and from which step, and the mean
    offset from the predicted curve. None without a band or an eval inside its span."""
    if band is None:
        return None
    steps, values = series(metrics, metric)
    kept = [(s, v) for s, v in zip(steps, values) if band["step"][0] <= s <= band["step"][-1]]
    if not kept:
        return None
    at = np.array([s for s, _ in kept], float)
    observed = np.array([v for _, v in kept])
    lo, hi, pred = (np.interp(at, band["step"], band[k]) for k in ("lo95", "hi95", "loss_pred"))
    outside = (observed < lo) | (observed > hi)
    offset = float(np.mean(observed / pred - 1))
    where = (f"{int(outside.sum())} of {len(kept)} evals fell outside the ladder's 95% band, the first at step "
             f"{int(at[outside][0])}" if outside.any() else f"all {len(kept)} evals stayed inside the ladder's 95% band")
    return (f"{metric}: {where}; on average the observed values sat {abs(offset):.1%} "
            f"{'below' if offset < 0 else 'above'} the predicted curve.")


def final_value(metrics: list[dict], summary: dict, metric: str) -> tuple[float | None, int | None]:
    """The last logged value of `metric` and its step; summary.json's `eval` backs up `eval/<domain>`."""
    for row in reversed(metrics):
        if isinstance(row.get(metric), (int, float)):
            return float(row[metric]), row.get("step")
    if metric.startswith("eval/") and metric[5:] in summary.get("eval", {}):
        return float(summary["eval"][metric[5:]]), summary.get("step")
    return None, None


# ----------------------------------------------------------------------------------------------
# what the router did: its settings and the tokens it dropped, for the report and the site alike

DROP_KEYS = ("drop_fraction", "drop_fraction_at_sender", "drop_fraction_at_receiver")


def read_moe_config(out: Path) -> MoEConfig | None:
    """The run's `model.moe` as its config.yaml holds it, read as a config is (`config.read_yaml`, `from_dict`);
    None when the file is absent, unreadable or holds a section MoEConfig refuses (a page then says it has no
    settings to show). Only the section is built, from the keys this moelab knows: a run an older moelab wrote
    still shows its routing."""
    try:
        data = read_yaml(out / CONFIG, "config", "the run directory has no config")
        moe = ((data or {}).get("model") or {}).get("moe") if isinstance(data, dict) else None
        if not isinstance(moe, dict):
            return None
        known = {f.name for f in dataclasses.fields(MoEConfig)}  # a knob since removed still shows the rest
        return from_dict({k: v for k, v in moe.items() if k in known}, MoEConfig)
    except (ConfigError, OSError):
        return None


def router_settings(moe: MoEConfig) -> list[tuple[str, str, object]]:
    """(key, what, value) rows of the routing the run used: backend, capacity, waves, balancer and its knobs
    (`MoEConfig.balancer_settings`: only those its rule reads)."""
    rows = [("dispatch", "dispatch backend", moe.dispatch),
            ("experts", "routed experts, top-k", f"{moe.num_experts}, top-{moe.num_experts_per_token}"),
            ("capacity_factor", "capacity factor", moe.capacity_factor if moe.dispatch in ("capacity", "ep")
             else f"none ({moe.dispatch} drops nothing)")]
    if moe.dispatch == "ep":
        rows += [("transport_capacity_factor", "transport capacity factor (sender pools)",
                  moe.resolved_transport_capacity_factor),
                 ("num_waves", "all-to-all waves", moe.num_waves)]
    rows.append(("balancing", "balancing rule", moe.balancing))
    for knob, value in moe.balancer_settings.items():
        if knob == "balance_rate" and value is None:
            value = f"(E - 1) / E = {(moe.num_experts - 1) / moe.num_experts:.4g}"
        rows.append((knob, knob.replace("_", " "), value))
    return rows


def drops_by_phase(metrics: list[dict]) -> list[list]:
    """[phase, logged steps, mean dropped fraction, at the sender, at the receiver] per training phase, in the
    order the run entered them: the mean over the steps its metrics logged (under `ep` drops happen at two
    stages; elsewhere the last two are None)."""
    phases: dict[str, list[dict]] = {}
    for row in metrics:
        if isinstance(row.get("drop_fraction"), (int, float)):
            phases.setdefault(str(row.get("phase")), []).append(row)
    table = []
    for phase, rows in phases.items():
        means = [float(np.mean([r[k] for r in rows])) if all(isinstance(r.get(k), (int, float)) for r in rows) else None
                 for k in DROP_KEYS]
        table.append([phase, len(rows), *means])
    return table


DROP_COLUMNS = ["phase", "logged steps", "dropped fraction (mean)", "at the sender", "at the receiver"]
DROPS_WORTH_A_NOTE = 0.05  # a run that drops more of its assignments than this trained a visibly thinner MoE


def drop_table(metrics: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, rows) of `drops_by_phase` as the pages show it: the sender / receiver columns only where a run has
    them (an `ep` run; elsewhere every cell would be "-")."""
    rows = drops_by_phase(metrics)
    if any(v is not None for row in rows for v in row[3:]):
        return DROP_COLUMNS, rows
    return DROP_COLUMNS[:3], [row[:3] for row in rows]


def drops_note(rows: list[list]) -> str | None:
    """A sentence when a run's training dropped more than DROPS_WORTH_A_NOTE of its token-expert assignments in a
    phase (`rows`: `drop_table`'s); a ladder's small rungs often do: capacity is per expert, and few tokens a batch
    fill it unevenly."""
    worst = max((row[2] for row in rows), default=0.0)
    if worst <= DROPS_WORTH_A_NOTE:
        return None
    return (f"This run dropped {worst:.1%} of its token-expert assignments in training (a phase's mean; over "
            f"{DROPS_WORTH_A_NOTE:.0%} is worth a look): its loss is that of a MoE that skipped that share of its "
            "experts' work, and a ladder fitted on it carries that into the prediction. A higher "
            "model.moe.capacity_factor, or the dropless dispatch, trains without it.")


# ----------------------------------------------------------------------------------------------
# the run directory


def locate_run_dir(body: dict, root: Path | None = None, exp_id: str | None = None) -> Path | None:
    """A run event's output directory: as recorded or, moved with ROOT, at ROOT/<id>/<its name>; None if neither."""
    recorded = body.get("output_dir")
    if not recorded:
        return None
    candidates = [Path(recorded)] + ([root / exp_id / Path(recorded).name] if root is not None and exp_id else [])
    return next((path for path in candidates if path.is_dir()), None)


def find_run_dir(experiment: Experiment) -> tuple[Path, dict]:
    """The training step's output directory of the newest finished run, and that ledger record's body."""
    finished = [r for r in experiment.runs if r.body.get("step") == TRAIN_STEP
                and r.body.get("event") in ("finished", "skipped") and r.body.get("output_dir")]
    if not finished:
        train_events = [r.body for r in experiment.runs if r.body.get("step") == TRAIN_STEP]
        if train_events and train_events[-1].get("event") == "preempted":
            raise ConfigError(f"experiment {experiment.id!r} has no finished run: its training step was preempted at "
                              f"step {train_events[-1].get('preempted_at')} with a checkpoint saved; resume it with "
                              f"`moelab lab run {experiment.id}`.")
        events = ", ".join(sorted({str(r.body.get("event")) for r in experiment.runs})) or "none"
        raise ConfigError(f"experiment {experiment.id!r} has no finished run (run events on the ledger: {events}); "
                          f"run it first with `moelab lab run {experiment.id}`.")
    body = finished[-1].body
    out = Path(body["output_dir"])
    if not (out / METRICS).is_file():
        raise ConfigError(f"experiment {experiment.id!r} ran into {out}, but {out / METRICS} is missing; "
                          "was the directory moved or deleted? Re-run with `moelab lab run`.")
    return out, body


def find_prediction(out: Path) -> Path | None:
    """The prediction a run was watched against: the copy it keeps in its directory (`contract.keep_copy`)."""
    path = out / contract.PREDICTION
    return path if path.is_file() else None


def read_band(path: Path) -> tuple[dict[str, list[float]] | None, str | None]:
    """(`contract.read_band`, None), or (None, why not): a file that cannot be read is stated, so a page says
    why it has no band instead of showing none as if there were no prediction."""
    try:
        return contract.read_band(path), None
    except (DataError, OSError, UnicodeDecodeError) as e:
        return None, f"{path.name} cannot be read as a prediction: {e}"


@dataclass
class RunFiles:
    """The main run's directory as the training loop wrote it: what the report states and `lab verify` recomputes."""

    out: Path
    record: dict  # the body of its finished run's ledger record
    metrics: list[dict]
    summary: dict
    prediction: Path | None  # the prediction.csv it was watched against
    band: dict[str, list[float]] | None  # that file's `contract.BAND_SERIES`
    band_problem: str | None  # why there is a prediction but no band
    mixture: list[dict]  # mixture_log.jsonl
    data: dict | None  # data.json: the token stores it read
    router_step: int | None
    router_load: np.ndarray | None  # [layers, experts], the newest logged
    incidents: list[dict]  # incidents.jsonl, plus any the metrics records carry
    samples: list[dict]
    moe: MoEConfig | None = None  # config.yaml's model.moe (`read_moe_config`)

    def final_value(self, metric: str) -> tuple[float | None, int | None]:
        return final_value(self.metrics, self.summary, metric)


def _router_load(out: Path) -> tuple[int | None, np.ndarray | None]:
    rows = read_jsonl(out / ROUTER_LOAD)
    if rows:
        return rows[-1].get("step"), np.asarray(rows[-1]["load"], dtype=np.float64)
    if (out / "router_load.npy").is_file():
        return None, np.load(out / "router_load.npy")
    return None, None


def _incidents(out: Path, metrics: list[dict]) -> list[dict]:
    incidents = read_jsonl(out / INCIDENTS)
    seen = {json.dumps(i, sort_keys=True) for i in incidents}
    for row in metrics:  # incidents carried inside metrics records, if the loop logs them there
        for i in row.get("incidents", []) if isinstance(row.get("incidents"), list) else []:
            if json.dumps(i, sort_keys=True) not in seen:
                incidents.append(i)
                seen.add(json.dumps(i, sort_keys=True))
    return sorted(incidents, key=lambda i: i.get("step") or 0)


def read_run(out: Path, record: dict) -> RunFiles:
    """Every file of the run directory `out` that the report states; `record` is its ledger record's body
    (`{}` reads nothing outside `out` and its parent: what `lab verify` passes for a bundle)."""
    metrics = read_jsonl(out / METRICS)
    summary = read_summary(out)
    prediction = find_prediction(out)
    band, problem = read_band(prediction) if prediction is not None else (None, None)
    data = json.loads((out / DATA).read_text()) if (out / DATA).is_file() else None
    step, load = _router_load(out)
    return RunFiles(out, record, metrics, summary, prediction, band, problem, read_jsonl(out / MIXTURE_LOG), data,
                    step, load, _incidents(out, metrics), read_jsonl(out / SAMPLES), read_moe_config(out))


def when(created_at: str) -> str:
    """A ledger timestamp (ISO 8601, UTC, microseconds) as a page shows it: '2026-12-06 08:12:34 UTC'."""
    return f"{created_at[:10]} {created_at[11:19]} UTC" if len(created_at) >= 19 and created_at[10] == "T" else created_at


def experiment_verdict(experiment: Experiment) -> tuple[str, float | None, dict | None]:
    """(verdict, observed value, the ladder prediction's trust or None) of a run experiment: what the report's
    first section states (`contract.trust`: the predicted value, its band and the self-check's verdict)."""
    out, _ = find_run_dir(experiment)
    value, _ = final_value(read_jsonl(out / METRICS), read_summary(out), experiment.spec.prediction.metric)
    prediction = find_prediction(out)
    return verdict(experiment.spec.prediction, value), value, contract.trust(prediction) if prediction else None


# ----------------------------------------------------------------------------------------------
# the experiment as its ledger records hold it


@dataclass
class RunView:
    """One training run of an experiment, as its metric, incident and mixture records on the ledger hold it."""

    name: str
    metrics: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    mixture: list[dict] = field(default_factory=list)
    band: dict[str, list[float]] | None = None  # `contract.read_band`, for the run a fit predicted
    band_problem: str | None = None  # why a prediction.csv it was watched against gives no band
    moe: MoEConfig | None = None  # the main run's config.yaml model.moe (`read_moe_config`), when its directory is found


@dataclass
class ExperimentView:
    experiment: Experiment
    status: str
    verdict: str | None  # confirmed / refuted / inconclusive once the main run finished; None before
    observed: float | None
    trust: dict | None  # the ladder prediction behind the main run (`contract.trust`); None without one
    runs: list[RunView]
    steps: dict[str, list[Record]]  # step -> its run events, in order
    head: Record  # the newest record of this experiment: what its page reflects
    last_event: Record  # the newest registration, amendment or run event: what the index shows
    main: str | None  # the main run's name (its metric records' `run`)


def _main_run_name(experiment: Experiment) -> str | None:
    """The run name the main ("train") step trains under (`lab.experiment.experiment_steps`): what its metric
    records carry as `run`. A ladder's main run is its recipe's target."""
    try:
        spec = experiment.spec
        if spec.ladder is not None:
            return recipe_from_data(spec.ladder, f"experiment {experiment.id}: ladder").target.name
        return resolve_run_config(spec).name
    except ConfigError:
        return None


def experiment_view(experiment: Experiment, streams: Iterable[Record], root: Path) -> ExperimentView:
    """Everything an experiment's page and index row state, from its records (`streams`: its metric, incident
    and mixture records) and, for the predicted band, the main run's directory under `root`."""
    runs: dict[str, RunView] = {}
    head = max([experiment.registration, *experiment.amendments, *experiment.runs], key=lambda r: r.seq)
    last_event = head
    for record in streams:
        head = record if record.seq > head.seq else head
        run = runs.setdefault(str(record.body.get("run")), RunView(str(record.body.get("run"))))
        {"metric": run.metrics, "incident": run.incidents, "mixture": run.mixture}[record.kind].append(record.body)
    steps: dict[str, list[Record]] = {}
    for record in experiment.runs:
        steps.setdefault(str(record.body.get("step", record.body.get("event"))), []).append(record)
    status, main = experiment_status(experiment), _main_run_name(experiment)
    found, observed, trust = None, None, None
    if main in runs:
        values = series(runs[main].metrics, experiment.spec.prediction.metric)[1]
        observed = values[-1] if values else None
        body = steps[TRAIN_STEP][-1].body if steps.get(TRAIN_STEP) else {}  # the newest training event's run
        where = locate_run_dir(body, root, experiment.id)
        prediction = find_prediction(where) if where is not None else None
        if prediction is not None:
            runs[main].band, runs[main].band_problem = read_band(prediction)
            trust = contract.trust(prediction)
        runs[main].moe = read_moe_config(where) if where is not None else None
    if status == FINISHED:
        found = verdict(experiment.spec.prediction, observed)
    ordered = sorted(runs.values(), key=lambda r: (r.name != main, r.name))  # the main run first: what a reader seeks
    return ExperimentView(experiment, status, found, observed, trust, ordered, steps, head, last_event, main)
