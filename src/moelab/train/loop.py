"""The training loop: a jitted train step, per-domain eval, and the run that writes its outputs.

    from moelab import presets
    from moelab.train.loop import train
    summary = train(presets.get("tiny"), "runs/tiny")

`train` writes the run directory of `moelab.train.outputs` (`OUT/config.yaml`, `metrics.jsonl`, ...,
`summary.json`). What plugs in comes as arguments, so train/ knows nothing of the lab or the ladder:
sinks (`outputs.Sink`; `moelab.lab.tracking` mirrors the outputs to the ledger or W&B), watchers
(`Watcher`; `moelab.ladder.on_track.OnTrack` checks each eval against a predicted band) and progress
callbacks (`Hooks`; the CLI plugs in a Rich progress bar). Everything a user can get wrong (config, data
files, vocabulary) is checked before `OUT` is created, so bad input leaves nothing half-written.

Multi-host: every process runs every step, eval, sample decode and checkpoint save (they are
collectives), but only process 0 (`mesh.is_writer()`) writes the files above and publishes to sinks; on
the others they are opened on os.devnull, so N hosts sharing `OUT` do not write each line N times.

Why one module past 600 lines: the step, the eval and the loop that resumes and drives them share one
state and one set of outputs; each piece is a function of at most ~60 lines (the step loop itself is
split into `_Throughput`, `_evaluate`, `_log`, `_checkpoint` and `_summary`), and split across modules
a resume would have to be read in three places.
"""

from __future__ import annotations

import contextlib
import json
import platform
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moelab.config import RunConfig, changed_fields, load_yaml, override, to_dict
from moelab.errors import ConfigError, Preempted, SaveFailed
from moelab.data.mixture import Corpus, MixtureLog, build_corpus, eval_batches, phase_at, sample_batch
from moelab.model import balancing, decode, router, transformer
from moelab.model.moe import Dispatch, build_moe, drops_by_purpose
from moelab.parallel import spmd
from moelab.parallel import mesh as mesh_lib
from moelab.train import outputs
from moelab.train.checkpoint import Checkpointer
from moelab.train.monitor import Incident, Monitor, group_norms, router_bias_norms
from moelab.train.outputs import Sink
from moelab.train.schedule import learning_rate
from moelab.train.state import (TrainState, compute_dtype, init_sharded_state, make_optimizer, state_shardings,
                                weights_sha256)

__all__ = ["Hooks", "Watcher", "accumulate_gradients", "loss_and_grad", "make_train_step", "make_eval_step", "evaluate", "prepare_corpus",
           "config_changes", "check_resumable", "run_platform", "train"]

def _mesh(cfg: RunConfig, mesh: Mesh | None) -> Mesh | None:
    """`mesh`, or for `ep` (whose experts live on a mesh) one built from `cfg.mesh` when None."""
    if mesh is None and cfg.model.moe.dispatch == "ep":
        return mesh_lib.make_mesh(cfg.mesh)
    return mesh


def _per_device_loss(cfg: RunConfig, mesh: Mesh, dispatch: Dispatch) -> tuple[Callable, Any]:
    """`loss(params, rows, (router_bias, rebalance)) -> (loss, aux)` of one device's rows inside the step's
    `shard_map`, parameters split over the rack gathered where they are read; and the params' specs."""
    specs = jax.tree.map(lambda sharding: sharding.spec, state_shardings(cfg, mesh).params)
    experts_local = dispatch.backend == "ep"
    dtype = compute_dtype(cfg)
    gather = spmd.layer_gather(specs, experts_local, dtype)

    def loss(params, rows, shared):
        router_bias, rebalance = shared
        top = {k: v for k, v in params.items() if k not in mesh_lib.STACKED}
        params = {**params, **spmd.gather_split(top, specs, experts_local, dtype)}
        return transformer.loss(params, rows, cfg.model, router_bias, dtype, dispatch=dispatch, gather=gather,
                                rebalance=rebalance if cfg.model.moe.rebalance_steps else False)

    return loss, specs


# Per-step router statistics that count (summed over microbatches); every other aux value is a mean or a
# fraction over equally sized microbatches, so their mean is the whole batch's value.
SUMMED_AUX = ("expert_load", "dropped", "assignments")


