"""The `moelab` command: a table of contents of commands, and `main()`, which turns errors into exit codes.

    moelab presets | flops | train | replan        one run (cli/train.py)
    moelab plan                                    memory per device and communication per step (cli/plan.py)
    moelab demo                                    the open-lab loop `make demo` runs (cli/demo.py)
    moelab generate                                sample from a trained run (cli/generate.py)
    moelab export                                  safetensors / Hugging Face export of a run (cli/export.py)
    moelab import                                  a Hugging Face MoE checkpoint as a run (cli/hf_import.py)
    moelab eval                                    loss / perplexity / bits per byte on your data (cli/evaluate.py)
    moelab data ...                                token stores: prepare, show (cli/data.py)
    moelab lab ...                                 pre-registered experiments (cli/lab.py)
    moelab ladder ...                              scaling ladders (cli/ladder.py)

Exit codes: 0 success, 1 a run failed, 2 bad input (one paragraph on stderr naming the field, the
value and the fix; set MOELAB_DEBUG=1 for the traceback), 75 preempted after saving (rerun to resume),
130 interrupted.
"""

from __future__ import annotations

import os
import sys

import typer

from moelab.cli.common import EXIT_PREEMPTED, err_console, print_problem
from moelab.cli.data import data_app
from moelab.cli.demo import demo
from moelab.cli.evaluate import evaluate
from moelab.cli.export import export
from moelab.cli.generate import generate
from moelab.cli.hf_import import import_cmd
from moelab.cli.lab import lab_app
from moelab.cli.ladder import ladder_app
from moelab.cli.plan import plan
from moelab.cli.train import flops, presets_cmd, replan, train
from moelab.errors import ConfigError, DataError, Preempted, SaveFailed

__all__ = ["app", "main"]

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode="markdown", help="Train Mixture-of-Experts LMs as an open lab.")
app.add_typer(lab_app, name="lab")
app.add_typer(ladder_app, name="ladder")
app.add_typer(data_app, name="data")
app.command("presets")(presets_cmd)
app.command()(flops)
app.command()(train)
app.command()(replan)
app.command()(plan)
app.command()(demo)
app.command()(generate)
app.command()(export)
app.command("import")(import_cmd)
app.command("eval")(evaluate)


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
        print_problem("Error", str(e))
        sys.exit(1)
    except Preempted as e:
        print_problem("Preempted", str(e), style="bold yellow")
        if e.path is None:  # Ctrl-C while XLA compiled: a hard exit, as `_aborted` explains
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PREEMPTED)
        sys.exit(EXIT_PREEMPTED)
    except (ConfigError, DataError) as e:
        if os.environ.get("MOELAB_DEBUG"):
            raise
        print_problem("Error", str(e))
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        _aborted()
    except OSError as e:  # a path the command was given that cannot be read or written: name it, no traceback
        if os.environ.get("MOELAB_DEBUG"):
            raise
        print_problem("Error", f"{e.filename or 'a file'}: {e.strerror or e}. Check the paths given to the command "
                      "(a file where a folder belongs, a missing folder, no permission, a full disk); "
                      "MOELAB_DEBUG=1 shows where it happened.")
        sys.exit(2)
    except Exception as e:
        if _is_usage_error(e):
            _name_the_bad_value(e)
            e.show()
            sys.exit(e.exit_code)
        raise


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print_problem("Warning", str(message), style="yellow")


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
