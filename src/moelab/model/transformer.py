"""The MoE transformer: embedding, pre-norm blocks (GQA attention with RoPE, MoE), lm head, loss.

    x = embed[tokens]
    for each layer:  x += attn(rms_norm(x));  x += moe(rms_norm(x))     (the first `dense_layers`: a dense SwiGLU)
    logits = rms_norm(x) @ lm_head

The MoE blocks share one shape, so their parameters are stacked along a leading layer axis and the
blocks run under `jax.lax.scan`: the block compiles once instead of L times. Dense first layers
(`ModelConfig.dense_layers`) are a second stack, `dense_layers`, scanned before them. The embedding and the lm
head are untied. The residual stream, norms, router and loss are float32; `compute_dtype` only
changes the inputs of the matmuls. References: nanoGPT's model.py (layout), RoFormer (RoPE), GQA
(Ainslie et al. 2023), PaLM (z-loss).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model import fp8 as fp8_lib
from moelab.model import moe, router
from moelab.model.dispatch import EXPERT_MATMUL
from moelab.model.moe import Dispatch
from moelab.model.layers import INIT_STD, residual_init_std, rms_norm, swiglu

__all__ = ["init", "init_router_bias", "apply", "loss", "lm_head", "attention", "with_bias", "qk_norm", "causal_attention",
           "apply_rope", "dense_mlp"]

# {"embed", "layers": {...stacked [L - Ld, ...]}, "final_norm", "lm_head"}, and "dense_layers" [Ld, ...] when Ld > 0
Params = dict
# The weights the model reads only through a cast to the compute dtype (every projection's matrix): a copy in that
# dtype computes the same. The router, the norms' gains and the embedding are read in float32.
READ_IN_COMPUTE_DTYPE = frozenset({"w_q", "w_k", "w_v", "w_o", "w_latent_down", "w_latent_up", "w_shared_gate",
                                   "w_shared_up", "w_shared_down", "w_mlp_gate", "w_mlp_up", "w_mlp_down", "lm_head"})
# Lays out one layer's params for use, inside the scan body (`moelab.parallel.spmd.layer_gather`: a parameter
# split over the rack is all-gathered here, where its layer runs, one layer at a time).
Gather = Callable[[dict], dict]


# ----------------------------------------------------------------------------------------------
# init


def _init_dense_mlp(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """A dense block's SwiGLU: `w_mlp_gate`, `w_mlp_up` [D, F], `w_mlp_down` [F, D] with F = `cfg.resolved_dense_ffn_dim`."""
    D, F = cfg.d_model, cfg.resolved_dense_ffn_dim
    k_gate, k_up, k_down = jax.random.split(key, 3)
    return {"w_mlp_gate": INIT_STD * jax.random.normal(k_gate, (D, F), jnp.float32),
            "w_mlp_up": INIT_STD * jax.random.normal(k_up, (D, F), jnp.float32),
            "w_mlp_down": residual_init_std(cfg.num_layers) * jax.random.normal(k_down, (F, D), jnp.float32)}


def _init_layer(cfg: ModelConfig, key: jax.Array, init_mlp: Callable = moe.init) -> dict[str, jax.Array]:
    """One block's parameters (attention + `init_mlp`'s: the MoE block, or a dense block's SwiGLU), before stacking."""
    D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    k_q, k_k, k_v, k_o, k_mlp = jax.random.split(key, 5)
    out_std = residual_init_std(cfg.num_layers)
    qk_norms = {}
    if cfg.qk_norm is not None:  # gains of the queries' and keys' RMSNorm: per head dim, or per projection dim
        qk_norms = {"q_norm": jnp.ones((H if cfg.qk_norm == "head" else N * H,), jnp.float32),
                    "k_norm": jnp.ones((H if cfg.qk_norm == "head" else K * H,), jnp.float32)}
    biases = {}
    if cfg.attention_bias:  # the q / k / v projections' biases (`model.attention_bias`), zero at init
        biases = {"b_q": jnp.zeros((N * H,), jnp.float32), "b_k": jnp.zeros((K * H,), jnp.float32),
                  "b_v": jnp.zeros((K * H,), jnp.float32)}
    return {
        **qk_norms,
        **biases,
        "attn_norm": jnp.ones((D,), jnp.float32),
        "w_q": INIT_STD * jax.random.normal(k_q, (D, N * H), jnp.float32),
        "w_k": INIT_STD * jax.random.normal(k_k, (D, K * H), jnp.float32),
        "w_v": INIT_STD * jax.random.normal(k_v, (D, K * H), jnp.float32),
        "w_o": out_std * jax.random.normal(k_o, (N * H, D), jnp.float32),
        "mlp_norm": jnp.ones((D,), jnp.float32),
        **init_mlp(cfg, k_mlp),
    }


