"""What JAX saves between a function's forward and backward passes: the planner's activation term.

    saved = residuals.of(lambda p, t, b: loss(p, t, b), params, tokens, bias, vocab_size=V)

The list is read off the jaxpr of `jax.vjp`, as `jax.ad_checkpoint.print_saved_residuals` prints it: every
residual that is not an argument, by where it was made (a `scan`'s output: the layer loop's; else the rest).
The caller traces the model as its target compiles it: `memory_plan.activation_bytes` passes the model
`fused_attention` for a GPU (cuDNN's residuals; the real kernel cannot be traced off a GPU) and a GPU's grouped
GEMM tiles (`Dispatch.tiled_for_gpu`). The model keeps no global to patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp

from moelab.parallel import mesh as mesh_lib
from moelab.train.traffic import nbytes

__all__ = ["fused_attention", "Residuals", "saved_residuals", "of"]


@jax.custom_vjp
def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A stand-in for cuDNN's fused attention with its residuals, traced only (never run): the output, [B, S, N, H].

    `jax.nn.dot_product_attention(implementation="cudnn")` keeps q, k, v, its output and the softmax
    statistics ([B, N, S] float32) for the backward pass, and no [S, S] scores. It cannot be traced off a
    GPU, so the planner traces this instead, and XLA's attention (whose scores it would count) nowhere.
    """
    return q * 1


def _fused_attention_forward(q, k, v):
    B, S, N, _ = q.shape
    out = q * 1
    return out, (q, k, v, out, jnp.zeros((B, N, S), jnp.float32))


def _fused_attention_backward(saved, g):
    q, k, v, _, _ = saved
    return g, jnp.zeros_like(k), jnp.zeros_like(v)


fused_attention.defvjp(_fused_attention_forward, _fused_attention_backward)


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[Any, str]]:
    """(abstract value, "argument" | "scan" | "other") of each residual `jax.vjp(fn, *args)` keeps for the backward."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
    jaxpr = closed.jaxpr
    num_residuals = len(jax.tree.leaves(shapes[1]))
    arguments = set(jaxpr.invars)
    made_by = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    found = []
    for var in jaxpr.outvars[len(jaxpr.outvars) - num_residuals:]:
        aval = var.aval
        # `jax.checkpoint` outside a scan saves through a `reduce_precision`: the residual is what it reads.
        while not isinstance(var, jax.extend.core.Literal) and var in made_by \
                and made_by[var].primitive.name == "reduce_precision":
            var = made_by[var].invars[0]
        if isinstance(var, jax.extend.core.Literal):
            found.append((aval, "other"))
        elif var in arguments:
            found.append((aval, "argument"))
        else:
            found.append((aval, "scan" if var in made_by and made_by[var].primitive.name == "scan" else "other"))
    return found


@dataclass(frozen=True)
class Residuals:
    """What JAX saves between a function's forward and backward passes (its residuals), in bytes.

    in_loop: residuals of the layer scan (each layer's, stacked); largest_per_layer: the largest of one
    layer; logits_sized: those shaped like the logits (the loss's softmax), freed once the head's backward
    has run; other: the rest (the head's small residuals, the scan's hoisted loop invariants).
    """

    in_loop: int
    largest_per_layer: int
    logits_sized: int
    other: int

    @property
    def total(self) -> int:
        return self.in_loop + self.logits_sized + self.other


def of(fn: Callable, params: Any, *args: Any, vocab_size: int, experts_split: int = 1) -> Residuals:
    """The residuals of `fn(params, *args)` (`saved_residuals`: what the compiled step keeps alive).

    Arguments are not counted (they are the state). A residual shaped like a routed expert's weight (a
    compute-dtype copy of it) is divided by `experts_split`, the devices the experts are split over.
    """
    expert_shapes = {tuple(leaf.shape[-3:]) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                     if mesh_lib.param_spec(path, leaf) != mesh_lib.P()}
    in_loop = largest = logits_sized = other = 0
    for aval, where in saved_residuals(fn, params, *args):
        if where == "argument":
            continue
        expert_copy = aval.ndim >= 3 and tuple(aval.shape[-3:]) in expert_shapes
        size = nbytes(aval) // (experts_split if expert_copy else 1)
        if where == "scan":
            in_loop += size
            largest = max(largest, size // aval.shape[0])  # stacked over the scan's layers
        elif aval.ndim >= 2 and aval.shape[-1] == vocab_size:
            logits_sized += size
        else:
            other += size
    return Residuals(in_loop, largest, logits_sized, other)
