"""`moelab lab`: pre-register, amend, show, verify and run experiments.

    moelab lab register experiments/demo-spec.yaml --markdown     # paste the Markdown into the issue
    moelab lab show demo-tiny
    moelab lab show demo-tiny --diff demo-tiny-lr                 # what two experiments differ in
    moelab lab amend demo-tiny experiments/demo-spec.yaml --reason "600 steps: 300 ended mid-decay"
    moelab lab run demo-tiny --dry-run                            # what would run, resume, wait or skip
    moelab lab run demo-tiny --backend ray --address 10.0.0.5:6379  # on a running Ray cluster
    moelab lab verify                                             # recompute the hash chain
    moelab lab verify --head 3f2a9c0e51b7                         # is a published head still in it?
    moelab lab report demo-tiny                                   # HTML + Markdown report of the run
    moelab lab site --root runs/lab --out site                    # one static site of every experiment
    moelab lab run demo-tiny --site site                          # ... its pages rebuilt after each eval
    moelab lab abandon demo-tiny --reason "budget moved to ..."   # stays on the record as abandoned
    moelab lab export demo-tiny --out demo-tiny.tar.gz            # a bundle anyone can check (cli/bundle.py)
    moelab lab verify demo-tiny.tar.gz                            # its hashes, chain and report numbers
    moelab lab reproduce demo-tiny.tar.gz --steps-fraction 0.1    # rerun at the recorded commit; compare

Every command takes --ledger PATH (default: $MOELAB_LEDGER, else lab/ledger.sqlite). Commands that
write (register, amend, run) refuse a ledger whose chain is broken. Exit codes: 0 success; 1 a step
failed, the chain is broken or a published head is gone; 2 bad input (an invalid or edited spec, an
unknown id, a file that is not a ledger, writing to a broken chain); 75 a training step was preempted
(SIGTERM / SIGINT) after saving a checkpoint: rerun the same `moelab lab run` to resume it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from moelab.cli.bundle import export, reproduce, verify_bundle_command
from moelab.cli.common import (DEFAULT_LEDGER, EXIT_PREEMPTED, JsonOpt, LedgerOpt, err_console, out_console,
                               print_problem)
from moelab.cli.train import training_progress
from moelab.errors import ConfigError
from moelab.lab import registry
from moelab.lab.dag import FAILED, PREEMPTED, SUCCESS, check_backend
from moelab.lab.experiment import plan_experiment, run_experiment
from moelab.lab.ledger import ChainCheck, Record, check_chain, find_record, open_ledger, verify as verify_chain

lab_app = typer.Typer(no_args_is_help=True, add_completion=False,
                      help="Pre-register, run and audit experiments: the open lab's record.")
lab_app.command("export")(export)
lab_app.command("reproduce")(reproduce)
IdArg = Annotated[str, typer.Argument(help="The experiment id, e.g. demo-tiny.", show_default=False)]
SpecArg = Annotated[Path, typer.Argument(help="An experiment spec YAML, e.g. experiments/demo-spec.yaml.",
                                         show_default=False)]
MarkdownOpt = Annotated[bool, typer.Option("--markdown", help="Print issue-ready Markdown.")]


def _record_json(record: Record) -> dict:
    return dataclasses.asdict(record)


def _experiment_json(experiment: registry.Experiment) -> dict:
    return {"id": experiment.id, "spec_hash": experiment.spec_hash, "spec": experiment.spec_data,
            "registration": _record_json(experiment.registration),
            "amendments": [_record_json(r) for r in experiment.amendments],
            "runs": [_record_json(r) for r in experiment.runs]}


def _chain_json(check: ChainCheck) -> dict:
    return {**dataclasses.asdict(check), "ok": check.ok}


def _records(n: int) -> str:
    return f"{n} record" if n == 1 else f"{n} records"


def _ledger_sentence(path: Path, check: ChainCheck) -> str:
    """The record count and head hash `lab show` prints: what a reader keeps to detect a truncation later."""
    if not check.ok:
        return (f"{path}: {check.status}: {check.problem}; the {_records(check.num_records)} before it end in "
                f"sha256 `{check.head_hash}`. Run `moelab lab verify --ledger {path}`.")
    return (f"{path} holds {_records(check.num_records)} ({check.status}); head sha256 `{check.head_hash}`. "
            f"`moelab lab verify --head {check.head_hash[:16]}` shows later that these records are still there.")


def _plain(obj: Any) -> Any:
    data = dataclasses.asdict(obj)
    return {k: str(v) if isinstance(v, Path) else v for k, v in data.items()}


@lab_app.command()
def register(spec: SpecArg, ledger: LedgerOpt = DEFAULT_LEDGER, markdown: MarkdownOpt = False,
             json_out: JsonOpt = False) -> None:
    """Pre-register an experiment: store its spec, content hash, git commit and time in the ledger.

    The spec is immutable from then on; record changes with `moelab lab amend`.
    """
    registry.parse_spec(registry.read_spec_file(spec), f"spec {spec}")  # before a new ledger file is made
    experiment = registry.register(open_ledger(ledger, create=True), spec)
    if json_out:
        print(json.dumps(_experiment_json(experiment)))
    elif markdown:
        print(registry.to_markdown(experiment), end="")
    else:
        reg = experiment.registration
        commit = (reg.body["git_commit"] or "none")[:12]
        out_console.print(f"Registered [bold]{experiment.id}[/] as record {reg.seq} of {ledger} "
                          f"(spec sha256 {experiment.spec_hash[:12]}, git {commit}).", highlight=False, soft_wrap=True)
        err_console.print(f"Next: `moelab lab run {experiment.id} --dry-run`; `moelab lab show {experiment.id} "
                          "--markdown` gives the text for the experiment's issue.", highlight=False, soft_wrap=True)


@lab_app.command()
def amend(
    exp_id: IdArg,
    spec: SpecArg,
    reason: Annotated[str, typer.Option("--reason", help="Why the spec changes, e.g. \"300 steps ended "
                                                        "mid-decay; run 600\".", show_default=False)],
    ledger: LedgerOpt = DEFAULT_LEDGER,
    json_out: JsonOpt = False,
) -> None:
    """Record a change to a registered spec: the diff and the reason go on the ledger."""
    experiment = registry.amend(open_ledger(ledger), exp_id, spec, reason)
    record = experiment.amendments[-1]
    if json_out:
        print(json.dumps(_record_json(record)))
        return
    out_console.print(f"Amended [bold]{exp_id}[/] (record {record.seq}); changed: "
                      f"{', '.join(record.body['changes'])}.", highlight=False)
    print(record.body["diff"], end="")


@lab_app.command()
def show(exp_id: IdArg, ledger: LedgerOpt = DEFAULT_LEDGER, markdown: MarkdownOpt = False,
         json_out: JsonOpt = False,
         diff: Annotated[Optional[str], typer.Option("--diff", show_default=False, help=(
             "Another experiment's id: show only what the two differ in (spec, resolved config, outcome)."))] = None,
         ) -> None:
    """Show an experiment as registered, with its amendments and runs, and the ledger's head hash."""
    book = open_ledger(ledger)
    if diff is not None:
        _show_diff(book, exp_id, diff, markdown, json_out)
        return
    experiment = registry.load_experiment(book, exp_id)
    check = verify_chain(book)
    if json_out:
        print(json.dumps({**_experiment_json(experiment), "ledger": {"path": str(ledger), **_chain_json(check)}}))
    elif markdown:
        print(registry.to_markdown(experiment, with_runs=True) + f"\n### Ledger\n\n{_ledger_sentence(ledger, check)}")
    else:
        trust = _verdict_and_trust(experiment)
        if trust:  # first: a finished experiment's outcome before its spec and every record (issue 62)
            out_console.print(trust + "\n", highlight=False)
        out_console.print(Markdown(registry.to_markdown(experiment, with_runs=True)))
        # Plain and unwrapped: the hash must survive a narrow terminal and a copy-paste whole.
        out_console.print(f"\n{_ledger_sentence(ledger, check)}", markup=False, highlight=False, soft_wrap=True)


