"""The routed MoE layer alone (router, dispatch, experts, combine), forward + backward in bf16, per backend.

    python benchmarks/moe_layer.py --json                        # 16384 tokens, d 2048, 64 experts top-8 of 1024
    python benchmarks/moe_layer.py --tokens 256 --d 64 --experts 8 --topk 2 --width 32 --json   # CPU-sized

No shared experts and no latent projection: `moelab.model.moe.apply` with only routed experts, float32
parameters cast to bf16 as in training. The gradient is taken with respect to the parameters and the
input. Useful throughput counts only the experts' matmuls a token needs:

    useful TFLOP/s = 6 x tokens x top-k x 3 x d x width / seconds

(forward + backward = 3 x forward; a SwiGLU expert is 3 matmuls of d x width). Drops under `capacity`
are not subtracted. `ep` is the expert-parallel backend on a 1x1 mesh. A backend that fails (out of
memory, say) reports `status` "error" and the others still run. A backend named with "-fp8"
(`--backends capacity-fp8`) runs its expert GEMMs in FP8 (`model.fp8`, issue 53).

Where the time goes, without a profiler:
- `--grouped-variants`: `grouped` again with other Pallas tile sizes (`BMxBNxBKwWARPSsSTAGES`), reported
  as `grouped[...]`; the fastest is the one to make the default. Two suffixes undo one optimisation
  each, so the gap to the same tiles without it is what that optimisation buys: `-rows` launches row
  blocks fastest, which re-reads rows from DRAM once per column tile; `-unfused` gathers the
  expert-sorted rows into memory before the kernels instead of reading them from the tokens inside
  the gate and up kernels. Both variants are copies in `grouped_variants.py`, not library options.
- `--breakdown`: for `capacity` and `grouped`, the same layer timed in parts: the router alone, the
  whole backend at expert width 16 (sorting, index maps and row moves with next to no matmul work),
  and the expert matmuls alone on ready-made buffers; plus the ideal batched matmul (every expert
  exactly its fair share of rows, one cuBLAS batched GEMM per matmul), the ceiling for any
  sort-and-buffer layer on this device.
- `--profile`: each `--backends` run is also traced (two calls) and its device time summed per
  kernel and per category (`profile_summary.py`): the Pallas `gmm` kernels, matmuls, sorting, row
  moves, other XLA fusions.
- `--check`: before any timing, `grouped` (its compiled Triton kernels, on a GPU) against `capacity`
  with room for every row, output and gradients in bf16, as relative errors |a - b| / |b| (2-norms);
  bf16 operands land between 1e-3 and 1e-2, a wrong kernel at order 1. A speed is only worth
  reporting for a kernel that computes the right function.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from moelab.config import MeshConfig, ModelConfig, MoEConfig
from moelab.model import dispatch as dispatch_lib
from moelab.model import grouped_matmul, moe
from moelab.model.router import drop_fraction, route
from moelab.parallel import ep
from moelab.parallel import mesh as mesh_lib

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, however this file loads
import grouped_variants  # noqa: E402
from profile_summary import profile_call  # noqa: E402

BACKENDS = ("capacity", "grouped", "ep", "dropless")
# Tile sizes `--grouped-variants` tries by default on a GPU (the first is the library default there).
# Each fits an H100/H200's 227 KiB of shared memory in all three kernels: the largest per-stage
# footprint is dx's dy [bm, bn] + w [bk, bn] tile (bf16), times num_stages; 128x256x64 at 3 stages would
# need 288 KiB, so it runs with 2.
GROUPED_VARIANTS = ("128x128x64w4s3", "128x128x64w4s3-rows", "128x128x64w4s3-unfused", "128x256x64w8s2",
                    "64x128x64w4s3")
BREAKDOWN_BACKENDS = ("capacity", "grouped")
MOVES_WIDTH = 16  # expert width of the "moves" part: the smallest `grouped` accepts


def layer_config(d: int, experts: int, topk: int, width: int, backend: str, capacity_factor: float) -> ModelConfig:
    """The layer's model; `backend` with the suffix "-fp8" runs its expert GEMMs in FP8 (`model.fp8`)."""
    fp8 = backend.endswith("-fp8")
    moe_cfg = MoEConfig(num_experts=experts, num_experts_per_token=topk, expert_dim=width,
                        capacity_factor=capacity_factor, dispatch=backend.removesuffix("-fp8"), balancing="none")
    return ModelConfig(d_model=d, num_heads=1, num_kv_heads=1, head_dim=2, num_layers=1, moe=moe_cfg, fp8=fp8)


