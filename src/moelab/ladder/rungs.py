"""Ladder rungs: smaller models of the target's recipe, trained on its tokens per active parameter.

A rung keeps everything about the target but its width and depth: head dim, the KV grouping, the
routing geometry (experts, top-k, shared experts, expert / latent / shared widths as fractions of
d_model), vocabulary, sequence length, data and schedule shape. Its token budget is the target's
tokens per active parameter times its own active parameters, so every rung sits at the same point
of the data/parameter trade-off and the fits see one recipe at several scales. The rule itself is
`presets.make_rung` (the ladder-d* presets are rungs of the frontier); this module reads recipes.

A recipe YAML names the target and the rung shapes:

    target: {preset: tiny, overrides: {train.steps: 2000}}    # or a full RunConfig mapping
    rungs: [[32, 2], [48, 2], [64, 3]]                          # (d_model, num_layers)
    rung_batch_size: 16                                         # default: the target's batch size
    lr_exponent: 0.5                                            # default 0: every rung at the target's LR
    rung_seeds: 2                                               # default 1: runs per rung shape (train.seed 0, 1)

The curve law assumes every rung is tuned like the target. `lr_exponent` k is the recipe's LR
transfer rule, lr(d) = lr_target * (d_target / d)^k: 0 keeps one LR; 1 is muP's rule for Adam's
hidden matrices (Yang et al. 2022, "Tensor Programs V"); in between is what a per-rung sweep of a
model this small usually finds. Measure it with a small sweep (docs/scaling-ladder.md) and store it.

`rung_seeds` trains each rung shape with that many init / data-order seeds. A small model's run
carries an offset of its own (where its plateaus break, how its data order fell): the fit averages
the seeds of a size, and the spread between them is run-to-run noise the size law cannot absorb, so
the band's run term rests on more degrees of freedom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from moelab import presets
from moelab.accounting import count_params, flops_per_token, train_tokens
from moelab.config import RunConfig, read_yaml
from moelab.errors import ConfigError
from moelab.presets import make_rung

__all__ = ["LadderRecipe", "rung_lr", "lr_rule_text", "LrRule", "fit_lr_rule", "rungs_of", "preset_recipe", "load_recipe", "recipe_from_data", "plan_rows",
           "check_monotone", "train_sizes", "data_epochs", "repeated_data", "recipe_warnings", "mixed_depth", "too_few_sizes", "rung_flags", "MIN_RUNG_STEPS", "short_rungs",
           "regrouped_heads"]


K_RANGE = (0.0, 3.0)  # lr_exponents a recipe takes and fit_lr_rule searches (muP's for Adam's hidden matrices: 1)


@dataclass(frozen=True)
class LadderRecipe:
    target: RunConfig
    shapes: tuple[tuple[int, int], ...]  # (d_model, num_layers) per rung, smallest first
    rung_batch_size: int | None = None  # None: the target's batch size
    lr_exponent: float = 0.0  # rung LR = target LR * (target d_model / rung d_model) ** lr_exponent, in K_RANGE
    rung_seeds: int = 1  # runs per rung shape, with train.seed 0 .. rung_seeds - 1

    def __post_init__(self) -> None:
        if len(self.shapes) < 2:
            raise ConfigError(f"ladder rungs={list(self.shapes)} is invalid: list at least 2 (d_model, num_layers) "
                              "shapes, e.g. rungs: [[32, 2], [48, 2], [64, 3]].")
        if self.rung_batch_size is not None and not _whole(self.rung_batch_size):
            raise ConfigError(f"ladder rung_batch_size={self.rung_batch_size!r} is invalid: must be an integer >= 1, "
                              "or null for the target's batch size.")
        if not _whole(self.rung_seeds):
            raise ConfigError(f"ladder rung_seeds={self.rung_seeds!r} is invalid: must be an integer >= 1 (runs per "
                              "rung shape).")
        exponent = self.lr_exponent
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent <= K_RANGE[1]:
            raise ConfigError(f"ladder lr_exponent={exponent!r} is invalid: must be a number in [0, {K_RANGE[1]:g}] "
                              "(0: the target's LR for every rung; 1: muP's 1/width rule for Adam; fit it with "
                              "benchmarks/lr_sweep.py).")


def _whole(value) -> bool:
    """An integer >= 1 (bool is not one); a float such as 2.0 or .inf is refused, not truncated."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def rung_lr(recipe: LadderRecipe, d_model: int) -> float:
    """The recipe's LR for a rung of width `d_model` (its transfer rule; see the module docstring)."""
    return recipe.target.train.lr * (recipe.target.model.d_model / d_model) ** recipe.lr_exponent


