"""`moelab export`: a run's newest checkpoint as safetensors + config.json + tokenizer + README.

    moelab export runs/mixtral --out exports/mixtral          # loads in transformers as MixtralForCausalLM
    moelab export runs/tiny --out exports/tiny --force        # moelab's own layout (shared experts, latent)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli.common import JsonOpt, err_console, out_console
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
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Export a run for other tools: Mixtral layout where it matches exactly, moelab's own otherwise.

    Writes OUT/model.safetensors (or shards and an index), config.json, tokenizer.json and README.md. A
    Mixtral-style config (softmax router, no shared experts, no latent, no router bias in use) loads in
    transformers as MixtralForCausalLM; any other keeps moelab's tree names plus router_bias (README.md says
    how to load it back).
    """
    from moelab.export.writer import export_run
    from moelab.train.weights import load_run

    if not max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb={max_shard_gb} is invalid: must be > 0, e.g. 5.")
    if out.exists() and not force:  # before loading anything
        raise ConfigError(f"export target {out} already exists; pass --force to replace it, or another --out.")
    weights = load_run(run, tokenizer)
    result = export_run(weights, out, force=force, max_shard_bytes=int(max_shard_gb * 1e9), source=run)
    if json_out:
        print(json.dumps(result))
        return
    layout = ("Mixtral (transformers MixtralForCausalLM)" if result["layout"] == "mixtral"
              else f"moelab's own (not Mixtral: {result['why']})")
    err_console.print(f"[dim]{run} at step {weights.step}[/]", highlight=False)
    out_console.print(f"Exported to {out}: {layout}; {result['bytes'] / 1e6:,.1f} MB of float32 weights in "
                      f"{', '.join(result['files'])}.", highlight=False, soft_wrap=True)
