"""The MoE block: router, optional LatentMoE projection, routed experts, shared experts.

    y = up(dispatch(norm(x @ W_latent_down), route(x))) + shared(x)

The router always reads the full-width x (design §3). Under LatentMoE (`cfg.moe.latent_dim` set)
only the routed path runs at the latent width: rows are projected down and RMS-normalized before
dispatch, and the combined output is projected back up. Shared experts are dense SwiGLU MLPs on every
token; the N of them are stored fused as one SwiGLU of width N * shared_dim, which is the same
function with the same parameter count (the hidden units of the N MLPs are simply concatenated).

Also home of `rms_norm`, which `transformer.py` imports from here (it imports this module, so the
norm cannot live there without an import cycle).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model import dispatch as dispatch_lib
from moelab.model import router as router_lib
from moelab.model.router import Routing, route

__all__ = ["init", "apply", "rms_norm"]

INIT_STD = 0.02

# The expert-parallel backend's call: (h [T, Din], routing, experts, capacity_factor) -> (out, stats).
EPDispatch = Callable[[jax.Array, Routing, dict, float], tuple[jax.Array, dict]]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32.

    Args:
        x: [..., D] any float dtype.
        scale: [D] learned gain.
        eps: added to the mean square.

    Returns:
        [..., D] float32.
    """
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)


def init(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Parameters of one MoE block, float32.

    Returns:
        `w_router` [D, E], `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din] where Din is
        `cfg.expert_input_dim`; with LatentMoE also `w_latent_down` [D, Dl], `latent_norm` [Dl],
        `w_latent_up` [Dl, D]; with shared experts `w_shared_gate` [D, Ns*Fs], `w_shared_up`
        [D, Ns*Fs], `w_shared_down` [Ns*Fs, D].
    """
    m = cfg.moe
    D, E, F, Din = cfg.d_model, m.num_experts, m.expert_dim, cfg.expert_input_dim
    # Projections that write into the residual stream start smaller, so the stream's variance does not
    # grow with depth (GPT-2's 1/sqrt(2L): each layer writes twice).
    out_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    keys = iter(jax.random.split(key, 10))

    def normal(shape, std=INIT_STD):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    params = {
        "w_router": normal((D, E)),
        "w_gate": normal((E, Din, F)),
        "w_up": normal((E, Din, F)),
        "w_down": normal((E, F, Din), out_std if m.latent_dim is None else INIT_STD),
    }
    if m.latent_dim is not None:
        params["w_latent_down"] = normal((D, m.latent_dim))
        params["latent_norm"] = jnp.ones((m.latent_dim,), jnp.float32)
        params["w_latent_up"] = normal((m.latent_dim, D), out_std)
    if m.num_shared_experts > 0:
        Fs = m.num_shared_experts * m.shared_dim
        params["w_shared_gate"] = normal((D, Fs))
        params["w_shared_up"] = normal((D, Fs))
        params["w_shared_down"] = normal((Fs, D), out_std)
    return params


def apply(
    params: dict[str, jax.Array],
    x: jax.Array,
    bias: jax.Array,
    cfg: ModelConfig,
    compute_dtype: jnp.dtype = jnp.float32,
    ep_dispatch: EPDispatch | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs the MoE block on a flat batch of tokens.

    Args:
        params: from `init`.
        x: [T, D] normalized block input (float32; the router reads it as is).
        bias: [E] router balancing bias (state; no gradient flows into it).
        cfg: the model config; `cfg.moe.dispatch` names the backend.
        compute_dtype: dtype of the matmuls' inputs (float32 or bfloat16). The router and the latent
            norm's statistics stay float32.
        ep_dispatch: the expert-parallel backend, required when `cfg.moe.dispatch == "ep"`.

    Returns:
        y [T, D] float32 and stats: `load` [E], `dropped` [], `assignments` [], `entropy` [] (the
        routing entropy), plus what the balancing rule measures (`router_lib.Balancer.measure`).
    """
    m = cfg.moe
    routing = route(x, params["w_router"], bias, m)

    def cast(a: jax.Array) -> jax.Array:
        return a.astype(compute_dtype)

    xc = cast(x)
    if m.latent_dim is not None:
        h = jnp.einsum("td,dl->tl", xc, cast(params["w_latent_down"]))
        h = cast(rms_norm(h, params["latent_norm"], cfg.norm_eps))  # [T, Dl]
    else:
        h = xc  # [T, D]
    experts = {name: cast(params[name]) for name in ("w_gate", "w_up", "w_down")}

    if m.dispatch == "ep":
        # Expert parallelism needs a mesh, so its backend lives in moelab.parallel.ep and is passed in.
        if ep_dispatch is None:
            raise ValueError(
                "model.moe.dispatch='ep' needs the expert-parallel backend from moelab.parallel.ep; "
                "pass it as ep_dispatch=..., or pick dispatch 'dense', 'capacity', 'dropless' or 'grouped' on one device."
            )
        routed, stats = ep_dispatch(h, routing, experts, m.capacity_factor)
    else:
        routed, stats = dispatch_lib.dispatch(m.dispatch, h, routing, experts, m.capacity_factor)

    if m.latent_dim is not None:
        routed = jnp.einsum("tl,ld->td", cast(routed), cast(params["w_latent_up"]))
    y = routed.astype(jnp.float32)

    if m.num_shared_experts > 0:
        gate = jnp.einsum("td,df->tf", xc, cast(params["w_shared_gate"]))
        up = jnp.einsum("td,df->tf", xc, cast(params["w_shared_up"]))
        y = y + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, cast(params["w_shared_down"])).astype(jnp.float32)
    stats = {**stats, "entropy": router_lib.routing_entropy(jax.lax.stop_gradient(routing.scores)),
             **router_lib.balancer(m).measure(routing, bias)}
    return y, stats
