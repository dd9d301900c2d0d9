"""Pre-registration: experiment specs, their registration and amendments, and issue-ready Markdown.

    moelab lab register experiments/demo-spec.yaml --markdown
    moelab lab amend demo-tiny experiments/demo-spec.yaml --reason "300 steps is too few; run 600"
    moelab lab show demo-tiny

A spec (YAML) says what is asked and what is expected *before* any code runs:

    id: demo-tiny                   # letters, digits, . _ - ; names the experiment everywhere
    title: ...
    question: ...
    hypothesis: ...
    prediction:
      metric: eval/mean             # a metric name the run logs
      expected: 2.3                 # a point prediction, and / or
      band: [null, 2.5]             # [low, high]; null leaves that side open
      decision_rule: ...            # how the result confirms or refutes the hypothesis
    owner: ...
    config: {preset: tiny, overrides: {train.steps: 300}}   # or a full RunConfig mapping
    # ladder: {...}                 # instead of config: a ladder recipe (issue 8)
    resources: {num_gpus: 1}        # optional: what a Ray worker must hold to run the training step

Registration stores the spec, its content hash, the project's git commit and a timestamp in the
ledger. The hash is of the spec's *content* (canonical JSON of the parsed YAML), so comments and
formatting are free to change but any value is not: a registered spec is immutable, and running it
after an edit is refused until `amend` records the diff and a reason.

The verdict a finished run gives its prediction (`verdict`) and the band's printed form (`band_text`)
live here, beside `Prediction`: the report and the site share one of each, and `compare` and `reproduce`
read outcomes without importing the report (and, through `view`, the ladder's scipy).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moelab import presets
from moelab.config import RunConfig, changed_fields, read_yaml
from moelab.errors import ConfigError
from moelab.lab.ledger import DuplicateRecord, Ledger, Record, append, canonical_json, records

TRAIN_STEP = "train"  # the step that trains an experiment's main run (`lab.experiment.experiment_steps`)
REGISTERED, RUNNING, FINISHED, FAILED, ABANDONED = "registered", "running", "finished", "failed", "abandoned"
CONFIRMED, REFUTED, INCONCLUSIVE = "confirmed", "refuted", "inconclusive"  # a finished experiment's verdict
REPRODUCTION = "reproduction"  # the run event `moelab lab reproduce` records

__all__ = ["Prediction", "Spec", "Experiment", "read_spec_file", "parse_spec", "spec_hash", "resolve_run_config",
           "register", "amend", "abandon", "experiment_status", "load_experiment", "experiment_ids", "check_unchanged",
           "git_state", "to_markdown", "verdict", "band_text", "TRAIN_STEP", "REGISTERED", "RUNNING", "FINISHED", "FAILED",
           "ABANDONED", "CONFIRMED", "REFUTED", "INCONCLUSIVE", "REPRODUCTION"]

REQUIRED = ("id", "title", "question", "hypothesis", "prediction", "owner")
OPTIONAL = ("config", "ladder", "resources")
PREDICTION_KEYS = ("metric", "expected", "band", "decision_rule")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SPEC_HELP = ("A spec needs id, title, question, hypothesis, prediction (metric, expected and / or band, "
              "decision_rule), owner, and one of config or ladder; see experiments/demo-spec.yaml.")


@dataclass(frozen=True)
class Prediction:
    """What the experiment expects of one metric, and the rule that decides the outcome."""

    metric: str
    decision_rule: str
    expected: float | None = None  # a point prediction
    band: tuple[float | None, float | None] | None = None  # [low, high]; None on a side leaves it open


@dataclass(frozen=True)
class Spec:
    id: str
    title: str
    question: str
    hypothesis: str
    prediction: Prediction
    owner: str
    config: dict | None = None  # a RunConfig mapping, or {preset: NAME, overrides: {dotted.field: value}}
    ladder: dict | None = None  # a ladder recipe: rungs -> fit -> main run (issue 8)
    resources: dict | None = None  # Ray resources for the training step, e.g. {num_gpus: 1}; None: one CPU


@dataclass(frozen=True)
class Experiment:
    """An experiment as the ledger holds it: its registration, amendments and run records, in order."""

    id: str
    registration: Record
    amendments: tuple[Record, ...] = ()
    runs: tuple[Record, ...] = ()

    @property
    def current(self) -> Record:
        """The record holding the spec in force: the newest amendment, else the registration."""
        return self.amendments[-1] if self.amendments else self.registration

    @property
    def spec_data(self) -> dict:
        return self.current.body["spec"]

    @property
    def spec_hash(self) -> str:
        return self.current.body["spec_hash"]

    @property
    def spec(self) -> Spec:
        return parse_spec(self.spec_data, f"the ledger's copy of {self.id}")

    @property
    def source(self) -> str:
        """The spec file the experiment was last registered or amended from."""
        return self.current.body["source"]


# ----------------------------------------------------------------------------------------------
# specs


def read_spec_file(path: str | Path) -> dict:
    """The YAML mapping in `path`; ConfigError naming the file when it is missing or not YAML."""
    data = read_yaml(path, "spec", "pass the path of an experiment spec YAML (e.g. experiments/demo-spec.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(f"spec file {path} must hold a YAML mapping, got {type(data).__name__}. {_SPEC_HELP}")
    return data


def spec_hash(data: dict) -> str:
    """SHA-256 of the spec's canonical JSON: the identity of a spec version."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