def _verdict_and_trust(experiment) -> str | None:
    """Once the main run finished: its verdict with the ladder prediction's trust beside it (issue 54), one line."""
    from moelab.ladder.contract import trust_text  # scipy, through the ladder: only when showing a finished run
    from moelab.lab.view import experiment_verdict

    try:
        verdict, value, trust = experiment_verdict(experiment)
    except ConfigError:  # not run yet, or its directory is gone: the record above says which
        return None
    return f"{verdict_sentence(verdict, experiment.spec.prediction.metric, value)}. {trust_text(trust, verdict)}"


def verdict_sentence(verdict: str, metric: str, value: float | None, label: str = "Verdict") -> str:
    """'Verdict: CONFIRMED (eval/mean = 1.8035)': the one form the demo and `lab show` print it in."""
    observed = "no value" if value is None else f"{value:.4f}"
    return f"{label}: {verdict.upper()} ({metric} = {observed})"


def _show_diff(book, exp_id: str, other: str, markdown: bool, json_out: bool) -> None:
    from moelab.lab import compare  # reads run directories (scipy, through the ladder's reader): only when asked

    result = compare.compare_experiments(book, exp_id, other)
    if json_out:
        print(json.dumps(compare.to_json(result)))
    elif markdown:
        print(compare.to_markdown(result), end="")
    else:
        out_console.print(Markdown(compare.to_markdown(result)))


