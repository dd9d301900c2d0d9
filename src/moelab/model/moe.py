"""The MoE block: router, optional LatentMoE projection, routed experts, shared experts.

    y = up(dispatch(norm(x @ W_latent_down), route(x))) + shared(x)

The router always reads the full-width x (architecture §3). Under LatentMoE (`cfg.moe.latent_dim` set)
only the routed path runs at the latent width: rows are projected down and RMS-normalized before
dispatch, and the combined output is projected back up. Shared experts are dense SwiGLU MLPs on every
token; the N of them are stored fused as one SwiGLU of width N * shared_dim, which is the same
function with the same parameter count (the hidden units of the N MLPs are simply concatenated).
The routed experts run through one `dispatch` callable, whatever the backend: the caller builds it
(`moelab.parallel.ep.make_dispatch`), so no backend is chosen here behind its back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model import balancing
from moelab.model import fp8 as fp8_lib
from moelab.model import router as router_lib
from moelab.model.dispatch import Dispatch
from moelab.model.layers import INIT_STD, residual_init_std, rms_norm, swiglu
from moelab.model.router import route

__all__ = ["init", "apply"]


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
    out_std = residual_init_std(cfg.num_layers)
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
    *,
    dispatch: Dispatch,
    rebalance: bool | jax.Array = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs the MoE block on a flat batch of tokens.

    Args:
        params: from `init`.
        x: [T, D] normalized block input (float32; the router reads it as is).
        bias: [E] router balancing bias (state; no gradient flows into it).
        cfg: the model config.
        compute_dtype: dtype of the matmuls' inputs (float32 or bfloat16). The router and the latent
            norm's statistics stay float32.
        dispatch: runs the routed experts, `dispatch(h, routing, experts) -> (out, stats)`, from
            `moelab.parallel.ep.make_dispatch(cfg.moe, mesh)` (required: `ep` needs a mesh, and a
            default would pick a backend the caller did not name).
        rebalance: [] bool (or a Python bool): route under the bias solved on this batch
            (`balancing.rebalance_on_batch`) instead of `bias`; a Python False adds nothing to the
            program, a traced flag one `lax.cond`.

    Returns:
        y [T, D] float32 and stats: `load` [E], `dropped` [], `assignments` [], `entropy` [] (the
        routing entropy), plus what the balancing rule measures (`balancing.Balancer.measure`).
    """
    m = cfg.moe
    if rebalance is not False:
        bias = jax.lax.cond(rebalance, lambda b: balancing.rebalance_on_batch(x, params["w_router"], b, m),
                            lambda b: b.astype(jnp.float32), bias)
    routing = route(x, params["w_router"], bias, m)

    def cast(a: jax.Array) -> jax.Array:
        return a.astype(compute_dtype)

    if getattr(dispatch, "fp8", False) != cfg.fp8:
        raise ValueError(f"model.fp8={cfg.fp8}, but the dispatch was built with fp8={getattr(dispatch, 'fp8', False)}: "
                         "build it with make_dispatch / single_device / no_drops(cfg.moe, fp8=cfg.fp8).")
    xc = cast(x)
    if m.latent_dim is not None:
        h = fp8_lib.project("td,dl->tl", xc, cast(params["w_latent_down"]), cfg.fp8)
        h = cast(rms_norm(h, params["latent_norm"], cfg.norm_eps))  # [T, Dl]
    else:
        h = xc  # [T, D]
    experts = {name: cast(params[name]) for name in ("w_gate", "w_up", "w_down")}  # the backend rounds them for FP8

    routed, stats = dispatch(h, routing, experts)

    if m.latent_dim is not None:
        routed = fp8_lib.project("tl,ld->td", cast(routed), cast(params["w_latent_up"]), cfg.fp8)
    y = routed.astype(jnp.float32)

    if m.num_shared_experts > 0:
        y = y + swiglu(xc, *(cast(params[f"w_shared_{name}"]) for name in ("gate", "up", "down")), fp8=cfg.fp8)
    stats = {**stats, "entropy": router_lib.routing_entropy(jax.lax.stop_gradient(routing.scores)),
             **balancing.balancer(m).measure(routing, bias)}
    return y, stats