def lr_rule_text(recipe: LadderRecipe) -> str:
    """One sentence on how the recipe sets its rungs' LRs, for `ladder plan`."""
    lr, d = recipe.target.train.lr, recipe.target.model.d_model
    if recipe.lr_exponent == 0:
        return (f"Every rung trains at the target's LR {lr:.3g} (lr_exponent 0: no LR transfer rule; fit one with "
                "benchmarks/lr_sweep.py).")
    return (f"Rung LRs follow the recipe's transfer rule lr(d) = {lr:.3g} x ({d} / d)^{recipe.lr_exponent:g} "
            f"(lr_exponent {recipe.lr_exponent:g}).")


@dataclass(frozen=True)
class LrRule:
    """lr*(d) = c * d^-k: the peak LR that minimises the final loss at width d (`fit_lr_rule`)."""

    c: float
    k: float  # what a recipe stores as lr_exponent
    curvature: tuple[float, ...]  # b_d per width, smallest first: the loss a factor e off lr*(d) costs there
    rmse: float  # of the fitted bowls over the sweep's points
    optima: tuple[float, ...]  # each width's own optimum (its 3 points' parabola), to see the scatter about the rule

    def lr(self, d_model: float) -> float:
        return self.c * d_model ** -self.k


def fit_lr_rule(d_model, lr, loss) -> LrRule:
    """Fit lr*(d) = c * d^-k to a per-width LR sweep: a bowl in log LR per width, centred on the rule.

        loss(d, lr) = m_d + b_d * (ln lr - ln c + k * ln d)^2

    with a level m_d and a curvature b_d per width (a small model's loss in a short run is far more
    sensitive to its LR than a larger one's), least squares over each width's best LR and its two
    neighbours on the grid (a parabola in log LR is a local shape: a factor 8 below the optimum a
    short run has not left its first plateau). Sharing the line lets a width whose three points
    barely bracket its optimum lean on the others. Given (ln c, k), m_d and b_d
    are linear and solved exactly (variable projection, as in `laws`); the search runs over k in
    K_RANGE and ln lr* at the widths' geometric mean, a grid then Nelder-Mead.

    >>> d, lr = [32] * 3 + [64] * 3, [1e-3, 2e-3, 4e-3, 5e-4, 1e-3, 2e-3]
    >>> loss = [2 + 0.1 * math.log(x * w / 0.064) ** 2 for w, x in zip(d, lr)]   # lr*(d) = 0.064 / d
    >>> rule = fit_lr_rule(d, lr, loss)
    >>> round(rule.k, 3), round(rule.lr(32), 5)
    (1.0, 0.002)
    """
    import numpy as np  # here, not at the top: `ladder plan` imports this module and need not pay for scipy
    from scipy.optimize import minimize

    d, x, y = (np.asarray(v, dtype=float) for v in (d_model, lr, loss))
    widths = np.unique(d)
    if len(widths) < 2 or any((d == w).sum() < 3 for w in widths):
        raise ConfigError(f"an LR rule needs at least 2 widths with 3 or more LRs each; got widths {d.tolist()}.")
    d, x, y = (np.concatenate(v) for v in zip(*(_around_best(d[d == w], x[d == w], y[d == w]) for w in widths)))
    edge = [f"d={w:g}" for w in widths if y[d == w].argmin() != 1]  # _around_best puts the best in the middle
    if edge:  # an optimum beyond the points would be a guess from the bowl's curvature, not a measurement
        raise ConfigError(f"the best LR of {', '.join(edge)} is at an end of its LR grid: add LRs beyond it so "
                          "that each width's best LR has a worse one on either side.")
    levels = (d[:, None] == widths[None, :]).astype(float)
    log_ref = np.log(widths).mean()

    def solve(theta) -> tuple[np.ndarray, float]:
        log_lr_ref, k = theta
        offset = (np.log(x) - log_lr_ref + k * (np.log(d) - log_ref)) ** 2
        design = np.column_stack([levels, levels * offset[:, None]])
        coef = np.linalg.lstsq(design, y, rcond=None)[0]
        bowl = ((coef[len(widths):] > 0).all() and K_RANGE[0] <= k <= K_RANGE[1]  # opening down: no optimum
                and abs(log_lr_ref - np.log(x).mean()) < 5)  # nor one e^5 away from every LR tried
        return coef, float(np.sum((design @ coef - y) ** 2)) if bowl else np.inf

    grid = [(a, k) for a in np.linspace(np.log(x.min()) - 1, np.log(x.max()) + 1, 61)
            for k in np.linspace(*K_RANGE, 61)]
    start = min(grid, key=lambda theta: solve(theta)[1])
    best = minimize(lambda theta: solve(theta)[1], np.array(start), method="Nelder-Mead",
                    options={"xatol": 1e-6, "fatol": 1e-12}).x
    coef, sse = solve(best)
    vertices = [np.polyfit(np.log(x[d == w]), y[d == w], 2) for w in widths]
    rule = LrRule(c=float(np.exp(best[0] + best[1] * log_ref)), k=float(best[1]),
                  curvature=tuple(float(b) for b in coef[len(widths):]), rmse=float(np.sqrt(sse / len(y))),
                  optima=tuple(float(np.exp(-p[1] / (2 * p[0]))) for p in vertices))
    return rule


