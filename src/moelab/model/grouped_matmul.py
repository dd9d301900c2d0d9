"""Block-padded grouped matrix multiply for MoE experts: a Pallas (Triton) kernel with a custom VJP.

`jax.lax.ragged_dot` on GPU falls back to a dense masked product (~10 TFLOP/s on an H200), so the
dropless expert path needs its own grouped GEMM. We make the groups easy for a kernel: rows are sorted
by expert and each expert's group is padded with zero rows up to a multiple of `block_m`, so every row
block of `block_m` rows belongs to exactly one expert:

    rows      | e0 e0 e0 0 | e2 e2 e2 e2 | e2 e2 0 0 | e3 0 0 0 | 0 0 0 0 |     (block_m = 4, e1 empty)
    block_expert    0            2             2           3          4 (= E: unused, output zeros)
    group_offsets [0, 1, 1, 3, 4]                                  (expert e owns blocks go[e] .. go[e+1])

`padded_layout` builds this layout from per-expert counts, `default_tiles` picks the tile sizes. `gmm` is then a grid over (column tile, row
block); each program reads its expert id from `block_expert` and multiplies its rows by that expert's
weight tile, accumulating in float32. The backward pass reuses the same kernel with the weight tile
read transposed (dx = dy w[e]^T) and adds a second kernel over (K tile, N tile, expert) that sums
x_b^T dy_b over the expert's row blocks (dw).

Launch order is about DRAM traffic, not correctness. The first grid axis varies fastest in launch order,
so the programs that share a row block (all its column tiles) run together and read its rows from
DRAM once, through L2; one expert's whole weight (a few MiB) stays in L2 across its row blocks. With
row blocks fastest instead, a wave of programs spans hundreds of row blocks (over 100 MiB of rows at
the issue's layer shape, against 60 MB of L2), so x is re-read from DRAM once per column tile: 8-32
times per matmul, more bytes than the matmul's arithmetic can hide. `dw` likewise runs one expert's
(K tile, N tile) programs together, so the expert's rows of x and dy are read once. The old order
(row blocks, in dw experts, fastest) survives as a benchmark variant, `benchmarks/grouped_variants.py`:
the kernel bodies take their tile ids as arguments, so only the launch grids differ there.

The Triton backend cannot read array values in BlockSpec index maps (no scalar prefetch), so `w`, the
integer arrays and, in the dw kernel, `x` and `dy` are passed whole and sliced inside the kernel with
`pl.ds` at offsets computed from the loaded expert id or group offsets.

On GPU, float32 inputs multiply in TF32 (the lowering's DEFAULT precision); bf16 is the target dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.triton as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from moelab.model.rows import sum_readers

__all__ = ["GPU_ROW_TILE", "MIN_TILE", "default_tiles", "gmm", "gmm_reference", "padded_layout"]

_NN = (((1,), (0,)), ((), ()))  # [m, c] x [c, o] -> [m, o]
_NT = (((1,), (1,)), ((), ()))  # [m, c] x [o, c] -> [m, o]: the weight tile read transposed
_TN = (((0,), (0,)), ((), ()))  # [m, k] x [m, n] -> [k, n]: x^T dy
# The Triton lowering computes element offsets in int32, so a larger operand would silently wrap.
_MAX_ELEMENTS = 2**31 - 1
# Triton tiles: the lowering rejects loads whose size is not a power of two, and tl.dot needs each
# dimension >= 16 (the MMA instruction shape), so `grouped` needs widths that are multiples of 16.
MIN_TILE = 16
# The row tile on a GPU: 128 rows fill an H100/H200 MMA tile; the padding costs at most 127 rows per
# expert (E * 127 of T * k + E * 127, ~6% at 64 experts and 16k tokens top-8).
GPU_ROW_TILE = 128


def _largest_tile(dim: int, most: int) -> int:
    """The largest power of two <= `most` that divides `dim` (at least MIN_TILE)."""
    tile = most
    while tile > MIN_TILE and dim % tile:
        tile //= 2
    return tile


def default_tiles(k_dim: int, n_dim: int, on_gpu: bool) -> dict[str, int]:
    """`gmm` tiles for a [rows, K] x [K, N] expert matmul: columns up to 128, contraction up to 64.

    Widths must be multiples of 16 (`ModelConfig` checks this for `grouped`). Each matmul gets its own
    (gate/up: K = Din, N = F; down: K = F, N = Din), so a narrow width does not shrink the other's
    tiles. Off the GPU the row tile is 16: the interpreter pays per row of padding, not per program.
    """
    return {"block_m": GPU_ROW_TILE if on_gpu else MIN_TILE,
            "block_n": _largest_tile(n_dim, 128), "block_k": _largest_tile(k_dim, 64)}


def padded_layout(counts: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """The block-padded layout of expert-sorted rows, for `gmm`.

    Args:
        counts: [E] int32 rows per expert; must sum to `num_rows` (not checked: traced).
        num_rows: static number of expert-sorted rows.
        block_m: rows per block.

    Returns:
        row_of_sorted: [num_rows] int32, the padded row of the i-th expert-sorted row (expert e's r-th
            row goes to block_m * group_offsets[e] + r).
        block_expert: [num_padded_rows // block_m] int32, each block's expert; E for unused blocks.
        group_offsets: [E + 1] int32, the first block of each expert; group_offsets[E] = used blocks.
        num_padded_rows: static, round_up(num_rows + E * (block_m - 1), block_m): each expert wastes
            at most block_m - 1 rows, so every routing fits.
    """
    num_experts = counts.shape[0]
    num_padded_rows = -(-(num_rows + num_experts * (block_m - 1)) // block_m) * block_m
    counts = counts.astype(jnp.int32)
    blocks_per_expert = (counts + block_m - 1) // block_m
    group_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks_per_expert, dtype=jnp.int32)])
    row_ends = jnp.cumsum(counts, dtype=jnp.int32)  # end of each expert's group among the sorted rows
    sorted_idx = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.searchsorted(row_ends, sorted_idx, side="right").astype(jnp.int32)
    row_of_sorted = block_m * group_offsets[expert] + sorted_idx - (row_ends - counts)[expert]
    # A block's expert is the number of experts whose blocks end at or before it: E past the last.
    blocks = jnp.arange(num_padded_rows // block_m, dtype=jnp.int32)
    block_expert = jnp.searchsorted(group_offsets[1:], blocks, side="right").astype(jnp.int32)
    return row_of_sorted, block_expert, group_offsets, num_padded_rows


def gmm_reference(x: jax.Array, w: jax.Array, block_expert: jax.Array) -> jax.Array:
    """`gmm` in plain jnp (a weight gather per block): the test oracle. x [M, K], w [E, K, N] -> [M, N]."""
    num_blocks = block_expert.shape[0]
    xb = x.reshape(num_blocks, -1, x.shape[1])
    used = block_expert < w.shape[0]
    wb = w[jnp.where(used, block_expert, 0)] * used[:, None, None].astype(w.dtype)
    y = jnp.einsum("bmk,bkn->bmn", xb, wb, preferred_element_type=jnp.float32)
    return y.reshape(x.shape[0], w.shape[2]).astype(x.dtype)


def _block_kernel(b, j, *refs, num_experts: int, block_c: int, transpose_w: bool, gather: bool):
    """Tile j of row block b, [bm, bo], of y = x_b @ W, W = w[e] ([C, O]) or w[e]^T (w[e] is [O, C]),
    e = block_expert[b].

    x_b is the b-th block of x's rows, or, with `gather`, the rows row_index[b-th block] of x.
    """
    block_expert_ref, *row_index_ref, x_ref, w_ref, y_ref = refs
    e = block_expert_ref[b]
    block_m, block_o = y_ref.shape
    cols = pl.ds(j * block_o, block_o)

    @pl.when(e < num_experts)
    def _():
        # x_ref is this row block (BlockSpec), or with `gather` all of x and the block's rows are listed.
        rows = row_index_ref[0][pl.ds(b * block_m, block_m)] if gather else slice(None)

        def accumulate(c, acc):
            step = pl.ds(c * block_c, block_c)
            lhs = x_ref[rows, step]
            if transpose_w:  # tt.trans of the loaded tile: Triton feeds it to the MMA without a copy of w.
                acc += lax.dot_general(lhs, w_ref[e, cols, step], _NT, preferred_element_type=jnp.float32)
            else:
                acc += lax.dot_general(lhs, w_ref[e, step, cols], _NN, preferred_element_type=jnp.float32)
            return acc

        num_steps = x_ref.shape[1] // block_c  # static, so the loop is an scf.for Triton can pipeline
        acc = lax.fori_loop(0, num_steps, accumulate, jnp.zeros((block_m, block_o), jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)

    @pl.when(e >= num_experts)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def _block_matmul(x, w, block_expert, row_index=None, *, block_m, block_c, block_o, transpose_w, compiler, interpret):
    """[M, C] x (w [E, C, O] or, transposed, [E, O, C]) per row block -> [M, O] in x.dtype.

    With `row_index` [M], the M rows are x[row_index] (x is [R, C]), gathered inside the kernel.
    The grid is (column tile, row block): a row block's column tiles launch together.
    """
    gather = row_index is not None
    num_rows, c_dim = row_index.shape[0] if gather else x.shape[0], x.shape[1]
    o_dim = w.shape[1] if transpose_w else w.shape[2]

    def kernel(*refs):
        _block_kernel(pl.program_id(1), pl.program_id(0), *refs, num_experts=w.shape[0], block_c=block_c,
                      transpose_w=transpose_w, gather=gather)

    if gather:  # the index, and x whole: the kernel picks its rows
        rows_specs = [pl.BlockSpec(row_index.shape, lambda *g: (0,)), pl.BlockSpec(x.shape, lambda *g: (0, 0))]
    else:
        rows_specs = [pl.BlockSpec((block_m, c_dim), lambda j, b: (b, 0))]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, o_dim), x.dtype),
        grid=(o_dim // block_o, num_rows // block_m),
        in_specs=[
            pl.BlockSpec(block_expert.shape, lambda *g: (0,)),
            *rows_specs,
            pl.BlockSpec(w.shape, lambda *g: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((block_m, block_o), lambda j, b: (b, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(**compiler),
        name="gmm_dx" if transpose_w else "gmm",
    )(block_expert, *([row_index] if gather else []), x, w)


def _dw_kernel(e, i, j, *refs, block_m: int, gather: bool):
    """Tile (i, j), [bk, bn], of dw[e] = sum over expert e's row blocks b of x_b^T dy_b (zeros if none);
    x_b gathered through row_index as in `_block_kernel`."""
    group_offsets_ref, *row_index_ref, x_ref, dy_ref, dw_ref = refs
    block_k, block_n = dw_ref.shape

    def accumulate(b, acc):
        rows = pl.ds(b * block_m, block_m)
        xb = x_ref[row_index_ref[0][rows] if gather else rows, pl.ds(i * block_k, block_k)]
        dyb = dy_ref[rows, pl.ds(j * block_n, block_n)]
        return acc + lax.dot_general(xb, dyb, _TN, preferred_element_type=jnp.float32)

    # Dynamic trip count; the Triton lowering still emits an scf.for (fori_loop pattern).
    first, end = group_offsets_ref[e], group_offsets_ref[e + 1]
    acc = lax.fori_loop(first, end, accumulate, jnp.zeros((block_k, block_n), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _dw(x, dy, group_offsets, num_experts, row_index=None, *, block_m, block_n, block_k, compiler, interpret):
    """dw [E, K, N] in x.dtype from x [M, K] (or x [R, K] read through row_index [M]) and dy [M, N].

    The grid is (K tile, N tile, expert): an expert's tiles launch together.
    """
    gather = row_index is not None
    k_dim, n_dim = x.shape[1], dy.shape[1]

    def kernel(*refs):
        _dw_kernel(pl.program_id(2), pl.program_id(0), pl.program_id(1), *refs, block_m=block_m, gather=gather)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), x.dtype),
        grid=(k_dim // block_k, n_dim // block_n, num_experts),
        in_specs=[
            pl.BlockSpec(group_offsets.shape, lambda *g: (0,)),
            *([pl.BlockSpec(row_index.shape, lambda *g: (0,))] if gather else []),
            pl.BlockSpec(x.shape, lambda *g: (0, 0)),
            pl.BlockSpec(dy.shape, lambda *g: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda i, j, e: (e, i, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(**compiler),
        name="gmm_dw",
    )(group_offsets, *([row_index] if gather else []), x, dy)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """How the three kernels run (hashable: the custom VJP's static argument)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    interpret: bool

    def kernel_args(self) -> dict:
        return {"interpret": self.interpret, "compiler": {"num_warps": self.num_warps, "num_stages": self.num_stages}}


def _differentiable(block_matmul, dw):
    """The grouped matmul with its custom VJP, from the kernels' launchers: `block_matmul` runs the
    forward and dx kernels, `dw` the weight-gradient kernel (`_block_matmul` and `_dw` here; the
    benchmarks build the old launch order from their own)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def matmul(x, ws, block_expert, group_offsets, row_index, inverse, launch: _Launch):
        """x times each weight of the tuple `ws`: a tuple of outputs."""
        return tuple(block_matmul(x, w, block_expert, row_index, block_m=launch.block_m, block_c=launch.block_k,
                                  block_o=launch.block_n, transpose_w=False, **launch.kernel_args()) for w in ws)

    def forward(x, ws, block_expert, group_offsets, row_index, inverse, launch: _Launch):
        ys = matmul(x, ws, block_expert, group_offsets, row_index, inverse, launch)
        return ys, (x, ws, block_expert, group_offsets, row_index, inverse)

    def backward(launch: _Launch, residuals, dys):
        x, ws, block_expert, group_offsets, row_index, inverse = residuals
        # dx contracts over N in block_n steps and writes block_k-wide column tiles of K, one row per
        # block-layout row. The weights' terms add first, in x's dtype, as autodiff would add the
        # gradients of separate matmuls; gathered rows are then summed into x's rows by their readers.
        dx = functools.reduce(jnp.add, [
            block_matmul(dy, w, block_expert, block_m=launch.block_m, block_c=launch.block_n,
                         block_o=launch.block_k, transpose_w=True, **launch.kernel_args()) for w, dy in zip(ws, dys)])
        if row_index is not None:
            dx = sum_readers(dx, inverse, x.shape[0])
        dws = tuple(dw(x, dy, group_offsets, w.shape[0], row_index, block_m=launch.block_m, block_n=launch.block_n,
                       block_k=launch.block_k, **launch.kernel_args()) for w, dy in zip(ws, dys))
        return dx, dws, None, None, None, None  # integer inputs: no cotangent

    matmul.defvjp(forward, backward)
    return matmul


_gmm = _differentiable(_block_matmul, _dw)


def _check_tile(name: str, tile: int, dim_name: str, dim: int) -> None:
    if tile < MIN_TILE or tile & (tile - 1):
        raise ValueError(f"{name}={tile} must be a power of two >= {MIN_TILE} (Triton tile); try 64 or 128.")
    if dim % tile:
        raise ValueError(f"{dim_name}={dim} is not divisible by {name}={tile}; pick a {name} that divides {dim_name}.")


def gmm(
    x: jax.Array,
    w: jax.Array | tuple[jax.Array, ...],
    block_expert: jax.Array,
    group_offsets: jax.Array,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    gather: tuple[jax.Array, jax.Array] | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
    """Grouped matmul over block-padded expert groups: y_b = x_b @ w[block_expert[b]] per row block b.

    Differentiable in x and w; accumulates in float32. Build the layout with `padded_layout`.

    Args:
        x: [M, K], rows sorted by expert and padded per expert to a multiple of block_m.
        w: [E, K, N] expert weights, same dtype as x; or a tuple of such weights, all one shape (a
            SwiGLU's gate and up), for one output each: x's gradient is then summed over them once,
            before the readers' sum of `gather`.
        block_expert: [M // block_m] int32, non-decreasing; E marks an unused block (output zeros),
            allowed only after the used ones.
        group_offsets: [E + 1] int32, the first row block of each expert; group_offsets[E] is the
            number of used blocks.
        block_m, block_n, block_k: tile sizes; powers of two >= 16 dividing M, N and K.
        num_warps, num_stages: Triton's launch and software-pipelining depth (GPU only); the
            defaults fit 128 x 128 x 64 bf16 tiles in an H100/H200's shared memory.
        gather: (row_index [M], inverse [R * m]) fuses the dispatch gather into the kernels: x is
            then the [R, K] source (tokens) and row r of the block layout is x[row_index[r]], so the
            [M, K] rows never exist in memory. Indices past the last row read the last row (they are
            clamped, so no kernel reads outside x): make x's last row zero for padding rows.
            `inverse` lists each source row's m readers, as `moelab.model.rows.take_rows`
            documents (len(x) ... reads zero); dx is summed over them.
        interpret: None runs the Pallas interpreter unless the default backend is a GPU.

    Returns:
        y: [M, N] in x.dtype, or a tuple of them for a tuple `w`.
    """
    several = isinstance(w, tuple)
    ws = w if several else (w,)
    w = ws[0]
    num_rows, k_dim = x.shape
    num_experts, _, n_dim = w.shape
    if w.shape[1] != k_dim:
        raise ValueError(f"w.shape={w.shape} does not match x.shape={x.shape}: w must be [E, K={k_dim}, N].")
    for other in ws:
        if other.shape != w.shape:
            raise ValueError(f"the weights in w have shapes {[v.shape for v in ws]}; a tuple w needs one shape.")
        if other.dtype != x.dtype:
            raise ValueError(f"w.dtype={other.dtype} differs from x.dtype={x.dtype}; cast w to {x.dtype} before gmm.")
    row_index, inverse = gather if gather is not None else (None, None)
    if gather is not None:
        if row_index.ndim != 1 or inverse.ndim != 1 or inverse.size % num_rows:
            raise ValueError(f"gather=(row_index {row_index.shape}, inverse {inverse.shape}): want 1-d arrays, the "
                             f"inverse a whole number of readers per row of x ({num_rows}).")
        num_rows = row_index.shape[0]  # the block layout's rows; x holds the source rows
    _check_tile("block_m", block_m, "M (x.shape[0], or gather's row_index length)", num_rows)
    _check_tile("block_n", block_n, "N (w.shape[2])", n_dim)
    _check_tile("block_k", block_k, "K (x.shape[1])", k_dim)
    if block_expert.shape != (num_rows // block_m,):
        raise ValueError(
            f"block_expert.shape={block_expert.shape}; expected (M // block_m,) = ({num_rows // block_m},)."
        )
    if group_offsets.shape != (num_experts + 1,):
        raise ValueError(f"group_offsets.shape={group_offsets.shape}; expected (E + 1,) = ({num_experts + 1},).")
    for name, size in (("x", x.size), ("w", w.size), ("y", num_rows * n_dim), ("dx rows", num_rows * k_dim)):
        if size > _MAX_ELEMENTS:
            raise ValueError(
                f"{name} has {size} elements, past the kernel's int32 offsets; split the call over rows or experts."
            )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    block_expert = block_expert.astype(jnp.int32)
    group_offsets = group_offsets.astype(jnp.int32)
    if gather is not None:  # a kernel's gathered load is unchecked: clamp, as jnp.take's default does
        row_index = jnp.minimum(row_index.astype(jnp.int32), x.shape[0] - 1)
        inverse = inverse.astype(jnp.int32)
    launch = _Launch(block_m, block_n, block_k, num_warps, num_stages, interpret)
    ys = _gmm(x, ws, block_expert, group_offsets, row_index, inverse, launch)
    return ys if several else ys[0]