def _number(value: Any) -> bool:
    """A finite int or float: YAML's .inf and .nan, and 1e999 (inf once read), are no prediction or amount."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_prediction(data: Any, where: str) -> Prediction:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: prediction must be a mapping with metric, expected and / or band, and "
                          f"decision_rule; got {data!r}.")
    unknown = sorted(set(data) - set(PREDICTION_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key prediction.{unknown[0]}; the keys allowed are: "
                          f"{', '.join(PREDICTION_KEYS)}.")
    for key in ("metric", "decision_rule"):
        if not isinstance(data[key], str):
            raise ConfigError(f"{where}: prediction.{key}={data[key]!r} must be text.")
    expected, band = data.get("expected"), data.get("band")
    if expected is not None and not _number(expected):
        raise ConfigError(f"{where}: prediction.expected={expected!r} must be a finite number, e.g. expected: 2.3.")
    if band is not None:
        ok = (isinstance(band, list) and len(band) == 2 and all(b is None or _number(b) for b in band)
              and band != [None, None] and (None in band or band[0] < band[1]))
        if not ok:
            raise ConfigError(f"{where}: prediction.band={band!r} must be [low, high], finite numbers with low < "
                              "high; null (not .inf) leaves a side open, e.g. band: [null, 2.5] for 'below 2.5'.")
        band = tuple(band)
    if expected is None and band is None:
        raise ConfigError(f"{where} is missing required field(s) prediction.expected or prediction.band. "
                          f"{_SPEC_HELP}")
    return Prediction(metric=data["metric"], decision_rule=data["decision_rule"], expected=expected, band=band)


def parse_spec(data: dict, where: str) -> Spec:
    """Check a spec mapping and build the Spec; ConfigError names the field, the value and the fix.

    `where` (the file, usually) starts every message. The training config is resolved here too, so
    a spec that cannot run is refused at registration, not hours later.
    """
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]}; a spec's keys are: "
                          f"{', '.join(REQUIRED + OPTIONAL)}.")
    missing = [k for k in REQUIRED if data.get(k) in (None, "")]
    if isinstance(data.get("prediction"), dict):
        missing += [f"prediction.{k}" for k in ("metric", "decision_rule") if data["prediction"].get(k) in (None, "")]
    if data.get("config") is None and data.get("ladder") is None:
        missing.append("config (or ladder)")
    if missing:
        raise ConfigError(f"{where} is missing required field(s) {', '.join(missing)}. {_SPEC_HELP}")
    for key in ("id", "title", "question", "hypothesis", "owner"):
        if not isinstance(data[key], str):
            raise ConfigError(f"{where}: {key}={data[key]!r} must be text.")
    if not _ID.fullmatch(data["id"]):
        raise ConfigError(f"{where}: id={data['id']!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit (it names directories), e.g. id: demo-tiny.")
    if data.get("config") is not None and data.get("ladder") is not None:
        raise ConfigError(f"{where}: give one of config or ladder, not both: a spec is one training run or "
                          "one ladder.")
    for key in ("config", "ladder", "resources"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ConfigError(f"{where}: {key} must be a mapping, got {data[key]!r}.")
    resources = data.get("resources")
    if resources is not None and not all(isinstance(k, str) and _number(v) and v >= 0 for k, v in resources.items()):
        raise ConfigError(f"{where}: resources={resources!r} must map resource names to finite amounts >= 0, "
                          "e.g. resources: {num_gpus: 1}.")
    spec = Spec(id=data["id"], title=data["title"], question=data["question"], hypothesis=data["hypothesis"],
                prediction=_parse_prediction(data["prediction"], where), owner=data["owner"],
                config=data.get("config"), ladder=data.get("ladder"), resources=resources)
    if spec.config is not None:
        try:
            resolve_run_config(spec)
        except ConfigError as e:
            raise ConfigError(f"{where}: config: {e}") from None
    if spec.ladder is not None:
        from moelab.ladder.rungs import check_monotone, recipe_from_data, rungs_of

        check_monotone(rungs_of(recipe_from_data(spec.ladder, f"{where}: ladder")))
    return spec


def resolve_run_config(spec: Spec) -> RunConfig:
    """The RunConfig of a `config:` spec: `preset` plus `overrides`, or a RunConfig mapping."""
    if spec.config is None:
        raise ConfigError(f"experiment {spec.id} has no config: it is a ladder spec.")
    return presets.resolve(spec.config)


def _spec_diff(old: dict, new: dict, old_source: str, new_source: str) -> str:
    """A unified diff from the version in force (`a/` + the file it was registered or last amended from) to
    the new one (`b/` + its file), labelled as git labels a diff (a leading / dropped)."""
    # Sorted keys on both sides: the ledger's copy is canonical JSON, so the author's order is gone.
    dump = lambda d: yaml.safe_dump(d, sort_keys=True, allow_unicode=True).splitlines(keepends=True)  # noqa: E731
    label = lambda prefix, source: prefix + Path(source).as_posix().lstrip("/")  # noqa: E731
    return "".join(difflib.unified_diff(dump(old), dump(new), label("a/", old_source), label("b/", new_source)))


# ----------------------------------------------------------------------------------------------
# the record


def git_state(where: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, uncommitted changes?) of the repository holding `where`; (None, None) outside git."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def experiment_ids(ledger: Ledger) -> list[str]:
    return [r.key for r in records(ledger, kind="experiment")]


def load_experiment(ledger: Ledger, exp_id: str) -> Experiment:
    """The experiment `exp_id` with its amendments and runs; ConfigError listing the known ids if unknown."""
    registration = records(ledger, kind="experiment", key=exp_id)
    if not registration:
        known = experiment_ids(ledger)
        listed = f"the registered ones are: {', '.join(known)}" if known else "none is registered yet"
        raise ConfigError(f"unknown experiment id {exp_id!r} in {ledger.path}; {listed}. Register a spec with "
                          "`moelab lab register SPEC.yaml`.")
    return Experiment(exp_id, registration[0], tuple(records(ledger, kind="amendment", key=exp_id)),
                      tuple(records(ledger, kind="run", key=exp_id)))


_PACKAGE_DIR = Path(__file__).resolve().parent  # moelab's source: in a checkout, the code that runs the spec


def _provenance(spec_path: Path, data: dict) -> dict:
    # The repository holding the spec; for a spec kept outside one (a copy edited in /tmp, say), the checkout
    # moelab runs from, which used to be recorded as no commit at all.
    commit, dirty = git_state(spec_path.resolve().parent)
    if commit is None:
        commit, dirty = git_state(_PACKAGE_DIR)
    return {"spec": data, "spec_hash": spec_hash(data), "source": str(spec_path), "git_commit": commit,
            "git_dirty": dirty}


def _decidable(prediction: Prediction, where: str) -> None:
    """Refuse a prediction that contradicts itself: an expected value outside its own band would be refuted by
    the very value it expects. Checked when a spec is recorded (register, amend), not when one is read back."""
    if prediction.expected is None or prediction.band is None:
        return
    low, high = prediction.band
    if (low is not None and prediction.expected < low) or (high is not None and prediction.expected > high):
        raise ConfigError(f"{where}: prediction.expected={prediction.expected} lies outside prediction.band="
                          f"{list(prediction.band)}, so the expected outcome would refute the hypothesis. Move one "
                          "of them (the band is what decides; expected is the point you predict inside it).")


def register(ledger: Ledger, spec_path: str | Path) -> Experiment:
    """Record a new spec; ConfigError if it is invalid or its id is already registered."""
    spec_path = Path(spec_path)
    data = read_spec_file(spec_path)
    spec = parse_spec(data, f"spec {spec_path}")
    _decidable(spec.prediction, f"spec {spec_path}")
    try:
        existing = load_experiment(ledger, spec.id)
    except ConfigError:
        existing = None
    duplicate = (f"experiment id {spec.id!r} is already registered in {ledger.path}; a registered spec cannot "
                 f"be replaced. Record a change with `moelab lab amend {spec.id} {spec_path} --reason \"...\"`, "
                 "or give the new experiment another id.")
    if existing is not None:
        raise ConfigError(duplicate.replace("registered in", f"registered (record {existing.registration.seq}, "
                                                             f"{existing.registration.created_at}) in"))
    try:
        append(ledger, "experiment", spec.id, _provenance(spec_path, data))
    except DuplicateRecord:  # registered by a concurrent process between the check and the append
        raise ConfigError(duplicate) from None
    return load_experiment(ledger, spec.id)


def amend(ledger: Ledger, exp_id: str, spec_path: str | Path, reason: str) -> Experiment:
    """Record a new version of a registered spec, with the diff and the reason."""
    reason = (reason or "").strip()
    if not reason:
        raise ConfigError("--reason is empty: an amendment must say why the spec changed, e.g. "
                          "--reason \"the baseline ended at 2.41 nats, so the band moves down\".")
    experiment = load_experiment(ledger, exp_id)
    spec_path = Path(spec_path)
    data = read_spec_file(spec_path)
    spec = parse_spec(data, f"spec {spec_path}")
    _decidable(spec.prediction, f"spec {spec_path}")
    if spec.id != exp_id:
        raise ConfigError(f"spec {spec_path} has id={spec.id!r}, but you are amending {exp_id!r}; an amendment "
                          f"cannot rename an experiment. Set id: {exp_id} in the file, or register it as a new one.")
    body = _provenance(spec_path, data)
    if body["spec_hash"] == experiment.spec_hash:
        raise ConfigError(f"spec {spec_path} matches the version of {exp_id!r} in force "
                          f"(sha256 {experiment.spec_hash[:12]}...); there is nothing to amend.")
    body.update(previous_hash=experiment.spec_hash, reason=reason,
                changes=changed_fields(experiment.spec_data, data),
                diff=_spec_diff(experiment.spec_data, data, experiment.source, str(spec_path)))
    append(ledger, "amendment", exp_id, body)
    return load_experiment(ledger, exp_id)


def verdict(prediction: Prediction, value: float | None) -> str:
    """The outcome of `prediction` given the run's final `value` of its metric.

    With a band: confirmed when low <= value <= high (an open side always holds), refuted otherwise.
    A point prediction alone (`expected`, no band) names no tolerance, so it cannot decide: inconclusive.
    A missing or non-finite value is inconclusive too.

    >>> verdict(Prediction("eval/mean", "below 2.5", band=(None, 2.5)), 2.1)
    'confirmed'
    """
    if value is None or not math.isfinite(value) or prediction.band is None:
        return INCONCLUSIVE
    low, high = prediction.band
    inside = (low is None or value >= low) and (high is None or value <= high)
    return CONFIRMED if inside else REFUTED


def band_text(band: tuple | None) -> str:
    """A prediction's pre-registered threshold (the spec's `prediction.band`, [low, high] with null for no bound) as
    the report and the site print it, in words rather than a notation the spec does not use: "at most 2.5", "at
    least 1", "1 to 2.5", "none". Pages call it the threshold, so it is never confused with the ladder's 95% band
    around a predicted curve."""
    if band is None:
        return "none"
    low, high = band
    if low is None and high is None:
        return "any value"
    if low is None:
        return f"at most {high:g}"
    return f"at least {low:g}" if high is None else f"{low:g} to {high:g}"


def experiment_status(experiment: Experiment) -> str:
    """registered (nothing ran), running, finished (the main run did), failed (a step did, not retried since)
    or abandoned (`moelab lab abandon`), from the experiment's run events."""
    events = [r.body for r in experiment.runs if r.body.get("event") != REPRODUCTION]
    if not events:
        return REGISTERED
    if events[-1].get("event") == ABANDONED:
        return ABANDONED
    last = {}
    for body in events:
        last[body.get("step")] = body.get("event")
    if FAILED in last.values():
        return FAILED
    if last.get(TRAIN_STEP) in ("finished", "skipped"):
        return FINISHED
    return RUNNING