def _around_best(d, x, y):
    """A width's best LR and its two neighbours (the 3 lowest or highest LRs when the best is at an end)."""
    order = x.argsort()
    best = int(y[order].argmin())
    keep = order[min(max(best - 1, 0), len(x) - 3):][:3]
    return d[keep], x[keep], y[keep]


def rungs_of(recipe: LadderRecipe) -> list[RunConfig]:
    """Every rung run, smallest shape first; a shape's seed-s run (s >= 1) is named `<rung>-seed<s>`."""
    rungs = []
    for d, layers in recipe.shapes:
        rung = make_rung(recipe.target, d, layers, recipe.rung_batch_size, lr=rung_lr(recipe, d))
        rungs += [rung] + [replace(rung, name=f"{rung.name}-seed{seed}", train=replace(rung.train, seed=seed))
                           for seed in range(1, recipe.rung_seeds)]
    return rungs


def preset_recipe(name: str) -> LadderRecipe:
    """The published ladder of preset `name` (`presets.LADDERS`); ConfigError listing the presets with one."""
    if name not in presets.LADDERS:
        raise ConfigError(f"preset {name!r} has no published ladder; the presets with one are: "
                          f"{', '.join(presets.LADDERS)}. Write a recipe YAML for others.")
    shapes, batch = presets.LADDERS[name]
    return LadderRecipe(presets.get(name), shapes, batch)


def load_recipe(path: str | Path) -> LadderRecipe:
    """Read a recipe YAML (see the module docstring); errors name the field."""
    data = read_yaml(path, "recipe", "pass a ladder recipe YAML or --preset NAME") or {}
    if isinstance(data, dict) and "ladder" in data:  # an experiment spec: its `ladder:` is the recipe
        return recipe_from_data(data["ladder"], f"{path}: ladder")
    return recipe_from_data(data, f"recipe {path}")


