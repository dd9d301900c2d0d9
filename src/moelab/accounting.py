"""Parameter counts and training FLOPs: the one source of these numbers for every report and CLI.

Counts follow the parameter layout of `moelab.model.transformer.init` (a test checks them against it).
FLOPs per token are forward + backward (3x forward), matmuls only:

    flops_per_token = 6 * (active_params + lm_head) + 6 * L * S * N * H      (causal attention)

where the attention term counts QK^T and AV over the causal half of the S x S score matrix
(2 * 2 * S/2 * N * H per layer forward). Norms, softmaxes and the router's top-k are not counted,
the usual convention (Kaplan et al. 2020, PaLM appendix B).
"""

from __future__ import annotations

from dataclasses import dataclass

from moelab.config import ModelConfig, RunConfig

__all__ = ["ParamCounts", "count_params", "flops_per_token", "tokens_per_step", "train_tokens", "summarize", "mfu"]


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter, embedding and lm head included
    active: int  # what one token touches, excluding embedding and lm head
    embedding: int  # embedding table + lm head (untied)


def _attention_and_norms(cfg: ModelConfig) -> int:
    """Parameters every block has, dense or MoE: attention (with its QK-norm gains) and the two norms."""
    d = cfg.d_model
    heads = cfg.num_heads * cfg.resolved_head_dim
    kv = cfg.num_kv_heads * cfg.resolved_head_dim
    attention = d * heads + 2 * d * kv + heads * d
    if cfg.qk_norm is not None:  # the queries' and keys' RMSNorm gains
        attention += 2 * cfg.resolved_head_dim if cfg.qk_norm == "head" else heads + kv
    if cfg.attention_bias:  # the q, k and v projections' biases
        attention += heads + 2 * kv
    return attention + 2 * d


def _layer_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of one MoE block."""
    d, moe = cfg.d_model, cfg.moe
    router = d * moe.num_experts
    d_in = cfg.expert_input_dim
    latent = 0 if moe.latent_dim is None else 2 * d * moe.latent_dim + moe.latent_dim
    one_expert = 3 * d_in * moe.expert_dim  # SwiGLU: gate, up, down
    shared = moe.num_shared_experts * 3 * d * moe.resolved_shared_expert_dim
    common = _attention_and_norms(cfg) + router + latent + shared
    return common + moe.num_experts * one_expert, common + moe.num_experts_per_token * one_expert


def count_params(cfg: ModelConfig) -> ParamCounts:
    total_layer, active_layer = _layer_counts(cfg)
    dense = cfg.dense_layers * (_attention_and_norms(cfg) + 3 * cfg.d_model * cfg.resolved_dense_ffn_dim)  # all active
    embedding = 2 * cfg.vocab_size * cfg.d_model
    final_norm = cfg.d_model
    return ParamCounts(
        total=cfg.num_moe_layers * total_layer + dense + embedding + final_norm,
        active=cfg.num_moe_layers * active_layer + dense + final_norm,
        embedding=embedding,
    )


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs (forward + backward) per token, attention included."""
    counts = count_params(cfg)
    lm_head = cfg.d_model * cfg.vocab_size
    attention = 6 * cfg.num_layers * cfg.seq_len * cfg.num_heads * cfg.resolved_head_dim
    return 6 * (counts.active + lm_head) + attention


def tokens_per_step(cfg: RunConfig) -> int:
    """Tokens one optimizer step trains on: global batch x sequence length."""
    return cfg.train.batch_size * cfg.model.seq_len


def train_tokens(cfg: RunConfig) -> int:
    """Tokens a run trains on: steps x tokens per step."""
    return cfg.train.steps * tokens_per_step(cfg)


def summarize(cfg: RunConfig, tokens: int | None = None) -> dict[str, int | float]:
    """The figures `moelab flops` prints, with exactly these keys."""
    counts = count_params(cfg.model)
    tokens = train_tokens(cfg) if tokens is None else tokens
    per_token = flops_per_token(cfg.model)
    return {
        "total_params": counts.total,
        "active_params": counts.active,
        "embedding_params": counts.embedding,
        "flops_per_token": per_token,
        "tokens": tokens,
        "train_flops": float(per_token) * tokens,
    }


def mfu(cfg: ModelConfig, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: useful training FLOPs per second over the hardware peak."""
    return flops_per_token(cfg) * tokens_per_s / peak_flops
