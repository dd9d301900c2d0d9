"""Kill `moelab train` at many random moments; every rerun must end bitwise equal to an uninterrupted run.

    python benchmarks/fault_sweep.py --trials 20 --json          # about 10 minutes on 2 cores
    python benchmarks/fault_sweep.py --trials 5 --steps 16

The suite's `tests/test_faults.py` kills a few seeded moments; this sweeps kill times uniformly over
the whole run (start-up, compile, steps, evals, checkpoint saves), SIGKILLs, reruns the same command
until it finishes (a kill can land before the first checkpoint, or twice), and compares the final
params, optimizer and router state and every metric record with the reference run. Prints one JSON
object: each trial's kill time, whether the kill landed, the step the rerun resumed from, and whether
the end was bitwise equal; and the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TIMING_KEYS = {"tokens_per_s"}


def _command(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "moelab.cli", "train", "--json", "--preset", "tiny", "--steps", str(steps), "--out", str(out),
            "--checkpoint-every", "4", "--set", "train.log_every=2", "--set", "train.eval_every=8",
            "--set", "train.eval_batches=1"]


def _fingerprint(out: Path, steps: int) -> tuple[list[np.ndarray], list[dict]]:
    """The final checkpoint's arrays and the metric records (timings left out)."""
    import jax

    from moelab import presets
    from moelab.config import CheckpointConfig
    from moelab.train.checkpoint import Checkpointer
    from moelab.train.state import init_state

    restored = Checkpointer(out / "checkpoints", CheckpointConfig()).restore_newest(init_state(presets.get("tiny")))
    if restored is None or restored.step != steps:
        return [], []
    records = [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [np.asarray(x) for x in jax.tree.leaves(restored.state)], records


def _same(a, b) -> bool:
    return len(a[0]) == len(b[0]) > 0 and a[1] == b[1] and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a[0], b[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default prints it too)")
    args = parser.parse_args()
    if args.trials < 1 or args.steps < 8:
        parser.error("--trials must be >= 1 and --steps >= 8 (two checkpoints at least)")
    rng = random.Random(args.seed)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="moelab-fault-sweep-cache-")}

    with tempfile.TemporaryDirectory(prefix="moelab-fault-sweep-") as root:
        root = Path(root)
        subprocess.run(_command(root / "reference", args.steps), check=True, capture_output=True, env=env)
        reference = _fingerprint(root / "reference", args.steps)
        started = time.perf_counter()  # a second uninterrupted run, compiled from the cache like the trials
        subprocess.run(_command(root / "again", args.steps), check=True, capture_output=True, env=env)
        duration = time.perf_counter() - started  # the window the kill times are drawn from
        if not _same(reference, _fingerprint(root / "again", args.steps)):
            sys.exit("two uninterrupted runs differ: the run itself is not deterministic on this machine")
        trials = []
        for trial in range(args.trials):
            out, kill_after = root / f"trial-{trial}", rng.uniform(0.0, duration)
            proc = subprocess.Popen(_command(out, args.steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env=env)
            time.sleep(kill_after)
            proc.kill()
            proc.wait()
            killed = proc.returncode == -9
            reruns, resumed_from = 0, None
            while reruns < 3:
                reruns += 1
                done = subprocess.run(_command(out, args.steps), capture_output=True, text=True, env=env)
                if done.returncode == 0:
                    resumed_from = json.loads(done.stdout).get("resumed_from")
                    break
            trials.append({"trial": trial, "kill_after_s": round(kill_after, 3), "killed": killed,
                           "reruns": reruns, "resumed_from": resumed_from,
                           "bitwise_equal": _same(reference, _fingerprint(out, args.steps))})
            print(json.dumps(trials[-1]), file=sys.stderr)

    result = {"benchmark": "fault_sweep", "steps": args.steps, "trials": len(trials),
              "reference_run_s": round(duration, 2), "killed": sum(t["killed"] for t in trials),
              "bitwise_equal": sum(t["bitwise_equal"] for t in trials), "per_trial": trials}
    print(json.dumps(result))
    if result["bitwise_equal"] != len(trials):
        sys.exit(1)


if __name__ == "__main__":
    main()
