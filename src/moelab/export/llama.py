"""The tensors every Llama-style `transformers` class names alike: embedding, norms, GQA attention, lm head.

Mixtral and Glm4Moe differ only in their MLP blocks; both exports start from `decoder_tensors` and add
their own. moelab's [in, out] matrices become torch's [out, in].
"""

from __future__ import annotations

import numpy as np

__all__ = ["decoder_tensors", "as_dtype"]


def as_dtype(a, dtype: np.dtype) -> np.ndarray:
    """`a` (any array) as a contiguous numpy array of `dtype`, through float32."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(dtype))


def decoder_tensors(params: dict, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Everything but the MLP blocks, in `dtype`, under `model.` and `lm_head.` names."""
    layers = params["layers"]
    tensors = {"model.embed_tokens.weight": as_dtype(params["embed"], dtype),
               "model.norm.weight": as_dtype(params["final_norm"], dtype),
               "lm_head.weight": as_dtype(params["lm_head"], dtype).T}
    for i in range(layers["w_q"].shape[0]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": as_dtype(layers["attn_norm"][i], dtype),
            p + "post_attention_layernorm.weight": as_dtype(layers["mlp_norm"][i], dtype),
            p + "self_attn.q_proj.weight": as_dtype(layers["w_q"][i], dtype).T,
            p + "self_attn.k_proj.weight": as_dtype(layers["w_k"][i], dtype).T,
            p + "self_attn.v_proj.weight": as_dtype(layers["w_v"][i], dtype).T,
            p + "self_attn.o_proj.weight": as_dtype(layers["w_o"][i], dtype).T,
        })
        if "q_norm" in layers:  # `model.qk_norm`: the gains of the queries' and keys' RMSNorm
            tensors.update({p + "self_attn.q_norm.weight": as_dtype(layers["q_norm"][i], dtype),
                            p + "self_attn.k_norm.weight": as_dtype(layers["k_norm"][i], dtype)})
    return tensors
