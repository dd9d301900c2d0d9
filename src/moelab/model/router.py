"""The router: expert scores, biased top-k selection, combine weights and router statistics.

Architecture §3: logits = x @ W_r in float32; scores s = sigmoid(logits) (softmax as an option). The
experts are *selected* by top-k of `s + stop_gradient(bias)`, but *weighted* by the unbiased s of the
chosen experts, renormalized and scaled. The bias is balancing state, not a parameter: it moves
tokens between experts without entering the function the optimizer differentiates.

The balancing rules that move the bias live in `moelab.model.balancing`.

Router statistics (`max_violation`, `routing_entropy`, `router_metrics`) are the one source of the
numbers users read: MaxVio per batch and running, entropy, drop fraction, bias range.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import MoEConfig

__all__ = [
    "drop_fraction",
    "Routing",
    "route",
    "expert_load",
    "max_violation",
    "routing_entropy",
    "logits_and_scores",
    "within_best_groups",
    "LOAD_EMA_DECAY",
    "update_load_ema",
    "router_metrics",
]


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


def logits_and_scores(x: jax.Array, w_router: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    # float32 logits: in bfloat16 near-tied scores flip the top-k choice from step to step.
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), w_router.astype(jnp.float32))
    if cfg.router_score == "softmax":
        return logits, jax.nn.softmax(logits, axis=-1)
    return logits, jax.nn.sigmoid(logits)


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
    logits, scores = logits_and_scores(x, w_router, cfg)
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if cfg.num_groups > 1:
        biased = within_best_groups(biased, cfg.num_groups, cfg.groups_per_token)
    _, expert_idx = jax.lax.top_k(biased, cfg.num_experts_per_token)  # [T, k]
    chosen = jnp.take_along_axis(scores, expert_idx, axis=-1)  # [T, k], unbiased
    if cfg.normalize_weights:
        # The floor only matters if every chosen sigmoid underflowed to 0 (logits below about -88);
        # it turns 0/0 into 0 instead of NaN.
        total = jnp.sum(chosen, axis=-1, keepdims=True)
        chosen = chosen / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    weights = chosen * cfg.routed_scaling
    return Routing(expert_idx.astype(jnp.int32), weights, scores, logits)


def within_best_groups(biased: jax.Array, num_groups: int, groups_per_token: int) -> jax.Array:
    """Group-limited selection (DeepSeek-V3, GLM-4.5: `n_group`, `topk_group`): the E experts form `num_groups`
    equal groups, a group scores the sum of its two best biased scores, and each token chooses only among the
    experts of its `groups_per_token` best groups; the others score 0, as in the reference implementations
    (not -inf: with a negative bias a masked expert can still win, there and here alike; several masked
    experts then tie at 0, and XLA's top-k takes the lowest index where torch's may not).

    Args:
        biased: [T, E] scores plus the balancing bias.

    Returns:
        [T, E], the biased scores where allowed, 0 elsewhere.
    """
    T, E = biased.shape
    size = E // num_groups
    group_scores = jnp.sum(jax.lax.top_k(biased.reshape(T, num_groups, size), 2)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, groups_per_token)  # [T, g]
    keep = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best].set(True)
    return jnp.where(jnp.repeat(keep, size, axis=1), biased, 0.0)


def expert_load(expert_idx: jax.Array, num_experts: int) -> jax.Array:
    """Assignments routed to each expert, before any capacity limit.

    Args:
        expert_idx: [T, k] int32 chosen experts.
        num_experts: E.

    Returns:
        [E] float32 counts; they sum to T * k.
    """
    return jnp.bincount(expert_idx.reshape(-1), length=num_experts).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# router statistics


def max_violation(load: jax.Array) -> jax.Array:
    """MaxVio: how far the busiest expert is above the fair share, relative to it.

        MaxVio = (max_j load_j - mean_j load_j) / mean_j load_j

    The one definition of MaxVio (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
    Mixture-of-Experts"): 0 is perfect balance, E - 1 is every assignment on one expert.

    Args:
        load: [..., E] assignments (or any non-negative weights) per expert.

    Returns:
        [...] float32.

    >>> float(max_violation(jnp.array([3.0, 1.0, 1.0, 1.0])))
    1.0
    """
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return (jnp.max(load, axis=-1) - mean) / jnp.maximum(mean, jnp.finfo(jnp.float32).tiny)


def routing_entropy(scores: jax.Array) -> jax.Array:
    """Mean per-token entropy (nats) of the router's distribution over experts.

    p_ij = s_ij / sum_l s_il (the softmax itself for a softmax router; sigmoid scores normalized),
    H = mean_i (-sum_j p_ij log p_ij). log E means the router cannot tell experts apart; near 0 means
    each token's scores sit on one expert.

    Args:
        scores: [T, E] unbiased scores.

    Returns:
        [] float32.
    """
    p = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return jnp.mean(-jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1))


# ----------------------------------------------------------------------------------------------
# the router's statistics


LOAD_EMA_DECAY = 0.99


def update_load_ema(load_ema: jax.Array, load: jax.Array, decay: float = LOAD_EMA_DECAY) -> jax.Array:
    """ema <- decay * ema + (1 - decay) * load, [L, E]. Starts at zero; MaxVio is scale-free, so the
    start needs no bias correction."""
    return decay * load_ema + (1.0 - decay) * load.astype(jnp.float32)


def drop_fraction(dropped: jax.Array, assignments: jax.Array) -> jax.Array:
    """The share of assignments dropped (per layer, or over layers when both are summed first): the one formula
    behind `drop_fraction`, its `ep` stages and `router/drop_fraction_by_layer`."""
    return dropped / jnp.maximum(assignments, 1.0)


def router_metrics(aux: dict[str, jax.Array], bias: jax.Array, load_ema: jax.Array) -> dict[str, jax.Array]:
    """The router's statistics for the metrics stream: per-layer arrays and scalar summaries.

    Args:
        aux: the transformer's aux of this step (`expert_load` [L, E], `dropped` [L], `assignments`
            [L], `router_entropy` [L], `balance_loss` []).
        bias: [L, E] the bias this step's routing used.
        load_ema: [L, E] the running load *including* this step (`update_load_ema`).

    Returns:
        Per layer: `router/load` [L, E], `router/{maxvio, maxvio_global, entropy, drop_fraction,
        bias_min, bias_max, bias_norm}_by_layer` [L]. Scalars: `router/maxvio` and
        `router/maxvio_global` (means over layers), `router/maxvio_worst` (max over layers),
        `router/entropy` (mean), `router/bias_min`, `router/bias_max` (over all layers),
        `router/aux_loss`.
    """
    bias = bias.astype(jnp.float32)
    per_layer = {
        "maxvio": max_violation(aux["expert_load"]),
        "maxvio_global": max_violation(load_ema),
        "entropy": aux["router_entropy"],
        "drop_fraction": drop_fraction(aux["dropped"], aux["assignments"]),
        "bias_min": jnp.min(bias, axis=-1),
        "bias_max": jnp.max(bias, axis=-1),
        "bias_norm": jnp.sqrt(jnp.sum(jnp.square(bias), axis=-1)),
    }
    return {
        "router/load": aux["expert_load"],
        **{f"router/{name}_by_layer": value for name, value in per_layer.items()},
        "router/maxvio": jnp.mean(per_layer["maxvio"]),
        "router/maxvio_worst": jnp.max(per_layer["maxvio"]),
        "router/maxvio_global": jnp.mean(per_layer["maxvio_global"]),
        "router/entropy": jnp.mean(per_layer["entropy"]),
        "router/bias_min": jnp.min(bias),
        "router/bias_max": jnp.max(bias),
        "router/aux_loss": aux["balance_loss"],
    }
