"""FP8 matmuls (`model.fp8`): operands rounded to e4m3 forward, gradients to e5m2 backward, float32 kept.

    y = gradient_fp8(x_q @ w_q),  x_q = forward_fp8(x),  w_q = forward_fp8(w, per tensor)

The recipe of FP8 training on Hopper (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; DeepSeek-V3
trained its MoE so; torchtitan's float8 rowwise): every projection and expert GEMM reads its operands as
e4m3 (4 exponent bits, 3 mantissa bits, max 448) and its output's gradient as e5m2 (5 and 2, max 57344: the
range gradients need), each with *current scaling* (the scale is this tensor's own max |x| over the format's
max, not a history); accumulation, master weights, norms, softmaxes, the router and the lm head stay in the
run's compute dtype or float32.

Activations and gradients are scaled per row (over their last axis, the features), weights per tensor (per
expert for the routed experts'). Per row, each token's rounding depends on that token alone, so every
dispatch backend (`dense` masks, `capacity` pads, `ep` splits rows across devices) rounds every row the same
way and they still compute one function. Projections and `capacity`'s / `ep`'s expert GEMMs are float8
`dot_general`s (`fp8_einsum`); `dense`, `dropless` and `grouped` write the same rounding as quantize-dequantize
around their matmuls (`forward_fp8`, `gradient_fp8`). On a CPU both are exact emulations, for tests; what a GPU
makes of them is measured in the GPU suite, not assumed. Gradients pass the forward rounding straight through
(the straight-through estimator; the scale carries no gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["E4M3", "E5M2", "quantize_dequantize", "forward_fp8", "gradient_fp8", "fp8_einsum", "project",
           "expert_weights", "expert_hidden"]

E4M3 = jnp.float8_e4m3fn  # forward operands
E5M2 = jnp.float8_e5m2  # gradients
_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}  # each format's largest finite value


def _quantize(x: jax.Array, fmt, axis) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `fmt`, scale) with current scaling over `axis` (kept as size-1 dims; None: all of them).

    Computed in float32. The scale is at least float32's smallest normal number: a row whose max is below
    fmt's max times that (6.7e-34 for e5m2) would otherwise get a subnormal scale, which a CPU flushes to zero,
    and 0 / 0 = NaN in a gradient (found by `benchmarks/fp8_error.py`, issue 61); at the floor such a row still
    rounds on fmt's grid, since x / tiny <= amax / tiny < fmt's max. The clip keeps a value that rounding
    pushed past the max from turning into NaN (e4m3fn has no inf)."""
    top = _MAX[jnp.dtype(fmt)]
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    scale = jax.lax.stop_gradient(jnp.maximum(amax / top, jnp.finfo(jnp.float32).tiny))
    return jnp.clip(x32 / scale, -top, top).astype(fmt), scale


def quantize_dequantize(x: jax.Array, fmt, axis: int | tuple[int, ...] | None = -1) -> jax.Array:
    """x rounded to `fmt` with current scaling over `axis` (None: the whole tensor), back in x's dtype.

    scale = max |x| / fmt's max (1 where x is all zero); q = fmt(clip(x / scale)) (`_quantize`); returns q * scale.
    """
    q, scale = _quantize(x, fmt, axis)
    return (q.astype(jnp.float32) * scale).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def forward_fp8(x: jax.Array, axis: int | tuple[int, ...] | None = -1) -> jax.Array:
    """x rounded to e4m3 (scaled over `axis`); its gradient passes through unchanged."""
    return quantize_dequantize(x, E4M3, axis)


def _forward_fwd(x, axis):
    return forward_fp8(x, axis), None


def _forward_bwd(axis, _, g):
    return (g,)


