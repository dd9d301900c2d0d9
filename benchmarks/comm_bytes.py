"""All-to-all bytes per device per training step, read from the compiled HLO of the real train step.

    python benchmarks/comm_bytes.py --json                          # 2x4 mesh, 8 simulated CPU devices
    python benchmarks/comm_bytes.py --mesh replica=1,expert=8 --json

For LatentMoE on and off and for 1 and 3 waves, `make_train_step` is compiled (not run) on the mesh.
In the per-device (SPMD-partitioned) HLO we add up the result bytes of every all-to-all; an op inside
a while loop (the layer scan and its backward) counts once per iteration, by the loop's
`known_trip_count`. That is what each device sends: the buffer it hands the collective less the 1/X
that stays on the device. Each figure comes with the analytic count for comparison: per layer and wave,
four [X, P, Din] row exchanges (dispatch and return, and their transposes in the backward pass) and
one [X, P] int32 exchange of expert ids (forward only: ids carry no gradient).

The shapes are CPU-sized (d_model 512 -> latent 256, half width like the 6144 -> 3072 run); they are
chosen so that P = ceil(cf A / (X W)) has no rounding for W in {1, 3}, so the wave totals match
exactly. In general they agree to within W - 1 rows per pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

def _parse_mesh(spec: str) -> tuple[int, int]:
    fields = dict(part.split("=") for part in spec.split(","))
    return int(fields.get("replica", 1)), int(fields.get("expert", 1))


# XLA reads this once, when JAX starts: set it before the imports below (CPU only; GPUs ignore it).
if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _spec = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--mesh=")), None)
    _spec = _spec or (sys.argv[sys.argv.index("--mesh") + 1] if "--mesh" in sys.argv else "replica=2,expert=4")
    _n = _parse_mesh(_spec)[0] * _parse_mesh(_spec)[1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}".strip()

import jax  # noqa: E402

from moelab import presets  # noqa: E402
from moelab.config import MeshConfig, RunConfig, override  # noqa: E402
from moelab.model import exchange  # noqa: E402
from moelab.train import hlo  # noqa: E402


# ----------------------------------------------------------------------------------------------
# the configurations


def small_config() -> RunConfig:
    """The test-sized run: tiny's model (d_model 64 -> latent 32), 960 tokens per step."""
    return override(presets.get("tiny"), {"model.seq_len": 60, "train.batch_size": 16})


def default_config() -> RunConfig:
    """d_model 512 -> latent 256, 16 experts top-4, 3840 tokens per step: P = 552 (W=1) = 3 x 184 (W=3)."""
    return override(presets.get("tiny"), {
        "model.d_model": 512, "model.num_heads": 8, "model.num_kv_heads": 4, "model.seq_len": 240,
        "model.moe.num_experts": 16, "model.moe.num_experts_per_token": 4, "model.moe.expert_dim": 256,
        "model.moe.latent_dim": 256, "model.moe.shared_expert_dim": 256, "train.batch_size": 16,
    })


def _variant(cfg: RunConfig, mesh: MeshConfig, latent: bool, num_waves: int) -> RunConfig:
    moe = dataclasses.replace(cfg.model.moe, dispatch="ep", num_waves=num_waves,
                              latent_dim=(cfg.model.moe.latent_dim or cfg.model.d_model // 2) if latent else None)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe), mesh=mesh)


def expected_bytes(cfg: RunConfig) -> int:
    """The analytic count: L layers x W waves x (4 row exchanges of [X, P, Din] + 1 id exchange of [X, P]),
    less the 1/X of each that stays on the device."""
    m, moe = cfg.model, cfg.model.moe
    X = cfg.mesh.expert
    tokens_per_device = cfg.train.batch_size * m.seq_len // cfg.mesh.num_devices
    P = exchange.pool_size(tokens_per_device, moe.num_experts_per_token, X, moe.num_experts // X, moe.num_waves,
                           moe.resolved_transport_capacity_factor)
    row_bytes = 2 if cfg.train.compute_dtype == "bfloat16" else 4
    return m.num_layers * moe.num_waves * (4 * P * m.expert_input_dim * row_bytes + P * 4) * (X - 1)


def compiled_all_to_all_bytes(cfg: RunConfig) -> int:
    """Compiles one train step on cfg.mesh (abstract inputs; nothing runs) and counts its all-to-all bytes."""
    return hlo.collective_bytes(hlo.compile_step(cfg).as_text(), cfg.mesh.num_devices)["all-to-all"]


def measure(cfg: RunConfig, mesh: MeshConfig, waves: tuple[int, ...] = (1, 3)) -> dict:
    """Measured and expected all-to-all bytes per device per step, for latent on / off and each wave count."""
    figures: dict = {"mesh": {"replica": mesh.replica, "expert": mesh.expert}}
    for name, latent in (("latent", True), ("full_width", False)):
        figures[name] = {}
        for w in waves:
            variant = _variant(cfg, mesh, latent, w)
            figures[name][f"waves_{w}"] = {"expert_input_dim": variant.model.expert_input_dim,
                                           "all_to_all_bytes": compiled_all_to_all_bytes(variant),
                                           "expected_bytes": expected_bytes(variant)}
    first = f"waves_{waves[0]}"
    figures["latent_over_full_width"] = (figures["latent"][first]["all_to_all_bytes"]
                                         / figures["full_width"][first]["all_to_all_bytes"])
    if len(waves) > 1:
        figures["waves_3_over_waves_1"] = {name: figures[name][f"waves_{waves[-1]}"]["all_to_all_bytes"]
                                           / figures[name][first]["all_to_all_bytes"]
                                           for name in ("latent", "full_width")}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="replica=2,expert=4", help="e.g. replica=2,expert=4")
    parser.add_argument("--small", action="store_true", help="the test-sized model instead of d_model 512")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    replica, expert = _parse_mesh(args.mesh)
    cfg = small_config() if args.small else default_config()
    figures = {"backend": jax.default_backend(), "d_model": cfg.model.d_model,
               **measure(cfg, MeshConfig(replica=replica, expert=expert))}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"all-to-all bytes per device per step, mesh replica={replica} x expert={expert}:")
    for name in ("latent", "full_width"):
        for key, row in figures[name].items():
            print(f"  {name:10s} {key}: {row['all_to_all_bytes']:>12,d}  (expected {row['expected_bytes']:,d})")
    print(f"  latent / full width: {figures['latent_over_full_width']:.4f}")


if __name__ == "__main__":
    main()