def abandon(ledger: Ledger, exp_id: str, reason: str) -> Record:
    """Record that an experiment is abandoned, and why: it stays on the record (report, site) as abandoned, not
    deleted. A later `moelab lab run` takes it up again (its events then follow this one). Refused for one that
    finished (its outcome is the record; abandoning it would hide the verdict) or is abandoned already."""
    reason = (reason or "").strip()
    if not reason:
        raise ConfigError("--reason is empty: say why the experiment stops, e.g. --reason \"the cluster was lost "
                          "at step 1200 and the budget moved to the replanned run\".")
    experiment = load_experiment(ledger, exp_id)  # an unknown id: ConfigError listing the known ones
    status = experiment_status(experiment)
    if status == FINISHED:
        raise ConfigError(f"{exp_id!r} has finished: its main run ended and its outcome is on the record, which "
                          "abandoning would hide. To follow it up, register a new experiment (its spec can say "
                          "which one it supersedes).")
    if status == ABANDONED:
        since = next(r for r in reversed(experiment.runs) if r.body.get("event") == ABANDONED)
        raise ConfigError(f"{exp_id!r} is abandoned already (record {since.seq}: {since.body.get('reason')}); "
                          f"`moelab lab run {exp_id}` takes it up again.")
    return append(ledger, "run", exp_id, {"event": ABANDONED, "reason": reason})


