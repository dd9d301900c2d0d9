"""The `moelab` command line: a table of contents of commands.

    moelab presets                                   list the named configs
    moelab flops --preset frontier-535b --json       parameter counts and training FLOPs
    moelab train --preset tiny --steps 100 --out runs/tiny --set train.lr=1e-3
    moelab train --preset tiny --mesh replica=2,expert=4    expert parallel over 2 x 4 devices
    moelab demo                                      the demo `make demo` runs

Exit codes: 0 success, 1 a run failed, 2 bad input (one paragraph on stderr naming the field, the
value and the fix; set MOELAB_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, Sequence

import typer
from rich.markup import escape
from rich.progress import ProgressColumn
from rich.table import Table
from rich.text import Text

from moelab import accounting, presets
from moelab._cli_utils import (EXIT_PREEMPTED, ConfigArg, JsonOpt, PresetOpt, SetOpt, err_console, out_console,
                               resolve_config)
from moelab.config import ConfigError, DataError, Preempted, RunConfig, load_yaml
from moelab.lab.cli import lab_app
from moelab.train.checkpoint import SaveFailed
from moelab.ladder.cli import ladder_app

if TYPE_CHECKING:
    from moelab.train.loop import Watcher

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Train Mixture-of-Experts LMs as an open lab.")
app.add_typer(lab_app, name="lab")
app.add_typer(ladder_app, name="ladder")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    err_console.print(f"[yellow]Warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


def main() -> None:
    """Entry point: runs the app and turns bad input into exit code 2 with one clear paragraph."""
    import warnings

    warnings.showwarning = _show_warning
    _flags_take_no_value()
    try:
        code = app(standalone_mode=False)  # returns a typer.Exit's code instead of raising it
        if code == 130:  # newer typer turns Ctrl-C (outside the training loop's own handler) into this code
            _aborted()
        if code:
            sys.exit(code)
    except SaveFailed as e:  # the run failed (exit 1), not its input; no traceback: the message says it all
        err_console.print(f"[bold red]Error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except Preempted as e:
        err_console.print(f"[bold yellow]Preempted:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_PREEMPTED)
    except (ConfigError, DataError) as e:
        if os.environ.get("MOELAB_DEBUG"):
            raise
        # escape: messages name fields like data.domains[code] and values like [6.0, 2.0], which Rich
        # would otherwise read as markup tags and drop.
        err_console.print(f"[bold red]Error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        _aborted()
    except Exception as e:
        if _is_usage_error(e):
            _name_the_bad_value(e)
            e.show()
            sys.exit(e.exit_code)
        raise


def _name_the_bad_value(e: Exception) -> None:
    """Add the rejected value to a parameter error: typer's pydantic coercion says what it wanted
    ("Input should be a valid integer") but not what it got (`--steps ten`)."""
    errors = getattr(e.__cause__, "errors", None)
    if callable(errors) and hasattr(e, "message"):
        given = [err["input"] for err in errors() if "input" in err]
        if given and repr(given[0]) not in e.message:
            e.message = f"{e.message} (got {given[0]!r})."


def _flags_take_no_value() -> None:
    """Show boolean flags (`--json`, `--help`) without a value placeholder in help texts.

    typer 0.29 labels them `<bool>`, which reads as if they took a value: `--json true` then
    passes `true` on as the next argument.
    """
    option = getattr(getattr(typer, "core", None), "TyperOption", None)
    if option is None or getattr(option, "_moelab_flags", False):
        return
    display = option.display_type_rich

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else display(self, ctx)

    option.display_type_rich, option._moelab_flags = display_type_rich, True


def _aborted() -> None:
    """Ctrl-C before or between training steps (the loop saves and exits 75 on its own): exit 130 now.

    A hard exit: interrupted while XLA compiles (loading, tracing), a normal interpreter shutdown
    crashed in XLA's threads (exit 139). Nothing is being written at that point.
    """
    err_console.print("Aborted.")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _is_usage_error(e: Exception) -> bool:
    """A command-line parsing error (click's, or the copy of click that newer typer releases bundle):
    it prints its own one-paragraph usage message and carries its exit code (2)."""
    import click

    bundled = getattr(getattr(typer, "_click", None), "exceptions", None)
    kinds = (click.ClickException, *((bundled.ClickException,) if bundled else ()))
    return isinstance(e, kinds)


@app.command("presets")
def presets_cmd(json_out: JsonOpt = False) -> None:
    """List the named configs, one line each."""
    rows = presets.describe()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    table = Table("preset", "description")
    for name, line in rows.items():
        table.add_row(name, line)
    out_console.print(table)


@app.command()
def flops(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    tokens: Annotated[Optional[float], typer.Option(
        help="Training tokens, e.g. 1e9 or 18.75e12 (default: steps x batch x sequence).")] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Parameter counts (total / active / embedding) and training FLOPs of a config."""
    cfg = resolve_config(config, preset, sets)
    if tokens is not None and not (tokens > 0 and float(tokens).is_integer()):
        raise ConfigError(f"--tokens={tokens:g} is invalid: must be a positive whole number of tokens, e.g. 1e9.")
    figures = accounting.summarize(cfg, None if tokens is None else int(tokens))
    if json_out:
        print(json.dumps(figures))
        return
    table = Table("figure", "value", title=cfg.name)
    for key, value in figures.items():
        table.add_row(key, f"{value:,.4g}" if isinstance(value, float) else f"{value:,}")
    out_console.print(table)


@app.command()
def train(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    sets: SetOpt = None,
    steps: Annotated[Optional[int], typer.Option(help="Training steps (overrides train.steps).")] = None,
    out: Annotated[Path, typer.Option(help="Output directory for config, metrics and summary.")] = Path("runs/train"),
    seed: Annotated[Optional[int], typer.Option(help="Seed for init and data order (overrides train.seed).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Save a checkpoint every N steps "
                                                                 "(overrides checkpoint.every).")] = None,
    mesh: Annotated[Optional[str], typer.Option(
        help="Device mesh, e.g. replica=2,expert=4: data parallel over replicas, experts sharded over `expert` "
             "devices (expert > 1 also selects the ep dispatch backend). Sets mesh.replica / mesh.expert.")] = None,
    predicted: Annotated[Optional[Path], typer.Option(
        help="A PRED.csv from `moelab ladder run/fit`: check each eval against its 95% band (off_track incidents).")] = None,
) -> None:
    """Train a model, or resume it if OUT already holds a checkpoint of the same run.

    Writes OUT/config.yaml, metrics.jsonl, incidents.jsonl, checkpoints/ and summary.json. Multi-host:
    start one process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set
    (or under Slurm / Open MPI); see the README.
    """
    from moelab.parallel.mesh import initialize_distributed, is_writer

    initialize_distributed()  # before anything touches a device; a no-op for one process
    cfg = resolve_config(config, preset, sets, **{"train.steps": steps, "train.seed": seed,
                                                  "checkpoint.every": checkpoint_every, **_mesh_fields(mesh)})
    watchers = []
    if predicted is not None:
        if not predicted.is_file():
            raise ConfigError(f"--predicted {predicted} does not exist; write it with `moelab ladder run` or "
                              "`ladder fit`.")
        from moelab.ladder.predict import load_on_track  # scipy: only when predictions are checked

        watchers.append(load_on_track(predicted))
    summary = run_training(cfg, out, watchers)
    if is_writer():  # every host returns the same summary; one prints it
        print(json.dumps(summary))


def _mesh_fields(spec: str | None) -> dict:
    """`--mesh replica=2,expert=4` as config overrides; expert > 1 also selects dispatch 'ep'."""
    if spec is None:
        return {}
    example = "e.g. --mesh replica=2,expert=4"
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("replica", "expert") or key in fields:
            raise ConfigError(f"--mesh {spec!r} must name replica and/or expert once each as key=value, {example}.")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh {key}={value!r} is invalid: must be an integer >= 1, {example}.") from None
    updates = {f"mesh.{key}": value for key, value in fields.items()}
    if fields.get("expert", 1) > 1:
        updates["model.moe.dispatch"] = "ep"
    return updates


def run_training(cfg: RunConfig, out: Path, watchers: Sequence[Watcher] = ()) -> dict:
    """Train with a Rich progress bar on stderr (process 0's only, on a multi-host run)."""
    from moelab.parallel import mesh as mesh_lib
    from moelab.train.loop import train

    mesh_lib.make_mesh(cfg.mesh)  # a mesh the devices cannot hold fails here, before a progress bar is drawn
    with training_progress(cfg) as hooks:
        return train(cfg, out, hooks, watchers=watchers)


class _StatusColumn(ProgressColumn):
    """The bar's status: the last loss and throughput, or the slow stage under way with its elapsed time."""

    def render(self, task) -> Text:
        since = task.fields.get("since")
        elapsed = f" {time.monotonic() - since:.0f} s" if since is not None else ""
        return Text(f"{task.fields['status']}{elapsed}")


@contextlib.contextmanager
def training_progress(cfg: RunConfig):
    """A progress bar for one training run (steps, loss, tokens/s) on stderr; yields the loop's Hooks.

    The bar appears with the first slow stage (a finished run that has nothing to do draws none),
    shows each stage before the first step ("compiling the train step 12 s"), and a resumed run
    says so on a line of its own. `moelab train`, `ladder run` and the local `lab run` / `demo`
    steps show it; process 0 only.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moelab.parallel import mesh as mesh_lib
    from moelab.train.loop import Hooks

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), _StatusColumn(), console=err_console, transient=False,
                        disable=not mesh_lib.is_writer())
    task = None

    def bar():
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task(escape(cfg.name), total=cfg.train.steps, status="", since=None)
        return task

    def on_stage(name: str) -> None:
        progress.update(bar(), status=name, since=time.monotonic())

    def on_resume(step: int, path: Path) -> None:
        progress.console.print(f"Resuming from step {step} ({escape(str(path))}).", highlight=False, soft_wrap=True)
        progress.update(bar(), completed=step)

    def on_log(record: dict) -> None:
        progress.update(bar(), status=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s", since=None)

    def on_step(done: int) -> None:
        if progress.tasks and progress.tasks[0].fields.get("since") is not None:  # the first step ends a stage
            progress.update(bar(), completed=done, status="training", since=None)
        else:
            progress.update(bar(), completed=done)

    try:
        yield Hooks(on_step=on_step, on_log=on_log,
                    on_stage=on_stage, on_resume=on_resume)
    finally:
        if task is not None:
            progress.stop()


@app.command()
def replan(
    plan: Annotated[Path, typer.Argument(help="The plan: a run config YAML with a `plan` section.")],
    event: Annotated[str, typer.Option(help="What happened, e.g. devices_lost:step=1200,count=8 or "
                                            "steps_lost:step=3000,count=500.")],
    out: Annotated[Optional[Path], typer.Option(help="Where to write the new plan (default: PLAN-replanned.yaml).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Re-plan a run after lost compute: shrink the budget if the loss came early, else report the delay."""
    from moelab.config import dump_yaml, to_dict
    from moelab.train.contingency import comparison_rows, parse_event
    from moelab.train.contingency import replan as make_replan

    if not plan.is_file():
        raise ConfigError(f"plan file {plan} does not exist; pass a run config YAML with a `plan` section "
                          "(see the README's re-planning example).")
    result = make_replan(load_yaml(plan), parse_event(event))
    target = out if out is not None else plan.with_name(f"{plan.stem}-replanned.yaml")
    replaced = target.exists()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(dump_yaml(result.new))
    if json_out:
        summary = {k: v for k, v in to_dict(result).items() if k not in ("old", "new")}
        print(json.dumps({**summary, "new_plan": str(target)}))
        return
    table = Table("field", "old", "new", title=f"replan: {result.event.spec} -> rule '{result.rule}'")
    for row in comparison_rows(result):
        table.add_row(*row)
    out_console.print(table)
    out_console.print(result.explanation)
    out_console.print(f"New plan written to {target}{' (it replaced the file there)' if replaced else ''} "
                      f"(train it with `moelab train {target}`).")


DEMO_SPEC = Path("experiments/demo.yaml")


@app.command()
def demo(
    root: Annotated[Path, typer.Option(help="Where the demo's steps, ledger and report go.")] = Path("runs/demo"),
    spec: Annotated[Path, typer.Option(help="The pre-registered experiment to run.")] = DEMO_SPEC,
) -> None:
    """The whole open-lab loop on the embedded data: register, ladder rungs, fit, main run, report.

    Re-running reuses every finished step (seconds); the report states the hypothesis verdict.
    """
    from moelab.lab.cli import show_outcomes
    from moelab.lab.experiment import run_experiment
    from moelab.lab.ledger import open_ledger
    from moelab.lab.registry import load_experiment, read_spec_file, register
    from moelab.lab.report import experiment_verdict, write_report

    if not spec.is_file():
        raise ConfigError(f"demo spec {spec} does not exist; run `make demo` from the repository root.")
    os.environ.setdefault("WANDB_SILENT", "true")  # the offline W&B run is written, not narrated
    ledger = open_ledger(root / "ledger.sqlite", create=True)
    exp_id = read_spec_file(spec).get("id")
    try:
        load_experiment(ledger, exp_id)
        err_console.print(f"[dim]{exp_id} is already registered in {ledger.path}; reusing it.[/]")
    except ConfigError:
        register(ledger, spec)
        err_console.print(f"Registered {exp_id} in {ledger.path} before running anything.")
    show_outcomes(exp_id, run_experiment(ledger, exp_id, root, spec_path=spec, progress=training_progress))
    html = write_report(ledger, exp_id)
    verdict, value = experiment_verdict(ledger, exp_id)
    metric = load_experiment(ledger, exp_id).spec.prediction.metric
    out_console.print(f"Hypothesis verdict: [bold]{verdict.upper()}[/] ({metric} = {value})")
    out_console.print(f"Report: {html}")


if __name__ == "__main__":
    main()
