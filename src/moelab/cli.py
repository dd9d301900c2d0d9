"""The `moelab` command line: a table of contents of commands.

    moelab presets                                   list the named configs
    moelab flops --preset frontier-535b --json       parameter counts and training FLOPs
    moelab train --preset tiny --steps 100 --out runs/tiny --set train.lr=1e-3
    moelab demo                                      the demo `make demo` runs

Exit codes: 0 success, 1 a run failed, 2 bad input (one paragraph on stderr naming the field, the
value and the fix; set MOELAB_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from moelab import accounting, presets
from moelab.config import ConfigError, DataError, RunConfig, load_yaml, override, parse_overrides

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Train Mixture-of-Experts LMs as an open lab.")
out_console = Console()
err_console = Console(stderr=True)

PresetOpt = Annotated[Optional[str], typer.Option("--preset", "-p", help="A named config, e.g. tiny (see `moelab presets`).")]
ConfigArg = Annotated[Optional[Path], typer.Argument(help="A run config YAML (instead of --preset).", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a field, e.g. --set model.d_model=256 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def resolve_config(config: Path | None, preset: str | None, sets: list[str] | None = None, **fields) -> RunConfig:
    """The run config from exactly one of a YAML file or a preset, with overrides applied."""
    if (config is None) == (preset is None):
        raise ConfigError("give exactly one of CONFIG.yaml or --preset NAME, e.g. `moelab train --preset tiny`.")
    cfg = load_yaml(config) if config is not None else presets.get(preset)
    updates = parse_overrides(sets or [])
    updates.update({k: v for k, v in fields.items() if v is not None})
    return override(cfg, updates) if updates else cfg


EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; rerun the same command to resume


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    err_console.print(f"[yellow]Warning:[/] {message}", highlight=False, soft_wrap=True)


def main() -> None:
    """Entry point: runs the app and turns bad input into exit code 2 with one clear paragraph."""
    import warnings

    from moelab.train.loop import Preempted

    warnings.showwarning = _show_warning
    try:
        app(standalone_mode=False)
    except Preempted as e:
        err_console.print(f"[bold yellow]Preempted:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_PREEMPTED)
    except (ConfigError, DataError) as e:
        if os.environ.get("MOELAB_DEBUG"):
            raise
        err_console.print(f"[bold red]Error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("Aborted.")
        sys.exit(130)
    except Exception as e:  # click's usage errors carry their own exit code
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


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
    tokens: Annotated[Optional[int], typer.Option(help="Training tokens (default: steps x batch x sequence).")] = None,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Parameter counts (total / active / embedding) and training FLOPs of a config."""
    cfg = resolve_config(config, preset, sets)
    if tokens is not None and tokens <= 0:
        raise ConfigError(f"--tokens={tokens} is invalid: must be a positive number of tokens.")
    figures = accounting.summarize(cfg, tokens)
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
) -> None:
    """Train a model, or resume it if OUT already holds a checkpoint of the same run.

    Writes OUT/config.yaml, metrics.jsonl, incidents.jsonl, checkpoints/ and summary.json.
    """
    cfg = resolve_config(config, preset, sets, **{"train.steps": steps, "train.seed": seed,
                                                  "checkpoint.every": checkpoint_every})
    summary = run_training(cfg, out)
    print(json.dumps(summary))


def run_training(cfg: RunConfig, out: Path) -> dict:
    """Train with a Rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moelab.train.loop import Hooks, train

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"), console=err_console, transient=False,
    ) as progress:
        task = progress.add_task(cfg.name, total=cfg.train.steps, status="loading data")

        def on_log(record: dict) -> None:
            progress.update(task, status=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")

        hooks = Hooks(on_step=lambda done: progress.update(task, completed=done), on_log=on_log)
        return train(cfg, out, hooks)


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

    result = make_replan(load_yaml(plan), parse_event(event))
    target = out if out is not None else plan.with_name(f"{plan.stem}-replanned.yaml")
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
    out_console.print(f"New plan written to {target} (train it with `moelab train {target}`).")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(help="Training steps (a couple of minutes on 2 CPU cores).")] = 2500,
) -> None:
    """Train the tiny preset on the embedded corpus and show per-domain eval loss before and after."""
    cfg = override(presets.get("tiny"), {"train.steps": steps, "train.warmup_steps": 100, "train.eval_every": 500})
    summary = run_training(cfg, out)
    table = Table("domain", "eval loss before", "eval loss after", title=f"tiny preset, {summary['tokens']:,} tokens")
    for domain, after in summary["eval"].items():
        table.add_row(domain, f"{summary['eval_initial'][domain]:.3f}", f"{after:.3f}")
    out_console.print(table)
    out_console.print(f"Outputs in {out}/ (config.yaml, metrics.jsonl, summary.json)")


if __name__ == "__main__":
    main()
