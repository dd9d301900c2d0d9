"""Named run configurations, and `resolve`: the one way to get a RunConfig.

The presets: the CPU-sized `tiny`, the 535B-A23B frontier target and its ladder rungs, and the
one-GPU benchmark shapes `gpu-small` / `gpu-medium` with their equal-FLOP dense counterparts.
`get(name)` returns a validated preset; `describe()` lists every preset with one line. Anything not
here is expressible in YAML (for example `experiments/mixtral-style.yaml`).

    cfg = resolve("tiny", {"train.steps": 300})                                 # a preset
    cfg = resolve(Path("run.yaml"), {"train.seed": 1})                          # a YAML file
    cfg = resolve({"preset": "tiny", "overrides": {"train.steps": 300}})        # a spec's `config:`

The rung rule (`make_rung`: the target's recipe at another width and depth, same tokens per active
parameter) lives here because the `ladder-d*` presets are rungs of the frontier; `moelab.ladder`
builds its rungs with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from moelab.accounting import count_params, flops_per_token, train_tokens
from moelab.config import (BALANCER_KNOBS, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig, from_dict,
                           did_you_mean, load_yaml, override)
from moelab.errors import ConfigError

__all__ = ["PRESETS", "FRONTIER_LADDER", "LADDERS", "GPU_VOCAB", "EVALS_PER_RUN", "dense_counterpart", "get",
           "describe", "resolve", "scale_model", "tokens_per_active_param", "make_rung"]

FRONTIER_TOKENS = 18_750_000_000_000
FRONTIER_VOCAB = 128_256
FRONTIER_SEQ = 4096
FRONTIER_BATCH = 11_264


def _tiny() -> RunConfig:
    model = ModelConfig(
        vocab_size=257,  # the byte tokenizer: 256 bytes + eos
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=128,
        moe=MoEConfig(
            num_experts=8,
            num_experts_per_token=2,
            expert_dim=64,
            num_shared_experts=1,
            shared_expert_dim=64,
            latent_dim=32,
            capacity_factor=1.15,
            dispatch="capacity",
            balancing="hist",
        ),
    )
    train = TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=30, eval_every=100, log_every=10)
    return RunConfig(name="tiny", model=model, train=train)


def _frontier() -> RunConfig:
    half = 6144 // 2
    model = ModelConfig(
        vocab_size=FRONTIER_VOCAB,
        d_model=6144,
        num_layers=48,
        num_heads=48,
        num_kv_heads=12,
        head_dim=128,
        seq_len=FRONTIER_SEQ,
        remat="full",  # keep each block's input only: 48 blocks' activations do not fit beside the state
        moe=MoEConfig(num_experts=384, num_experts_per_token=8, expert_dim=half, num_shared_experts=2,
                      shared_expert_dim=half, latent_dim=half, capacity_factor=1.15, num_waves=3,
                      dispatch="ep", balancing="hist"),  # ep: the backend that shards experts over mesh.expert=64
    )
    steps = math.ceil(FRONTIER_TOKENS / (FRONTIER_BATCH * FRONTIER_SEQ))
    return RunConfig(
        name="frontier-535b",
        model=model,
        # 11 racks of 64 (the seed's 704 GPUs): 16 sequences per device, run one at a time (microbatches=16),
        # non-expert state split across each rack and whole on every rack (`rack`: only the gradient crosses racks,
        # once a step) and bfloat16 Adam moments: `moelab plan` puts this at 157.5 GB a device against 186 GB of
        # HBM and 77 days at MFU 31.9% (docs/scaling-out.md).
        train=TrainConfig(steps=steps, batch_size=FRONTIER_BATCH, lr=3e-4, warmup_steps=2000, eval_every=1000,
                          compute_dtype="bfloat16", moment_dtype="bfloat16", microbatches=16),
        mesh=MeshConfig(replica=11, expert=64, shard="rack"),
    )


# The frontier's published ladder: (d_model, num_layers) per rung; heads follow from head dim 128.
FRONTIER_LADDER = ((768, 8), (1024, 12), (1536, 16), (2048, 22))
FRONTIER_RUNG_BATCH = 256


def _ladder(d_model: int, num_layers: int) -> RunConfig:
    """A rung of the frontier recipe at the frontier's tokens per active parameter."""
    return make_rung(_frontier(), d_model, num_layers, batch_size=FRONTIER_RUNG_BATCH, lr=1e-3)


