"""`moelab lab export | verify BUNDLE | reproduce`: hand an experiment over, check it, rerun it (cli/lab.py
registers these under `moelab lab`).

    moelab lab export demo-ladder --out demo-ladder.tar.gz     # a folder, or .tar.gz by the name
    moelab lab verify demo-ladder.tar.gz                       # every hash, the chain, the report's numbers
    moelab lab reproduce demo-ladder.tar.gz --steps-fraction 0.1
    moelab lab reproduce demo-ladder                           # an id on --ledger: exported, then rerun

`lab verify BUNDLE` exits 1 naming each changed, missing or unlisted file, broken record or report
number. `lab reproduce` exits 1 when a step differs, 2 when it refuses (a bundle that fails
verification, a commit the repository lacks, uncommitted changes, a bad --set): nothing is run or
recorded then.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Annotated, Iterator

import typer
from rich.table import Table

from moelab.cli.common import DEFAULT_LEDGER, JsonOpt, LedgerOpt, SetOpt, err_console, out_console, print_problem
from moelab.config import parse_overrides
from moelab.errors import ConfigError
from moelab.lab.bundle import MANIFEST, export_bundle, open_bundle
from moelab.lab.ledger import open_ledger

__all__ = ["export", "verify_bundle_command", "reproduce"]



def export(
    exp_id: Annotated[str, typer.Argument(help="The experiment id, e.g. demo-tiny.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="The bundle to write: a new folder, or a .tar.gz, e.g. "
                                                    "--out demo-tiny.tar.gz.", show_default=False)],
    ledger: LedgerOpt = DEFAULT_LEDGER,
    json_out: JsonOpt = False,
) -> None:
    """Write an experiment's bundle: spec and amendments, its ledger records and chain, each step's config,
    commit, metrics, incidents, mixture log, prediction and data-store manifest, the report, and a manifest
    of SHA-256 hashes of every file. Check it anywhere with `moelab lab verify BUNDLE`."""
    exported = export_bundle(open_ledger(ledger), exp_id, out)
    head = exported.info["ledger"]
    if json_out:
        print(json.dumps({"bundle": str(exported.path), "manifest_sha256": exported.manifest_sha256,
                          "num_files": exported.num_files, "ledger": head, "steps": exported.info["steps"]}))
        return
    num_steps = len(exported.info["steps"])
    out_console.print(f"Wrote {exported.path}: {exported.num_files} files, {num_steps} step{'s' * (num_steps != 1)} of "
                      f"{exp_id}, ledger head {head['head_hash']} (record {head['num_records']}). {MANIFEST} sha256 "
                      f"{exported.manifest_sha256}", highlight=False, soft_wrap=True)
    for store in exported.info["unreachable_stores"]:
        print_problem("Warning", f"the token store {store} could not be read, so its manifest is not in the "
                      "bundle; its content hash is still in the steps' data.json.", style="bold yellow")
    err_console.print(f"Next: `moelab lab verify {exported.path}`, or `moelab lab reproduce {exported.path} "
                      "--steps-fraction 0.1`.", highlight=False, soft_wrap=True)


def verify_bundle_command(bundle: Path, head: str | None, json_out: bool) -> None:
    """`moelab lab verify BUNDLE`: the bundle alone, without the ledger it came from."""
    if head is not None:
        raise ConfigError("--head checks a ledger, not a bundle: `moelab lab verify BUNDLE` prints the ledger head "
                          "the bundle links up to; compare that, or run `moelab lab verify --ledger L --head HASH` "
                          "where the ledger is.")
    from moelab.lab.verify import verify_bundle  # re-renders the report: scipy only for this command

    with open_bundle(bundle) as folder:
        check = verify_bundle(folder)
    if json_out:
        print(json.dumps({"bundle": str(bundle), "ok": check.ok, "problems": check.problems,
                          "manifest_sha256": check.manifest_sha256, "num_files": check.num_files,
                          "num_records": check.num_records, "head_hash": check.head_hash}))
    elif check.ok:
        out_console.print(f"{bundle}: {check.num_files} files match {MANIFEST}; {check.num_records} ledger records "
                          f"recompute and link up to ledger head {check.head_hash}; the report's numbers are the "
                          f"metrics'. {MANIFEST} sha256 {check.manifest_sha256}", highlight=False, soft_wrap=True)
    else:
        print_problem("Bundle fails verification", f"{bundle}: {len(check.problems)} problem(s). Get the bundle "
                      "again from its source, or re-export it from the ledger.")
        for problem in check.problems:
            err_console.print(f"- {problem}", markup=False, highlight=False, soft_wrap=True)
    if not check.ok:
        raise typer.Exit(1)


@contextlib.contextmanager
def _bundle_of(source: str, ledger: Path) -> Iterator[Path]:
    """A bundle's folder: `source` itself when it is a path, else the experiment `source` of `ledger`, exported
    into a temporary folder for the block."""
    if Path(source).exists():
        with open_bundle(Path(source)) as folder:
            yield folder
        return
    book = open_ledger(ledger)
    with tempfile.TemporaryDirectory(prefix="moelab-export-") as tmp:
        err_console.print(f"{source} is not a path: exporting experiment {source} of {ledger} first.", highlight=False)
        yield export_bundle(book, source, Path(tmp) / source).path


def reproduce(
    bundle_or_id: Annotated[str, typer.Argument(show_default=False, help=(
        "A bundle (folder or .tar.gz from `moelab lab export`), or an experiment id on --ledger."))],
    steps_fraction: Annotated[float, typer.Option("--steps-fraction", help=(
        "Rerun the first F of each run's steps (same schedule, stopped early), e.g. 0.1: a cheap check."))] = 1.0,
    ledger: LedgerOpt = DEFAULT_LEDGER,
    sets: SetOpt = None,
    same_env: Annotated[bool, typer.Option("--same-env", help=(
        "At another commit, run its worktree with this environment's packages instead of installing its own "
        "(minutes): right when the dependencies did not change."))] = False,
    json_out: JsonOpt = False,
) -> None:
    """Rerun an experiment's training steps at the recorded commit and configs and compare with the record.

    Per step: reproduced (bitwise, and the final weights' hash for a whole run), within noise (the losses
    within the run-to-run spread the record states) or differs (the first diverging step and metric).
    The result goes on --ledger as a record pointing at the original runs; exit 1 if a step differs.
    """
    from moelab.cli.train import training_progress
    from moelab.lab.reproduce import DIFFERS, reproduce as rerun, spans

    overrides = parse_overrides(sets or [])
    with _bundle_of(bundle_or_id, ledger) as folder:
        result = rerun(folder, ledger, steps_fraction, overrides, same_env=same_env,
                       progress=None if json_out else training_progress)
    if json_out:
        print(json.dumps({"experiment": result.experiment, "verdict": result.verdict, "commit": result.commit,
                          "where": result.where, "same_platform": result.same_platform, "run_sd": result.run_sd,
                          "record": {"seq": result.record.seq, "hash": result.record.hash}, "notes": result.notes,
                          "steps": {c.name: {**c.to_json(), "per_step": c.per_step} for c in result.steps}}))
    else:
        table = Table("step", "verdict", "rerun", "final weights", "first difference",
                      title=f"{result.experiment}: reproduction at {result.commit[:12]}")
        for c in result.steps:
            first = c.first_difference
            table.add_row(c.name, c.verdict, f"{c.until} of {c.steps} steps", c.params,
                          "—" if first is None else f"step {first['step']}: {first['metric']} {first['recorded']} "
                                                    f"recorded, {first['reproduced']} now")
        out_console.print(table)
        for c in result.steps:
            held = "" if c.run_sd is None else f" (losses held to run sd {c.run_sd:.4g} at its size)"
            out_console.print(f"{c.name} ({len(c.per_step)} logged steps{held}): {spans(c)}", highlight=False,
                              soft_wrap=True)
        platform = {None: "the record states no platform", True: "same platform as recorded",
                    False: "another platform than recorded"}[result.same_platform]
        noise = ("no run-to-run noise stated" if result.run_sd is None else
                 f"stated run-to-run sd {result.run_sd:.4g}, scaled to each run's size")
        out_console.print(f"Verdict: {result.verdict} ({platform}; {noise}). Recorded as ledger record "
                          f"{result.record.seq} (sha256 {result.record.hash[:16]}...).", highlight=False,
                          soft_wrap=True)
        for note in result.notes:
            print_problem("Note", note, style="bold yellow")
    if result.verdict == DIFFERS:
        raise typer.Exit(1)