forward_fp8.defvjp(_forward_fwd, _forward_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gradient_fp8(y: jax.Array, axis: int | tuple[int, ...] | None = -1) -> jax.Array:
    """y unchanged; the gradient arriving at it is rounded to e5m2 (scaled over `axis`) before it flows on: what a
    GEMM's backward reads as its output's gradient."""
    return y


def _gradient_fwd(y, axis):
    return y, None


def _gradient_bwd(axis, _, g):
    return (quantize_dequantize(g, E5M2, axis),)


gradient_fp8.defvjp(_gradient_fwd, _gradient_bwd)


def _grad_specs(spec: str) -> tuple[str, str]:
    """For "X,W->Y": the einsums of X's gradient ("Y,W->X") and W's ("X,Y->W")."""
    inputs, y = spec.split("->")
    x, w = inputs.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_einsum(spec: str, w_axes: tuple[int, ...] | None, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` as FP8 GEMMs (float8 operands, float32 accumulation): the forward and x's gradient
    read e4m3 x (scaled per row: over its last axis, the contracted one), e4m3 w (scaled over `w_axes`: None per
    tensor, (1, 2) per expert) and the e5m2 output gradient (per row); the scales multiply the float32 result, so
    they must not vary along a summed axis (true of a projection and of `capacity`'s per-expert batches). w's
    gradient sums over rows, across their scales, so it runs on the dequantized operands in x's dtype. The same
    numbers as `forward_fp8` and `gradient_fp8` around a plain einsum, up to float32 rounding."""
    return _fp8_forward(spec, w_axes, x, w)[0]


def _scales(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """The product of two operands' scales, laid out like `spec`'s output (size 1 where a scale is constant)."""
    return jnp.einsum(spec, a, b)


def _fp8_forward(spec, w_axes, x, w):
    qx, sx = _quantize(x, E4M3, -1)
    qw, sw = _quantize(w, E4M3, w_axes)
    y = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.float32) * _scales(spec, sx, sw)
    dtypes = (x.reshape(-1)[:0], w.reshape(-1)[:0])  # empty slices: the primals' dtypes and mesh axes, for the gradients
    return y.astype(x.dtype), (qx, sx, qw, sw, dtypes)


def _fp8_backward(spec, w_axes, saved, g):
    qx, sx, qw, sw, (x_like, w_like) = saved
    qg, sg = _quantize(g, E5M2, -1)
    dx_spec, dw_spec = _grad_specs(spec)
    dx = jnp.einsum(dx_spec, qg, qw, preferred_element_type=jnp.float32) * _scales(dx_spec, sg, sw)
    x_deq, g_deq = (qx.astype(jnp.float32) * sx).astype(g.dtype), (qg.astype(jnp.float32) * sg).astype(g.dtype)
    dw = jnp.einsum(dw_spec, x_deq, g_deq, preferred_element_type=jnp.float32)
    return _like(dx, x_like), _like(dw, w_like)


def _like(grad: jax.Array, primal_like: jax.Array) -> jax.Array:
    """`grad` in the primal's dtype, summed over the mesh axes it varies along and the primal does not: inside
    `shard_map` an expert's weight is one per "expert" shard while its rows vary over "replica" too, and autodiff
    would have summed those contributions (the transpose of the weight's implicit broadcast)."""
    def vma(a):  # the mesh axes `a` varies along; empty outside `shard_map` (JAX 0.10: manual_axis_type; later: vma)
        aval = jax.typeof(a)
        axes = getattr(aval, "manual_axis_type", None)
        return frozenset(axes.varying) if axes is not None else frozenset(getattr(aval, "vma", ()))

    extra = tuple(sorted(vma(grad) - vma(primal_like)))
    return (jax.lax.psum(grad, extra) if extra else grad).astype(primal_like.dtype)


fp8_einsum.defvjp(_fp8_forward, _fp8_backward)


def project(spec: str, x: jax.Array, w: jax.Array, fp8: bool) -> jax.Array:
    """`jnp.einsum(spec, x, w)`, with `fp8` the FP8 GEMM (`fp8_einsum`): x per row and w per tensor in e4m3, the
    output's gradient per row in e5m2. x's last axis must be the one contracted (every projection here:
    "...d,dh->...h")."""
    if not fp8:
        return jnp.einsum(spec, x, w)
    return fp8_einsum(spec, None, x, w)


def expert_weights(experts: dict[str, jax.Array], fp8: bool) -> dict[str, jax.Array]:
    """The routed experts' [E, a, b] matrices, each expert rounded to e4m3 on its own scale (with `fp8`)."""
    if not fp8:
        return experts
    return {name: forward_fp8(w, (1, 2)) for name, w in experts.items()}


def expert_hidden(gate: jax.Array, up: jax.Array, fp8: bool) -> jax.Array:
    """SwiGLU's silu(gate) * up, the input of the down matmul. With `fp8`, gate's and up's gradients (outputs of
    the gate and up GEMMs) are rounded to e5m2, and the product, the down GEMM's operand, to e4m3, per row."""
    if not fp8:
        return jax.nn.silu(gate) * up
    return forward_fp8(jax.nn.silu(gradient_fp8(gate)) * gradient_fp8(up))
