"""One size, several LR schedules: how well the curve law predicts a schedule it has not seen.

    python benchmarks/schedule_fit.py --json                          # trains 5 runs, ~5 min on 2 cores
    python benchmarks/schedule_fit.py --csv tests/data/schedules-tiny.csv

Trains the `tiny` preset (one data phase, so only the LR moves the curve) under constant, cosine and
WSD schedules with 10%, 20% and 40% decays, every run on the same seed and data order, evaluating
every 20 of its 600 steps. Writes every eval as CURVES.csv rows (`--csv`; the test set of
tests/test_ladder_schedules.py), then leaves each schedule out in turn: fit the one-size law on the
other four, predict the fifth, and report its mean relative error after warmup and the 95% band's
coverage. Re-running reuses finished runs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from moelab import presets
from moelab.config import PhaseConfig
from moelab.ladder.fit import bootstrap_curve_law, fit_curve_law
from moelab.ladder.predict import predict_with_bands, read_curves, score
from moelab.ladder.run import curve_rows, write_csv
from moelab.train.loop import train
from moelab.train.outputs import SUMMARY

# name -> TrainConfig fields; "constant" is WSD without a decay
SCHEDULES = {
    "constant": {"schedule": "wsd", "decay_fraction": 0.0},
    "cosine": {"schedule": "cosine"},
    "wsd10": {"schedule": "wsd", "decay_fraction": 0.1},
    "wsd20": {"schedule": "wsd", "decay_fraction": 0.2},
    "wsd40": {"schedule": "wsd", "decay_fraction": 0.4},
}


def config(name: str, steps: int):
    cfg = presets.get("tiny")
    data = replace(cfg.data, phases=(PhaseConfig("pretrain", 1.0, {"code": 0.45, "prose": 0.45, "arithmetic": 0.1}),))
    train_cfg = replace(cfg.train, steps=steps, warmup_steps=steps // 20, eval_every=steps // 30, eval_batches=8,
                        **SCHEDULES[name])
    return replace(cfg, name=f"tiny-{name}", data=data, train=train_cfg)


def leave_one_out(curves_csv: Path, num_bootstrap: int) -> dict:
    """Fit on all schedules but one, predict it; per held-out schedule and on average."""
    runs = read_curves(curves_csv)
    out = {}
    for held in runs:
        rest = [r for r in runs if r is not held]
        law = fit_curve_law(rest)
        bands = predict_with_bands(law, bootstrap_curve_law(rest, law, num_bootstrap), replace(held, loss=None))
        out[held.name] = {**score(bands, held), "fit_rmse": law.rmse}
    return {"held_out": out,
            "mean_relative_error": float(np.mean([s["mape_after_10pct"] for s in out.values()])),
            "worst_relative_error": float(max(s["mape_after_10pct"] for s in out.values())),
            "band95_coverage": float(np.mean([s["band95_coverage"] for s in out.values()]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/schedules")
    parser.add_argument("--csv", default=None, help="where to write the curves (default: OUT/curves.csv)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--bootstrap", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    out = Path(args.out)
    start = time.perf_counter()
    rows = []
    for name in SCHEDULES:
        cfg = config(name, args.steps)
        if not (out / cfg.name / SUMMARY).is_file():
            train(cfg, out / cfg.name)
        rows += curve_rows(cfg, out / cfg.name)
    csv_path = Path(args.csv) if args.csv else out / "curves.csv"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    write_csv(csv_path, rows)
    result = {"benchmark": "schedule_fit", "preset": "tiny", "steps": args.steps, "schedules": list(SCHEDULES),
              "curves": str(csv_path), **leave_one_out(csv_path, args.bootstrap),
              "seconds": time.perf_counter() - start}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
