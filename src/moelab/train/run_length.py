"""How long a run takes: its step time on a stated device, and its days for the config's token budget.

    device = run_length.DEVICES["h200"]
    estimate = run_length.estimate(cfg, memory_plan.plan(cfg, device.hbm, links=device.links), device.peak_flops, 0.319,
                                   "given")
    estimate["step_seconds"], estimate["days"]

The compute is the config's training FLOPs per step (`accounting.flops_per_token`) split over the mesh,
at an MFU: the user's, or the newest one measured on that device kind (`MEASURED_MFU`, from the lab's
GPU records). The communication is `traffic.communication`'s bytes at the device's link bandwidths
(inside a rack over NVLink, between racks over the network), each link at its own. The step is planned
without overlap (compute, then communication); the overlapped figure hides only what a compiled schedule
has been seen to overlap (`SHOWN_OVERLAP`: nothing yet), and beside it stands the most `ep`'s waves could
hide of the all-to-all, a bound, not a plan (docs/scaling-out.md, "Overlap").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moelab import accounting
from moelab.config import RunConfig
from moelab.errors import ConfigError
from moelab.train.traffic import Links

__all__ = ["Device", "DEVICES", "MEASURED_MFU", "SHOWN_OVERLAP", "device_named", "device_of_kind", "datasheet_peak_flops", "check_mfu",
           "check_peak_flops", "estimate"]

DAY = 86_400.0


@dataclass(frozen=True)
class Device:
    """One accelerator by its datasheet: dense bf16 FLOP/s, HBM bytes, and its links (`traffic.Links`)."""

    name: str
    peak_flops: float
    hbm: int
    links: Links


DEVICES = {
    # NVLink 4: 900 GB/s both ways per GPU; 80 GB HBM3; 400 Gb/s InfiniBand per GPU between nodes.
    "h100": Device("NVIDIA H100 SXM", 989e12, 80 * 10**9, Links(nvlink=450e9)),
    # The same GH100 chip with 141 GB of HBM3e.
    "h200": Device("NVIDIA H200 SXM", 989e12, 141 * 10**9, Links(nvlink=450e9)),
    # One Blackwell GPU of a GB200 NVL72 rack: NVLink 5 (1.8 TB/s both ways), 13.4 TB of HBM3e over 72 GPUs.
    "gb200": Device("NVIDIA GB200 (one B200 GPU of an NVL72 rack)", 2.5e15, 186 * 10**9, Links(nvlink=900e9)),
}

# The newest train-step MFU measured per device kind (of the datasheet peak), and its source. The H100 is
# the H200's chip with less memory, so it borrows the H200's figure; a GB200 has none yet (give --mfu).
MEASURED_MFU = {
    "h200": (0.319, "gpu-medium, capacity dispatch, on an H200 (benchmarks/results/h200-2026-12-04.json)"),
    "h100": (0.319, "measured on an H200, the same GH100 chip (benchmarks/results/h200-2026-12-04.json)"),
}


# The share of each collective's time a compiled schedule of the step has been seen to hide behind compute, keyed as
# `traffic.communication`. None yet: XLA on CPU emits every collective synchronously (no start / done pairs), and
# no GPU compile of the multi-device step has been read. A share measured on a GPU goes here, with its record.
SHOWN_OVERLAP: dict[str, float] = {}


# JAX's `device_kind` of each device in DEVICES, by a part of its name (an H100 PCIe is slower: not matched).
_KINDS = (("H200", "h200"), ("H100 80GB HBM3", "h100"), ("H100 SXM", "h100"), ("GB200", "gb200"))


def device_of_kind(device_kind: str) -> str | None:
    """The DEVICES key of a JAX `device_kind` ("NVIDIA H200" -> "h200"); None for a device with no datasheet here
    (a CPU, an H100 PCIe, an A100)."""
    return next((name for part, name in _KINDS if part in device_kind), None)


def datasheet_peak_flops(device_kind: str) -> float | None:
    """The dense bf16 FLOP/s of one device of this JAX `device_kind`, from DEVICES; None where unknown: the loop
    then shows no MFU rather than a guess."""
    name = device_of_kind(device_kind)
    return None if name is None else DEVICES[name].peak_flops


def device_named(name: str) -> Device:
    """`DEVICES[name]`; a ConfigError naming --device and the choices otherwise."""
    if name not in DEVICES:
        raise ConfigError(f"--device={name!r} is unknown: choose one of {', '.join(DEVICES)} "
                          "(or give --peak-flops and --hbm for another device).")
    return DEVICES[name]


def check_mfu(mfu: float) -> float:
    """An MFU in (0, 1]; a ConfigError naming --mfu otherwise."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu={mfu} is invalid: a fraction of the peak in (0, 1], e.g. 0.35.")
    return mfu


def check_peak_flops(peak_flops: float) -> float:
    """A positive FLOP/s figure; a ConfigError naming --peak-flops otherwise."""
    if not peak_flops > 0:
        raise ConfigError(f"--peak-flops={peak_flops} is invalid: a positive FLOP/s figure, e.g. 989e12.")
    return peak_flops


def estimate(cfg: RunConfig, plan: Any, peak_flops: float, mfu: float, mfu_source: str) -> dict[str, Any]:
    """Step time and run length of `cfg` on its mesh, one device `peak_flops` at `mfu`, moving `plan.comm`
    at `plan.links` (a `memory_plan.Plan`)."""
    check_peak_flops(peak_flops)
    check_mfu(mfu)
    flops_per_device = accounting.flops_per_token(cfg.model) * accounting.tokens_per_step(cfg) / cfg.mesh.num_devices
    compute = flops_per_device / (mfu * peak_flops)
    seconds = plan.comm_seconds
    communication = float(sum(seconds.values()))
    hidden = min(compute, sum(t * SHOWN_OVERLAP.get(k, 0.0) for k, t in seconds.items()))
    serial, overlapped = compute + communication, compute + communication - hidden
    # Wave w + 1's exchange is independent of wave w's expert GEMMs; within a wave the exchange, the GEMMs and the
    # return depend on each other. So at most (W - 1) / W of the all-to-all can hide, and only behind those GEMMs.
    W = cfg.model.moe.num_waves if cfg.model.moe.dispatch == "ep" else 1
    steps = cfg.train.steps
    return {
        "peak_flops": peak_flops, "mfu": mfu, "mfu_source": mfu_source,
        "devices": cfg.mesh.num_devices, "tokens": accounting.train_tokens(cfg), "steps": steps,
        "compute_seconds": compute, "communication_seconds": communication,
        "in_rack_seconds": sum(t for k, t in seconds.items() if k.endswith("in_rack")),
        "across_racks_seconds": sum(t for k, t in seconds.items() if k.endswith("across_racks")),
        "step_seconds": serial, "step_seconds_overlapped": overlapped,
        "all_to_all_hideable_seconds": seconds.get("all_to_all_in_rack", 0.0) * (W - 1) / W,
        "days": steps * serial / DAY, "days_overlapped": steps * overlapped / DAY,
    }
