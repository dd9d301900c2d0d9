"""Train-step throughput and MFU of a preset with a chosen dispatch backend, on JAX's default device.

    python benchmarks/mfu.py --preset gpu-small --backend capacity --json
    python benchmarks/mfu.py --preset gpu-medium-dense --backend dense --json
    python benchmarks/mfu.py --matmul-only --json          # just the bf16 matmul peak
    python benchmarks/mfu.py --preset gpu-small --backend ep --tiny --json   # CPU-sized shapes, same logic

The real train step (`make_train_step` on a 1x1 mesh, state born sharded, donated buffers) runs on
random tokens. After `--warmup` steps we time `--windows` windows of `--steps` steps with a device
sync only at each window's end and report the median step time. Model FLOPs come from
`moelab.accounting`; MFU is given against the H100/H200 datasheet bf16 peak (989 TFLOP/s) and against a
bf16 matmul peak measured in the same process (8192^3 on a GPU, 1024^3 elsewhere). `ep` on one device is
the expert-parallel backend on a 1x1 mesh. A run that fails (out of memory, say) still prints one JSON
object, with `status` "error" and the message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moelab import accounting, presets
from moelab.config import MeshConfig, RunConfig
from moelab.errors import ConfigError
from moelab.model import transformer
from moelab.parallel import mesh as mesh_lib
from moelab.train import memory_plan
from moelab.train.state import compute_dtype, init_sharded_state
from moelab.train.step import make_train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file loads
from moe_layer import write_json  # noqa: E402  (atomic: a killed run leaves the previous file)
from profile_summary import profile_call  # noqa: E402

DATASHEET_PEAK = 989e12  # H100 / H200 SXM dense bf16, FLOP/s
BACKENDS = ("capacity", "grouped", "dropless", "ep", "dense")
FP8 = "-fp8"  # a backend name with this suffix runs it with model.fp8 (issue 53): "capacity-fp8"


def split_backend(name: str) -> tuple[str, bool]:
    """'capacity-fp8' -> ('capacity', True); 'capacity' -> ('capacity', False)."""
    return (name.removesuffix(FP8), True) if name.endswith(FP8) else (name, False)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def matmul_peak(n: int | None = None, repeats: int = 10) -> dict:
    """Measured bf16 matmul FLOP/s: the median over `repeats` of one n x n x n product (n: 8192 on GPU)."""
    n = n or (8192 if on_gpu() else 1024)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"n": n, "seconds": seconds, "flops_per_s": 2 * n**3 / seconds}


def shrink(cfg: RunConfig) -> RunConfig:
    """A CPU-sized copy of a MoE preset: same recipe (latent, shared, top-k / E ratio), tiny shapes."""
    m = cfg.model
    moe = replace(m.moe, num_experts=8, num_experts_per_token=2, expert_dim=32,
                  shared_expert_dim=None if m.moe.shared_expert_dim is None else 32,
                  latent_dim=None if m.moe.latent_dim is None else 32,
                  hist_bins=16 if m.moe.balancing == "hist" else m.moe.hist_bins)
    model = replace(m, vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
                    seq_len=32, moe=moe)
    return replace(cfg, model=model, train=replace(cfg.train, batch_size=4))


def resolve_config(preset: str, backend: str | None, tiny: bool, batch_size: int | None) -> RunConfig:
    """The preset (shrunk under `tiny`; dense counterparts shrink their MoE first), on `backend`."""
    if tiny and preset.endswith("-dense"):
        cfg = presets.dense_counterpart(shrink(presets.get(preset.removesuffix("-dense"))), multiple=8)
    else:
        cfg = presets.get(preset)
        cfg = shrink(cfg) if tiny else cfg
    is_dense = cfg.model.moe.dispatch == "dense"
    backend, fp8 = split_backend(backend or cfg.model.moe.dispatch)
    if is_dense != (backend == "dense") or backend not in BACKENDS:
        raise SystemExit(f"--backend {backend} does not fit preset {preset} (dense presets take --backend dense, "
                         f"MoE presets capacity, grouped, dropless or ep; any of them with {FP8} for model.fp8).")
    cfg = replace(cfg, model=replace(cfg.model, fp8=fp8, moe=replace(cfg.model.moe, dispatch=backend)),
                  mesh=MeshConfig(replica=1, expert=1))
    if batch_size is not None:
        cfg = replace(cfg, train=replace(cfg.train, batch_size=batch_size))
    return cfg


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def time_train_step(cfg: RunConfig, steps: int, warmup: int, windows: int, budget_s: float,
                    profile: bool = False, on_timed=None) -> dict:
    """Median seconds per step of the real train step, the steps per window actually timed, and the
    fraction of routed assignments dropped at every step run (`drop_fractions`, from the compiling one on).

    If the last warm-up step says `windows x steps` would take longer than `budget_s`, fewer steps
    are timed (at least one per window), so a slow backend still finishes. With `profile`, two more
    steps are traced and their device time summed per kernel (`profile_summary.py`); `on_timed(timing)`
    is called first, so a profile that never finishes cannot cost the timing.
    """
    mesh = mesh_lib.make_mesh(cfg.mesh)
    state = init_sharded_state(cfg, mesh)
    step = make_train_step(cfg, mesh)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    batches = [mesh_lib.place_batch(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), mesh)
               for _ in range(2)]
    drops = []  # every step's drop fraction, on device until a window's end

    compile_start = time.perf_counter()
    state, metrics = step(state, batches[0])
    drops.append(metrics["drop_fraction"])
    jax.block_until_ready(metrics)
    first_step_s = time.perf_counter() - compile_start
    step_s = first_step_s
    for i in range(warmup):
        start = time.perf_counter()
        state, metrics = step(state, batches[i % 2])
        drops.append(metrics["drop_fraction"])
        jax.block_until_ready(metrics)
        step_s = time.perf_counter() - start
    steps = max(1, min(steps, int(budget_s / max(windows * step_s, 1e-9))))
    per_step = []
    for _ in range(windows):
        start = time.perf_counter()
        for i in range(steps):
            state, metrics = step(state, batches[i % 2])
            drops.append(metrics["drop_fraction"])
        jax.block_until_ready(metrics)
        per_step.append((time.perf_counter() - start) / steps)
    drops = [float(d) for d in drops]
    timing = {"step_time_s": statistics.median(per_step), "window_step_times_s": per_step, "steps": steps,
              "first_step_s": first_step_s, "final_loss": float(metrics["loss"]),
              "drop_fraction": drops[-1], "drop_fraction_first": drops[0], "drop_fraction_mean": statistics.mean(drops),
              "drop_fractions": drops}
    if profile:
        if on_timed is not None:
            on_timed(dict(timing))

        def one_step():  # the state's buffers are donated: each step feeds the next
            nonlocal state
            state, step_metrics = step(state, batches[0])
            return step_metrics

        timing["profile"] = profile_call(one_step)
    return timing


def report(cfg: RunConfig, timing: dict, peak: dict) -> dict:
    """Throughput and MFU from a timing; every FLOP count comes from `moelab.accounting`."""
    m, t = cfg.model, cfg.train
    tokens_per_step = accounting.tokens_per_step(cfg)
    tokens_per_s = tokens_per_step / timing["step_time_s"]
    counts = accounting.count_params(m)
    return {
        **timing,
        "batch_size": t.batch_size,
        "seq_len": m.seq_len,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": accounting.flops_per_token(m),
        "model_flops_per_step": accounting.flops_per_token(m) * tokens_per_step,
        "model_flops_per_s": accounting.flops_per_token(m) * tokens_per_s,
        "total_params": counts.total,
        "active_params": counts.active,
        "mfu_datasheet": accounting.mfu(m, tokens_per_s, DATASHEET_PEAK),
        "mfu_measured_peak": accounting.mfu(m, tokens_per_s, peak["flops_per_s"]),
        "peak_memory_bytes": peak_memory_bytes(),
        # `moelab plan`'s per-device total for the same step, so every device run re-checks the planner (issue 49).
        "planned_memory_bytes": memory_plan.plan(cfg, platform="gpu" if on_gpu() else "cpu").total,
    }


@contextlib.contextmanager
def xla_attention():
    """Attention on XLA's path for the block's duration (the library picks cuDNN on a GPU)."""
    chosen = transformer._attention_implementation
    transformer._attention_implementation = lambda dtype: None
    try:
        yield
    finally:
        transformer._attention_implementation = chosen


def timed_with_attention(cfg: RunConfig, args: argparse.Namespace, on_timed=None) -> tuple[dict, dict]:
    """`time_train_step`, plus which attention ran: cuDNN's, or XLA's and why.

    cuDNN can decline when the step is traced (the model then warns and uses XLA's) or fail later,
    compiling; then the run is measured again on XLA's attention rather than lost.
    """
    wanted = transformer._attention_implementation(compute_dtype(cfg)) or "xla"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            timing = time_train_step(cfg, args.steps, args.warmup, args.windows, args.budget_s, args.profile,
                                     on_timed)
        except Exception as e:  # noqa: BLE001 - only a cuDNN failure is retried
            if wanted == "xla" or "cudnn" not in str(e).lower():
                raise
            with xla_attention():
                timing = time_train_step(cfg, args.steps, args.warmup, args.windows, args.budget_s, args.profile,
                                         on_timed)
            return timing, {"attention": "xla", "attention_note": f"cudnn failed: {type(e).__name__}: {str(e)[:500]}"}
    declined = [str(w.message) for w in caught if "attention declined" in str(w.message)]
    for w in caught:  # the rest were only caught along: let them through
        if "attention declined" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if declined:
        return timing, {"attention": "xla", "attention_note": declined[0][:500]}
    return timing, {"attention": wanted}


def result_path(out_dir: str, result: dict) -> Path:
    return Path(out_dir) / f"mfu_{result['preset']}_{result['backend']}.json"


def run_one(preset: str, backend: str | None, args: argparse.Namespace, peak: dict) -> dict:
    """One preset x backend as a JSON-ready dict; a failure becomes `status` "error" with the message.

    With --profile and --out-dir, the timed result is written before the profile runs, so a run
    killed while profiling (the suite's per-run cap) keeps its figures.
    """
    result = {"benchmark": "mfu", "preset": preset, "device": jax.devices()[0].device_kind,
              "platform": jax.default_backend(), "jax": jax.__version__, "datasheet_peak_flops": DATASHEET_PEAK,
              "matmul_n": peak["n"], "matmul_peak_flops": peak["flops_per_s"]}
    try:
        cfg = resolve_config(preset, backend, args.tiny, args.batch_size)
        result |= {"backend": cfg.model.moe.dispatch + (FP8 if cfg.model.fp8 else ""), "fp8": cfg.model.fp8,
                   "tiny": args.tiny, "remat": cfg.model.remat,
                   "compute_dtype": cfg.train.compute_dtype}

        def on_timed(timing: dict) -> None:
            if args.out_dir is not None:
                write_json(result_path(args.out_dir, result), {
                    **result, **report(cfg, timing, peak), "status": "ok",
                    "profile": {"error": "killed before the profile finished"}})

        timing, attention = timed_with_attention(cfg, args, on_timed)
        result |= attention | report(cfg, timing, peak)
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one failed run (OOM, a backend that cannot lower) must still report
        result |= {"backend": backend, "status": "error", "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu-small")
    parser.add_argument("--backend", choices=[*BACKENDS, *(b + FP8 for b in BACKENDS)], default=None,
                        help=f"default: the preset's own dispatch; with {FP8}, in FP8 (model.fp8)")
    parser.add_argument("--run", action="append", default=[], metavar="PRESET:BACKEND",
                        help="several runs in this one process (repeatable; needs --out-dir)")
    parser.add_argument("--out-dir", default=None, help="write mfu_PRESET_BACKEND.json per run here")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed window")
    parser.add_argument("--warmup", type=int, default=2, help="steps after the compiling one, untimed")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=60.0, help="cap on the timed part's seconds")
    parser.add_argument("--batch-size", type=int, default=None, help="override the preset's batch size")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes with the preset's recipe")
    parser.add_argument("--matmul-only", action="store_true", help="measure only the bf16 matmul peak")
    parser.add_argument("--profile", action="store_true",
                        help="also trace two steps and sum their device time per kernel (profile_summary.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = parser.parse_args()
    runs = [r.split(":") for r in args.run] or [[args.preset, args.backend]]
    if len(runs) > 1 and args.out_dir is None:
        parser.error("several --run need --out-dir")
    if args.out_dir is not None:  # a folder that does not exist yet is made; a file in its place is an error
        try:
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--out-dir {args.out_dir}: cannot make that folder ({e.strerror or e})")
    if not args.matmul_only:  # a typo exits 2 here, before the matmul peak or any run
        for preset, backend in runs:
            try:
                resolve_config(preset, backend or None, args.tiny, args.batch_size)
            except (SystemExit, ConfigError) as e:
                parser.error(str(e))

    peak = matmul_peak(256 if args.tiny else None)
    if args.matmul_only:
        results = [{"benchmark": "matmul", "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
                    "jax": jax.__version__, "datasheet_peak_flops": DATASHEET_PEAK, "matmul_n": peak["n"],
                    "matmul_seconds": peak["seconds"], "matmul_peak_flops": peak["flops_per_s"],
                    "fraction_of_datasheet": peak["flops_per_s"] / DATASHEET_PEAK, "status": "ok"}]
    else:
        results = (run_one(preset, backend or None, args, peak) for preset, backend in runs)
    for result in results:  # each run's file is written as it finishes: a process killed later keeps it
        if args.out_dir is not None:
            name = "matmul.json" if args.matmul_only else result_path("", result).name
            write_json(Path(args.out_dir) / name, result)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
