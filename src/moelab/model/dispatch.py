"""Single-device dispatch backends: how routed rows reach their experts and come back.

Every backend computes the same function (architecture §3):

    out[t] = sum_j weights[t, j] * expert_{idx[t, j]}(h[t])
    expert_e(h) = (silu(h W_gate[e]) * (h W_up[e])) W_down[e]            (SwiGLU)

- `dense`: every expert on every token, masked by the combine weights. O(T E) work; the test oracle.
- `capacity`: sort the T*k assignments by expert, gather them into fixed [E, C, Din] buffers, one
  batched einsum over experts, gather back. Assignments past an expert's capacity C are dropped
  (they contribute 0) and counted. Static shapes, so this is the fast path on GPU (architecture §6).
- `dropless`: `jax.lax.ragged_dot` over the expert-sorted rows; nothing is dropped. On GPU XLA runs
  it as a dense masked product (slow, and large scratch), so it is the reference grouped GEMM.
- `grouped`: dropless too, through our Pallas grouped GEMM (`moelab.model.grouped_matmul`): each
  expert's rows padded to a multiple of the row tile, one kernel per matmul. Compiled with Triton on
  GPU; run by the Pallas interpreter elsewhere (correct, slow: for tests and tiny shapes).

Rows move with `moelab.model.rows.take_rows`, a gather whose gradient is also a gather (each map is
injective with a known inverse), so no backward pass pays for a float scatter-add.

The expert-parallel backend, `ep`, is the per-device exchange of `moelab.model.exchange`. Which backend runs,
with which capacity, is one frozen value built once for its purpose, `moelab.model.moe.build_moe`; the
model itself never picks a dispatch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moelab.errors import ConfigError
from moelab.model import fp8 as fp8_lib
from moelab.model import grouped_matmul
from moelab.model.rows import take_rows
from moelab.model.router import Routing, expert_load

__all__ = ["BACKENDS", "EXPERT_MATMUL", "sort_by_group", "combine", "dense", "capacity", "dropless", "grouped",
           "expert_capacity", "grouped_swiglu", "swiglu_buffers", "check_fp8"]

BACKENDS = ("dense", "capacity", "dropless", "grouped")

# `grouped`'s kernel outputs carry this name, so a remat policy can keep them as it keeps XLA's dots
# (`checkpoint_dots` sees only dot_general; a Pallas call would be recomputed in the backward pass).
EXPERT_MATMUL = "expert_matmul"

Experts = dict[str, jax.Array]  # w_gate [E, Din, F], w_up [E, Din, F], w_down [E, F, Din]
Stats = dict[str, jax.Array]  # load [E], dropped [], assignments []


def _stats(routing: Routing, num_experts: int, dropped: jax.Array) -> Stats:
    """The statistics every backend reports, all float32."""
    return {
        "load": expert_load(routing.expert_idx, num_experts),
        "dropped": jnp.asarray(dropped, jnp.float32),
        "assignments": jnp.asarray(routing.expert_idx.size, jnp.float32),
    }


def combine(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum over each token's k expert outputs: every backend's last step, and `ep`'s.

    Args:
        rows: [T * k, Din] expert outputs in assignment order (token-major: row t * k + j).
        weights: [T, k] the router's combine weights.

    Returns:
        [T, Din] in the dtype of `rows`.
    """
    T, k = weights.shape
    y = rows.reshape(T, k, rows.shape[-1])
    return jnp.einsum("tkd,tk->td", y, weights.astype(rows.dtype))


