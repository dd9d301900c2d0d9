"""Renders a `gpu_suite.sh` output folder as Markdown tables.

    python benchmarks/suite_table.py OUTDIR

Reads OUTDIR/matmul.json, OUTDIR/moe_layer.json and every OUTDIR/mfu_*.json; a run that failed shows
its status instead of numbers. `EXPECTED_FILES` is the list of files a complete suite writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MOE_PRESETS = ("gpu-small", "gpu-medium")
MOE_BACKENDS = ("capacity", "grouped", "ep", "dropless")
MFU_RUNS = tuple((p, b) for p in MOE_PRESETS for b in MOE_BACKENDS) + tuple((f"{p}-dense", "dense") for p in MOE_PRESETS)
EXPECTED_FILES = ("matmul.json", "moe_layer.json", *(f"mfu_{p}_{b}.json" for p, b in MFU_RUNS))


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"status": "missing"}


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _breakdown(layer: dict) -> list[str]:
    """Where the layer's time goes: each part of `capacity` and `grouped` in ms and as a share of the layer."""
    parts_of = layer.get("breakdown")
    if not parts_of:
        return []
    ideal = parts_of.get("ideal_batched_matmul", {})
    lines = ["", "Where the layer's time goes (each part timed alone, as a share of the whole layer; the "
             "width-16 backend includes the router):", "",
             "| backend | part | ms | share | useful TFLOP/s |", "|---|---|---|---|---|"]
    if ideal.get("status") == "ok":
        lines.append(f"| - | ideal batched matmul (fair share, no drops) | {ideal['seconds'] * 1e3:.2f} | - | "
                     f"{ideal['useful_tflops_per_s']:.1f} |")
    for backend, entry in parts_of.items():
        if backend == "ideal_batched_matmul":
            continue
        if entry.get("status") != "ok":
            lines.append(f"| {backend} | - | - | - | {entry.get('status')}: {str(entry.get('error', ''))[:60]} |")
            continue
        whole = layer.get("backends", {}).get(backend, {}).get("seconds")
        for part, r in entry["parts"].items():
            share = _num(whole and r["seconds"] / whole, ".0%")
            lines.append(f"| {backend} | {part} | {r['seconds'] * 1e3:.2f} | {share} | "
                         f"{_num(r.get('useful_tflops_per_s'), '.1f')} |")
    return lines


def render(out: Path) -> str:
    lines = []
    mm = _load(out / "matmul.json")
    device = mm.get("device", "?")
    if mm.get("status") == "ok":
        lines.append(f"Device: {device}. bf16 matmul {mm['matmul_n']}^3: {mm['matmul_peak_flops'] / 1e12:.1f} TFLOP/s "
                     f"({mm['fraction_of_datasheet']:.1%} of the 989 TFLOP/s datasheet).")
    else:
        lines.append(f"matmul: {mm.get('status')}")
    layer = _load(out / "moe_layer.json")
    lines += ["", "MoE layer alone, bf16 forward + backward"
              + (f" ({layer['tokens']} tokens, d {layer['d']}, {layer['experts']} experts top-{layer['topk']} "
                 f"of {layer['width']}):" if "tokens" in layer else ":"),
              "", "| backend | ms | useful TFLOP/s | drop | peak GiB | status |", "|---|---|---|---|---|---|"]
    for name, r in layer.get("backends", {}).items():
        ok = r.get("status") == "ok"
        mem = r.get("peak_memory_bytes") if ok else None
        lines.append(f"| {name} | {_num(r.get('seconds') and r['seconds'] * 1e3, '.2f')} | "
                     f"{_num(r.get('useful_tflops_per_s'), '.1f')} | {_num(r.get('drop_fraction'), '.3f')} | "
                     f"{_num(mem and mem / 2**30, '.1f')} | {r.get('status')} |")
    if "backends" not in layer:
        lines.append(f"| - | - | - | - | - | {layer.get('status')} |")
    lines += _breakdown(layer)
    lines += ["", "Train step (median after warm-up):", "",
              "| preset | backend | batch x seq | step ms | tokens/s | MFU (989) | MFU (matmul) | peak GiB | attention "
              "| status |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p, b in MFU_RUNS:
        r = _load(out / f"mfu_{p}_{b}.json")
        if r.get("status") != "ok":
            lines.append(f"| {p} | {b} | - | - | - | - | - | - | - | {r.get('status')}: {str(r.get('error', ''))[:60]} |")
            continue
        mem = r.get("peak_memory_bytes")
        lines.append(f"| {p} | {b} | {r['batch_size']} x {r['seq_len']} | {r['step_time_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mfu_datasheet']:.1%} | {r['mfu_measured_peak']:.1%} | "
                     f"{_num(mem and mem / 2**30, '.1f')} | {r.get('attention', '-')} | ok{' (tiny)' if r.get('tiny') else ''} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/suite_table.py OUTDIR")
    print(render(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
