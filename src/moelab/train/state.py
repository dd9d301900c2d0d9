"""TrainState: params, optimizer state, router bias and step; the optimizer that updates them.

The router bias lives here, beside the params, never inside them: the optimizer and the loss never
see it (architecture §3). Data order depends only on (seed, step), so `step` is also the data cursor.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import Mesh

from moelab.config import RunConfig, TrainConfig
from moelab.model import transformer
from moelab.parallel import mesh as mesh_lib
from moelab.train.schedule import learning_rate

__all__ = ["TrainState", "compute_dtype", "decay_mask", "make_optimizer", "init_state", "state_shardings", "init_sharded_state",
           "weights_sha256"]


class TrainState(NamedTuple):
    params: Any  # nested dict of float32 arrays
    opt_state: Any
    router_bias: jax.Array  # [L, E] float32, balancing state outside the optimizer
    step: jax.Array  # int32 scalar: steps taken, and the data cursor
    router_load: jax.Array  # [L, E] float32, EMA of assignments per expert (router/maxvio_global)


def compute_dtype(cfg: RunConfig) -> jnp.dtype:
    """The dtype of the matmuls' inputs, `train.compute_dtype`; params and optimizer state stay float32."""
    return jnp.dtype(cfg.train.compute_dtype)


def decay_mask(params: Any) -> Any:
    """Weight decay on the matrices only: every `w_*` weight, the embedding and the head. The norms' gains stay
    undecayed (the usual AdamW practice), and so does anything added later that is not a matrix.

    Chosen by name, not by rank: stacked over layers a gain is [L, D], as many dimensions as a matrix (the rank
    rule decayed every block's gains until issue 59)."""
    def is_matrix(path, _):
        name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
        return name.startswith("w_") or name in ("embed", "lm_head")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the configured schedule, its moments stored as `train.moment_dtype`."""
    adamw = optax.adamw(learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), _stored_as(jnp.dtype(cfg.moment_dtype), adamw))


def _stored_as(dtype: jnp.dtype, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its floating-point state kept in `dtype` between steps and updated in float32.

    The identity for float32. Counters (integers) are untouched; the state's tree is the same, only
    the moments' dtype differs.
    """
    if dtype == jnp.float32:
        return tx

    def cast(state, to):
        return jax.tree.map(lambda a: a.astype(to) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)

    def init(params):
        return cast(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def init_state(cfg: RunConfig) -> TrainState:
    """Fresh state from `cfg.train.seed`: the same seed gives bitwise the same params."""
    params = transformer.init(cfg.model, jax.random.key(cfg.train.seed))
    opt_state = make_optimizer(cfg.train).init(params)
    bias = transformer.init_router_bias(cfg.model)
    return TrainState(params, opt_state, bias, jnp.zeros((), jnp.int32), jnp.zeros_like(bias))


def state_shardings(cfg: RunConfig, mesh: Mesh) -> TrainState:
    """A `NamedSharding` for every leaf of the train state under `cfg.mesh.shard` (`moelab.parallel.mesh`)."""
    return mesh_lib.state_shardings(jax.eval_shape(lambda: init_state(cfg)), mesh, cfg.mesh.shard)


def init_sharded_state(cfg: RunConfig, mesh: Mesh) -> TrainState:
    """`init_state`, born in its shardings on `mesh`: each device computes only its own shards, so
    no host ever holds the whole state (and it works unchanged across hosts). Deterministic in the
    seed like `init_state`, but compiled as one program its values may differ from the op-by-op
    `init_state` in the last bit (measured: at most 1 float32 ulp)."""
    return jax.jit(lambda: init_state(cfg), out_shardings=state_shardings(cfg, mesh))()


def weights_sha256(state: TrainState) -> str | None:
    """SHA-256 of what the model computes with: every param (path, dtype, shape, bytes) and the router bias.

    Equal hashes mean bitwise-equal weights: `moelab lab reproduce` compares a rerun's final hash with the
    recorded one. None when this process does not hold every shard (a multi-host run): gathering a
    frontier model onto one host only to hash it is not worth it.
    """
    leaves = jax.tree_util.tree_leaves_with_path({"params": state.params, "router_bias": state.router_bias})
    if not all(getattr(x, "is_fully_addressable", True) for _, x in leaves):
        return None
    digest = hashlib.sha256()
    for path, leaf in leaves:
        array = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
