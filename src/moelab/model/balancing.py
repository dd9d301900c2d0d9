"""Balancing rules: how the router's bias moves so that every expert gets its fair share of tokens.

Balancing (`MoEConfig.balancing`) is a `Balancer`: two pure functions, Optax-style. `measure` runs
inside each MoE layer on that step's routing and returns statistics; `update` runs once per train step
and turns the stacked [L, ...] statistics of step t into the bias of step t+1.

- `exact` / `hist`: quantile balancing, the bias that would have given every expert exactly its fair
  share of step t's tokens (`quantile_balancing`, derivation there). `exact` sorts (the reference);
  `hist` reads the quantile off a fixed-bin histogram, one `bincount` and one `psum` when sharded.
- `sign`: b += gamma * sign(mean load - load), the update of Wang et al. 2024 (`sign_balancing`).
- `aux`: no bias; a Switch-style load-balancing loss term (`aux_loss_balancing`).
- `none`: the bias stays zero.

Every bias rule mean-centres each layer's bias (`center_bias`): a constant added to all of a layer's
biases changes no top-k, so the mean carries no information and would only drift.

Why its own module: five rules and the quantile estimators are one idea (moving the bias); the router
(`moelab.model.router`) selects and weights experts under whatever bias it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import MoEConfig
from moelab.model.router import Routing, expert_load, logits_and_scores

__all__ = [
    "selection_margins",
    "fair_share_quantile_exact",
    "fair_share_quantile_hist",
    "center_bias",
    "switch_aux_loss",
    "Balancer",
    "no_balancing",
    "quantile_balancing",
    "rebalance_on_batch",
    "sign_balancing",
    "aux_loss_balancing",
    "balancer",
]


# ----------------------------------------------------------------------------------------------
# quantile balancing: margins and the fair-share quantile


def selection_margins(scores: jax.Array, bias: jax.Array, expert_idx: jax.Array) -> jax.Array:
    """How far each expert's unbiased score is above the bar it must clear to be chosen.

        margin_ij = s_ij - a_ij,   a_ij = k-th largest of {s_il + b_l : l != j}

    Token i chooses expert j iff s_ij + b_j > a_ij, i.e. iff margin_ij > -b_j, and a_ij does not
    depend on b_j. a_ij is the (k+1)-th largest biased score of token i when j is among its top k,
    and the k-th largest when it is not (architecture §3's a_i is the first case). Taking the (k+1)-th for
    every j would put the expert ranked k+1 exactly at margin -b_j, so an underloaded expert's
    quantile would sit on that pile-up instead of on the bar it actually has to clear (on a skewed
    synthetic router that variant ended at running MaxVio 0.03-0.05 where this one reaches 0.005-0.01).

    Args:
        scores: [T, E] unbiased scores.
        bias: [E] the bias the selection used.
        expert_idx: [T, k] the chosen experts (k < E).

    Returns:
        [T, E] float32 margins, gradient-free.

    >>> s = jnp.array([[0.875, 0.5, 0.375, 0.125]])
    >>> idx = jnp.array([[0, 1]])  # the top 2 of s + 0; the bar is 0.375 for them, 0.5 for the others
    >>> print(selection_margins(s, jnp.zeros(4), idx))
    [[ 0.5    0.125 -0.125 -0.375]]
    """
    scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
    biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    k = expert_idx.shape[-1]
    top = jax.lax.top_k(biased, k + 1)[0]  # [T, k+1], descending
    rows = jnp.arange(scores.shape[0])[:, None]
    chosen = jnp.zeros(scores.shape, jnp.bool_).at[rows, expert_idx].set(True)  # [T, E], no [T, k, E] one-hot
    bar = jnp.where(chosen, top[:, k:k + 1], top[:, k - 1:k])  # [T, E]
    return scores - bar


def _fair_share(num_tokens: int, k: int, num_experts: int) -> int:
    """q = ceil(m k / E), at least 1: the assignments one expert gets under perfect balance."""
    return max(1, -(-num_tokens * k // num_experts))


def fair_share_quantile_exact(margins: jax.Array, k: int) -> jax.Array:
    """Per expert, the q-th largest margin over the tokens, q = ceil(m k / E); by sorting (the reference).

    Args:
        margins: [m, E] from `selection_margins`.
        k: experts per token.

    Returns:
        [E] float32.

    >>> m = jnp.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2], [0.2, 0.0]])  # 4 tokens, top-1 of 2
    >>> print(fair_share_quantile_exact(m, k=1))  # the 2nd largest of each column
    [0.2 0.2]
    """
    num_tokens, num_experts = margins.shape
    q = _fair_share(num_tokens, k, num_experts)
    return jnp.sort(margins.astype(jnp.float32), axis=0, descending=True)[q - 1]


def fair_share_quantile_hist(
    margins: jax.Array,
    k: int,
    num_bins: int,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Per expert, the q-th largest margin, q = m k / E, read off a histogram: scales to many devices.

    Each expert's live range [lo_j, hi_j] (over every device) is cut into `num_bins` equal bins of
    width w_j = (hi_j - lo_j) / num_bins; the margins are counted per (expert, bin) with one
    `bincount`, summed over devices with one `psum`, and the quantile is the point where the count
    from the top reaches q, interpolated linearly inside its bin. The q-th largest margin lies in the
    same bin, so the estimate is within one bin width w_j of `fair_share_quantile_exact`. m is the
    global token count, read off the summed histogram.

    Args:
        margins: [T, E] this device's margins.
        k: experts per token.
        num_bins: bins per expert.
        axis_name: the mesh axes the tokens are sharded over, inside `shard_map`; None on one device
            or under plain `jit` (XLA then sums the global histogram itself).

    Returns:
        [E] float32, the same on every device.

    >>> m = jnp.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2], [0.2, 0.0]])
    >>> print(fair_share_quantile_hist(m, k=1, num_bins=1000).round(3))  # within 0.0009 and 0.0006
    [0.2 0.2]
    """
    margins = margins.astype(jnp.float32)
    num_experts = margins.shape[1]
    hi, neg_lo = jnp.max(margins, axis=0), -jnp.min(margins, axis=0)  # [E] each
    if axis_name is not None:
        hi, neg_lo = jax.lax.pmax((hi, neg_lo), axis_name)
    lo = -neg_lo
    # A column whose margins are all equal has no width: put it in bin 0 and answer lo below.
    width = jnp.where(hi > lo, (hi - lo) / num_bins, 1.0)
    bins = jnp.clip(jnp.floor((margins - lo) / width).astype(jnp.int32), 0, num_bins - 1)  # [T, E]
    flat = bins + num_bins * jnp.arange(num_experts, dtype=jnp.int32)
    counts = jnp.bincount(flat.reshape(-1), length=num_experts * num_bins).reshape(num_experts, num_bins)
    rack = _rack_axis(axis_name, num_experts)
    if rack is not None:
        # Over a rack-major mesh, in two steps: reduce-scattered by expert over the rack (the last axis, the fast
        # links), summed over the others in 1/X slices, each device estimating its own experts, then gathered back:
        # what crosses racks is 1/X of the histogram.
        part = jax.lax.psum_scatter(counts, rack, scatter_dimension=0, tiled=True)
        part = jax.lax.psum(part, tuple(a for a in axis_name if a != rack))
        mine = jax.lax.axis_index(rack) * part.shape[0] + jnp.arange(part.shape[0])
        estimate = _quantile_from_counts(part, k, num_experts, lo[mine], hi[mine], width[mine])
        return jax.lax.all_gather(estimate, rack, axis=0, tiled=True, to="invarying")
    if axis_name is not None:
        counts = jax.lax.psum(counts, axis_name)
    return _quantile_from_counts(counts, k, num_experts, lo, hi, width)


