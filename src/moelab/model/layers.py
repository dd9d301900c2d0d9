"""What the transformer and the MoE block both use: RMSNorm, the dense SwiGLU MLP and the init scales."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moelab.model import fp8 as fp8_lib

__all__ = ["INIT_STD", "residual_init_std", "rms_norm", "swiglu"]

INIT_STD = 0.02  # every weight matrix starts as N(0, INIT_STD^2), except those of `residual_init_std`


def residual_init_std(num_layers: int) -> float:
    """The init std of projections that write into the residual stream (attention's `w_o`, the MoE's
    last matmuls): smaller, so the stream's variance does not grow with depth (GPT-2's 1/sqrt(2L):
    each layer writes twice)."""
    return INIT_STD / math.sqrt(2 * num_layers)


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


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, fp8: bool = False) -> jax.Array:
    """A dense SwiGLU MLP, silu(x @ w_gate) * (x @ w_up) @ w_down (Shazeer 2020), in the operands' dtype.

    Args:
        x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D], all in the compute dtype.
        fp8: the three matmuls in FP8 (`moelab.model.fp8`).

    Returns:
        [T, D] float32.
    """
    gate = fp8_lib.project("td,df->tf", x, w_gate, fp8)
    up = fp8_lib.project("td,df->tf", x, w_up, fp8)
    return fp8_lib.project("tf,fd->td", jax.nn.silu(gate) * up, w_down, fp8).astype(jnp.float32)