def accumulate_gradients(loss_fn: Callable, params: Any, tokens: jax.Array, microbatches: int
                         ) -> tuple[tuple[jax.Array, dict], Any]:
    """`jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)`, over `microbatches` slices of the batch.

    The slices run one after another under `lax.scan` (activations of one slice live at a time), with one
    float32 gradient sum. On a mesh it runs per device on the device's rows (`moelab.parallel.spmd`), so the
    sum is each device's own until the step reduces it once. Microbatch m holds rows m, m + M, ...: on a mesh
    the same global rows as on one device, since each device's block of rows is a multiple of M long. Equal
    slices make the mean of their losses and gradients the batch's to float32 rounding, as
    long as the dispatch drops nothing (a capacity is set per call, so a slice's drops may differ).
    The router statistics are combined for the whole step (`SUMMED_AUX` summed, the rest averaged);
    under quantile balancing the bias target is the mean of the slices' targets.
    """
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    if microbatches == 1:
        return value_and_grad(params, tokens)
    B = tokens.shape[0]
    slices = tokens.reshape(B // microbatches, microbatches, *tokens.shape[1:]).swapaxes(0, 1)  # [M, B/M, S+1]

    def one(total, rows):
        (loss, aux), grads = value_and_grad(params, rows)
        aux = {k: v for k, v in aux.items() if k != "ce_per_row"}
        return jax.tree.map(jnp.add, total, grads), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, (losses, auxes) = jax.lax.scan(one, zeros, slices)
    grads = jax.tree.map(lambda g: g / microbatches, total)
    aux = {k: jnp.sum(v, axis=0) if k in SUMMED_AUX else jnp.mean(v, axis=0) for k, v in auxes.items()}
    return (jnp.mean(losses), aux), grads


def loss_and_grad(cfg: RunConfig, mesh: Mesh | None = None) -> Callable:
    """`(params, tokens [B, S+1], (router_bias, rebalance)) -> ((loss, aux), grads)` of one step (not jitted).

    On a mesh (or for `ep`) it runs per device (`moelab.parallel.spmd`): each device routes its own tokens, and
    the gradient is summed over the mesh once, after the microbatches, laid out as the params. Elsewhere it is
    the plain program on one device. Both are the same function of the batch (tests/test_parallel.py).
    """
    mesh = _mesh(cfg, mesh)
    dispatch = build_moe(cfg.model, mesh, "train")
    if dispatch.token_axes:
        loss_fn, specs = _per_device_loss(cfg, mesh, dispatch)
        return spmd.per_device_value_and_grad(loss_fn, mesh, specs, cfg.train.microbatches, accumulate_gradients,
                                              across_dtype=jnp.dtype(cfg.train.grad_reduce_dtype))
    dtype = compute_dtype(cfg)

    def value_and_grad(params, tokens, shared):
        def loss_fn(params, rows):
            return transformer.loss(params, rows, cfg.model, shared[0], dtype, dispatch=dispatch,
                                    rebalance=shared[1] if cfg.model.moe.rebalance_steps else False)
        return accumulate_gradients(loss_fn, params, tokens, cfg.train.microbatches)

    return value_and_grad


def make_train_step(cfg: RunConfig, mesh: Mesh | None = None
                    ) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict]]:
    """A jitted `step(state, tokens [B, S+1], loss_ceiling [] = inf) -> (state, metrics)`.

    The old state's buffers are donated. With `monitor.skip_spikes`, a step whose loss exceeds
    `loss_ceiling` (the monitor's spike threshold; +inf while it has too little history) keeps the old
    params and optimizer state, decided on device so no host sync is needed. With a `mesh`, the new
    state keeps the shardings of `state_shardings` (experts over "expert", the rest by `mesh.shard`).
    With `train.microbatches` > 1 the gradients are accumulated over slices of the batch
    (`accumulate_gradients`); the balancer, the monitor and the metrics see the whole step. On a mesh the loss
    and its gradient run per device (`moelab.parallel.spmd`): each device routes its own tokens, and the
    gradient is summed over the mesh once a step; the optimizer then updates each shard where it lives.
    """
    tx = make_optimizer(cfg.train)
    schedule = learning_rate(cfg.train)
    balancer = balancing.balancer(cfg.model.moe)
    mesh = _mesh(cfg, mesh)
    shardings = None if mesh is None else state_shardings(cfg, mesh)
    value_and_grad = loss_and_grad(cfg, mesh)

    def step(state: TrainState, tokens: jax.Array, loss_ceiling: jax.Array = jnp.inf) -> tuple[TrainState, dict]:
        # The first steps route under the bias solved on their own batch (`balancing.rebalance_on_batch`).
        rebalance = state.step < cfg.model.moe.rebalance_steps
        (loss, aux), grads = value_and_grad(state.params, tokens, (state.router_bias, rebalance))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skipped = jnp.logical_and(cfg.monitor.skip_spikes, loss > loss_ceiling)
        if cfg.monitor.skip_spikes:
            params, opt_state = jax.tree.map(lambda old, new: jnp.where(skipped, old, new),
                                             (state.params, state.opt_state), (params, opt_state))
        metrics = {
            "skipped": skipped.astype(jnp.float32),
            **group_norms(state.params, "params"),
            **group_norms(grads, "grads"),
            **group_norms(updates, "updates"),
            **router_bias_norms(state.router_bias),
            "loss": loss,
            "ce": aux["ce"],
            "lr": schedule(state.step),
            "grad_norm": optax.tree.norm(grads),
            "drop_fraction": aux["drop_fraction"],
            # `ep` only: dropped at the sender's pools (transport_capacity_factor) / at the experts (capacity_factor)
            **{k: aux[k] for k in ("drop_fraction_at_sender", "drop_fraction_at_receiver") if k in aux},
        }
        # Balancing: step t's statistics give the bias of step t+1. It is not rolled back with a
        # skipped step: the routing statistics of a spiking batch are as valid as any other's.
        router_bias = balancer.update(state.router_bias, aux)
        router_load = router.update_load_ema(state.router_load, aux["expert_load"])
        metrics |= router.router_metrics(aux, state.router_bias, router_load)
        return TrainState(params, opt_state, router_bias, state.step + 1, router_load), metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))


