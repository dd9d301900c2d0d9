"""Ladder rungs: smaller models of the target's recipe, trained on its tokens per active parameter.

A rung keeps everything about the target but its width and depth: head dim, the KV grouping, the
routing geometry (experts, top-k, shared experts, expert / latent / shared widths as fractions of
d_model), vocabulary, sequence length, data and schedule shape. Its token budget is the target's
tokens per active parameter times its own active parameters, so every rung sits at the same point
of the data/parameter trade-off and the fits see one recipe at several scales.

A recipe YAML names the target and the rung shapes:

    target: {preset: tiny, overrides: {train.steps: 2000}}    # or a full RunConfig mapping
    rungs: [[32, 2], [48, 2], [64, 3]]                          # (d_model, num_layers)
    rung_batch_size: 16                                         # default: the target's batch size
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from moelab.accounting import count_params, flops_per_token, train_tokens
from moelab.config import ConfigError, ModelConfig, RunConfig, from_dict, override

__all__ = ["LadderRecipe", "scale_model", "make_rung", "rungs_of", "load_recipe", "recipe_from_data", "plan_rows",
           "check_monotone"]

EVALS_PER_RUN = 20  # eval every 5% of each rung, so each run contributes a whole curve to the fit


@dataclass(frozen=True)
class LadderRecipe:
    target: RunConfig
    shapes: tuple[tuple[int, int], ...]  # (d_model, num_layers) per rung, smallest first
    rung_batch_size: int | None = None  # None: the target's batch size

    def __post_init__(self) -> None:
        if len(self.shapes) < 2:
            raise ConfigError(f"ladder rungs={list(self.shapes)} is invalid: list at least 2 (d_model, num_layers) "
                              "shapes, e.g. rungs: [[32, 2], [48, 2], [64, 3]].")
        if self.rung_batch_size is not None and not _whole(self.rung_batch_size):
            raise ConfigError(f"ladder rung_batch_size={self.rung_batch_size!r} is invalid: must be an integer >= 1, "
                              "or null for the target's batch size.")


def _whole(value) -> bool:
    """An integer >= 1 (bool is not one); a float such as 2.0 or .inf is refused, not truncated."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _scaled(width: int | None, target_d: int, d_model: int) -> int | None:
    return None if width is None else max(1, round(width * d_model / target_d))


def _kv_heads(num_heads: int, group: int) -> int:
    """The target's query heads per KV head kept as closely as num_heads allows (a divisor, >= 1)."""
    want = max(1, num_heads // group)
    return max(k for k in range(1, want + 1) if num_heads % k == 0)


def scale_model(target: ModelConfig, d_model: int, num_layers: int) -> ModelConfig:
    """The target's model at another width and depth, same recipe."""
    head_dim = target.dim_per_head
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
    """A rung of `target`'s recipe: scaled model, same tokens per active parameter.

    `train_fields` override TrainConfig fields (e.g. lr, warmup_steps, eval_every); by default the rung
    warms up for 5% of its steps and evaluates every 5%.
    """
    model = scale_model(target.model, d_model, num_layers)
    batch = batch_size or target.train.batch_size
    tokens = tokens_per_active_param(target) * count_params(model).active
    steps = max(EVALS_PER_RUN, round(tokens / (batch * model.seq_len)))
    fields = {"steps": steps, "batch_size": batch, "warmup_steps": max(1, steps // EVALS_PER_RUN),
              "eval_every": max(1, steps // EVALS_PER_RUN), **train_fields}
    return replace(target, name=f"ladder-d{d_model}-l{num_layers}", model=model, train=replace(target.train, **fields))


def rungs_of(recipe: LadderRecipe) -> list[RunConfig]:
    return [make_rung(recipe.target, d, layers, recipe.rung_batch_size) for d, layers in recipe.shapes]


def load_recipe(path: str | Path) -> LadderRecipe:
    """Read a recipe YAML (see the module docstring); errors name the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file {path} does not exist; pass a ladder recipe YAML or --preset NAME.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe file {path} is not valid YAML: {e}") from None
    if isinstance(data, dict) and "ladder" in data:  # an experiment spec: its `ladder:` is the recipe
        return recipe_from_data(data["ladder"], f"{path}: ladder")
    return recipe_from_data(data, f"recipe {path}")


def recipe_from_data(data: dict, where: str = "ladder recipe") -> LadderRecipe:
    """A recipe from plain data (a recipe file's content, or an experiment spec's `ladder:`)."""
    from moelab import presets  # presets builds its ladder shapes with this module

    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with the keys target and rungs; got {data!r}.")
    unknown = sorted(set(data) - {"target", "rungs", "rung_batch_size"})
    if unknown or "target" not in data or "rungs" not in data:
        raise ConfigError(f"{where} must have the keys target and rungs (and optionally rung_batch_size); "
                          f"got {sorted(data)}.")
    rungs = data["rungs"]
    try:  # every message below starts with `where`, the file or spec it came from
        if not (isinstance(rungs, (list, tuple))
                and all(isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_whole, r)) for r in rungs)):
            raise ConfigError(f"rungs={rungs!r} must be a list of [d_model, num_layers] pairs of integers >= 1, "
                              "e.g. rungs: [[32, 2], [48, 2], [64, 3]].")
        target = data["target"]
        if isinstance(target, dict) and "preset" in target:
            target = override(presets.get(target["preset"]), target.get("overrides") or {})
        else:
            target = from_dict(target)
        return LadderRecipe(target, tuple((d, layers) for d, layers in rungs), data.get("rung_batch_size"))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def plan_rows(configs: list[RunConfig]) -> list[dict]:
    """One row per config: the figures `moelab ladder plan` prints."""
    rows = []
    for cfg in configs:
        counts, tokens = count_params(cfg.model), train_tokens(cfg)
        rows.append({
            "name": cfg.name, "d_model": cfg.model.d_model, "num_layers": cfg.model.num_layers,
            "active_params": counts.active, "total_params": counts.total, "tokens": tokens,
            "steps": cfg.train.steps, "train_flops": float(flops_per_token(cfg.model)) * tokens,
        })
    return rows


def check_monotone(configs: list[RunConfig]) -> None:
    """Rungs must grow in active parameters, else the ladder's x axis folds back."""
    sizes = [count_params(c.model).active for c in configs]
    if any(b <= a for a, b in zip(sizes, sizes[1:])) or not math.isfinite(sum(sizes)):
        raise ConfigError(f"ladder rungs must grow in active parameters; got {sizes}. Order the rungs smallest first.")
