"""Named run configurations: the CPU-sized `tiny`, the 535B-A23B frontier target and its ladder shapes.

`get(name)` returns a validated RunConfig; `describe()` lists every preset with one line. Anything
not here is expressible in YAML (for example `experiments/mixtral-style.yaml`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from moelab.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig

__all__ = ["PRESETS", "FRONTIER_LADDER", "LADDERS", "get", "describe"]

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


PRESETS = {
    "tiny": (_tiny, "CPU-sized MoE for tests and the demo: d 64, 2 layers, 8 experts top-2, latent 32, 1 shared."),
    "frontier-535b": (_frontier, "The 535B-total / 23B-active target: d 6144, 48 layers, 384 experts top-8, "
                                 "latent 3072, 2 shared, 18.75T tokens."),
    **{f"ladder-d{d}": (lambda d=d, layers=layers: _ladder(d, layers),
                        f"Ladder rung of the frontier recipe: d {d}, {layers} layers, {d // 128} heads.")
       for d, layers in FRONTIER_LADDER},
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