def make_eval_step(cfg: RunConfig, mesh: Mesh | None = None) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """A jitted `eval(params, router_bias, tokens) -> mean CE per row [B]`.

    Under `model.moe.rebalance_steps` > 0 every eval batch routes under the bias solved on itself, as the
    rebalanced train steps do: an eval measures the model, not how far the carried bias lags its batch. The
    routed experts run as in training, at the training capacity (`build_moe`'s `eval`): `eval/mean` is the model
    as it trains, and a run's summary says so (`moe_drops`, from `moe.drops_by_purpose`).
    """
    dtype = compute_dtype(cfg)
    mesh = _mesh(cfg, mesh)
    dispatch = build_moe(cfg.model, mesh, "eval")
    rebalance = cfg.model.moe.rebalance_steps > 0
    if dispatch.token_axes:
        loss_fn, specs = _per_device_loss(cfg, mesh, dispatch)
        eval_step = spmd.per_device_apply(
            lambda p, bias, rows: loss_fn(p, rows, (bias, jnp.bool_(rebalance)))[1]["ce_per_row"], mesh, specs)
    else:
        def eval_step(params, router_bias, tokens):
            _, aux = transformer.loss(params, tokens, cfg.model, router_bias, dtype, dispatch=dispatch,
                                      rebalance=rebalance)
            return aux["ce_per_row"]

    # Replicated, so every process can read it into numpy on a multi-host mesh.
    return jax.jit(eval_step, out_shardings=None if mesh is None else NamedSharding(mesh, PartitionSpec()))


def evaluate(eval_step, params, router_bias, eval_sets: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """Mean held-out cross-entropy (nats/token) per domain, plus `mean`: their unweighted mean.

    `mean` is the one loss the ladder fits, predictions and reports use for a checkpoint.
    """
    per_domain = {
        domain: float(np.mean([np.mean(eval_step(params, router_bias, b)) for b in batches]))
        for domain, batches in eval_sets.items()
    }
    return {**per_domain, "mean": float(np.mean(list(per_domain.values())))}


def prepare_corpus(cfg: RunConfig) -> Corpus:
    """Load and tokenize the data; checks that the model's vocabulary holds the tokenizer's."""
    corpus = build_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({corpus.tokenizer.vocab_size} tokens); set --set model.vocab_size={corpus.tokenizer.vocab_size} or more."
        )
    return corpus


