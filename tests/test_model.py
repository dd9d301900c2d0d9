"""The transformer and router: shapes, causality, loss, dtypes, router bias semantics, attention pieces."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import apply_on_one_device, loss_on_one_device, tiny_model
from moelab.config import ModelConfig, MoEConfig
from moelab.model import transformer
from moelab.model.moe import build_moe
from moelab.model.router import route

B, S = 2, 8

CFG = tiny_model(seq_len=S, z_loss_weight=1e-3,
                 moe={"num_shared_experts": 2, "shared_expert_dim": 8, "latent_dim": 16,
                      "capacity_factor": 1.0,  # tight, so some tests see drops
                      "dispatch": "capacity"})

# One jitted function per (cfg, dtype): tests that share CFG share its compilation.
loss_and_grad = jax.jit(
    jax.value_and_grad(loss_on_one_device, has_aux=True), static_argnames=("cfg", "compute_dtype")
)
forward = jax.jit(apply_on_one_device, static_argnames=("cfg", "compute_dtype"))


def _with_moe(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **changes))


def _tokens(key: jax.Array, cfg: ModelConfig = CFG, length: int = S + 1) -> jax.Array:
    return jax.random.randint(key, (B, length), 0, cfg.vocab_size, dtype=jnp.int32)


def test_params_have_the_documented_keys_shapes_and_dtype():
    L, D, V, E = CFG.num_layers, CFG.d_model, CFG.vocab_size, CFG.moe.num_experts
    NH, KH, Dl, F = CFG.num_heads * CFG.resolved_head_dim, CFG.num_kv_heads * CFG.resolved_head_dim, 16, 16
    Fs = 2 * 8
    want = {
        "embed": (V, D),
        "final_norm": (D,),
        "lm_head": (D, V),
        "layers": {
            "attn_norm": (L, D),
            "w_q": (L, D, NH),
            "w_k": (L, D, KH),
            "w_v": (L, D, KH),
            "w_o": (L, NH, D),
            "mlp_norm": (L, D),
            "w_router": (L, D, E),
            "w_gate": (L, E, Dl, F),
            "w_up": (L, E, Dl, F),
            "w_down": (L, E, F, Dl),
            "w_latent_down": (L, D, Dl),
            "latent_norm": (L, Dl),
            "w_latent_up": (L, Dl, D),
            "w_shared_gate": (L, D, Fs),
            "w_shared_up": (L, D, Fs),
            "w_shared_down": (L, Fs, D),
        },
    }
    params = transformer.init(CFG, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, params) == want
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    np.testing.assert_array_equal(params["layers"]["attn_norm"], 1.0)
    # Layers are initialised independently, not copies of one another.
    assert not np.allclose(params["layers"]["w_q"][0], params["layers"]["w_q"][1])


def test_params_without_latent_or_shared_experts_leave_those_keys_out():
    cfg = _with_moe(CFG, latent_dim=None, num_shared_experts=0)
    layers = transformer.init(cfg, jax.random.key(0))["layers"]
    assert not {k for k in layers if "latent" in k or "shared" in k}
    assert layers["w_gate"].shape == (cfg.num_layers, 4, cfg.d_model, 16)


def test_init_depends_only_on_the_key():
    a, b = transformer.init(CFG, jax.random.key(3)), transformer.init(CFG, jax.random.key(3))
    c = transformer.init(CFG, jax.random.key(4))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a["embed"], c["embed"])


def test_router_bias_starts_at_zero_with_one_row_per_layer():
    bias = transformer.init_router_bias(CFG)
    assert bias.shape == (CFG.num_layers, CFG.moe.num_experts) and bias.dtype == jnp.float32
    assert not np.any(bias)


@pytest.mark.parametrize("backend", ["dense", "capacity", "dropless"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(backend):
    """Holds for `capacity` too: within an expert earlier tokens win, so a later token cannot evict one."""
    cfg = _with_moe(CFG, dispatch=backend)
    params = transformer.init(cfg, jax.random.key(0))
    tokens = _tokens(jax.random.key(1), length=S)
    p = S // 2
    edited = tokens.at[0, p].set((tokens[0, p] + 1) % cfg.vocab_size)
    bias = transformer.init_router_bias(cfg)
    logits, _ = forward(params, tokens, cfg, bias)
    logits_edited, _ = forward(params, edited, cfg, bias)
    np.testing.assert_array_equal(logits[0, :p], logits_edited[0, :p])
    assert not np.allclose(logits[0, p], logits_edited[0, p])
    if backend != "capacity":
        # Sequences are independent. Under `capacity` they are not: a token of row 0 can take an expert
        # slot that a token of row 1 (later in the flattened batch) would have had.
        np.testing.assert_array_equal(logits[1], logits_edited[1])


def test_loss_at_init_is_close_to_log_vocab_size():
    params = transformer.init(CFG, jax.random.key(0))
    (loss, aux), _ = loss_and_grad(params, _tokens(jax.random.key(1)), CFG, transformer.init_router_bias(CFG))
    # Small init makes the logits nearly uniform: CE ~ log V plus the logits' variance / 2 (~1e-2 here).
    assert abs(float(aux["ce"]) - math.log(CFG.vocab_size)) < 0.05
    assert abs(float(loss) - math.log(CFG.vocab_size)) < 0.1


def test_loss_is_cross_entropy_plus_weighted_z_loss_and_aux_has_every_statistic():
    params = transformer.init(CFG, jax.random.key(0))
    (loss, aux), _ = loss_and_grad(params, _tokens(jax.random.key(2)), CFG, transformer.init_router_bias(CFG))
    L, E, k = CFG.num_layers, CFG.moe.num_experts, CFG.moe.num_experts_per_token
    assert {"ce", "z_loss", "ce_per_row", "expert_load", "dropped", "drop_fraction"} <= set(aux)
    assert all(v.dtype == jnp.float32 for v in aux.values())
    assert aux["ce_per_row"].shape == (B,) and aux["expert_load"].shape == (L, E) and aux["dropped"].shape == (L,)
    np.testing.assert_allclose(loss, aux["ce"] + CFG.z_loss_weight * aux["z_loss"], rtol=1e-6)
    np.testing.assert_allclose(np.mean(aux["ce_per_row"]), aux["ce"], rtol=1e-6)
    np.testing.assert_array_equal(np.sum(aux["expert_load"], axis=1), B * S * k)
    np.testing.assert_allclose(aux["drop_fraction"], np.sum(aux["dropped"]) / (L * B * S * k), rtol=1e-6)


def test_z_loss_is_the_mean_squared_log_partition():
    params = transformer.init(CFG, jax.random.key(0))
    tokens = _tokens(jax.random.key(2))
    bias = transformer.init_router_bias(CFG)
    (_, aux), _ = loss_and_grad(params, tokens, CFG, bias)
    logits, _ = forward(params, tokens[:, :-1], CFG, bias)
    lse = jax.nn.logsumexp(np.asarray(logits, np.float64), axis=-1)
    np.testing.assert_allclose(aux["z_loss"], np.mean(lse**2), rtol=1e-5)


@pytest.mark.slow
def test_bfloat16_compute_is_close_to_float32():
    """`slow` (issue 27): the model compiled in both dtypes, ~16 s on 2 cores; the fast suite keeps bf16
    dispatch bit-identical with and without the fused gather (test_dispatch)."""
    params = transformer.init(CFG, jax.random.key(0))
    # Larger weights than at init so the loss depends on the network, not just log V.
    params = jax.tree.map(lambda p: 5.0 * p, params)
    tokens, bias = _tokens(jax.random.key(1)), transformer.init_router_bias(CFG)
    (loss32, _), grads32 = loss_and_grad(params, tokens, CFG, bias, jnp.float32)
    (loss16, aux16), grads16 = loss_and_grad(params, tokens, CFG, bias, jnp.bfloat16)
    assert loss16.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in aux16.values())
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))  # params stay float32
    # bfloat16 keeps 8 mantissa bits (~0.4% per rounding); the loss averages many of them.
    assert abs(float(loss16) - float(loss32)) / float(loss32) < 1e-2
    logits16, _ = jax.eval_shape(functools.partial(apply_on_one_device, cfg=CFG, compute_dtype=jnp.bfloat16),
                                 params, tokens[:, :-1], router_bias=bias)
    assert logits16.dtype == jnp.float32


@pytest.mark.parametrize("router_score", ["sigmoid", "softmax"])
def test_router_combine_weights_sum_to_routed_scaling(router_score):
    cfg = MoEConfig(num_experts=8, num_experts_per_token=3, router_score=router_score, routed_scaling=2.5)
    x = jax.random.normal(jax.random.key(0), (32, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8))
    routing = route(x, w, jnp.zeros((8,)), cfg)
    np.testing.assert_allclose(np.sum(routing.weights, axis=-1), 2.5, rtol=1e-6)
    assert routing.expert_idx.dtype == jnp.int32 and routing.weights.dtype == jnp.float32
    # Without renormalization the weights are the chosen scores, scaled.
    raw = route(x, w, jnp.zeros((8,)), dataclasses.replace(cfg, normalize_weights=False))
    chosen = np.take_along_axis(np.asarray(raw.scores), np.asarray(raw.expert_idx), axis=-1)
    np.testing.assert_allclose(raw.weights, 2.5 * chosen, rtol=1e-6)


@pytest.mark.parametrize("router_score", ["sigmoid", "softmax"])
def test_router_bias_changes_the_selection_but_weights_stay_the_unbiased_scores(router_score):
    cfg = MoEConfig(num_experts=8, num_experts_per_token=2, router_score=router_score)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8))
    plain = route(x, w, jnp.zeros((8,)), cfg)
    favoured = route(x, w, jnp.zeros((8,)).at[5].set(10.0), cfg)  # larger than any score gap
    assert not np.all(np.any(np.asarray(plain.expert_idx) == 5, axis=-1))
    assert np.all(np.asarray(favoured.expert_idx)[:, 0] == 5)
    np.testing.assert_array_equal(favoured.scores, plain.scores)
    chosen = np.take_along_axis(np.asarray(favoured.scores), np.asarray(favoured.expert_idx), axis=-1)
    np.testing.assert_allclose(favoured.weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_a_bias_that_keeps_the_selection_changes_neither_loss_nor_gradients():
    """A per-layer constant bias shifts every expert equally, so top-k is unchanged; since the weights
    use unbiased scores, the loss and every parameter gradient must be identical."""
    params = transformer.init(CFG, jax.random.key(0))
    tokens = _tokens(jax.random.key(1))
    zero = transformer.init_router_bias(CFG)
    shifted = zero + jnp.array([[0.5], [-0.25]])
    (loss0, aux0), grads0 = loss_and_grad(params, tokens, CFG, zero)
    (loss1, aux1), grads1 = loss_and_grad(params, tokens, CFG, shifted)
    np.testing.assert_array_equal(aux0["expert_load"], aux1["expert_load"])
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for g0, g1 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-9)


def test_router_bias_receives_no_gradient():
    params = transformer.init(CFG, jax.random.key(0))
    bias = 0.1 * jax.random.normal(jax.random.key(5), (CFG.num_layers, CFG.moe.num_experts))
    grad_bias = jax.jit(jax.grad(lambda b: transformer.loss(params, _tokens(jax.random.key(1)), CFG, b,
                                                          dispatch=build_moe(CFG))[0]))(bias)
    np.testing.assert_array_equal(grad_bias, 0.0)


def _naive_causal_gqa(q, k, v):
    """softmax(q k^T / sqrt(H) + causal mask) v with each K/V head repeated for its query group."""
    N, K = q.shape[2], k.shape[2]
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    S = q.shape[1]
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", p, v)


def test_grouped_query_attention_matches_a_reference_with_repeated_kv_heads():
    params = transformer.init(CFG, jax.random.key(0))
    layer = jax.tree.map(lambda a: 10.0 * a[0], params["layers"])  # larger scores: a sharper softmax
    x = jax.random.normal(jax.random.key(1), (B, S, CFG.d_model))
    out = transformer.attention(layer, x, CFG, jnp.float32)

    N, K, H = CFG.num_heads, CFG.num_kv_heads, CFG.resolved_head_dim
    xn = np.asarray(x, np.float64)
    q = (xn @ np.asarray(layer["w_q"], np.float64)).reshape(B, S, N, H)
    k = (xn @ np.asarray(layer["w_k"], np.float64)).reshape(B, S, K, H)
    v = (xn @ np.asarray(layer["w_v"], np.float64)).reshape(B, S, K, H)
    q = np.asarray(transformer.apply_rope(jnp.asarray(q, jnp.float32), CFG.rope_theta), np.float64)
    k = np.asarray(transformer.apply_rope(jnp.asarray(k, jnp.float32), CFG.rope_theta), np.float64)
    ref = _naive_causal_gqa(q, k, v).reshape(B, S, N * H) @ np.asarray(layer["w_o"], np.float64)
    # float32 against a float64 reference: rounding of ~1e-7 per op through a few matmuls.
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.max(np.abs(ref)))


def test_rope_query_key_products_depend_only_on_relative_position():
    """With the same vector at every position, q_i . k_j after RoPE must be a function of i - j."""
    H = 8
    q = jnp.broadcast_to(jax.random.normal(jax.random.key(0), (H,)), (1, S, 1, H))
    k = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (H,)), (1, S, 1, H))
    q_rot, k_rot = transformer.apply_rope(q, 100.0)[0, :, 0], transformer.apply_rope(k, 100.0)[0, :, 0]
    scores = np.einsum("qh,kh->qk", q_rot, k_rot)  # [S, S]
    for offset in range(-S + 1, S):
        diagonal = np.diagonal(scores, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.diagonal(scores, 0)[0], np.diagonal(scores, 1)[0])  # it does rotate


def test_a_few_adam_steps_fit_a_fixed_batch():
    params = transformer.init(CFG, jax.random.key(0))
    tokens, bias = _tokens(jax.random.key(1)), transformer.init_router_bias(CFG)
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    losses = []
    for _ in range(30):
        (loss, _), grads = loss_and_grad(params, tokens, CFG, bias)
        updates, opt_state = opt.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


def test_lm_head_backward_is_autodiffs_in_float32_and_runs_in_bfloat16_under_bf16():
    """Issue 39: the head's backward matmuls took the float32 cotangent of the logits (tf32 on a GPU)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 3, 16), jnp.float32)
    w = jax.random.normal(kw, (16, 40), jnp.float32)
    g = jax.random.normal(kg, (2, 3, 40), jnp.float32)

    def plain(x, w):
        return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)

    ours, reference = jax.vjp(transformer.lm_head, x, w), jax.vjp(plain, x, w)
    np.testing.assert_array_equal(ours[0], reference[0])
    for a, b in zip(ours[1](g), reference[1](g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w, g: jax.vjp(transformer.lm_head, x, w)[1](g))(xb, wb, g)
    dots = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)
    dx, dw = jax.vjp(transformer.lm_head, xb, wb)[1](g)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
    exact = jax.vjp(plain, xb.astype(jnp.float32), wb.astype(jnp.float32))[1](g)
    for a, b in zip((dx, dw), exact):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05)


def test_attention_biases_start_at_zero_are_counted_undecayed_and_monitored():
    """`model.attention_bias` (GLM-4.5's): q / k / v biases of the projections' widths, zero at init (the model at
    init is the unbiased one), counted by `accounting`, left out of weight decay like the norms' gains, and in the
    monitor's attention group. The forward with biases is held to transformers' in test_hf_import."""
    from moelab import accounting
    from moelab.train.monitor import group_norms
    from moelab.train.state import decay_mask

    cfg = tiny_model(attention_bias=True)
    params = jax.eval_shape(lambda: transformer.init(cfg, jax.random.key(0)))
    layer = params["layers"]
    N, K, H, L = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.num_layers
    assert (layer["b_q"].shape, layer["b_k"].shape, layer["b_v"].shape) == ((L, N * H), (L, K * H), (L, K * H))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(params)) == accounting.count_params(cfg).total
    assert not any(decay_mask(params)["layers"][f"b_{x}"] for x in "qkv")
    init = transformer.init(cfg, jax.random.key(0))
    assert not any(np.any(np.asarray(init["layers"][f"b_{x}"])) for x in "qkv")
    assert "norm/params/attention" in group_norms(init, "params")
