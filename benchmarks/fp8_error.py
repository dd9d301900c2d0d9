"""Where FP8 loses precision: each parameter's gradient error, per layer, under variants of the recipe.

    python benchmarks/fp8_error.py --json                                   # tiny at init
    python benchmarks/fp8_error.py --from-run runs/tiny --json              # a trained run's weights
    python benchmarks/fp8_error.py --set model.d_model=256 --variant fp8 --variant "tiles 128" --json

One batch of the embedded corpus, one set of weights; the loss and every parameter's gradient in float32 are
the reference. Each variant computes them in bf16 with the FP8 GEMMs rounding as it says, and the result is
the relative error ||g - g_ref|| / ||g_ref|| per parameter (per layer for the stacked block weights), so a
table answers issue 61's questions: which GEMM (its weight's gradient), which operand (the variants that round
only weights, only activations, only output gradients) and which direction (forward operands against the
backward's gradients). Variants are copies of `fp8._quantize` (style: a variant, not a knob): the one that
wins is the one to make the recipe. "bf16" is the floor: the same computation with no FP8 at all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from moelab import presets
from moelab.config import parse_overrides
from moelab.data.mixture import build_corpus, sample_batch
from moelab.model import fp8, transformer
from moelab.model.moe import build_moe
from moelab.train.weights import load_run

_RECIPE = fp8._quantize  # the recipe as it stands: rows for activations and gradients, tensors for weights


def _unrounded(x, fmt, axis):
    """No rounding: x in float32 with a unit scale (what a GEMM outside FP8 reads)."""
    return x.astype(jnp.float32), jnp.ones((1,) * x.ndim, jnp.float32)


def _is_gradient(fmt) -> bool:
    return jnp.dtype(fmt) == jnp.dtype(fp8.E5M2)


def _is_weight(axis) -> bool:
    return axis != -1  # weights are scaled per tensor (None) or per expert ((1, 2)); rows over the last axis


def _only(keep):
    """The recipe on the operands `keep(fmt, axis)` selects; every other operand unrounded."""
    return lambda x, fmt, axis: _RECIPE(x, fmt, axis) if keep(fmt, axis) else _unrounded(x, fmt, axis)


def _e4m3_gradients(x, fmt, axis):
    """Gradients in e4m3 (3 mantissa bits, DeepSeek-V3's choice) instead of e5m2 (2 bits, more range)."""
    return _RECIPE(x, fp8.E4M3, axis)


def _power_of_two(x, fmt, axis):
    """Each scale rounded up to a power of two, so scaling and unscaling are exact (DeepSeek-V3, TE's MXFP8)."""
    top = fp8._MAX[jnp.dtype(fmt)]
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    scale = jax.lax.stop_gradient(jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax / top, jnp.finfo(jnp.float32).tiny)))))
    return jnp.clip(x32 / scale, -top, top).astype(fmt), scale


def _dequantized(x, fmt, axis):
    """x rounded by the recipe over `axis` and scaled back, in float32 (the recipe's own function, not the
    patched one: `fp8.quantize_dequantize` would call the variant again)."""
    q, scale = _RECIPE(x, fmt, axis)
    return q.astype(jnp.float32) * scale


