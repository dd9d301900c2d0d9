"""`moelab plan`: does a config's train step fit a device, and what does it move per step.

    moelab plan --preset frontier-535b --mesh replica=11,expert=64 --hbm 186GB
    moelab plan run.yaml --mesh expert=8 --hbm 141GB --microbatches 4 --json
    moelab plan --preset ladder-d1024 --mesh expert=8 --compile      # and XLA's own figures beside the plan

The counting is `moelab.train.memory_plan`'s; this module parses and prints.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from moelab.cli.common import ConfigArg, JsonOpt, PresetOpt, SetOpt, mesh_fields, out_console, resolve_config
from moelab.errors import ConfigError

__all__ = ["plan"]

GiB = 2**30


def plan(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    mesh: Annotated[Optional[str], typer.Option(
        help="Device mesh, e.g. replica=11,expert=64 (as in `moelab train`; default: the config's).")] = None,
    hbm: Annotated[Optional[str], typer.Option(help="Memory per device, e.g. 186GB, 141GB or 80GiB: gives the verdict.")] = None,
    microbatches: Annotated[Optional[int], typer.Option(help="Gradient accumulation slices (overrides train.microbatches).")] = None,
    platform: Annotated[str, typer.Option(
        help="gpu: attention runs as a fused kernel; cpu: its scores are materialized, as XLA on CPU compiles it.")] = "gpu",
    nvlink: Annotated[str, typer.Option(help="Bandwidth per device inside a rack, one way, per second.")] = "900GB",
    network: Annotated[str, typer.Option(help="Bandwidth per device between racks, one way, per second.")] = "50GB",
    compile_xla: Annotated[bool, typer.Option("--compile", help=(
        "Also compile the real train step on simulated CPU devices (one per mesh device; nothing allocated) "
        "and show XLA's per-device memory and collective bytes beside the plan."))] = False,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-device memory of a config's train step (parameters, gradients, optimizer state, activations,
    buffers), the verdict against --hbm, and the communication per step."""
    from moelab.train import memory_plan

    if platform not in ("gpu", "cpu"):
        raise ConfigError(f"--platform={platform!r} is invalid: must be gpu or cpu.")
    if microbatches is not None and microbatches < 1:
        raise ConfigError(f"--microbatches={microbatches} is invalid: must be an integer >= 1 (train.microbatches).")
    links = memory_plan.Links(nvlink=memory_plan.parse_bytes(nvlink.removesuffix("/s"), "--nvlink"),
                              network=memory_plan.parse_bytes(network.removesuffix("/s"), "--network"))
    limit = None if hbm is None else memory_plan.parse_bytes(hbm, "--hbm")
    cfg = resolve_config(config, preset, sets, **{"train.microbatches": microbatches, **mesh_fields(mesh, sets)})
    result = memory_plan.plan(cfg, limit, platform, links)
    compiled = memory_plan.compile_in_subprocess(cfg) if compile_xla else None
    if json_out:
        print(json.dumps({**result.as_json(), **({"xla": compiled} if compiled else {})}))
        return
    _print(result, compiled)


def _print(result, compiled: dict | None) -> None:
    mesh = result.mesh
    out_console.print(f"[bold]{result.name}[/bold] on replica={mesh['replica']} x expert={mesh['expert']}, "
                      f"shard={mesh['shard']}: {result.microbatches} microbatch(es) of {result.rows_per_microbatch} "
                      f"sequence(s) a device, attention as on {result.platform}")
    table = Table("per device", "GiB", "share")
    for term, size in result.terms.items():
        if size:
            table.add_row(term, f"{size / GiB:,.2f}", f"{size / result.total:.0%}")
    table.add_row("total", f"{result.total / GiB:,.2f}", f"{result.total / 1e9:,.1f} GB", style="bold")
    if compiled:
        table.add_row("XLA (compiled)", f"{compiled['total'] / GiB:,.2f}",
                      f"{result.total / compiled['total'] - 1:+.1%} plan vs XLA", style="dim")
    out_console.print(table)
    if result.hbm is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        out_console.print(f"[bold]{verdict}[/bold]: {result.total / 1e9:,.1f} GB of {result.hbm / 1e9:,.1f} GB "
                          f"({result.total / result.hbm:.0%}); the largest term is {result.largest}.")
        for tip in result.advice:
            out_console.print(f"  to reduce it: {tip}")
    comm = Table("per step, per device", "GB sent", "seconds", title="communication (counted from the layout)")
    for kind, size in result.comm.items():
        if size:
            comm.add_row(kind.replace("_", " "), f"{size / 1e9:,.1f}", f"{result.comm_seconds[kind]:,.2f}")
    if compiled:
        for kind, size in compiled["collectives"].items():
            if size:
                comm.add_row(f"{kind} (XLA)", f"{size / 1e9:,.1f}", "", style="dim")
    out_console.print(comm)
    out_console.print(f"links: {result.links.nvlink / 1e9:g} GB/s in a rack, {result.links.network / 1e9:g} GB/s between "
                      "racks, no overlap with compute assumed.")
