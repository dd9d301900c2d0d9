"""Training throughput of a preset on this machine's CPU (or whatever JAX's default device is).

    python benchmarks/train_cpu.py --json                 # tiny preset, 20 timed steps
    python benchmarks/train_cpu.py --preset tiny --steps 50

Compilation and the first steps are excluded: we time `--steps` steps after `--warmup` steps, with a
device sync only at the ends, and report the median of `--repeats` such windows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from moelab import accounting, presets
from moelab.data.mixture import phase_at, sample_batch
from moelab.train.loop import prepare_corpus
from moelab.train.step import make_train_step
from moelab.train.state import init_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    cfg = presets.get(args.preset)
    corpus = prepare_corpus(cfg)
    t, m = cfg.train, cfg.model
    _, phase = phase_at(cfg.data, 0, t.steps)
    batches = [jnp.asarray(sample_batch(corpus, phase.weights, t.seed, s, t.batch_size, m.seq_len).tokens)
               for s in range(args.steps)]
    state, step = init_state(cfg), make_train_step(cfg)
    for i in range(args.warmup):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)

    windows = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for b in batches:
            state, metrics = step(state, b)
        jax.block_until_ready(metrics)
        windows.append(time.perf_counter() - start)
    seconds = statistics.median(windows)
    tokens_per_s = args.steps * accounting.tokens_per_step(cfg) / seconds
    result = {
        "benchmark": "train_cpu",
        "preset": args.preset,
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "batch_size": t.batch_size,
        "seq_len": m.seq_len,
        "step_time_s": seconds / args.steps,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": accounting.flops_per_token(m) * tokens_per_s,
        "final_loss": float(metrics["loss"]),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
