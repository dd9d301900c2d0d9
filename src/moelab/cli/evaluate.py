"""`moelab eval`: a run's loss, perplexity and bits per byte on your data, per domain.

    moelab eval runs/tiny --data my-data.yaml             # a data section's domains (files, globs, hf:...)
    moelab eval runs/tiny --data notes.txt --data web.jsonl.gz --json     # files, one domain each
    moelab eval runs/tiny --tasks my_mc --include-path tasks/             # lm-evaluation-harness tasks
    moelab eval runs/tiny --arithmetic --every-checkpoint --json          # exact match on held-out sums
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from moelab.cli.common import JsonOpt, err_console, out_console
from moelab.cli.generate import RunArg, TokenizerOpt
from moelab.config import DataConfig, DomainConfig, from_dict, read_data_yaml
from moelab.errors import ConfigError, DataError

__all__ = ["evaluate"]


def _data_config(paths: list[Path]) -> DataConfig:
    """The domains of each `--data`: a YAML file's data section, or a text / JSONL / Parquet file (or glob) as a
    domain named after it."""
    domains = []
    for path in paths:
        if path.suffix in (".yaml", ".yml"):
            domains += from_dict(read_data_yaml(path), DataConfig).domains
        else:
            _check_exists(path)
            name = path.name.split(".")[0] or "data"
            domains.append(DomainConfig(name=name, kind="files", paths=(str(path.absolute()),)))
    names = [d.name for d in domains]
    if len(set(names)) != len(names):
        raise ConfigError(f"--data gives domains {names}, some twice; name each once (a data YAML names them).")
    return DataConfig(domains=tuple(domains))


def _check_exists(path: Path) -> None:
    """A --data file that is missing (or a glob that matches none) is named as the user typed it: as a domain
    it would be `data.domains[NAME].paths`, a field they never wrote."""
    if str(path).startswith("hf:"):
        return
    if any(c in str(path) for c in "*?["):
        if not glob.glob(str(path), recursive=True):
            raise DataError(f"--data {path}: the pattern matches no file; fix it, or give a data YAML or a "
                            ".txt / .jsonl / .parquet file.")
    elif not path.exists():
        raise DataError(f"--data {path}: no such file ({path.absolute()} does not exist); give a data YAML or a "
                        ".txt / .jsonl / .parquet file (or a glob of them).")


def evaluate(
    run: RunArg,
    data: Annotated[Optional[list[Path]], typer.Option(
        "--data", help="A data YAML (its domains) or a .txt/.jsonl/.parquet file or glob (one domain); "
                       "repeatable.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Score at most this many tokens per domain.")] = None,
    batch_size: Annotated[int, typer.Option(help="Windows of seq_len tokens per forward.")] = 8,
    tasks: Annotated[Optional[str], typer.Option(
        help="lm-evaluation-harness tasks, comma-separated (installed ones, or YAML tasks under --include-path).")] = None,
    include_path: Annotated[Optional[Path], typer.Option(help="A folder of lm-eval task YAML files.")] = None,
    limit: Annotated[Optional[int], typer.Option(
        help="With --tasks or --arithmetic: at most this many examples per task.")] = None,
    arithmetic: Annotated[bool, typer.Option(
        "--arithmetic", help="Exact-match accuracy and answer loss on the run's held-out arithmetic problems "
                             "(`417 + 86 = 503`), scored as greedy decoding would answer.")] = False,
    every_checkpoint: Annotated[bool, typer.Option(
        "--every-checkpoint", help="With --arithmetic: score each saved checkpoint, not only the newest.")] = False,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Loss, perplexity and bits per byte of a run's newest checkpoint on each domain of --data.

    Every document is read whole and scored once (each token predicted once, documents separated by eos
    as in training); bits per byte divides the summed loss by the text's UTF-8 bytes, so it compares across
    tokenizers.
    """
    if every_checkpoint and not arithmetic:
        raise ConfigError("--every-checkpoint scores the arithmetic task per checkpoint: add --arithmetic.")
    if not data and not tasks and not arithmetic:
        raise ConfigError("give --data (a data YAML or a text / JSONL / Parquet file), --tasks or --arithmetic, "
                          "e.g. `moelab eval runs/tiny --data notes.txt`.")
    if (data or tasks) and arithmetic:
        raise ConfigError("--arithmetic prints its own table: run it apart from --data and --tasks.")
    if limit is not None and limit < 1:
        raise ConfigError("--limit must be >= 1.")
    if include_path is not None and not include_path.is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder; give the folder of your task YAML files.")
    if batch_size < 1 or (max_tokens is not None and max_tokens < 1):  # before any checkpoint is read
        raise ConfigError("--batch-size and --max-tokens must be >= 1.")
    from moelab.train.weights import load_run

    if arithmetic:
        _run_arithmetic(run, tokenizer, limit, every_checkpoint, json_out)
        return
    cfg = _data_config(data) if data else None  # a bad data YAML is named before the checkpoint loads
    weights = load_run(run, tokenizer)  # once, for the tasks and the data
    if tasks:
        _run_tasks(run, weights, tasks, include_path, limit, batch_size, json_out)
        if not data:
            return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from moelab.evals.loss import domain_documents, evaluate_documents

    documents = domain_documents(cfg)  # DataError naming a missing or malformed file, before any forward
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), console=err_console,
                  transient=True) as progress:
        bars = {}

        def on_batch(domain: str, done: int, total: int) -> None:
            if domain not in bars:
                bars[domain] = progress.add_task(domain, total=total)
            progress.update(bars[domain], completed=done)

        scores = evaluate_documents(weights, documents, batch_size=batch_size, max_tokens=max_tokens,
                                    on_batch=on_batch)
    if json_out:
        print(json.dumps({"run": str(run), "step": weights.step, "domains": {d: s._asdict() for d, s in scores.items()}}))
        return
    table = Table("domain", "loss", "perplexity", "bits/byte", "tokens", "bytes", "documents",
                  title=f"{run} at step {weights.step}")
    for domain, s in scores.items():
        table.add_row(domain, f"{s.loss:.4f}", f"{s.perplexity:.3f}", f"{s.bits_per_byte:.4f}", f"{s.tokens:,}",
                      f"{s.bytes:,}", f"{s.documents:,}")
    out_console.print(table)


