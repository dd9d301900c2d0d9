"""How much memory one device needs for a config's train step (`moelab plan`; what it sends is `traffic`'s).

    plan = memory_plan.plan(presets.get("frontier-535b"), hbm=186e9, advise_too=True)
    plan.total, plan.fits, plan.largest, plan.advice    # advice: one-setting changes, re-planned

Counted before launch, nothing allocated. The state terms are exact: every leaf of `init_state`'s
abstract tree, divided by the devices `parallel.mesh.leaf_spec` splits it over. The activations are
what JAX itself saves for the backward pass of `transformer.loss` on one device's microbatch, under the
config's remat policy (`moelab.train.residuals`: the same residuals the compiled step keeps), with attention
and the grouped GEMM traced as the target compiles them, plus the backward's working set (`activation_bytes`).
The peak is the state plus the largest of three phases (`plan`): the head's backward, the blocks' backward and
the update.

Approximations, each named in `docs/scaling-out.md`: `ep`'s buffers are counted as the `capacity`
backend's for the device's tokens (the same rows: capacity factor x tokens x k); the partitioner's own
copies are not modelled. `benchmarks/plan_vs_xla.py` compares the total with XLA's compiled memory
analysis on simulated CPU meshes; `tests/test_memory_plan.py` pins the H200's measured peaks.

Communication is what one device sends per step (`moelab.train.traffic`), timed at the stated link bandwidths
(inside a rack over NVLink, between racks over the network); `moelab.train.run_length` adds it to the compute,
with and without overlap. The compiler's own figures, which `--compile` and the benchmarks compare with these,
are `moelab.train.hlo`'s.
"""


from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp

from moelab.config import RunConfig, override
from moelab.errors import ConfigError
from moelab.model import transformer
from moelab.model.moe import build_moe
from moelab.parallel import mesh as mesh_lib
from moelab.train import residuals as residuals_lib
from moelab.train.state import init_state
from moelab.train.traffic import Links, devices_split_over, communication, nbytes, param_bytes, rows_per_microbatch

__all__ = ["XLA_GPU_SLOP", "XLA_MEM_FRACTION", "Plan", "parse_bytes", "state_bytes", "Activations",
           "activation_bytes", "advise", "plan"]

# XLA's GPU compiler budgets a program's temporaries at (the memory JAX gives it - the arguments and outputs)
# x xla_gpu_memory_limit_slop_factor / 100 (default 95), and past that runs its rematerialization pass after
# scheduling: recomputation nobody asked for. JAX gives it XLA_PYTHON_CLIENT_MEM_FRACTION of the device (0.75
# as the issue of 12-06 measured it; `mem_fraction` takes another).
XLA_GPU_SLOP = 0.95
XLA_MEM_FRACTION = 0.75

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


def state_bytes(cfg: RunConfig) -> dict[str, int]:
    """Per-device bytes of the parameters, Adam's moments and the rest of the train state under `cfg.mesh`."""
    axes = {"replica": cfg.mesh.replica, "expert": cfg.mesh.expert}
    state = jax.eval_shape(lambda: init_state(cfg))
    per_device = jax.tree_util.tree_map_with_path(
        lambda path, leaf: nbytes(leaf) // devices_split_over(mesh_lib.leaf_spec(path, leaf, axes, cfg.mesh.shard), axes), state)
    total = lambda tree: int(sum(jax.tree.leaves(tree)))  # noqa: E731
    return {"params": total(per_device.params), "moments": total(per_device.opt_state),
            "other_state": total((per_device.router_bias, per_device.step, per_device.router_load)),
            "largest_param": max(jax.tree.leaves(per_device.params))}


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

    on_gpu = platform == "gpu"
    attend = residuals_lib.fused_attention if on_gpu else transformer.causal_attention

    def residuals(m, token_cols: int, fn) -> residuals_lib.Residuals:
        params = jax.eval_shape(lambda: transformer.init(m, jax.random.key(0)))
        bias = jax.ShapeDtypeStruct((m.num_moe_layers, m.moe.num_experts), jnp.float32)
        tokens = jax.ShapeDtypeStruct((rows, token_cols), jnp.int32)
        dispatch = replace(build_moe(m), tiled_for_gpu=on_gpu)  # the grouped GEMM's tiles as `platform` picks them
        return residuals_lib.of(lambda p, t, b: fn(p, t, m, b, dispatch), params, tokens, bias,
                                vocab_size=m.vocab_size, experts_split=cfg.mesh.expert)

    def block(p, t, m, b, dispatch):
        return transformer.apply(p, t, m, b, dtype, dispatch=dispatch, attend=attend)[0].sum()

    saved = residuals(model, model.seq_len + 1,
                      lambda p, t, m, b, dispatch: transformer.loss(p, t, m, b, dtype, dispatch=dispatch,
                                                                    attend=attend)[0])
    one = replace(model, num_layers=1, dense_layers=0, remat="none")
    recomputed = 0
    if model.remat != "none":
        recomputed = (residuals(one, model.seq_len, block).in_loop
                      - residuals(replace(one, remat=model.remat), model.seq_len, block).in_loop)
    logits = rows * model.seq_len * model.vocab_size
    return Activations(saved=saved.total, logits_sized=saved.logits_sized,
                       logits_grad=logits * 4,
                       block_work=recomputed + 2 * saved.largest_per_layer)


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
    rows = rows_per_microbatch(cfg)
    state = state_bytes(cfg)
    grads = state["params"]  # float32, in the params' layout
    g = param_bytes(cfg, platform)
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

