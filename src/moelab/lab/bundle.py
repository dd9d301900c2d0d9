"""An experiment's portable bundle: everything an outsider needs to check it, and to rerun it.

    export_bundle(ledger, "demo-ladder", "demo-ladder.tar.gz")   # `moelab lab export ID --out BUNDLE`
    with open_bundle("demo-ladder.tar.gz") as folder:               # `moelab lab verify BUNDLE`
        check = verify_bundle(folder)                               # check.problems == [] when it holds

A bundle is a folder (or the same folder as a `.tar.gz`):

    bundle.json            format, the experiment, when and from which ledger, the ledger's head at export,
                           and each step: its directory, version, the ledger record of its finished run, commit
    spec/registered.yaml   the spec as registered; spec/amendment-N.yaml each amended version
    ledger/records.jsonl   every ledger record of the experiment (registration, amendments, runs, metrics,
                           incidents, mixture log, samples), each with its prev_hash and hash
    ledger/chain.jsonl     {seq, kind, key, prev_hash, hash} of every record from the experiment's first to the
                           head
    steps/<step>/          each step's files: config.yaml (the resolved config), step.json, metrics.jsonl,
                           incidents.jsonl, mixture_log.jsonl, summary.json, prediction.csv + .json, ...
                           (checkpoints stay behind); store-<i>-manifest.json: the token stores it read
    report/                report.md, report.html and the plots, written at export
    MANIFEST.sha256        the SHA-256 of every other file, `sha256sum -c` format

How much of the ledger's chain a bundle can prove. The experiment's records are only some of the
ledger's, interleaved with other experiments'. Each record travels whole, so its hash recomputes
(`ledger.record_hash`); the other records travel as links alone (seq, kind, key, prev_hash, hash; the
body withheld), so `verify_bundle` checks that the experiment's records sit, in order, on one unbroken
line of hashes that ends at the ledger head the bundle states, and that every link keyed to the
experiment has its record in the bundle. What it cannot check alone is that the withheld records hash
right (so a link relabelled to another key would hide a dropped record), or what came before the
experiment's first record: whoever holds the ledger proves both, by finding the bundle's head in it
(`moelab lab verify --ledger L --head HEAD`) and comparing the links.

`verify_bundle` also recomputes each step's version from its step.json (as `lab.dag` does), checks
that each training step's config.yaml is the config that version names, and that the numbers the
report states (observed value, verdict, per-domain evals; `report.stated_tables`) are those of the
bundled metrics, and that the ledger head the report names is on the chain.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import json
import math
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from moelab.data.store import read_manifest, sha256_file
from moelab.errors import ConfigError, DataError
from moelab.lab.dag import SUCCESS, Step, read_status, step_versions, versioned
from moelab.lab.experiment import LEDGER_EXPORT
from moelab.lab.ledger import Ledger, Record, canonical_json, record_hash, record_line, records, verify
from moelab.lab.registry import TRAIN_STEP, Experiment, load_experiment, spec_hash
from moelab.train.outputs import CONFIG, DATA, METRICS, SUMMARY, read_jsonl

__all__ = ["FORMAT", "MANIFEST", "INFO", "RECORDS", "CHAIN", "Bundle", "BundleCheck", "Exported", "finished_steps",
           "export_bundle", "open_bundle", "load_bundle", "verify_bundle", "sha256_file"]

FORMAT, FORMAT_VERSION = "moelab-bundle", 1
MANIFEST, INFO = "MANIFEST.sha256", "bundle.json"
RECORDS, CHAIN = "ledger/records.jsonl", "ledger/chain.jsonl"
TAR_SUFFIX = ".tar.gz"
REPORT_MD, REPORT_HTML = "report/report.md", "report/report.html"
# What stays behind: checkpoints and W&B (large), the report (rewritten at export), and a published run's export
# of the whole ledger (other experiments' records; the bundle holds this one's).
_SKIPPED_ENTRIES = ("checkpoints", "wandb", "report", LEDGER_EXPORT)


# ----------------------------------------------------------------------------------------------
# export


def finished_steps(experiment: Experiment) -> dict[str, Record]:
    """Each step's newest `finished` (or `skipped`, by a later run) ledger record, by step name."""
    found: dict[str, Record] = {}
    for record in experiment.runs:
        if record.body.get("event") in ("finished", "skipped") and record.body.get("output_dir"):
            found[record.body["step"]] = record
    return found


def _spec_files(experiment: Experiment) -> dict[str, Record]:
    files = {"spec/registered.yaml": experiment.registration}
    files.update({f"spec/amendment-{n}.yaml": a for n, a in enumerate(experiment.amendments, 1)})
    return files


