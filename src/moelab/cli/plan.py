"""`moelab plan`: does a config's train step fit a device, and what does it move per step.

    moelab plan --preset frontier-535b --mesh replica=11,expert=64 --hbm 186GB
    moelab plan run.yaml --mesh expert=8 --hbm 141GB --microbatches 4 --json
    moelab plan --preset ladder-d1024 --mesh expert=8 --compile      # and XLA's own figures beside the plan
    moelab plan --preset frontier-535b --mesh replica=11,expert=64 --device gb200 --mfu 0.4   # and how long it runs

The counting is `moelab.train.memory_plan`'s and `traffic`'s (`hlo`'s with --compile); this module parses and prints.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from moelab.cli.common import ConfigArg, JsonOpt, PresetOpt, SetOpt, mesh_fields, out_console, resolve_config
from moelab.errors import ConfigError

__all__ = ["plan", "print_plan_here"]

GB = 1e9  # one unit everywhere: --hbm sizes are read in GB as device sheets give them


def plan(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    mesh: Annotated[Optional[str], typer.Option(
        help="Device mesh, e.g. replica=11,expert=64 (as in `moelab train`; default: the config's).")] = None,
    hbm: Annotated[Optional[str], typer.Option(help="Memory per device, e.g. 186GB, 141GB or 80GiB: gives the verdict.")] = None,
    microbatches: Annotated[Optional[int], typer.Option(help="Gradient accumulation slices (overrides train.microbatches).")] = None,
    platform: Annotated[str, typer.Option(
        help="gpu: attention runs as a fused kernel; cpu: its scores are materialized, as XLA on CPU compiles it.")] = "gpu",
    device: Annotated[Optional[str], typer.Option(help=(
        "h100, h200 or gb200: its datasheet peak, HBM (the default --hbm) and links; gives the step time and "
        "the run's days."))] = None,
    mfu: Annotated[Optional[float], typer.Option(help=(
        "Model FLOPs utilization for the step time, in (0, 1] (default: the newest measured on --device)."))] = None,
    peak_flops: Annotated[Optional[float], typer.Option(help=(
        "Dense bf16 FLOP/s of one device, e.g. 989e12 (instead of --device's datasheet; needs --mfu)."))] = None,
    nvlink: Annotated[Optional[str], typer.Option(help=(
        "Bandwidth per device inside a rack, one way, per second (default: --device's, else 900GB).") )] = None,
    network: Annotated[Optional[str], typer.Option(help=(
        "Bandwidth per device between racks, one way, per second (default: 50GB).") )] = None,
    compile_xla: Annotated[bool, typer.Option("--compile", help=(
        "Also compile the real train step on simulated CPU devices (one per mesh device; nothing allocated) "
        "and show XLA's per-device memory and collective bytes beside the plan."))] = False,
    sets: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-device memory of a config's train step (parameters, gradients, optimizer state, activations,
    buffers), the verdict against --hbm, the communication per step and, on a --device, the step time and
    the run's days."""
    from moelab.train import hlo, memory_plan, run_length, traffic

    if platform not in ("gpu", "cpu"):
        raise ConfigError(f"--platform={platform!r} is invalid: must be gpu or cpu.")
    if microbatches is not None and microbatches < 1:
        raise ConfigError(f"--microbatches={microbatches} is invalid: must be an integer >= 1 (train.microbatches).")
    chip = run_length.device_named(device) if device is not None else None
    if mfu is not None:
        run_length.check_mfu(mfu)
    if peak_flops is not None:
        run_length.check_peak_flops(peak_flops)
    default = chip.links if chip else traffic.Links()  # the device's, else a GB200 rack's and 400 Gb/s InfiniBand
    links = traffic.Links(
        nvlink=memory_plan.parse_bytes(nvlink.removesuffix("/s"), "--nvlink") if nvlink else default.nvlink,
        network=memory_plan.parse_bytes(network.removesuffix("/s"), "--network") if network else default.network)
    limit = memory_plan.parse_bytes(hbm, "--hbm") if hbm is not None else (chip.hbm if chip else None)
    cfg = resolve_config(config, preset, sets, **{"train.microbatches": microbatches, **mesh_fields(mesh, sets)})
    timing, timed = None, chip is not None or peak_flops is not None
    if timed:  # what the step time needs, checked before the plan's tracing
        measured = run_length.MEASURED_MFU.get(device) if device else None
        if mfu is None and measured is None:
            raise ConfigError(f"--mfu is needed: no MFU has been measured on {device or 'a device given by --peak-flops'}; "
                              "give the fraction of the peak you expect, e.g. --mfu 0.35.")
        rate, source = (mfu, "given (--mfu)") if mfu is not None else measured
    result = memory_plan.plan(cfg, limit, platform, links, advise_too=True)
    if timed:
        timing = run_length.estimate(cfg, result, peak_flops or chip.peak_flops, rate, source)
        timing["device"] = chip.name if chip and peak_flops is None else f"{peak_flops:g} FLOP/s (--peak-flops)"
    compiled = hlo.compile_in_subprocess(cfg) if compile_xla else None
    if json_out:
        print(json.dumps({**result.as_json(), **({"xla": compiled} if compiled else {}),
                          **({"time": timing} if timing else {})}))
        return
    _print(result, compiled, timing)


