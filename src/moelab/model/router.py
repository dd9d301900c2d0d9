"""The router: expert scores, biased top-k selection, combine weights, and router statistics.

Design §3: logits = x @ W_r in float32; scores s = sigmoid(logits) (softmax as an option). The
experts are *selected* by top-k of `s + stop_gradient(bias)`, but *weighted* by the unbiased s of the
chosen experts, renormalized and scaled. The bias is balancing state, not a parameter: it moves
tokens between experts without entering the function the optimizer differentiates.

Balancing rules (quantile bias, sign update, aux loss) will live here too, as functions that read a
`Routing` and return the next bias; none is implemented yet.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import MoEConfig

__all__ = ["Routing", "route", "expert_load"]


class Routing(NamedTuple):
    """Which experts each token goes to and with what weight.

    Attributes:
        expert_idx: [T, k] int32, the chosen experts, best (by biased score) first.
        weights: [T, k] float32, the combine weights of the chosen experts.
        scores: [T, E] float32, unbiased scores (sigmoid or softmax of the logits).
        logits: [T, E] float32, the router logits.
    """

    expert_idx: jax.Array
    weights: jax.Array
    scores: jax.Array
    logits: jax.Array


def route(x: jax.Array, w_router: jax.Array, bias: jax.Array, cfg: MoEConfig) -> Routing:
    """Scores every expert for every token and picks the top k.

    Args:
        x: [T, D] token representations (any float dtype; the router runs in float32).
        w_router: [D, E] router weights.
        bias: [E] balancing bias; it changes which experts are chosen, never their weights, and
            carries no gradient.
        cfg: the MoE config (`num_experts_per_token`, `router_score`, `normalize_weights`,
            `routed_scaling`).

    Returns:
        A `Routing` whose weights sum to `cfg.routed_scaling` per token when
        `cfg.normalize_weights` is set.
    """
    # float32 logits: in bfloat16 near-tied scores flip the top-k choice from step to step.
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), w_router.astype(jnp.float32))
    if cfg.router_score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, expert_idx = jax.lax.top_k(biased, cfg.num_experts_per_token)  # [T, k]
    chosen = jnp.take_along_axis(scores, expert_idx, axis=-1)  # [T, k], unbiased
    if cfg.normalize_weights:
        # The floor only matters if every chosen sigmoid underflowed to 0 (logits below about -88);
        # it turns 0/0 into 0 instead of NaN.
        total = jnp.sum(chosen, axis=-1, keepdims=True)
        chosen = chosen / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    weights = chosen * cfg.routed_scaling
    return Routing(expert_idx.astype(jnp.int32), weights, scores, logits)


def expert_load(expert_idx: jax.Array, num_experts: int) -> jax.Array:
    """Assignments routed to each expert, before any capacity limit.

    Args:
        expert_idx: [T, k] int32 chosen experts.
        num_experts: E.

    Returns:
        [E] float32 counts; they sum to T * k.
    """
    return jnp.bincount(expert_idx.reshape(-1), length=num_experts).astype(jnp.float32)
