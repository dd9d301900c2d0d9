"""moelab's default recipe as `transformers`' `Glm4MoeForCausalLM`: sigmoid router with its balancing bias,
shared experts, top-k over fine experts, GQA attention with RoPE; the same function, weights renamed.

Why Glm4Moe and not DeepSeek-V3: `Glm4MoeForCausalLM`'s MoE block is DeepSeek-V3's, line for line
(`DeepseekV3TopkRouter`: sigmoid scores, `e_score_correction_bias` added to choose but not to weight,
`n_group` / `topk_group`, `norm_topk_prob`, `routed_scaling_factor`; `n_shared_experts` dense SwiGLU
experts on every token), but its attention is ordinary grouped-query attention with RoPE, as moelab's.
`DeepseekV3ForCausalLM` has Multi-head Latent Attention instead, which no choice of weights turns into
GQA: its RoPE key is one head shared by every query head (GQA with more than one KV head has one per
group), the per-head key part has no RoPE at all (moelab rotates every key dimension), and values
come out of `kv_a_layernorm`, a per-token RMSNorm of the KV latent that is not linear in the input.

The mapping, per layer (moelab's [in, out] matrices become torch's [out, in]):

    w_q / w_k / w_v / w_o         -> self_attn.q_proj / k_proj / v_proj / o_proj (rotate-halves RoPE
                                     on model.rope_fraction of each head: partial_rotary_factor)
    b_q / b_k / b_v               -> self_attn.q_proj / k_proj / v_proj .bias (model.attention_bias: attention_bias)
    q_norm / k_norm               -> self_attn.q_norm / k_norm (model.qk_norm 'head': use_qk_norm)
    w_router, router_bias         -> mlp.gate.weight, mlp.gate.e_score_correction_bias (float32 always)
    w_gate / w_up / w_down [e]    -> mlp.experts.e.gate_proj / up_proj / down_proj
    w_shared_*                    -> mlp.shared_experts.*, zero-padded to n_shared_experts * expert_dim
    dense_layers' w_mlp_gate / up / down -> the first first_k_dense_replace layers' mlp.gate_proj / up_proj /
                                     down_proj (model.dense_layers, of width intermediate_size = model.resolved_dense_ffn_dim)

Settings that make the block moelab's: `n_group` / `topk_group` = `model.moe.num_groups` /
`groups_per_token` (1 / 1: plain top-k of score + bias; more: `router.within_best_groups`),
`first_k_dense_replace = model.dense_layers`, `norm_topk_prob = normalize_weights`,
`routed_scaling_factor = routed_scaling`. Glm4Moe sizes the shared MLP as `n_shared_experts *
moe_intermediate_size`; moelab stores its Ns shared experts fused as one SwiGLU of width Ns * resolved_shared_expert_dim,
so that width is padded with hidden units whose gate, up and down weights are all zero: silu(0) * 0 = 0
adds exactly nothing. The combine weights are the chosen sigmoids divided by their sum (+1e-20 in
transformers, a floor at the smallest normal float in moelab: the same number unless every chosen
sigmoid underflowed).

LatentMoE does not fold: the latent up-projection could be folded into each expert's down matrix
(it is linear and comes after the weighted sum), but the down side normalizes each token's latent
(RMSNorm) before the experts, a per-token factor 1/rms that SwiGLU, not being homogeneous, does not
let through. `transformers`' NemotronH has latent projections around its experts, but no norm between
them and non-gated experts, so it does not carry it either.
"""

from __future__ import annotations

import numpy as np

from moelab.config import ModelConfig
from moelab.export.llama import as_dtype, blocks, decoder_config, decoder_tensors, experts_tensors

__all__ = ["glm4_moe_mismatch", "glm4_moe_tensors", "glm4_moe_config", "shared_experts_in_glm4_moe"]