def print_plan_here(cfg) -> None:
    """The plan of `cfg` on the devices this process sees (`moelab train --dry-run`): memory against the device's
    HBM and the step time at its newest measured MFU where `run_length` has its datasheet; memory alone elsewhere."""
    import jax

    from moelab.train import memory_plan, run_length, traffic

    name = run_length.device_of_kind(jax.devices()[0].device_kind)
    chip = run_length.DEVICES[name] if name else None
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    # Settings that lower the memory only where there is a limit to get under: on a CPU they are noise.
    result = memory_plan.plan(cfg, chip.hbm if chip else None, platform, chip.links if chip else traffic.Links(),
                              advise_too=chip is not None)
    timing = None
    if chip is not None and name in run_length.MEASURED_MFU:
        rate, source = run_length.MEASURED_MFU[name]
        timing = run_length.estimate(cfg, result, chip.peak_flops, rate, source)
        timing["device"] = chip.name
    _print(result, None, timing, f"No step time: no datasheet here for {jax.devices()[0].device_kind!r}; "
                                 "`moelab plan --device h200` (or --peak-flops and --mfu) gives one.")


def _print(result, compiled: dict | None, timing: dict | None,
           no_time: str = "step time and run length: add --device h100|h200|gb200 (or --peak-flops and --mfu).") -> None:
    from moelab.train.memory_plan import XLA_GPU_SLOP, XLA_MEM_FRACTION

    mesh = result.mesh
    out_console.print(f"[bold]{result.name}[/bold] on replica={mesh['replica']} x expert={mesh['expert']}, "
                      f"shard={mesh['shard']}: {result.microbatches} microbatch(es) of {result.rows_per_microbatch} "
                      f"sequence(s) a device, attention "
                      + ("fused, as XLA compiles it on a GPU" if result.platform == "gpu" else
                         "with its scores materialized, as XLA compiles it on a CPU"))
    table = Table("per device", "GB", "share")
    for term, size in result.terms.items():
        if size:
            table.add_row(term, f"{size / GB:,.2f}", f"{size / result.total:.0%}")
    table.add_row("total", f"{result.total / GB:,.2f}", "100%", style="bold")
    if compiled:
        table.add_row("XLA (compiled)", f"{compiled['total'] / GB:,.2f}",
                      f"{result.total / compiled['total'] - 1:+.1%} plan vs XLA", style="dim")
    out_console.print(table)
    if result.hbm is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        out_console.print(f"[bold]{verdict}[/bold]: {result.total / 1e9:,.1f} GB of {result.hbm / 1e9:,.1f} GB "
                          f"({result.total / result.hbm:.0%}); it peaks in the {result.phase}; the largest term is "
                          f"{result.largest}.")
        if result.compiler_recomputes:
            out_console.print(
                f"  [yellow]{'it fits in memory, but ' if result.fits else ''}XLA will recompute[/yellow]: the "
                "step's temporaries "
                f"({(result.total - result.state) / 1e9:,.1f} GB) exceed what XLA's GPU compiler allows them "
                f"({result.compiler_limit() / 1e9:,.1f} GB: {XLA_GPU_SLOP} x ({XLA_MEM_FRACTION} "
                "of HBM - the state)), so it rematerializes on "
                "its own, silently, at a cost in step time. Run it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95"
                + (" or take a setting below." if result.advice else "."))
    _print_advice(result)
    comm = Table("per step, per device", "GB sent", "seconds", title="communication (the collectives of the compiled step)")
    for kind, size in result.comm.items():
        if size:
            comm.add_row(kind.replace("_", " "), f"{size / 1e9:,.1f}", f"{result.comm_seconds[kind]:,.2f}")
    if compiled:
        for kind, size in compiled["collectives"].items():
            if size:
                comm.add_row(f"{kind} (XLA)", f"{size / 1e9:,.1f}", "", style="dim")
    if comm.row_count:
        out_console.print(comm)
        out_console.print(f"links: {result.links.nvlink / 1e9:g} GB/s in a rack, {result.links.network / 1e9:g} GB/s "
                          "between racks, one way.")
    else:  # no link carries anything: their speeds would only confuse
        out_console.print("communication: none (one device)")
    if timing is None:
        out_console.print(no_time)
        return
    if result.hbm is not None and not result.fits:
        out_console.print(f"  [yellow]as if it fit[/yellow]: it does not ({result.total / 1e9:,.1f} GB of "
                          f"{result.hbm / 1e9:,.1f} GB), so this step time is for a run that cannot start as "
                          "configured; " + ("take a setting above, " if result.advice else "")
                          + "more devices or more memory first.")
    parts = (f"compute {timing['compute_seconds']:,.2f} s + communication {timing['in_rack_seconds']:,.2f} s in the "
             f"rack and {timing['across_racks_seconds']:,.2f} s across racks: {timing['step_seconds']:,.2f} s a step "
             "without overlap" if comm.row_count else
             f"compute {timing['compute_seconds']:,.2f} s a step (one device: nothing to communicate)")
    out_console.print(
        f"[bold]time[/bold] on {timing['devices']} x {timing['device']} at MFU {timing['mfu']:.1%} ({timing['mfu_source']}): "
        f"{parts}. {timing['steps']:,} steps ({timing['tokens']:.3g} tokens): [bold]{_duration(timing['days'])}[/bold].")
    if comm.row_count:
        out_console.print("  " + _dominant(result, timing))
    if timing["step_seconds_overlapped"] < timing["step_seconds"]:
        out_console.print(f"  with the overlap a compiled schedule shows: {timing['step_seconds_overlapped']:,.2f} s a "
                          f"step, {_duration(timing['days_overlapped'])}.")
    if timing["all_to_all_hideable_seconds"]:
        out_console.print(f"  at most {timing['all_to_all_hideable_seconds']:,.2f} s of the all-to-all could hide behind "
                          "the expert GEMMs of the next wave: a bound no compiled schedule has shown yet "
                          "(docs/scaling-out.md, \"Overlap\").")


