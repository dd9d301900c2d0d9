"""How much memory one device needs for a config's train step, and what it moves per step (`moelab plan`).

    plan = memory_plan.plan(presets.get("frontier-535b"), hbm=186e9)
    plan.total, plan.fits, plan.largest, plan.advice

Counted before launch, nothing allocated. The state terms are exact: every leaf of `init_state`'s
abstract tree, divided by the devices `parallel.mesh.leaf_spec` splits it over. The activations are
what JAX itself saves for the backward pass of `transformer.loss` on one device's microbatch, under the
config's remat policy (`saved_residuals` of the traced program: the same residuals the compiled step
keeps), plus the backward's working set (`activation_bytes`). Two phases of the step
peak: the backward (one microbatch's gradient, the running gradient sum, the activations, one gathered
layer) and the update (the gradient, Adam's update, float32 copies of the moments of the largest array).
The peak is the state plus the larger phase.

Approximations, each named in `docs/scaling-out.md`: `ep`'s buffers are counted as the `capacity`
backend's for the device's tokens (the same rows: capacity factor x tokens x k); attention's scores
are counted as materialized on CPU and as fused (cuDNN, none kept) on GPU; the partitioner's own
copies are not modelled. `benchmarks/plan_vs_xla.py` compares the total with XLA's compiled memory
analysis on simulated CPU meshes.

Communication is per device per step, counted from the layout: the all-to-alls of `ep` (forward,
backward, and the recomputed forward under remat), the per-layer all-gathers of `full`, the gradient
reduce-scatters inside a rack, and the all-reduce across racks; times at the stated link bandwidths
(inside a rack over NVLink, between racks over the network), with no overlap assumed.
"""

from __future__ import annotations

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig, from_dict, to_dict
from moelab.errors import ConfigError
from moelab.model import transformer
from moelab.parallel import mesh as mesh_lib
from moelab.train.state import init_state, make_optimizer

__all__ = ["Links", "Plan", "plan", "parse_bytes", "state_bytes", "activation_bytes", "communication", "collective_bytes",
           "compile_step", "compiled_figures", "compile_in_subprocess"]

GB = 1e9


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

    @property
    def fits(self) -> bool | None:
        return None if self.hbm is None else self.total <= self.hbm

    @property
    def largest(self) -> str:
        return max(self.terms, key=self.terms.get)

    @property
    def advice(self) -> list[str]:
        """What to change, largest lever first; empty when it fits with room to spare."""
        if self.hbm is not None and self.total <= 0.9 * self.hbm:
            return []
        tips, t, shard = [], self.terms, self.mesh["shard"]
        if shard != "full" and t["params"] + t["grads"] > 0.2 * self.total:
            tips.append("--set mesh.shard=full: split the non-expert parameters and gradients across the rack")
        elif shard == "replicate":
            tips.append("--set mesh.shard=optimizer: split the Adam moments across the mesh (ZeRO-1)")
        if t["activations"] > 0.2 * self.total and self.rows_per_microbatch > 1:
            tips.append(f"--microbatches {self.microbatches * 2}: half the sequences a device runs at once")
        if t["activations"] > 0.2 * self.total:
            tips.append("--set model.remat=full: keep each block's input only, recompute the rest")
        if t["moments"] > 0.2 * self.total:
            tips.append("--set train.moment_dtype=bfloat16: store Adam's moments in bfloat16")
        if t["grad_sum"] > 0.2 * self.total:
            tips.append("a larger mesh.expert: the experts' gradients (and their sum) split over more devices")
        return tips or ["a larger mesh.expert, or devices with more memory"]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "mesh": self.mesh, "microbatches": self.microbatches,
                "rows_per_microbatch": self.rows_per_microbatch, "platform": self.platform, "terms": self.terms,
                "total": self.total, "hbm": self.hbm, "fits": self.fits, "largest": self.largest,
                "advice": self.advice, "comm_bytes": self.comm, "comm_seconds": self.comm_seconds,
                "links": {"nvlink": self.links.nvlink, "network": self.links.network}}


