"""Early training of a MoE preset against its equal-FLOP dense twin, step by step from step 0 (issue 39).

    python benchmarks/early_training.py --preset gpu-small --seq-len 256 --batch-size 4 --steps 20 --json
    python benchmarks/early_training.py --preset gpu-small --data text --set model.embed_std=1.0
    python benchmarks/early_training.py --preset tiny --data random --steps 30 --out results.json

Both models see the same batches: `random` is two batches of uniform random tokens, alternated (what
the GPU suite times: it measures memorization, where the dense twin's wider MLP may simply win),
`text` the preset's own data mixture (the embedded corpus by default), a fresh batch each step. Per
step we record the loss, the fraction of routed assignments the capacity dropped, MaxVio per layer
(how far the busiest expert is above its fair share) and the learning rate. `--set FIELD=VALUE`
(repeatable, read as `moelab train --set` reads it) changes the MoE's config before its dense twin is
derived, so a fix is compared on the same footing; `--no-dense` skips the twin. A bad `--set` or preset
exits 2 before any work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from moelab import presets
from moelab.config import RunConfig, override, parse_overrides
from moelab.errors import ConfigError
from moelab.data.mixture import phase_at, sample_batch
from moelab.train.loop import prepare_corpus
from moelab.train.step import make_train_step
from moelab.train.state import init_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_layer import write_json  # noqa: E402


def configure(preset: str, seq_len: int | None, batch_size: int | None, sets: list[str]) -> RunConfig:
    """The preset at the asked sequence length and batch, float32 on CPU, with `--set` applied."""
    cfg = presets.get(preset)
    changes = {"train.compute_dtype": "float32" if jax.default_backend() == "cpu" else cfg.train.compute_dtype,
               "train.microbatches": 1}
    if seq_len is not None:
        changes["model.seq_len"] = seq_len
    if batch_size is not None:
        changes["train.batch_size"] = batch_size
    return override(cfg, changes | parse_overrides(sets))


def batches(cfg: RunConfig, data: str, steps: int) -> list[np.ndarray]:
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    if data == "random":
        rng = np.random.default_rng(0)
        pair = [rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32) for _ in range(2)]
        return [pair[s % 2] for s in range(steps)]
    corpus = prepare_corpus(cfg)
    _, phase = phase_at(cfg.data, 0, cfg.train.steps)
    return [sample_batch(corpus, phase.weights, cfg.train.seed, s, cfg.train.batch_size, cfg.model.seq_len).tokens
            for s in range(steps)]


def curve(cfg: RunConfig, tokens: list[np.ndarray]) -> dict:
    """Per-step loss, drop fraction (all, and per layer), MaxVio (max and mean over layers) and LR."""
    state, step = init_state(cfg), make_train_step(cfg)
    rows: dict[str, list] = {"loss": [], "drop_fraction": [], "maxvio_max": [], "maxvio_mean": [], "lr": [],
                             "drop_by_layer": []}
    start = time.perf_counter()
    for batch in tokens:
        state, metrics = step(state, batch)
        maxvio = np.asarray(metrics["router/maxvio_by_layer"]).reshape(-1)
        rows["loss"].append(float(metrics["loss"]))
        rows["drop_fraction"].append(float(metrics["drop_fraction"]))
        rows["maxvio_max"].append(float(maxvio.max()))
        rows["maxvio_mean"].append(float(maxvio.mean()))
        rows["lr"].append(float(metrics["lr"]))
        rows["drop_by_layer"].append([round(float(d), 4) for d in np.asarray(metrics["router/drop_fraction_by_layer"])])
    return {**rows, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu-small")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", choices=("random", "text"), default="random")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change the MoE's config")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense twin")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    try:
        cfg = configure(args.preset, args.seq_len, args.batch_size, args.set)
    except ConfigError as e:
        parser.error(str(e))
    tokens = batches(cfg, args.data, args.steps)
    result = {"benchmark": "early_training", "preset": args.preset, "data": args.data, "set": args.set,
              "seq_len": cfg.model.seq_len, "batch_size": cfg.train.batch_size, "steps": args.steps,
              "device": jax.devices()[0].device_kind, "moe": curve(cfg, tokens)}
    if not args.no_dense:
        result["dense"] = curve(presets.dense_counterpart(cfg, multiple=8), tokens)
    if args.out:
        write_json(Path(args.out), result)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("moe", "dense"):
            if name in result:
                r = result[name]
                print(f"{name:5s} loss " + " ".join(f"{v:.2f}" for v in r["loss"]))
                if name == "moe":
                    print("      drop " + " ".join(f"{v:.2f}" for v in r["drop_fraction"]))
                    print("    maxvio " + " ".join(f"{v:.1f}" for v in r["maxvio_max"]))


if __name__ == "__main__":
    main()
