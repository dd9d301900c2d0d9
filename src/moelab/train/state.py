"""TrainState: params, optimizer state, router bias and step; the optimizer that updates them.

The router bias lives here, beside the params, never inside them: the optimizer and the loss never
see it (design §3). Data order depends only on (seed, step), so `step` is also the data cursor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from moelab.config import RunConfig, TrainConfig
from moelab.model import transformer
from moelab.train.schedule import learning_rate

__all__ = ["TrainState", "make_optimizer", "init_state"]


class TrainState(NamedTuple):
    params: Any  # nested dict of float32 arrays
    opt_state: Any
    router_bias: jax.Array  # [L, E] float32, balancing state outside the optimizer
    step: jax.Array  # int32 scalar: steps taken, and the data cursor


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only; norms' gains stay undecayed (the usual AdamW practice)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the configured schedule."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=_decay_mask),
    )


def init_state(cfg: RunConfig) -> TrainState:
    """Fresh state from `cfg.train.seed`: the same seed gives bitwise the same params."""
    params = transformer.init(cfg.model, jax.random.key(cfg.train.seed))
    opt_state = make_optimizer(cfg.train).init(params)
    return TrainState(params, opt_state, transformer.init_router_bias(cfg.model), jnp.zeros((), jnp.int32))