def _tiles(size: int):
    """1 x `size` tiles along the last axis for activations and gradients, `size` x `size` blocks of the last two
    axes for weights (DeepSeek-V3's 1x128 and 128x128), each on its own scale. Returned dequantized with a unit
    scale: a scale that varies along the contracted axis cannot multiply the GEMM's output, so this is the
    numbers of a blockwise-scaled GEMM (DeepGEMM's), not the kernel."""
    def quantize(x, fmt, axis):
        x32 = x.astype(jnp.float32)
        if _is_weight(axis) and x.ndim >= 2:
            *lead, a, b = x.shape
            pa, pb = -a % size, -b % size
            padded = jnp.pad(x32, [(0, 0)] * len(lead) + [(0, pa), (0, pb)])
            blocks = padded.reshape(*lead, (a + pa) // size, size, (b + pb) // size, size)
            deq = _dequantized(blocks, fmt, (-3, -1)).reshape(padded.shape)
            return deq[..., :a, :b], jnp.ones((1,) * x.ndim, jnp.float32)
        if axis == -1:
            *lead, d = x.shape
            pad = -d % size
            padded = jnp.pad(x32, [(0, 0)] * len(lead) + [(0, pad)])
            deq = _dequantized(padded.reshape(*lead, (d + pad) // size, size), fmt, -1)
            return deq.reshape(padded.shape)[..., :d], jnp.ones((1,) * x.ndim, jnp.float32)
        return _RECIPE(x, fmt, axis)
    return quantize


VARIANTS = {
    "fp8": _RECIPE,
    "weights only": _only(lambda fmt, axis: _is_weight(axis) and not _is_gradient(fmt)),
    "activations only": _only(lambda fmt, axis: not _is_weight(axis) and not _is_gradient(fmt)),
    "gradients only": _only(lambda fmt, axis: _is_gradient(fmt)),
    "e4m3 gradients": _e4m3_gradients,
    "power-of-two scales": _power_of_two,
    "tiles 128": _tiles(128),
    "tiles 32": _tiles(32),
}


def batches(cfg, num_batches: int, batch_size: int) -> list[jax.Array]:
    """`num_batches` training batches of the embedded corpus (seed 0, steps 0..n-1), all domains alike."""
    corpus = build_corpus(cfg.data)
    weights = {d: 1.0 / len(corpus.domains) for d in corpus.domains}
    return [jnp.asarray(sample_batch(corpus, weights, 0, step, batch_size, cfg.model.seq_len).tokens)
            for step in range(num_batches)]


def _loss_and_grads(model, params, batches, bias, dtype) -> list:
    """(loss, grads) on each batch: one compile, reused."""
    dispatch = build_moe(model)
    step = jax.jit(jax.value_and_grad(
        lambda p, tokens: transformer.loss(p, tokens, model, bias, dtype, dispatch=dispatch)[0]))
    return [step(params, tokens) for tokens in batches]


def _errors(ref_grads, grads) -> dict[str, float]:
    """||g - g_ref|| / ||g_ref|| per parameter; stacked block weights (leading axis: the layer) per layer."""
    out = {}
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        pieces = enumerate(zip(ref, got)) if name.startswith("layers.") else [(None, (ref, got))]
        for layer, (r, g) in pieces:
            key = name if layer is None else f"{name}[{layer}]"
            out[key] = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
    return out


def measure(cfg, params, router_bias, batches: list[jax.Array], variants: list[str]) -> dict:
    """The loss and gradient errors of bf16 and of each FP8 variant against float32, averaged over `batches`.

    Averaged because one batch's figures are noisy: a rounding that flips a token's top-k experts moves its
    gradients by far more than the rounding itself, so two variants' single-batch errors differ by up to ~30%
    where their rounding errors differ by ~10% (`tiles 32` against rows at d 256)."""
    plain, rounded = dataclasses.replace(cfg.model, fp8=False), dataclasses.replace(cfg.model, fp8=True)
    reference = _loss_and_grads(plain, params, batches, router_bias, jnp.float32)
    rows = {}
    for name in ["bf16", *variants]:
        patch = contextlib.nullcontext() if name == "bf16" else mock.patch.object(fp8, "_quantize", VARIANTS[name])
        with patch:  # the variant is read while the step is traced
            got = _loss_and_grads(plain if name == "bf16" else rounded, params, batches, router_bias, jnp.bfloat16)
        per_batch = [_errors(ref[1], out[1]) for ref, out in zip(reference, got)]
        errors = {k: float(np.mean([e[k] for e in per_batch])) for k in per_batch[0]}
        rows[name] = {"loss_error": float(np.mean([out[0] / ref[0] - 1 for ref, out in zip(reference, got)])),
                      "mean_gradient_error": float(np.mean(list(errors.values()))), "gradient_error": errors}
    return {"loss_f32": float(np.mean([ref[0] for ref in reference])), "variants": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    parser.add_argument("--from-run", type=Path, default=None, help="a run folder: its newest checkpoint's weights "
                        "and config (default: the preset at init)")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), default=None,
                        help="a recipe variant (repeatable; default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4, help="batches the errors are averaged over")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1:
        parser.error("--batches and --batch-size must be at least 1")
    if args.from_run:
        run = load_run(args.from_run)
        cfg, params, bias, source = run.cfg, run.params, run.router_bias, f"{args.from_run} at step {run.step}"
    else:
        cfg = presets.resolve(args.preset, parse_overrides(args.set))
        params, bias = transformer.init(cfg.model, jax.random.key(0)), transformer.init_router_bias(cfg.model)
        source = f"{args.preset} at init"
    variants = args.variant or list(VARIANTS)
    result = {"benchmark": "fp8_error", "weights": source, "overrides": parse_overrides(args.set),
              "batches": args.batches, "batch_size": args.batch_size,
              **measure(cfg, params, bias, batches(cfg, args.batches, args.batch_size), variants)}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = result["variants"]
    names = list(rows["bf16"]["gradient_error"])
    print(f"{'gradient error':28s}" + "".join(f"{v[:12]:>13s}" for v in rows))
    for n in names:
        print(f"{n[:28]:28s}" + "".join(f"{rows[v]['gradient_error'][n]:13.3f}" for v in rows))
    print(f"{'mean':28s}" + "".join(f"{rows[v]['mean_gradient_error']:13.3f}" for v in rows))
    print(f"{'loss error':28s}" + "".join(f"{rows[v]['loss_error']:+13.1e}" for v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
