"""Learning-rate schedules: warmup-stable-decay (WSD) and cosine, as Optax schedules.

WSD holds the peak LR after a linear warmup and decays linearly to `lr * min_lr_ratio` over the last
`decay_fraction` of the steps (Hu et al. 2024, "MiniCPM"); it lets a run be extended or cut short
and re-decayed, which is what the contingency planner needs. Cosine is the classic baseline.
"""

from __future__ import annotations

import optax

from moelab.config import TrainConfig

__all__ = ["learning_rate", "warmup_steps", "decay_start"]


def warmup_steps(cfg: TrainConfig) -> int:
    """Warmup length, clamped so that a run shorter than its warmup still reaches peak LR."""
    return min(cfg.warmup_steps, cfg.steps)


def decay_start(cfg: TrainConfig) -> int:
    """First step of the WSD decay (the end of the stable phase)."""
    return max(warmup_steps(cfg), cfg.steps - round(cfg.decay_fraction * cfg.steps))


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """The LR at every step, from `cfg.schedule`."""
    peak, final = cfg.lr, cfg.lr * cfg.min_lr_ratio
    num_warmup = warmup_steps(cfg)
    # Warmup starts at peak / warmup_steps rather than 0 so that step 0 already trains.
    warmup = optax.linear_schedule(peak / max(num_warmup, 1), peak, max(num_warmup, 1))
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, max(cfg.steps - num_warmup, 1), alpha=cfg.min_lr_ratio)
        return optax.join_schedules([warmup, decay], [num_warmup])
    start = decay_start(cfg)
    stable = optax.constant_schedule(peak)
    decay = optax.linear_schedule(peak, final, max(cfg.steps - start, 1))
    return optax.join_schedules([warmup, stable, decay], [num_warmup, start])
