"""The tensors and config keys every Llama-style `transformers` class names alike: embedding, norms, GQA
attention, lm head (`decoder_tensors`), and the config.json keys of the shape (`decoder_config`).

Mixtral, Glm4Moe, Qwen3-MoE and OLMoE differ only in their MoE blocks; each export starts from these (dense
blocks included) and adds its own. The last three name their router and experts alike (`experts_tensors`).
moelab's [in, out] matrices become torch's [out, in].
"""

from __future__ import annotations

import numpy as np

__all__ = ["blocks", "decoder_tensors", "experts_tensors", "decoder_config", "as_dtype"]


def as_dtype(a, dtype: np.dtype) -> np.ndarray:
    """`a` (any array) as a contiguous numpy array of `dtype`, through float32."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(dtype))


def blocks(params: dict) -> list[tuple[str, dict, int]]:
    """Every block in the model's order as (the `model.layers.{i}.` prefix, the stack holding it, its index
    there): the dense blocks (`model.dense_layers`) first, then the MoE ones."""
    stacks = [params[key] for key in ("dense_layers", "layers") if key in params]
    found = [(stack, i) for stack in stacks for i in range(stack["w_q"].shape[0])]
    return [(f"model.layers.{n}.", stack, i) for n, (stack, i) in enumerate(found)]


def decoder_tensors(params: dict, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Everything but the MoE blocks' MLPs, in `dtype`, under `model.` and `lm_head.` names: a dense block's
    SwiGLU is `mlp.gate_proj` / `up_proj` / `down_proj` in every Llama-style class."""
    tensors = {"model.embed_tokens.weight": as_dtype(params["embed"], dtype),
               "model.norm.weight": as_dtype(params["final_norm"], dtype),
               "lm_head.weight": as_dtype(params["lm_head"], dtype).T}
    for p, layers, i in blocks(params):
        tensors.update({
            p + "input_layernorm.weight": as_dtype(layers["attn_norm"][i], dtype),
            p + "post_attention_layernorm.weight": as_dtype(layers["mlp_norm"][i], dtype),
            p + "self_attn.q_proj.weight": as_dtype(layers["w_q"][i], dtype).T,
            p + "self_attn.k_proj.weight": as_dtype(layers["w_k"][i], dtype).T,
            p + "self_attn.v_proj.weight": as_dtype(layers["w_v"][i], dtype).T,
            p + "self_attn.o_proj.weight": as_dtype(layers["w_o"][i], dtype).T,
        })
        if "b_q" in layers:  # `model.attention_bias`: the q, k and v projections' biases
            tensors.update({f"{p}self_attn.{x}_proj.bias": as_dtype(layers[f"b_{x}"][i], dtype) for x in "qkv"})
        if "q_norm" in layers:  # `model.qk_norm`: the gains of the queries' and keys' RMSNorm
            tensors.update({p + "self_attn.q_norm.weight": as_dtype(layers["q_norm"][i], dtype),
                            p + "self_attn.k_norm.weight": as_dtype(layers["k_norm"][i], dtype)})
        if "w_mlp_gate" in layers:
            tensors.update({p + f"mlp.{name}_proj.weight": as_dtype(layers[f"w_mlp_{name}"][i], dtype).T
                            for name in ("gate", "up", "down")})
    return tensors


def experts_tensors(params: dict, num_experts: int, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Every MoE block's router and routed experts under the names Glm4Moe, Qwen3-MoE and OLMoE share
    (`mlp.gate.weight`, `mlp.experts.e.gate_proj / up_proj / down_proj`): the router float32 (moelab routes in
    float32), the experts in `dtype`."""
    tensors = {}
    for p, layers, i in blocks(params):
        if "w_router" not in layers:  # a dense block: all in decoder_tensors
            continue
        tensors[p + "mlp.gate.weight"] = as_dtype(layers["w_router"][i], np.float32).T
        for e in range(num_experts):
            q = f"{p}mlp.experts.{e}."
            tensors.update({q + "gate_proj.weight": as_dtype(layers["w_gate"][i, e], dtype).T,
                            q + "up_proj.weight": as_dtype(layers["w_up"][i, e], dtype).T,
                            q + "down_proj.weight": as_dtype(layers["w_down"][i, e], dtype).T})
    return tensors


def decoder_config(cfg, eos_id: int, dtype: str) -> dict:
    """The config.json keys every exported class reads alike (`cfg` a ModelConfig): the shape, RoPE's theta, the
    norms, top-k, the untied head and the token ids."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu",
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "attention_dropout": 0.0, "tie_word_embeddings": False,
            "num_experts_per_tok": cfg.moe.num_experts_per_token, "output_router_logits": False,
            "bos_token_id": None, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype}
