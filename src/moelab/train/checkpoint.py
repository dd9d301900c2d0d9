"""Checkpoints: Orbax saves of the whole TrainState, a checksum manifest, newest-valid restore, retention.

    ckpt = Checkpointer(out / "checkpoints", cfg.checkpoint)
    ckpt.save(step, state, meta={"seed": 0})
    restored = ckpt.restore_newest(like=state)      # None when there is nothing valid to resume

Orbax writes each step into a temporary directory and renames it when complete, so a crash never
leaves a half-written step that looks finished. On top of that we write `moelab_manifest.json`
(SHA-256 of every file) *after* Orbax finishes: a step without a matching manifest (killed between
the two, truncated or edited on disk later) is moved aside to `checkpoints/<step>.corrupt-<UTC time>`
(kept for inspection, invisible to Orbax) with a `CheckpointWarning` naming both paths, and the previous
one is used; the resumed run then saves that step afresh. A save that fails (a full disk, a file-size
limit) raises `SaveFailed` naming the step and the previous checkpoint, which it leaves untouched.
Retention keeps the newest `keep_last` steps plus every `keep_every`-th.

The TrainState holds everything a resume needs: params, optimizer state, router bias and step, which
is also the data cursor (the sampler is keyed on (seed, step)); the seed travels in `meta`.

Multi-host: every process calls `save` and `restore_newest`; Orbax writes each process's shards and
ends a save with a barrier once the step is complete. Only process 0 (`is_writer`) then writes the
manifest, and no process waits for it during the run. At restore, process 0 alone checks a step's
manifest (hashing every file once, not once per host) and tells the others; a restore that fails on
any process is skipped by all of them, so every process resumes from the same step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from moelab.config import CheckpointConfig
from moelab.errors import ConfigError, SaveFailed
from moelab.files import sha256_file, write_json
from moelab.parallel import mesh as mesh_lib

__all__ = ["CheckpointWarning", "Restored", "Checkpointer"]

MANIFEST = "moelab_manifest.json"


class CheckpointWarning(UserWarning):
    """A checkpoint on disk was skipped because it is incomplete or corrupted."""


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict


@contextlib.contextmanager
def _quiet_orbax():
    """Hold back what a save prints, and drop it if the save fails: `SaveFailed` then says it once.

    A failed write makes Orbax log the error with a traceback from each of its threads (absl), and
    TensorStore's C++ threads print a traceback per pending write straight to file descriptor 2
    (about 150 lines for one full disk). A save that succeeds gets its output replayed, so nothing
    is lost.
    """
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            _until_quiet(held)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            logger.setLevel(level)
        held.seek(0)  # reached only when the save succeeded
        os.write(2, held.read())


class _ReadOnlyNotes(logging.Filter):
    """Drops Orbax's notes on a read-only manager: which save options it turned off, and "Given directory is
    read only=...". Three WARNING lines on every `moelab generate`, `eval` and `export` that ask nothing of
    the user; every other absl message passes."""

    PREFIXES = ("CheckpointManagerOptions.read_only=True, setting", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


@contextlib.contextmanager
def _quiet_read_only_notes():
    """`_ReadOnlyNotes` on the absl logger while a read-only manager is built, and only then."""
    logger, notes = logging.getLogger("absl"), _ReadOnlyNotes()
    logger.addFilter(notes)
    try:
        yield
    finally:
        logger.removeFilter(notes)


def _until_quiet(held, settle_s: float = 0.5, most_s: float = 5.0) -> None:
    """Wait until nothing more is printed for `settle_s` (at most `most_s`): a failed save's writes that
    were still in flight report their own failure a little later, from TensorStore's threads."""
    size, since, deadline = -1, time.monotonic(), time.monotonic() + most_s
    while time.monotonic() < deadline:
        now = os.fstat(held.fileno()).st_size
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(0.05)


def _digest(step_dir: Path) -> dict[str, str]:
    """SHA-256 of every file under a step directory (the manifest itself excluded)."""
    out = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        out[str(path.relative_to(step_dir))] = sha256_file(path)
    return out


