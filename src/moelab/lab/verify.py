"""`moelab lab verify BUNDLE`: check an exported bundle (`lab.bundle`) alone, with nothing but its files.

    with open_bundle("demo-ladder.tar.gz") as folder:
        check = verify_bundle(folder)          # check.problems == [] when it holds; one sentence per finding

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
that each training step's config.yaml is the config that version names, and that every file a ledger
record commits to says what the record says. The report is checked through report.json, never its
prose: its stated tables are those the bundled files give (`report.stated_tables`), its amendments
and ledger head are the bundled records', its figures hash as it says, and report.md and report.html
are exactly its renderings. Any sentence of the report can be reworded without breaking this.

About 600 lines, on purpose: every check of one bundle, each a function of 10-60 lines sharing the
readers of its JSON files (`_json_lines`, `_shape_problem`); split further, one check would read
another module's records.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moelab.errors import ConfigError, DataError
from moelab.files import sha256_file
from moelab.lab.bundle import CHAIN, FORMAT, FORMAT_VERSION, INFO, MANIFEST, RECORDS, REPORT_DIR, spec_files, spec_text
from moelab.lab.dag import SUCCESS, Step, read_status, step_versions, versioned
from moelab.lab.ledger import Record, canonical_json, record_hash
from moelab.lab.registry import TRAIN_STEP, Experiment, spec_hash
from moelab.lab.report import (REPORT_FORMAT, REPORT_VERSION, STATED, figure_name, html_section, json_tables,
                               markdown_section, render_html, render_markdown, stated_tables)
from moelab.lab.view import read_run
from moelab.train.outputs import CONFIG, METRICS, SUMMARY

__all__ = ["Bundle", "BundleCheck", "load_bundle", "verify_bundle"]

REPORT_JSON, REPORT_MD, REPORT_HTML = (f"{REPORT_DIR}/{name}" for name in ("report.json", "report.md", "report.html"))


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
# Bundle format versions this moelab refuses by name, and why each cannot be checked as it is.
_OLDER = {1: f"before its report was stated as {REPORT_JSON} (moelab issue 41), so only the report's wording could "
             "check it",
          2: "while the report's figures were PNG files (moelab issue 41 made them SVG, drawn as the site's are)"}


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
    if info.get("format") == FORMAT and info.get("version") in _OLDER:
        raise ConfigError(f"{folder / INFO} says format {FORMAT!r} version {info['version']}: a bundle written "
                          f"{_OLDER[info['version']]}. This moelab reads {FORMAT!r} version {FORMAT_VERSION}; export the "
                          f"experiment again from its ledger (`moelab lab export {info['experiment']} --out NEW`) and "
                          "verify that.")
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
    for name, record in spec_files(bundle.experiment).items():
        try:
            data = yaml.safe_load((bundle.folder / name).read_text())
        except (OSError, yaml.YAMLError):
            data = None
        if data is None or spec_hash(data) != record.body.get("spec_hash"):
            problems.append(f"{name} is not the spec of ledger record {record.seq} (its content hash differs)")
        elif (bundle.folder / name).read_text() != spec_text(record):
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


# ----------------------------------------------------------------------------------------------
# the report: report.json against the records, report.md and report.html against report.json

_PART_FIELDS = {"p": {"text": str}, "note": {"text": str}, "pre": {"text": str}, "table": {"head": list, "rows": list},
                "img": {"name": str, "sha256": str}}


def _document_problem(document: Any) -> str | None:
    """What keeps report.json from being a report this moelab renders, or None."""
    shape = _shape_problem(document, {"format": str, "version": int, "title": str, "sections": list})
    if shape:
        return shape
    if (document["format"], document["version"]) != (REPORT_FORMAT, REPORT_VERSION):
        return (f"says format {document['format']!r} version {document['version']}; this moelab reads "
                f"{REPORT_FORMAT!r} version {REPORT_VERSION}")
    for i, section in enumerate(document["sections"]):
        shape = _shape_problem(section, {"id": str, "title": str, "parts": list})
        for part in section["parts"] if shape is None else ():
            kind = part.get("kind") if isinstance(part, dict) else None
            shape = shape or (f"has a part of kind {kind!r}" if kind not in _PART_FIELDS else
                              _shape_problem(part, _PART_FIELDS[kind]))
        if shape:
            return f"section {i} {shape}"
    return None


def _parts(document: dict, sid: str) -> list[dict]:
    return next((s["parts"] for s in document["sections"] if s["id"] == sid), [])


def _figures(bundle: Bundle, document: dict) -> tuple[dict[str, bytes], list[str]]:
    """The SVG bytes of each figure report.json names that hash as it says (by name), and a finding per figure
    missing or not as named. report.html holds each figure's text inline, so it is rendered again only when every
    figure is as named (`_check_rendering`); a figure that is not already has its finding."""
    figures, problems = {}, []
    for part in (p for s in document["sections"] for p in s["parts"] if p["kind"] == "img"):
        name = f"{REPORT_DIR}/{figure_name(part['name'])}"
        path = bundle.folder / name
        if "/" in part["name"] or not _inside(name) or not path.is_file():
            problems.append(f"{REPORT_JSON} names figure {part['name']!r}, but the bundle holds no {name}")
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != part["sha256"]:
            problems.append(f"{name} is not the figure {REPORT_JSON} names (its SHA-256 differs)")
            continue
        figures[part["name"]] = data
    return figures, problems


def _check_rendering(bundle: Bundle, document: dict, figures: dict[str, bytes]) -> list[str]:
    """report.md and report.html are report.json rendered, byte for byte; a finding names the section that is not."""
    sections = document["sections"]
    renderings = [(REPORT_MD, render_markdown(document), [markdown_section(s) for s in sections])]
    if all(p["name"] in figures for s in sections for p in s["parts"] if p["kind"] == "img"):  # else _figures says
        renderings.append((REPORT_HTML, render_html(document, figures), [html_section(s, figures) for s in sections]))
    problems = []
    for name, want, parts in renderings:
        try:
            have = (bundle.folder / name).read_text()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{name} cannot be read ({type(e).__name__})")
            continue
        if have != want:
            sid = next((s["id"] for s, text in zip(sections, parts) if text not in have), None)
            problems.append(f"{name}: the {sid} section is not what {REPORT_JSON} states" if sid else
                            f"{name} is not the rendering of {REPORT_JSON} (its title or layout differs)")
    return problems


def _check_stated(bundle: Bundle, document: dict) -> list[str]:
    """report.json's stated tables hold the rows the bundled step's files give (headers are wording: not compared)."""
    expected = stated_tables(bundle.experiment, read_run(bundle.step_dir(TRAIN_STEP), {}))
    stated, problems = json_tables(document), []
    for sid in STATED:
        rows, got = expected.get(sid, []), stated.get(sid, [])
        bad = next((i for i in range(max(len(rows), len(got))) if i >= len(rows) or i >= len(got)
                    or rows[i] != got[i]), None)
        if bad is not None:
            want = " | ".join(map(str, rows[bad])) if bad < len(rows) else "no row"
            have = " | ".join(map(str, got[bad])) if bad < len(got) else "no row"
            problems.append(f"{REPORT_JSON}: the {sid} table does not state the bundled metrics' numbers: row "
                            f"{bad} reads '{have}', the metrics give '{want}'")
    return problems


def _check_amendments(bundle: Bundle, document: dict) -> list[str]:
    """The amendments section states each amendment on the bundled ledger (its record, reason and diff), no other."""
    parts = _parts(document, "amendments")
    amendments = {a.seq: a for a in bundle.experiment.amendments}
    named = sorted({p["record"] for p in parts if "record" in p}, key=str)
    if named != sorted(amendments, key=str):
        return [f"{REPORT_JSON}: the amendments section names record(s) {named or 'none'}, but the bundled ledger "
                f"holds amendment record(s) {sorted(amendments) or 'none'}"]
    problems = [f"{REPORT_JSON}: the amendments section holds a part that names no amendment record"
                for p in parts if amendments and "record" not in p]
    for part in (p for p in parts if "record" in p):
        body = amendments[part["record"]].body
        stated = (part["text"] == body.get("diff") if part["kind"] == "pre" else
                  str(part["record"]) in part["text"] and str(body.get("reason")) in part["text"])
        if not stated:
            problems.append(f"{REPORT_JSON}: the amendments section misstates amendment record {part['record']} "
                            "(its reason, record or diff)")
    return problems


def _check_head(bundle: Bundle, document: dict) -> list[str]:
    """The ledger head the reproducibility table names is on the bundled chain; its config hash is the bundled one's."""
    facts = {key: row[1] for part in _parts(document, "reproducibility") if part["kind"] == "table"
             for key, row in zip(part.get("keys", ()), part["rows"]) if len(row) == 2}
    count = re.match(r"(\d+)", str(facts.get("ledger_records", "")))
    head = facts.get("ledger_head")
    if count is None or head is None:
        return [f"{REPORT_JSON} states no ledger head (its reproducibility table lacks it)"]
    links = {link["seq"]: link["hash"] for link in _read_records(bundle.folder / CHAIN)}
    problems, seq = [], int(count.group(1))
    if seq in links and links[seq] != head:
        problems.append(f"{REPORT_JSON} names ledger head {str(head)[:16]}... at record {seq}, which is not that "
                        f"record's hash on the chain in {CHAIN}")
    config = bundle.step_dir(TRAIN_STEP) / CONFIG
    if config.is_file() and facts.get("config_sha256") != sha256_file(config):
        problems.append(f"{REPORT_JSON} names another {CONFIG} sha256 than the bundled steps/{TRAIN_STEP}/{CONFIG}'s")
    return problems


def _check_report(bundle: Bundle) -> list[str]:
    """report.json states what the bundle's files and records hold; report.md and report.html are its renderings."""
    if TRAIN_STEP not in bundle.info.get("steps", {}):
        return [f"{INFO} names no {TRAIN_STEP} step, whose run the report describes"]
    try:
        document = json.loads((bundle.folder / REPORT_JSON).read_text())
    except (OSError, ValueError) as e:
        return [f"{REPORT_JSON} is missing or not JSON ({type(e).__name__}): the report cannot be checked"]
    shape = _document_problem(document)
    if shape:
        return [f"{REPORT_JSON} {shape}: the report cannot be checked"]
    figures, problems = _figures(bundle, document)
    for check in (_check_stated, _check_amendments, _check_head):
        problems += check(bundle, document)
    return problems + _check_rendering(bundle, document, figures)


# ----------------------------------------------------------------------------------------------
# all of it


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