def _rack_axis(axis_name: str | tuple[str, ...] | None, num_experts: int) -> str | None:
    """The axis to reduce-scatter a histogram over first: the last of several (the mesh's rack axis, `expert`), when
    it has more than one device and splits the experts evenly; None to sum it in one step."""
    if not isinstance(axis_name, tuple) or len(axis_name) < 2:
        return None
    size = jax.lax.axis_size(axis_name[-1])
    return axis_name[-1] if size > 1 and num_experts % size == 0 else None


def _quantile_from_counts(counts: jax.Array, k: int, num_experts: int, lo: jax.Array, hi: jax.Array,
                          width: jax.Array) -> jax.Array:
    """`fair_share_quantile_hist`'s estimate for the experts whose summed histograms are `counts` [e, B]."""
    # Counts stay int32 until here (exact under psum: at most the global token count per bin).
    at_or_above = jnp.cumsum(counts[:, ::-1], axis=-1)[:, ::-1].astype(jnp.float32)  # [E, B]: in bin b or higher
    q = at_or_above[:, 0] * (k / num_experts)  # [E]: m k / E
    b = jnp.sum(at_or_above >= q[:, None], axis=-1) - 1  # the highest bin whose count from the top reaches q
    in_bin = jnp.take_along_axis(counts, b[:, None], axis=-1)[:, 0].astype(jnp.float32)
    above = jnp.take_along_axis(at_or_above, b[:, None], axis=-1)[:, 0] - in_bin
    top_edge = lo + width * (b + 1).astype(jnp.float32)
    estimate = top_edge - width * (q - above) / in_bin
    return jnp.where(hi > lo, estimate, lo)


