"""A run's weights as a folder other tools read: safetensors, config.json, tokenizer, README.

    export_run(load_run("runs/default"), "exports/default")        # Glm4Moe / Mixtral layout where it fits
    export_run(run, "exports/default-bf16", dtype="bfloat16")      # weights in bfloat16 (router float32)
    cfg, params, bias = load_export("exports/tiny-latent")         # moelab's own layout, back

Three layouts, picked by what the model is (`choose_layout`), the first that expresses it exactly:

- **Mixtral** (`transformers`' `MixtralForCausalLM`), when the architecture says exactly what moelab
  computes: softmax router with its top-k weights renormalized to sum to 1, no router bias in use
  (all zeros), no shared experts, no LatentMoE, no z-loss-free logit changes (z-loss only trains).
  Attention is GQA with the GPT-NeoX RoPE layout (rotate halves) in both; moelab's [in, out] matrices
  are transposed to torch's [out, in]; expert e's `w_gate`/`w_up`/`w_down` become
  `block_sparse_moe.experts.e.w1/w3/w2` (the checkpoint format Mixtral's own weights use, which every
  `transformers` version reads).
- **Glm4Moe** (`Glm4MoeForCausalLM`, DeepSeek-V3's MoE block with GQA attention), for moelab's default
  recipe: sigmoid router with its balancing bias as `e_score_correction_bias`, shared experts, any top-k,
  renormalized or not, any `routed_scaling`; no LatentMoE (`moelab.export.glm4_moe` says why that is the
  closest class and why a latent does not fold).
- **moelab** otherwise (LatentMoE; a softmax router with shared experts or a bias): the params tree
  flattened with `.` (`layers.w_q`, stacked [L, ...] as moelab holds them) plus `router_bias` [L, E],
  and config.json `{"format": "moelab", "model": {ModelConfig fields}}`; `load_export` reads it back.

Weights are float32, or bfloat16 with `dtype="bfloat16"` (the router's weights and bias stay float32: moelab
routes in float32, since a rounded score flips near-tied top-k choices). They go in `model.safetensors`, or
above `max_shard_bytes` in `model-0000i-of-0000n.safetensors` shards with `model.safetensors.index.json`
(the Hugging Face index). The folder is written under a temporary name beside the target and renamed into
place when complete, so a failed or interrupted export never leaves a half-written folder; an existing
target is refused unless `force`. `moelab.export.check` compares an export with transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig, from_dict, to_dict
from moelab.errors import ConfigError, DataError
from moelab.export.glm4_moe import glm4_moe_config, glm4_moe_mismatch, glm4_moe_tensors
from moelab.export.llama import as_dtype, decoder_config, decoder_tensors
from moelab.export.softmax_moe import (olmoe_config, olmoe_mismatch, qwen3_moe_config, qwen3_moe_mismatch,
                                       softmax_moe_tensors)

__all__ = ["mixtral_mismatch", "mixtral_tensors", "mixtral_config", "moelab_tensors", "choose_layout", "export_run",
           "load_export", "imported_class", "byte_tokenizer_json", "MAX_SHARD_BYTES", "WEIGHTS", "INDEX", "DTYPES", "HF_CLASSES"]

MAX_SHARD_BYTES = 5 * 2**30  # the Hugging Face default shard size
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
# layout -> transformers class, in the order `choose_layout` tries them
HF_CLASSES = {"mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "olmoe": "OlmoeForCausalLM"}


def mixtral_mismatch(cfg: ModelConfig, router_bias: Any) -> str | None:
    """Why Mixtral cannot express this model exactly (naming the option), or None when it can."""
    m = cfg.moe
    if m.router_score != "softmax":
        return f"model.moe.router_score={m.router_score!r} (Mixtral scores with softmax)"
    if not m.normalize_weights or m.routed_scaling != 1.0:
        return ("model.moe.normalize_weights / routed_scaling: Mixtral's combine weights are the chosen softmax "
                "scores renormalized to 1")
    if m.num_shared_experts:
        return f"model.moe.num_shared_experts={m.num_shared_experts} (Mixtral has none)"
    if m.latent_dim is not None:
        return f"model.moe.latent_dim={m.latent_dim} (Mixtral's experts run at d_model)"
    if cfg.qk_norm is not None:
        return f"model.qk_norm={cfg.qk_norm!r} (Mixtral's attention has no QK-norm)"
    if cfg.attention_bias:
        return "model.attention_bias=true (Mixtral's projections have no bias)"
    if m.num_groups > 1:
        return f"model.moe.num_groups={m.num_groups} (Mixtral's router has no groups)"
    if cfg.dense_layers:
        return f"model.dense_layers={cfg.dense_layers} (every Mixtral block is a MoE block)"
    if cfg.rope_fraction != 1.0:
        return f"model.rope_fraction={cfg.rope_fraction} (Mixtral rotates every dimension of a head)"
    if np.any(np.asarray(router_bias) != 0):
        return "the router selects with a balancing bias (model.moe.balancing); Mixtral's has none"
    return None


def choose_layout(cfg: ModelConfig, router_bias: Any, prefer: str | None = None) -> tuple[str, str | None]:
    """The layout that expresses this model exactly, `prefer` first (the class a run was imported from): (a key of
    HF_CLASSES, None), else ("moelab", why not each, naming the field that rules it out)."""
    mismatches = {"mixtral": lambda: mixtral_mismatch(cfg, router_bias), "glm4_moe": lambda: glm4_moe_mismatch(cfg),
                  "qwen3_moe": lambda: qwen3_moe_mismatch(cfg, router_bias),
                  "olmoe": lambda: olmoe_mismatch(cfg, router_bias)}
    order = sorted(mismatches, key=lambda layout: HF_CLASSES[layout] != prefer)  # stable: the rest keep theirs
    why = {}
    for layout in order:
        why[layout] = mismatches[layout]()
        if why[layout] is None:
            return layout, None
    return "moelab", "; ".join(f"not {HF_CLASSES[layout]}: {why[layout]}" for layout in HF_CLASSES)


def mixtral_tensors(params: dict, dtype: np.dtype = DTYPES["float32"]) -> dict[str, np.ndarray]:
    """moelab params as a Mixtral checkpoint's tensors (torch [out, in] layout) in `dtype`, the router float32."""
    layers = params["layers"]
    tensors = decoder_tensors(params, dtype)  # no dense blocks: `mixtral_mismatch` refuses them
    for i in range(layers["w_q"].shape[0]):
        p = f"model.layers.{i}."
        tensors[p + "block_sparse_moe.gate.weight"] = as_dtype(layers["w_router"][i], np.float32).T
        for e in range(layers["w_gate"].shape[1]):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": as_dtype(layers["w_gate"][i, e], dtype).T,
                            q + "w3.weight": as_dtype(layers["w_up"][i, e], dtype).T,
                            q + "w2.weight": as_dtype(layers["w_down"][i, e], dtype).T})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def mixtral_config(cfg: ModelConfig, eos_id: int, dtype: str = "float32") -> dict:
    """config.json for `MixtralForCausalLM` (keys of transformers 4.x and 5.x both)."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **decoder_config(cfg, eos_id, dtype),
        "intermediate_size": cfg.moe.expert_dim, "head_dim": cfg.resolved_head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "num_local_experts": cfg.moe.num_experts, "sliding_window": None, "router_jitter_noise": 0.0,
    }


def moelab_tensors(params: dict, router_bias: Any, dtype: np.dtype = DTYPES["float32"]) -> dict[str, np.ndarray]:
    """moelab params flattened with '.' (stacked layers as they are) in `dtype` plus `router_bias` [L, E]; the
    router's weight and bias float32."""
    flat = {"router_bias": as_dtype(router_bias, np.float32)}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = as_dtype(node, np.float32 if prefix.endswith("w_router") else dtype)

    walk("", params)
    return flat


