"""Named run configurations: the CPU-sized `tiny`, the 535B-A23B frontier target and its ladder shapes.

`get(name)` returns a validated RunConfig; `describe()` lists every preset with one line. Anything
not here is expressible in YAML (for example `experiments/mixtral-style.yaml`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from moelab.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig

__all__ = ["PRESETS", "get", "describe", "ladder_model"]

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
        ),
    )
    train = TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=30, eval_every=100, log_every=10)
    return RunConfig(name="tiny", model=model, train=train)


def _frontier_moe(d_model: int) -> MoEConfig:
    """The frontier routing geometry at width d: 384 experts top-8 at d/2 in a d/2 latent, 2 shared."""
    half = d_model // 2
    return MoEConfig(
        num_experts=384,
        num_experts_per_token=8,
        expert_dim=half,
        num_shared_experts=2,
        shared_expert_dim=half,
        latent_dim=half,
        capacity_factor=1.15,
        num_waves=3,
        dispatch="capacity",
    )


def ladder_model(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int) -> ModelConfig:
    """A model of the frontier recipe at another width: head dim 128, same routing geometry."""
    return ModelConfig(
        vocab_size=FRONTIER_VOCAB,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        seq_len=FRONTIER_SEQ,
        moe=_frontier_moe(d_model),
    )


def _frontier() -> RunConfig:
    steps = math.ceil(FRONTIER_TOKENS / (FRONTIER_BATCH * FRONTIER_SEQ))
    return RunConfig(
        name="frontier-535b",
        model=ladder_model(6144, 48, 48, 12),
        train=TrainConfig(steps=steps, batch_size=FRONTIER_BATCH, lr=3e-4, warmup_steps=2000, eval_every=1000),
        mesh=MeshConfig(replica=1, expert=64),
    )


def _ladder(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int) -> RunConfig:
    """A ladder rung trained on the frontier's tokens per active parameter."""
    from moelab.accounting import count_params  # accounting imports config only; no cycle

    frontier = _frontier()
    model = ladder_model(d_model, num_layers, num_heads, num_kv_heads)
    ratio = FRONTIER_TOKENS / count_params(frontier.model).active
    batch = 256
    steps = max(1, round(ratio * count_params(model).active / (batch * FRONTIER_SEQ)))
    train = TrainConfig(steps=steps, batch_size=batch, lr=1e-3, warmup_steps=min(500, steps), eval_every=500)
    return RunConfig(name=f"ladder-d{d_model}", model=model, train=train)


PRESETS = {
    "tiny": (_tiny, "CPU-sized MoE for tests and the demo: d 64, 2 layers, 8 experts top-2, latent 32, 1 shared."),
    "frontier-535b": (_frontier, "The 535B-total / 23B-active target: d 6144, 48 layers, 384 experts top-8, "
                                 "latent 3072, 2 shared, 18.75T tokens."),
    "ladder-d768": (lambda: _ladder(768, 8, 6, 1), "Ladder rung of the frontier recipe: d 768, 8 layers, 6 heads."),
    "ladder-d1024": (lambda: _ladder(1024, 12, 8, 2), "Ladder rung of the frontier recipe: d 1024, 12 layers, 8 heads."),
    "ladder-d1536": (lambda: _ladder(1536, 16, 12, 3), "Ladder rung of the frontier recipe: d 1536, 16 layers, 12 heads."),
    "ladder-d2048": (lambda: _ladder(2048, 22, 16, 4), "Ladder rung of the frontier recipe: d 2048, 22 layers, 16 heads."),
}


def get(name: str) -> RunConfig:
    """The preset `name`; an unknown name raises ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)} (see `moelab presets`).")
    return replace(PRESETS[name][0](), name=name)


def describe() -> dict[str, str]:
    return {name: line for name, (_, line) in PRESETS.items()}
