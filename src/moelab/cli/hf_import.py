"""`moelab import`: a Hugging Face Mixtral, Glm4Moe, Qwen3-MoE or OLMoE checkpoint as a moelab run directory.

    moelab import hf/my-mixtral --out runs/my-mixtral
    moelab import hf/my-mixtral --out runs/my-mixtral-ep --mesh expert=8     # born sharded over 8 devices
    moelab generate runs/my-mixtral --prompt "def "            # then like any run: generate, eval, plan, export

The reading and mapping are `moelab.export.hf_import`'s; this module parses and prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from moelab.cli.common import JsonOpt, mesh_fields, out_console

__all__ = ["import_cmd"]


def import_cmd(
    hf_dir: Annotated[Path, typer.Argument(metavar="HF_DIR", help="A Hugging Face model folder: config.json and "
                                                                   "*.safetensors (sharded or not), as save_pretrained "
                                                                   "writes them.")],
    out: Annotated[Path, typer.Option(help="The run directory to write (must not exist, unless --force).")],
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists (only once the import is "
                                                         "complete).")] = False,
    mesh: Annotated[Optional[str], typer.Option(help=(
        "The run's device mesh, e.g. replica=1,expert=8: each tensor goes straight into its shards there "
        "(experts over expert; expert > 1 selects the ep dispatch). Default: one device."))] = None,
    json_out: JsonOpt = False,
) -> None:
    """Import a published MoE checkpoint (Mixtral, Glm4Moe, Qwen3-MoE, OLMoE) as a moelab run.

    Writes OUT/config.yaml, OUT/checkpoints/0, imported.json and the checkpoint's tokenizer.json; `moelab train
    OUT/config.yaml --out OUT` continues from it. Dense first layers import as model.dense_layers; a value moelab
    does not model (a sliding window, dense layers elsewhere, a rope_scaling, ...) is refused naming the field.

    What the checkpoint does not say is moelab's default, to change with --set when training: model.seq_len is
    the model's max_position_embeddings up to 4096; model.moe.dispatch is capacity (factor 1.15: a token past an
    expert's capacity is dropped; dropless drops none); the train section is the tiny preset's (lr 0.003, 300
    steps, batch 16, 30 warmup steps).
    """
    from moelab.config import MeshConfig
    from moelab.export.hf_import import import_checkpoint

    fields = {k.removeprefix("mesh."): v for k, v in mesh_fields(mesh, None).items() if k.startswith("mesh.")}
    summary = import_checkpoint(hf_dir, out, force=force, mesh=MeshConfig(**fields) if fields else None)
    if json_out:
        print(json.dumps(summary))
        return
    left = summary["tensors_left_out"]
    out_console.print(f"Imported {hf_dir} ({summary['architecture']}: {summary['num_layers']} layers, d_model "
                      f"{summary['d_model']}, {summary['num_experts']} experts top-{summary['top_k']}, "
                      f"{summary['params']:,} parameters) into {out}; {summary['tensors_read']} tensors "
                      f"read" + (f", {len(left)} left out ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})"
                                 if left else "") + f"; tokenizer: {summary['tokenizer']}.",
                      highlight=False, soft_wrap=True)
