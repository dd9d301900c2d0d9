"""What the command modules share: the consoles, the options that read the same in every command, the
exit code of a preempted run, and `CONFIG.yaml | --preset NAME` plus `--set` overrides as one RunConfig."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from moelab import presets
from moelab.config import DataConfig, RunConfig, from_dict, parse_overrides, read_data_yaml, resolve_data_paths, to_dict
from moelab.errors import ConfigError

__all__ = ["out_console", "err_console", "print_problem", "EXIT_PREEMPTED", "PresetOpt", "ConfigArg", "SetOpt",
           "JsonOpt", "DataOpt", "mesh_fields", "LedgerOpt", "DEFAULT_LEDGER", "resolve_config"]

# Tables keep their columns when piped to a file or another program (Rich would fold them to 80).
out_console = Console(width=None if sys.stdout.isatty() else 160)  # results
err_console = Console(stderr=True)  # progress, warnings, errors

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; rerun the same command to resume

PresetOpt = Annotated[Optional[str], typer.Option("--preset", "-p", help="A named config, e.g. tiny (see `moelab presets`).")]
ConfigArg = Annotated[Optional[Path], typer.Argument(help="A run config YAML (instead of --preset).", show_default=False)]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a field, e.g. --set model.d_model=256 (repeatable).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

DEFAULT_LEDGER = Path("lab/ledger.sqlite")
LedgerOpt = Annotated[Path, typer.Option("--ledger", envvar="MOELAB_LEDGER", show_default=False,
                                         help="The ledger file (default: $MOELAB_LEDGER, else lab/ledger.sqlite).")]


def print_problem(label: str, message: str, style: str = "bold red") -> None:
    """`Label: message` as one unwrapped paragraph on stderr (an error, a warning, a preemption). The message is
    escaped: it names fields like data.domains[code] and values like [6.0, 2.0], which Rich would otherwise
    read as markup tags and drop."""
    err_console.print(f"[{style}]{label}:[/] {escape(message)}", highlight=False, soft_wrap=True)


DataOpt = Annotated[Optional[Path], typer.Option(
    "--data", help="A YAML data section (domains, phases, tokenizer, store) in place of the config's; its relative "
                   "paths are read against its folder.", show_default=False)]


def resolve_config(config: Path | None, preset: str | None, sets: list[str] | None = None, data: Path | None = None,
                   **fields) -> RunConfig:
    """The run config from exactly one of a YAML file or a preset, with `--data`, `--set` and flag `fields` applied."""
    bare = [item for item in sets or [] if "=" not in item]
    if bare:  # `--set model.d_model 128`: the value became CONFIG, and the message would be about that
        raise ConfigError(f"--set {bare[0]} has no '=': write --set {bare[0]}=VALUE (section.field=value, no spaces"
                          + (f"; here --set {bare[0]}={config}" if config is not None and preset is not None else "")
                          + ").")
    if (config is None) == (preset is None):
        raise ConfigError("give exactly one of CONFIG.yaml or --preset NAME, e.g. `moelab train --preset tiny`.")
    updates = {"data": read_data_yaml(data)} if data is not None else {}
    updates.update(parse_overrides(sets or []))
    updates.update({k: v for k, v in fields.items() if v is not None})
    cfg = presets.resolve(Path(config) if config is not None else preset, updates)
    # Paths given on the command line (--set data.store=...) mean the shell's folder: pin them, so the run's
    # config.yaml reads back the same from anywhere.
    return dataclasses.replace(cfg, data=from_dict(resolve_data_paths(to_dict(cfg.data), Path.cwd()), DataConfig))


def mesh_fields(spec: str | None, sets: list[str] | None) -> dict:
    """`--mesh replica=2,expert=4` as config overrides. A shortcut: expert > 1 also selects dispatch 'ep',
    unless `--set model.moe.dispatch=...` names one (RunConfig then says whether the mesh can run it)."""
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
    if fields.get("expert", 1) > 1 and "model.moe.dispatch" not in parse_overrides(sets or []):
        updates["model.moe.dispatch"] = "ep"
    return updates
