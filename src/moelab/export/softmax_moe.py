"""moelab's softmax-routed models with QK-norm as `transformers`' `Qwen3MoeForCausalLM` and `OlmoeForCausalLM`.

Both route as Mixtral does (softmax over all experts, top-k, renormalized when `norm_topk_prob`), with no shared
experts and no router bias; they differ from Mixtral, and from each other, in the QK-norm (an RMSNorm of the
queries and keys before RoPE):

    Qwen3MoeForCausalLM   per head (gains [head_dim]: model.qk_norm 'head'), optional dense first blocks
                          (mlp_only_layers [0, ..., k-1]: model.dense_layers k, width intermediate_size)
    OlmoeForCausalLM      over the whole projection (gains [heads x head_dim]: model.qk_norm 'full'), head_dim
                          d_model / heads, no dense blocks

The mapping, per layer (moelab's [in, out] matrices become torch's [out, in]; `llama.decoder_tensors` names the
attention, the norms and any dense block):

    w_router                   -> mlp.gate.weight (float32 always: moelab routes in float32)
    w_gate / w_up / w_down [e] -> mlp.experts.e.gate_proj / up_proj / down_proj

These are the classes `moelab import` reads them from, so an import exported again writes the checkpoint back.
"""

from __future__ import annotations

import numpy as np

from moelab.config import ModelConfig
from moelab.export.llama import decoder_config, decoder_tensors, experts_tensors

__all__ = ["qwen3_moe_mismatch", "olmoe_mismatch", "softmax_moe_tensors", "qwen3_moe_config", "olmoe_config"]


def _softmax_mismatch(cfg: ModelConfig, router_bias, name: str) -> str | None:
    """What a plain softmax-routed MoE block (no shared experts, latent, groups or bias) cannot express."""
    m = cfg.moe
    if cfg.attention_bias:  # their classes take attention_bias, but no test holds moelab's to theirs yet
        return f"model.attention_bias=true (not exported as {name} yet: Glm4MoeForCausalLM carries it)"
    if m.router_score != "softmax":
        return f"model.moe.router_score={m.router_score!r} ({name} scores with softmax)"
    if m.routed_scaling != 1.0:
        return f"model.moe.routed_scaling={m.routed_scaling} ({name} does not scale its combine weights)"
    if m.num_shared_experts:
        return f"model.moe.num_shared_experts={m.num_shared_experts} ({name} has none)"
    if m.latent_dim is not None:
        return f"model.moe.latent_dim={m.latent_dim} ({name}'s experts run at d_model)"
    if m.num_groups > 1:
        return f"model.moe.num_groups={m.num_groups} ({name}'s router has no groups)"
    if cfg.rope_fraction != 1.0:
        return f"model.rope_fraction={cfg.rope_fraction} ({name} rotates every dimension of a head)"
    if np.any(np.asarray(router_bias) != 0):
        return f"the router selects with a balancing bias (model.moe.balancing); {name}'s has none"
    return None


def qwen3_moe_mismatch(cfg: ModelConfig, router_bias) -> str | None:
    """Why `Qwen3MoeForCausalLM` cannot express this model exactly (naming the option), or None when it can."""
    if cfg.qk_norm != "head":
        return f"model.qk_norm={cfg.qk_norm!r} (Qwen3-MoE normalizes queries and keys per head: 'head')"
    return _softmax_mismatch(cfg, router_bias, "Qwen3-MoE")


def olmoe_mismatch(cfg: ModelConfig, router_bias) -> str | None:
    """Why `OlmoeForCausalLM` cannot express this model exactly (naming the option), or None when it can."""
    if cfg.qk_norm != "full":
        return f"model.qk_norm={cfg.qk_norm!r} (OLMoE normalizes the whole query and key projections: 'full')"
    if cfg.dense_layers:
        return f"model.dense_layers={cfg.dense_layers} (every OLMoE block is a MoE block)"
    if cfg.resolved_head_dim * cfg.num_heads != cfg.d_model:
        return (f"model.head_dim={cfg.resolved_head_dim} (OLMoE's heads split d_model: head_dim = "
                f"{cfg.d_model // cfg.num_heads})")
    return _softmax_mismatch(cfg, router_bias, "OLMoE")


def softmax_moe_tensors(params: dict, cfg: ModelConfig, dtype: np.dtype) -> dict[str, np.ndarray]:
    """moelab params as a Qwen3-MoE or OLMoE checkpoint's tensors (the names are the same in both)."""
    tensors = {**decoder_tensors(params, dtype), **experts_tensors(params, cfg.moe.num_experts, dtype)}
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def _common(cfg: ModelConfig, eos_id: int, dtype: str) -> dict:
    """What both classes' config.json add to `decoder_config`: default RoPE, no biases, the softmax router's."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {**decoder_config(cfg, eos_id, dtype), "rope_parameters": rope, "attention_bias": False,
            "num_experts": cfg.moe.num_experts, "norm_topk_prob": cfg.moe.normalize_weights}


def qwen3_moe_config(cfg: ModelConfig, eos_id: int, dtype: str) -> dict:
    """config.json for `Qwen3MoeForCausalLM`."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_common(cfg, eos_id, dtype),
            "head_dim": cfg.resolved_head_dim, "moe_intermediate_size": cfg.moe.expert_dim,
            "intermediate_size": cfg.resolved_dense_ffn_dim, "mlp_only_layers": list(range(cfg.dense_layers)),
            "decoder_sparse_step": 1, "use_sliding_window": False, "sliding_window": None}


def olmoe_config(cfg: ModelConfig, eos_id: int, dtype: str) -> dict:
    """config.json for `OlmoeForCausalLM`."""
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **_common(cfg, eos_id, dtype),
            "intermediate_size": cfg.moe.expert_dim, "clip_qkv": None}
