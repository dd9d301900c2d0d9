"""The train and eval steps: the loss and its gradient over a batch (microbatched, per device on a mesh), one
optimizer update, the held-out cross-entropy. Jitted functions of arrays; no files, no loop.

    step = make_train_step(cfg, mesh)
    state, metrics = step(state, tokens)

`moelab.train.loop` drives them; the tests and benchmarks call them directly.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moelab.config import RunConfig
from moelab.model import balancing, router, transformer
from moelab.model.moe import Dispatch, build_moe
from moelab.parallel import spmd
from moelab.parallel import mesh as mesh_lib
from moelab.train.monitor import group_norms, router_bias_norms
from moelab.train.schedule import learning_rate
from moelab.train.state import TrainState, compute_dtype, make_optimizer, state_shardings

__all__ = ["SUMMED_AUX", "accumulate_gradients", "loss_and_grad", "make_train_step", "make_eval_step", "evaluate"]


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