@lab_app.command()
def verify(
    bundle: Annotated[Optional[Path], typer.Argument(metavar="BUNDLE", show_default=False, help=(
        "A bundle from `moelab lab export` (folder or .tar.gz) to check alone, instead of the ledger."))] = None,
    ledger: LedgerOpt = DEFAULT_LEDGER,
    head: Annotated[Optional[str], typer.Option("--head", show_default=False, help=(
        "A head hash published earlier (by `lab verify`, `lab show` or a report), in full or its first 12+ hex "
        "digits, e.g. --head 3f2a9c0e51b7: fail (exit 1) unless that record is still in the chain."))] = None,
    json_out: JsonOpt = False,
) -> None:
    """Recompute the ledger's hash chain, or check a BUNDLE; name what is broken (exit 1) if anything is.

    With --head, also prove that a published head is still in the chain: rows cut off the end (or
    rewritten) leave a valid but shorter chain that only a head kept elsewhere can expose. With BUNDLE:
    every file's SHA-256, its records and their chain up to the head it states, and that its report's
    numbers are its metrics'.
    """
    if bundle is not None:
        return verify_bundle_command(bundle, head, json_out)
    book = open_ledger(ledger)
    check = verify_chain(book)
    found = find_record(book, head, up_to=check.num_records) if head is not None else None
    head_gone = head is not None and found is None
    if json_out:
        result = {"ledger": str(ledger), **_chain_json(check)}
        if head is not None:
            result["published_head"] = {"hash": head, "found": found is not None,
                                        "seq": found.seq if found else None,
                                        "records_after": check.num_records - found.seq if found else None}
            result["ok"] = check.ok and not head_gone
        print(json.dumps(result))
    elif not check.ok:
        print_problem("Broken", f"{ledger}: {check.problem}. The {check.num_records} records before it check out.")
    elif head_gone:
        print_problem("Head not found", f"no record of {ledger} has hash {head}. The chain is intact but ends "
                      f"elsewhere ({check.num_records} records, head sha256 {check.head_hash}): rows were cut off "
                      "the end, or the ledger was rewritten, after that head was published. Restore the ledger "
                      "from a copy that holds it.")
    else:
        out_console.print(f"{escape(str(ledger))}: {check.num_records} records, chain intact. Head sha256 "
                          f"{check.head_hash}", highlight=False, soft_wrap=True)
        if found is not None:
            out_console.print(f"The published head {found.hash[:16]}... is record {found.seq}: "
                              f"{_records(check.num_records - found.seq)} came after it.", highlight=False,
                              soft_wrap=True)
    if not check.ok or head_gone:
        raise typer.Exit(1)


