"""Where the time goes: a jitted call traced with the JAX profiler, its device kernels summed by name.

    summary = profile_call(lambda: step(*args), calls=2)   # {"kernel_ms_per_call", "categories", "top", ...}

On a GPU the trace's device plane ("/device:GPU:0") holds one line per CUDA stream, each event a
kernel with its device time; we sum them per kernel name and per category (our Pallas `gmm`
kernels, matmuls, attention, sorting, row moves, collectives, other XLA fusions). Without a GPU the
host plane's XLA op events stand in (parallel CPU threads overlap there, so shares are rough): the
same code path, so CI tests the logic. No extra dependency: `jax.profiler.ProfileData` reads the
trace.
"""

from __future__ import annotations

import collections
import glob
import tempfile

# (category, substrings of the lower-cased kernel name), first match wins: `gmm` before matmuls
# (cuBLAS kernels are "...gemm..." or "nvjet..."), attention before matmuls (cuDNN's fused kernels).
# "gmm" counts only where it is not part of "wgmma" (Hopper's warp-group MMA, inside cuDNN's attention
# and cuBLAS's names): the 2026-12-04 H200 suite filed cuDNN's attention under the grouped GEMM.
CATEGORIES = (
    ("grouped GEMM (Pallas)", ("gmm",)),
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "dot", "matmul")),
    ("collectives", ("nccl", "all-to-all", "all_to_all", "allreduce", "all-reduce", "all-gather", "collective")),
    ("sort", ("sort", "radix", "cub::")),
    ("row moves", ("gather", "scatter", "dynamic-slice", "dynamic_slice", "dynamic-update", "dynamic_update")),
)
OTHER = "other XLA kernels"
# The categories in the order the suite's table shows them (CATEGORIES is in matching order).
LABELS = ("grouped GEMM (Pallas)", "matmul", "attention", "sort", "row moves", "collectives", OTHER)
TOP = 40  # kernels kept per run, by device time
NAME_CHARS = 120


def category(name: str) -> str:
    lowered = name.lower().replace("wgmma", "wg-mma")
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    return OTHER


def _kernel_events(planes) -> tuple[str, list[tuple[str, float]]]:
    """(plane name, [(kernel name, ns)]): the GPU's stream lines, else the host's XLA op events."""
    planes = list(planes)
    for plane in planes:
        if plane.name.startswith("/device:GPU"):
            lines = [line for line in plane.lines if line.name.startswith("Stream")]
            lines = lines or [line for line in plane.lines if line.name not in ("XLA Modules", "XLA Ops", "Steps")]
            return plane.name, [(e.name, e.duration_ns) for line in lines for e in line.events]
    for plane in planes:
        if plane.name == "/host:CPU":  # thread lines; skip Python and the runtime's own bookkeeping events
            return plane.name, [(e.name, e.duration_ns) for line in plane.lines if line.name != "python"
                                for e in line.events if "::" not in e.name and not e.name.startswith("end:")]
    return "", []


def summarize(planes, calls: int) -> dict:
    """Per-call device milliseconds by category and for the top kernels of a trace of `calls` calls."""
    plane, events = _kernel_events(planes)
    by_name, count = collections.Counter(), collections.Counter()
    for name, ns in events:
        by_name[name] += ns
        count[name] += 1
    total = sum(by_name.values())
    by_category = collections.Counter()
    for name, ns in by_name.items():
        by_category[category(name)] += ns

    def ms(ns: float) -> float:
        return ns / 1e6 / calls

    return {
        "plane": plane,
        "calls": calls,
        "kernel_ms_per_call": ms(total),
        "categories": {c: {"ms": ms(ns), "share": ns / total if total else 0.0} for c, ns in by_category.most_common()},
        "top": [{"name": name[:NAME_CHARS], "category": category(name), "ms": ms(ns),
                 "share": ns / total if total else 0.0, "launches_per_call": count[name] / calls}
                for name, ns in by_name.most_common(TOP)],
    }


def profile_call(call, calls: int = 2) -> dict:
    """Trace `calls` runs of `call()` (a compiled step, already warm; it threads its own state, e.g. a
    train step's donated buffers) and summarize the kernels they ran.

    A profiler that fails (no CUPTI access, say) gives {"error": ...}: the timing it accompanies stands.
    """
    try:
        return _traced_summary(call, calls)
    except Exception as e:  # noqa: BLE001 - the profile is an extra; it must not cost the measurement
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def _traced_summary(call, calls: int) -> dict:
    import jax  # here, not at the top: `suite_table.py` reads LABELS without starting JAX

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
        return summarize(jax.profiler.ProfileData.from_file(files[0]).planes, calls)