# One-GPU benchmark shapes (benchmarks/gpu_suite.sh). Vocabulary 32768: a realistic BPE size (a
# multiple of 128 for the tensor cores). The byte vocabulary (257) would make the lm head vanish from
# the FLOPs; 128256 would make embedding + head a third of gpu-small's parameters and its float32
# logits (tokens x V x 4 bytes) the largest activation of the step, which is not what we measure.
GPU_VOCAB = 32_768


# Their runs are 1000 steps of 4-16 sequences, and every one of them routes under the bias solved on its
# own batch: with so few sequences a step, each batch asks for its own experts and the carried bias dropped
# 30% of the assignments for 60 steps (issue 39, docs/benchmarks.md "Early training").
GPU_STEPS = 1000


def _gpu(name: str, d_model: int, num_layers: int, width: int, seq_len: int, batch_size: int,
         remat: str = "none") -> RunConfig:
    """A one-H200 MoE: 64 experts top-8 of `width`, 2 shared of `width`, latent `width`, head dim 128, GQA 4:1."""
    heads = d_model // 128
    model = ModelConfig(
        vocab_size=GPU_VOCAB, d_model=d_model, num_layers=num_layers, num_heads=heads, num_kv_heads=heads // 4,
        head_dim=128, seq_len=seq_len, remat=remat,
        moe=MoEConfig(num_experts=64, num_experts_per_token=8, expert_dim=width, num_shared_experts=2,
                      shared_expert_dim=width, latent_dim=width, capacity_factor=1.15, dispatch="capacity",
                      balancing="hist", rebalance_steps=GPU_STEPS),
    )
    train = TrainConfig(steps=GPU_STEPS, batch_size=batch_size, lr=1e-3, warmup_steps=100, compute_dtype="bfloat16")
    return RunConfig(name=name, model=model, train=train)


def dense_counterpart(cfg: RunConfig, multiple: int = 128) -> RunConfig:
    """The dense model with `cfg`'s active training FLOPs per token (`accounting.flops_per_token`).

    One expert, top-1, no shared experts, no latent; its width is the one that makes the FLOPs equal,
    rounded to a multiple of `multiple` (a ConfigError if that misses by more than 1%).
    """
    moe_model = cfg.model
    # No balancing, so none of the balancers' knobs (a MoE knob left set would be refused under "none").
    knobs = {f.name: f.default for f in dataclasses.fields(MoEConfig)
             if any(f.name in names for names in BALANCER_KNOBS.values())}
    dense_moe = replace(moe_model.moe, num_experts=1, num_experts_per_token=1, num_shared_experts=0,
                        shared_expert_dim=None, latent_dim=None, dispatch="dense", balancing="none", **knobs)
    base = replace(moe_model, moe=replace(dense_moe, expert_dim=multiple))
    target, at_base = flops_per_token(moe_model), flops_per_token(base)
    per_unit = 6 * moe_model.num_layers * 3 * moe_model.d_model  # FLOPs per token per unit of width
    width = max(multiple, round((multiple + (target - at_base) / per_unit) / multiple) * multiple)
    dense = replace(base, moe=replace(dense_moe, expert_dim=width))
    miss = abs(flops_per_token(dense) / target - 1)
    if miss > 0.01:
        raise ConfigError(f"no dense width that is a multiple of {multiple} matches {cfg.name}'s FLOPs within 1% "
                          f"(best {width} misses by {miss:.2%}); pass a smaller multiple.")
    return replace(cfg, name=f"{cfg.name}-dense", model=dense)