def _run_tasks(run: Path, weights, tasks: str, include_path: Path | None, limit: int | None, batch_size: int,
               json_out: bool) -> None:
    from moelab.evals.harness import run_tasks

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    results = run_tasks(weights, names, include_path=str(include_path) if include_path else None,
                        limit=limit, batch_size=batch_size)
    if json_out:
        print(json.dumps({"run": str(run), "tasks": results}, default=str))
        return
    table = Table("task", "metric", "value", title=f"{run}: lm-eval")
    for task, metrics in results.items():
        for key, value in metrics.items():
            if isinstance(value, float) and "stderr" not in key:
                table.add_row(task, key.split(",")[0], f"{value:.4f}")
    out_console.print(table)


def _run_arithmetic(run: Path, tokenizer: Path | None, limit: int | None, every_checkpoint: bool,
                    json_out: bool) -> None:
    """The arithmetic task at the newest checkpoint, or at each one (oldest first), as a table or JSON."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from moelab.evals.arithmetic import heldout_problems, score_problems
    from moelab.train.weights import checkpoint_steps, load_run

    newest = load_run(run, tokenizer)  # names a run without checkpoints before anything is scored
    problems = heldout_problems(newest.cfg.data, limit)
    steps = [s for s in checkpoint_steps(run) if s <= newest.step] if every_checkpoint else [newest.step]
    rows = []
    with Progress(TextColumn("[bold]arithmetic"), BarColumn(), MofNCompleteColumn(), console=err_console,
                  transient=True) as progress:
        bar = progress.add_task("checkpoints", total=len(steps))
        for step in steps:
            weights = newest if step == newest.step else load_run(run, tokenizer, step)
            score = score_problems(weights, problems)
            rows.append({"step": step, **score._asdict()})
            progress.advance(bar)
    if json_out:
        print(json.dumps({"run": str(run), "task": "arithmetic", "checkpoints": rows}))
        return
    table = Table("step", "accuracy", "task loss", "problems", title=f"{run}: arithmetic exact match")
    for row in rows:
        table.add_row(str(row["step"]), f"{row['accuracy']:.3f}", f"{row['task_loss']:.4f}", f"{row['problems']:,}")
    out_console.print(table)
