"""Final eval/mean of a preset from several seeds, or of a ladder recipe's rungs: the before / after figure of a
change that touches every run.

    python benchmarks/tiny_seeds.py --preset tiny --steps 300 --seeds 3 --json
    python benchmarks/tiny_seeds.py --recipe experiments/ladder-cpu.yaml --json   # each rung width, its first seed

Trains `--preset` for `--steps` steps from `train.seed` 0..N-1 (each its own init and batches), or with `--recipe`
each rung width of the recipe at its planned steps (its first seed: `moelab ladder plan` lists them), and reports
each run's final train loss and eval/mean, their mean and their spread. Run it on the commit before a change and
on the change, and compare the means against the spread (issue 59 measured the norm gains' weight decay this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moelab import presets
from moelab.config import RunConfig
from moelab.errors import ConfigError, DataError
from moelab.ladder.rungs import load_recipe
from moelab.ladder.run import plan_ladder
from moelab.train.loop import train


def run(cfg: RunConfig, out: Path) -> dict:
    """One training run; its final figures."""
    start = time.perf_counter()
    summary = train(cfg, out / cfg.name)
    return {"name": cfg.name, "seed": cfg.train.seed, "steps": cfg.train.steps, "loss": summary["loss"],
            "eval_mean": summary["eval_mean"], "seconds": round(time.perf_counter() - start, 1)}


def configs(args: argparse.Namespace) -> list[RunConfig]:
    """What to train: the preset's seeds, or the first seed of each rung width of the recipe."""
    if args.recipe:
        rungs, _ = plan_ladder(load_recipe(args.recipe))
        return [cfg for cfg in rungs if "-seed" not in cfg.name]
    return [presets.resolve(args.preset, {"name": f"{args.preset}-seed{seed}", "train.steps": args.steps,
                                          "train.seed": seed, "train.eval_every": args.steps})
            for seed in range(args.seeds)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--recipe", type=Path, default=None, help="a ladder recipe: train its rung widths instead")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    try:
        planned = configs(args)  # a bad recipe or preset stops here, before anything trains
    except (ConfigError, DataError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(cfg, Path(tmp)) for cfg in planned]
    evals = [r["eval_mean"] for r in runs]
    result = {"benchmark": "tiny_seeds", "preset": None if args.recipe else args.preset,
              "recipe": str(args.recipe) if args.recipe else None, "steps": None if args.recipe else args.steps,
              "runs": runs, "eval_mean": statistics.fmean(evals), "eval_spread": max(evals) - min(evals)}
    print(json.dumps(result, indent=2) if args.json else f"eval/mean {result['eval_mean']:.4f} "
          f"(spread {result['eval_spread']:.4f} over {len(runs)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