def parse_bytes(text: str, name: str) -> int:
    """'186GB', '141 GiB', '8e10' -> bytes; a ConfigError naming `name` otherwise."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={text!r} is invalid: give a positive size such as 186GB, 141GiB or 8e10 (bytes).")
    return int(value)


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


def _residual_bytes(fn, params: Any, *args, experts_split: int = 1,
                    drop_scores_of: int | None = None) -> tuple[int, int]:
    """Bytes JAX saves between `fn(params, *args)`'s forward and backward passes (its residuals): the total
    and the largest one.

    Arguments are not counted (they are the state). A residual shaped like a routed expert's weight (a
    compute-dtype copy of it) is divided by `experts_split`, the devices the experts are split over.
    `drop_scores_of=S` leaves out [..., S, S] attention scores: a fused attention kernel keeps none.
    """
    from jax._src.ad_checkpoint import saved_residuals  # the list jax.ad_checkpoint.print_saved_residuals prints

    expert_shapes = {tuple(leaf.shape[-3:]) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                     if mesh_lib.param_spec(path, leaf) != mesh_lib.P()}

    def counted(aval, why: str) -> float:
        if why.startswith("from the argument"):
            return 0
        if drop_scores_of is not None and aval.ndim >= 2 and aval.shape[-2:] == (drop_scores_of,) * 2:
            return 0
        expert_copy = aval.ndim >= 3 and tuple(aval.shape[-3:]) in expert_shapes
        return _nbytes(aval) / (experts_split if expert_copy else 1)

    sizes = [counted(aval, why) for aval, why in saved_residuals(fn, params, *args)]
    return int(sum(sizes)), int(max(sizes, default=0))


def activation_bytes(cfg: RunConfig, rows: int, platform: str = "gpu") -> int:
    """Activation bytes of one device running `rows` sequences, traced on one device (`ep` counted as `capacity`).

    The saved residuals of the loss, plus the backward's working set: under remat, the one block it
    recomputes at a time; without, the cotangents of the largest tensor a block keeps (its gradient and
    its input's, two of its size).
    """
    model = cfg.model
    if model.moe.dispatch in ("ep", "dense", "grouped"):
        model = replace(model, moe=replace(model.moe, dispatch="capacity"))
    dtype = jnp.dtype(cfg.train.compute_dtype)
    drop = model.seq_len if platform == "gpu" else None

    def residuals(m, token_cols: int, fn) -> tuple[int, int]:
        params = jax.eval_shape(lambda: transformer.init(m, jax.random.key(0)))
        bias = jax.ShapeDtypeStruct((m.num_layers, m.moe.num_experts), jnp.float32)
        tokens = jax.ShapeDtypeStruct((rows, token_cols), jnp.int32)
        return _residual_bytes(lambda p, t, b: fn(p, t, m, b), params, tokens, bias, experts_split=cfg.mesh.expert,
                               drop_scores_of=drop)

    def block(m, t, b, p):
        return transformer.apply(p, t, m, b, dtype)[0].sum()

    saved, _ = residuals(model, model.seq_len + 1, lambda p, t, m, b: transformer.loss(p, t, m, b, dtype)[0])
    one = replace(model, num_layers=1, remat="none")
    whole, largest = residuals(one, model.seq_len, lambda p, t, m, b: block(m, t, b, p))
    if model.remat == "none":
        return saved + 2 * largest
    bare, _ = residuals(replace(one, remat="full"), model.seq_len, lambda p, t, m, b: block(m, t, b, p))
    return saved + whole - bare  # one block's residuals beyond its saved input


def _layer_split(cfg: RunConfig) -> tuple[int, int, int]:
    """(one layer's non-expert param bytes, the top-level params' bytes, one layer's expert bytes), float32, whole."""
    params = jax.eval_shape(lambda: transformer.init(cfg.model, jax.random.key(0)))
    L = cfg.model.num_layers
    layer, experts = 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params["layers"]):
        if mesh_lib.param_spec(path, leaf) == mesh_lib.P():
            layer += _nbytes(leaf) // L
        else:
            experts += _nbytes(leaf) // L
    top = sum(_nbytes(leaf) for key, leaf in params.items() if key != "layers")
    return layer, top, experts


def _rows_per_microbatch(cfg: RunConfig) -> int:
    """Sequences one device runs at once."""
    return cfg.train.batch_size // (cfg.mesh.num_devices * cfg.train.microbatches)


def communication(cfg: RunConfig, split: tuple[int, int, int] | None = None) -> dict[str, int]:
    """Bytes one device sends per step, by collective (what the layout implies; see the module docstring).
    `split`: `_layer_split(cfg)` where the caller has it already."""
    R, X, M = cfg.mesh.replica, cfg.mesh.expert, cfg.train.microbatches
    model, moe = cfg.model, cfg.model.moe
    L, S = model.num_layers, model.seq_len
    rows = _rows_per_microbatch(cfg)
    layer, top, experts = split or _layer_split(cfg)
    non_expert = L * layer + top
    passes = 3 if model.remat == "full" else 2  # forward, backward, and the forward recomputed under remat
    out = {"all_to_all": 0, "all_gather": 0, "reduce_scatter": 0, "all_reduce_in_rack": 0, "all_reduce_across_racks": 0}
    if moe.dispatch == "ep" and X > 1:
        # Each pass moves every kept assignment's row out and its result back: cf * tokens * k rows of Din.
        rows_moved = (moe.transport_capacity_factor or moe.capacity_factor) * rows * S * moe.num_experts_per_token
        width = model.expert_input_dim * jnp.dtype(cfg.train.compute_dtype).itemsize
        out["all_to_all"] = int(2 * passes * M * L * rows_moved * width * (X - 1) / X)
    shard = cfg.mesh.shard
    if shard == "full" and X > 1:
        out["all_gather"] = int(passes * M * non_expert * (X - 1) / X)
        out["reduce_scatter"] = int(M * non_expert * (X - 1) / X)
    elif shard == "optimizer":
        out["reduce_scatter"] = int(non_expert * (R * X - 1) / (R * X))
        out["all_gather"] = int(non_expert * (R * X - 1) / (R * X))  # the new parameters, from their owners
    elif X > 1:
        out["all_reduce_in_rack"] = int(2 * non_expert * (X - 1) / X)
    if R > 1:  # across racks: each device's share of the gradients it does not own alone
        local = (non_expert / X if shard == "full" else 0 if shard == "optimizer" else non_expert) + L * experts / X
        out["all_reduce_across_racks"] = int(2 * local * (R - 1) / R)
    return out


def plan(cfg: RunConfig, hbm: int | None = None, platform: str = "gpu", links: Links = Links()) -> Plan:
    """The per-device memory of `cfg`'s train step on `cfg.mesh` and its communication per step."""
    R, X, M = cfg.mesh.replica, cfg.mesh.expert, cfg.train.microbatches
    rows = _rows_per_microbatch(cfg)
    state = state_bytes(cfg)
    grads = state["params"]  # float32, in the params' layout
    split = _layer_split(cfg)
    layer, top, _ = split
    grad_sum = grads if M > 1 else 0
    activations = activation_bytes(cfg, rows, platform)
    gathered = 2 * (layer + top) if cfg.mesh.shard == "full" and X > 1 else 0  # one layer + embeddings, and grads
    # The update reads the largest array's two moments in float32 when they are stored narrower.
    moments_f32 = 2 * state["largest_param"] if cfg.train.moment_dtype != "float32" else 0
    backward = grad_sum + activations + gathered
    update = grads + moments_f32  # Adam's update, the size of the gradient, and the float32 moments of one array
    terms = {
        "params": state["params"],
        "moments": state["moments"],
        "grads": grads,
        "grad_sum": grad_sum,
        "activations": activations,
        "gathered": gathered,
        "update": max(0, update - backward),  # only what the update phase needs beyond the backward's peak
        "other_state": state["other_state"],
    }
    comm = communication(cfg, split)
    seconds = {k: v / (links.network if k == "all_reduce_across_racks" else links.nvlink) for k, v in comm.items()}
    return Plan(name=cfg.name, mesh={"replica": R, "expert": X, "shard": cfg.mesh.shard}, microbatches=M,
                rows_per_microbatch=rows, platform=platform, terms=terms, total=int(sum(terms.values())), hbm=hbm,
                comm=comm, comm_seconds=seconds, links=links)


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


def collective_bytes(hlo: str) -> dict[str, int]:
    """Result bytes of each kind of collective per execution of an HLO module's entry computation, per device.

    Walks from ENTRY: a collective (or its async `-start`) adds its result's bytes; a while loop adds its
    body's total times its `known_trip_count` (an unknown trip count raises rather than guessing); a
    conditional adds its largest branch; any other called computation adds its total once.
    """
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
                count[kind] += _shape_bytes(result)
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

    found = total(entry)
    return {kind: int(found.get(kind, 0)) for kind in COLLECTIVES}


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
            "collectives": collective_bytes(compiled.as_text()), "compile_seconds": round(seconds, 1)}


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
