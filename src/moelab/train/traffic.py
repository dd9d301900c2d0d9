"""What one device sends per step, by collective and link, and the link bandwidths that time it (`moelab plan`).

    comm = traffic.communication(cfg)            # {"all_to_all_in_rack": bytes, ..., "all_reduce_across_racks": ...}
    seconds = comm["all_reduce_across_racks"] / Links().network

Counted from the config alone, in the terms of the per-device step (`moelab.parallel.spmd`): the `ep` exchange, the
rack's parameter gathers and gradient reduce-scatters, the gradient's one crossing of the racks, the balancer's
histogram. `moelab.train.hlo` reads the same figures off XLA's compiled step; `benchmarks/comm_links.py`
compares the two. `ring` is the one formula both use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig
from moelab.model import exchange, transformer
from moelab.parallel import mesh as mesh_lib

__all__ = ["Links", "COMM_KEYS", "ParamBytes", "param_bytes", "rows_per_microbatch", "nbytes", "devices_split_over",
           "ring", "communication"]


@dataclass(frozen=True)
class Links:
    """Per-device link bandwidths, bytes/s one way: NVLink inside a rack, the network between racks.

    Defaults: a GB200 NVL72 rack (NVLink 5, 1.8 TB/s both ways) and 400 Gb/s InfiniBand per GPU.
    """

    nvlink: float = 900e9
    network: float = 50e9


def nbytes(leaf: Any) -> int:
    """Bytes of an array or its abstract shape."""
    return int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize


def devices_split_over(spec: Any, axes: dict[str, int]) -> int:
    """How many devices one leaf is split over under a PartitionSpec."""
    n = 1
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            n *= axes[axis] if axis else 1
    return n


def rows_per_microbatch(cfg: RunConfig) -> int:
    """Sequences one device runs at once."""
    return cfg.train.batch_size // (cfg.mesh.num_devices * cfg.train.microbatches)


class ParamBytes(NamedTuple):
    """A model's parameter bytes (float32, whole) by how the per-device step moves them under `mesh.shard`."""

    layer_split: int  # one MoE block's non-expert parameters split over the rack (gathered where they are read)
    layer_read: int  # ... as gathered: the matrices in the compute dtype (`transformer.READ_IN_COMPUTE_DTYPE`)
    layer_whole: int  # ... and those every device holds whole
    dense_split: int  # the same for one dense block (`model.dense_layers`)
    dense_read: int
    dense_whole: int
    top_split: int  # embedding, lm head and final norm
    top_read: int
    top_whole: int
    experts: int  # one MoE block's routed experts (all E)
    updated_whole: int  # parameters held whole whose moments split over the whole mesh (`optimizer`)
    updated_split: int  # parameters split over the rack whose moments split over "replica" too, per device

    def gathered_layer(self) -> int:
        """What `rack` and `full` gather at once: the larger block's non-expert parameters and the embeddings, whole."""
        return max(self.layer_split + self.layer_whole, self.dense_split + self.dense_whole) + self.top_split + \
            self.top_whole


def param_bytes(cfg: RunConfig, platform: str = "gpu") -> ParamBytes:
    """`ParamBytes` read off the params `transformer.init` would make and their `leaf_spec` on `cfg.mesh`; the bytes
    as gathered in the compute dtype as `platform` moves them (XLA on CPU moves 16-bit rows as float32)."""
    read_itemsize = 4 if platform == "cpu" else jnp.dtype(cfg.train.compute_dtype).itemsize
    params = jax.eval_shape(lambda: transformer.init(cfg.model, jax.random.key(0)))
    axes = {"replica": cfg.mesh.replica, "expert": cfg.mesh.expert}
    sums = Counter()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        where = {"layers": "layer", "dense_layers": "dense"}.get(keys[0], "top")
        per_layer = nbytes(leaf) // (leaf.shape[0] if where != "top" else 1)
        spec = mesh_lib.leaf_spec(path, leaf, axes, cfg.mesh.shard)
        if keys[-1] in mesh_lib.EXPERT_WEIGHTS:
            sums["experts"] += per_layer
        elif "expert" in spec:
            sums[f"{where}_split"] += per_layer
            cast = keys[-1] in transformer.READ_IN_COMPUTE_DTYPE
            sums[f"{where}_read"] += per_layer * read_itemsize // 4 if cast else per_layer
        else:
            sums[f"{where}_whole"] += per_layer
        moment = mesh_lib.leaf_spec((jax.tree_util.GetAttrKey("opt_state"), *path), leaf, axes, cfg.mesh.shard)
        if "replica" in str(moment):
            sums["updated_split" if "expert" in spec else "updated_whole"] += nbytes(leaf) // devices_split_over(spec, axes)
    return ParamBytes(**{name: int(sums[name]) for name in ParamBytes._fields})


def ring(size: float, group: int) -> float:
    """Bytes one device sends to pass `size` bytes around a ring of `group` devices: size (group - 1) / group. The
    one formula behind every count here (an all-reduce sends it twice: a reduce-scatter and an all-gather)."""
    return size * (group - 1) / group if group > 1 else 0.0