def recipe_from_data(data: dict, where: str = "ladder recipe") -> LadderRecipe:
    """A recipe from plain data (a recipe file's content, or an experiment spec's `ladder:`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with the keys target and rungs; got {data!r}.")
    unknown = sorted(set(data) - {"target", "rungs", "rung_batch_size", "lr_exponent", "rung_seeds"})
    if unknown or "target" not in data or "rungs" not in data:
        raise ConfigError(f"{where} must have the keys target and rungs (and optionally rung_batch_size, "
                          f"lr_exponent, rung_seeds); got {sorted(data)}.")
    rungs = data["rungs"]
    try:  # every message below starts with `where`, the file or spec it came from
        if not (isinstance(rungs, (list, tuple))
                and all(isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_whole, r)) for r in rungs)):
            raise ConfigError(f"rungs={rungs!r} must be a list of [d_model, num_layers] pairs of integers >= 1, "
                              "e.g. rungs: [[32, 2], [48, 2], [64, 3]].")
        target = presets.resolve(data["target"])
        return LadderRecipe(target, tuple((d, layers) for d, layers in rungs), data.get("rung_batch_size"),
                            data.get("lr_exponent", 0.0), data.get("rung_seeds", 1))
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
            "steps": cfg.train.steps, "lr": cfg.train.lr, "train_flops": float(flops_per_token(cfg.model)) * tokens,
        })
    return rows


def train_sizes(cfg: RunConfig) -> dict[str, int]:
    """Tokens per domain in `cfg`'s training split: what `data_epochs` counts passes over."""
    from moelab.train.loop import prepare_corpus  # builds the corpus: only when the data is checked

    return {d: len(tokens) for d, tokens in prepare_corpus(cfg).train.items()}


def data_epochs(cfg: RunConfig, train_sizes: Mapping[str, int]) -> dict[str, float]:
    """Passes `cfg` makes over each domain's training split (`train_sizes`: tokens per domain).

    The curve law, like every scaling law fitted on fresh data, assumes at most one: the held-out loss
    of a domain read twice bends away from it (Muennighoff et al. 2023, "Scaling Data-Constrained
    Language Models"). A ladder makes this worst at the target, whose tokens are the most.
    """
    total, used = train_tokens(cfg), dict.fromkeys(train_sizes, 0.0)
    for phase in cfg.data.phases:
        weight_sum = sum(phase.weights.values())
        for domain, weight in phase.weights.items():
            used[domain] += phase.fraction * weight / weight_sum * total
    return {d: used[d] / max(size, 1) for d, size in train_sizes.items()}


# A rung of fewer optimizer steps is still leaving its first plateaus when its LR decays, so it is not
# tuned like the longer runs: at the full ladder budget the 186-step d32 rung of ladder-cpu wanted 2.8x
# the LR that suited every width from 401 steps up (docs/scaling-ladder.md, "LR transfer across rungs").
# With its 5 seeds in the fit the self-check missed d80 by -2.5% and the target's curve by 1.9% (MAPE);
# without it, by -0.8% and 0.7%. The cut sits between the two lengths.
MIN_RUNG_STEPS = 250


def short_rungs(rungs: list[RunConfig]) -> list[str]:
    """A warning per rung shape that trains fewer than MIN_RUNG_STEPS optimizer steps."""
    warnings, seen = [], set()
    for cfg in rungs:
        shape = (cfg.model.d_model, cfg.model.num_layers)
        if cfg.train.steps < MIN_RUNG_STEPS and shape not in seen:
            seen.add(shape)
            warnings.append(f"{cfg.name} trains {cfg.train.steps} steps, under {MIN_RUNG_STEPS}: a rung this short is "
                            "still leaving its first plateaus as its LR decays, so it is not tuned like the longer "
                            "runs and bends the size trend. Drop it, or use wider rungs (more tokens, more steps).")
    return warnings


def regrouped_heads(rungs: list[RunConfig], target: RunConfig) -> list[str]:
    """A warning per rung shape whose query heads per KV head differ from the target's.

    A rung keeps the target's head dim, so its head count is its width / head dim, and the grouping
    can only be kept where that count divides by it (`presets._kv_heads` takes the nearest divisor).
    """
    group = target.model.num_heads // target.model.num_kv_heads
    warnings, seen = [], set()
    for cfg in rungs:
        heads, kv = cfg.model.num_heads, cfg.model.num_kv_heads
        if heads // kv != group and cfg.model.d_model not in seen:
            seen.add(cfg.model.d_model)
            warnings.append(f"{cfg.name} groups {heads // kv} query heads per KV head ({heads}/{kv}), the target "
                            f"{group} ({target.model.num_heads}/{target.model.num_kv_heads}): {heads} heads do not "
                            f"divide by {group}, so its attention is not the target's recipe. Use widths whose head "
                            f"count divides by {group}, or a target grouping every rung can keep (num_kv_heads = "
                            "num_heads).")
    return warnings