def useful_flops(tokens: int, topk: int, d: int, width: int) -> int:
    """Forward + backward FLOPs of the routed experts' matmuls: 6 x T x k x 3 x d x width."""
    return 6 * tokens * topk * 3 * d * width


def parse_variant(text: str) -> dict:
    """'128x256x64w8s3[-rows][-unfused]' -> `grouped_variants.grouped` keyword arguments: `tiles` (gmm's
    block_m/n/k, num_warps, num_stages, and rows_together) and `fuse_gather`."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(-rows)?(-unfused)?", text)
    if not match:
        raise SystemExit(f"--grouped-variants entry {text!r} is not BMxBNxBKwWARPSsSTAGES[-rows][-unfused], "
                         "e.g. 128x128x64w4s3")
    *sizes, rows_fastest, unfused = match.groups()
    tiles = dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), map(int, sizes)))
    return {"tiles": {**tiles, "rows_together": rows_fastest is None}, "fuse_gather": unfused is None}


def time_call(fn, args, iters: int, budget_s: float) -> dict:
    """Median seconds of `fn(*args)` (jitted) over 3 windows of up to `iters` calls, one sync per window."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    one_s = time.perf_counter() - start
    iters = max(1, min(iters, int(budget_s / (3 * max(one_s, 1e-9)))))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return {"seconds": statistics.median(times), "iters": iters, "first_call_s": first_s, "out": out}


def _inputs(cfg: ModelConfig, tokens: int):
    k_p, k_x, k_c = jax.random.split(jax.random.key(0), 3)
    params = moe.init(cfg, k_p)
    x = jax.random.normal(k_x, (tokens, cfg.d_model), jnp.float32)
    cot = jax.random.normal(k_c, (tokens, cfg.d_model), jnp.float32)
    return params, x, cot


def time_backend(cfg: ModelConfig, tokens: int, iters: int, budget_s: float, backend_fn=None,
                 profile: bool = False, on_timed=None) -> dict:
    """Median seconds of one jitted forward + backward of the layer; with `profile`, its kernels too
    (after `on_timed(timing)`, so a profile that never finishes cannot cost the timing).

    `backend_fn(h, routing, experts)`, if given, replaces the configured backend inside the block (`_Variant`:
    how `grouped` runs with other tiles); `ep` runs on a 1x1 mesh, per device as in the train step.
    """
    params, x, cot = _inputs(cfg, tokens)
    bias = jnp.zeros((cfg.moe.num_experts,), jnp.float32)
    if cfg.moe.dispatch == "ep":
        block = ep.moe_on_mesh(cfg, mesh_lib.make_mesh(MeshConfig()), compute_dtype=jnp.bfloat16)
    else:
        dispatch = moe.build_moe(cfg) if backend_fn is None else _Variant(cfg.moe.dispatch, fp8=cfg.fp8, fn=backend_fn)
        block = functools.partial(moe.apply, cfg=cfg, compute_dtype=jnp.bfloat16, dispatch=dispatch)

    def loss(params, x):
        y, stats = block(params, x, bias)
        return jnp.sum(y * cot), drop_fraction(stats["dropped"], stats["assignments"])

    layer = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    timing = time_call(layer, (params, x), iters, budget_s)
    (_, dropped), _ = timing.pop("out")
    timing["drop_fraction"] = float(dropped)
    if profile:
        if on_timed is not None:
            on_timed(dict(timing))
        timing["profile"] = profile_call(lambda: layer(params, x))
    return timing


# A kernel variant as the block's dispatch: `fn(h, routing, experts)` in place of the backend's function. Made with
# `make_dataclass` (a type, not an annotation string) because `load_benchmark` runs this file outside sys.modules.
_Variant = dataclasses.make_dataclass(
    "_Variant", [("fn", object, dataclasses.field(default=None))], bases=(moe.Dispatch,), frozen=True,
    namespace={"__call__": lambda self, h, routing, experts: self.fn(h, routing, experts)})


def _swiglu_buffers(buf, w_gate, w_up, w_down):
    """The `capacity` backend's expert matmuls on [E, C, d] buffers."""
    return dispatch_lib.swiglu_buffers(buf, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down})


def _swiglu_grouped(rows, w_gate, w_up, w_down, block_expert, group_offsets):
    """The `grouped` backend's expert matmuls on block-padded rows, with its default tiles."""
    experts = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return dispatch_lib.grouped_swiglu(rows, experts, block_expert, group_offsets)


