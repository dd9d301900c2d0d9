"""`moelab presets`, `flops`, `train` and `replan`: one run's config, its cost, training it, re-planning it.

    moelab presets                                   list the named configs
    moelab flops --preset frontier-535b --json       parameter counts and training FLOPs
    moelab train --preset tiny --steps 100 --out runs/tiny --set train.lr=1e-3
    moelab train --preset tiny --mesh replica=2,expert=4    expert parallel over 2 x 4 devices
    moelab replan plan.yaml --event devices_lost:step=1200,count=8

Also the progress bar every command that trains in this process shows (`training_progress`).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, Sequence

import typer
from rich.markup import escape
from rich.progress import ProgressColumn
from rich.table import Table
from rich.text import Text

from moelab import accounting, presets
from moelab.cli.common import (ConfigArg, DataOpt, JsonOpt, PresetOpt, SetOpt, err_console, mesh_fields, out_console,
                               resolve_config)
from moelab.config import RunConfig, load_yaml, to_dict
from moelab.errors import ConfigError

if TYPE_CHECKING:
    from moelab.train.loop import Watcher
    from moelab.train.outputs import Sink

__all__ = ["presets_cmd", "flops", "train", "replan", "run_training", "training_progress"]


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
             "devices. Sets mesh.replica / mesh.expert; expert > 1 also selects dispatch ep unless --set "
             "model.moe.dispatch is given.")] = None,
    predicted: Annotated[Optional[Path], typer.Option(
        help="A PRED.csv from `moelab ladder run/fit`: check each eval against its 95% band (off_track incidents).")] = None,
    data: DataOpt = None,
    publish: Annotated[Optional[str], typer.Option(
        help="Copy the mixture log, metrics, incidents, config and summary to this URL (s3://, gs://) or folder "
             "as training goes, each file a complete object.")] = None,
    publish_every: Annotated[float, typer.Option(help="Seconds between publications (with --publish).")] = 3600.0,
    wandb: Annotated[bool, typer.Option(
        "--wandb", help="Log to Weights & Biases under OUT/wandb: offline unless WANDB_MODE or WANDB_API_KEY says "
                        "online; a resumed run continues its W&B run.")] = False,
    name: Annotated[Optional[str], typer.Option(help="The W&B run's name (default: the config's name).")] = None,
    verify_data: Annotated[bool, typer.Option(
        "--verify-data", help="Re-hash every token-store shard the run opens (otherwise a shard is re-hashed when "
                              "its size, mtime, inode or ctime changed since it was last verified).")] = False,
    profile: Annotated[Optional[str], typer.Option(
        help="START:STOP: write a JAX profiler trace of steps START+1 to STOP under OUT/profile (open its "
             "perfetto_trace.json.gz in ui.perfetto.dev, or `tensorboard --logdir OUT/profile`), e.g. 10:15.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the resolved config and the plan's memory and step time on this machine's devices, "
                          "then exit without training or writing anything.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train a model, or resume it if OUT already holds a checkpoint of the same run.

    Writes OUT/config.yaml, metrics.jsonl, incidents.jsonl, checkpoints/ and summary.json. Multi-host:
    start one process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set
    (or under Slurm / Open MPI); see the README.
    """
    from moelab.parallel.mesh import initialize_distributed, is_writer

    initialize_distributed()  # before anything touches a device; a no-op for one process
    if verify_data:
        import os

        from moelab.data.store import REHASH_ENV

        os.environ[REHASH_ENV] = "1"  # the environment, so data workers and Ray tasks re-hash too
    cfg = resolve_config(config, preset, sets, data, **{"train.steps": steps, "train.seed": seed,
                                                  "checkpoint.every": checkpoint_every, **mesh_fields(mesh, sets)})
    trace = parse_profile(profile, cfg.train.steps) if profile is not None else None
    if dry_run:
        from moelab.cli.plan import print_plan_here
        from moelab.config import dump_yaml

        out_console.print(dump_yaml(cfg), highlight=False, markup=False)
        print_plan_here(cfg)
        return
    watchers = []
    if predicted is not None:
        if not predicted.is_file():
            raise ConfigError(f"--predicted {predicted} does not exist; write it with `moelab ladder run` or "
                              "`ladder fit`.")
        from moelab.ladder.contract import keep_copy
        from moelab.ladder.on_track import load_on_track  # scipy: only when predictions are checked

        # The run keeps its own copy (OUT/prediction.csv and sidecar): the one place its report looks.
        watchers.append(load_on_track(keep_copy(predicted, out) if is_writer() else predicted))
    sinks = []
    if publish is not None:
        from moelab.train.publish import Publisher

        publisher = Publisher(out, publish, publish_every)
        publisher.check()  # an unreachable URL or missing credentials: exit 2 before anything trains
        sinks.append(publisher)
    if wandb:
        sinks.append(_wandb_sink(cfg, out, name))
    elif name is not None:
        raise ConfigError("--name names the W&B run; add --wandb to log to W&B.")
    started = time.time()  # a trace older than this is an earlier run's, not one this command wrote
    summary = run_training(cfg, out, watchers, sinks, trace)
    if is_writer():  # every host returns the same summary; one prints it
        print(json.dumps(summary) if json_out else summary_line(summary, out))
        if trace is not None and not json_out:
            from moelab.train.outputs import PROFILE

            traces = sorted(p for p in (out / PROFILE).rglob("perfetto_trace.json.gz") if p.stat().st_mtime >= started)
            print(f"Profile of steps {trace[0] + 1}-{trace[1]}: {traces[-1]} (ui.perfetto.dev; or tensorboard "
                  f"--logdir {out / PROFILE})" if traces else
                  f"No profile written: the run did not train steps {trace[0] + 1}-{trace[1]} here (resumed past them?).")


