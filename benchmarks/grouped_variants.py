"""The `grouped` backend with one of its optimisations undone: moe_layer.py's `-rows` and `-unfused` variants.

The library keeps only the winners (a variant is copied here rather than kept as a knob of the kernel);
these copies measure what each optimisation buys, and the tests check that they still compute the
library's function (tests/test_grouped_matmul.py, tests/test_dispatch.py):

- `gmm_rows_fastest`: `moelab.model.grouped_matmul.gmm` launched in the old order, row blocks (in dw,
  experts) fastest, so a wave of programs spans many row blocks and each row block is read from DRAM
  once per column tile instead of once. The kernel bodies are the library's; only the grids differ.
- `grouped(..., fuse_gather=False)`: `moelab.model.dispatch.grouped` gathering the [M, Din]
  expert-sorted rows into memory with `take_rows` before the gate and up kernels, instead of reading
  them from the tokens inside the kernels.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.triton as plgpu
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from moelab.model import dispatch as dispatch_lib
from moelab.model import grouped_matmul
# The library's private pieces, so that a variant differs from it only where its docstring says.
from moelab.model.dispatch import _padded_rows, _stats, combine
from moelab.model.grouped_matmul import _block_kernel, _differentiable, _dw_kernel, _Launch
from moelab.model.rows import take_rows

__all__ = ["gmm_rows_fastest", "grouped"]


# ----------------------------------------------------------------------------------------------
# gmm, row blocks fastest


def _block_matmul(x, w, block_expert, row_index=None, *, block_m, block_c, block_o, transpose_w, compiler, interpret):
    """`grouped_matmul._block_matmul` on the grid (row block, column tile): row blocks launch fastest."""
    gather = row_index is not None
    num_rows, c_dim = row_index.shape[0] if gather else x.shape[0], x.shape[1]
    o_dim = w.shape[1] if transpose_w else w.shape[2]

    def kernel(*refs):
        _block_kernel(pl.program_id(0), pl.program_id(1), *refs, num_experts=w.shape[0], block_c=block_c,
                      transpose_w=transpose_w, gather=gather)

    if gather:
        rows_specs = [pl.BlockSpec(row_index.shape, lambda *g: (0,)), pl.BlockSpec(x.shape, lambda *g: (0, 0))]
    else:
        rows_specs = [pl.BlockSpec((block_m, c_dim), lambda b, j: (b, 0))]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, o_dim), x.dtype),
        grid=(num_rows // block_m, o_dim // block_o),
        in_specs=[pl.BlockSpec(block_expert.shape, lambda *g: (0,)), *rows_specs,
                  pl.BlockSpec(w.shape, lambda *g: (0, 0, 0))],
        out_specs=pl.BlockSpec((block_m, block_o), lambda b, j: (b, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(**compiler),
        name="gmm_dx" if transpose_w else "gmm",
    )(block_expert, *([row_index] if gather else []), x, w)


def _dw(x, dy, group_offsets, num_experts, row_index=None, *, block_m, block_n, block_k, compiler, interpret):
    """`grouped_matmul._dw` on the grid (expert, K tile, N tile): experts launch fastest."""
    gather = row_index is not None
    k_dim, n_dim = x.shape[1], dy.shape[1]

    def kernel(*refs):
        _dw_kernel(pl.program_id(0), pl.program_id(1), pl.program_id(2), *refs, block_m=block_m, gather=gather)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), x.dtype),
        grid=(num_experts, k_dim // block_k, n_dim // block_n),
        in_specs=[pl.BlockSpec(group_offsets.shape, lambda *g: (0,)),
                  *([pl.BlockSpec(row_index.shape, lambda *g: (0,))] if gather else []),
                  pl.BlockSpec(x.shape, lambda *g: (0, 0)), pl.BlockSpec(dy.shape, lambda *g: (0, 0))],
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda e, i, j: (e, i, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(**compiler),
        name="gmm_dw",
    )(group_offsets, *([row_index] if gather else []), x, dy)


_gmm = _differentiable(_block_matmul, _dw)  # the library's custom VJP over these kernels


def gmm_rows_fastest(x, w, block_expert, group_offsets, *, block_m=128, block_n=128, block_k=64, num_warps=4,
                     num_stages=3, gather=None, interpret=None):
    """`grouped_matmul.gmm` (same arguments and result) with row blocks, in dw experts, launched fastest.

    Checks nothing: call `gmm` with the same arguments first for its messages.
    """
    ws = w if isinstance(w, tuple) else (w,)
    row_index, inverse = gather if gather is not None else (None, None)
    if gather is not None:  # as gmm does: the kernel's gathered load is unchecked
        row_index = jnp.minimum(row_index.astype(jnp.int32), x.shape[0] - 1)
        inverse = inverse.astype(jnp.int32)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    launch = _Launch(block_m, block_n, block_k, num_warps, num_stages, interpret)
    ys = _gmm(x, ws, block_expert.astype(jnp.int32), group_offsets.astype(jnp.int32), row_index, inverse, launch)
    return ys if isinstance(w, tuple) else ys[0]


# ----------------------------------------------------------------------------------------------
# the `grouped` backend


def _swiglu_rows_fastest(rows, experts, block_expert, group_offsets, tiles=None, gather=None):
    """`dispatch.grouped_swiglu` (same arguments and result) through `gmm_rows_fastest`."""
    on_gpu = jax.default_backend() == "gpu"

    def matmul(x, w, gather=None):
        one = w[0] if isinstance(w, tuple) else w
        w_tiles = tiles or grouped_matmul.default_tiles(one.shape[1], one.shape[2], on_gpu)
        y = gmm_rows_fastest(x, w, block_expert, group_offsets, gather=gather, **w_tiles)
        return checkpoint_name(y, dispatch_lib.EXPERT_MATMUL)

    gate, up = matmul(rows, (experts["w_gate"], experts["w_up"]), gather)
    return matmul(jax.nn.silu(gate) * up, experts["w_down"])


def grouped(h, routing, experts, tiles: dict | None = None, fuse_gather: bool = True):
    """`moelab.model.dispatch.grouped` (same arguments and result) where `tiles["rows_together"]` False
    launches `gmm_rows_fastest` and `fuse_gather` False gathers the [M, Din] rows first.

    With both True (the defaults) this is the library's `grouped` itself.
    """
    tiles = dict(tiles or {})
    rows_together = tiles.pop("rows_together", True)
    tiles = tiles or None
    if rows_together and fuse_gather:
        return dispatch_lib.grouped(h, routing, experts, tiles)
    swiglu = dispatch_lib.grouped_swiglu if rows_together else _swiglu_rows_fastest
    k = routing.expert_idx.shape[1]
    E, Din, F = experts["w_gate"].shape
    block_m = (tiles or grouped_matmul.default_tiles(Din, F, jax.default_backend() == "gpu"))["block_m"]
    assignment_row, row_assignment, block_expert, group_offsets = _padded_rows(routing.expert_idx, E, block_m)
    M = row_assignment.shape[0]
    if fuse_gather:
        source = jnp.concatenate([h, jnp.zeros((1, Din), h.dtype)])
        readers = jnp.concatenate([assignment_row, jnp.full((k,), M, jnp.int32)])
        y = swiglu(source, experts, block_expert, group_offsets, tiles, gather=(row_assignment // k, readers))
    else:
        x = take_rows(h, row_assignment // k, assignment_row)  # [M, Din]; padding rows are zero
        y = swiglu(x, experts, block_expert, group_offsets, tiles)
    return combine(take_rows(y, assignment_row, row_assignment), routing.weights), _stats(routing, E, 0.0)
