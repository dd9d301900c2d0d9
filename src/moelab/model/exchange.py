"""The expert-parallel exchange, per device: pooled fixed-capacity all-to-all over the mesh axis "expert" (architecture §3).

The routed experts are sharded over the mesh's `expert` axis (X shards of E_l = E / X experts); the
tokens over ("replica", "expert"). Each device, with T local tokens and A = T k assignments, runs:

  1. Sender pools. Assignments are grouped by destination shard (the owner of expert e is
     e // E_l). The r-th assignment (token order) for a destination goes to wave r % W, row r // W
     of that destination's pool. Pools hold P = ceil(transport_cf * A / (X W)) rows, so the
     buffers are [W, X, P, Din] whatever the routing; rows past P are dropped at the sender.
  2. For each of the W static waves:
       all_to_all over `expert` of the wave's [X, P, Din] rows and [X, P] local expert ids
         (in band: an id travels in the same collective as its row, so the receiver needs no
         other routing metadata);
       receiver buffers [E_l, C, Din], C = ceil(cf * X A / (E W)): the fair share of one local
         expert in one wave. Capacity is shared round-robin across senders (each sender's first
         row for an expert, then each one's second, ...), so overflow is spread evenly over the
         senders instead of always cutting the last one; rows past C are dropped at the receiver;
       local SwiGLU GEMMs, batched over the local experts;
       all_to_all back: the same [X, P, Din] layout, now holding expert outputs.
  3. Un-pool to assignment order and combine with the router's weights; a dropped assignment
     contributes zero, as in the single-device `capacity` backend.

Waves cut the buffers each collective and GEMM touch by W at the same total bytes, and give XLA
independent collective / GEMM pairs it can overlap. Under LatentMoE the rows are latent-width, so the
all-to-all carries d_latent instead of d_model columns. Everything is static-shaped: fixed pools
instead of `jax.lax.ragged_all_to_all`, which does not run on CPU (architecture §6). Gradients flow back
through the same all_to_alls (the op is linear; its transpose is the reverse exchange).

With capacity large enough to drop nothing, the result equals `moelab.model.dispatch.dense` in
outputs and gradients (tests/test_parallel.py). The code here names a mesh axis but holds no mesh: it runs
inside the train step's `shard_map` (`moelab.parallel.spmd`), where every device routes its own tokens, so
it lives with the model; `moelab.model.moe.Dispatch` sizes its pools and buffers for the device's rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moelab.model.dispatch import combine, expert_capacity, sort_by_group, swiglu_buffers
from moelab.model.rows import take_rows

__all__ = ["exchange", "pool_size", "receiver_capacity", "receiver_slots"]

Experts = dict[str, jax.Array]  # w_gate [E, Din, F], w_up [E, Din, F], w_down [E, F, Din]


# ----------------------------------------------------------------------------------------------
# buffer sizes (static: they fix the shapes of the collectives)


def pool_size(num_tokens: int, k: int, num_shards: int, experts_per_shard: int, num_waves: int,
              transport_capacity_factor: float) -> int:
    """P, the rows one device sends one destination shard in one wave.

    The fair share is 1 / (X W) of the device's A = T k assignments. A token sends at most
    min(k, E_l) rows to one shard, so a pool never needs more than ceil(T min(k, E_l) / W) rows:
    a larger factor only adds empty rows.
    """
    fair = expert_capacity(num_tokens * k, num_shards * num_waves, transport_capacity_factor)
    most = math.ceil(num_tokens * min(k, experts_per_shard) / num_waves)
    return min(fair, most)


def receiver_capacity(num_tokens: int, k: int, num_experts: int, num_shards: int, num_waves: int,
                      pool: int, capacity_factor: float) -> int:
    """C, the rows one local expert takes in one wave.

    One expert's fair share of one wave is 1 / (E W) of the X senders' X A assignments, the same
    `expert_capacity` formula as the single-device `capacity` backend. A sender's pool holds at
    most min(P, T) rows for one expert (an expert is in a token's top-k at most once), which
    bounds C from above.
    """
    fair = expert_capacity(num_shards * num_tokens * k, num_experts * num_waves, capacity_factor)
    return min(fair, num_shards * min(pool, num_tokens))


# ----------------------------------------------------------------------------------------------
# the two halves of the exchange, per device


def _pack(expert_idx: jax.Array, experts_per_shard: int, num_shards: int, num_waves: int,
          pool: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each assignment goes in the sender's pools, and what fills each pool row.

    Args:
        expert_idx: [T, k] global expert ids.

    Returns:
        pos: [A] flat position of each assignment (a = t k + j) in the [W, X, P] pools; W X P for
            an assignment dropped at the sender.
        source: [W X P] the assignment filling each pool row; A for an empty row.
        ids: [W, X, P] int32 local expert id of each row on its destination shard; E_l when empty.
    """
    W, X, Pl, El = num_waves, num_shards, pool, experts_per_shard
    flat = expert_idx.reshape(-1)
    A = flat.size
    dest = flat // El
    # Rank of each assignment among those for the same destination, in token order.
    order, _, _, sorted_rank = sort_by_group(dest, X)
    rank = jnp.zeros((A,), jnp.int32).at[order].set(sorted_rank)
    # Striping ranks over waves keeps every wave's pools equally full, whatever the skew.
    wave, row = rank % W, rank // W
    pos = jnp.where(row < Pl, (wave * X + dest) * Pl + row, W * X * Pl)
    # Dropped assignments all write to the extra row W X P, which is cut off.
    source = jnp.full((W * X * Pl + 1,), A, jnp.int32).at[pos].set(jnp.arange(A, dtype=jnp.int32))[:-1]
    local_ids = jnp.concatenate([flat % El, jnp.array([El], flat.dtype)])  # [A + 1]; A -> "empty"
    return pos, source, local_ids[source].reshape(W, X, Pl).astype(jnp.int32)


def receiver_slots(ids: jax.Array, experts_per_shard: int, capacity: int) -> jax.Array:
    """The expert-buffer slot of each received row, with capacity shared round-robin across senders.

    For expert e, the rows from all senders are taken in rounds: round j holds each sender's j-th
    row for e, senders in order. So the rows ahead of sender s's j-th row are, from every sender
    s', its first min(n[s', e], j) rows (the earlier rounds), plus, in round j itself, one row from
    each sender s' < s that has more than j rows for e. A row whose rank reaches C is dropped.

    Args:
        ids: [X, P] int32 local expert id of each received row (sender-major); E_l marks an empty
            pool row.
        experts_per_shard: E_l.
        capacity: C, rows per local expert.

    Returns:
        [X, P] int32 slot in the flat [E_l C] buffer: e C + rank; E_l C for an empty or dropped row.
    """
    X, Pl = ids.shape
    El, C = experts_per_shard, capacity
    onehot = (ids[..., None] == jnp.arange(El)).astype(jnp.int32)  # [X, P, El]; empty rows all 0
    n = jnp.sum(onehot, axis=1)  # [X, El] rows per (sender, expert)
    j = jnp.sum(jnp.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # [X, P] index among its sender's rows for e
    n_same = n[:, jnp.minimum(ids, El - 1)]  # [X(s'), X(s), P]: n[s', e] for each row's expert e
    n_same = jnp.moveaxis(n_same, 0, -1)  # [X(s), P, X(s')]
    earlier_rounds = jnp.sum(jnp.minimum(n_same, j[..., None]), axis=-1)
    sender = jnp.arange(X)
    earlier_senders = jnp.sum((n_same > j[..., None]) & (sender[None, None, :] < sender[:, None, None]), axis=-1)
    rank = earlier_rounds + earlier_senders
    kept = (ids < El) & (rank < C)
    return jnp.where(kept, ids * C + rank, El * C).astype(jnp.int32)


def _run_wave(rows: jax.Array, ids: jax.Array, experts: Experts, capacity: int, fp8: bool = False
              ) -> tuple[jax.Array, jax.Array]:
    """Receiver side of one wave: received rows -> expert outputs in the same [X, P, Din] layout.

    Returns:
        out [X, P, Din] (zero for empty and dropped rows) and slot [X, P] from `receiver_slots`.
    """
    X, Pl, Din = rows.shape
    El = experts["w_gate"].shape[0]
    slot = receiver_slots(ids, El, capacity).reshape(-1)  # [X P]
    # The received row filling each buffer slot; X P (a zero row) where none does.
    fill = jnp.full((El * capacity + 1,), X * Pl, jnp.int32).at[slot].set(jnp.arange(X * Pl, dtype=jnp.int32))[:-1]
    buf = take_rows(rows.reshape(X * Pl, Din), fill, slot).reshape(El, capacity, Din)
    y = swiglu_buffers(buf, experts, fp8).reshape(El * capacity, Din)
    out = take_rows(y, slot, fill)  # empty and dropped rows (slot El C) read zero
    return out.reshape(X, Pl, Din), slot.reshape(X, Pl)


def exchange(
    h: jax.Array, expert_idx: jax.Array, weights: jax.Array, experts: Experts, *,
    num_waves: int, pool: int, capacity: int, fp8: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One device's part of the expert-parallel dispatch, inside a `shard_map` whose experts are split over "expert":
    [T, Din] this device's rows -> [T, Din] their combined expert outputs, and this device's drop counters
    (`dropped_at_sender`, `dropped_at_receiver`, `kept`; `moelab.model.moe.Dispatch` sums them over the mesh)."""
    T, k = expert_idx.shape
    Din = h.shape[-1]
    W, X, El = num_waves, jax.lax.axis_size("expert"), experts["w_gate"].shape[0]
    pos, source, ids = _pack(expert_idx, El, X, W, pool)
    send = take_rows(h, source // k, pos).reshape(W, X, pool, Din)  # empty rows (source A -> token T) are zero

    returned = []
    kept = dropped_at_receiver = jnp.zeros((), jnp.int32)
    for w in range(W):  # static: W exchange / GEMM / exchange triples XLA can overlap
        rows, wave_ids = jax.lax.all_to_all((send[w], ids[w]), "expert", 0, 0)  # [X(src), P, Din], [X, P]
        out, slot = _run_wave(rows, wave_ids, experts, capacity, fp8)
        returned.append(jax.lax.all_to_all(out, "expert", 0, 0))  # [X(dest), P, Din], our pool layout
        in_buffer = slot < El * capacity
        kept += jnp.sum(in_buffer)
        dropped_at_receiver += jnp.sum((wave_ids < El) & ~in_buffer)  # arrived (a real id), found no slot

    back = jnp.stack(returned).reshape(W * X * pool, Din)
    out = combine(take_rows(back, pos, source), weights)  # dropped-at-sender assignments (pos W X P) read zero
    counts = {
        "dropped_at_sender": jnp.sum(pos == W * X * pool),
        "dropped_at_receiver": dropped_at_receiver,
        "kept": kept,
    }
    return out, {name: c.astype(jnp.float32) for name, c in counts.items()}  # this device's; the caller sums them
