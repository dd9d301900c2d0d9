"""The `moelab` command (the top layer): parsing and printing only; the work is the library's.

- `main`: the table of contents (the Typer app and its groups) and `main()`, which maps errors to exit codes.
- `common`: the consoles, the options every command spells the same way, config resolution.
- `train`: presets, flops, train, replan, and the training progress bar; `plan`: `moelab plan`.
- `data`: `moelab data`; `evaluate`: `moelab eval`; `generate`: `moelab generate`; `export`: `moelab export`.
- `lab`: the `moelab lab` group; `bundle`: its export, verify and reproduce; `ladder`: the `moelab ladder`
  group; `demo`: `moelab demo`; `__main__`: `python -m moelab.cli`.
"""

from moelab.cli.main import app, main

__all__ = ["app", "main"]
