"""`moelab plan` against the compiler: per-device memory of the real train step, planned and compiled.

    python benchmarks/plan_vs_xla.py --json              # tiny / 8, ladder-d1024 / 8, frontier-535b / 64
    python benchmarks/plan_vs_xla.py --case tiny --json

Each case's train step is lowered and compiled on abstract arrays on simulated CPU devices
(`--xla_force_host_platform_device_count`, in a child process; nothing is allocated or run) and XLA's
`memory_analysis()` gives the per-device total (arguments + outputs not aliased to them + temporaries).
The plan is counted for the same config with attention as CPU compiles it (scores materialized). The
frontier case is one of its 11 racks: 64 devices and the rack's 1,024 of the 11,264 sequences, the same
per-device work as the full run (no array of its state is split over the 11 racks: 11 divides no
dimension). Also printed: the bytes each device sends per step by kind of collective, counted by the plan
and read from the compiled HLO (group sizes from the replica groups, loops multiplied by their trip
counts), and their ratio per kind.
"""

from __future__ import annotations

import argparse
import json
import time

from moelab import presets
from moelab.config import override
from moelab.train import hlo, memory_plan

CASES = {
    "tiny": ("tiny", {"mesh.replica": 2, "mesh.expert": 4, "model.moe.dispatch": "ep"}),
    "ladder-d1024": ("ladder-d1024", {"mesh.expert": 8, "train.microbatches": 8}),
    "frontier-535b": ("frontier-535b", {"mesh.replica": 1, "train.batch_size": 1024}),
}


def measure(name: str) -> dict:
    preset, sets = CASES[name]
    cfg = override(presets.get(preset), sets)
    started = time.perf_counter()
    planned = memory_plan.plan(cfg, platform="cpu")
    plan_seconds = time.perf_counter() - started
    xla = hlo.compile_in_subprocess(cfg)
    return {"case": name, "devices": cfg.mesh.num_devices, "mesh": planned.mesh, "microbatches": cfg.train.microbatches,
            "rows_per_microbatch": planned.rows_per_microbatch, "plan_bytes": planned.total, "xla_bytes": xla["total"],
            "plan_vs_xla": round(planned.total / xla["total"] - 1, 4), "plan_terms": planned.terms,
            "xla_arguments": xla["arguments"], "xla_temporaries": xla["temporaries"],
            "compile_seconds": xla["compile_seconds"], "plan_seconds": round(plan_seconds, 1),
            "comm_bytes_counted": planned.comm, "comm_bytes_compiled": xla["collectives"],
            "comm_counted_vs_compiled": comm_ratios(planned.comm, xla["collectives"])}


def comm_ratios(counted: dict, compiled: dict) -> dict:
    """Counted / compiled bytes per kind of collective (the plan's keys summed per kind: in and across racks)."""
    ratios = {}
    for kind in ("all-to-all", "all-gather", "reduce-scatter", "all-reduce"):
        mine = sum(v for k, v in counted.items() if k.replace("_", "-").startswith(kind))
        if mine or compiled[kind]:
            ratios[kind] = round(mine / compiled[kind], 4) if compiled[kind] else None
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="one case (repeatable); default all")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [measure(name) for name in args.case or CASES]
    if args.json:
        print(json.dumps({"cases": rows}))
        return
    for row in rows:
        print(f"{row['case']:>14} on {row['devices']:>3} devices: plan {row['plan_bytes'] / 2**30:9.3f} GiB, "
              f"XLA {row['xla_bytes'] / 2**30:9.3f} GiB ({row['plan_vs_xla']:+.1%}), compiled in {row['compile_seconds']} s; "
              f"communication counted / compiled {row['comm_counted_vs_compiled']}")


if __name__ == "__main__":
    main()
