"""Resuming a run: which config changes a resume may make, and where a run starts (step 0, its newest valid
checkpoint, or the weights `moelab import` left), with its logs cut back to that step.

The driver (`moelab.train.loop`) asks `check_config` before anything is built, `restore` once the state is, and
`check_same_store` once the data is read; each raises ConfigError naming what blocks the resume and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from moelab.config import RunConfig, changed_fields, load_yaml, override, to_dict
from moelab.errors import ConfigError
from moelab.data.mixture import Corpus
from moelab.model import transformer
from moelab.train import outputs
from moelab.train.checkpoint import Checkpointer
from moelab.train.state import TrainState

__all__ = ["RESUME_SAFE", "Start", "config_changes", "check_same_weights", "check_resumable", "check_config",
           "restore", "store_hash", "check_same_store"]


# Fields a resume may change: they alter neither the model nor the data stream already consumed.
# `train.steps` moves the WSD decay and phase boundaries of the steps still to come (the contingency
# planner relies on that); a new mesh re-shards the same arrays.
RESUME_SAFE = ("name", "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
               "train.mixture_snapshot_every",
               "data.store",  # a moved or copied store: its content hash is checked against the checkpoint's
               "train.microbatches",  # how the same batch is cut for memory; the update is the same to rounding
               "train.grad_reduce_dtype",  # how the gradient crosses racks; the update is the same to its rounding
               "checkpoint.", "monitor.", "plan.", "mesh.")


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Fields whose value differs between two configs, as {dotted.field: (old, new)}."""
    return changed_fields(to_dict(old), to_dict(new))


def _untrained_import(out: Path) -> bool:
    """A `moelab import` run directory whose only checkpoint is the import's (step 0): nothing trained from it yet."""
    if not (out / outputs.IMPORTED).is_file():
        return False
    return sorted(p.name for p in (out / outputs.CHECKPOINTS).glob("*") if p.name.isdigit()) == ["0"]


def _weight_shapes(cfg: RunConfig) -> dict[str, tuple]:
    abstract = jax.eval_shape(lambda: transformer.init(cfg.model, jax.random.key(0)))
    return {jax.tree_util.keystr(path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)}


def check_same_weights(old: RunConfig, new: RunConfig) -> None:
    """ConfigError naming the model fields that change the weights' shapes between `old` and `new`."""
    before = _weight_shapes(old)
    if _weight_shapes(new) == before:
        return

    def reshapes(key: str, value: Any) -> bool:  # does this change alone change a weight's shape?
        try:
            return _weight_shapes(override(old, {key: value})) != before
        except ConfigError:  # it only holds together with the others: name it
            return True

    changed = [k for k, (_, value) in config_changes(old, new).items() if k.startswith("model.") and reshapes(k, value)]
    raise ConfigError(f"the imported weights are shaped by the config they came with; {', '.join(changed) or 'the model'} "
                      "changes their shapes. Keep the model's shape (the dispatch, balancing, remat, training and data "
                      "settings may change).")


def check_resumable(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The safe changes between a run's saved config and the one resuming it; ConfigError if any is unsafe."""
    changes = config_changes(old, new)
    unsafe = [k for k in changes if not k.startswith(RESUME_SAFE)]
    if unsafe:
        listed = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in unsafe)
        raise ConfigError(
            f"cannot resume with a config that changes the model or the data stream ({listed}). "
            "Undo these changes, or train into a new --out directory."
        )
    return changes


def check_config(cfg: RunConfig, out: Path) -> dict[str, tuple[Any, Any]]:
    """What `cfg` changes in the run already in `out` (empty for a new run); ConfigError if it may not.

    An import not trained yet takes any config of its weights' shapes; any other run only `RESUME_SAFE` changes."""
    config_path = out / outputs.CONFIG
    if not config_path.is_file():
        return {}
    if _untrained_import(out):
        check_same_weights(load_yaml(config_path), cfg)
        return {}
    return check_resumable(load_yaml(config_path), cfg)


@dataclass(frozen=True)
class Start:
    """Where a run starts: step 0, or its newest valid checkpoint with the logs cut back to that step."""

    step: int
    state: TrainState  # the checkpoint's, or the freshly initialized one
    meta: dict | None  # the checkpoint's meta; None on a fresh start
    kept: dict[str, list[str]]  # each log's lines up to `step` (`outputs.read_logs_until`)
    imported_from: str | None = None  # `moelab import`'s source when the run starts from its weights


def restore(cfg: RunConfig, out: Path, checkpoints: Checkpointer, state: TrainState) -> Start:
    """Restore the newest valid checkpoint (if any) over the freshly built `state`, and read what each log keeps
    up to its step."""
    restored = checkpoints.restore_newest(like=state)
    # `moelab import`'s checkpoint: its weights and router bias start this run at step 0 (fresh Adam moments,
    # fresh logs, the initial eval taken on them); later checkpoints resume as in any run.
    imported = restored is not None and "imported_from" in restored.meta
    start = 0 if restored is None or imported else restored.step
    if start > cfg.train.steps:
        checkpoints.close()
        raise ConfigError(f"{out} holds a checkpoint at step {start}, past train.steps={cfg.train.steps}: pass "
                          f"--steps {start} or more to continue it, or a new --out for a shorter run.")
    # Logs survive only up to a checkpoint; a fresh start rewrites them (whatever the directory held).
    kept = outputs.read_logs_until(out, start)
    if jax.process_count() > 1:  # every process reads the logs (and config.yaml) before process 0 rewrites them
        multihost_utils.sync_global_devices("moelab.train: run files read")
    if imported:
        return Start(0, state._replace(params=restored.state.params, router_bias=restored.state.router_bias), None,
                     kept, imported_from=restored.meta["imported_from"])
    if restored is None:
        return Start(0, state, None, kept)
    return Start(start, restored.state, restored.meta, kept)


def store_hash(corpus: Corpus) -> str | None:
    """The content hash of the token store(s) the corpus reads; None for a corpus built in memory."""
    return (corpus.provenance or {}).get("store_hash")


def check_same_store(start: Start, corpus: Corpus, checkpoints: Checkpointer) -> None:
    """Refuse to resume a checkpoint trained on other tokens (another store, or none) than `corpus`."""
    if start.meta is None or start.meta.get("store_hash") == store_hash(corpus):
        return
    checkpoints.close()
    in_memory = "none (data built in memory)"
    saved, now = start.meta.get("store_hash") or in_memory, store_hash(corpus) or in_memory
    raise ConfigError(f"cannot resume the checkpoint at step {start.step}: it was trained on token store {saved}, "
                      f"but data now comes from {now}. Point data.store back at the store it trained on, or train "
                      "into a new --out directory.")