def mixed_depth(rungs: list[RunConfig], target: RunConfig) -> list[str]:
    """A warning when some rung's depth is not the target's: the size trend then mixes depth into width."""
    depth = {}  # each rung shape (seeds share one) in the recipe's order, smallest first: its depth
    for c in rungs:
        if c.model.num_layers != target.model.num_layers:
            depth.setdefault(c.name.split("-seed")[0], c.model.num_layers)
    if not depth:
        return []
    listed = ", ".join(f"{name} ({layers})" for name, layers in depth.items())
    return [f"{listed} {'is' if len(depth) == 1 else 'are'} not {target.model.num_layers} layers deep as the target "
            "is: the law reads the size trend as one of width, so a depth change inside it bends the extrapolation. "
            "Give every rung the target's depth."]


def too_few_sizes(rungs: list[RunConfig]) -> list[str]:
    """A warning when the rungs hold fewer than 3 sizes: the leave-largest-out self-check then cannot run."""
    sizes = {(c.model.d_model, c.model.num_layers) for c in rungs}
    if len(sizes) >= 3:
        return []
    return [f"the rungs hold {len(sizes)} sizes: the self-check (refit without the largest, predict it) needs 3, so "
            "nothing will say whether the prediction can be trusted before the target trains. Add a rung."]


def repeated_data(configs: list[RunConfig], train_sizes: Mapping[str, int]) -> list[str]:
    """A warning per config that reads some domain more than once (`data_epochs`), naming the domains."""
    warnings = []
    for cfg in configs:
        over = {d: e for d, e in data_epochs(cfg, train_sizes).items() if e > 1.0}
        if over:
            warnings.append(f"{cfg.name} reads {', '.join(f'{d} {e:.2f}x' for d, e in over.items())}: repeated data "
                            "bends its loss away from the law, so the prediction for it is biased low. Lower those "
                            "domains' weights in data.phases, add data, or train fewer tokens.")
    return warnings


def recipe_warnings(rungs: list[RunConfig], target: RunConfig, read_data: bool = True) -> list[str]:
    """What `ladder plan` warns about a recipe: each rung too short to be tuned like the others (`short_rungs`),
    grouping its attention heads unlike the target (`regrouped_heads`) or of another depth (`mixed_depth`), fewer
    than three sizes (`too_few_sizes`) and, with `read_data`, each run that would read a domain of its data more
    than once (`repeated_data`)."""
    warnings = short_rungs(rungs) + regrouped_heads(rungs, target) + mixed_depth(rungs, target) + too_few_sizes(rungs)
    if read_data:
        warnings += repeated_data(rungs + [target], train_sizes(target))
    return warnings


def rung_flags(rungs: list[RunConfig], target: RunConfig, train_sizes: Mapping[str, int] | None = None
               ) -> dict[str, str]:
    """Per rung run the checks flag, why: what `ladder.run` leaves out of the fit (the warnings, per run)."""
    group = target.model.num_heads // target.model.num_kv_heads
    flags = {}
    for cfg in rungs:
        m, reasons = cfg.model, []
        if cfg.train.steps < MIN_RUNG_STEPS:
            reasons.append(f"trains {cfg.train.steps} steps, under {MIN_RUNG_STEPS}")
        if m.num_heads // m.num_kv_heads != group:
            reasons.append(f"groups {m.num_heads // m.num_kv_heads} query heads per KV head, the target {group}")
        if m.num_layers != target.model.num_layers:
            reasons.append(f"is {m.num_layers} layers deep, the target {target.model.num_layers}")
        if train_sizes is not None:
            over = {d: e for d, e in data_epochs(cfg, train_sizes).items() if e > 1.0}
            if over:
                reasons.append("reads " + ", ".join(f"{d} {e:.2f}x" for d, e in over.items()))
        if reasons:
            flags[cfg.name] = "; ".join(reasons)
    return flags


def check_monotone(configs: list[RunConfig]) -> None:
    """Rung shapes must grow in active parameters, else the ladder's x axis folds back (seeds of one shape repeat it)."""
    sizes = [count_params(c.model).active for c in configs]
    sizes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]  # one per shape
    if any(b <= a for a, b in zip(sizes, sizes[1:])) or not math.isfinite(sum(sizes)):
        raise ConfigError(f"ladder rungs must grow in active parameters; got {sizes}. Order the rungs smallest first.")