def check_unchanged(experiment: Experiment, spec_path: str | Path) -> None:
    """Refuse (ConfigError) when the spec file differs from the version in force: amend it first."""
    spec_path = Path(spec_path)
    data = read_spec_file(spec_path)
    if spec_hash(data) == experiment.spec_hash:
        return
    changed = ", ".join(changed_fields(experiment.spec_data, data)) or "formatting only"
    raise ConfigError(
        f"spec {spec_path} was edited after {experiment.id!r} was registered (changed: {changed}); a registered "
        f"spec is immutable. Record the change first: `moelab lab amend {experiment.id} {spec_path} --reason "
        "\"...\"`, or restore the file."
    )


# ----------------------------------------------------------------------------------------------
# Markdown


def _band(band: tuple | list | None) -> str:
    if band is None:
        return "—"
    low, high = band
    if low is None:
        return f"< {high:g}"
    if high is None:
        return f"> {low:g}"
    return f"[{low:g}, {high:g}]"


def _recipe(spec_data: dict) -> str:
    recipe = {k: spec_data[k] for k in ("config", "ladder", "resources") if spec_data.get(k) is not None}
    return yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True).rstrip()


def _commit(body: dict) -> str:
    commit = body.get("git_commit")
    if commit is None:
        return "none (not in a git repository)"
    return f"`{commit[:12]}`" + (" (with uncommitted changes)" if body.get("git_dirty") else "")


