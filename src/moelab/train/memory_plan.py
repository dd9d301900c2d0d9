"""How much memory one device needs for a config's train step, and what it moves per step (`moelab plan`).

    plan = memory_plan.plan(presets.get("frontier-535b"), hbm=186e9, advise_too=True)
    plan.total, plan.fits, plan.largest, plan.advice    # advice: one-setting changes, re-planned

Counted before launch, nothing allocated. The state terms are exact: every leaf of `init_state`'s
abstract tree, divided by the devices `parallel.mesh.leaf_spec` splits it over. The activations are
what JAX itself saves for the backward pass of `transformer.loss` on one device's microbatch, under the
config's remat policy (`saved_residuals` of the traced program: the same residuals the compiled step
keeps), with attention traced as the target compiles it (`_traced_as_on`), plus the backward's working
set (`activation_bytes`). The peak is the state plus the largest of three phases (`plan`): the head's
backward, the blocks' backward and the update.

Approximations, each named in `docs/scaling-out.md`: `ep`'s buffers are counted as the `capacity`
backend's for the device's tokens (the same rows: capacity factor x tokens x k); the partitioner's own
copies are not modelled. `benchmarks/plan_vs_xla.py` compares the total with XLA's compiled memory
analysis on simulated CPU meshes; `tests/test_memory_plan.py` pins the H200's measured peaks.

Why one module of ~600 lines: the plan and the compiler's figures it is checked against (`compile_step`,
`collective_bytes`) must count in the same terms, and keeping them together is what keeps them so.

Communication is what one device sends per step in the collectives XLA's partitioner emits
(`communication` lists them), timed at the stated link bandwidths (inside a rack over NVLink, between
racks over the network); `moelab.train.run_length` adds it to the compute, with and without overlap.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig, from_dict, override, to_dict
from moelab.errors import ConfigError
from moelab.model import grouped_matmul, transformer
from moelab.model.moe import build_moe
from moelab.model import exchange
from moelab.parallel import mesh as mesh_lib
from moelab.train.state import init_state

__all__ = ["Links", "Plan", "plan", "parse_bytes", "state_bytes", "activation_bytes", "communication", "collective_bytes",
           "compile_step", "compiled_figures", "compile_in_subprocess"]

GB = 1e9
# XLA's GPU compiler budgets a program's temporaries at (the memory JAX gives it - the arguments and outputs)
# x xla_gpu_memory_limit_slop_factor / 100 (default 95), and past that runs its rematerialization pass after
# scheduling: recomputation nobody asked for. JAX gives it XLA_PYTHON_CLIENT_MEM_FRACTION of the device (0.75
# as the issue of 12-06 measured it; `mem_fraction` takes another).
XLA_GPU_SLOP = 0.95
XLA_MEM_FRACTION = 0.75


@dataclass(frozen=True)
class Links:
    """Per-device link bandwidths, bytes/s one way: NVLink inside a rack, the network between racks.

    Defaults: a GB200 NVL72 rack (NVLink 5, 1.8 TB/s both ways) and 400 Gb/s InfiniBand per GPU.
    """

    nvlink: float = 900e9
    network: float = 50e9


@dataclass(frozen=True)
class Plan:
    """Per-device bytes by term, the verdict, and the communication of one step."""

    name: str
    mesh: dict[str, Any]
    microbatches: int
    rows_per_microbatch: int  # sequences one device runs at once
    platform: str  # "gpu": attention fused; "cpu": scores materialized (what the XLA check compiles)
    terms: dict[str, int]  # bytes per device
    total: int
    hbm: int | None
    comm: dict[str, int]  # bytes one device sends per step, by collective
    comm_seconds: dict[str, float]
    links: Links = field(default_factory=Links)
    phase: str = ""  # the phase of the step that peaks; `terms` are its terms
    phases: dict[str, int] = field(default_factory=dict)  # each phase's per-device total
    # What to change when it does not fit (`advise`): {"set": "KEY=VALUE", "total": bytes, "fits": bool | None}
    advice: tuple[dict[str, Any], ...] = ()

    @property
    def fits(self) -> bool | None:
        return None if self.hbm is None else self.total <= self.hbm

    @property
    def state(self) -> int:
        """What the step takes and gives back (donated, so counted once): XLA's arguments and outputs."""
        return self.terms["params"] + self.terms["moments"] + self.terms["other_state"]

    def compiler_limit(self, mem_fraction: float = XLA_MEM_FRACTION) -> int | None:
        """The temporaries XLA's GPU compiler allows this step before it recomputes on its own; None off a GPU
        or without --hbm."""
        if self.hbm is None or self.platform != "gpu":
            return None
        return int((mem_fraction * self.hbm - self.state) * XLA_GPU_SLOP)

    @property
    def compiler_recomputes(self) -> bool:
        """The step's temporaries exceed `compiler_limit`: XLA will rematerialize to fit, costing step time."""
        limit = self.compiler_limit()
        return limit is not None and self.total - self.state > limit

    @property
    def largest(self) -> str:
        return max(self.terms, key=self.terms.get)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "mesh": self.mesh, "microbatches": self.microbatches,
                "rows_per_microbatch": self.rows_per_microbatch, "platform": self.platform, "terms": self.terms,
                "total": self.total, "phase": self.phase, "phases": self.phases, "hbm": self.hbm, "fits": self.fits,
                "compiler_limit": self.compiler_limit(), "compiler_recomputes": self.compiler_recomputes, "largest": self.largest,
                "advice": list(self.advice), "comm_bytes": self.comm, "comm_seconds": self.comm_seconds,
                "links": {"nvlink": self.links.nvlink, "network": self.links.network}}


