"""One size, several LR schedules: how well the curve law predicts a schedule it has not seen.

    python benchmarks/schedule_fit.py --json                          # trains 5 runs, ~5 min on 2 cores
    python benchmarks/schedule_fit.py --csv tests/data/schedules-tiny.csv

Trains the `tiny` preset (one data phase, so only the LR moves the curve) under constant, cosine and
WSD schedules with 10%, 20% and 40% decays, every run on the same seed and data order, evaluating
every 20 of its 600 steps. Writes every eval as CURVES.csv rows (`--csv`; the test set of
tests/test_ladder_checks.py), then leaves each schedule out in turn: fit the one-size law on the
other four, predict the fifth, and report its mean relative error after 10% of its tokens and the 95%
band's coverage, plain and borrowing the noise the runs share at each step (`same_data_order`: the
runs share one seed and data order, `moelab ladder fit --same-data-order`). `in_sample_mape` is the
law fitted on all five, scored on each: what a smooth law leaves of the curves' own noise, so no
held-out prediction should be expected below it. `--seeds 3` also trains seeds 1 and 2 of every
schedule (the CSV keeps seed 0) and repeats all this on each schedule's mean curve over the seeds
(`seed_mean`: a third of the noise variance). Re-running reuses finished runs.
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
from moelab.ladder.bands import bootstrap_curve_law, predict_with_bands, score, shared_noise
from moelab.ladder.contract import read_curves
from moelab.ladder.curve import curve_loss
from moelab.ladder.fit import fit_curve_law
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


def config(name: str, steps: int, seed: int = 0):
    cfg = presets.get("tiny")
    data = replace(cfg.data, phases=(PhaseConfig("pretrain", 1.0, {"code": 0.45, "prose": 0.45, "arithmetic": 0.1}),))
    train_cfg = replace(cfg.train, steps=steps, warmup_steps=steps // 20, eval_every=steps // 30, eval_batches=8,
                        seed=seed, **SCHEDULES[name])
    return replace(cfg, name=f"tiny-{name}" + (f"-seed{seed}" if seed else ""), data=data, train=train_cfg)


def _mape(pred: np.ndarray, run) -> float:
    late = run.tokens >= 0.1 * run.tokens[-1]
    return float(np.mean(np.abs(pred[late] / run.loss[late] - 1)))


def leave_one_out(runs: list, num_bootstrap: int) -> dict:
    """Fit on all schedules but one, predict it; per held-out schedule and on average, without and with
    borrowing the noise the runs share at each step (`fit.SharedNoise`: they share one seed and data order)."""
    whole = fit_curve_law(runs)
    out = {"plain": {}, "same_data_order": {}}
    for held in runs:
        rest = [r for r in runs if r is not held]
        law = fit_curve_law(rest)
        bootstrap = bootstrap_curve_law(rest, law, num_bootstrap)
        for key, shared in (("plain", None), ("same_data_order", shared_noise(rest, law))):
            bands = predict_with_bands(law, bootstrap, replace(held, loss=None), shared)
            out[key][held.name] = {**score(bands, held), "fit_rmse": law.rmse}

    def summary(scores: dict) -> dict:
        return {"held_out": scores,
                "mean_relative_error": float(np.mean([s["mape_after_10pct"] for s in scores.values()])),
                "worst_relative_error": float(max(s["mape_after_10pct"] for s in scores.values())),
                "band95_coverage": float(np.mean([s["band95_coverage"] for s in scores.values()]))}

    return {**summary(out["plain"]), "same_data_order": summary(out["same_data_order"]),
            "in_sample_mape": float(np.mean([_mape(curve_loss(whole, r), r) for r in runs]))}


def seed_mean(runs_by_seed: list[list]) -> list:
    """Each schedule's mean curve over the seeds (every seed evaluates at the same steps)."""
    return [replace(same[0], name=same[0].name + "-mean", loss=np.mean([r.loss for r in same], axis=0))
            for same in zip(*runs_by_seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/schedules")
    parser.add_argument("--csv", default=None, help="where to write the curves (default: OUT/curves.csv)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--bootstrap", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1, help="train every schedule with train.seed 0..SEEDS-1")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    out = Path(args.out)
    curves_csv = Path(args.csv) if args.csv else out / "curves.csv"
    start = time.perf_counter()
    by_seed = []
    for seed in range(args.seeds):
        rows = []
        for name in SCHEDULES:
            cfg = config(name, args.steps, seed)
            if not (out / cfg.name / SUMMARY).is_file():
                train(cfg, out / cfg.name)
            rows += curve_rows(cfg, out / cfg.name)
        csv_path = curves_csv if seed == 0 else out / f"curves-seed{seed}.csv"
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(csv_path, rows)
        by_seed.append(read_curves(csv_path))
    result = {"benchmark": "schedule_fit", "preset": "tiny", "steps": args.steps, "schedules": list(SCHEDULES),
              "curves": str(curves_csv),
              **leave_one_out(by_seed[0], args.bootstrap)}
    if args.seeds > 1:
        result["seed_mean"] = {"seeds": args.seeds, **leave_one_out(seed_mean(by_seed), args.bootstrap)}
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
