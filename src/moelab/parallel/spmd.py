"""The train step's per-device program: the loss and its gradient under one `shard_map` over the mesh.

    value_and_grad = per_device_value_and_grad(loss_fn, mesh, specs, microbatches, accumulate_gradients)
    (loss, aux), grads = value_and_grad(params, tokens, (router_bias, rebalance))   # under jit; grads as `specs`

The layout rule of a rack-scale run (architecture §3): expert parallelism inside a rack, racks data-parallel,
and across racks only gradients, once a step. Left to XLA's partitioner, the step broke it twice: `top_k` is
not split over the batch, so every token's router scores were all-gathered from every device (across the
racks), and the gradient was all-reduced inside every microbatch. Here every device runs the model on its
own rows (`moelab.model.moe.Dispatch.token_axes`: the router picks experts for its own tokens), and the
collectives are the ones written below:
- inside the step, over the rack ("expert"): `ep`'s all-to-alls, and under `rack` / `full` the all-gather of
  each split parameter where it is read (its transpose, a reduce-scatter of its gradient, per microbatch);
- over the whole mesh, small: the balancer's per-expert histogram and ranges, the load counts, the loss;
- once a step, after the microbatches: the gradient. A leaf split over the rack is summed over "replica"
  alone; a whole one is reduce-scattered in the rack, all-reduced across racks in 1/X slices, and
  all-gathered back in the rack, so what crosses racks is one gradient shard whatever `train.microbatches`
  (in `train.grad_reduce_dtype`: float32, or bfloat16 for half the bytes).

Each device differentiates its own loss (its parameters cast to "varying" first, so the gradient is its own
and not summed per microbatch); the step's loss is the mean of equal slices, so its gradient is the sum of
the devices' gradients over their number. The optimizer then runs under jit on the gradients as laid out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moelab.model import transformer
from moelab.parallel.mesh import BATCH_AXES, EXPERT_WEIGHTS

__all__ = ["RACK", "mean_over_devices", "named_axes", "split_in_rack", "gather_split", "layer_gather", "reduce_gradients",
           "per_device_value_and_grad", "per_device_apply"]

RACK = "expert"  # the mesh axis inside a rack (the high-bandwidth domain)


def named_axes(spec: P) -> set[str]:
    """The mesh axes a `PartitionSpec` splits over."""
    found = set()
    for entry in spec:
        found |= set(entry) if isinstance(entry, tuple) else ({entry} if entry is not None else set())
    return found


def split_in_rack(name: str, spec: P, experts_local: bool) -> int | None:
    """The dimension of a parameter named `name` that is split over the rack and must be gathered to be read;
    None when it is read as it is held (whole, or a routed expert's array that `ep` reads as local experts)."""
    if RACK not in named_axes(spec) or (experts_local and name in EXPERT_WEIGHTS):
        return None
    return next(d for d, entry in enumerate(spec) if entry == RACK or (isinstance(entry, tuple) and RACK in entry))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_as_read(shard: jax.Array, dim: int, dtype: jnp.dtype) -> jax.Array:
    """A parameter split over the rack, whole, in `dtype`: the dtype the model reads it in, so a bfloat16 run moves half
    the bytes. Its gradient comes back as autodiff's transpose would send it (a reduce-scatter), but in float32."""
    return jax.lax.all_gather(shard.astype(dtype), RACK, axis=dim, tiled=True)


def _gather_forward(shard, dim, dtype):
    return _gather_as_read(shard, dim, dtype), None


def _gather_backward(dim, dtype, _, cotangent):
    return (jax.lax.psum_scatter(cotangent.astype(jnp.float32), RACK, scatter_dimension=dim, tiled=True),)


_gather_as_read.defvjp(_gather_forward, _gather_backward)


def gather_split(tree: dict[str, Any], specs: dict[str, P], experts_local: bool,
                 compute_dtype: jnp.dtype = jnp.float32) -> dict[str, Any]:
    """`tree`'s leaves split over the rack, all-gathered over it (inside `shard_map`); the rest as they are.

    A weight the model reads only through a cast (`transformer.READ_IN_COMPUTE_DTYPE`) is gathered in
    `compute_dtype`. The gradient of a split parameter comes back split, summed over the rack in float32 (a
    reduce-scatter), per microbatch, inside the rack's links."""
    out = {}
    for name, leaf in tree.items():
        if isinstance(leaf, dict):
            out[name] = gather_split(leaf, specs[name], experts_local, compute_dtype)
            continue
        dim = split_in_rack(name, specs[name], experts_local)
        dtype = compute_dtype if name in transformer.READ_IN_COMPUTE_DTYPE else leaf.dtype
        out[name] = leaf if dim is None else _gather_as_read(leaf, dim, jnp.dtype(dtype))
    return out


def layer_gather(param_specs: dict[str, Any], experts_local: bool,
                 compute_dtype: jnp.dtype = jnp.float32) -> Callable[[dict], dict]:
    """A `transformer.Gather`: one layer's params (a slice of the stacked `layers` or `dense_layers`), split ones
    gathered over the rack where the layer runs. The stacked arrays' specs less their layer axis."""
    names = {}
    for stack in ("layers", "dense_layers"):
        for name, spec in param_specs.get(stack, {}).items():
            names[name] = P(*tuple(spec)[1:])
    return lambda layer: gather_split(layer, names, experts_local, compute_dtype)


def _sum_over(x: jax.Array, axes: tuple[str, ...], mesh_shape: dict[str, int], across_dtype: jnp.dtype) -> jax.Array:
    """`psum` over `axes`; in `across_dtype` when they span racks (more than one "replica"), back in x's dtype."""
    if mesh_shape.get("replica", 1) > 1 and "replica" in axes:
        return jax.lax.psum(x.astype(across_dtype), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def _reduce_leaf(grad: jax.Array, spec: P, mesh_shape: dict[str, int], across_dtype: jnp.dtype) -> jax.Array:
    """The sum over the mesh of one gradient leaf, with what crosses racks kept to one shard (module docstring)."""
    axes = tuple(a for a in mesh_shape if a not in named_axes(spec))
    if not axes:
        return grad
    if RACK not in axes or mesh_shape[RACK] == 1 or len(axes) == 1:
        return _sum_over(grad, axes, mesh_shape, across_dtype)
    # Whole on every device: reduce-scatter in the rack, all-reduce the slice across racks, all-gather it back.
    X = mesh_shape[RACK]
    flat = grad.reshape(-1)
    padded = jnp.pad(flat, (0, -flat.size % X))
    part = jax.lax.psum_scatter(padded, RACK, scatter_dimension=0, tiled=True)
    part = _sum_over(part, tuple(a for a in axes if a != RACK), mesh_shape, across_dtype)
    whole = jax.lax.all_gather(part, RACK, axis=0, tiled=True, to="invarying")
    return whole[:flat.size].reshape(grad.shape)


def reduce_gradients(grads: Any, specs: Any, mesh: Mesh, across_dtype: jnp.dtype = jnp.float32) -> Any:
    """Each device's gradients summed over the mesh, once, each leaf left laid out as `specs` says. Inside a rack in
    float32; across racks in `across_dtype` (`train.grad_reduce_dtype`: bfloat16 sends half the bytes over the
    network, each partial sum rounded to it), back in float32."""
    shape = dict(mesh.shape)
    return jax.tree.map(lambda g, s: _reduce_leaf(g, s, shape, across_dtype), grads, specs,
                        is_leaf=lambda x: isinstance(x, P))


def varying_axes(value: jax.Array) -> frozenset[str]:
    """The mesh axes over which `value` may differ from device to device (inside `shard_map`)."""
    return jax.typeof(value).manual_axis_type.varying


def mean_over_devices(value: jax.Array) -> jax.Array:
    """A per-device value as the mean over the devices it varies across (a step's mean of equal slices)."""
    axes = tuple(sorted(varying_axes(value)))
    return jax.lax.pmean(value, axes) if axes else value


def per_device_value_and_grad(loss_fn: Callable, mesh: Mesh, specs: Any, microbatches: int,
                              accumulate: Callable, across_dtype: jnp.dtype = jnp.float32) -> Callable:
    """`(params, tokens [B, S+1], shared) -> ((loss, aux), grads)` for the whole step, run per device.

    Args:
        loss_fn: `(params, rows, shared) -> (loss, aux)` of one device's rows (`shared`: a pytree every device
            reads whole, such as the router bias), written with named collectives (the model
            under a `Dispatch` with `token_axes`); its loss is that device's mean.
        specs: the params' `PartitionSpec`s; the gradients come out laid out the same.
        accumulate: `(loss_fn, params, rows, microbatches) -> ((loss, aux), grads)`, the microbatch loop
            (`moelab.train.step.accumulate_gradients`), run on this device's rows.
        across_dtype: the dtype the gradient crosses racks in (`reduce_gradients`).

    Returns:
        The step's mean loss, its aux (counts summed over the devices inside the model; every other value
        averaged over them; no `ce_per_row`) and the gradient of the mean loss, laid out as `specs`.
    """
    def local(params, tokens, shared):
        varying = jax.tree.map(
            lambda p: jax.lax.pcast(p, tuple(a for a in mesh.axis_names if a not in varying_axes(p)), to="varying"),
            params)
        (loss, aux), grads = accumulate(lambda p, rows: loss_fn(p, rows, shared), varying, tokens, microbatches)
        grads = jax.tree.map(lambda g: g / mesh.size, reduce_gradients(grads, specs, mesh, across_dtype))
        aux = {k: mean_over_devices(v) for k, v in aux.items() if k != "ce_per_row"}
        return (mean_over_devices(loss), aux), grads

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(BATCH_AXES), P()), out_specs=((P(), P()), specs))


def per_device_apply(fn: Callable, mesh: Mesh, specs: Any) -> Callable:
    """`fn(params, shared, tokens) -> per_row [B]` run per device: tokens and `per_row` split over the batch axes,
    `shared` (e.g. the router bias) whole on every device. For evaluation."""
    return jax.shard_map(fn, mesh=mesh, in_specs=(specs, P(), P(BATCH_AXES)), out_specs=P(BATCH_AXES))