def center_bias(bias: jax.Array) -> jax.Array:
    """Subtracts each layer's mean bias: [..., E] -> [..., E] with mean 0 over E.

    A constant added to all of a layer's biases changes no top-k, so removing the mean changes no
    routing; it only keeps the bias from drifting.
    """
    return bias - jnp.mean(bias, axis=-1, keepdims=True)


def switch_aux_loss(routing: Routing, axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """The Switch Transformer load-balancing loss of one layer (Fedus et al. 2021, eq. 4), for top-k.

        loss = E * sum_j f_j P_j,   f_j = load_j / (T k),   P_j = mean_i p_ij,

    with p_ij the router's distribution over experts (softmax, or sigmoid scores normalized per token).
    It is 1 at perfect balance and grows as load and probability mass pile onto the same experts.
    The gradient flows through P (f is a count). Multiply by a weight (1e-2 in Switch).

    With `axis_name` (inside `shard_map`, the tokens split over those axes), f is the whole step's load and P this
    device's mean: the loss is the mean over the devices of what each returns, so no score leaves a device.

    Returns:
        [] float32.
    """
    T, k = routing.expert_idx.shape
    E = routing.scores.shape[-1]
    load = expert_load(routing.expert_idx, E)
    if axis_name is not None:
        load = jax.lax.psum(load, axis_name)
    f = load / jnp.sum(load)
    p = routing.scores / jnp.maximum(jnp.sum(routing.scores, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return E * jnp.sum(f * jnp.mean(p, axis=0))


# ----------------------------------------------------------------------------------------------
# balancing rules


class Balancer(NamedTuple):
    """A balancing rule as two pure functions (the Optax `GradientTransformation` pattern).

    measure(routing, bias [E]) -> {name: array}: inside each MoE layer, on that step's routing; the
        transformer stacks the values over layers into its aux (`bias_target` [L, E] for the quantile
        rules, `balance_loss` for `aux`, nothing for the others).
    update(bias [L, E], aux) -> bias [L, E]: once per train step, from the step's aux (the
        transformer's `expert_load` [L, E] and whatever `measure` returned); the result is the bias of
        the *next* step.
    """

    measure: Callable[[Routing, jax.Array], dict[str, jax.Array]]
    update: Callable[[jax.Array, dict[str, jax.Array]], jax.Array]


def _measure_nothing(routing: Routing, bias: jax.Array) -> dict[str, jax.Array]:
    return {}


def no_balancing() -> Balancer:
    """The bias stays where it is (zero from `init_router_bias`)."""
    return Balancer(_measure_nothing, lambda bias, aux: bias)


def quantile_balancing(
    estimator: str = "hist",
    num_bins: int = 256,
    rate: float | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Balancer:
    """Quantile balancing: each step, move every expert's bias to where it would have had its fair share.

    Derivation. With margins m_ij = s_ij - a_ij (`selection_margins`: unbiased score minus the bar set
    by the *biased* scores of the other experts), token i chooses j iff m_ij > -b_j, and a_ij does
    not depend on b_j. So with the other biases fixed, expert j gets exactly the fair share
    q = m k / E of the step's m tokens when -b_j is the q-th largest margin:

        b*_j = -Q_j,   Q_j = q-th largest of {m_ij : i}.

    b* is a target, not a step: it does not depend on b_j, so it *replaces* b_j. (With biased
    margins s_ij + b_j - a_ij the same solution is the step b_j - Q_j; adding -Q_j to b_j on top of
    the unbiased margins would count b_j twice.) The scores stay unbiased in the margin because b_j
    is the unknown; the bar is biased because the other experts compete with their biases on.

    All experts move at once, and each target assumes the others stand still. Linearize: expert j's
    load has slope g in b_j and, since the k T assignments are conserved, about -g / (E - 1) in each
    other bias. Replacing every bias then turns a load error e_j into -e_j / (E - 1): it overshoots,
    and for E = 2 it flips back and forth forever. Blending

        b_{t+1} = center(b_t + rate * (b*_t - b_t))

    maps e_j to (1 - rate E / (E - 1)) e_j, which vanishes at rate = (E - 1) / E: the default.
    `center_bias` then removes the layer mean (no routing changes). b*_t comes from the scores of step
    t (under b_t); b_{t+1} is used at step t+1. The one-step lag is the rule's limit: while the router
    weights move more per step than the margins spread across tokens (the warmup of the `tiny`
    preset, when all tokens' scores move together), the bias trails and MaxVio stays high until the
    router settles.

    Reference: architecture §3; the bias-only (loss-free) balancing of Wang et al. 2024, "Auxiliary-Loss-Free
    Load Balancing Strategy for Mixture-of-Experts", with their sign step replaced by a quantile
    solve.

    Args:
        estimator: "exact" (sort; the reference) or "hist" (`fair_share_quantile_hist`).
        num_bins: histogram bins per expert (hist only).
        rate: weight of the new target; None: (E - 1) / E.
        axis_name: mesh axes the tokens are sharded over inside `shard_map` (hist only); None otherwise.

    >>> from moelab.model.router import route
    >>> cfg = MoEConfig(num_experts=2, num_experts_per_token=1)
    >>> logits = jnp.array([[2.0, 0.0], [1.0, 0.5], [0.4, 0.2], [0.3, -1.0]])  # expert 0 wins all 4
    >>> rule, bias = quantile_balancing("exact"), jnp.zeros(2)
    >>> routing = route(logits, jnp.eye(2), bias, cfg)
    >>> stats = rule.measure(routing, bias)                   # per layer: bias_target [E]
    >>> bias = rule.update(bias[None], {"bias_target": stats["bias_target"][None]})[0]
    >>> print(bias.round(3))                                  # mean 0; expert 0 pushed down
    [-0.104  0.104]
    >>> expert_load(route(logits, jnp.eye(2), bias, cfg).expert_idx, 2).tolist()
    [2.0, 2.0]
    """
    if estimator not in ("exact", "hist"):
        raise ValueError(f"estimator={estimator!r} must be 'exact' or 'hist'.")

    def measure(routing: Routing, bias: jax.Array) -> dict[str, jax.Array]:
        return {"bias_target": _bias_target(routing.scores, bias, routing.expert_idx, estimator, num_bins, axis_name)}

    def update(bias: jax.Array, aux: dict[str, jax.Array]) -> jax.Array:
        return _blend(bias, aux["bias_target"], rate)

    return Balancer(measure, update)


def _bias_target(scores, bias, expert_idx, estimator, num_bins, axis_name=None) -> jax.Array:
    """b* = -Q, the fair-share quantile of the selection margins (`quantile_balancing`), [E]."""
    margins = selection_margins(scores, bias, expert_idx)
    k = expert_idx.shape[-1]
    if estimator == "exact":
        if axis_name is not None:  # the config refuses it first (`RunConfig`)
            raise ValueError("the exact quantile sorts every token's margins on one device; under a mesh use 'hist'.")
        return -fair_share_quantile_exact(margins, k)
    return -fair_share_quantile_hist(margins, k, num_bins, axis_name)


def _blend(bias: jax.Array, target: jax.Array, rate: float | None) -> jax.Array:
    """center(b + rate (b* - b)), rate None: (E - 1) / E (`quantile_balancing`)."""
    num_experts = bias.shape[-1]
    r = (num_experts - 1) / num_experts if rate is None else rate
    return center_bias(bias + r * (target - bias))


def rebalance_on_batch(x: jax.Array, w_router: jax.Array, bias: jax.Array, cfg: MoEConfig,
                       axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """The bias that balances *this* batch: `cfg.rebalance_iterations` quantile steps on its own scores.

    Why: at initialization a sequence's tokens share most of their direction (attention's output is
    close to the running mean of the sequence), so each batch asks for its own few experts and the
    bias measured on step t does not fit step t+1 (issue 39: gpu-small kept next-batch MaxVio 3-7 and
    dropped 30-65% of its assignments for 20 steps). Solved on the batch itself, the same quantile rule
    leaves no expert past its capacity. Selection only: the bias carries no gradient, so the function
    the optimizer differentiates is the same; but a token's experts now depend on the other tokens of
    its batch, as capacity drops already do. `moe.apply` uses it for the first
    `cfg.rebalance_steps` steps; each step's bias then starts from the carried one.

    Args:
        x: [T, D] the router's input.
        w_router: [D, E] router weights.
        bias: [E] the carried bias, the first iterate.
        cfg: the MoE config; its rule must be quantile balancing (`exact` or `hist`).
        axis_name: the axes the tokens are split over inside `shard_map` (`hist` only), as in `quantile_balancing`.

    Returns:
        [E] float32, mean zero, gradient-free.
    """
    _, scores = logits_and_scores(jax.lax.stop_gradient(x), jax.lax.stop_gradient(w_router), cfg)
    bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
    k = cfg.num_experts_per_token
    for _ in range(cfg.rebalance_iterations):
        _, expert_idx = jax.lax.top_k(scores + bias, k)
        target = _bias_target(scores, bias, expert_idx, cfg.balancing, cfg.hist_bins, axis_name)
        bias = _blend(bias, target, cfg.balance_rate)
    return bias


def sign_balancing(gamma: float = 1e-3) -> Balancer:
    """The sign update of Wang et al. 2024 (DeepSeek-V3's bias balancing): a fixed step per expert.

        b_{t+1} = center(b_t + gamma * sign(mean_j load_j - load))

    Underloaded experts move up and overloaded ones down by gamma each step, whatever the size of the
    imbalance: it needs about |b*| / gamma steps to reach a bias b*.
    """

    def update(bias: jax.Array, aux: dict[str, jax.Array]) -> jax.Array:
        load = aux["expert_load"]
        return center_bias(bias + gamma * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load))

    return Balancer(_measure_nothing, update)


def aux_loss_balancing(weight: float = 1e-2, axis_name: str | tuple[str, ...] | None = None) -> Balancer:
    """No bias; each layer adds `weight * switch_aux_loss` to the training loss (`balance_loss`)."""

    def measure(routing: Routing, bias: jax.Array) -> dict[str, jax.Array]:
        return {"balance_loss": weight * switch_aux_loss(routing, axis_name)}

    return Balancer(measure, lambda bias, aux: bias)


def balancer(cfg: MoEConfig, axis_name: str | tuple[str, ...] | None = None) -> Balancer:
    """The rule `cfg.balancing` names, with its settings from `cfg`."""
    if cfg.balancing in ("exact", "hist"):
        return quantile_balancing(cfg.balancing, cfg.hist_bins, cfg.balance_rate, axis_name)
    if cfg.balancing == "sign":
        return sign_balancing(cfg.sign_gamma)
    if cfg.balancing == "aux":
        return aux_loss_balancing(cfg.aux_loss_weight, axis_name)
    return no_balancing()


# ----------------------------------------------------------------------------------------------
# router metrics

# The running load behind `router/maxvio_global` is an exponential moving average over about the last
# 1 / (1 - decay) = 100 steps: long enough to average out one batch's sampling noise, short enough
# that the first steps' imbalance is forgotten in a run of a few hundred steps.
