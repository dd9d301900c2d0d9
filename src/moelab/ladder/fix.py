"""Resolving a ladder recipe's warnings before anything trains: `moelab ladder plan RECIPE --fix --out FIXED.yaml`.

`ladder plan` warns about what bends a ladder's size trend (`rungs`: short rungs, rungs that regroup the
target's attention heads, domains read more than once); `fix_recipe` changes the recipe until it plans
without them, one rule per warning, each change recorded with its reason:

1. depth: every rung takes the target's depth, so the size trend is a width trend and not a depth change too;
2. heads: a width whose head count does not divide by the target's query heads per KV head moves to the
   nearest width that keeps the grouping and no other rung uses, within 25% of it (else it is dropped, unless
   that would leave under two sizes: then every rung stays, said to be unfixed);
3. length: rungs under MIN_RUNG_STEPS optimizer steps are dropped while MIN_SIZES sizes remain; otherwise they
   stay, said to be unfixed (the target's tokens per parameter fix a rung's tokens, and the one way to more
   steps, a smaller rung batch, was measured to bias the prediction 16% low: the rungs learn more per token);
4. data: the weights of a domain the target would read more than once are lowered in every phase until each
   domain stays under one pass (the target reads the most tokens, so its rungs stay under too);
5. seeds: at least MIN_SEEDS per rung (one seed leaves the band's run term on almost no degrees of freedom)
   or, given a fitted ladder's noise (`--runs`), the number `seeds_for_band` finds for a +-3% band.

What a rule cannot fix is said, not hidden: a recipe left with two sizes cannot run its self-check, and one
whose run-to-run spread alone is wider than the band goal cannot reach it with seeds.

`write_fixed_recipe` is the whole of `--fix`: it fixes the recipe and writes it in the user's own form, each
change as a comment at the top.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import yaml
from scipy import special

from moelab.config import PhaseConfig, read_yaml
from moelab.errors import ConfigError
from moelab.files import write_text
from moelab.ladder.contract import PREDICTION, read_sidecar, sidecar_path
from moelab.ladder.rungs import MIN_RUNG_STEPS, LadderRecipe, data_epochs, train_sizes
from moelab.presets import make_rung

__all__ = ["Change", "fix_recipe", "write_fixed_recipe", "recipe_data", "seeds_for_band", "MIN_SIZES", "MIN_SEEDS",
           "BAND_GOAL"]

MIN_SIZES = 3  # the leave-largest-out self-check fits on two sizes and predicts the third
MIN_SEEDS = 3  # ladder-cpu's run-to-run spread came from 5 seeds a rung; 1 leaves it unestimated
BAND_GOAL = 0.03  # the target's 95% band half-width that tells a run 3% off its recipe from a healthy one
MAX_SEEDS = 12
EPOCH_LIMIT = 0.95  # a pass over a domain, with room for the rounding of the weights
EPOCH_AIM = 0.9  # what a lowered domain is aimed at: its share falls by less than its weight (the others rise)
MAX_MOVE = 0.25  # a regrouped width moves at most this share of itself; further, it is another rung, so it is dropped


@dataclass(frozen=True)
class Change:
    field: str  # the recipe field changed, e.g. "rungs" or "target.data.phases"
    before: Any
    after: Any
    why: str


def fix_recipe(recipe: LadderRecipe, train_sizes: Mapping[str, int] | None = None,
               noise: Mapping[str, Any] | None = None) -> tuple[LadderRecipe, list[Change]]:
    """The recipe with its warnings resolved, and the changes made (see the module docstring).

    `train_sizes` (tokens per domain of the training split) enables the data rule; `noise` (a fitted ladder's
    prediction.json) sizes the seeds. ConfigError when fewer than two rung sizes can be kept.
    """
    changes: list[Change] = []
    for rule in (_same_depth, _keep_grouping, _long_enough):
        recipe = rule(recipe, changes)
    if train_sizes is not None:
        recipe = _one_pass(recipe, train_sizes, changes)
    return _enough_seeds(recipe, noise, changes), changes


def write_fixed_recipe(path: Path, recipe: LadderRecipe, out: Path,
                       runs: Path | None = None) -> tuple[LadderRecipe, list[Change]]:
    """`moelab ladder plan RECIPE --fix --out OUT [--runs LADDER_OUT]`: fix `recipe` (read from `path`), write it to
    `out` in the user's form with the changes as comments, and return it with the changes.

    With `runs` (a `ladder run` folder of this recipe), its fitted noise sizes the seeds. ConfigError, naming the
    flag, when `runs` has no prediction or `out` cannot be written; `out` then holds what it held.
    """
    noise = None
    if runs is not None:
        noise = read_sidecar(runs / PREDICTION)
        if noise is None:
            raise ConfigError(f"--runs {runs}: {sidecar_path(runs / PREDICTION)} does not exist; give the --out folder "
                              "of a finished `moelab ladder run` of this recipe.")
    fixed, changes = fix_recipe(recipe, train_sizes(recipe.target), noise)
    lines = [f"# {path} with its `moelab ladder plan` warnings resolved by `--fix`:"]
    lines += [f"# - {c.field}: {c.before} -> {c.after}: {c.why}." for c in changes] or ["# - nothing to change."]
    data = recipe_data(read_yaml(path, "recipe", ""), fixed)
    rest = {k: v for k, v in data.items() if k not in ("target", "rungs")}
    text = "\n".join([*lines, yaml.safe_dump({"target": data["target"]}, sort_keys=False, width=110).rstrip(),
                      f"rungs: {json.dumps(data['rungs'])}", yaml.safe_dump(rest, sort_keys=False)])
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; --fix writes one recipe file: give a path like {out / 'fixed.yaml'}.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, text)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot be written ({e.strerror or e}: {e.filename or out}); choose a path "
                          "in a folder you can write to.") from None
    return fixed, changes


def _set_shapes(recipe: LadderRecipe, shapes: list[tuple[int, int]], why: str, changes: list[Change],
                **fields) -> LadderRecipe:
    if len(shapes) < 2:
        raise ConfigError(f"the recipe cannot be fixed: {why}, which leaves {len(shapes)} rung size(s) and a ladder "
                          "needs at least 2. Raise the target's train.steps (more tokens per parameter, so more "
                          "steps per rung) or choose rung widths whose head count divides by the target's grouping.")
    changes.append(Change("rungs", [list(s) for s in recipe.shapes], [list(s) for s in shapes], why))
    return replace(recipe, shapes=tuple(shapes), **fields)


def _same_depth(recipe: LadderRecipe, changes: list[Change]) -> LadderRecipe:
    depth = recipe.target.model.num_layers
    if all(layers == depth for _, layers in recipe.shapes):
        return recipe
    shapes = list(dict.fromkeys((d, depth) for d, _ in recipe.shapes))
    return _set_shapes(recipe, shapes, f"every rung takes the target's depth {depth}: rungs of mixed depth put a "
                       "depth change into the width trend the law reads as size", changes)


def _keeps_grouping(recipe: LadderRecipe, d_model: int) -> bool:
    model = recipe.target.model
    group, head_dim = model.num_heads // model.num_kv_heads, model.resolved_head_dim
    return d_model % head_dim == 0 and (d_model // head_dim) % group == 0


def _keep_grouping(recipe: LadderRecipe, changes: list[Change]) -> LadderRecipe:
    target = recipe.target.model
    bad = [d for d, _ in recipe.shapes if not _keeps_grouping(recipe, d)]
    if not bad:
        return recipe
    valid = [d for d in range(1, target.d_model) if _keeps_grouping(recipe, d)]
    taken = {d for d, _ in recipe.shapes if d not in bad}
    shapes, moved, stuck = [], [], []
    for d, layers in recipe.shapes:
        if d not in bad:
            shapes.append((d, layers))
            continue
        free = [w for w in valid if w not in taken and abs(w - d) <= MAX_MOVE * d]
        if free:
            new = min(free, key=lambda w: (abs(w - d), -w))
            taken.add(new)
            shapes.append((new, layers))
            moved.append(f"d{d} -> d{new}")
        else:
            stuck.append((d, layers))
    group = target.num_heads // target.num_kv_heads
    rule = (f"a rung's head count (width / head dim {target.resolved_head_dim}) must divide by the target's {group} query "
            "heads per KV head, else it groups its attention otherwise and is not the target's recipe")
    if len(shapes) >= 2 or not stuck:
        return _set_shapes(recipe, sorted(shapes), ", ".join(moved + [f"d{d} dropped" for d, _ in stuck]) + f": {rule}",
                           changes)
    # Kept, not fixed: a regrouped rung biases a ladder less than having no ladder at all.
    if moved:
        recipe = _set_shapes(recipe, sorted(shapes + stuck), f"{', '.join(moved)}: {rule}", changes)
    changes.append(Change("rungs", [list(s) for s in recipe.shapes], [list(s) for s in recipe.shapes],
                          f"not fixed: {', '.join(f'd{d}' for d, _ in stuck)} cannot move within {MAX_MOVE:.0%} to a "
                          f"width that keeps the grouping, and dropping them would leave {len(shapes)} size(s): "
                          f"{rule}. Measured (docs/key-figures.md 'Ladder accuracy'): ladder-cpu's rungs at 3:1 and 5:1 against its "
                          "2:1 target still met every goal; ladder-cpu-shallow's d56 at 7:1 against 3:1 sat above the "
                          "law in all 5 seeds. Choose rung widths whose head count divides by the grouping"))
    return recipe


def _steps(recipe: LadderRecipe, shape: tuple[int, int], batch: int) -> int:
    return make_rung(recipe.target, *shape, batch).train.steps


def _long_enough(recipe: LadderRecipe, changes: list[Change]) -> LadderRecipe:
    batch = recipe.rung_batch_size or recipe.target.train.batch_size
    steps = {s: _steps(recipe, s, batch) for s in recipe.shapes}
    if min(steps.values()) >= MIN_RUNG_STEPS:
        return recipe
    short = ", ".join(f"d{d} x {layers} trains {n} steps" for (d, layers), n in steps.items() if n < MIN_RUNG_STEPS)
    long_enough = [s for s in recipe.shapes if steps[s] >= MIN_RUNG_STEPS]
    if len(long_enough) >= MIN_SIZES:
        return _set_shapes(recipe, long_enough, f"{short}, under {MIN_RUNG_STEPS}: dropped (a rung that short is still "
                           "leaving its first plateaus as its LR decays, so it is not tuned like the others)", changes)
    # Kept, not fixed: a smaller rung batch would give them the steps, but measured on ladder-untuned-wide16
    # (rungs at 6 sequences, target at 16) it put the prediction 16.4% low, so the batch stays the target's.
    changes.append(Change("rungs", [list(s) for s in recipe.shapes], [list(s) for s in recipe.shapes],
                          f"not fixed: {short}, under {MIN_RUNG_STEPS}, and dropping them would leave "
                          f"{len(long_enough)} size(s). A rung's tokens are set by the target's tokens per parameter; "
                          "a smaller rung batch would give it more steps but makes it learn more per token than the "
                          "target (measured: 16% low), so raise the target's train.steps (more tokens per parameter) "
                          "or use a smaller head dim, whose widths leave room for wider rungs"))
    return recipe


def _one_pass(recipe: LadderRecipe, train_sizes: Mapping[str, int], changes: list[Change]) -> LadderRecipe:
    target = recipe.target
    before = data_epochs(target, train_sizes)
    if max(before.values()) <= 1.0:
        return recipe
    phases = list(target.data.phases)
    for _ in range(50):  # lowering one domain raises the others' shares, so repeat until all fit
        epochs = data_epochs(replace(target, data=replace(target.data, phases=tuple(phases))), train_sizes)
        over = {d: e for d, e in epochs.items() if e > EPOCH_LIMIT}
        if not over:
            break
        phases = [replace(ph, weights={d: round(w * (EPOCH_AIM / over[d] if d in over else 1.0), 4)
                                       for d, w in ph.weights.items()}) for ph in phases]
    else:
        raise ConfigError(f"the recipe cannot be fixed: the target's {target.train.steps} steps read more tokens than "
                          f"its domains hold ({', '.join(f'{d} {e:.2f}x' for d, e in before.items())}); train fewer "
                          "tokens or add data.")
    phases = [replace(ph, weights={d: round(w / sum(ph.weights.values()), 3) for d, w in ph.weights.items()})
              for ph in phases]
    fixed = replace(target, data=replace(target.data, phases=tuple(phases)))
    if max(data_epochs(fixed, train_sizes).values()) > 1.0:
        raise ConfigError("the recipe cannot be fixed: no weighting of data.phases keeps every domain under one pass; "
                          "train fewer tokens or add data.")
    read = ", ".join(f"{d} {e:.2f}x" for d, e in before.items() if e > 1.0)
    after = ", ".join(f"{d} {e:.2f}x" for d, e in data_epochs(fixed, train_sizes).items())
    changes.append(Change("target.data.phases", _phase_data(target.data.phases), _phase_data(phases),
                          f"the target read {read}; lowered in every phase, it reads {after} (repeated data bends the "
                          "held-out loss away from the law)"))
    return replace(recipe, target=fixed)


def _phase_data(phases) -> list[dict]:
    return [{"name": ph.name, "fraction": ph.fraction, "weights": dict(ph.weights)} for ph in phases]


def _enough_seeds(recipe: LadderRecipe, noise: Mapping[str, Any] | None, changes: list[Change]) -> LadderRecipe:
    if noise is not None:
        advice = seeds_for_band(noise, len(recipe.shapes))
        seeds, why = advice["seeds"], advice["why"]
    else:
        seeds = max(recipe.rung_seeds, MIN_SEEDS)
        why = (f"{len(recipe.shapes)} sizes x {recipe.rung_seeds} seed(s) leave the run-to-run spread "
               f"{max(len(recipe.shapes) * recipe.rung_seeds - 3, 0)} degree(s) of freedom (E, A and alpha absorb "
               f"three run levels); {MIN_SEEDS} seeds a rung is the least that estimates it (pass --runs with a "
               "fitted ladder to size them from its measured spread)")
    if seeds == recipe.rung_seeds:
        return recipe
    changes.append(Change("rung_seeds", recipe.rung_seeds, seeds, why))
    return replace(recipe, rung_seeds=seeds)


def seeds_for_band(summary: Mapping[str, Any], sizes: int, goal: float = BAND_GOAL) -> dict:
    """Seeds per rung for a target band of +-`goal`, from a fitted ladder's summary (`predict.fit_curves`).

    The band's half-width squared is read as two parts: the new run's own offset, t_0.975(dof) x run_sd at the
    target (dof = sizes x seeds - 3), which seeds cannot shrink below 1.96 x run_sd but whose t quantile they
    bring down; and the fit's uncertainty, the rest of today's half-width squared, which falls as 1 / runs.
    An approximation (the band is a bootstrap mixture), good for how many seeds, not for the last digit.
    Returns {"seeds", "half_width" (expected at those seeds), "reachable", "why"}.
    """
    target = summary["targets"][0]
    noise, runs = summary["noise"], summary["fit"]["runs"]
    scale = (target["params"] / noise["ref_params"]) ** -noise.get("size_exponent", 0.0) if noise.get(
        "ref_params") else 1.0
    own = scale * noise["run_sd"] / target["loss_pred"]  # the target run's own offset, relative
    dof = noise["run_dof"]
    t_now = float(special.stdtrit(dof, 0.975)) if dof > 0 else 1.96
    fit_part = max(target["band95_half_width"] ** 2 - (t_now * own) ** 2, 0.0)

    def half_width(seeds: int) -> float:
        new_dof = sizes * seeds - 3
        t = float(special.stdtrit(new_dof, 0.975)) if new_dof > 0 else 12.7
        return math.sqrt((t * own) ** 2 + fit_part * runs / (sizes * seeds))

    seeds = next((k for k in range(1, MAX_SEEDS + 1) if half_width(k) <= goal), None)
    if seeds is not None:
        return {"seeds": max(seeds, MIN_SEEDS), "half_width": half_width(max(seeds, MIN_SEEDS)), "reachable": True,
                "why": f"the fitted spread (run sd {own:.2%} at the target, band +-{target['band95_half_width']:.1%} "
                       f"from {runs} runs) needs about {seeds} seed(s) a rung for a +-{goal:.0%} band"}
    floor = half_width(MAX_SEEDS)
    seeds = next(k for k in range(MIN_SEEDS, MAX_SEEDS + 1) if half_width(k) <= 1.1 * floor)
    if 1.96 * own >= goal:
        why = (f"the run-to-run spread alone is +-{1.96 * own:.1%} at the target (run sd {own:.2%}), so seeds cannot "
               f"bring the band under +-{goal:.0%}: {seeds} a rung get it to about +-{half_width(seeds):.1%}; runs "
               "that vary less (longer rungs, more eval batches) are what would reach it")
    else:
        why = (f"the fit's own uncertainty (+-{math.sqrt(fit_part):.1%} from {runs} runs) would need over {MAX_SEEDS} "
               f"seeds a rung for +-{goal:.0%} ({MAX_SEEDS} get about +-{floor:.1%}): the rungs disagree with the "
               "law more than seeds can average away, so fix the recipe (see the notes) before adding seeds")
    return {"seeds": seeds, "half_width": half_width(seeds), "reachable": False, "why": why}


def recipe_data(original: Mapping[str, Any], fixed: LadderRecipe) -> dict:
    """The recipe file's mapping with the fixed fields written in, keeping how the user wrote its target."""
    data = copy.deepcopy(dict(original))
    data["rungs"] = [list(s) for s in fixed.shapes]
    data["rung_seeds"] = fixed.rung_seeds
    if fixed.rung_batch_size is not None:
        data["rung_batch_size"] = fixed.rung_batch_size
    phases = _phase_data(fixed.target.data.phases)
    target = data["target"]
    if isinstance(target, dict) and "preset" in target:
        if (target.get("overrides") or {}).get("data.phases") is not None or phases != _phase_data(
                _resolved_phases(target)):
            target.setdefault("overrides", {})["data.phases"] = phases
    elif isinstance(target, dict):
        target.setdefault("data", {})["phases"] = phases
    return data


def _resolved_phases(target: Mapping[str, Any]) -> tuple[PhaseConfig, ...]:
    from moelab import presets

    return presets.resolve(target).data.phases