def _time_matmuls(swiglu, rows_shape, cfg: ModelConfig, iters: int, budget_s: float, *extra) -> dict:
    """Forward + backward of `swiglu(rows, w_gate, w_up, w_down, *extra)` in bf16, gradients for all four."""
    params, _, _ = _inputs(cfg, 1)
    experts = [params[name].astype(jnp.bfloat16) for name in ("w_gate", "w_up", "w_down")]
    rows = jax.random.normal(jax.random.key(3), rows_shape, jnp.bfloat16)

    def loss(rows, *experts):
        return jnp.sum(swiglu(rows, *experts, *extra).astype(jnp.float32))

    timing = time_call(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), (rows, *experts), iters, budget_s)
    timing.pop("out")
    return timing


def breakdown(backend: str, args, flops: int) -> dict:
    """The layer's parts for `backend` (see the module docstring); each with seconds and useful TFLOP/s
    where matmul work is the point."""
    cfg = layer_config(args.d, args.experts, args.topk, args.width, backend, args.capacity_factor)
    params, x, cot = _inputs(cfg, args.tokens)
    bias = jnp.zeros((args.experts,), jnp.float32)

    def router_loss(w_router, x):
        return jnp.sum(route(x, w_router, bias, cfg.moe).weights)

    router = time_call(jax.jit(jax.grad(router_loss, argnums=(0, 1))), (params["w_router"], x), args.iters,
                       args.budget_s)
    router.pop("out")
    narrow = layer_config(args.d, args.experts, args.topk, MOVES_WIDTH, backend, args.capacity_factor)
    parts = {"router": router, f"backend_at_width_{MOVES_WIDTH}": time_backend(narrow, args.tokens, args.iters,
                                                                                args.budget_s)}
    A = args.tokens * args.topk
    if backend == "capacity":
        C = min(dispatch_lib.expert_capacity(A, args.experts, args.capacity_factor), args.tokens)
        parts["expert_matmuls"] = _time_matmuls(_swiglu_buffers, (args.experts, C, args.d), cfg, args.iters,
                                                args.budget_s)
    else:
        block_m = grouped_matmul.default_tiles(args.d, args.width, jax.default_backend() == "gpu")["block_m"]
        counts = jnp.full((args.experts,), A // args.experts, jnp.int32).at[0].add(A % args.experts)
        _, block_expert, group_offsets, M = grouped_matmul.padded_layout(counts, A, block_m)
        parts["expert_matmuls"] = _time_matmuls(_swiglu_grouped, (M, args.d), cfg, args.iters, args.budget_s,
                                                block_expert, group_offsets)
    parts["expert_matmuls"]["useful_tflops_per_s"] = flops / parts["expert_matmuls"]["seconds"] / 1e12
    return parts


def _ideal_batched_matmul(args, flops: int) -> dict:
    """Every expert exactly A / E rows: the matmuls a perfectly balanced, drop-free buffer layer runs."""
    cfg = layer_config(args.d, args.experts, args.topk, args.width, "capacity", 1.0)
    rows = -(-args.tokens * args.topk // args.experts)
    timing = _time_matmuls(_swiglu_buffers, (args.experts, rows, args.d), cfg, args.iters, args.budget_s)
    return {**timing, "useful_tflops_per_s": flops / timing["seconds"] / 1e12}


def check_grouped(args) -> dict:
    """Relative errors of `grouped` against drop-free `capacity`: output, input gradient, expert gradients."""
    results = {}
    for backend in ("grouped", "capacity"):
        # capacity_factor E / k gives C = T rows per expert: nothing can drop.
        cfg = layer_config(args.d, args.experts, args.topk, args.width, backend, args.experts / args.topk)
        params, x, cot = _inputs(cfg, args.tokens)
        bias = jnp.zeros((args.experts,), jnp.float32)

        def loss(params, x, cfg=cfg, cot=cot, bias=bias):
            y, _ = moe.apply(params, x, bias, cfg, jnp.bfloat16, dispatch=moe.build_moe(cfg))
            return jnp.sum(y * cot), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        results[backend] = {"out": y, "d_x": grads[1], **{f"d_{n}": grads[0][n] for n in ("w_gate", "w_up", "w_down")}}

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))

    errors = {name: rel(results["grouped"][name], results["capacity"][name]) for name in results["grouped"]}
    worst = max(errors.values(), key=lambda e: (math.isnan(e), e))  # a NaN is the worst, wherever it sits
    return {"relative_errors": errors, "max_relative_error": worst, "passed": bool(worst < 2e-2)}