def _spec_text(record: Record) -> str:
    """A spec file's text in a bundle: one writer, so `verify_bundle` can compare the bytes too."""
    return yaml.safe_dump(record.body["spec"], sort_keys=False, allow_unicode=True)


def _copy_step(src: Path, dst: Path) -> list[str]:
    """The step's top-level files into `dst`, plus the manifest of each token store it read; returns the
    stores whose manifest could not be read (the run's data.json still names them)."""
    dst.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if entry.is_file() and not entry.name.startswith(".") and entry.name not in _SKIPPED_ENTRIES:
            shutil.copyfile(entry, dst / entry.name)
    unreachable = []
    if (src / DATA).is_file():
        for i, store in enumerate(json.loads((src / DATA).read_text()).get("stores", [])):
            try:
                manifest = read_manifest(store["location"])
            except DataError:
                unreachable.append(str(store["location"]))
                continue
            (dst / f"store-{i}-manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return unreachable


def _write_manifest(folder: Path) -> str:
    """MANIFEST.sha256 over every other file (sorted paths); returns the manifest's own SHA-256."""
    lines = [f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}\n" for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST]
    (folder / MANIFEST).write_text("".join(lines))
    return sha256_file(folder / MANIFEST)


def _fill(folder: Path, ledger: Ledger, exp_id: str) -> dict:
    from moelab.lab.report import write_report  # matplotlib: only when a bundle is written

    chain = verify(ledger)
    if not chain.ok:
        raise ConfigError(f"the ledger {ledger.path} fails its hash check at record {chain.broken_seq}: "
                          f"{chain.problem}. A bundle of a broken chain would prove nothing; restore the ledger "
                          f"from a copy you trust (`moelab lab verify --ledger {ledger.path}` shows the details).")
    experiment = load_experiment(ledger, exp_id)
    steps = finished_steps(experiment)
    if TRAIN_STEP not in steps:
        raise ConfigError(f"experiment {exp_id!r} has no finished training step on {ledger.path}, so there is "
                          f"nothing to bundle yet; run it first: `moelab lab run {exp_id} --ledger {ledger.path}`.")
    for name, record in steps.items():
        out = Path(record.body["output_dir"])
        if read_status(out) != SUCCESS:
            raise ConfigError(f"step {name} of {exp_id!r} finished in {out} (ledger record {record.seq}), but that "
                              f"directory does not hold a SUCCESS run now (moved or deleted?). Run `moelab lab run "
                              f"{exp_id}` again to restore it, then export.")
    # One read, cut at the head checked above: records another process appends meanwhile stay out of
    # both files, so the chain ends at the head bundle.json states.
    upto_head = [r for r in records(ledger) if r.seq <= chain.num_records]
    own = [r for r in upto_head if r.key == exp_id]
    (folder / "ledger").mkdir()
    (folder / RECORDS).write_text("".join(record_line(r) for r in own))
    (folder / CHAIN).write_text("".join(
        canonical_json({"seq": r.seq, "kind": r.kind, "key": r.key, "prev_hash": r.prev_hash, "hash": r.hash}) + "\n"
        for r in upto_head if r.seq >= own[0].seq))
    (folder / "spec").mkdir()
    for name, record in _spec_files(experiment).items():
        (folder / name).write_text(_spec_text(record))
    step_info, unreachable = {}, []
    for name, record in steps.items():
        unreachable += _copy_step(Path(record.body["output_dir"]), folder / "steps" / name)
        step_info[name] = {"dir": f"steps/{name}", "version": record.body["version"],
                           "record": {"seq": record.seq, "hash": record.hash},
                           "git_commit": record.body.get("git_commit"), "git_dirty": record.body.get("git_dirty")}
    write_report(ledger, exp_id, folder / "report")
    info = {"format": FORMAT, "version": FORMAT_VERSION, "experiment": exp_id,
            "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "ledger": {"path": str(ledger.path), "num_records": chain.num_records, "head_hash": chain.head_hash},
            "steps": step_info, "unreachable_stores": sorted(set(unreachable))}
    (folder / INFO).write_text(json.dumps(info, indent=1) + "\n")
    return info


@dataclass(frozen=True)
class Exported:
    path: Path
    manifest_sha256: str  # publish it: a bundle whose MANIFEST hashes to it holds exactly these files
    num_files: int
    info: dict


def export_bundle(ledger: Ledger, exp_id: str, out: str | Path) -> Exported:
    """Write the bundle of `exp_id` to `out` (a folder, or a `.tar.gz` when the name ends so).

    Refused (ConfigError) when `out` exists, the ledger's chain is broken, or the experiment has no
    finished training step. Written under a temporary name and renamed: a failed export leaves nothing.
    """
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {out} already exists; a bundle is written whole into a new path. Pass another "
                          "--out, or remove the old bundle first.")
    name = out.name[:-len(TAR_SUFFIX)] if out.name.endswith(TAR_SUFFIX) else out.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=out.parent) as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        info = _fill(folder, ledger, exp_id)
        digest = _write_manifest(folder)
        num_files = sum(1 for p in folder.rglob("*") if p.is_file())
        if out.name.endswith(TAR_SUFFIX):
            partial = Path(tmp) / out.name
            with tarfile.open(partial, "w:gz") as tar:
                tar.add(folder, arcname=name)
            os.replace(partial, out)
        else:
            os.replace(folder, out)
    return Exported(out, digest, num_files, info)