def parse_profile(text: str, num_steps: int) -> tuple[int, int]:
    """`--profile START:STOP` as (START, STOP), 0 <= START < STOP <= train.steps; a ConfigError naming it otherwise."""
    start, sep, stop = text.partition(":")
    try:
        bounds = (int(start), int(stop)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 0 <= bounds[0] < bounds[1] <= num_steps:
        raise ConfigError(f"--profile={text!r} is invalid: give START:STOP with 0 <= START < STOP <= train.steps "
                          f"({num_steps}), e.g. --profile 10:15 for steps 11 to 15 (after the first step's compile).")
    return bounds


def summary_line(summary: dict, out: Path) -> str:
    """A finished run in one line for a person: where it ended, how fast, where its files are (`--json`: all of it)."""
    evals = summary.get("eval") or {}
    start = (summary.get("eval_initial") or {}).get("mean")
    held_out = (f", held-out loss {evals['mean']:.3f}" + (f" (from {start:.3f})" if start is not None else "")
                if "mean" in evals else "")
    incidents = summary.get("incidents", 0)
    # A run resumed at its last step trains none here: no loss of its own, no steady throughput.
    loss = f"loss {summary['loss']:.3f}" if summary.get("loss") is not None else "no step trained here"
    speed = (f"{summary['tokens_per_s']:,.0f} tokens/s" if summary.get("tokens_per_s") is not None
             else "throughput not measured (fewer than two steps ran)")
    if summary.get("mfu") is not None:
        speed += f" (MFU {summary['mfu']:.1%} of the datasheet peak)"
    return (f"Trained to step {summary['step']}: {loss}{held_out}, "
            f"{speed}, {incidents} incident{'' if incidents == 1 else 's'}. "
            f"Run in {out} (summary.json has every figure; --json prints it).")


def _wandb_sink(cfg: RunConfig, out: Path, name: str | None):
    """The W&B sink of `moelab train --wandb` (`lab.tracking.WandbSink`), named after the run."""
    from moelab.lab import tracking  # W&B's import is slow: only when a run asks for it

    if not tracking.wandb_available():
        raise ConfigError("--wandb needs the wandb package: pip install 'moelab[wandb]' (or drop --wandb).")
    return tracking.WandbSink(out, to_dict(cfg), name or cfg.name)


def run_training(cfg: RunConfig, out: Path, watchers: Sequence[Watcher] = (), sinks: Sequence[Sink] = (),
                 profile: tuple[int, int] | None = None) -> dict:
    """Train with a Rich progress bar on stderr (process 0's only, on a multi-host run)."""
    from moelab.parallel import mesh as mesh_lib
    from moelab.train.loop import train as train_run

    mesh_lib.make_mesh(cfg.mesh)  # a mesh the devices cannot hold fails here, before a progress bar is drawn
    with training_progress(cfg) as hooks:
        return train_run(cfg, out, hooks, watchers=watchers, sinks=sinks, profile=profile)


class _StatusColumn(ProgressColumn):
    """The bar's status: the last loss and throughput, or the slow stage under way with its elapsed time."""

    def render(self, task) -> Text:
        since = task.fields.get("since")
        elapsed = f" {time.monotonic() - since:.0f} s" if since is not None else ""
        return Text(f"{task.fields['status']}{elapsed}")


@contextlib.contextmanager
def training_progress(cfg: RunConfig):
    """A progress bar for one training run (steps, loss, tokens/s, MFU where the device's peak is known) on stderr;
    yields the loop's Hooks.

    The bar appears with the first slow stage (a finished run that has nothing to do draws none),
    shows each stage before the first step ("compiling the train step 12 s"), and a resumed run
    says so on a line of its own. The stage the first step ends, the train step's compile, leaves
    its time on a line too ("compiling the train step: 12.3 s"): the tokens/s after it leave the
    compile out. Off a terminal, where the bar is not redrawn, every stage does. `moelab train`,
    `ladder run` and the local `lab run` / `demo` steps show it; process 0 only.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moelab.parallel import mesh as mesh_lib
    from moelab.train.loop import Hooks

    writer = mesh_lib.is_writer()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), _StatusColumn(), console=err_console, transient=False,
                        disable=not writer)
    task, stage = None, None  # stage: (name, start) of the one under way, until the next or the first step
    every_stage = not err_console.is_terminal

    def bar():
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task(escape(cfg.name), total=cfg.train.steps, status="", since=None)
        return task

    def end_stage(by_first_step: bool) -> None:
        nonlocal stage
        if stage is not None and writer and (by_first_step or every_stage):
            name, since = stage
            progress.console.print(f"{escape(name)}: {time.monotonic() - since:.1f} s", highlight=False)
        stage = None

    def on_stage(name: str) -> None:
        nonlocal stage
        end_stage(by_first_step=False)
        stage = (name, time.monotonic())
        progress.update(bar(), status=name, since=stage[1])

    def on_resume(step: int, path: Path) -> None:
        progress.console.print(f"Resuming from step {step} ({escape(str(path))}).", highlight=False, soft_wrap=True)
        progress.update(bar(), completed=step)

    forecast = ""  # the live forecast of the final loss, from the last eval watched against a prediction

    def on_log(record: dict) -> None:
        nonlocal forecast
        end_stage(by_first_step=True)
        if "forecast/final" in record:
            forecast = f"  forecast {record['forecast/final']:.3f} ({record['on_track']})"
        mfu = f"  MFU {record['mfu']:.1%}" if record.get("mfu") is not None else ""
        progress.update(bar(), status=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s{mfu}{forecast}",
                        since=None)

    def on_step(done: int) -> None:
        if stage is not None:
            end_stage(by_first_step=True)
            progress.update(bar(), completed=done, status="training", since=None)
        else:
            progress.update(bar(), completed=done)

    try:
        yield Hooks(on_step=on_step, on_log=on_log,
                    on_stage=on_stage, on_resume=on_resume)
    finally:
        end_stage(by_first_step=False)  # a run that stopped (or had nothing to train) before its first step
        if task is not None:
            progress.stop()


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