@dataclass
class Hooks:
    """Callbacks the caller plugs in (all optional): progress, every logged record, every eval.

    They run on every process of a multi-host run, with the same values; show progress only where
    `moelab.parallel.mesh.is_writer()` holds.
    """

    on_step: Callable[[int], None] | None = None  # after each step, with the number of steps done
    on_log: Callable[[dict], None] | None = None  # each record written to metrics.jsonl
    on_eval: Callable[[int, dict[str, float]], None] | None = None
    on_stage: Callable[[str], None] | None = None  # slow work before the steps: "compiling the train step", ...
    on_resume: Callable[[int, Path], None] | None = None  # resuming from this step's checkpoint directory

    def stage(self, name: str) -> None:
        if self.on_stage:
            self.on_stage(name)


class Watcher(Protocol):
    """Watches a run's evals from outside the loop; `moelab.ladder.on_track.OnTrack` (the predicted band) is one.

    `check_run(cfg)` runs once, before anything is built (e.g. to warn that it watches for another run).
    `watch(step, eval_mean)` runs at each eval, on every process, with its `eval/mean`; it returns fields
    for that eval's metrics record (`on_track`) and incidents as {"rule", "module", "values"}, which the
    loop stamps with the step, writes to incidents.jsonl and publishes like the monitor's own.
    """

    def check_run(self, cfg: RunConfig) -> None: ...

    def watch(self, step: int, eval_mean: float) -> tuple[dict[str, Any], list[dict]]: ...