def sort_by_group(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Orders assignments by group (an expert, or `ep`'s destination shard), earlier tokens first within a group:
    the one sort behind every capacity and pool.

    Args:
        groups: [T, k] or [A] int, each assignment's group (assignment a = t * k + j).

    Returns:
        order: [A] int32, assignment ids sorted by group; stable, so within a group the earlier token comes first
            and is the one kept when capacity runs out.
        sorted_group: [A] int32, the group of each sorted assignment.
        counts: [G] int32, assignments per group (the size of each sorted group).
        rank: [A] int32, each sorted assignment's position inside its group (rank[i] of assignment order[i]).
    """
    flat = groups.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=num_groups).astype(jnp.int32)
    sorted_group = flat[order].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts  # [G] first sorted position of each group
    return order, sorted_group, counts, jnp.arange(flat.size, dtype=jnp.int32) - starts[sorted_group]


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order`: x[order][_inverse(order)] == x."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))


def _rounded(h: jax.Array, experts: Experts, fp8: bool) -> tuple[jax.Array, Experts]:
    """With `fp8`, the gate and up GEMMs' operands rounded to e4m3: h per row (so each row rounds alike whichever
    rows a backend gathers), each expert on its own scale. For the backends whose GEMMs are written as
    quantize-dequantize around a plain matmul (`dense`, `dropless`, `grouped`); `capacity` and `ep` call
    `fp8.fp8_einsum`, which rounds its own operands."""
    return (fp8_lib.forward_fp8(h), fp8_lib.expert_weights(experts, True)) if fp8 else (h, experts)


def _expert_output(y: jax.Array, fp8: bool) -> jax.Array:
    """The down GEMM's output; with `fp8` its gradient is rounded to e5m2 per row (`fp8.gradient_fp8`)."""
    return fp8_lib.gradient_fp8(y) if fp8 else y


def dense(h: jax.Array, routing: Routing, experts: Experts, fp8: bool = False) -> tuple[jax.Array, Stats]:
    """Runs every expert on every token and keeps the chosen ones: the reference.

    Args:
        h: [T, Din] expert inputs.
        routing: chosen experts and combine weights.
        experts: `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din].
        fp8: the expert GEMMs in FP8 (`moelab.model.fp8`): h and the hidden rows per row, the weights per
            expert, the GEMMs' output gradients per row, as every backend rounds them.

    Returns:
        out [T, Din] and stats (`load` [E], `dropped` = 0, `assignments` = T * k).
    """
    E = experts["w_gate"].shape[0]
    h, experts = _rounded(h, experts, fp8)
    gate = jnp.einsum("td,edf->tef", h, experts["w_gate"])
    up = jnp.einsum("td,edf->tef", h, experts["w_up"])
    y = jnp.einsum("tef,efd->ted", fp8_lib.expert_hidden(gate, up, fp8), experts["w_down"])  # [T, E, Din]
    y = _expert_output(y, fp8)
    # [T, E] combine matrix: zero for the experts a token did not choose, so they add nothing and
    # receive no gradient.
    mask = jax.nn.one_hot(routing.expert_idx, E, dtype=routing.weights.dtype)  # [T, k, E]
    combine = jnp.einsum("tke,tk->te", mask, routing.weights).astype(y.dtype)
    out = jnp.einsum("ted,te->td", y, combine)
    return out, _stats(routing, E, 0.0)


def swiglu_buffers(buf: jax.Array, experts: Experts, fp8: bool = False) -> jax.Array:
    """[E, C, Din] buffer rows through their own expert's SwiGLU -> [E, C, Din]: batched einsums, the
    expert matmuls of `capacity` and of `ep`'s receivers; with `fp8`, FP8 GEMMs (`fp8.fp8_einsum`: each
    buffer row and each expert on its own scale, so the scales stay outside every sum but the weights')."""
    def matmul(spec, x, w):
        return fp8_lib.fp8_einsum(spec, (1, 2), x, w) if fp8 else jnp.einsum(spec, x, w)

    gate = matmul("ecd,edf->ecf", buf, experts["w_gate"])
    up = matmul("ecd,edf->ecf", buf, experts["w_up"])
    return matmul("ecf,efd->ecd", jax.nn.silu(gate) * up, experts["w_down"])


def expert_capacity(num_assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert buffer: C = ceil(capacity_factor * assignments / E), at least 1.

    The one formula for C; the expert-parallel backend sizes its receiver buffers with it too.
    """
    return max(1, math.ceil(capacity_factor * num_assignments / num_experts))


def capacity(h: jax.Array, routing: Routing, experts: Experts, capacity_factor: float, fp8: bool = False
             ) -> tuple[jax.Array, Stats]:
    """Fixed-capacity dispatch: sort by expert, [E, C, Din] buffers, batched einsum, gather back.

    Args:
        h: [T, Din] expert inputs.
        routing: chosen experts and combine weights.
        experts: `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din].
        capacity_factor: C = ceil(capacity_factor * T * k / E); `E / k` gives C = T, so nothing drops.
        fp8: as in `dense`.

    Returns:
        out [T, Din] and stats; `dropped` counts assignments past their expert's capacity (the
        later tokens of an overfull expert), which contribute nothing to `out`.
    """
    T, k = routing.expert_idx.shape
    E = experts["w_gate"].shape[0]
    # An expert is in a token's top-k at most once, so it never gets more than T rows: a larger C
    # would only add empty buffer rows.
    C = min(expert_capacity(T * k, E, capacity_factor), T)

    order, sorted_expert, counts, rank = sort_by_group(routing.expert_idx, E)
    kept = rank < C
    # Buffer slot of each sorted assignment; dropped ones go to slot E * C, past the buffers.
    slot = jnp.where(kept, sorted_expert * C + rank, E * C)
    # The two maps between assignments (t * k + j, token-major) and buffer slots; an assignment
    # with no slot has E * C, a slot with no assignment has T * k (both read as zero rows).
    assignment_slot = jnp.zeros((T * k,), jnp.int32).at[order].set(slot)
    slot_assignment = jnp.full((E * C + 1,), T * k, jnp.int32).at[slot].set(order)[: E * C]

    buf = take_rows(h, slot_assignment // k, assignment_slot).reshape(E, C, h.shape[1])  # [E, C, Din]
    y = swiglu_buffers(buf, experts, fp8)  # [E, C, Din]
    rows = take_rows(y.reshape(E * C, -1), assignment_slot, slot_assignment)  # [T * k, Din]
    dropped = jnp.sum(jnp.maximum(counts - C, 0))
    return combine(rows, routing.weights), _stats(routing, E, dropped)


def dropless(h: jax.Array, routing: Routing, experts: Experts, fp8: bool = False) -> tuple[jax.Array, Stats]:
    """Grouped-GEMM dispatch: `jax.lax.ragged_dot` over the expert-sorted rows, no drops.

    Args:
        h: [T, Din] expert inputs.
        routing: chosen experts and combine weights.
        experts: `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din].

    Returns:
        out [T, Din] and stats (`dropped` = 0).
    """
    T, k = routing.expert_idx.shape
    E = experts["w_gate"].shape[0]
    order, _, counts, _ = sort_by_group(routing.expert_idx, E)
    h, experts = _rounded(h, experts, fp8)
    position = _inverse(order)  # [T * k] sorted position of each assignment
    x = take_rows(h, order // k, position)  # [T * k, Din], grouped by expert in the order of `counts`
    gate = jax.lax.ragged_dot(x, experts["w_gate"], counts)
    up = jax.lax.ragged_dot(x, experts["w_up"], counts)
    y = jax.lax.ragged_dot(fp8_lib.expert_hidden(gate, up, fp8), experts["w_down"], counts)  # [T * k, Din]
    y = _expert_output(y, fp8)
    return combine(take_rows(y, position, order), routing.weights), _stats(routing, E, 0.0)


def grouped_swiglu(rows: jax.Array, experts: Experts, block_expert: jax.Array, group_offsets: jax.Array,
                   tiles: dict[str, int] | None = None, gather: tuple[jax.Array, jax.Array] | None = None,
                   fp8: bool = False, on_gpu: bool | None = None) -> jax.Array:
    """Block-padded rows [M, Din] through their block's expert SwiGLU with the Pallas `gmm` -> [M, Din].

    With `gather` (`gmm`'s argument), `rows` are the source rows and the gate and up matmuls read the
    block layout through it. `tiles` (all three matmuls) or, if None, `default_tiles` per matmul; the
    layout's block_m must match; `on_gpu` picks the default tiles of a GPU or a CPU (None: this machine's).
    Outputs are named `EXPERT_MATMUL` for the remat policy.
    """
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu

    def gmm(x, w, gather=None):
        one = w[0] if isinstance(w, tuple) else w
        w_tiles = tiles or grouped_matmul.default_tiles(one.shape[1], one.shape[2], on_gpu)
        y = grouped_matmul.gmm(x, w, block_expert, group_offsets, gather=gather, **w_tiles)
        return checkpoint_name(y, EXPERT_MATMUL)

    # Gate and up in one call: with `gather`, x's gradient is summed over both before the readers' sum.
    gate, up = gmm(rows, (experts["w_gate"], experts["w_up"]), gather)
    return _expert_output(gmm(fp8_lib.expert_hidden(gate, up, fp8), experts["w_down"]), fp8)


def _padded_rows(expert_idx: jax.Array, num_experts: int, block_m: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The T*k assignments in `grouped_matmul.padded_layout`'s block-padded layout, sorted by expert.

    Returns:
        assignment_row: [T*k] int32, the padded row of each assignment.
        row_assignment: [M] int32, the assignment in each padded row; T*k for padding.
        block_expert, group_offsets: the layout, for `gmm`.
    """
    order, _, counts, _ = sort_by_group(expert_idx, num_experts)
    A = expert_idx.size
    row_of_sorted, block_expert, group_offsets, M = grouped_matmul.padded_layout(counts, A, block_m)
    assignment_row = jnp.zeros((A,), jnp.int32).at[order].set(row_of_sorted)
    row_assignment = jnp.full((M,), A, jnp.int32).at[row_of_sorted].set(order)
    return assignment_row, row_assignment, block_expert, group_offsets


def grouped(h: jax.Array, routing: Routing, experts: Experts, tiles: dict[str, int] | None = None,
            fp8: bool = False, on_gpu: bool | None = None) -> tuple[jax.Array, Stats]:
    """Dropless dispatch through the Pallas grouped GEMM over block-padded expert groups.

    The gate and up kernels read each row from `h` through the layout's index (`gmm`'s `gather`), so
    the [M, Din] expert-sorted copy of the rows (M ~ T k: k times h's bytes) is never written, read
    back twice, or rebuilt for the backward pass (benchmarks/moe_layer.py's `-unfused` variant
    measures what this saves).

    Args:
        h: [T, Din] expert inputs; Din and the expert width F multiples of 16.
        routing: chosen experts and combine weights.
        experts: `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din].
        tiles: `gmm` keyword arguments (block_m/n/k, num_warps, num_stages) for all three matmuls;
            None: `grouped_matmul.default_tiles` per matmul. The layer benchmark tries several on the GPU.
        on_gpu: the default tiles a GPU's (True) or a CPU's (False); None: this machine's. The memory planner
            traces a GPU's step on a CPU.

    Returns:
        out [T, Din] and stats (`dropped` = 0).
    """
    k = routing.expert_idx.shape[1]
    E, Din, F = experts["w_gate"].shape
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    block_m = (tiles or grouped_matmul.default_tiles(Din, F, on_gpu))["block_m"]
    assignment_row, row_assignment, block_expert, group_offsets = _padded_rows(routing.expert_idx, E, block_m)
    h, experts = _rounded(h, experts, fp8)
    M = row_assignment.shape[0]
    # Padding rows read row T, a zero row; nothing lists it as read, so its gradient is zero.
    source = jnp.concatenate([h, jnp.zeros((1, Din), h.dtype)])
    readers = jnp.concatenate([assignment_row, jnp.full((k,), M, jnp.int32)])
    y = grouped_swiglu(source, experts, block_expert, group_offsets, tiles, gather=(row_assignment // k, readers),
                       fp8=fp8, on_gpu=on_gpu)
    return combine(take_rows(y, assignment_row, row_assignment), routing.weights), _stats(routing, E, 0.0)


def check_fp8(fp8: bool) -> None:
    """Refuse, before anything compiles, an FP8 run a GPU cannot run as FP8: a device before compute capability 8.9
    (no FP8 tensor cores). CPUs emulate it; `grouped` with FP8 the config refuses on any machine."""
    if not fp8 or jax.default_backend() != "gpu":
        return
    capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
    if tuple(int(p) for p in capability.split(".")[:2] if p.isdigit()) < (8, 9):
        raise ConfigError(f"model.fp8=true needs FP8 tensor cores (compute capability 8.9: Ada, Hopper or later); "
                          f"this GPU has {capability}. Set model.fp8=false.")