def _peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def _guarded(fn) -> dict:
    """`fn()` with status "ok", or status "error" and the message (e.g. ragged_dot's fallback out of memory)."""
    try:
        return {**fn(), "status": "ok"}
    except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
        return {"status": "error", "error": f"{type(e).__name__}: {str(e)[:2000]}"}


def write_json(path: str | Path, result: dict) -> None:
    """Atomically (a temporary file, then a rename): a run killed mid-write leaves the previous version."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--capacity-factor", type=float, default=1.15)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--grouped-variants", default="",
                        help=f"comma-separated gmm tiles for extra `grouped` runs, or 'default' ({','.join(GROUPED_VARIANTS)})")
    parser.add_argument("--breakdown", action="store_true", help="also time the parts of capacity and grouped")
    parser.add_argument("--check", action="store_true", help="first check grouped against drop-free capacity")
    parser.add_argument("--profile", action="store_true",
                        help="also trace each --backends run and sum its device time per kernel (profile_summary.py)")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed window (3 windows)")
    parser.add_argument("--budget-s", type=float, default=30.0, help="cap on each timing's seconds")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--merge", action="store_true",
                        help="add to the results already in --out (same shape), so a suite can split the work")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    variants = GROUPED_VARIANTS if args.grouped_variants == "default" else [
        v for v in args.grouped_variants.split(",") if v]
    try:
        grouped_args = {v: parse_variant(v) for v in variants}  # fail on a typo before any work
    except SystemExit as e:
        parser.error(str(e))

    flops = useful_flops(args.tokens, args.topk, args.d, args.width)
    result = {"benchmark": "moe_layer", "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "tokens": args.tokens, "d": args.d, "experts": args.experts, "topk": args.topk,
              "width": args.width, "capacity_factor": args.capacity_factor, "dtype": "bfloat16",
              "useful_flops": flops, "backends": {}}

    prior = json.loads(Path(args.out).read_text()) if args.merge and args.out and Path(args.out).is_file() else {}
    if "backends" in prior:  # else nothing to add to: e.g. the suite's stub for a first part that timed out
        shape = ("tokens", "d", "experts", "topk", "width", "capacity_factor")
        if any(prior.get(k) != result[k] for k in shape):
            parser.error(f"--merge: {args.out} holds another shape ({', '.join(f'{k}={prior.get(k)}' for k in shape)})")
        result |= {k: prior[k] for k in ("backends", "check", "breakdown") if k in prior}

    def save(status: str) -> None:  # after every step, so a later one that hangs past a timeout loses only itself
        if args.out:
            write_json(args.out, {**result, "status": status})

    def timed_layer(backend: str, backend_fn=None) -> dict:
        cfg = layer_config(args.d, args.experts, args.topk, args.width, backend, args.capacity_factor)

        def figures(timing: dict) -> dict:
            return {**timing, "useful_tflops_per_s": flops / timing["seconds"] / 1e12,
                    "peak_memory_bytes": _peak_memory()}

        def on_timed(timing: dict) -> None:  # on disk before the profile, which a cap could kill
            result["backends"][backend] = {**figures(timing), "status": "ok",
                                           "profile": {"error": "killed before the profile finished"}}
            save("running")

        return figures(time_backend(cfg, args.tokens, args.iters, args.budget_s, backend_fn,
                                    profile=args.profile and backend_fn is None, on_timed=on_timed))

    if args.check:
        result["check"] = _guarded(functools.partial(check_grouped, args))
        save("running")
    for backend in filter(None, args.backends.split(",")):
        result["backends"][backend] = _guarded(functools.partial(timed_layer, backend))
        save("running")
    for name, kwargs in grouped_args.items():
        fn = functools.partial(grouped_variants.grouped, **kwargs)
        result["backends"][f"grouped[{name}]"] = _guarded(functools.partial(timed_layer, "grouped", fn))
        save("running")
    if args.breakdown:
        result.setdefault("breakdown", {})["ideal_batched_matmul"] = _guarded(
            functools.partial(_ideal_batched_matmul, args, flops))
        for backend in BREAKDOWN_BACKENDS:
            result["breakdown"][backend] = _guarded(lambda b=backend: {"parts": breakdown(b, args, flops)})
            save("running")
    runs = [*result["backends"].values(), *result.get("breakdown", {}).values()]
    checked = result.get("check", {"passed": True})
    result["status"] = "ok" if all(r["status"] == "ok" for r in runs) and checked.get("passed") else "error"
    save(result["status"])
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
