"""`moelab export`: a run's newest checkpoint as safetensors + config.json + tokenizer + README.

    moelab export runs/default --out exports/default --check     # Glm4MoeForCausalLM; compared with transformers
    moelab export runs/mixtral --out exports/mixtral             # loads in transformers as MixtralForCausalLM
    moelab export runs/default --out exports/bf16 --dtype bfloat16
    moelab export runs/tiny --out exports/tiny --force           # LatentMoE: moelab's own layout
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli.common import JsonOpt, err_console, out_console, print_problem
from moelab.cli.generate import RunArg, TokenizerOpt
from moelab.errors import ConfigError

__all__ = ["export"]


def export(
    run: RunArg,
    out: Annotated[Path, typer.Option(help="The folder to write (must not exist, unless --force).")],
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists (only once the new one is "
                                                         "complete).")] = False,
    max_shard_gb: Annotated[float, typer.Option(help="Split the weights into shards of at most this many GB "
                                                     "(with a model.safetensors.index.json).")] = 5.0,
    dtype: Annotated[str, typer.Option(help="The weights' dtype: float32 or bfloat16 (the router stays "
                                            "float32).")] = "float32",
    check: Annotated[bool, typer.Option("--check", help="Load the export with transformers and print the max "
                                                         "logits difference from moelab's dropless forward and whether "
                                                         "greedy generation matches; exit 1 past 1e-4.")] = False,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Export a run for other tools: a transformers class where one computes exactly moelab's function.

    Writes OUT/model.safetensors (or shards and an index), config.json, tokenizer.json and README.md, as the
    first transformers class that computes the model exactly (a run imported from one tries it first): a
    softmax-routed model without shared experts, latent, QK-norm or router bias as MixtralForCausalLM; a
    sigmoid-routed one (its balancing bias, shared experts) as Glm4MoeForCausalLM (DeepSeek-V3's MoE block with
    GQA attention); a softmax-routed one with per-head QK-norm as Qwen3MoeForCausalLM, with QK-norm over the
    projection as OlmoeForCausalLM. Any other (LatentMoE) keeps moelab's tree names plus router_bias (README.md
    says how to load it back; the summary names what rules out each class), and --check refuses it.
    """
    from moelab.export.writer import DTYPES, choose_layout, export_run, imported_class
    from moelab.train.weights import load_run

    if not max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb={max_shard_gb} is invalid: must be > 0, e.g. 5.")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not supported: use one of {', '.join(DTYPES)}.")
    if out.exists() and not force:  # before loading anything
        raise ConfigError(f"export target {out} already exists; pass --force to replace it, or another --out.")
    weights = load_run(run, tokenizer)
    layout, why = choose_layout(weights.cfg.model, weights.router_bias, imported_class(run))
    if check and layout == "moelab":
        raise ConfigError(f"--check compares the export with transformers, but no transformers class computes this "
                          f"model exactly: {why}. Export without --check for moelab's own layout (README.md in it "
                          "says how to load it back with moelab.export.writer.load_export).")
    result = export_run(weights, out, force=force, max_shard_bytes=int(max_shard_gb * 1e9), source=run, dtype=dtype)
    if check:
        from moelab.export.check import check_export

        err_console.print(f"[dim]checking {out} against transformers[/]", highlight=False)
        result["check"] = check_export(out, weights, dtype=dtype)
    if json_out:
        print(json.dumps(result))
    else:
        layout_text = (f"transformers {result['hf_class']}" if result["hf_class"]
                       else f"moelab's own layout ({result['why']})")
        err_console.print(f"[dim]{run} at step {weights.step}[/]", highlight=False)
        out_console.print(f"Exported to {out}: {layout_text}; {result['bytes'] / 1e6:,.1f} MB of {dtype} weights in "
                          f"{', '.join(result['files'])}.", highlight=False, soft_wrap=True)
        if check:
            c, g = result["check"], result["check"]["greedy"]
            held = "the run's weights" if dtype == "float32" else "the run's weights rounded to bfloat16"
            out_console.print(f"Check against transformers {c['hf_class']} (float32, {held}): max |logits "
                              f"difference| {c['max_abs_diff']:.2e} over {c['tokens'][0]}x{c['tokens'][1]} tokens "
                              f"(tolerance {c['tolerance']:g}; logits up to {c['max_abs_logit']:.3g}); greedy "
                              f"generation of {g['new_tokens']} tokens after {g['prompt']!r}: "
                              + ("the same." if g["same"] else f"differs (moelab {g['moelab']}, transformers "
                                                                f"{g['transformers']})."),
                              highlight=False, soft_wrap=True)
            if "bfloat16_inference" in c:
                b = c["bfloat16_inference"]
                out_console.print(f"transformers computing in bfloat16 vs the float32 run: largest logit difference "
                                  f"per position {b['median_abs_diff']:.3g} (median), {b['max_abs_diff']:.3g} (max: "
                                  f"a near-tied expert choice that rounding flips); the argmax agrees at "
                                  f"{b['argmax_agreement']:.1%} of positions.", highlight=False, soft_wrap=True)
    if check and not result["check"]["passed"]:
        print_problem("Check failed", f"the logits of {out} in transformers differ from moelab's by "
                      f"{result['check']['max_abs_diff']:.3g}, more than {result['check']['tolerance']:g}. The export "
                      "is not the run's function; report it with the run's config.yaml.")
        raise typer.Exit(1)
