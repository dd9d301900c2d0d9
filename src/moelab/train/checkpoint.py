"""Checkpoints: Orbax saves of the whole TrainState, a checksum manifest, newest-valid restore, retention.

    ckpt = Checkpointer(out / "checkpoints", cfg.checkpoint)
    ckpt.save(step, state, meta={"seed": 0})
    restored = ckpt.restore_newest(like=state)      # None when there is nothing valid to resume

Orbax writes each step into a temporary directory and renames it when complete, so a crash never
leaves a half-written step that looks finished. On top of that we write `moelab_manifest.json`
(SHA-256 of every file) *after* Orbax finishes: a step without a matching manifest (killed between
the two, truncated or edited on disk later) is skipped with a `CheckpointWarning` naming it, and the
previous one is used. Retention keeps the newest `keep_last` steps plus every `keep_every`-th.

The TrainState holds everything a resume needs: params, optimizer state, router bias and step, which
is also the data cursor (the sampler is keyed on (seed, step)); the seed travels in `meta`.

Multi-host: every process calls `save` and `restore_newest`; Orbax writes each process's shards and
ends a save with a barrier once the step is complete. Only process 0 (`is_writer`) then writes the
manifest, and no process waits for it during the run. At restore, process 0 alone checks a step's
manifest (hashing every file once, not once per host) and tells the others; a restore that fails on
any process is skipped by all of them, so every process resumes from the same step.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from moelab.config import CheckpointConfig
from moelab.parallel import mesh as mesh_lib

__all__ = ["CheckpointWarning", "Restored", "Checkpointer"]

MANIFEST = "moelab_manifest.json"


class CheckpointWarning(UserWarning):
    """A checkpoint on disk was skipped because it is incomplete or corrupted."""


class Restored(NamedTuple):
    step: int
    state: Any
    meta: dict


def _digest(step_dir: Path) -> dict[str, str]:
    """SHA-256 of every file under a step directory (the manifest itself excluded)."""
    out = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        out[str(path.relative_to(step_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Checkpointer:
    """Saves and restores TrainStates under one directory."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep_last,
            keep_period=cfg.keep_every,
            # Synchronous saves: a SIGKILL right after save() returns must still find the step complete.
            enable_async_checkpointing=False,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: dict) -> Path:
        """Save `state` at `step` and seal it with a manifest; returns the step directory."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        step_dir = self.directory / str(step)
        if mesh_lib.is_writer():
            tmp = step_dir / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(_digest(step_dir), indent=1))
            tmp.rename(step_dir / MANIFEST)  # atomic: the manifest is either absent or complete
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

        Each newer one that fails is skipped with a CheckpointWarning naming its directory.
        """
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        for step in self.steps():
            step_dir = self.directory / str(step)
            if not mesh_lib.from_process_0(lambda: self.is_valid(step)):
                warnings.warn(f"checkpoint {step_dir} is incomplete or corrupted (its files do not match "
                              f"{MANIFEST}); skipping it and trying the previous one.", CheckpointWarning,
                              stacklevel=2)
                continue
            args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
            try:
                restored, error = self._manager.restore(step, args=args), None
            except Exception as e:  # Orbax raises many types; any failure means "not usable"
                restored, error = None, f"{type(e).__name__}: {e}"
            if not mesh_lib.on_every_process(error is None):
                warnings.warn(f"checkpoint {step_dir} could not be restored ({error or 'on another process'}); "
                              "skipping it and trying the previous one.", CheckpointWarning, stacklevel=2)
                continue
            return Restored(step, restored.state, dict(restored.meta))
        return None

    def close(self) -> None:
        self._manager.close()
