"""FP8 against bf16 on the loss: one preset trained from the same seeds both ways, the final losses compared.

    python benchmarks/fp8_loss.py --preset gpu-small --steps 300 --json        # on a GPU (the suite's comparison)
    python benchmarks/fp8_loss.py --preset tiny --steps 300 --seeds 3 --json   # on CPU: 3 seeds each way
    python benchmarks/fp8_loss.py --preset tiny --steps 600 --seeds 3 --set model.d_model=256 ...  # a wider model
    python benchmarks/fp8_loss.py ... --variant "tiles 128"    # FP8 rounded as a variant of fp8_error.py

Trains `--preset` with `train.compute_dtype: bfloat16` for `--steps` steps, once as is and once with
`model.fp8: true` (issue 53), from each of `train.seed` 0..N-1 (`--seeds`): a seed fixes the init and the
batches, so bf16 and FP8 from one seed differ only by the FP8 GEMMs. Reports each run's final train loss and
eval/mean, and three readings of the FP8 cost:
- `fp8_vs_bf16_eval` / `_loss`: seed 0 alone (what the GPU suite's one pair can say);
- `paired_eval`: FP8 minus bf16 per seed, relative, its mean and standard error. Pairs share init and data,
  so this is the cost with the seed noise that both runs share taken out;
- `fp8_inside_seed_range`: whether the FP8 seeds' mean eval lies within the bf16 seeds' [min, max] (issue 61's
  bar, "within the bf16 seeds' spread"; DeepSeek-V3 reports FP8 within 0.25% of BF16 at scale).
Runs are written under `--out` (a temporary folder by default) and resume from there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from moelab import presets
from moelab.config import parse_overrides
from moelab.model import fp8 as fp8_lib
from moelab.train.loop import train


@functools.cache
def _fp8_error():
    """`benchmarks/fp8_error.py` (a script beside this one, not a package), loaded once."""
    spec = importlib.util.spec_from_file_location("fp8_error", Path(__file__).with_name("fp8_error.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variant(name: str | None):
    """A context in which FP8 rounds as `fp8_error.VARIANTS[name]` does (None: the recipe as it is)."""
    if name is None:
        return contextlib.nullcontext()
    return mock.patch.object(fp8_lib, "_quantize", _fp8_error().VARIANTS[name])


def run(preset: str, steps: int, seed: int, fp8: bool, out: Path, sets: dict | None = None,
        variant: str | None = None) -> dict:
    """One training run; its final figures. `variant` (FP8 only): a rounding of `fp8_error.VARIANTS` instead of the
    recipe's, in its own folder."""
    sets = {"train.steps": steps, "train.seed": seed, "train.compute_dtype": "bfloat16", "model.fp8": fp8,
            "train.eval_every": steps, "train.eval_batches": 2, **(sets or {})}
    start = time.perf_counter()
    name = f"{'fp8' if fp8 else 'bf16'}{'-' + variant.replace(' ', '-') if variant else ''}-seed{seed}"
    with _variant(variant if fp8 else None):  # read while the step is traced
        summary = train(presets.resolve(preset, sets), out / name)
    return {"fp8": fp8, "seed": seed, "loss": summary["loss"], "eval_mean": summary["eval_mean"],
            "eval_initial": summary["eval_initial"]["mean"],  # before any step: the same weights, FP8 or not
            "tokens_per_s": summary["tokens_per_s"], "seconds": time.perf_counter() - start}


def _spread(values: list[float]) -> float | None:
    """(max - min) / min: the range the seeds span, relative."""
    return (max(values) - min(values)) / min(values) if len(values) > 1 else None


def compare(preset: str, steps: int, seeds: int, out: Path, sets: dict | None = None, variant: str | None = None
            ) -> dict:
    """bf16 and FP8 from seeds 0..seeds-1, and the FP8 cost read three ways (the module docstring)."""
    bf16 = [run(preset, steps, seed, False, out, sets) for seed in range(seeds)]
    fp8 = [run(preset, steps, seed, True, out, sets, variant) for seed in range(seeds)]
    evals, fp8_evals = [r["eval_mean"] for r in bf16], [r["eval_mean"] for r in fp8]
    paired = [f / b - 1 for f, b in zip(fp8_evals, evals)]
    fp8_mean = statistics.fmean(fp8_evals)
    return {"benchmark": "fp8_loss", "preset": preset, "steps": steps, "overrides": dict(sets or {}), "variant": variant,
            "bf16": bf16, "fp8": fp8[0], "fp8_runs": fp8,
            "fp8_vs_bf16_eval": fp8[0]["eval_mean"] / bf16[0]["eval_mean"] - 1,
            "fp8_vs_bf16_loss": fp8[0]["loss"] / bf16[0]["loss"] - 1,
            "bf16_eval_mean": statistics.fmean(evals), "fp8_eval_mean": fp8_mean,
            "fp8_vs_bf16_mean_eval": fp8_mean / statistics.fmean(evals) - 1,
            "paired_eval": {"per_seed": paired, "mean": statistics.fmean(paired),
                            "stderr": statistics.stdev(paired) / len(paired) ** 0.5 if seeds > 1 else None},
            "bf16_seed_spread_eval": _spread(evals), "fp8_seed_spread_eval": _spread(fp8_evals),
            "fp8_inside_seed_range": min(evals) <= fp8_mean <= max(evals) if seeds > 1 else None,
            "status": "ok"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, each trained in bf16 and in FP8")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs (repeatable), e.g. model.d_model=256")
    parser.add_argument("--variant", default=None, choices=list(_fp8_error().VARIANTS), help="FP8 rounded as a variant of benchmarks/fp8_error.py "
                        "(e.g. 'tiles 128') instead of the recipe; the bf16 runs are the same")
    parser.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON object to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    sets = parse_overrides(args.set)
    with tempfile.TemporaryDirectory() as tmp:
        result = compare(args.preset, args.steps, args.seeds, args.out or Path(tmp), sets, args.variant)
    text = json.dumps(result, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    paired = result["paired_eval"]
    print(text if args.json else f"FP8 vs bf16 eval/mean, paired by seed: {paired['mean']:+.3%}"
          + (f" (+-{paired['stderr']:.3%} standard error)" if paired["stderr"] is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