def to_markdown(experiment: Experiment, with_runs: bool = False) -> str:
    """Issue-ready Markdown: the spec in force, its provenance, every amendment (and the runs)."""
    spec, reg = experiment.spec, experiment.registration
    p = spec.prediction
    expected = "—" if p.expected is None else f"{p.expected:g}"
    lines = [
        f"## [{spec.id}] {spec.title}",
        "",
        f"**Owner:** {spec.owner} · **Registered:** {reg.created_at} · **Amendments:** {len(experiment.amendments)}",
        "",
        "### Question", "", spec.question.strip(), "",
        "### Hypothesis", "", spec.hypothesis.strip(), "",
        "### Prediction", "",
        "| metric | expected | threshold (pre-registered) | decision rule |",
        "|---|---|---|---|",
        f"| `{p.metric}` | {expected} | {_band(p.band)} | {' '.join(p.decision_rule.split())} |",
        "",
        "### Recipe", "", "```yaml", _recipe(experiment.spec_data), "```", "",
        "### Provenance", "",
        f"- spec sha256: `{experiment.spec_hash}`",
        f"- git commit at registration: {_commit(reg.body)}",
        f"- ledger: registration is record {reg.seq}, hash `{reg.hash[:16]}`",
    ]
    if experiment.amendments:
        lines += ["", "### Amendments", ""]
        for i, a in enumerate(experiment.amendments, 1):
            changed = ", ".join(f"`{k}`" for k in a.body["changes"])
            lines += [f"{i}. **{a.body['reason']}** ({a.created_at}; record {a.seq}; git commit {_commit(a.body)})",
                      f"   changed: {changed}", "", "   ```diff",
                      *(f"   {line}" for line in a.body["diff"].rstrip().splitlines()), "   ```", ""]
    if with_runs and experiment.runs:
        lines += [""] if lines[-1] else []
        lines += ["### Runs", "", "| record | time | step | event | output |", "|---|---|---|---|---|"]
        for r in experiment.runs:
            b = r.body
            lines.append(f"| {r.seq} | {r.created_at} | {b.get('step')} | {b.get('event')} | `{b.get('output_dir')}` |")
    return "\n".join(lines).rstrip() + "\n"