def _dominant(result, timing: dict) -> str:
    """What a step's time goes to, in words, and what to change: the largest term of compute, the collectives in
    the rack and those across racks."""
    terms = {"compute": timing["compute_seconds"], "in_rack": timing["in_rack_seconds"],
             "across": timing["across_racks_seconds"]}
    step = timing["step_seconds"]
    largest = max(terms, key=terms.get)
    share = f"{terms[largest] / step:.0%} of the step"
    if largest == "compute":
        return (f"Compute dominates ({share}): the step is as fast as the MFU allows; a faster kernel (a higher MFU) "
                "or more devices shortens it, communication would not.")
    kinds = {k: v for k, v in result.comm_seconds.items() if v and (k.endswith("across_racks") == (largest == "across"))}
    top = max(kinds, key=kinds.get).replace("_", " ") if kinds else "the collectives"
    if largest == "in_rack":
        return (f"Communication in the rack dominates ({share}; most of it the {top}): LatentMoE "
                "(model.moe.latent_dim: fewer bytes through the all-to-all) or faster links help "
                "(docs/scaling-out.md).")
    return (f"Communication across racks dominates ({share}; most of it the {top}): only the gradient crosses "
            "racks, once a step; train.grad_reduce_dtype=bfloat16 halves its bytes, and a larger batch (fewer "
            "steps for the tokens) or a faster network between racks shortens it (docs/scaling-out.md).")


def _print_advice(result) -> None:
    """Each setting that lowers the total on this mesh, as `moelab train` takes it, and what it alone gives."""
    if result.hbm is not None and result.total <= 0.9 * result.hbm:
        return
    if not result.advice:
        if result.hbm is not None and not result.fits:
            from moelab.train.run_length import DEVICES

            roomier = [f"{name} ({d.hbm / GB:,.0f} GB)" for name, d in DEVICES.items() if d.hbm >= result.total]
            out_console.print("  no single setting makes it fit on this mesh: more devices (mesh.expert, "
                              "mesh.replica), devices with more memory"
                              + (f" (it fits on {', '.join(roomier)}: --device)" if roomier else "")
                              + ", or a smaller batch.")
        return
    out_console.print("  settings that lower it on this mesh (each alone; add them to `moelab train` as is):")
    for tip in result.advice:
        verdict = "" if tip["fits"] is None else ", fits" if tip["fits"] else f", still over {result.hbm / GB:,.1f} GB"
        out_console.print(f"    --set {tip['set']}  -> {tip['total'] / GB:,.1f} GB{verdict} ({tip['why']})")


def _duration(days: float) -> str:
    return f"{days:,.1f} days" if days >= 1 else f"{days * 24:,.2f} hours"