# ----------------------------------------------------------------------------------------------
# reading


@contextlib.contextmanager
def open_bundle(path: str | Path) -> Iterator[Path]:
    """The bundle's folder: `path` itself, or a `.tar.gz` unpacked into a temporary folder for the block."""
    path = Path(path)
    if path.is_dir():
        yield path
        return
    if not path.is_file():
        raise ConfigError(f"no bundle at {path}: pass the folder or .tar.gz that `moelab lab export ID --out "
                          "BUNDLE` wrote.")
    with tempfile.TemporaryDirectory(prefix="moelab-bundle-") as tmp:
        try:
            with tarfile.open(path, "r:*") as tar:
                tar.extractall(tmp, filter="data")  # no absolute paths, links out or devices
        except (tarfile.TarError, OSError) as e:
            raise ConfigError(f"{path} is not a readable bundle archive ({e}); pass the folder or .tar.gz that "
                              "`moelab lab export` wrote.") from None
        tops = [p for p in Path(tmp).iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise ConfigError(f"{path} does not hold one bundle folder (it holds {len(tops)} entries at the top); "
                              "pass the .tar.gz that `moelab lab export` wrote.")
        yield tops[0]


@dataclass(frozen=True)
class Bundle:
    folder: Path
    info: dict
    experiment: Experiment  # rebuilt from the bundled records

    def step_dir(self, name: str) -> Path:
        return self.folder / self.info["steps"][name]["dir"]

    def steps(self) -> list[str]:
        return list(self.info["steps"])


_RECORD_FIELDS = {"seq": int, "kind": str, "key": str, "created_at": str, "body": dict, "prev_hash": str, "hash": str}
_LINK_FIELDS = {"seq": int, "kind": str, "key": str, "prev_hash": str, "hash": str}
_INFO_FIELDS = {"format": str, "version": int, "experiment": str, "ledger": dict, "steps": dict}
_STEP_FIELDS = {"dir": str, "version": str, "record": dict}


def _typed(value: Any, kind: type) -> bool:
    """isinstance, except that a bool is not an int (JSON true is not a record number)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _shape_problem(row: Any, fields: dict[str, type]) -> str | None:
    """What keeps `row` from being a JSON object with `fields` of those types, or None."""
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object"
    missing = [k for k in fields if k not in row]
    if missing:
        return f"lacks {', '.join(repr(k) for k in missing)}"
    wrong = [f"{k!r} is {type(row[k]).__name__}, not {fields[k].__name__}" for k in fields if not _typed(row[k], fields[k])]
    return "; ".join(wrong) or None


def _json_lines(folder: Path, name: str, fields: dict[str, type]) -> tuple[list[dict], list[str]]:
    """The lines of `name` that are JSON objects with `fields` of their types, and a finding per other line
    (naming the file and line), so a tampered line is reported instead of breaking the checks after it."""
    try:
        text = (folder / name).read_text()
    except (OSError, UnicodeDecodeError) as e:
        return [], [f"{name} cannot be read ({type(e).__name__}: {e})"]
    rows, problems = [], []
    if text and not text.endswith("\n"):
        problems.append(f"{name} does not end with a newline: it was cut short or edited")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            problems.append(f"{name} line {number} is blank: export writes none")
            continue
        try:
            row = json.loads(line)
        except ValueError:
            problems.append(f"{name} line {number} is not JSON")
            continue
        shape = _shape_problem(row, fields)
        if shape:
            problems.append(f"{name} line {number} {shape}: it is not a ledger {'record' if fields is _RECORD_FIELDS else 'link'}")
            continue
        rows.append(row)
    return rows, problems


def _read_records(path: Path) -> list[dict]:
    """The well-formed records of a bundle's records.jsonl or chain.jsonl (`_json_lines` reports the rest)."""
    fields = _RECORD_FIELDS if path.name == Path(RECORDS).name else _LINK_FIELDS
    return _json_lines(path.parent, path.name, fields)[0]


def _info_problems(info: Any) -> list[str]:
    """What keeps bundle.json from being one: its keys and types, and each step's entry."""
    shape = _shape_problem(info, _INFO_FIELDS)
    if shape:
        return [f"{INFO} {shape}"]
    problems = []
    head = info["ledger"]
    if not (_typed(head.get("num_records"), int) and _typed(head.get("head_hash"), str)):
        problems.append(f"{INFO}: ledger must hold num_records (an integer) and head_hash (a string)")
    for name, entry in info["steps"].items():
        shape = _shape_problem(entry, _STEP_FIELDS)
        if shape is None and _shape_problem(entry["record"], {"seq": int, "hash": str}):
            shape = "has a record that is not {seq, hash}"
        if shape is None and not _inside(entry["dir"]):
            shape = f"names dir {entry['dir']!r}, which is not a path inside the bundle"
        if shape:
            problems.append(f"{INFO}: step {name!r} {shape}")
    return problems


def _inside(name: str) -> bool:
    """A relative path with no `..` part: it cannot name anything outside the bundle's folder."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def load_bundle(folder: str | Path) -> Bundle:
    """The bundle's info and its experiment as its records say. ConfigError when it is not a bundle;
    this checks nothing else: `verify_bundle` does."""
    folder = Path(folder)
    try:
        info = json.loads((folder / INFO).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder} is not a moelab bundle ({INFO} is missing or not JSON: {e}); "
                          "pass the folder or .tar.gz that `moelab lab export ID --out BUNDLE` wrote.") from None
    problems = _info_problems(info)
    if problems:
        raise ConfigError(f"{folder} is not a readable moelab bundle: {problems[0]}.")
    rows = _read_records(folder / RECORDS)
    if info.get("format") != FORMAT or info.get("version") != FORMAT_VERSION:
        raise ConfigError(f"{folder / INFO} says format {info.get('format')!r} version {info.get('version')!r}; "
                          f"this moelab reads {FORMAT!r} version {FORMAT_VERSION}.")
    own = [Record(**row) for row in rows]
    registration = [r for r in own if r.kind == "experiment"]
    if not registration:
        raise ConfigError(f"{folder / RECORDS} holds no registration record of {info.get('experiment')!r}; "
                          "it is not an exported experiment.")
    experiment = Experiment(info["experiment"], registration[0], tuple(r for r in own if r.kind == "amendment"),
                            tuple(r for r in own if r.kind == "run"))
    return Bundle(folder, info, experiment)


# ----------------------------------------------------------------------------------------------
# verification


@dataclass(frozen=True)
class BundleCheck:
    problems: list[str]  # one sentence each, naming the file or the record; [] when the bundle holds
    manifest_sha256: str | None
    num_files: int
    head_hash: str | None  # the ledger head the bundle states
    num_records: int  # the experiment's records in it

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_manifest(folder: Path) -> tuple[list[str], str | None, int]:
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{MANIFEST} is missing: nothing in the bundle can be checked against it"], None, 0
    problems, listed = [], set()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        return [f"{MANIFEST} cannot be read ({type(e).__name__}): nothing in the bundle can be checked against it"], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        match = re.fullmatch(r"([0-9a-f]{64})  (.+)", line)
        if not match or ".." in Path(match.group(2)).parts or Path(match.group(2)).is_absolute():
            problems.append(f"{MANIFEST}:{number} is not a '<sha256>  <path>' line inside the bundle")
            continue
        digest, name = match.groups()
        if name in listed:
            problems.append(f"{MANIFEST}:{number} lists {name} a second time")
        elif listed and name < max(listed):
            problems.append(f"{MANIFEST}:{number} ({name}) is out of the sorted order export writes: the manifest "
                            "was edited")
        listed.add(name)
        file = folder / name
        if not file.is_file():
            problems.append(f"{name} is missing (listed in {MANIFEST})")
        elif sha256_file(file) != digest:
            problems.append(f"{name} was changed: its SHA-256 is not the one {MANIFEST} lists")
    for file in sorted(folder.rglob("*")):
        name = file.relative_to(folder).as_posix()
        if file.is_file() and name != MANIFEST and name not in listed:
            problems.append(f"{name} is not listed in {MANIFEST}: it was added after export")
    return problems, sha256_file(path), len(listed) + 1


def _check_chain(folder: Path, info: dict) -> list[str]:
    """The experiment's records recompute; they sit on the chain's links, which are unbroken up to the head."""
    own, problems = _json_lines(folder, RECORDS, _RECORD_FIELDS)
    links, bad_links = _json_lines(folder, CHAIN, _LINK_FIELDS)
    problems += bad_links
    seen: dict[int, int] = {}
    for link in links:
        seen[link["seq"]] = seen.get(link["seq"], 0) + 1
    problems += [f"{CHAIN}: record {seq} appears {n} times" for seq, n in seen.items() if n > 1]
    by_seq = {}
    for i, link in enumerate(links):
        if i and (link["seq"] != links[i - 1]["seq"] + 1 or link["prev_hash"] != links[i - 1]["hash"]):
            problems.append(f"{CHAIN}: record {link.get('seq')} does not link to record {links[i - 1].get('seq')} "
                            "(its prev_hash is not that record's hash, or a record is missing between them)")
        by_seq[link.get("seq")] = link
    head = info.get("ledger", {})
    if not links or links[-1]["hash"] != head.get("head_hash") or links[-1]["seq"] != head.get("num_records"):
        problems.append(f"{CHAIN} does not end at the ledger head {INFO} states (record {head.get('num_records')}, "
                        f"sha256 {str(head.get('head_hash'))[:16]}...)")
    problems += [f"{RECORDS} line order: record {b['seq']} follows record {a['seq']}; the records were reordered or "
                 "repeated" for a, b in zip(own, own[1:]) if b["seq"] <= a["seq"]]
    kept = {row.get("seq") for row in own}
    problems += [f"{CHAIN}: record {link.get('seq')} ({link.get('kind')} {link.get('key')!r}) is one of the "
                 f"experiment's, but {RECORDS} does not hold it" for link in links
                 if link.get("key") == info.get("experiment") and link.get("seq") not in kept]
    for row in own:
        seq, what = row.get("seq"), f"{RECORDS}: record {row.get('seq')} ({row.get('kind')} {row.get('key')!r})"
        digest = record_hash(row["prev_hash"], seq, row["kind"], row["key"], row["created_at"], row["body"])
        if digest != row["hash"]:
            problems.append(f"{what} does not match its hash: a field was changed after it was written")
        elif row["key"] != info.get("experiment"):
            problems.append(f"{what} belongs to another experiment than {info.get('experiment')!r}")
        elif any(by_seq.get(seq, {}).get(k) != row[k] for k in _LINK_FIELDS):
            problems.append(f"{what} is not on the chain in {CHAIN} at its place (its link there differs)")
    return problems


def _check_specs(bundle: Bundle) -> list[str]:
    problems = []
    for name, record in _spec_files(bundle.experiment).items():
        try:
            data = yaml.safe_load((bundle.folder / name).read_text())
        except (OSError, yaml.YAMLError):
            data = None
        if data is None or spec_hash(data) != record.body.get("spec_hash"):
            problems.append(f"{name} is not the spec of ledger record {record.seq} (its content hash differs)")
        elif (bundle.folder / name).read_text() != _spec_text(record):
            problems.append(f"{name} is not the text export writes for ledger record {record.seq} (same content, "
                            "edited text: a repeated key or a comment was added)")
    return problems


def _check_steps(bundle: Bundle) -> list[str]:
    """Each step's record is in the bundle, its version recomputes from step.json, a training step's
    config.yaml is the config of that version."""
    problems, runs, steps = [], {r.seq: r for r in bundle.experiment.runs}, []
    for name, entry in bundle.info.get("steps", {}).items():
        where = bundle.folder / entry["dir"]
        record = runs.get(entry["record"]["seq"])
        if record is None or record.hash != entry["record"]["hash"] or record.body.get("version") != entry["version"]:
            problems.append(f"{INFO}: step {name} names ledger record {entry['record']['seq']}, which is not its "
                            f"finished run in {RECORDS}")
        try:
            step = json.loads((where / "step.json").read_text())
        except (OSError, ValueError):
            problems.append(f"{entry['dir']}/step.json is missing or not JSON")
            continue
        if step.get("version") != entry["version"]:
            problems.append(f"{entry['dir']}/step.json names version {str(step.get('version'))[:12]}..., not the "
                            f"recorded {entry['version'][:12]}...")
        steps.append(Step(name, _no_fn, {k: versioned(v) for k, v in step.get("versioned", {}).items()},
                          tuple(step.get("deps", {}))))
        if "run" in step.get("versioned", {}):
            try:
                config = yaml.safe_load((where / CONFIG).read_text())
                config.pop("name", None)
                same = canonical_json(config) == canonical_json(step["versioned"]["run"])
            except (OSError, yaml.YAMLError, AttributeError):
                same = False
            if not same:
                problems.append(f"{entry['dir']}/{CONFIG} is not the config of step version {entry['version'][:12]}...")
    try:
        recomputed = step_versions(steps)
    except ConfigError as e:
        return problems + [f"the steps' step.json files do not form the experiment's DAG: {e}"]
    problems += [f"steps/{s.name}/step.json: its versioned fields and dependencies hash to "
                 f"{recomputed[s.name][:12]}..., not to its recorded version" for s in steps
                 if recomputed[s.name] != bundle.info["steps"][s.name]["version"]]
    return problems


# A step's files whose rows the run also appended to the ledger (`tracking.LedgerSink`): kind per file.
_STREAMED = {METRICS: "metric", "incidents.jsonl": "incident", "mixture_log.jsonl": "mixture", "samples.jsonl": "sample"}
# A step's files that hold its result, which its finished record commits to (a training step's summary holds
# more keys than the result: the ones it shares must agree). A training step watched against a fit keeps a copy
# of that fit's prediction.json: it is the fit's result, checked against the fit's record (`_result_owner`).
_RESULT_FILES = (("result.json", True), (SUMMARY, False), ("prediction.json", True))


def _first_difference(have: dict, want: dict) -> str:
    """The first key where two records differ, with both values, in a few words."""
    for key in sorted(set(have) | set(want)):
        if canonical_json(have.get(key)) != canonical_json(want.get(key)):
            return f"{key} is {have.get(key, '(absent)')!r} here, {want.get(key, '(absent)')!r} in the record"
    return "they differ"


def _result_owner(bundle: Bundle, name: str, filename: str, runs: dict) -> Any:
    """The finished record a step's prediction.json copies, when the step was watched against a fit step
    (`predicted_by` in its step.json); None for any other file or step."""
    if filename != "prediction.json":
        return None
    try:
        step = json.loads((bundle.folder / bundle.info["steps"][name]["dir"] / "step.json").read_text())
        fit = step["config"]["predicted_by"]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # _check_steps names a missing or malformed step.json
    entry = bundle.info["steps"].get(fit) if isinstance(fit, str) else None
    return runs.get(entry["record"]["seq"]) if entry else None


def _check_committed(bundle: Bundle) -> list[str]:
    """Each step file whose content a ledger record commits to says what the record says (issue 31): the
    metrics, incidents, mixture log and samples the run appended row by row, its result, summary and
    prediction in its finished record. A file edited and re-hashed into the manifest fails here."""
    problems, own = [], _read_records(bundle.folder / RECORDS)
    runs = {r.seq: r for r in bundle.experiment.runs}
    for name, entry in bundle.info["steps"].items():
        where, label = bundle.folder / entry["dir"], entry["dir"]
        record = runs.get(entry["record"]["seq"])
        if record is None:
            continue  # _check_steps names it
        status = read_status(where)
        if status not in (None, SUCCESS):  # the record is a finished (or skipped-as-done) step's
            problems.append(f"{label}/STATUS reads {status!r}, but ledger record {record.seq} has the step "
                            f"{record.body.get('event')} with status {SUCCESS}")
        for filename, whole in _RESULT_FILES:
            path = where / filename
            owner = _result_owner(bundle, name, filename, runs) or record
            result = owner.body.get("result")
            if not isinstance(result, dict) or not path.is_file():
                continue
            data = json.loads(path.read_text())
            have = data if whole else {k: data.get(k) for k in result}
            if canonical_json(have) != canonical_json(result):
                problems.append(f"{label}/{filename} is not the result ledger record {owner.seq} holds: "
                                f"{_first_difference(have, result)}")
        config = where / CONFIG
        run_name = (yaml.safe_load(config.read_text()) or {}).get("name") if config.is_file() else None
        problems += _check_streamed(where, label, [r for r in own if r["body"].get("run") == run_name])
    return problems


def _check_streamed(where: Path, label: str, own: list[dict]) -> list[str]:
    """A step's streamed files against the run's ledger records, one file per kind (`_STREAMED`): each line is a
    record (same body), the lines follow the records' order (none repeated), and every record is a line unless
    the run went back past it: a resume from an earlier checkpoint cuts its files there and logs those steps
    again (its metrics step back to one at or below the record's), or the same row came again later. So a row
    deleted, reordered or duplicated is a finding."""
    problems, restarts, previous = [], [], -math.inf
    for row in sorted(own, key=lambda r: r["seq"]):  # a resume: the run logs a step it had logged, or an earlier one
        step = row["body"].get("step")
        if row["kind"] == _STREAMED[METRICS] and _typed(step, int):
            if step <= previous:
                restarts.append((row["seq"], step))
            previous = step
    for filename, kind in _STREAMED.items():
        committed = [(row["seq"], {k: v for k, v in row["body"].items() if k != "run"})
                     for row in own if row["kind"] == kind]
        path = where / filename
        if not path.is_file():
            if committed:
                problems.append(f"{label}/{filename} is missing, though {len(committed)} ledger record(s) hold its rows")
            continue
        by_step: dict[Any, list[tuple[int, dict, str]]] = {}
        for seq, body in committed:
            by_step.setdefault(body.get("step"), []).append((seq, body, canonical_json(body)))
        matched: dict[str, int] = {}  # a matched row's canonical JSON -> the newest record seq it matched
        last = 0
        for number, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            step = row.get("step") if isinstance(row, dict) else None
            same = by_step.get(step, []) if _hashable(step) else []
            text = canonical_json(row)
            equal = [seq for seq, _, canon in same if canon == text]
            later = [seq for seq in equal if seq > last]
            if later:  # the newest: after a resume the row in the file is the one logged again
                last = later[-1]
                matched[text] = max(matched.get(text, 0), last)
            elif equal:
                problems.append(f"{label}/{filename} line {number} (step {step}) repeats a row or is out of order: "
                                f"it is ledger record {equal[-1]}, which comes before the record of an earlier line")
            elif same:
                seq, body, _ = same[-1]
                problems.append(f"{label}/{filename} line {number} (step {step}) is not ledger record "
                                f"{seq}: {_first_difference(row, body)}")
            else:
                problems.append(f"{label}/{filename} line {number}: no ledger record holds this row")
        for seq, body in committed:
            step, canon = body.get("step"), canonical_json(body)
            gone_back = _typed(step, int) and any(at > seq and first <= step for at, first in restarts)
            if matched.get(canon, 0) < seq and not gone_back:
                problems.append(f"{label}/{filename} lacks ledger record {seq} (step {step}): a row the run "
                                "committed is not in the file")
    return problems


def _hashable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None)))


def _no_fn(ctx: Any) -> None:  # a Step rebuilt only to recompute its version
    raise AssertionError("never run")


def _markdown_tables(text: str) -> dict[str, list[list[str]]]:
    """The tables of each `<a id="...">` section of report.md, as rows of cell text (separator rows dropped)."""
    tables: dict[str, list[list[str]]] = {}
    section = None
    for line in text.splitlines():
        anchor = re.fullmatch(r'<a id="([^"]+)"></a>', line)
        if anchor:
            section = anchor.group(1)
        elif section and line.startswith("| ") and not re.fullmatch(r"\|(---\|)+", line):
            cells = re.split(r"(?<!\\) \| ", line[2:-2])
            tables.setdefault(section, []).append([c.replace("\\|", "|") for c in cells])
    return tables


def _html_tables(text: str) -> dict[str, list[list[str]]]:
    tables = {}
    for sid, body in re.findall(r'<section id="([^"]+)">(.*?)</section>', text, re.DOTALL):
        rows = [[html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
                for row in re.findall(r"<tr>(.*?)</tr>", body, re.DOTALL)]
        if rows:
            tables[sid] = rows
    return tables


def _check_report(bundle: Bundle) -> list[str]:
    """The numbers the report states are those of the bundled metrics; its ledger head is on the chain."""
    from moelab.lab.report import stated_tables

    if TRAIN_STEP not in bundle.info.get("steps", {}):
        return [f"{INFO} names no {TRAIN_STEP} step, whose run the report describes"]
    run = bundle.step_dir(TRAIN_STEP)
    summary_path = run / SUMMARY
    expected = stated_tables(bundle.experiment, read_jsonl(run / METRICS),
                             json.loads(summary_path.read_text()) if summary_path.is_file() else {}, run)
    problems = []
    for name, parse in ((REPORT_MD, _markdown_tables), (REPORT_HTML, _html_tables)):
        try:
            text = (bundle.folder / name).read_text()
        except OSError:
            problems.append(f"{name} is missing")
            continue
        stated = parse(text)
        problems += _check_report_amendments(bundle, name, text)
        for sid, rows in expected.items():
            got = stated.get(sid, [])
            bad = next((i for i in range(max(len(rows), len(got))) if i >= len(rows) or i >= len(got)
                        or rows[i] != got[i]), None)
            if bad is not None:
                want = " | ".join(rows[bad]) if bad < len(rows) else "no row"
                have = " | ".join(got[bad]) if bad < len(got) else "no row"
                problems.append(f"{name}: the {sid} table does not state the bundled metrics' numbers: row "
                                f"{bad} reads '{have}', the metrics give '{want}'")
        if name == REPORT_MD:
            problems += _check_report_head(bundle, stated.get("reproducibility", []))
    return problems


def _check_report_amendments(bundle: Bundle, name: str, text: str) -> list[str]:
    """The report's amendments section names each amendment on the bundled ledger by its record, and no other."""
    pattern = (r'<a id="amendments"></a>(.*?)(?:<a id="|\Z)' if name == REPORT_MD else
               r'<section id="amendments">(.*?)</section>')
    found = re.search(pattern, text, re.DOTALL)
    if found is None:
        return [f"{name} has no amendments section"]
    named = sorted(int(n) for n in re.findall(r"ledger record (\d+)\)", found.group(1)))
    want = sorted(a.seq for a in bundle.experiment.amendments)
    if named == want:
        return []
    return [f"{name}: the amendments section names record(s) {named or 'none'}, but the bundled ledger holds "
            f"amendment record(s) {want or 'none'}"]


def _check_report_head(bundle: Bundle, rows: list[list[str]]) -> list[str]:
    facts = {row[0]: row[1] for row in rows if len(row) == 2}
    count = re.match(r"(\d+)", facts.get("ledger records when this report was written", ""))
    head = facts.get("ledger head sha256")
    links = {link["seq"]: link["hash"] for link in _read_records(bundle.folder / CHAIN)}
    if count is None or head is None:
        return [f"{REPORT_MD} states no ledger head (its reproducibility table lacks it)"]
    problems, seq = [], int(count.group(1))
    if seq in links and links[seq] != head:
        problems.append(f"{REPORT_MD} names ledger head {head[:16]}... at record {seq}, which is not that record's "
                        f"hash on the chain in {CHAIN}")
    config = bundle.step_dir(TRAIN_STEP) / CONFIG
    if config.is_file() and facts.get(f"{CONFIG} sha256") != sha256_file(config):
        problems.append(f"{REPORT_MD} names another {CONFIG} sha256 than the bundled steps/{TRAIN_STEP}/{CONFIG}'s")
    return problems


def verify_bundle(folder: str | Path) -> BundleCheck:
    """Check a bundle alone: every file's hash, the chain, the specs, the steps, the report's numbers."""
    folder = Path(folder)
    links = _links_in(folder)
    if links:  # refused before anything is read: a link could point anywhere on the verifying machine
        return BundleCheck(links, None, 0, None, 0)
    problems, digest, num_files = _check_manifest(folder)
    try:
        bundle = load_bundle(folder)
    except ConfigError as e:
        return BundleCheck(problems + [str(e)], digest, num_files, None, 0)
    for check, arg in ((_check_chain, None), (_check_specs, bundle), (_check_steps, bundle), (_check_committed, bundle),
                       (_check_report, bundle)):
        problems += _guarded(check, *((folder, bundle.info) if arg is None else (arg,)))
    num_records = len(_read_records(folder / RECORDS))
    return BundleCheck(problems, digest, num_files, bundle.info["ledger"].get("head_hash"), num_records)


def _links_in(folder: Path) -> list[str]:
    """A finding per symbolic link (or other non-plain entry) in the bundle: a bundle holds folders and files."""
    found = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found.append(f"{name} is a symbolic link (to {os.readlink(path)}): a bundle holds plain files only, so "
                         "it is refused without reading anything through it")
        elif not (path.is_file() or path.is_dir()):
            found.append(f"{name} is not a plain file or folder: refused")
    return found


def _guarded(check, *args) -> list[str]:
    """`check(*args)`'s findings; a file whose content breaks it (bad types deep in a JSON or YAML file) is a
    finding naming the check, not a traceback: whatever made it fail is not what was exported."""
    try:
        return check(*args)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, yaml.YAMLError,
            ConfigError, DataError) as e:
        return [f"{check.__name__.removeprefix('_check_')}: the bundle's files cannot be checked as exported "
                f"({type(e).__name__}: {e})"]