def _write_weights(tensors: dict[str, np.ndarray], folder: Path, max_shard_bytes: int, metadata: dict) -> list[str]:
    """One safetensors file, or shards of at most `max_shard_bytes` (a bigger tensor gets one to itself) plus the
    index; returns the file names."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS), metadata=metadata)
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata=metadata)
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    return [*names, INDEX]


def byte_tokenizer_json() -> str:
    """moelab's byte tokenizer (ids 0..255 = bytes, 256 = `<eos>`) as a Hugging Face tokenizer.json: a byte-level
    BPE without merges whose vocabulary puts each byte at its own value, so ids are the same in both."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _gpt2_byte_table()
    vocab = {table[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer.to_str()


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map (`bytes_to_unicode`), which byte-level BPEs use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _readme(cfg: ModelConfig, layout: str, why: str | None, step: int, run_name: str, files: list[str],
            dtype: str) -> str:
    m = cfg.moe
    dense = f" (the first {cfg.dense_layers} dense, SwiGLU width {cfg.resolved_dense_ffn_dim})" if cfg.dense_layers else ""
    shape = (f"{cfg.num_layers} layers{dense}, d_model {cfg.d_model}, {cfg.num_heads} heads ({cfg.num_kv_heads} KV, head "
             f"dim {cfg.resolved_head_dim}), RoPE theta {cfg.rope_theta:g}, context {cfg.seq_len}, vocab {cfg.vocab_size}; "
             f"{m.num_experts} routed experts top-{m.num_experts_per_token} of width {m.expert_dim}, {m.router_score} "
             f"router" + (f", {m.num_shared_experts} shared expert(s) of width {m.resolved_shared_expert_dim}" if m.num_shared_experts
                          else "") + (f", LatentMoE at width {m.latent_dim}" if m.latent_dim is not None else ""))
    if layout in HF_CLASSES:
        use = (f"Loads in Hugging Face `transformers` as `{HF_CLASSES[layout]}`, the same function as moelab's "
               "(dropless: every token reaches all of its experts):\n\n```python\nfrom transformers import "
               "AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n```\n")
        if layout == "glm4_moe":
            use += ("\nThe router's balancing bias is `mlp.gate.e_score_correction_bias`: added to the sigmoid scores "
                    "to pick experts, never to weight them.\n")
    else:
        use = (f"moelab's own layout ({why}). The tensors are moelab's params "
               "flattened with `.` (per-layer arrays stacked along a leading layer axis, matrices [in, out]) and "
               "`router_bias` [layers, experts], the balancing bias the router adds to its scores to pick experts "
               "(never to weight them). Load it back with:\n\n```python\nfrom moelab.export.writer import "
               "load_export\ncfg, params, router_bias = load_export(\"THIS_FOLDER\")\n```\n\nand run "
               "`moelab.model.transformer.apply(params, tokens, cfg, router_bias, "
               "dispatch=moelab.model.moe.build_moe(cfg, purpose=\"decode\"))`.\n")
    return (f"# {run_name}\n\nA moelab Mixture-of-Experts model exported from the run `{run_name}` at step {step}.\n\n"
            f"Architecture: {shape}. Pre-norm blocks (RMSNorm), SwiGLU experts, untied embedding and head. Weights "
            f"in {dtype}" + (" (the router's float32)" if dtype != "float32" else "") + ".\n\n"
            f"{use}\nFiles: {', '.join(files)}, config.json, tokenizer.json.\n")


def imported_class(run_dir: str | Path) -> str | None:
    """The transformers class a run was imported from (its `imported.json`), None for a run trained from scratch
    or a folder that is not a run."""
    path = Path(run_dir) / "imported.json"
    try:
        return json.loads(path.read_text()).get("architecture")
    except (OSError, ValueError, AttributeError):
        return None


def export_run(run: Any, out: str | Path, *, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
               source: str | Path = "a moelab run", dtype: str = "float32") -> dict:
    """Write `run` (a `moelab.train.weights.RunWeights`) to the folder `out`; returns what was written.

    `source` is the run's folder; the README names it by its last part only (a shared export must not carry
    the building machine's paths). `dtype` is "float32" or "bfloat16".

    Returns:
        {"out", "layout" (a key of HF_CLASSES, or "moelab"), "hf_class" (None for moelab), "why" (why not a
        transformers class; None for those), "dtype", "files", "bytes"}.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is not supported: use one of {', '.join(DTYPES)}.")
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"export target {out} already exists; pass --force to replace it, or another --out.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} is a file; give a folder path as --out.")
    cfg = run.cfg.model
    layout, why = choose_layout(cfg, run.router_bias, imported_class(source))
    eos_id, np_dtype = run.tokenizer.eos_id, DTYPES[dtype]
    if layout == "mixtral":
        tensors, config = mixtral_tensors(run.params, np_dtype), mixtral_config(cfg, eos_id, dtype)
    elif layout == "glm4_moe":
        tensors = glm4_moe_tensors(run.params, np.asarray(run.router_bias), cfg, np_dtype)
        config = glm4_moe_config(cfg, eos_id, dtype)
    elif layout in ("qwen3_moe", "olmoe"):
        tensors = softmax_moe_tensors(run.params, cfg, np_dtype)
        config = (qwen3_moe_config if layout == "qwen3_moe" else olmoe_config)(cfg, eos_id, dtype)
    else:
        tensors = moelab_tensors(run.params, run.router_bias, np_dtype)
        config = {"format": "moelab", "step": run.step, "eos_token_id": eos_id, "dtype": dtype, "model": to_dict(cfg)}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = _write_weights(tensors, staging, max_shard_bytes, {"format": "np", "moelab_layout": layout})
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        if hasattr(run.tokenizer, "save"):
            run.tokenizer.save(staging / "tokenizer.json")
        else:
            (staging / "tokenizer.json").write_text(byte_tokenizer_json())
        (staging / "README.md").write_text(_readme(cfg, layout, why, run.step, Path(source).resolve().name, files,
                                                   dtype))
        staging.chmod(0o755)  # mkdtemp makes it private; an export is for sharing
        for path in staging.iterdir():
            path.chmod(0o644)
        if out.exists():  # --force: the old folder goes only once the new one is complete
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return {"out": str(out), "layout": layout, "hf_class": HF_CLASSES.get(layout), "why": why, "dtype": dtype,
            "files": [*files, "config.json", "tokenizer.json", "README.md"],
            "bytes": int(sum(a.nbytes for a in tensors.values()))}


def load_export(folder: str | Path) -> tuple[ModelConfig, dict, np.ndarray]:
    """A moelab-layout export back as (model config, float32 params, router_bias); DataError if it is not one.

    The config's `model.moe.dispatch` is "dropless", whatever the run trained with: an export is the
    model's function, and under the training `capacity` dispatch a forward drops tokens whenever an
    expert gets more than its share of a batch, which a short sequence (a prompt, a check's few
    tokens) does often, so the logits would depend on which other tokens share the batch. Dropless is
    also what transformers computes for the Mixtral and Glm4Moe layouts, so `moelab export --check`
    compares against it.
    """
    from safetensors.numpy import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise DataError(f"{folder} is not an export: {config_path} does not exist.")
    config = json.loads(config_path.read_text())
    if config.get("format") != "moelab":
        raise DataError(f"{folder} is a {config.get('model_type', 'foreign')} export, not moelab's layout; load it "
                        "with transformers (AutoModelForCausalLM.from_pretrained).")
    if (folder / INDEX).is_file():
        files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    else:
        files = [WEIGHTS]
    flat: dict[str, np.ndarray] = {}
    for name in files:
        flat.update(load_file(str(folder / name)))
    params: dict = {}
    for key, value in flat.items():
        if key == "router_bias":
            continue
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value.astype(np.float32)  # a bfloat16 export: moelab's params are float32
    cfg = from_dict(config["model"], ModelConfig)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="dropless"))
    return cfg, params, flat["router_bias"]
