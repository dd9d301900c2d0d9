"""A preset's final eval/mean from several seeds: the before / after figure of a change that touches every run.

    python benchmarks/tiny_seeds.py --preset tiny --steps 300 --seeds 3 --json

Trains `--preset` for `--steps` steps from `train.seed` 0..N-1 (each its own init and batches) and reports each
run's final train loss and eval/mean, their mean and their spread. Run it on the commit before a change and on
the change, and compare the means against the spread (issue 59 measured the norm gains' weight decay this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from moelab import presets
from moelab.train.loop import train


def run(preset: str, steps: int, seed: int, out: Path) -> dict:
    """One training run; its final figures."""
    start = time.perf_counter()
    summary = train(presets.resolve(preset, {"train.steps": steps, "train.seed": seed, "train.eval_every": steps}),
                    out / f"seed{seed}")
    return {"seed": seed, "loss": summary["loss"], "eval_mean": summary["eval_mean"],
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(args.preset, args.steps, seed, Path(tmp)) for seed in range(args.seeds)]
    evals = [r["eval_mean"] for r in runs]
    result = {"benchmark": "tiny_seeds", "preset": args.preset, "steps": args.steps, "runs": runs,
              "eval_mean": statistics.fmean(evals), "eval_spread": max(evals) - min(evals)}
    print(json.dumps(result, indent=2) if args.json else f"eval/mean {result['eval_mean']:.4f} "
          f"(spread {result['eval_spread']:.4f} over {args.seeds} seeds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