def glm4_moe_mismatch(cfg: ModelConfig) -> str | None:
    """Why `Glm4MoeForCausalLM` cannot express this model exactly (naming the option), or None when it can."""
    m = cfg.moe
    if m.latent_dim is not None:
        return (f"model.moe.latent_dim={m.latent_dim}: carrying LatentMoE takes a down-projection, an RMSNorm and an "
                "up-projection around SwiGLU experts, which no transformers class has (NemotronH has the projections "
                "but no norm and non-gated experts), and the norm keeps them from folding into the experts; train "
                "with model.moe.latent_dim: null for a model transformers loads")
    if cfg.qk_norm == "full":
        return "model.qk_norm='full' (Glm4Moe's QK-norm is per head: model.qk_norm='head')"
    if m.router_score != "sigmoid":
        return f"model.moe.router_score={m.router_score!r} (Glm4Moe, like DeepSeek-V3, scores with sigmoid)"
    if m.num_experts < 2:
        return f"model.moe.num_experts={m.num_experts} (Glm4Moe's router ranks the top 2 experts of a group)"
    return None


def shared_experts_in_glm4_moe(cfg: ModelConfig) -> int:
    """Glm4Moe's `n_shared_experts`: moelab's fused shared width in whole routed-expert widths, rounded up."""
    m = cfg.moe
    return -(-m.num_shared_experts * m.resolved_shared_expert_dim // m.expert_dim)


def glm4_moe_tensors(params: dict, router_bias: np.ndarray, cfg: ModelConfig, dtype: np.dtype
                     ) -> dict[str, np.ndarray]:
    """moelab params as a Glm4Moe checkpoint's tensors: torch [out, in] matrices in `dtype`, the router's
    weight and bias in float32 (moelab routes in float32; transformers keeps both float32 too)."""
    tensors = {**decoder_tensors(params, dtype), **experts_tensors(params, cfg.moe.num_experts, dtype)}
    shared_width = shared_experts_in_glm4_moe(cfg) * cfg.moe.expert_dim
    for p, layers, i in blocks(params):
        if "w_router" not in layers:  # a dense block: all in decoder_tensors
            continue
        tensors[p + "mlp.gate.e_score_correction_bias"] = as_dtype(router_bias[i], np.float32)
        # Zero hidden units add nothing; with no shared experts the tensors have width 0, and still go in the
        # file: transformers builds a width-0 shared MLP and would report its weights missing.
        pad = shared_width - cfg.moe.num_shared_experts * cfg.moe.resolved_shared_expert_dim
        shared = {name: as_dtype(layers[f"w_shared_{name}"][i], dtype) if cfg.moe.num_shared_experts else
                  np.zeros((cfg.d_model, 0) if name != "down" else (0, cfg.d_model), dtype) for name in
                  ("gate", "up", "down")}
        q = p + "mlp.shared_experts."
        tensors.update({q + "gate_proj.weight": np.pad(shared["gate"], ((0, 0), (0, pad))).T,
                        q + "up_proj.weight": np.pad(shared["up"], ((0, 0), (0, pad))).T,
                        q + "down_proj.weight": np.pad(shared["down"], ((0, pad), (0, 0))).T})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def glm4_moe_config(cfg: ModelConfig, eos_id: int, dtype: str) -> dict:
    """config.json for `Glm4MoeForCausalLM` (the settings the module docstring explains)."""
    m = cfg.moe
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rope_fraction}
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **decoder_config(cfg, eos_id, dtype),
        "head_dim": cfg.resolved_head_dim, "partial_rotary_factor": cfg.rope_fraction, "rope_parameters": rope,
        "attention_bias": cfg.attention_bias, "use_qk_norm": cfg.qk_norm == "head",
        "n_routed_experts": m.num_experts, "moe_intermediate_size": m.expert_dim,
        "intermediate_size": cfg.resolved_dense_ffn_dim,  # the dense layers' width
        "n_shared_experts": shared_experts_in_glm4_moe(cfg), "first_k_dense_replace": cfg.dense_layers,
        "n_group": m.num_groups, "topk_group": m.groups_per_token,
        "norm_topk_prob": m.normalize_weights, "routed_scaling_factor": m.routed_scaling,
        "num_nextn_predict_layers": 0,
    }