def communication(cfg: RunConfig, platform: str = "gpu", params: ParamBytes | None = None) -> dict[str, int]:
    """Bytes one device sends per step, by collective and link: `<kind>_in_rack` over the rack's links, `<kind>_across_racks`
    over the network. What the per-device step (`moelab.parallel.spmd`) emits, compiled (`hlo.collective_bytes_by_link`;
    `benchmarks/comm_bytes.py` compares the two on simulated multi-rack meshes):
    - `ep`'s all-to-alls, in the rack, each microbatch: per layer and wave, the rows out and back ([X, P, Din] each) in
      the forward, the backward and (under remat) the recomputed forward, and the expert ids ([X, P] int32) in each
      forward. XLA on CPU moves 16-bit rows as float32; on a GPU, in the compute dtype.
    - under `rack` and `full`, in the rack, each microbatch: every split block parameter all-gathered where it is read
      (again in its recomputed forward under remat; a matrix in the compute dtype) and its gradient reduce-scattered
      (float32); the embedding and head gathered once a step (XLA hoists that out of the microbatch loop).
    - the gradient, once a step: a leaf split over the rack all-reduced across racks as it is held (1/X); a whole
      one reduce-scattered in the rack, all-reduced across racks in 1/X slices and all-gathered back. In the rack
      in float32, across racks in `train.grad_reduce_dtype`.
    - `optimizer` and `full` split moments over the racks too: the new parameters all-gathered across racks, once.
    - small, each microbatch: the balancer's histogram (reduce-scattered by expert in the rack, summed across racks
      in 1/X slices), its ranges, and the load and drop counts.
    `params`: `param_bytes(cfg, platform)` where the caller has it already.
    """
    R, X, M = cfg.mesh.replica, cfg.mesh.expert, cfg.train.microbatches
    n = R * X
    model, moe = cfg.model, cfg.model.moe
    L, Ld, E, k = model.num_moe_layers, model.dense_layers, moe.num_experts, moe.num_experts_per_token
    tokens = rows_per_microbatch(cfg) * model.seq_len  # one device's, one microbatch
    remat = model.remat != "none"
    out = Counter()
    if n == 1:
        return {key: 0 for key in COMM_KEYS}
    g = params or param_bytes(cfg, platform)
    itemsize = 4 if platform == "cpu" else jnp.dtype(cfg.train.compute_dtype).itemsize  # XLA on CPU moves 16-bit as 32
    if moe.dispatch == "ep" and X > 1:
        W = moe.num_waves
        P = exchange.pool_size(tokens, k, X, E // X, W, moe.resolved_transport_capacity_factor)
        rows = (3 if remat else 2) * 2 * X * P * model.expert_input_dim * itemsize
        ids = (2 if remat else 1) * X * P * 4
        out["all_to_all_in_rack"] += M * L * W * ring(rows + ids, X)
    blocks_split, blocks_read = L * g.layer_split + Ld * g.dense_split, L * g.layer_read + Ld * g.dense_read
    # The top's gather reads no microbatch: XLA hoists it out of the microbatch loop, once a step.
    out["all_gather_in_rack"] += M * ring((1 + remat) * blocks_read, X) + ring(g.top_read, X)
    out["reduce_scatter_in_rack"] += M * ring(blocks_split + g.top_split, X)  # float32
    # The gradient, once a step: across racks in `train.grad_reduce_dtype` (the bytes above are float32, as held).
    across = 1.0 if platform == "cpu" else jnp.dtype(cfg.train.grad_reduce_dtype).itemsize / 4
    held = (blocks_split + g.top_split + L * g.experts) / X
    out["all_reduce_across_racks"] += 2 * ring(held, R) * across
    whole = L * g.layer_whole + Ld * g.dense_whole + g.top_whole
    if X > 1 and R > 1:
        out["reduce_scatter_in_rack"] += ring(whole, X)
        out["all_reduce_across_racks"] += 2 * ring(whole / X, R) * across
        out["all_gather_in_rack"] += ring(whole, X)
    elif R == 1:
        out["all_reduce_in_rack"] += 2 * ring(whole, n)
    else:
        out["all_reduce_across_racks"] += 2 * ring(whole, n) * across
    # `optimizer` / `full`: the update is computed where the moments are, and the new parameters shared back.
    out["all_gather_across_racks"] += ring(g.updated_whole, n) + ring(g.updated_split, R)
    # The balancer and the statistics, each microbatch and MoE layer.
    small = 4 * (E + 6)  # the load and the drop counts, float32
    if moe.balancing == "hist":
        solves = 1 + (moe.rebalance_iterations if moe.rebalance_steps else 0)
        hist = 4 * E * moe.hist_bins
        small += solves * 2 * 4 * E  # the ranges (pmax)
        if X > 1 and E % X == 0:  # `balancing.fair_share_quantile_hist`'s two stages
            out["reduce_scatter_in_rack"] += M * L * solves * ring(hist, X)
            out["all_reduce_across_racks"] += M * L * solves * 2 * ring(hist / X, R)
            out["all_gather_in_rack"] += M * L * solves * ring(4 * E, X)
        else:
            small += solves * hist
    out["all_reduce_in_rack" if R == 1 else "all_reduce_across_racks"] += M * L * 2 * ring(small, n)
    return {key: int(out[key]) for key in COMM_KEYS}


COMM_KEYS = ("all_to_all_in_rack", "all_gather_in_rack", "reduce_scatter_in_rack", "all_reduce_in_rack",
             "all_gather_across_racks", "all_reduce_across_racks")