def _gpu_small() -> RunConfig:
    # 32k tokens a step; estimated ~15 GB of state (0.8B params x 16 bytes) + ~40 GB of activations.
    return _gpu("gpu-small", 1024, 12, 512, 2048, batch_size=16)


def _gpu_medium() -> RunConfig:
    # 16k tokens a step; estimated ~60 GB of state (3.7B params x 16 bytes) + ~15 GB of gradients and
    # ~40 GB of activations with the dot outputs saved and the elementwise work recomputed.
    return _gpu("gpu-medium", 2048, 16, 1024, 4096, batch_size=4, remat="dots")


PRESETS = {
    "tiny": (_tiny, "CPU-sized MoE for tests and the demo: d 64, 2 layers, 8 experts top-2, latent 32, 1 shared."),
    "frontier-535b": (_frontier, "The 535B-total / 23B-active target: d 6144, 48 layers, 384 experts top-8, "
                                 "latent 3072, 2 shared, 18.75T tokens."),
    **{f"ladder-d{d}": (lambda d=d, layers=layers: _ladder(d, layers),
                        f"Ladder rung of the frontier recipe: d {d}, {layers} layers, {d // 128} heads.")
       for d, layers in FRONTIER_LADDER},
    "gpu-small": (_gpu_small, ("One-H200 benchmark MoE: d 1024, 12 layers, 64 experts top-8 (width 512), 2 shared, "
                               "latent 512, seq 2048, bf16.")),
    "gpu-medium": (_gpu_medium, ("One-H200 benchmark MoE: d 2048, 16 layers, 64 experts top-8 (width 1024), 2 shared, "
                                 "latent 1024, seq 4096, bf16, dots remat.")),
    "gpu-small-dense": (lambda: dense_counterpart(_gpu_small()), "Dense model with gpu-small's active FLOPs per token."),
    "gpu-medium-dense": (lambda: dense_counterpart(_gpu_medium()), "Dense model with gpu-medium's active FLOPs per token."),
}


# Presets with a published ladder: rung shapes and the rungs' batch size (`moelab ladder plan --preset`).
LADDERS = {"frontier-535b": (FRONTIER_LADDER, FRONTIER_RUNG_BATCH)}


def get(name: str) -> RunConfig:
    """The preset `name`; an unknown name raises ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, list(PRESETS))}; choose one of: "
                          f"{', '.join(PRESETS)} (see `moelab presets`).")
    return replace(PRESETS[name][0](), name=name)


def describe() -> dict[str, str]:
    return {name: line for name, (_, line) in PRESETS.items()}


def resolve(source: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The RunConfig named by `source`, with dotted `overrides` applied and the whole validated.

    Args:
        source: a preset name (`str`, e.g. "tiny"); a run config YAML file (`Path`); or a mapping: either
            `{preset: NAME, overrides: {dotted.field: value}}` (an experiment spec's `config:`, a ladder
            recipe's `target:`) or a whole RunConfig as plain data.
        overrides: e.g. `{"train.steps": 300}`; applied after the mapping's own overrides, in one pass.

    Raises:
        ConfigError: an unknown preset, a missing or malformed file, or a bad field, by name.
    """
    updates: dict[str, Any] = {}
    if isinstance(source, Path):
        cfg = load_yaml(source)
    elif isinstance(source, str):
        cfg = get(source)
    elif isinstance(source, Mapping) and "preset" in source:
        extra = sorted(set(source) - {"preset", "overrides"})
        if extra:
            raise ConfigError(f"{extra[0]} cannot sit beside preset; put changes under overrides, e.g. "
                              "{preset: tiny, overrides: {train.steps: 300}}.")
        inner = source.get("overrides") or {}
        if not isinstance(inner, Mapping):
            raise ConfigError(f"overrides={inner!r} must map dotted fields to values, e.g. "
                              "overrides: {train.steps: 300}.")
        cfg, updates = get(source["preset"]), {str(k): v for k, v in inner.items()}
    elif isinstance(source, Mapping):
        cfg = from_dict(dict(source))
    else:
        raise ConfigError(f"a run config must be a preset name, a YAML file or a mapping ({{preset: NAME, "
                          f"overrides: {{...}}}} or a whole RunConfig); got {source!r}.")
    updates.update(overrides or {})
    return override(cfg, updates) if updates else cfg