@lab_app.command()
def run(
    exp_id: IdArg,
    ledger: LedgerOpt = DEFAULT_LEDGER,
    spec: Annotated[Optional[Path], typer.Option("--spec", help="The spec file to check against the record "
                                                              "(default: the one registered or last amended).")] = None,
    root: Annotated[Path, typer.Option("--root", help="Step outputs go to ROOT/ID/<step>-<hash8>.")] = Path("runs/lab"),
    backend: Annotated[str, typer.Option("--backend", help="local, or ray (joins --address or RAY_ADDRESS if set, "
                                                          "else starts a local cluster).")] = "local",
    address: Annotated[Optional[str], typer.Option("--address", show_default=False, help=(
        "With --backend ray: the Ray cluster to run on, HOST:PORT as `ray start --head` printed it, e.g. "
        "10.0.0.5:6379. Checked first: one that does not answer exits 2."))] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would run, resume, wait or skip; "
                                                          "run nothing.")] = False,
    json_out: JsonOpt = False,
    publish: Annotated[Optional[str], typer.Option(
        help="Copy each training step's mixture log, metrics, incidents, summary and the ledger's export to this "
             "URL (s3://, gs://) or folder as it trains, then the report, each file a complete object.")] = None,
    publish_every: Annotated[float, typer.Option(help="Seconds between publications (with --publish).")] = 3600.0,
    site: Annotated[Optional[Path], typer.Option(
        "--site", help="Keep this static site (`moelab lab site`) up to date as the experiment runs: its pages are "
                       "rebuilt at each step's start and end and, on the local backend, after each eval, e.g. "
                       "--site site.")] = None,
) -> None:
    """Execute a registered experiment's DAG; refused if its spec file was edited without an amendment."""
    check_backend(backend, address)
    book = open_ledger(ledger)
    check_chain(book)  # a dry run too: on a broken chain nothing would run
    planned = plan_experiment(book, exp_id, root, spec)
    if dry_run:
        if json_out:
            print(json.dumps([_plain(p) for p in planned]))
            return
        table = Table("step", "action", title=f"{exp_id}: dry run")
        table.add_column("directory", overflow="fold")
        table.add_column("reason")
        for p in planned:
            table.add_row(p.name, p.action, str(p.output_dir), p.reason)
        out_console.print(table)
        return
    todo = [f"{p.name} (resume)" if p.action == "resume" else p.name for p in planned if p.action != "skip"]
    err_console.print(f"{exp_id}: running {', '.join(todo) or 'nothing (all done)'} on the {backend} backend.",
                      highlight=False)
    # Local steps train in this process and show each one's progress bar; Ray workers train quietly.
    if publish is not None:
        from moelab.train.publish import Publisher

        Publisher(root, publish, publish_every).check()  # unreachable or refused: exit 2 before anything runs
    on_change = None
    if site is not None:  # the pages of this experiment (and the index, timeline) after each event and eval
        from moelab.lab import site as site_lib

        def on_change() -> None:
            site_lib.build_site(book, root, site, only=exp_id)

        on_change()  # the index names the experiment as it starts
    outcomes = run_experiment(book, exp_id, root, spec, backend, progress=training_progress,
                              publish=None if publish is None else (publish, publish_every), address=address,
                              on_change=on_change)
    if json_out:
        print(json.dumps([_plain(o) for o in outcomes]))
    if publish is not None and all(o.status == SUCCESS for o in outcomes):
        _publish_report(book, exp_id, publish)
    show_outcomes(exp_id, outcomes, table=not json_out)


@lab_app.command("site")
def site_command(
    root: Annotated[Path, typer.Option("--root", help="Where the experiments' steps ran (`moelab lab run --root`); "
                                                      "a predicted band is read from there.")] = Path("runs/lab"),
    out: Annotated[Path, typer.Option("--out", help="The site's folder, e.g. site; brought up to date in place.")]
    = Path("site"),
    ledger: LedgerOpt = DEFAULT_LEDGER,
    publish: Annotated[Optional[str], typer.Option(
        "--publish", help="Then copy the site to this URL (s3://bucket/lab, gs://..., any fsspec URL) or folder, only "
                          "the files that changed since the last publication.", show_default=False)] = None,
    bundles: Annotated[bool, typer.Option(help="Put each ended experiment's bundle (`lab export`) in the site.")]
    = True,
    json_out: JsonOpt = False,
) -> None:
    """Write one static site of every experiment: an index, a page each, a timeline; offline, no script."""
    from moelab.lab.site import INDEX, build_site, counted, publish_site

    book = open_ledger(ledger)
    built = build_site(book, root, out, bundles=bundles)
    copied = publish_site(out, publish) if publish is not None else None
    if json_out:
        print(json.dumps({"out": str(out), "experiments": built.num_experiments, "written": built.written,
                          "unchanged": built.unchanged, "head_seq": built.head_seq, "head_hash": built.head_hash,
                          "published": copied}))
        return
    out_console.print(f"{out / INDEX}: {counted(built.num_experiments, 'experiment')}, "
                      f"{counted(len(built.written), 'file')} written, "
                      f"{built.unchanged} unchanged; ledger head record {built.head_seq} ({built.head_hash[:16]}...).",
                      highlight=False, soft_wrap=True)
    if copied is not None:
        out_console.print(f"Published to {publish}: {counted(len(copied), 'changed file')} and site.json.", highlight=False,
                          soft_wrap=True)


