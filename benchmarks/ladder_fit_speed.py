"""How long `moelab ladder fit` takes on a public-sized set of curves: 25 runs, 2,500 rows.

    python benchmarks/ladder_fit_speed.py --json
    python benchmarks/ladder_fit_speed.py --runs 25 --rows 100 --max-steps 60000 --bootstrap 200

Writes CURVES.csv and TARGET.csv for 5 sizes x 5 schedules (constant, cosine, WSD 10/20/40%), run
lengths growing with size up to `--max-steps` (long runs are what make the anneal term's EMA costly),
losses from a known law plus run offsets and checkpoint noise; then times the CLI's code path,
`fit_curves` (point fit, bootstrap, the leave-largest-out self-check with its own bootstrap), and
reports how far the fitted law lands from the one that made the curves. Goal: under 60 s on 2 cores
with the default bootstrap.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from moelab.ladder import NUM_BOOTSTRAP
from moelab.ladder.curve import CurveLaw, Run, curve_loss
from moelab.ladder.predict import fit_curves
from moelab.ladder.run import write_csv

TRUTH = CurveLaw(e=1.6, a=60.0, alpha=0.35, b=400.0, beta=0.38, c=0.25, tau=300.0)
KINDS = ("constant", "cosine", "wsd10", "wsd20", "wsd40")


def relative_lr(kind: str, steps: int) -> np.ndarray:
    """LR / peak at steps 1..steps: 5% linear warmup, then the schedule, down to 10% of the peak."""
    s = np.arange(1, steps + 1)
    warm = max(1, steps // 20)
    lr = np.minimum(1.0, s / warm)
    if kind == "cosine":
        progress = np.clip((s - warm) / (steps - warm), 0, 1)
        lr = np.where(s > warm, 0.1 + 0.45 * (1 + np.cos(np.pi * progress)), lr)
    elif kind.startswith("wsd"):
        start = steps - int(int(kind[3:]) / 100 * steps)
        lr = np.where(s > start, 1.0 - 0.9 * (s - start) / (steps - start), lr)
    return lr


def synthetic_curves(num_runs: int, rows: int, max_steps: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    sizes = -(-num_runs // len(KINDS))
    curves = []
    for k in range(num_runs):
        i, kind = k // len(KINDS), KINDS[k % len(KINDS)]
        params, steps = 1e6 * 3.0**i, int(max_steps * 0.6 ** (sizes - 1 - i))
        lr = relative_lr(kind, steps)
        dense = Run("dense", params, np.arange(1, steps + 1), np.arange(1, steps + 1) * 2e4, lr * 1e-3)
        picks = np.unique(np.linspace(1, steps, rows).astype(int)) - 1
        loss = curve_loss(TRUTH, dense)[picks] + rng.normal(0, 0.01) + rng.normal(0, 0.004, len(picks))
        curves += [{"run": f"n{i}-{kind}", "params": params, "step": int(p + 1), "tokens": float(p + 1) * 2e4,
                    "lr": float(lr[p] * 1e-3), "loss": float(l)} for p, l in zip(picks, loss)]
    steps = int(max_steps * 1.5)
    lr = relative_lr("wsd20", steps)
    picks = np.unique(np.linspace(1, steps, rows).astype(int)) - 1
    target = [{"run": "target", "params": 1e6 * 3.0**sizes, "step": int(p + 1), "tokens": float(p + 1) * 2e4,
               "lr": float(lr[p] * 1e-3)} for p in picks]
    return curves, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=60000)
    parser.add_argument("--bootstrap", type=int, default=NUM_BOOTSTRAP)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    curves, target = synthetic_curves(args.runs, args.rows, args.max_steps)
    with tempfile.TemporaryDirectory() as tmp:
        write_csv(Path(tmp) / "curves.csv", curves)
        write_csv(Path(tmp) / "target.csv", target)
        start = time.perf_counter()
        summary = fit_curves(Path(tmp) / "curves.csv", Path(tmp) / "target.csv", Path(tmp) / "pred.csv",
                             num_bootstrap=args.bootstrap)
        seconds = time.perf_counter() - start
    truth = {"E": TRUTH.e, "A": TRUTH.a, "alpha": TRUTH.alpha, "B": TRUTH.b, "beta": TRUTH.beta, "C": TRUTH.c,
             "tau_steps": TRUTH.tau}
    result = {"benchmark": "ladder_fit_speed", "runs": len({r["run"] for r in curves}), "rows": len(curves),
              "max_steps": args.max_steps, "bootstrap": args.bootstrap, "cpus": os.cpu_count(),
              "seconds": seconds, "goal_seconds": 60,
              "fitted": summary["params"], "truth": truth, "self_check": summary["self_check"],
              "notes": summary["notes"]}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
