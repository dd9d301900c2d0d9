"""Named run configurations: the CPU-sized `tiny`, the 535B-A23B frontier target and its ladder shapes,
and the one-GPU benchmark shapes `gpu-small` / `gpu-medium` with their equal-FLOP dense counterparts.

`get(name)` returns a validated RunConfig; `describe()` lists every preset with one line. Anything
not here is expressible in YAML (for example `experiments/mixtral-style.yaml`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from moelab.accounting import flops_per_token
from moelab.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig

__all__ = ["PRESETS", "FRONTIER_LADDER", "LADDERS", "GPU_VOCAB", "dense_counterpart", "get", "describe"]

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
        moe=MoEConfig(num_experts=384, num_experts_per_token=8, expert_dim=half, num_shared_experts=2,
                      shared_expert_dim=half, latent_dim=half, capacity_factor=1.15, num_waves=3,
                      dispatch="capacity", balancing="hist"),
    )
    steps = math.ceil(FRONTIER_TOKENS / (FRONTIER_BATCH * FRONTIER_SEQ))
    return RunConfig(
        name="frontier-535b",
        model=model,
        train=TrainConfig(steps=steps, batch_size=FRONTIER_BATCH, lr=3e-4, warmup_steps=2000, eval_every=1000),
        mesh=MeshConfig(replica=1, expert=64),
    )


# The frontier's published ladder: (d_model, num_layers) per rung; heads follow from head dim 128.
FRONTIER_LADDER = ((768, 8), (1024, 12), (1536, 16), (2048, 22))


def _ladder(d_model: int, num_layers: int) -> RunConfig:
    """A rung of the frontier recipe at the frontier's tokens per active parameter (`ladder.rungs`)."""
    from moelab.ladder.rungs import make_rung  # rungs reads presets lazily; no import cycle

    return make_rung(_frontier(), d_model, num_layers, batch_size=256, lr=1e-3)


# One-GPU benchmark shapes (benchmarks/gpu_suite.sh). Vocabulary 32768: a realistic BPE size (a
# multiple of 128 for the tensor cores). The byte vocabulary (257) would make the lm head vanish from
# the FLOPs; 128256 would make embedding + head a third of gpu-small's parameters and its float32
# logits (tokens x V x 4 bytes) the largest activation of the step, which is not what we measure.
GPU_VOCAB = 32_768


def _gpu(name: str, d_model: int, num_layers: int, width: int, seq_len: int, batch_size: int,
         remat: str = "none") -> RunConfig:
    """A one-H200 MoE: 64 experts top-8 of `width`, 2 shared of `width`, latent `width`, head dim 128, GQA 4:1."""
    heads = d_model // 128
    model = ModelConfig(
        vocab_size=GPU_VOCAB, d_model=d_model, num_layers=num_layers, num_heads=heads, num_kv_heads=heads // 4,
        head_dim=128, seq_len=seq_len, remat=remat,
        moe=MoEConfig(num_experts=64, num_experts_per_token=8, expert_dim=width, num_shared_experts=2,
                      shared_expert_dim=width, latent_dim=width, capacity_factor=1.15, dispatch="capacity",
                      balancing="hist"),
    )
    train = TrainConfig(steps=1000, batch_size=batch_size, lr=1e-3, warmup_steps=100, compute_dtype="bfloat16")
    return RunConfig(name=name, model=model, train=train)


def dense_counterpart(cfg: RunConfig, multiple: int = 128) -> RunConfig:
    """The dense model with `cfg`'s active training FLOPs per token (`accounting.flops_per_token`).

    One expert, top-1, no shared experts, no latent; its width is the one that makes the FLOPs equal,
    rounded to a multiple of `multiple` (a ConfigError if that misses by more than 1%).
    """
    moe_model = cfg.model
    dense_moe = replace(moe_model.moe, num_experts=1, num_experts_per_token=1, num_shared_experts=0,
                        shared_expert_dim=None, latent_dim=None, dispatch="dense", balancing="none")
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
    "gpu-small": (_gpu_small, ("One-H200 benchmark MoE: d 1024, 12 layers, 64 experts top-8 of 512, 2 shared, "
                               "latent 512, seq 2048, bf16.")),
    "gpu-medium": (_gpu_medium, ("One-H200 benchmark MoE: d 2048, 16 layers, 64 experts top-8 of 1024, 2 shared, "
                                 "latent 1024, seq 4096, bf16, dots remat.")),
    "gpu-small-dense": (lambda: dense_counterpart(_gpu_small()), "Dense model with gpu-small's active FLOPs per token."),
    "gpu-medium-dense": (lambda: dense_counterpart(_gpu_medium()), "Dense model with gpu-medium's active FLOPs per token."),
}


# Presets with a published ladder: rung shapes and the rungs' batch size (`moelab ladder plan --preset`).
LADDERS = {"frontier-535b": (FRONTIER_LADDER, 256)}


def get(name: str) -> RunConfig:
    """The preset `name`; an unknown name raises ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)} (see `moelab presets`).")
    return replace(PRESETS[name][0](), name=name)


def describe() -> dict[str, str]:
    return {name: line for name, (_, line) in PRESETS.items()}
