"""The routed MoE layer alone (router, dispatch, experts, combine), forward + backward in bf16, per backend.

    python benchmarks/moe_layer.py --json                        # 16384 tokens, d 2048, 64 experts top-8 of 1024
    python benchmarks/moe_layer.py --tokens 256 --d 64 --experts 8 --topk 2 --width 32 --json   # CPU-sized

No shared experts and no latent projection: `moelab.model.moe.apply` with only routed experts, float32
parameters cast to bf16 as in training. The gradient is taken with respect to the parameters and the
input. Useful throughput counts only the experts' matmuls a token needs:

    useful TFLOP/s = 6 x tokens x top-k x 3 x d x width / seconds

(forward + backward = 3 x forward; a SwiGLU expert is 3 matmuls of d x width). Drops under `capacity`
are not subtracted. `ep` is the expert-parallel backend on a 1x1 mesh. A backend that fails (out of
memory, say) reports `status` "error" and the others still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from moelab.config import MeshConfig, ModelConfig, MoEConfig
from moelab.model import moe
from moelab.parallel import ep
from moelab.parallel import mesh as mesh_lib

BACKENDS = ("capacity", "dropless", "ep")


def layer_config(d: int, experts: int, topk: int, width: int, backend: str, capacity_factor: float) -> ModelConfig:
    moe_cfg = MoEConfig(num_experts=experts, num_experts_per_token=topk, expert_dim=width,
                        capacity_factor=capacity_factor, dispatch=backend, balancing="none")
    return ModelConfig(d_model=d, num_heads=1, num_kv_heads=1, head_dim=2, num_layers=1, moe=moe_cfg)


def useful_flops(tokens: int, topk: int, d: int, width: int) -> int:
    """Forward + backward FLOPs of the routed experts' matmuls: 6 x T x k x 3 x d x width."""
    return 6 * tokens * topk * 3 * d * width


def time_backend(cfg: ModelConfig, tokens: int, iters: int, budget_s: float) -> dict:
    """Median seconds of one jitted forward + backward of the layer."""
    ep_dispatch = ep.make_dispatch(mesh_lib.make_mesh(MeshConfig()), cfg.moe) if cfg.moe.dispatch == "ep" else None
    k_p, k_x, k_c = jax.random.split(jax.random.key(0), 3)
    params = moe.init(cfg, k_p)
    x = jax.random.normal(k_x, (tokens, cfg.d_model), jnp.float32)
    cot = jax.random.normal(k_c, (tokens, cfg.d_model), jnp.float32)
    bias = jnp.zeros((cfg.moe.num_experts,), jnp.float32)

    def loss(params, x):
        y, stats = moe.apply(params, x, bias, cfg, jnp.bfloat16, ep_dispatch)
        return jnp.sum(y * cot), stats["dropped"] / stats["assignments"]

    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    start = time.perf_counter()
    out = jax.block_until_ready(fwd_bwd(params, x))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(fwd_bwd(params, x))
    one_s = time.perf_counter() - start
    iters = max(1, min(iters, int(budget_s / (3 * max(one_s, 1e-9)))))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fwd_bwd(params, x)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    (_, drop_fraction), _ = out
    return {"seconds": statistics.median(times), "iters": iters, "first_call_s": first_s,
            "drop_fraction": float(drop_fraction)}


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--capacity-factor", type=float, default=1.15)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--iters", type=int, default=10, help="calls per timed window (3 windows)")
    parser.add_argument("--budget-s", type=float, default=30.0, help="cap on each backend's timed seconds")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    flops = useful_flops(args.tokens, args.topk, args.d, args.width)
    result = {"benchmark": "moe_layer", "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "tokens": args.tokens, "d": args.d, "experts": args.experts, "topk": args.topk,
              "width": args.width, "capacity_factor": args.capacity_factor, "dtype": "bfloat16",
              "useful_flops": flops, "backends": {}}
    for backend in args.backends.split(","):
        try:
            cfg = layer_config(args.d, args.experts, args.topk, args.width, backend, args.capacity_factor)
            timing = time_backend(cfg, args.tokens, args.iters, args.budget_s)
            stats = jax.devices()[0].memory_stats()
            result["backends"][backend] = {**timing, "useful_tflops_per_s": flops / timing["seconds"] / 1e12,
                                           "peak_memory_bytes": stats.get("peak_bytes_in_use") if stats else None,
                                           "status": "ok"}
        except Exception as e:  # noqa: BLE001 - e.g. ragged_dot's fallback running out of memory on a GPU
            result["backends"][backend] = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        if args.out:  # after every backend, so a later one that hangs past a timeout loses only itself
            _write(args.out, {**result, "status": "running"})
    result["status"] = "ok" if all(r["status"] == "ok" for r in result["backends"].values()) else "error"
    if args.out:
        _write(args.out, result)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
