"""An experiment's portable bundle: everything an outsider needs to check it, and to rerun it.

    export_bundle(ledger, "demo-ladder", "demo-ladder.tar.gz")   # `moelab lab export ID --out BUNDLE`
    with open_bundle("demo-ladder.tar.gz") as folder:               # `moelab lab verify BUNDLE`
        check = verify_bundle(folder)                               # `lab.verify`: check.problems == [] when it holds

This module writes bundles and opens them; `lab.verify` checks one. A bundle is a folder (or the same
folder as a `.tar.gz`):

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
    report/                report.json (the sections as stated), report.md, report.html and the plots (.svg),
                           written at export (`lab.report`)
    MANIFEST.sha256        the SHA-256 of every other file, `sha256sum -c` format

Format version 2 added report/report.json, from which `lab verify` re-renders the report; version 3 holds
the report's figures as SVG (version 2's were PNG). Older bundles are refused by `lab.verify.load_bundle`,
naming the format: export them again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from moelab.data.store import read_manifest
from moelab.errors import ConfigError, DataError
from moelab.files import sha256_file
from moelab.lab.dag import SUCCESS, read_status
from moelab.lab.experiment import LEDGER_EXPORT
from moelab.lab.ledger import Ledger, Record, canonical_json, record_line, records, verify
from moelab.lab.registry import TRAIN_STEP, Experiment, load_experiment
from moelab.train.outputs import DATA

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "INFO", "RECORDS", "CHAIN", "TAR_SUFFIX", "REPORT_DIR", "Exported",
           "finished_steps", "spec_files", "spec_text", "export_bundle", "open_bundle"]

FORMAT, FORMAT_VERSION = "moelab-bundle", 3
MANIFEST, INFO = "MANIFEST.sha256", "bundle.json"
RECORDS, CHAIN = "ledger/records.jsonl", "ledger/chain.jsonl"
TAR_SUFFIX = ".tar.gz"
REPORT_DIR = "report"
# What stays behind: checkpoints and W&B (large), the report (rewritten at export), and a published run's export
# of the whole ledger (other experiments' records; the bundle holds this one's).
_SKIPPED_ENTRIES = ("checkpoints", "wandb", REPORT_DIR, LEDGER_EXPORT)


# ----------------------------------------------------------------------------------------------
# export


def finished_steps(experiment: Experiment) -> dict[str, Record]:
    """Each step's newest `finished` (or `skipped`, by a later run) ledger record, by step name."""
    found: dict[str, Record] = {}
    for record in experiment.runs:
        if record.body.get("event") in ("finished", "skipped") and record.body.get("output_dir"):
            found[record.body["step"]] = record
    return found


def spec_files(experiment: Experiment) -> dict[str, Record]:
    files = {"spec/registered.yaml": experiment.registration}
    files.update({f"spec/amendment-{n}.yaml": a for n, a in enumerate(experiment.amendments, 1)})
    return files


def spec_text(record: Record) -> str:
    """A spec file's text in a bundle: one writer, so `lab.verify` can compare the bytes too."""
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
    from moelab.lab.report import write_report  # scipy (via `view`): only for a bundle (`moelab` starts without)

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
    for name, record in spec_files(experiment).items():
        (folder / name).write_text(spec_text(record))
    step_info, unreachable = {}, []
    for name, record in steps.items():
        unreachable += _copy_step(Path(record.body["output_dir"]), folder / "steps" / name)
        step_info[name] = {"dir": f"steps/{name}", "version": record.body["version"],
                           "record": {"seq": record.seq, "hash": record.hash},
                           "git_commit": record.body.get("git_commit"), "git_dirty": record.body.get("git_dirty")}
    write_report(ledger, exp_id, folder / REPORT_DIR)
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