@lab_app.command()
def abandon(
    exp_id: IdArg,
    reason: Annotated[str, typer.Option("--reason", help="Why the experiment stops, e.g. \"budget moved to the "
                                                        "replanned run\".", show_default=False)],
    ledger: LedgerOpt = DEFAULT_LEDGER,
) -> None:
    """Record that an experiment is abandoned and why; it stays on the record (report, site) as abandoned."""
    record = registry.abandon(open_ledger(ledger), exp_id, reason)
    out_console.print(f"Abandoned [bold]{escape(exp_id)}[/] (record {record.seq}): {escape(reason.strip())}",
                      highlight=False)


def _publish_report(book, exp_id: str, destination: str) -> None:
    """The finished experiment's report (HTML, Markdown, plots) and the whole ledger's export, its last record
    the run's `finished`, to DESTINATION/report/."""
    from moelab.data.remote import join, publish
    from moelab.lab.ledger import export_jsonl
    from moelab.lab.report import write_report

    html = write_report(book, exp_id)
    export_jsonl(book, html.parent / "ledger.jsonl")
    for path in sorted(html.parent.iterdir()):
        if path.is_file():
            publish(path, join(destination, "report", path.name))


def show_outcomes(exp_id: str, outcomes: list, table: bool = True) -> None:
    """Print a DAG's step outcomes; exit 1 naming the failed steps if any step did not succeed.

    Preempted steps (and no failed one) exit 75 instead, like `moelab train`: rerunning the same
    command (`moelab lab run` or `moelab demo`) resumes them.
    """
    if table:
        rows = Table("step", "outcome", "status", title=exp_id)
        rows.add_column("directory", overflow="fold")
        rows.add_column("error")
        for o in outcomes:
            rows.add_row(o.name, o.action, o.status or "-", str(o.output_dir), o.error or "")
        out_console.print(rows)
    if all(o.status == SUCCESS for o in outcomes):
        return
    failed = [o.name for o in outcomes if o.status == FAILED]
    preempted = [o for o in outcomes if o.status == PREEMPTED]
    stopped = ", ".join(f"{o.name} at step {o.preempted_at}" for o in preempted)
    if preempted and not failed:  # nothing is lost: the same command picks up where each one stopped
        rerun = shlex.join(["moelab", *sys.argv[1:]])
        print_problem("Preempted", f"{stopped}, after saving a checkpoint. Rerun `{rerun}` to resume in place; "
                      "the steps downstream run then.", style="bold yellow")
        raise typer.Exit(EXIT_PREEMPTED)
    also = f" Preempted (resumes on the next run): {stopped}." if preempted else ""
    print_problem("Failed", f"{', '.join(failed) or 'blocked steps'}; see step.json in its directory and "
                  f"`moelab lab show {exp_id}`.{also}")
    raise typer.Exit(1)


@lab_app.command()
def report(
    exp_id: IdArg,
    ledger: LedgerOpt = DEFAULT_LEDGER,
    out: Annotated[Optional[Path], typer.Option("--out", help="Directory for report.html and report.md "
                                                             "(default: the run's directory / report).")] = None,
) -> None:
    """Write an experiment's report (self-contained HTML and Markdown) and print the HTML path."""
    from moelab.lab.report import write_report  # scipy (the ladder's prediction reader): only for this command

    print(write_report(open_ledger(ledger), exp_id, out))
