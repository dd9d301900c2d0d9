"""A run's weights as a folder other tools read: safetensors, config.json, tokenizer, README.

    export_run(load_run("runs/tiny"), "exports/tiny")              # Mixtral layout where it fits
    cfg, params, bias = load_export("exports/tiny-latent")         # moelab's own layout, back

Two layouts, picked by what the model is:

- **Mixtral** (`transformers`' `MixtralForCausalLM`), when the architecture says exactly what moelab
  computes: softmax router with its top-k weights renormalized to sum to 1, no router bias in use
  (all zeros), no shared experts, no LatentMoE, no z-loss-free logit changes (z-loss only trains).
  Attention is GQA with the GPT-NeoX RoPE layout (rotate halves) in both; moelab's [in, out] matrices
  are transposed to torch's [out, in]; expert e's `w_gate`/`w_up`/`w_down` become
  `block_sparse_moe.experts.e.w1/w3/w2` (the checkpoint format Mixtral's own weights use, which every
  `transformers` version reads).
- **moelab** otherwise (sigmoid router, a selection bias, shared experts, a latent): the params tree
  flattened with `.` (`layers.w_q`, stacked [L, ...] as moelab holds them) plus `router_bias` [L, E],
  and config.json `{"format": "moelab", "model": {ModelConfig fields}}`; `load_export` reads it back.

Weights go in `model.safetensors`, or above `max_shard_bytes` in `model-0000i-of-0000n.safetensors`
shards with `model.safetensors.index.json` (the Hugging Face index). The folder is written under a
temporary name beside the target and renamed into place when complete, so a failed or interrupted
export never leaves a half-written folder; an existing target is refused unless `force`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from moelab.config import ModelConfig, from_dict, to_dict
from moelab.errors import ConfigError, DataError

__all__ = ["mixtral_mismatch", "mixtral_tensors", "mixtral_config", "moelab_tensors", "export_run", "load_export",
           "byte_tokenizer_json", "MAX_SHARD_BYTES", "WEIGHTS", "INDEX"]

MAX_SHARD_BYTES = 5 * 2**30  # the Hugging Face default shard size
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def mixtral_mismatch(cfg: ModelConfig, router_bias: Any) -> str | None:
    """Why Mixtral cannot express this model exactly, or None when it can."""
    m = cfg.moe
    if m.router_score != "softmax":
        return f"the router scores with {m.router_score} (Mixtral: softmax)"
    if not m.normalize_weights or m.routed_scaling != 1.0:
        return "the combine weights are not the chosen softmax scores renormalized to 1"
    if m.num_shared_experts:
        return f"it has {m.num_shared_experts} shared expert(s)"
    if m.latent_dim is not None:
        return f"its experts run in a latent of width {m.latent_dim}"
    if np.any(np.asarray(router_bias) != 0):
        return "its router selects with a balancing bias"
    return None


def _np(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


def mixtral_tensors(params: dict) -> dict[str, np.ndarray]:
    """moelab params as a Mixtral checkpoint's tensors (torch [out, in] layout)."""
    layers = params["layers"]
    tensors = {"model.embed_tokens.weight": _np(params["embed"]), "model.norm.weight": _np(params["final_norm"]),
               "lm_head.weight": _np(params["lm_head"]).T}
    for i in range(layers["w_q"].shape[0]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": _np(layers["attn_norm"][i]),
            p + "post_attention_layernorm.weight": _np(layers["mlp_norm"][i]),
            p + "self_attn.q_proj.weight": _np(layers["w_q"][i]).T,
            p + "self_attn.k_proj.weight": _np(layers["w_k"][i]).T,
            p + "self_attn.v_proj.weight": _np(layers["w_v"][i]).T,
            p + "self_attn.o_proj.weight": _np(layers["w_o"][i]).T,
            p + "block_sparse_moe.gate.weight": _np(layers["w_router"][i]).T,
        })
        for e in range(layers["w_gate"].shape[1]):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": _np(layers["w_gate"][i, e]).T, q + "w3.weight": _np(layers["w_up"][i, e]).T,
                            q + "w2.weight": _np(layers["w_down"][i, e]).T})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def mixtral_config(cfg: ModelConfig, eos_id: int) -> dict:
    """config.json for `MixtralForCausalLM` (keys of transformers 4.x and 5.x both)."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.moe.expert_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.dim_per_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.num_experts_per_token,
        "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0, "router_jitter_noise": 0.0,
        "output_router_logits": False, "bos_token_id": None, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def moelab_tensors(params: dict, router_bias: Any) -> dict[str, np.ndarray]:
    """moelab params flattened with '.' (stacked layers as they are) plus `router_bias` [L, E]."""
    flat = {"router_bias": _np(router_bias)}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = _np(node)

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


def _readme(cfg: ModelConfig, layout: str, why: str | None, step: int, run_name: str, files: list[str]) -> str:
    m = cfg.moe
    shape = (f"{cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads ({cfg.num_kv_heads} KV, head "
             f"dim {cfg.dim_per_head}), RoPE theta {cfg.rope_theta:g}, context {cfg.seq_len}, vocab {cfg.vocab_size}; "
             f"{m.num_experts} routed experts top-{m.num_experts_per_token} of width {m.expert_dim}, {m.router_score} "
             f"router" + (f", {m.num_shared_experts} shared expert(s) of width {m.shared_dim}" if m.num_shared_experts
                          else "") + (f", LatentMoE at width {m.latent_dim}" if m.latent_dim is not None else ""))
    if layout == "mixtral":
        use = ("Loads in Hugging Face `transformers` as `MixtralForCausalLM`:\n\n```python\nfrom transformers "
               "import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n```\n")
    else:
        use = (f"moelab's own layout (Mixtral cannot express this model: {why}). The tensors are moelab's params "
               "flattened with `.` (per-layer arrays stacked along a leading layer axis, matrices [in, out]) and "
               "`router_bias` [layers, experts], the balancing bias the router adds to its scores to pick experts "
               "(never to weight them). Load it back with:\n\n```python\nfrom moelab.export.writer import "
               "load_export\ncfg, params, router_bias = load_export(\"THIS_FOLDER\")\n```\n\nand run "
               "`moelab.model.transformer.apply(params, tokens, cfg, router_bias)`.\n")
    return (f"# {run_name}\n\nA moelab Mixture-of-Experts model exported from the run `{run_name}` at step {step}.\n\n"
            f"Architecture: {shape}. Pre-norm blocks (RMSNorm), SwiGLU experts, untied embedding and head.\n\n"
            f"{use}\nFiles: {', '.join(files)}, config.json, tokenizer.json.\n")


def export_run(run: Any, out: str | Path, *, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
               source: str | Path = "a moelab run") -> dict:
    """Write `run` (a `moelab.train.weights.RunWeights`) to the folder `out`; returns what was written.

    `source` is the run's folder; the README names it by its last part only (a shared export must not carry
    the building machine's paths).

    Returns:
        {"out", "layout" ("mixtral" or "moelab"), "why" (None for Mixtral), "files", "bytes"}.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"export target {out} already exists; pass --force to replace it, or another --out.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} is a file; give a folder path as --out.")
    cfg = run.cfg.model
    why = mixtral_mismatch(cfg, run.router_bias)
    layout = "mixtral" if why is None else "moelab"
    if layout == "mixtral":
        tensors, config = mixtral_tensors(run.params), mixtral_config(cfg, run.tokenizer.eos_id)
    else:
        tensors = moelab_tensors(run.params, run.router_bias)
        config = {"format": "moelab", "step": run.step, "eos_token_id": run.tokenizer.eos_id, "model": to_dict(cfg)}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = _write_weights(tensors, staging, max_shard_bytes, {"format": "np", "moelab_layout": layout})
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        if hasattr(run.tokenizer, "save"):
            run.tokenizer.save(staging / "tokenizer.json")
        else:
            (staging / "tokenizer.json").write_text(byte_tokenizer_json())
        (staging / "README.md").write_text(_readme(cfg, layout, why, run.step, Path(source).resolve().name, files))
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
    return {"out": str(out), "layout": layout, "why": why, "files": [*files, "config.json", "tokenizer.json",
                                                                     "README.md"],
            "bytes": int(sum(a.nbytes for a in tensors.values()))}


def load_export(folder: str | Path) -> tuple[ModelConfig, dict, np.ndarray]:
    """A moelab-layout export back as (model config, params, router_bias); DataError if it is not one."""
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
        node[leaf] = value
    return from_dict(config["model"], ModelConfig), params, flat["router_bias"]