def parse_bytes(text: str, name: str) -> int:
    """'186GB', '141 GiB', '8e10B' -> bytes; a ConfigError naming `name` otherwise. A bare number is refused: `--hbm
    80` meant 80 GB, and read as 80 bytes it made every plan "not fit"."""
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={text!r} is invalid: give a positive size such as 186GB, 141GiB or 8e10B (bytes).")
    if unit == "":
        raise ConfigError(f"{name}={text!r} has no unit: write {text.strip()}GB (or {text.strip()}GiB, or B for bytes).")
    if unit not in units:
        hint = f" ({unit}B?)" if unit + "B" in units else ""
        raise ConfigError(f"{name}={text!r} is invalid: the unit {unit!r}{hint} is not one of B, KB, MB, GB, TB, KiB, "
                          "MiB, GiB, TiB; give a positive size such as 186GB or 141GiB.")
    return int(value * units[unit])


def _nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize


def _split(spec: Any, axes: dict[str, int]) -> int:
    """How many devices one leaf is split over under a PartitionSpec."""
    n = 1
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            n *= axes[axis] if axis else 1
    return n


def state_bytes(cfg: RunConfig) -> dict[str, int]:
    """Per-device bytes of the parameters, Adam's moments and the rest of the train state under `cfg.mesh`."""
    axes = {"replica": cfg.mesh.replica, "expert": cfg.mesh.expert}
    state = jax.eval_shape(lambda: init_state(cfg))
    per_device = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _nbytes(leaf) // _split(mesh_lib.leaf_spec(path, leaf, axes, cfg.mesh.shard), axes), state)
    total = lambda tree: int(sum(jax.tree.leaves(tree)))  # noqa: E731
    return {"params": total(per_device.params), "moments": total(per_device.opt_state),
            "other_state": total((per_device.router_bias, per_device.step, per_device.router_load)),
            "largest_param": max(jax.tree.leaves(per_device.params))}


@jax.custom_vjp
def _fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
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


_fused_attention.defvjp(_fused_attention_forward, _fused_attention_backward)


@contextlib.contextmanager
def _traced_as_on(platform: str):
    """Trace the model as `platform` compiles it, whatever JAX's backend here: on "gpu", attention fused
    (`_fused_attention`) and the `grouped` backend's row tile the GPU's; on "cpu", as is."""
    if platform == "cpu":
        yield
        return
    xla_attention, tiles = transformer.causal_attention, grouped_matmul.default_tiles
    transformer.causal_attention = _fused_attention
    grouped_matmul.default_tiles = lambda k_dim, n_dim, on_gpu: tiles(k_dim, n_dim, True)
    try:
        yield
    finally:
        transformer.causal_attention, grouped_matmul.default_tiles = xla_attention, tiles


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


