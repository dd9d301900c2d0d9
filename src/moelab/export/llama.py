"""The tensors every Llama-style `transformers` class names alike: embedding, norms, GQA attention, lm head.

Mixtral and Glm4Moe differ only in their MoE blocks; both exports start from `decoder_tensors` (dense blocks
included) and add their own. moelab's [in, out] matrices become torch's [out, in].
"""

from __future__ import annotations

import numpy as np

__all__ = ["blocks", "decoder_tensors", "as_dtype"]


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