class Checkpointer:
    """Saves and restores TrainStates under one directory."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig, read_only: bool = False):
        """`read_only`: for readers of a run that may still be training (generate, eval, export): nothing
        on disk changes; an unsealed step (a save in progress) is skipped, not moved aside or cleaned up."""
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        with _quiet_read_only_notes() if read_only else contextlib.nullcontext():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep_last,
                keep_period=cfg.keep_every,
                # Synchronous saves: a SIGKILL right after save() returns must still find the step complete.
                enable_async_checkpointing=False,
                create=not read_only,
                # A save killed midway leaves `<step>.orbax-checkpoint-tmp-*`; for a reader it may be a live save.
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: dict) -> Path:
        """Save `state` at `step` and seal it with a manifest; returns the step directory."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        step_dir = self.directory / str(step)
        try:
            with _quiet_orbax():
                self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
            if mesh_lib.is_writer():
                # atomic: the manifest is either absent or complete
                write_json(step_dir / MANIFEST, _digest(step_dir), sort_keys=False)
        except Exception as e:  # Orbax and TensorStore raise many types for one failed write
            # A step left without its manifest is moved aside at the next restore; the older ones are untouched.
            good = [s for s in self.steps() if s != step]
            last = f"the previous checkpoint, step {good[0]}, is untouched" if good else "there is no earlier checkpoint"
            raise SaveFailed(f"saving checkpoint step {step} to {step_dir} failed ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'no message'}); {last}. Free disk space or "
                             "fix the folder, then rerun the same command to resume.") from e
        return step_dir

    def steps(self) -> list[int]:
        """Steps present on disk, newest first (valid or not)."""
        self._manager.reload()
        return sorted(self._manager.all_steps(), reverse=True)

    def is_valid(self, step: int) -> bool:
        step_dir = self.directory / str(step)
        manifest = step_dir / MANIFEST
        if not manifest.is_file():
            return False
        try:
            return json.loads(manifest.read_text()) == _digest(step_dir)
        except (OSError, ValueError):
            return False

    def restore_newest(self, like: Any) -> Restored | None:
        """The newest checkpoint that verifies and loads, shaped like `like`; None if there is none.

        Each newer one that fails is moved aside (`_set_aside`) with a CheckpointWarning naming it, so
        the step can be saved again when training reaches it (Orbax refuses to overwrite a step); a
        read-only Checkpointer skips it instead.
        """
        for step in self.steps():
            restored = self.restore(step, like)
            if restored is not None:
                return restored
        return None

    def restore(self, step: int, like: Any) -> Restored | None:
        """Checkpoint `step` shaped like `like` if it verifies and loads; None otherwise (and, unless
        read-only, the failed step is moved aside as in `restore_newest`)."""
        if not mesh_lib.from_process_0(lambda: self.is_valid(step)):
            if not self.read_only:
                self._set_aside(step, f"its files do not match {MANIFEST}")
            return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        try:
            restored, error = self._manager.restore(step, args=args), None
        except Exception as e:  # Orbax raises many types; any failure means "not usable"
            restored, error = None, f"{type(e).__name__}: {e}"
        if not mesh_lib.on_every_process(error is None):
            if not self.read_only:
                self._set_aside(step, f"it could not be restored: {error or 'on another process'}")
            return None
        return Restored(step, restored.state, dict(restored.meta))

    def _set_aside(self, step: int, why: str) -> Path:
        """Rename a failed step to `<step>.corrupt-<UTC time>`, warning with both paths; returns the new one.

        Process 0 renames; every process then re-reads the step list. Orbax only lists directories
        named by a bare step number, so the renamed one is out of its way but kept for inspection.
        """
        step_dir = self.directory / str(step)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = self.directory / f"{step}.corrupt-{stamp}"
        suffix = 1
        while aside.exists():  # two failures of one step within a second
            aside, suffix = self.directory / f"{step}.corrupt-{stamp}-{suffix}", suffix + 1
        if mesh_lib.is_writer():
            try:
                step_dir.rename(aside)
            except OSError as e:
                raise ConfigError(f"checkpoint {step_dir} is incomplete or corrupted ({why}), and moving it aside "
                                  f"failed ({e.strerror}); move or delete it by hand, then rerun.") from None
        mesh_lib.on_every_process(True)  # a barrier: nobody re-reads the steps before the rename
        self._manager.reload()
        warnings.warn(f"checkpoint {step_dir} is incomplete or corrupted ({why}); moved it to {aside.name} "
                      "and resuming from the previous one.", CheckpointWarning, stacklevel=3)
        return aside

    def is_finished(self, step: int) -> bool:
        """Whether the newest step on disk is `step` and verifies: a finished run, known without loading it."""
        steps = self.steps()
        return bool(steps) and steps[0] == step and mesh_lib.from_process_0(lambda: self.is_valid(step))

    def close(self) -> None:
        self._manager.close()
