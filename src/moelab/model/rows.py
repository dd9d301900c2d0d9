"""Row moves whose gradients are gathers: MoE dispatch without float scatter-adds.

Autodiff's transpose of a row gather is a scatter-add, which a GPU runs with atomics over rows it
cannot prove distinct. Every dispatch map in moelab is injective with a known inverse: each source
row is read by a fixed number of output rows (a token by its k assignments), and we know which. So
the gradient can be gathered instead: `sum_readers` sums, for each source row, the gradients of the
rows that read it. `take_rows` is the gather with that gradient; the grouped GEMM
(`moelab.model.grouped_matmul`) uses `sum_readers` for its fused gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sum_readers", "take_rows"]


def sum_readers(d_out: jax.Array, inverse: jax.Array, num_rows: int) -> jax.Array:
    """d_x[r] = sum_j d_out[inverse[r m + j]] for each of `num_rows` source rows (m = fan-out).

    `inverse` [num_rows * m] lists each source row's readers among d_out's rows, padded with
    len(d_out), which reads as zero. The m terms are summed in float32, as autodiff's scatter-add
    would not be: k = 8 bf16 partial sums in bf16 would lose ~3 bits.
    """
    fan_out = inverse.size // num_rows
    d_x = jnp.take(d_out, inverse, axis=0, mode="fill", fill_value=0).reshape(num_rows, fan_out, -1)
    return jnp.sum(d_x, axis=1, dtype=jnp.float32).astype(d_out.dtype)


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """Row gather whose gradient is a gather too: out[i] = x[index[i]], zero where index[i] == len(x).

    `inverse` lists, for each row r of x, the m output rows that read it (a fixed fan-out, padded
    with len(index), which reads as zero), and dx = `sum_readers(dout, inverse, len(x))`.

    Args:
        x: [R, D] rows.
        index: [N] int32 in [0, R]; R selects a zero row.
        inverse: [R * m] int32 in [0, N]; N selects a zero row. Each out row i with index[i] = r < R
            must appear exactly once in inverse[r m : (r + 1) m], and nothing else may.

    Returns:
        [N, D] in x's dtype.
    """
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return take_rows(x, index, inverse), (inverse, x.shape[0])


def _take_rows_bwd(residuals, d_out):
    inverse, num_rows = residuals
    return sum_readers(d_out, inverse, num_rows), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