def _residuals(fn, params: Any, *args, vocab_size: int, experts_split: int = 1) -> Residuals:
    """The residuals of `fn(params, *args)` (`saved_residuals`: what the compiled step keeps alive).

    Arguments are not counted (they are the state). A residual shaped like a routed expert's weight (a
    compute-dtype copy of it) is divided by `experts_split`, the devices the experts are split over.
    """
    from jax._src.ad_checkpoint import saved_residuals  # the list jax.ad_checkpoint.print_saved_residuals prints

    expert_shapes = {tuple(leaf.shape[-3:]) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                     if mesh_lib.param_spec(path, leaf) != mesh_lib.P()}
    in_loop = largest = logits_sized = other = 0
    for aval, why in saved_residuals(fn, params, *args):
        if why.startswith("from the argument"):
            continue
        expert_copy = aval.ndim >= 3 and tuple(aval.shape[-3:]) in expert_shapes
        size = _nbytes(aval) // (experts_split if expert_copy else 1)
        if why.startswith("output of scan"):
            in_loop += size
            largest = max(largest, size // aval.shape[0])  # stacked over the scan's layers
        elif aval.ndim >= 2 and aval.shape[-1] == vocab_size:
            logits_sized += size
        else:
            other += size
    return Residuals(in_loop, largest, logits_sized, other)


@dataclass(frozen=True)
class Activations:
    """One device's activation bytes for one microbatch, by when they are live (see `activation_bytes`)."""

    saved: int  # every residual of the loss: live from the end of the forward pass
    logits_sized: int  # of which the logits-sized ones, freed after the head's backward
    logits_grad: int  # the head's backward: the logits' float32 cotangent
    block_work: int  # one block's backward: what its remat policy recomputes, and two cotangents of its largest tensor


def activation_bytes(cfg: RunConfig, rows: int, platform: str = "gpu") -> Activations:
    """Activation bytes of one device running `rows` sequences, traced on one device (`ep` counted as `capacity`).

    The saved residuals of the loss as JAX lists them, with attention as `platform` runs it (fused on a
    GPU: q, k, v, output and softmax statistics; XLA's scores on CPU). The backward pass starts at the
    head: every residual is live, and so is the cotangent of the logits (float32: the transpose of the
    loss's gather is a scatter XLA materializes; its cast to the compute dtype fuses into the head's
    matmuls, which read it). Then each block's backward runs, in the loop: the logits-sized residuals are gone, and one
    block recomputes what its remat policy did not save (its residuals under no remat, less those under
    its policy) and holds two cotangents of its largest residual (its gradient and its input's).
    """
    model = cfg.model
    if model.moe.dispatch == "ep":
        model = replace(model, moe=replace(model.moe, dispatch="capacity"))
    dtype = jnp.dtype(cfg.train.compute_dtype)

    def residuals(m, token_cols: int, fn) -> Residuals:
        params = jax.eval_shape(lambda: transformer.init(m, jax.random.key(0)))
        bias = jax.ShapeDtypeStruct((m.num_moe_layers, m.moe.num_experts), jnp.float32)
        tokens = jax.ShapeDtypeStruct((rows, token_cols), jnp.int32)
        with _traced_as_on(platform):
            return _residuals(lambda p, t, b: fn(p, t, m, b), params, tokens, bias, vocab_size=m.vocab_size,
                              experts_split=cfg.mesh.expert)

    def block(p, t, m, b):
        return transformer.apply(p, t, m, b, dtype, dispatch=build_moe(m))[0].sum()

    saved = residuals(model, model.seq_len + 1,
                      lambda p, t, m, b: transformer.loss(p, t, m, b, dtype, dispatch=build_moe(m))[0])
    one = replace(model, num_layers=1, dense_layers=0, remat="none")
    recomputed = 0
    if model.remat != "none":
        recomputed = (residuals(one, model.seq_len, block).in_loop
                      - residuals(replace(one, remat=model.remat), model.seq_len, block).in_loop)
    logits = rows * model.seq_len * model.vocab_size
    return Activations(saved=saved.total, logits_sized=saved.logits_sized,
                       logits_grad=logits * 4,
                       block_work=recomputed + 2 * saved.largest_per_layer)


def _rows_per_microbatch(cfg: RunConfig) -> int:
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


def _param_bytes(cfg: RunConfig, platform: str = "gpu") -> ParamBytes:
    """`ParamBytes` read off the params `transformer.init` would make and their `leaf_spec` on `cfg.mesh`; the bytes
    as gathered in the compute dtype as `platform` moves them (XLA on CPU moves 16-bit rows as float32)."""
    read_itemsize = 4 if platform == "cpu" else jnp.dtype(cfg.train.compute_dtype).itemsize
    params = jax.eval_shape(lambda: transformer.init(cfg.model, jax.random.key(0)))
    axes = {"replica": cfg.mesh.replica, "expert": cfg.mesh.expert}
    sums = Counter()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        where = {"layers": "layer", "dense_layers": "dense"}.get(keys[0], "top")
        per_layer = _nbytes(leaf) // (leaf.shape[0] if where != "top" else 1)
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
            sums["updated_split" if "expert" in spec else "updated_whole"] += _nbytes(leaf) // _split(spec, axes)
    return ParamBytes(**{name: int(sums[name]) for name in ParamBytes._fields})


def ring(size: float, group: int) -> float:
    """Bytes one device sends to pass `size` bytes around a ring of `group` devices: size (group - 1) / group. The
    one formula behind every count here (an all-reduce sends it twice: a reduce-scatter and an all-gather)."""
    return size * (group - 1) / group if group > 1 else 0.0


def communication(cfg: RunConfig, platform: str = "gpu", params: ParamBytes | None = None) -> dict[str, int]:
    """Bytes one device sends per step, by collective and link: `<kind>_in_rack` over the rack's links, `<kind>_across_racks`
    over the network. What the per-device step (`moelab.parallel.spmd`) emits, compiled (`collective_bytes_by_link`;
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
    `params`: `_param_bytes(cfg, platform)` where the caller has it already.
    """
    R, X, M = cfg.mesh.replica, cfg.mesh.expert, cfg.train.microbatches
    n = R * X
    model, moe = cfg.model, cfg.model.moe
    L, Ld, E, k = model.num_moe_layers, model.dense_layers, moe.num_experts, moe.num_experts_per_token
    tokens = _rows_per_microbatch(cfg) * model.seq_len  # one device's, one microbatch
    remat = model.remat != "none"
    out = Counter()
    if n == 1:
        return {key: 0 for key in COMM_KEYS}
    g = params or _param_bytes(cfg, platform)
    itemsize = 4 if platform == "cpu" else jnp.dtype(cfg.train.compute_dtype).itemsize  # XLA on CPU moves 16-bit as 32
    if moe.dispatch == "ep" and X > 1:
        W = moe.num_waves
        P = exchange.pool_size(tokens, k, X, E // X, W, moe.transport_factor)
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


# One-setting changes `advise` tries, largest lever first: (field, value, what it does).
_LEVERS = (
    ("mesh.shard", "full", "split the non-expert parameters, gradients and moments across the rack"),
    ("mesh.shard", "optimizer", "split the Adam moments across the mesh (ZeRO-1)"),
    ("train.microbatches", None, "half the sequences a device runs at once"),
    ("model.remat", "full", "keep each block's input only, recompute the rest"),
    ("model.remat", "dots", "keep the matmul outputs, recompute the rest"),
    ("train.moment_dtype", "bfloat16", "store Adam's moments in bfloat16"),
)


def advise(cfg: RunConfig, current: Plan, platform: str = "gpu", links: Links = Links()) -> tuple[dict[str, Any], ...]:
    """Each one-setting change that lowers `current`'s total on the same mesh, re-planned: {"set": "KEY=VALUE" (as
    `moelab train --set` takes it), "why", "total", "fits" (alone, against `current.hbm`)}, the lowest total first.
    A setting that changes nothing here (a layout on one device) or that the config refuses is left out."""
    tips = []
    for key, value, why in _LEVERS:
        if key == "train.microbatches":
            value = cfg.train.microbatches * 2
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == value:
            continue
        try:
            changed = override(cfg, {key: value})
            total = plan(changed, current.hbm, platform, links).total
        except ConfigError:
            continue
        if total < 0.99 * current.total:
            tips.append({"set": f"{key}={value}", "why": why, "total": total,
                         "fits": None if current.hbm is None else total <= current.hbm})
    return tuple(sorted(tips, key=lambda tip: tip["total"]))


def plan(cfg: RunConfig, hbm: int | None = None, platform: str = "gpu", links: Links = Links(),
         advise_too: bool = False) -> Plan:
    """The per-device memory of `cfg`'s train step on `cfg.mesh` and its communication per step.

    The state (parameters, moments) is live throughout; on top of it, the step's peak is the largest of
    three phases: the head's backward (every saved activation and the logits' cotangent), the blocks'
    backward (the gradient being written, the activations less the logits-sized ones, one block's working
    set) and the update (the gradient, Adam's update and float32 copies of the largest array's moments).
    The running gradient sum of `train.microbatches` > 1 and the gathered layer of `mesh.shard=full` are
    live in both backward phases. `advise_too` (what `moelab plan` asks) re-plans one-setting changes (`advise`)
    when the step is tight or over `hbm`: six more plans, which a caller that reads only the total does not pay.
    """
    R, X, M = cfg.mesh.replica, cfg.mesh.expert, cfg.train.microbatches
    rows = _rows_per_microbatch(cfg)
    state = state_bytes(cfg)
    grads = state["params"]  # float32, in the params' layout
    g = _param_bytes(cfg, platform)
    grad_sum = grads if M > 1 else 0
    act = activation_bytes(cfg, rows, platform)
    # one layer + embeddings, and their grads
    gathered = 2 * g.gathered_layer() if cfg.mesh.shard in ("rack", "full") and X > 1 else 0
    # The update reads the largest array's two moments in float32 when they are stored narrower.
    moments_f32 = 2 * state["largest_param"] if cfg.train.moment_dtype != "float32" else 0
    phases = {
        "head backward": {"grad_sum": grad_sum, "activations": act.saved, "logits_grad": act.logits_grad,
                          "gathered": gathered},
        "blocks backward": {"grads": grads, "grad_sum": grad_sum, "activations": act.saved - act.logits_sized,
                            "block_work": act.block_work, "gathered": gathered},
        "update": {"grads": grads, "update": grads + moments_f32},
    }
    peak = max(phases, key=lambda name: sum(phases[name].values()))
    always = {"params": state["params"], "moments": state["moments"], "other_state": state["other_state"]}
    keys = ("grads", "grad_sum", "activations", "logits_grad", "block_work", "gathered", "update")
    terms = {**always, **{key: phases[peak].get(key, 0) for key in keys}}
    comm = communication(cfg, platform, g)
    seconds = {k: v / (links.network if k.endswith("across_racks") else links.nvlink) for k, v in comm.items()}
    result = Plan(name=cfg.name, mesh={"replica": R, "expert": X, "shard": cfg.mesh.shard}, microbatches=M,
                  rows_per_microbatch=rows, platform=platform, terms=terms, total=int(sum(terms.values())), hbm=hbm,
                  comm=comm, comm_seconds=seconds, links=links, phase=peak,
                  phases={name: int(sum(always.values()) + sum(t.values())) for name, t in phases.items()})
    if advise_too and (hbm is None or result.total > 0.9 * hbm):  # tight or over: what would help
        result = replace(result, advice=advise(cfg, result, platform, links))
    return result


# ----------------------------------------------------------------------------------------------
# the compiler's figures: the real train step compiled on abstract arrays (nothing allocated or run)

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


def _shape_bytes(types: str) -> int:
    """Bytes of an HLO type or tuple of types, e.g. `(f32[1,13,32]{2,1,0}, s32[1,13]{1,0})`."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types):
        if dtype in DTYPE_BYTES:
            total += math.prod(int(d) for d in filter(None, dims.split(","))) * DTYPE_BYTES[dtype]
    return total


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective, as positions in the mesh's device order: listed `{{0,1},{2,3}}`, the iota
    form `[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`, the mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, a
    collective-permute's `source_target_pairs`; one group of all `num_devices` when it names none."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = {axis: int(size) for axis, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
        names = list(sizes)
        over = set(re.findall(r"'(\w+)'", mesh.group(2)))
        ids = np.arange(num_devices).reshape([sizes[a] for a in names])
        kept = [i for i, a in enumerate(names) if a in over]
        moved = np.moveaxis(ids, kept, list(range(len(names) - len(kept), len(names))))
        return moved.reshape(-1, math.prod(sizes[names[i]] for i in kept)).tolist()
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    listed = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if listed and listed.group(1) != "{}":
        return [[int(d) for d in group.split(",")] for group in re.findall(r"\{([\d,]+)\}", listed.group(1))]
    if "source_target_pairs=" in line:
        return [[int(d) for d in pair.split(",")] for pair in re.findall(r"\{(\d+,\d+)\}", line)]
    return [list(range(num_devices))]


def _group_size(line: str, num_devices: int) -> int:
    """Devices in each replica group of a collective (a collective-permute: 2, a sender and a receiver)."""
    if "source_target_pairs=" in line:
        return 2
    return len(replica_groups(line, num_devices)[0])


def spans_racks(line: str, num_devices: int, rack_size: int) -> bool:
    """Whether any group of a collective holds devices of two racks (mesh positions p // rack_size differ)."""
    return any(len({d // rack_size for d in group}) > 1 for group in replica_groups(line, num_devices))


def _wire_bytes(kind: str, result: int, n: int) -> float:
    """Bytes one device sends for a collective whose result on it is `result` bytes, over groups of `n`
    (ring algorithms: an all-reduce is a reduce-scatter and an all-gather)."""
    if n <= 1:
        return 0
    return {"all-to-all": ring(result, n), "all-gather": ring(result, n), "reduce-scatter": ring(result * n, n),
            "all-reduce": 2 * ring(result, n), "collective-permute": result}[kind]


def collective_bytes(hlo: str, num_devices: int) -> dict[str, int]:
    """Bytes one device sends per execution of an HLO module's entry computation, by kind of collective.

    Walks from ENTRY: a collective (or its async `-start`) adds what it sends (`_wire_bytes`, from its
    result and its group size); a while loop adds its body's total times its `known_trip_count` (an
    unknown trip count raises rather than guessing); a conditional adds its largest branch; any other
    called computation adds its total once.
    """
    found = _walk(hlo, num_devices, lambda line: "")
    return {kind: int(found.get((kind, ""), 0)) for kind in COLLECTIVES}


LINKS = ("in_rack", "across_racks")


def collective_bytes_by_link(hlo: str, num_devices: int, rack_size: int) -> dict[str, dict[str, int]]:
    """`collective_bytes` split by link: {"in_rack": {kind: bytes}, "across_racks": {kind: bytes}}. A collective
    whose groups hold devices of two racks (`spans_racks`; a rack is `rack_size` consecutive mesh positions, the
    mesh's "expert" axis) crosses the network; every other stays on the rack's links."""
    found = _walk(hlo, num_devices,
                  lambda line: LINKS[spans_racks(line, num_devices, rack_size)])
    return {link: {kind: int(found.get((kind, link), 0)) for kind in COLLECTIVES} for link in LINKS}


def _walk(hlo: str, num_devices: int, link: Any) -> Counter:
    """{(kind, link(line)): bytes one device sends} over one execution of the entry computation (`collective_bytes`)."""
    computations: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and line.startswith("  "):
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    @functools.cache
    def total(name: str) -> Counter:
        count: Counter = Counter()
        for line in computations[name]:
            op = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z\-]+)\(", line)
            if not op:
                continue
            result, opcode = op.groups()
            kind = opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                count[(kind, link(line))] += _wire_bytes(kind, _shape_bytes(result), _group_size(line, num_devices))
            elif opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                if trips is None:
                    raise ValueError(f"while loop {body} has no known trip count; cannot count its collectives")
                for k, v in total(body).items():
                    count[k] += int(trips.group(1)) * v
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
                count += max((total(b.strip().lstrip("%")) for b in branches.split(",")), key=lambda c: sum(c.values()))
            else:
                for called in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    count += total(called)
        return count

    return total(entry)


def compile_step(cfg: RunConfig) -> Any:
    """`make_train_step(cfg, mesh)` lowered and compiled on abstract inputs; the devices must exist
    (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)."""
    from moelab.train.loop import make_train_step
    from moelab.train.state import state_shardings

    mesh = mesh_lib.make_mesh(cfg.mesh)
    shapes = jax.eval_shape(lambda: init_state(cfg))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                         state_shardings(cfg, mesh))
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    lowered = make_train_step(cfg, mesh).lower(state, tokens, jnp.float32(jnp.inf))
    # LLVM's optimizations would double the compile time; they come after the HLO passes that place the
    # collectives and assign the buffers, so the figures read here are the same without them.
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})


def compiled_figures(cfg: RunConfig) -> dict[str, Any]:
    """XLA's per-device memory (`memory_analysis`) and collective bytes of the compiled step, and the compile time."""
    started = time.perf_counter()
    compiled = compile_step(cfg)
    seconds = time.perf_counter() - started
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"total": int(total), "arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "outputs_not_aliased": int(m.output_size_in_bytes - m.alias_size_in_bytes),
            "collectives": collective_bytes(compiled.as_text(), cfg.mesh.num_devices), "compile_seconds": round(seconds, 1)}


def compile_in_subprocess(cfg: RunConfig, timeout: float = 1800) -> dict[str, Any]:
    """`compiled_figures(cfg)` in a fresh Python on `cfg.mesh.num_devices` simulated CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={cfg.mesh.num_devices}".strip()}
    done = subprocess.run([sys.executable, "-m", "moelab.train.memory_plan"], input=json.dumps(to_dict(cfg)),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {cfg.name} on {cfg.mesh.num_devices} simulated devices failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the child of compile_in_subprocess: a config's JSON on stdin, figures on stdout
    print(json.dumps(compiled_figures(from_dict(json.loads(sys.stdin.read())))))
