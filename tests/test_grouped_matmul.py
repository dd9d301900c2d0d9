"""The block-padded grouped matmul matches its jnp reference (values and gradients) and lowers to Triton.

Numerics run the Pallas interpreter on CPU in float32; the CUDA lowering is checked by exporting for
the "cuda" platform, which runs the Pallas -> Triton lowering without a GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_benchmark, relative_error
from moelab.model.grouped_matmul import gmm, gmm_reference, padded_layout

# The library's launch order, and the old one (row blocks fastest) that the benchmarks keep to measure it.
GMMS = {True: gmm, False: load_benchmark("grouped_variants").gmm_rows_fastest}

E, K, N = 4, 32, 64
# Two K steps and four column tiles per block: every grid (forward 4 x 7, dw 2 x 4 x 4) has unequal
# axes, so a kernel that swapped two tile ids would read or write the wrong tiles.
BLOCKS = dict(block_m=16, block_n=16, block_k=16)
# Expert 1 has no rows, expert 2 fills exactly two blocks, so 4 blocks are used and 3 are unused.
COUNTS = (5, 0, 32, 9)
TRITON_TARGET = "__gpu$xla.gpu.triton"


def _numpy_layout(counts: tuple[int, ...], block_m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`padded_layout` by loops: the oracle."""
    row_of_sorted, block_expert, group_offsets = [], [], [0]
    for e, c in enumerate(counts):
        start = group_offsets[-1] * block_m
        row_of_sorted += [start + r for r in range(c)]
        num_blocks = -(-c // block_m)
        block_expert += [e] * num_blocks
        group_offsets.append(group_offsets[-1] + num_blocks)
    return np.array(row_of_sorted), np.array(block_expert), np.array(group_offsets)


def _inputs(dtype=jnp.float32):
    """Padded x (zeros in padding, garbage in the unused blocks, which must not leak), w and the layout."""
    num_rows = sum(COUNTS)
    row_of_sorted, block_expert, group_offsets, num_padded = padded_layout(
        jnp.array(COUNTS, jnp.int32), num_rows, BLOCKS["block_m"]
    )
    k_x, k_w, k_junk = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(k_x, (num_rows, K), dtype)
    used_rows = int(group_offsets[-1]) * BLOCKS["block_m"]
    x = jax.random.normal(k_junk, (num_padded, K), dtype).at[:used_rows].set(0).at[row_of_sorted].set(rows)
    w = jax.random.normal(k_w, (E, K, N), dtype)
    return x, w, block_expert, group_offsets, row_of_sorted


@pytest.mark.parametrize("counts", [COUNTS, (0, 0, 0, 7), (16, 16, 1, 0), (0, 0, 0, 0)])
def test_padded_layout_matches_a_numpy_construction(counts):
    block_m = 16
    num_rows = sum(counts)
    row_of_sorted, block_expert, group_offsets, num_padded = padded_layout(
        jnp.array(counts, jnp.int32), num_rows, block_m
    )
    want_rows, want_used_blocks, want_offsets = _numpy_layout(counts, block_m)
    assert num_padded == -(-(num_rows + len(counts) * (block_m - 1)) // block_m) * block_m
    np.testing.assert_array_equal(row_of_sorted, want_rows)
    np.testing.assert_array_equal(group_offsets, want_offsets)
    unused = num_padded // block_m - len(want_used_blocks)
    assert unused >= 0  # the static bound holds every routing
    np.testing.assert_array_equal(block_expert, np.concatenate([want_used_blocks, np.full(unused, len(counts))]))


@pytest.mark.parametrize("rows_together", [True, False])
def test_gmm_matches_reference_values_and_gradients_in_float32(rows_together):
    """Both launch orders (unequal grid axes, so a swapped index map would read the wrong tiles)."""
    x, w, block_expert, group_offsets, _ = _inputs()
    assert int(group_offsets[-1]) < block_expert.shape[0], "the test needs unused trailing blocks"

    def kernel(x, w):
        return GMMS[rows_together](x, w, block_expert, group_offsets, **BLOCKS)

    def reference(x, w):
        return gmm_reference(x, w, block_expert)

    y, vjp = jax.vjp(kernel, x, w)
    y_ref, vjp_ref = jax.vjp(reference, x, w)
    dy = jax.random.normal(jax.random.key(1), y.shape)
    # Only the float32 summation order differs (K in block_k chunks, dw over row blocks).
    tolerance = 1e-5
    assert relative_error(y, y_ref) < tolerance
    for got, want in zip(vjp(dy), vjp_ref(dy)):
        assert relative_error(got, want) < tolerance
    dw = vjp(dy)[1]
    np.testing.assert_array_equal(dw[1], 0.0)  # the expert with no rows gets no gradient


def _gather_inputs(fan_out: int = 2):
    """Source rows (tokens) read `fan_out` times each through the padded layout, as `grouped` reads h.

    Returns x_src [T + 1, K] (row T zero, for padding), w, the layout, row_index [M] and the inverse
    [(T + 1) * fan_out] (row T lists no readers), and the token order of the sorted rows.
    """
    num_rows = sum(COUNTS)
    assert num_rows % fan_out == 0
    T = num_rows // fan_out
    row_of_sorted, block_expert, group_offsets, num_padded = padded_layout(
        jnp.array(COUNTS, jnp.int32), num_rows, BLOCKS["block_m"]
    )
    token_of_sorted = jax.random.permutation(jax.random.key(2), jnp.arange(num_rows) // fan_out)
    row_index = jnp.full((num_padded,), T, jnp.int32).at[row_of_sorted].set(token_of_sorted)
    readers = np.full(((T + 1), fan_out), num_padded)
    filled = np.zeros(T + 1, int)
    for row, token in zip(np.asarray(row_of_sorted), np.asarray(token_of_sorted)):
        readers[token, filled[token]] = row
        filled[token] += 1
    k_x, k_w = jax.random.split(jax.random.key(3))
    x_src = jnp.concatenate([jax.random.normal(k_x, (T, K)), jnp.zeros((1, K))])
    w = jax.random.normal(k_w, (E, K, N))
    return x_src, w, block_expert, group_offsets, row_index, jnp.asarray(readers.reshape(-1), jnp.int32)


@pytest.mark.parametrize("rows_together", [True, False])
def test_gmm_with_fused_gather_equals_gathering_first(rows_together):
    """The kernels reading rows through row_index compute gmm(x_src[row_index]) for each of two weights
    (gate and up, as `grouped` calls it): values, and gradients for the source rows (summed over both
    weights and each token's readers) and the weights."""
    x_src, w, block_expert, group_offsets, row_index, inverse = _gather_inputs()
    w2 = jax.random.normal(jax.random.key(5), w.shape)
    T = x_src.shape[0] - 1

    def fused(x_src, w, w2):
        return GMMS[rows_together](x_src, (w, w2), block_expert, group_offsets, gather=(row_index, inverse), **BLOCKS)

    def reference(x_src, w, w2):
        return tuple(gmm_reference(x_src[row_index], v, block_expert) for v in (w, w2))

    ys, vjp = jax.vjp(fused, x_src, w, w2)
    ys_ref, vjp_ref = jax.vjp(reference, x_src, w, w2)
    assert [y.shape for y in ys] == [(row_index.shape[0], N)] * 2
    dys = tuple(jax.random.normal(jax.random.key(6 + i), y.shape) for i, y in enumerate(ys))
    (dx, dw, dw2), (dx_ref, dw_ref, dw2_ref) = vjp(dys), vjp_ref(dys)
    for got, want in zip((*ys, dw, dw2), (*ys_ref, dw_ref, dw2_ref)):
        assert relative_error(got, want) < 1e-5
    # Row T is the padding rows' zero row: no reader is listed for it, so it gets no gradient.
    assert relative_error(dx[:T], dx_ref[:T]) < 1e-5
    np.testing.assert_array_equal(dx[T], 0.0)


def test_gmm_gather_clamps_indices_past_the_source_to_its_last_row():
    """The Triton kernel's gathered load has no bounds check, so gmm clamps: no index reads outside x."""
    x_src, w, block_expert, group_offsets, row_index, inverse = _gather_inputs()
    T = x_src.shape[0] - 1
    padding = row_index == T
    past = jnp.where(padding, T + 5, row_index)  # padding rows point past the zero row
    y = gmm(x_src, w, block_expert, group_offsets, gather=(past, inverse), **BLOCKS)
    np.testing.assert_array_equal(y, gmm(x_src, w, block_expert, group_offsets, gather=(row_index, inverse), **BLOCKS))
    assert bool(jnp.any(padding[: int(group_offsets[-1]) * BLOCKS["block_m"]]))  # some used row was clamped


def test_gmm_gather_rejects_an_inverse_that_does_not_fit_the_source():
    x_src, w, block_expert, group_offsets, row_index, inverse = _gather_inputs()
    with pytest.raises(ValueError, match="readers per row of x"):
        gmm(x_src, w, block_expert, group_offsets, gather=(row_index, inverse[:-1]), **BLOCKS)
    with pytest.raises(ValueError, match="a tuple w needs one shape"):
        gmm(x_src, (w, w[:, :, :32]), block_expert, group_offsets, gather=(row_index, inverse), **BLOCKS)


def test_gmm_padded_rows_and_unused_blocks_give_zero_output_rows():
    x, w, block_expert, group_offsets, row_of_sorted = _inputs()
    y = gmm(x, w, block_expert, group_offsets, **BLOCKS)
    is_data_row = np.zeros(x.shape[0], bool)
    is_data_row[np.asarray(row_of_sorted)] = True
    np.testing.assert_array_equal(y[~is_data_row], 0.0)  # padding has zero x; unused blocks hold junk x
    assert np.all(np.any(np.asarray(y[is_data_row]) != 0, axis=1))


def test_gmm_matches_reference_in_bfloat16():
    x, w, block_expert, group_offsets, _ = _inputs(jnp.bfloat16)
    y = gmm(x, w, block_expert, group_offsets, **BLOCKS)
    assert y.dtype == jnp.bfloat16
    # Both accumulate in float32 and round once to bf16 (8 mantissa bits): one ulp apart at most.
    assert relative_error(y.astype(jnp.float32), gmm_reference(x, w, block_expert).astype(jnp.float32)) < 2**-7


@pytest.mark.parametrize(
    "blocks, message",
    [
        (dict(block_m=16, block_n=32, block_k=64), r"K \(x.shape\[1\]\)=32 is not divisible by block_k=64"),
        (dict(block_m=16, block_n=128, block_k=16), r"N \(w.shape\[2\]\)=64 is not divisible by block_n=128"),
        (dict(block_m=32, block_n=32, block_k=16), r"M \(x.shape\[0\].*\)=112 is not divisible by block_m=32"),
        (dict(block_m=16, block_n=32, block_k=8), r"block_k=8 must be a power of two >= 16"),
        (dict(block_m=48, block_n=32, block_k=16), r"block_m=48 must be a power of two >= 16"),
    ],
)
def test_gmm_rejects_bad_block_sizes_naming_the_argument(blocks, message):
    x, w, block_expert, group_offsets, _ = _inputs()
    with pytest.raises(ValueError, match=message):
        gmm(x, w, block_expert, group_offsets, **blocks)


# CUDA launch grids (x, y, z) of the export below: 8 row blocks of 128, N = 256 in 2 column tiles of 128,
# K = 256 in 4 tiles of 64 (dx's output columns), 8 experts. x launches fastest.
LAUNCH_GRIDS = {
    True: {"gmm": (2, 8, 1), "gmm_dx": (4, 8, 1), "gmm_dw": (4, 2, 8)},  # a row block's (an expert's) tiles together
    False: {"gmm": (8, 2, 1), "gmm_dx": (8, 4, 1), "gmm_dw": (8, 4, 2)},  # row blocks (experts) fastest
}


@pytest.mark.parametrize("rows_together, gather", [(True, False), (False, False), (True, True)])
def test_gmm_forward_and_backward_lower_to_triton_kernels_for_cuda(rows_together, gather):
    """Exporting for CUDA on a CPU-only machine runs the Pallas -> Triton lowering of all three kernels.

    The Triton module is serialized into the custom call; Triton's own passes (layouts, pipelining,
    PTX) run only when XLA compiles on a GPU, so this catches unsupported ops, not tile-size limits.
    The launch grid in each call's config shows which programs run together (the DRAM-traffic order).
    """
    M, K_, N_, E_ = 1024, 256, 256, 8  # a realistic tile config: 8 row blocks, 2-4 column tiles

    R = M // 2 + 1  # with `gather`: source rows read twice each, plus the zero row

    def loss(x, w, block_expert, group_offsets, *gather_maps):
        y = GMMS[rows_together](x, w, block_expert, group_offsets, block_m=128, block_n=128, block_k=64,
                                gather=gather_maps or None, interpret=False)
        return jnp.sum(y.astype(jnp.float32))

    args = (
        jax.ShapeDtypeStruct((R if gather else M, K_), jnp.bfloat16),
        jax.ShapeDtypeStruct((E_, K_, N_), jnp.bfloat16),
        jax.ShapeDtypeStruct((M // 128,), jnp.int32),
        jax.ShapeDtypeStruct((E_ + 1,), jnp.int32),
        *([jax.ShapeDtypeStruct((M,), jnp.int32), jax.ShapeDtypeStruct((2 * R,), jnp.int32)] if gather else []),
    )
    # The Triton custom call has no export compatibility guarantee; we export only to lower.
    disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]
    fns = {"forward": loss, "forward+backward": jax.value_and_grad(loss, argnums=(0, 1))}
    want_kernels = {"forward": ["gmm"], "forward+backward": ["gmm", "gmm_dw", "gmm_dx"]}
    for label, fn in fns.items():
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)
        calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call" in line]
        assert all(TRITON_TARGET in line for line in calls), label
        names = sorted(re.search(r'\bname = "(\w+)"', line).group(1) for line in calls)
        assert names == want_kernels[label], label
        for line in calls:
            name = re.search(r'\bname = "(\w+)"', line).group(1)
            grid = tuple(int(re.search(rf"\bgrid_{axis} = (\d+)", line).group(1)) for axis in "xyz")
            assert grid == LAUNCH_GRIDS[rows_together][name], (label, name)
