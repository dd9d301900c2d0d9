"""A small per-width LR sweep of a ladder recipe, and the LR-transfer rule fitted from it.

    python benchmarks/lr_sweep.py experiments/ladder-cpu.yaml --out runs/lr-sweep-cpu --json
    python benchmarks/lr_sweep.py experiments/ladder-cpu-shallow.yaml --out runs/lr-sweep-shallow --json

Every rung width and the target's width, each at its ladder shape (`presets.make_rung`, the
recipe's rung batch size), trains at each LR of a factor-2 grid around the target's LR for
`--fraction` of its ladder token budget, one seed, scored by its one eval at the end. A width
whose best LR is at an end of its grid gets the next LR beyond it (at most `--extend` times), so the
optimum is bracketed. `rungs.fit_lr_rule` then fits lr*(d) = c * d^-k to all points; k is what the
recipe stores as `lr_exponent` (rung LR = target LR * (d_target / d)^k, so every rung sits at the
same ratio to its own optimum as the target does to its). Reading k off a reduced budget assumes
the budget moves every width's optimum by one factor (each width keeps the ladder's tokens per
parameter, scaled by `--fraction`). On our CPU recipes it did not quite hold: short runs of small
widths want much larger LRs, so the rule gave the small rungs more LR than suits them at the full
budget (docs/scaling-ladder.md, "LR transfer across rungs"); a larger `--fraction` costs more and
assumes less. Resumable: finished points are reused.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from moelab.ladder.rungs import fit_lr_rule, load_recipe
from moelab.presets import EVALS_PER_RUN, make_rung
from moelab.train.loop import train
from moelab.train.outputs import SUMMARY, read_summary


def sweep_point(recipe, d_model: int, num_layers: int, lr: float, fraction: float, out: Path) -> dict:
    """Train one (width, LR) point at `fraction` of the width's ladder budget (or reuse it); its final eval."""
    rung = make_rung(recipe.target, d_model, num_layers, recipe.rung_batch_size)
    steps = max(EVALS_PER_RUN, round(rung.train.steps * fraction))
    cfg = replace(rung, name=f"sweep-d{d_model}-l{num_layers}-lr{lr:g}",
                  train=replace(rung.train, lr=lr, steps=steps, warmup_steps=max(1, steps // EVALS_PER_RUN),
                                eval_every=steps))
    run_dir = out / cfg.name
    if not (run_dir / SUMMARY).is_file():
        train(cfg, run_dir)
    return {"d_model": d_model, "num_layers": num_layers, "lr": lr, "steps": steps,
            "loss": read_summary(run_dir)["eval_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--out", default="runs/lr-sweep")
    parser.add_argument("--fraction", type=float, default=0.33, help="share of each width's ladder token budget")
    parser.add_argument("--factors", default="0.5,1,2", help="LR grid as multiples of the target's LR")
    parser.add_argument("--extend", type=int, default=2, help="most LRs added beyond a grid end, per width")
    parser.add_argument("--widths", help="comma-separated d_model subset, in this order (default: every width)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    recipe, out = load_recipe(args.recipe), Path(args.out)
    base = recipe.target.train.lr
    shapes = sorted({*recipe.shapes, (recipe.target.model.d_model, recipe.target.model.num_layers)})
    if args.widths:
        depth = dict(shapes)
        shapes = [(int(d), depth[int(d)]) for d in args.widths.split(",")]
    points = []
    for d, layers in shapes:
        lrs = sorted(base * float(f) for f in args.factors.split(","))
        width = [sweep_point(recipe, d, layers, lr, args.fraction, out) for lr in lrs]
        for _ in range(args.extend):
            best = min(range(len(width)), key=lambda i: width[i]["loss"])
            if 0 < best < len(width) - 1:
                break
            lr = width[0]["lr"] / 2 if best == 0 else width[-1]["lr"] * 2
            width = sorted(width + [sweep_point(recipe, d, layers, lr, args.fraction, out)], key=lambda p: p["lr"])
        points += width
        print(json.dumps(width), flush=True) if not args.json else None
    rule = fit_lr_rule([p["d_model"] for p in points], [p["lr"] for p in points], [p["loss"] for p in points])
    d_target = recipe.target.model.d_model
    best = {d: min((p for p in points if p["d_model"] == d), key=lambda p: p["loss"])["lr"] for d, _ in shapes}
    result = {
        "benchmark": "lr_sweep", "recipe": args.recipe, "fraction": args.fraction, "target_lr": base,
        "points": points, "best_grid_lr": best,
        "rule": {"c": rule.c, "k": rule.k, "curvature": rule.curvature, "rmse": rule.rmse},
        "optimum_per_width": dict(zip(sorted(best), rule.optima)),  # each width's own parabola: the scatter
        "rule_per_width": {d: rule.lr(d) for d in sorted(best)},
        "optimum_at_target_width": rule.lr(d_target),
        "target_lr_over_optimum": base / rule.lr(d_target),
        "recipe_line": f"lr_exponent: {rule.k:.2f}",
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