# ----------------------------------------------------------------------------------------------
# rungs: a target's recipe at another width and depth (`moelab.ladder` and the ladder-d* presets)

EVALS_PER_RUN = 20  # eval every 5% of each rung, so each run contributes a whole curve to the fit


def _scaled(width: int | None, target_d: int, d_model: int) -> int | None:
    return None if width is None else max(1, round(width * d_model / target_d))


def _kv_heads(num_heads: int, group: int) -> int:
    """The target's query heads per KV head kept as closely as num_heads allows (a divisor, >= 1)."""
    want = max(1, num_heads // group)
    return max(k for k in range(1, want + 1) if num_heads % k == 0)


def scale_model(target: ModelConfig, d_model: int, num_layers: int) -> ModelConfig:
    """The target's model at another width and depth, same recipe.

    Kept: head dim, the KV grouping, the routing geometry (experts, top-k, shared experts), expert /
    latent / shared widths as fractions of d_model, vocabulary and sequence length.
    """
    head_dim = target.resolved_head_dim
    if d_model % head_dim:
        raise ConfigError(f"ladder rung d_model={d_model} is invalid: must be a multiple of the target's head dim "
                          f"{head_dim} so the rung keeps the recipe's head size.")
    num_heads = d_model // head_dim
    moe = target.moe
    return replace(
        target,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_kv_heads(num_heads, target.num_heads // target.num_kv_heads),
        head_dim=head_dim if target.head_dim is not None else None,
        moe=replace(
            moe,
            expert_dim=_scaled(moe.expert_dim, target.d_model, d_model),
            shared_expert_dim=_scaled(moe.shared_expert_dim, target.d_model, d_model),
            latent_dim=_scaled(moe.latent_dim, target.d_model, d_model),
        ),
    )


def tokens_per_active_param(cfg: RunConfig) -> float:
    return train_tokens(cfg) / count_params(cfg.model).active


def make_rung(target: RunConfig, d_model: int, num_layers: int, batch_size: int | None = None,
              **train_fields) -> RunConfig:
    """A rung of `target`'s recipe: scaled model (`scale_model`), same tokens per active parameter.

    Everything else (data, schedule shape, dtypes, the rack's expert parallelism and layout) is the
    target's. How the target's batch is spread over racks and microbatches is not recipe: a rung runs on one
    rack (`mesh.replica` 1) in one pass (`train.microbatches` 1) unless `train_fields` say otherwise.
    `train_fields` override TrainConfig fields (e.g. lr, warmup_steps, eval_every); by default the rung warms
    up for 5% of its steps and evaluates every 5%.
    """
    model = scale_model(target.model, d_model, num_layers)
    batch = batch_size or target.train.batch_size
    tokens = tokens_per_active_param(target) * count_params(model).active
    steps = max(EVALS_PER_RUN, round(tokens / (batch * model.seq_len)))
    fields = {"steps": steps, "batch_size": batch, "warmup_steps": max(1, steps // EVALS_PER_RUN),
              "eval_every": max(1, steps // EVALS_PER_RUN), "microbatches": 1, **train_fields}
    return replace(target, name=f"ladder-d{d_model}-l{num_layers}", model=model, train=replace(target.train, **fields),
                   mesh=replace(target.mesh, replica=1))