def init(cfg: ModelConfig, key: jax.Array) -> Params:
    """All parameters, float32, per-layer ones stacked along a leading L axis.

    Returns:
        `embed` [V, D], `layers` (the L = num_moe_layers MoE blocks: `attn_norm` [L, D], `w_q` [L, D, N*H],
        `w_k` / `w_v` [L, D, K*H], `w_o` [L, N*H, D], `mlp_norm` [L, D] and the MoE block's arrays from
        `moe.init` with a leading L), `final_norm` [D], `lm_head` [D, V]; with `cfg.dense_layers` = Ld > 0
        also `dense_layers` (the same attention arrays with a leading Ld, and `w_mlp_gate` / `w_mlp_up`
        [Ld, D, F], `w_mlp_down` [Ld, F, D]). Layer i draws from the i-th of num_layers keys, dense or not.
    """
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    layer_keys = jax.random.split(k_layers, cfg.num_layers)
    params = {
        "embed": cfg.embed_std * jax.random.normal(k_embed, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "layers": jax.vmap(functools.partial(_init_layer, cfg))(layer_keys[cfg.dense_layers:]),
        "final_norm": jnp.ones((cfg.d_model,), jnp.float32),
        "lm_head": INIT_STD * jax.random.normal(k_head, (cfg.d_model, cfg.vocab_size), jnp.float32),
    }
    if cfg.dense_layers:
        params["dense_layers"] = jax.vmap(functools.partial(_init_layer, cfg, init_mlp=_init_dense_mlp))(
            layer_keys[:cfg.dense_layers])
    return params


def init_router_bias(cfg: ModelConfig) -> jax.Array:
    """The router balancing bias, [L, E] zeros over the L = num_moe_layers MoE blocks: training state, not a
    parameter."""
    return jnp.zeros((cfg.num_moe_layers, cfg.moe.num_experts), jnp.float32)


# ----------------------------------------------------------------------------------------------
# attention


def apply_rope(x: jax.Array, theta: float, offset: jax.Array | int = 0, fraction: float = 1.0) -> jax.Array:
    """Rotary position embedding, rotating the two halves of each head (the GPT-NeoX / Llama layout).

    Args:
        x: [B, S, N, H] queries or keys, H even.
        theta: base of the rotation frequencies.
        offset: the position of x's first row (decoding with a KV cache: the cache's fill).
        fraction: the share of each head's dimensions rotated (`ModelConfig.rope_fraction`): the first
            H * fraction, with frequencies as for a head of that width; the rest pass unrotated.

    Returns:
        [B, S, N, H] in x's dtype; the angles and the rotation are computed in float32.
    """
    if fraction != 1.0:
        rotated = rotary_dims(x.shape[-1], fraction)
        return jnp.concatenate([apply_rope(x[..., :rotated], theta, offset), x[..., rotated:]], axis=-1)
    S, H = x.shape[1], x.shape[-1]
    half = H // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angle = (offset + jnp.arange(S, dtype=jnp.float32))[:, None] * freq[None, :]  # [S, H/2]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rotary_dims(head_dim: int, fraction: float) -> int:
    """The head dimensions RoPE rotates under `fraction`: int(head_dim * fraction), as transformers takes it."""
    return int(head_dim * fraction)


def _attention_implementation(dtype: jnp.dtype) -> str | None:
    """cuDNN's fused (flash) attention for 16-bit inputs on a GPU; JAX's default (XLA) everywhere else.

    cuDNN only takes float16 / bfloat16, so float32 runs keep the XLA path even on a GPU.
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "cudnn"
    return None


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`jax.nn.dot_product_attention`, causal: cuDNN's fused kernel where `_attention_implementation`
    picks it, XLA's otherwise.

    cuDNN checks the shapes, the dtype and its own presence when the step is traced. If it declines,
    the step runs on XLA's attention with a warning naming why, rather than not at all: a run is
    never lost to a missing kernel, and a benchmark that lost the fused kernel says so.

    Args:
        q: [B, S, N, H]; k, v: [B, S, K, H] with K dividing N (grouped-query).

    Returns:
        [B, S, N, H] in q's dtype.
    """
    implementation = _attention_implementation(q.dtype)
    if implementation is not None:
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            warnings.warn(f"{implementation} attention declined ({type(e).__name__}: {e}); using XLA's attention.",
                          stacklevel=2)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def qk_norm(layer: dict[str, jax.Array], q: jax.Array, k: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """`cfg.qk_norm`'s RMSNorm of q [B, S, N*H] and k [B, S, K*H] (in float32, back in their dtype), before RoPE:
    over each head's H dimensions with one [H] gain ("head"), or over the whole projection ("full")."""
    if cfg.qk_norm is None:
        return q, k
    H = cfg.resolved_head_dim

    def norm(x, gain):
        shaped = x.reshape(*x.shape[:-1], -1, H) if cfg.qk_norm == "head" else x
        return rms_norm(shaped, gain, cfg.norm_eps).reshape(x.shape).astype(x.dtype)

    return norm(q, layer["q_norm"]), norm(k, layer["k_norm"])


def with_bias(layer: dict[str, jax.Array], name: str, y: jax.Array) -> jax.Array:
    """`y` plus the layer's projection bias `name` (`model.attention_bias`), in y's dtype; `y` as is without one."""
    return y + layer[name].astype(y.dtype) if name in layer else y


def attention(layer: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig, compute_dtype: jnp.dtype,
              attend: Callable = causal_attention) -> jax.Array:
    """Causal grouped-query self-attention with RoPE.

    Args:
        layer: one block's `w_q` [D, N*H], `w_k` [D, K*H], `w_v` [D, K*H], `w_o` [N*H, D].
        x: [B, S, D] normalized input.
        cfg: model shape (`num_heads` N, `num_kv_heads` K, `resolved_head_dim` H, `rope_theta`).
        compute_dtype: dtype of the matmuls' inputs.
        attend: `causal_attention`, or a stand-in with its signature (the memory planner traces cuDNN's
            residuals off a GPU).

    Returns:
        [B, S, D] float32.
    """
    B, S, _ = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    x = x.astype(compute_dtype)
    w = {name: layer[name].astype(compute_dtype) for name in ("w_q", "w_k", "w_v", "w_o")}
    q = with_bias(layer, "b_q", fp8_lib.project("bsd,dh->bsh", x, w["w_q"], cfg.fp8))
    k = with_bias(layer, "b_k", fp8_lib.project("bsd,dh->bsh", x, w["w_k"], cfg.fp8))
    q, k = qk_norm(layer, q, k, cfg)
    q, k = q.reshape(B, S, N, H), k.reshape(B, S, K, H)
    v = with_bias(layer, "b_v", fp8_lib.project("bsd,dh->bsh", x, w["w_v"], cfg.fp8)).reshape(B, S, K, H)
    q, k = apply_rope(q, cfg.rope_theta, fraction=cfg.rope_fraction), apply_rope(k, cfg.rope_theta, fraction=cfg.rope_fraction)
    # K < N key/value heads are shared by groups of N / K query heads; dot_product_attention does the
    # grouping itself, so K and V are never repeated in memory.
    o = attend(q, k, v)
    return fp8_lib.project("bsh,hd->bsd", o.reshape(B, S, N * H), w["w_o"], cfg.fp8).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# forward and loss


def dense_mlp(layer: dict[str, jax.Array], h: jax.Array, cfg: ModelConfig, compute_dtype: jnp.dtype) -> jax.Array:
    """A dense block's MLP: `layers.swiglu` of h [T, D] with the block's `w_mlp_*`; [T, D] float32."""
    return swiglu(h.astype(compute_dtype), *(layer[f"w_mlp_{name}"].astype(compute_dtype)
                                             for name in ("gate", "up", "down")), fp8=cfg.fp8)


def _block(
    cfg: ModelConfig,
    compute_dtype: jnp.dtype,
    gather: Gather | None,
    attend: Callable,
    mlp: Callable,
    x: jax.Array,
    layer_and_bias: tuple[dict[str, jax.Array], jax.Array | None],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One pre-norm block as a scan step: x [B, S, D] -> (x, this layer's MLP stats).

    `mlp(layer, h [T, D], bias) -> (y [T, D], stats)` is the MoE block (`moe.apply`) or, with bias None, a
    dense block's SwiGLU (no stats)."""
    layer, bias = layer_and_bias
    if gather is not None:
        layer = gather(layer)
    B, S, D = x.shape
    x = x + attention(layer, rms_norm(x, layer["attn_norm"], cfg.norm_eps), cfg, compute_dtype, attend)
    h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps).reshape(B * S, D)  # the MLP sees a flat [T, D]
    y, stats = mlp(layer, h, bias)
    return x + y.reshape(B, S, D), stats


def mlps(cfg: ModelConfig, compute_dtype: jnp.dtype, dispatch: Dispatch, rebalance: bool | jax.Array = False
         ) -> tuple[Callable, Callable]:
    """The MLP of a dense block and of a MoE block as `_block` (and the decoder's block) call them."""

    def dense(layer, h, bias):
        return dense_mlp(layer, h, cfg, compute_dtype), {}

    def routed(layer, h, bias):
        return moe.apply(layer, h, bias, cfg, compute_dtype, dispatch=dispatch, rebalance=rebalance)

    return dense, routed


def _remat(block, remat: str):
    """The block under `jax.checkpoint` per `ModelConfig.remat`; the same function, other memory / time.

    `dots` keeps every matmul output (`checkpoint_dots`, plus the `grouped` backend's Pallas matmuls,
    named `EXPERT_MATMUL`) and recomputes the elementwise work (norms, RoPE, SwiGLU's silu * up) in the
    backward pass; `full` keeps only the block's inputs.
    """
    if remat == "none":
        return block
    policies = jax.checkpoint_policies
    policy = None
    if remat == "dots":
        policy = policies.save_from_both_policies(policies.checkpoint_dots,
                                                  policies.save_only_these_names(EXPERT_MATMUL))
    return jax.checkpoint(block, policy=policy, prevent_cse=False)  # prevent_cse is not needed under scan


@jax.custom_vjp
def lm_head(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 logits [B, S, V] of x [B, S, D] @ w [D, V], whose backward matmuls run in x's dtype.

    Left to autodiff, the float32 cotangent of the logits would make both backward matmuls float32 (tf32
    on a GPU: the slowest matmul of gpu-medium's step, issue 39). Here it is rounded to the compute dtype
    first, as Megatron does when it casts bf16 logits up for the loss. Under float32 compute nothing is
    rounded and the gradients are autodiff's.
    """
    return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)


def _lm_head_forward(x, w):
    return lm_head(x, w), (x, w)


def _lm_head_backward(saved, g):
    x, w = saved
    g = g.astype(x.dtype)
    dx = jnp.einsum("bsv,dv->bsd", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("bsd,bsv->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


lm_head.defvjp(_lm_head_forward, _lm_head_backward)


def apply(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    router_bias: jax.Array,
    compute_dtype: jnp.dtype = jnp.float32,
    *,
    dispatch: Dispatch,
    gather: Gather | None = None,
    rebalance: bool | jax.Array = False,
    attend: Callable = causal_attention,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token logits.

    Args:
        params: from `init`.
        tokens: [B, S] int32.
        cfg: the model config.
        router_bias: [L, E] (L = `cfg.num_moe_layers`) from `init_router_bias` or a balancing rule.
        compute_dtype: jnp.float32 or jnp.bfloat16, for the matmuls only.
        dispatch: how the routed experts run (`moe.build_moe(cfg, mesh, purpose)`: training, evaluation or
            decoding; under a mesh, per device inside the step's `shard_map`). The model
            never picks one behind its caller's back.
        gather: applied to each layer's params where the layer runs (`Gather`); None under layouts
            that keep the non-expert params whole.
        rebalance: [] bool: every MoE layer routes under the bias solved on this batch (`moe.apply`);
            the train step sets it for the first `cfg.moe.rebalance_steps` steps.
        attend: the causal attention (`attention`'s).

    Returns:
        logits [B, S, V] float32 and aux, over the L MoE blocks: `expert_load` [L, E], `dropped` [L], `assignments` [L],
        `drop_fraction` [] (dropped / assignments over all layers), `router_entropy` [L],
        `balance_loss` [] and, under quantile balancing, `bias_target` [L, E]; under `ep` also
        `drop_fraction_at_sender` and `drop_fraction_at_receiver` [] (they add up to `drop_fraction`);
        all float32.
    """
    x = params["embed"][tokens]  # [B, S, D] float32 residual stream
    dense, routed = mlps(cfg, compute_dtype, dispatch, rebalance)
    if "dense_layers" in params:
        dense_block = _remat(functools.partial(_block, cfg, compute_dtype, gather, attend, dense), cfg.remat)
        x, _ = jax.lax.scan(dense_block, x, (params["dense_layers"], None))
    block = _remat(functools.partial(_block, cfg, compute_dtype, gather, attend, routed), cfg.remat)
    x, stats = jax.lax.scan(block, x, (params["layers"], router_bias))  # stats: leading L axis
    x = rms_norm(x, params["final_norm"], cfg.norm_eps).astype(compute_dtype)
    logits = lm_head(x, params["lm_head"].astype(compute_dtype))
    aux = {
        "expert_load": stats["load"],
        "dropped": stats["dropped"],
        "assignments": stats["assignments"],
        "drop_fraction": router.drop_fraction(jnp.sum(stats["dropped"]), jnp.sum(stats["assignments"])),
        "router_entropy": stats["entropy"],
        # The balancing rule's loss term (`aux` rule), summed over layers; 0 for the bias rules.
        "balance_loss": jnp.sum(stats["balance_loss"]) if "balance_loss" in stats else jnp.zeros((), jnp.float32),
    }
    if "bias_target" in stats:  # quantile balancing: this step's target bias per layer, for the next step
        aux["bias_target"] = stats["bias_target"]
    if "dropped_at_sender" in stats:  # `ep`: where the drops happen says which capacity factor to raise
        for stage in ("sender", "receiver"):
            aux[f"drop_fraction_at_{stage}"] = router.drop_fraction(jnp.sum(stats[f"dropped_at_{stage}"]),
                                                                     jnp.sum(stats["assignments"]))
    return logits, aux


def loss(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    router_bias: jax.Array,
    compute_dtype: jnp.dtype = jnp.float32,
    *,
    dispatch: Dispatch,
    gather: Gather | None = None,
    rebalance: bool | jax.Array = False,
    attend: Callable = causal_attention,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross-entropy plus the optional z-loss and the balancing loss.

    loss = mean_{b,s} (lse_{b,s} - logit_{b,s,target}) + cfg.z_loss_weight * mean_{b,s} lse_{b,s}^2
           + balance_loss,
    with lse the log-partition of each position's logits and balance_loss the `aux` balancing rule's
    term (0 under every other rule, so the bias rules leave the loss and its gradients untouched).

    Args:
        params: from `init`.
        tokens: [B, S+1] int32; positions 0..S-1 are inputs, 1..S the targets.
        cfg, router_bias, compute_dtype, dispatch, gather, rebalance, attend: as in `apply`.

    Returns:
        The scalar loss and aux: `ce` [], `z_loss` [], `ce_per_row` [B] (mean CE of each sequence),
        plus everything in `apply`'s aux.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, aux = apply(params, inputs, cfg, router_bias, compute_dtype, dispatch=dispatch, gather=gather,
                        rebalance=rebalance, attend=attend)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, S]
    ce_tok = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, S]
    ce = jnp.mean(ce_tok)
    z_loss = jnp.mean(lse * lse)
    aux = {**aux, "ce": ce, "z_loss": z_loss, "ce_per_row": jnp.mean(ce_tok, axis=-1)}
    return ce + cfg.z_loss_weight * z_loss + aux["balance_loss"], aux
