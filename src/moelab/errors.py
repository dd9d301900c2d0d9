"""What can go wrong, as types: the CLI maps each to one paragraph and an exit code.

`ConfigError` and `DataError` are bad input (exit 2), `Preempted` a run stopped by a signal after
saving (exit 75), `SaveFailed` a run whose write failed (exit 1). Every layer raises them; this module
imports nothing of moelab, so the CLI can handle them without loading JAX.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ConfigError", "DataError", "Preempted", "SaveFailed"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class DataError(ValueError):
    """Input data is missing, empty or malformed; the message names the file and the fix."""


class Preempted(Exception):
    """Training stopped on SIGTERM / SIGINT after saving a checkpoint; rerun the same command to resume.

    `path` None: stopped before this run had a checkpoint to save (building, compiling), with nothing half-made
    left behind (`note` says what was removed); rerunning starts it.
    """

    def __init__(self, step: int, path: Path | None, note: str = ""):
        if path is None:
            message = (f"stopped at step {step}, before the first checkpoint: nothing was saved{note}. Rerun the same "
                       "command to start.")
        else:
            message = f"stopped at step {step}; checkpoint saved in {path}. Rerun the same command to resume."
        super().__init__(message)
        self.step = step
        self.path = None if path is None else Path(path)


class SaveFailed(RuntimeError):
    """Writing a checkpoint (or a run file) failed: a full disk, a file-size limit, a lost mount.

    The message names what failed and the last good checkpoint, which a rerun resumes from.
    """