def _jsonable(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


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


@contextlib.contextmanager
def _stop_requests():
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps (main thread only)."""
    requested = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum, _frame):
        requested["signal"] = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass(frozen=True)
class _Start:
    """Where a run starts: step 0, or its newest valid checkpoint with the logs cut back to that step."""

    step: int
    state: TrainState  # the checkpoint's, or the freshly initialized one
    meta: dict | None  # the checkpoint's meta; None on a fresh start
    kept: dict[str, list[str]]  # each log's lines up to `step` (`outputs.read_logs_until`)


def _resume(cfg: RunConfig, out: Path, hooks: Hooks, checkpoints: Checkpointer, state: TrainState) -> _Start:
    """Restore the newest valid checkpoint (if any) and read what each log keeps up to its step."""
    restored = checkpoints.restore_newest(like=state)
    # `moelab import`'s checkpoint: its weights and router bias start this run at step 0 (fresh Adam moments,
    # fresh logs, the initial eval taken on them); later checkpoints resume as in any run.
    imported = restored is not None and "imported_from" in restored.meta
    start = 0 if restored is None or imported else restored.step
    if start > cfg.train.steps:
        checkpoints.close()
        raise ConfigError(f"{out} holds a checkpoint at step {start}, past train.steps={cfg.train.steps}: pass "
                          f"--steps {start} or more to continue it, or a new --out for a shorter run.")
    if imported:
        hooks.stage(f"starting from the weights imported from {restored.meta['imported_from']}")
    elif restored is not None and hooks.on_resume:
        hooks.on_resume(start, checkpoints.directory / str(start))
    # Logs survive only up to a checkpoint; a fresh start rewrites them (whatever the directory held).
    kept = outputs.read_logs_until(out, start)
    if jax.process_count() > 1:  # every process reads the logs (and config.yaml) before process 0 rewrites them
        multihost_utils.sync_global_devices("moelab.train: run files read")
    if imported:
        return _Start(0, state._replace(params=restored.state.params, router_bias=restored.state.router_bias), None,
                      kept)
    if restored is None:
        return _Start(0, state, None, kept)
    return _Start(start, restored.state, restored.meta, kept)


def run_platform() -> dict[str, Any]:
    """Where a run computed: Python (it also builds the embedded corpus from its standard library), JAX, the
    backend, device kind and count, and the machine. Two runs compare bitwise only where these match."""
    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
            "machine": platform.machine(), "system": platform.system()}


def _store_hash(corpus: Corpus) -> str | None:
    """The content hash of the token store(s) the corpus reads; None for a corpus built in memory."""
    return (corpus.provenance or {}).get("store_hash")


def _check_same_store(start: _Start, corpus: Corpus, checkpoints: Checkpointer) -> None:
    """Refuse to resume a checkpoint trained on other tokens (another store, or none) than `corpus`."""
    if start.meta is None or start.meta.get("store_hash") == _store_hash(corpus):
        return
    checkpoints.close()
    in_memory = "none (data built in memory)"
    saved, now = start.meta.get("store_hash") or in_memory, _store_hash(corpus) or in_memory
    raise ConfigError(f"cannot resume the checkpoint at step {start.step}: it was trained on token store {saved}, "
                      f"but data now comes from {now}. Point data.store back at the store it trained on, or train "
                      "into a new --out directory.")


def train(cfg: RunConfig, out_dir: str | Path, hooks: Hooks | None = None, *, sinks: Sequence[Sink] = (),
          watchers: Sequence[Watcher] = ()) -> dict:
    """Train `cfg` into `out_dir`, resuming from its newest valid checkpoint if there is one.

    Writes the run directory of `moelab.train.outputs`: `config.yaml`, `metrics.jsonl`,
    `incidents.jsonl`, `mixture_log.jsonl` (phase changes and realized-token snapshots), `samples.jsonl`
    (greedy continuations of fixed prompts at each eval), `router_load.jsonl`, `checkpoints/`,
    `summary.json` (and `resumes.jsonl` on a resume). Every record, incident, mixture entry and sample
    also goes to each of `sinks` (e.g. `moelab.lab.tracking`'s), which `train` closes when it returns or
    raises. Each of `watchers` sees every eval's `eval/mean` (`Watcher`): with
    `moelab.ladder.on_track.load_on_track(PRED.csv)` each eval is checked against the predicted 95% band,
    and two misses in a row are an `off_track` incident. Returns the summary: final `step`, `loss`,
    `eval` and `eval_initial` per domain (with their `mean`), `eval_mean`, `tokens`, `tokens_per_s` (after
    the first step), `compile_s` (the first step), `incidents`, `moe_drops` (what the MoE blocks drop in training,
    in the evals and in the samples: `moe.drops_by_purpose`). Raises Preempted on SIGTERM / SIGINT.

    On a multi-host run every process trains, evaluates, saves checkpoints (Orbax coordinates
    `checkpoints/`) and returns the same summary, but only process 0 writes the other files and
    publishes to `sinks`.
    """
    hooks = hooks or Hooks()
    out = Path(out_dir)
    for watcher in watchers:
        watcher.check_run(cfg)
    config_path = out / outputs.CONFIG
    changes = {}
    if config_path.is_file() and _untrained_import(out):
        check_same_weights(load_yaml(config_path), cfg)  # an import not trained yet: any config of its shapes
    elif config_path.is_file():
        changes = check_resumable(load_yaml(config_path), cfg)
    mesh = mesh_lib.make_mesh(cfg.mesh)  # ConfigError if there are too few devices
    corpus = prepare_corpus(cfg)  # may raise DataError / ConfigError: before anything is written
    t, m = cfg.train, cfg.model
    held_out = {d: eval_batches(corpus, d, t.eval_batches, t.batch_size, m.seq_len) for d in corpus.domains}  # likewise
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output directory {out} is an existing file: pass a directory path (--out).")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output directory {out} ({e.strerror}): pass a writable path (--out).") from None
    try:
        return _train(cfg, out, hooks, changes, mesh, corpus, held_out, sinks, watchers)
    except OSError as e:  # a log or config write: a full disk, a file-size limit, a lost mount
        raise SaveFailed(f"writing {e.filename or 'a run file'} failed ({e.strerror or e}); the checkpoints saved "
                         "so far are untouched. Free disk space or fix the folder, then rerun the same command "
                         "to resume.") from e
    finally:
        for sink in sinks:
            sink.close()


def _train(cfg: RunConfig, out: Path, hooks: Hooks, changes: dict, mesh: Mesh, corpus: Corpus,
           held_out: dict[str, list[np.ndarray]], sinks: Sequence[Sink], watchers: Sequence[Watcher]) -> dict:
    """`train` once its inputs are checked and `out` exists: build, resume, write the run's files, run the steps."""
    t, m = cfg.train, cfg.model
    checkpoints = Checkpointer(out / outputs.CHECKPOINTS, cfg.checkpoint)
    # A finished run is left as it is, known from its summary and sealed last checkpoint before anything
    # compiles (process 0 reads them; every process agrees).
    previous = outputs.finished_summary(out, t.steps)
    if mesh_lib.from_process_0(lambda: previous is not None) and checkpoints.is_finished(t.steps):
        checkpoints.close()
        warnings.warn(f"{out} already finished its {t.steps} steps; nothing to do (its summary.json is unchanged). "
                      "Pass a larger --steps to train on, or a new --out for a new run.", stacklevel=2)
        return previous or {"step": t.steps, "resumed_from": t.steps}
    hooks.stage("building the model")
    eval_sets = {d: [mesh_lib.place_batch(b, mesh) for b in batches] for d, batches in held_out.items()}
    state = init_sharded_state(cfg, mesh)
    train_step, eval_step = make_train_step(cfg, mesh), make_eval_step(cfg, mesh)
    prompts = decode.sample_prompts(corpus.heldout, m.seq_len)
    greedy, _ = decode.make_greedy_decode(m, len(next(iter(prompts.values()))), corpus.tokenizer.vocab_size,
                                          compute_dtype(cfg))

    def evaluate_state(state: TrainState) -> dict[str, float]:
        return evaluate(eval_step, state.params, state.router_bias, eval_sets)

    def sample(state: TrainState, step: int) -> list[dict]:
        return decode.generate_samples(greedy, state.params, state.router_bias, prompts, corpus.tokenizer, step)

    start = _resume(cfg, out, hooks, checkpoints, state)
    _check_same_store(start, corpus, checkpoints)
    writer = mesh_lib.is_writer()
    if start.meta is not None:
        eval_initial = start.meta["eval_initial"]
        outputs.append_resume(out, start.step, changes, writer)
        if start.step < t.steps:
            # Compiled here, not at the first eval: there the bar would stall unexplained and the summary's
            # throughput would hold the compile. One batch per domain and one sample, both discarded.
            hooks.stage("compiling the eval step")
            first_batches = {d: batches[:1] for d, batches in eval_sets.items()}
            evaluate(eval_step, start.state.params, start.state.router_bias, first_batches)
            hooks.stage("compiling the sampler")
            sample(start.state, start.step)
    else:
        hooks.stage("compiling the eval step")
        eval_initial = evaluate_state(start.state)
    outputs.write_config(out, cfg, writer)
    outputs.write_data(out, corpus.provenance, writer)
    outputs.write_tokenizer(out, corpus.tokenizer, writer)
    if hooks.on_eval and start.step == 0:
        hooks.on_eval(0, eval_initial)
    logs = outputs.RunLogs(out, start.kept, sinks, writer)  # opened by the steps
    summary = _run_steps(cfg, mesh, corpus, hooks, watchers, checkpoints, logs, start, eval_initial, train_step,
                         evaluate_state, sample)
    outputs.write_summary(out, summary, writer)
    return summary


@dataclass
class _Throughput:
    """The train step's wall time: this process's first step (the compile) apart, then the steady state, and
    the window since the last logged record."""

    tokens_per_step: int
    window_start: float  # from after the decode's compile: that is not training time
    window_steps: int = 0
    steady_since: float | None = None
    steady_steps: int = 0
    compile_s: float | None = None  # the first step: the train step's compile, reported apart

    def step_done(self) -> None:
        self.window_steps += 1
        if self.steady_since is None:  # the first step compiled: time the steady state, and the window, from here
            self.steady_since = time.perf_counter()
            self.compile_s = self.steady_since - self.window_start
            self.window_start, self.window_steps = self.steady_since, 0
        else:
            self.steady_steps += 1

    def window_tokens_per_s(self) -> float:
        # Logged at the first step, the window holds no steady step: that step (compile included) is all.
        if self.window_steps:
            return self.window_steps * self.tokens_per_step / (time.perf_counter() - self.window_start)
        return self.tokens_per_step / self.compile_s

    def new_window(self) -> None:
        self.window_start, self.window_steps = time.perf_counter(), 0

    def steady_tokens_per_s(self) -> float | None:
        """Every step after the first (evals and saves included); None when this process ran fewer than two."""
        if not self.steady_steps:
            return None
        return self.steady_steps * self.tokens_per_step / (time.perf_counter() - self.steady_since)


@dataclass
class _Loop:
    """What every step of `_run_steps` reads: the run's parts, its writers and callbacks."""

    cfg: RunConfig
    corpus: Corpus
    hooks: Hooks
    watchers: Sequence[Watcher]
    checkpoints: Checkpointer
    logs: outputs.RunLogs
    evaluate_state: Callable[[TrainState], dict[str, float]]
    sample: Callable[[TrainState, int], list[dict]]
    incidents: list[dict] = field(default_factory=list)  # this process's, for the summary's count

    def report(self, found: list[dict]) -> None:
        for incident in found:
            self.logs.incident(incident)
        self.incidents.extend(found)


def _evaluate(loop: _Loop, state: TrainState, done: int, record: dict) -> tuple[dict[str, float], list[dict]]:
    """An eval step: the held-out losses into `record`, each watcher's fields and incidents, the samples and
    the router load; returns the eval and the incidents the watchers opened."""
    last_eval = loop.evaluate_state(state)
    record.update({f"eval/{d}": v for d, v in last_eval.items()})
    opened = []
    for watcher in loop.watchers:
        fields, found = watcher.watch(done, last_eval["mean"])
        record.update(fields)
        found = [Incident(done, **incident).to_json() for incident in found]
        loop.report(found)
        opened += found
    loop.logs.samples(done, loop.sample(state, done))
    loop.logs.router_load(done, jax.device_get(state.router_load).tolist())
    if loop.hooks.on_eval:
        loop.hooks.on_eval(done, last_eval)
    return last_eval, opened


def _save(loop: _Loop, state: TrainState, step: int, eval_initial: dict, mixture: MixtureLog) -> Path:
    return loop.checkpoints.save(step, state, {"seed": loop.cfg.train.seed, "eval_initial": eval_initial,
                                               "store_hash": _store_hash(loop.corpus),
                                               "realized_tokens": mixture.counts})


def _run_steps(cfg: RunConfig, mesh: Mesh, corpus: Corpus, hooks: Hooks, watchers: Sequence[Watcher],
               checkpoints: Checkpointer, logs: outputs.RunLogs, start: _Start, eval_initial: dict[str, float],
               train_step: Callable, evaluate_state: Callable[[TrainState], dict[str, float]],
               sample: Callable[[TrainState, int], list[dict]]) -> dict:
    """The steps from `start.step` to `train.steps`: train, log, evaluate, watch, sample, save; returns the summary.

    Raises Preempted, once the checkpoint of the step under way is saved, when a stop was requested.
    """
    t, m = cfg.train, cfg.model
    loop = _Loop(cfg, corpus, hooks, watchers, checkpoints, logs, evaluate_state, sample)
    state, last_eval, record = start.state, eval_initial, {}
    if start.step == t.steps:  # finished, but its summary was never written: summarize the final state again
        last_eval = evaluate_state(state)
        record = json.loads(start.kept[outputs.METRICS][-1]) if start.kept[outputs.METRICS] else {}
    monitor = Monitor(cfg.monitor)
    with _stop_requests() as stop, logs:
        # No `realized_tokens` in a fresh start or a checkpoint older than the mixture log: rebuilt from the phases.
        realized = start.meta.get("realized_tokens") if start.meta else None
        mixture = MixtureLog(cfg, corpus.domains, start.step, realized,
                             [json.loads(x) for x in start.kept[outputs.MIXTURE_LOG]])
        if start.step == 0:
            hooks.stage("compiling the sampler")
            logs.samples(0, sample(state, 0))
        hooks.stage("compiling the train step")
        clock = _Throughput(t.batch_size * m.seq_len, time.perf_counter())
        for step in range(start.step, t.steps):
            logs.mixture(mixture.before_step(step))
            _, phase = phase_at(cfg.data, step, t.steps)
            batch = sample_batch(corpus, phase.weights, t.seed, step, t.batch_size, m.seq_len)
            ceiling = jnp.float32(monitor.loss_ceiling())
            state, metrics = train_step(state, mesh_lib.place_batch(batch.tokens, mesh), ceiling)
            scalars = _jsonable(jax.device_get({k: v for k, v in metrics.items() if np.ndim(v) == 0}))
            done = step + 1
            clock.step_done()
            snapshot = mixture.after_step(done, batch)
            if snapshot is None and done == t.steps:
                snapshot = mixture.snapshot(done)  # the end always gets one
            logs.mixture(snapshot)
            new_incidents = [i.to_json() for i in monitor.observe(done, scalars)]
            loop.report(new_incidents)
            is_eval = done % t.eval_every == 0 or done == t.steps
            if done % t.log_every == 0 or is_eval or new_incidents:
                record = {"step": done, **scalars, "tokens": done * clock.tokens_per_step,
                          "tokens_per_s": clock.window_tokens_per_s(), "phase": phase.name}
                evaluated = _log(loop, state, done, record, new_incidents, is_eval)
                last_eval = last_eval if evaluated is None else evaluated
                clock.new_window()
            # Every process stops after this step if any saw a signal: saving the checkpoint is a collective,
            # so a host that stopped alone would wait forever. The loop already waits for each step's
            # metrics, so the flags' all-gather adds no sync of its own.
            stopping = mesh_lib.on_any_process(stop["signal"] is not None)
            _checkpoint(loop, state, done, eval_initial, mixture, stopping, snapshot is None)
            if hooks.on_step:
                hooks.on_step(done)
    checkpoints.close()
    return _summary(cfg, start, state, record, last_eval, eval_initial, clock, len(loop.incidents))


def _log(loop: _Loop, state: TrainState, done: int, record: dict, new_incidents: list[dict],
         is_eval: bool) -> dict[str, float] | None:
    """A logged step: `record` (and, at an eval, its held-out losses and the watchers' fields) to the metrics,
    with the incidents the step opened; returns the eval when there was one."""
    last_eval = None
    if is_eval:
        last_eval, opened = _evaluate(loop, state, done, record)
        new_incidents = new_incidents + opened
    if new_incidents:
        record["incidents"] = new_incidents
    loop.logs.log(record)
    if loop.hooks.on_log:
        loop.hooks.on_log(record)
    return last_eval


def _checkpoint(loop: _Loop, state: TrainState, done: int, eval_initial: dict, mixture: MixtureLog, stopping: bool,
                no_snapshot: bool) -> None:
    """Saves at the cadence, at the end and on a stop; a stop before the end then raises Preempted."""
    t, every = loop.cfg.train, loop.cfg.checkpoint.every
    if stopping or done == t.steps or (every and done % every == 0):
        path = _save(loop, state, done, eval_initial, mixture)
        if stopping and done < t.steps:
            if no_snapshot:  # publish the realized mixture up to the stop
                loop.logs.mixture(mixture.snapshot(done))
            loop.checkpoints.close()
            raise Preempted(done, path)


def _summary(cfg: RunConfig, start: _Start, state: TrainState, record: dict, last_eval: dict, eval_initial: dict,
             clock: _Throughput, new_incidents: int) -> dict:
    """summary.json: the run's final figures (`train`'s docstring lists them)."""
    t = cfg.train
    tokens_per_step = t.batch_size * cfg.model.seq_len
    return {
        "step": t.steps,
        "loss": record.get("loss"),
        "eval": last_eval,
        "eval_initial": eval_initial,
        "eval_mean": last_eval["mean"],
        "tokens": t.steps * tokens_per_step,
        # Steady state: every step this process ran after its first (which compiles), evals and saves
        # included; None when it ran fewer than two.
        "tokens_per_s": clock.steady_tokens_per_s(),
        "compile_s": clock.compile_s,  # this process's first step (the train step's compile); None if it ran none
        "incidents": len(start.kept[outputs.INCIDENTS]) + new_incidents,
        "resumed_from": start.step or None,
        # What `moelab lab reproduce` compares a rerun with: bitwise-equal weights, and the platform that
        # made them (a rerun elsewhere is held to the run-to-run noise instead).
        "params_sha256": weights_sha256(state),
        "platform": run_platform(),
        "moe_drops": drops_by_purpose(cfg.model),
    }
