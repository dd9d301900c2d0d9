"""Bytes each device sends per train step, by link: inside the rack and across racks, compiled vs planned.

    python benchmarks/comm_links.py --json                      # meshes 2x4 and 2x8, each in its own process
    python benchmarks/comm_links.py --mesh replica=2,expert=4   # one mesh (needs that many devices)

The layout rule of a rack-scale run is that only the gradient crosses racks, once a step. For a frontier-shaped
model shrunk to CPU size (d_model 256, 2 layers, 16 experts top-8 of width 128, latent 128, 2 shared experts,
3 waves at four microbatches), the real train step (`make_train_step`) is compiled on simulated devices for
each layout and one and four microbatches, with and without remat, and every collective of its HLO is
classified by its replica groups (`hlo.collective_bytes_by_link`: a group holding devices of two racks
crosses the network). Beside each figure, what `moelab plan` counts (`traffic.communication`, as XLA on
CPU moves it); and the checks of issue 58: across racks, four microbatches send at most 1.1x one microbatch's
bytes and at most 2.2x one device's float32 gradient shard (parameters / devices in a rack x 4 bytes), and no
all-gather or all-to-all (the router scores' old route) crosses racks under `rack`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _parse_mesh(spec: str) -> tuple[int, int]:
    fields = dict(part.split("=") for part in spec.split(","))
    return int(fields.get("replica", 1)), int(fields.get("expert", 1))


# XLA reads this once, when JAX starts: set it before the imports below (CPU only; GPUs ignore it), replacing a count
# inherited from a parent (the test suite's 8).
if __name__ == "__main__" and "--mesh" in sys.argv:
    _r, _x = _parse_mesh(sys.argv[sys.argv.index("--mesh") + 1])
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--xla_force_host_platform_device_count={_r * _x}"])

import jax  # noqa: E402

from moelab import presets  # noqa: E402
from moelab.config import RunConfig, override  # noqa: E402
from moelab.train import hlo, traffic  # noqa: E402
from moelab.train.state import init_state  # noqa: E402

MESHES = ("replica=2,expert=4", "replica=2,expert=8")
LAYOUTS = ("rack", "full", "replicate", "optimizer")


def frontier_shaped(replica: int, expert: int, layout: str, microbatches: int, remat: str = "none") -> RunConfig:
    """The frontier's recipe (top-8 of many experts, latent half width, 2 shared, waves) at CPU size: 4 sequences of
    64 tokens a device, bfloat16 compute (moved as float32 by XLA on CPU)."""
    return override(presets.get("tiny"), {
        "model.d_model": 256, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2, "model.seq_len": 64,
        "model.remat": remat, "model.moe.num_experts": 16, "model.moe.num_experts_per_token": 8,
        "model.moe.expert_dim": 128, "model.moe.latent_dim": 128, "model.moe.num_shared_experts": 2,
        "model.moe.shared_expert_dim": 128, "model.moe.num_waves": 3 if microbatches > 1 else 1,
        "model.moe.dispatch": "ep", "mesh.replica": replica, "mesh.expert": expert, "mesh.shard": layout,
        "train.microbatches": microbatches, "train.batch_size": 4 * replica * expert, "train.compute_dtype": "bfloat16"})


def gradient_shard_bytes(cfg: RunConfig) -> float:
    """One device's float32 gradient shard: every parameter over the devices of a rack, 4 bytes each."""
    params = jax.eval_shape(lambda: init_state(cfg).params)
    return sum(leaf.size for leaf in jax.tree.leaves(params)) * 4 / cfg.mesh.expert


def measure(cfg: RunConfig) -> dict:
    """Compiled and planned bytes by link for one config, and what crosses racks by kind."""
    n, X = cfg.mesh.num_devices, cfg.mesh.expert
    compiled = hlo.collective_bytes_by_link(hlo.compile_step(cfg).as_text(), n, X)
    planned = traffic.communication(cfg, "cpu")
    row = {"layout": cfg.mesh.shard, "microbatches": cfg.train.microbatches, "remat": cfg.model.remat}
    for link in hlo.LINKS:
        got = sum(compiled[link].values())
        counted = sum(v for k, v in planned.items() if k.endswith(link))
        row[link] = {"compiled": got, "planned": counted, "planned_over_compiled": counted / got if got else None,
                     "compiled_by_kind": {k: v for k, v in compiled[link].items() if v}}
    row["across_racks_over_gradient_shard"] = row["across_racks"]["compiled"] / gradient_shard_bytes(cfg)
    return row


def run_mesh(spec: str) -> dict:
    replica, expert = _parse_mesh(spec)
    rows = [measure(frontier_shaped(replica, expert, layout, m, remat))
            for layout in LAYOUTS for m in (1, 4) for remat in ("none", "full")]
    across = {(r["layout"], r["microbatches"], r["remat"]): r["across_racks"]["compiled"] for r in rows}
    checks = {
        "across_4_over_1": {f"{layout}/{remat}": across[layout, 4, remat] / across[layout, 1, remat]
                            for layout in LAYOUTS for remat in ("none", "full")},
        "rack_crosses_only_all_reduce": all(set(r["across_racks"]["compiled_by_kind"]) <= {"all-reduce"}
                                            for r in rows if r["layout"] == "rack"),
        "worst_planned_over_compiled": max(abs(r[link]["planned_over_compiled"] - 1)
                                           for r in rows for link in hlo.LINKS
                                           if r[link]["planned_over_compiled"] is not None) + 1,
    }
    return {"mesh": {"replica": replica, "expert": expert}, "backend": jax.default_backend(), "rows": rows,
            "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", help="one mesh, e.g. replica=2,expert=4 (default: each of " + ", ".join(MESHES) + ")")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.mesh:
        result = run_mesh(args.mesh)
    else:  # each mesh needs its own device count, so its own process
        result = {"meshes": []}
        for spec in MESHES:
            done = subprocess.run([sys.executable, __file__, "--mesh", spec, "--json"], capture_output=True, text=True,
                                  check=True)
            result["meshes"].append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(result))
        return
    for mesh in result.get("meshes", [result]):
        print(f"mesh replica={mesh['mesh']['replica']} x expert={mesh['mesh']['expert']}  (MB a device a step: "
              "compiled / planned)")
        for r in mesh["rows"]:
            print(f"  {r['layout']:9s} M={r['microbatches']} remat={r['remat']:4s}  in rack "
                  f"{r['in_rack']['compiled'] / 1e6:8.2f} / {r['in_rack']['planned'] / 1e6:8.2f}   across racks "
                  f"{r['across_racks']['compiled'] / 1e6:6.2f} / {r['across_racks']['planned'] / 1e6:6.2f}   "
                  f"= {r['across_racks_over_gradient_shard']:.2f} gradient shards")
        print(f"  checks: {json.dumps(mesh['checks'])}")


if __name__ == "__main__":
    main()
