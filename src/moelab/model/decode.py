"""Decoding: greedy samples of fixed prompts at each eval, and sampling with a KV cache (`moelab generate`).

    prompts = sample_prompts(corpus.heldout, cfg.model.seq_len)
    decode, _ = make_greedy_decode(cfg.model, len(next(iter(prompts.values()))), tokenizer.vocab_size, jnp.bfloat16)
    rows = generate_samples(decode, params, router_bias, prompts, tokenizer, step)

Each domain's prompt is the first tokens of its held-out stream. The model continues them greedily,
one full forward of [domains, seq_len] per new token inside one jitted `fori_loop`; no KV cache is
needed at the sizes this runs at.

`moelab generate` decodes with a KV cache instead: `make_sampler` returns a jitted `prefill` (the
whole prompt in one forward, filling the cache) and a jitted `step` (one token in, the next out), so
each new token costs one position's forward, not the whole sequence's:

    sampler = make_sampler(cfg, Sampling(temperature=0.8, top_p=0.95), vocab_size)
    cache, token = sampler.prefill(params, router_bias, prompt_ids, key)    # prompt_ids [B, P]
    cache, token = sampler.step(params, router_bias, cache, token, key)     # and so on, to eos

Routed experts decode through `dropless` dispatch: a capacity buffer sized for a training batch
would drop tokens of a one-token batch's expert whenever two of its k choices collide (and a dropped
token changes the text), so decoding never drops.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.errors import DataError
from moelab.model import transformer
from moelab.model.layers import rms_norm
from moelab.model.moe import build_moe

__all__ = ["sample_prompts", "make_greedy_decode", "generate_samples", "PROMPT_TOKENS", "CONTINUATION_TOKENS",
           "EOS_MARK", "KVCache", "Sampling", "Sampler", "init_cache", "apply_cached", "sample_token", "make_sampler",
           "prefill_length", "check_prompt", "generate"]

PROMPT_TOKENS = 32  # per domain, clipped to seq_len // 2
CONTINUATION_TOKENS = 48  # greedy tokens per sample, clipped to what is left of seq_len
EOS_MARK = " <eos> "  # shown where a sample ends a document; the byte tokenizer would drop eos silently


def sample_prompts(heldout: Mapping[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """The fixed prompt of each domain: the first min(PROMPT_TOKENS, seq_len // 2) tokens of its held-out stream."""
    length = max(1, min(PROMPT_TOKENS, seq_len // 2))
    return {d: np.asarray(stream[:length], dtype=np.int32) for d, stream in heldout.items()}


def make_greedy_decode(cfg: ModelConfig, prompt_len: int, vocab_size: int, compute_dtype: jnp.dtype = jnp.float32
                       ) -> tuple[Callable[[Any, jax.Array, jax.Array], jax.Array], int]:
    """A jitted `decode(params, router_bias, prompts [N, prompt_len]) -> [N, num_new]` and `num_new`.

    Each new token is the argmax over the first `vocab_size` logits (the tokenizer's ids; a padded
    model vocabulary has ids no tokenizer decodes) at the last filled position of a [N, seq_len] buffer.
    Positions past it hold 0s, which causal attention never lets the filled ones see. The routed experts run
    as every decode does (`build_moe`'s `decode`: one device, no token dropped), whatever the training dispatch.
    """
    dispatch = build_moe(cfg, purpose="decode")
    seq_len = cfg.seq_len
    num_new = max(0, min(CONTINUATION_TOKENS, seq_len - prompt_len))
    valid = jnp.arange(cfg.vocab_size) < vocab_size

    def decode(params, router_bias, prompts):
        n = prompts.shape[0]
        buf = jnp.zeros((n, seq_len), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(i, buf):
            logits, _ = transformer.apply(params, buf, cfg, router_bias, compute_dtype, dispatch=dispatch)
            last = jax.lax.dynamic_index_in_dim(logits, prompt_len + i - 1, axis=1, keepdims=False)  # [N, V]
            token = jnp.argmax(jnp.where(valid, last, -jnp.inf), axis=-1).astype(jnp.int32)
            return jax.lax.dynamic_update_index_in_dim(buf, token[:, None], prompt_len + i, axis=1)

        buf = jax.lax.fori_loop(0, num_new, body, buf)
        return buf[:, prompt_len:prompt_len + num_new]

    return jax.jit(decode), num_new


def _decode_text(tokenizer, ids: np.ndarray) -> str:
    """Decoded text with EOS_MARK where a document ends."""
    ids = np.asarray(ids)
    cuts = np.flatnonzero(ids == tokenizer.eos_id)
    pieces = np.split(ids, cuts)
    return EOS_MARK.join(tokenizer.decode(p[p != tokenizer.eos_id]) for p in pieces)


def generate_samples(decode: Callable, params, router_bias, prompts: dict[str, np.ndarray], tokenizer,
                     step: int) -> list[dict]:
    """One eval's samples: rows {"step", "domain", "prompt", "continuation"}, one per domain."""
    domains = list(prompts)
    new = np.asarray(jax.device_get(decode(params, router_bias, jnp.asarray(np.stack(list(prompts.values()))))))
    return [{"step": step, "domain": d, "prompt": _decode_text(tokenizer, prompts[d]),
             "continuation": _decode_text(tokenizer, new[i])} for i, d in enumerate(domains)]


# ----------------------------------------------------------------------------------------------
# sampling with a KV cache


class KVCache(NamedTuple):
    """Keys and values of every position filled so far, for every layer."""

    k: jax.Array  # [L, B, S, K, H] in the compute dtype; S = model.seq_len
    v: jax.Array  # [L, B, S, K, H]
    length: jax.Array  # [] int32: positions 0..length-1 hold real tokens


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 1.0  # 0: greedy (argmax); else logits / temperature
    top_k: int | None = None  # None: every token; else only the k most likely
    top_p: float | None = None  # None: every token; else the smallest set holding this much probability

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy).")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1].")


def init_cache(cfg: ModelConfig, batch: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
    """An empty cache for `batch` sequences of up to `cfg.seq_len` positions."""
    shape = (cfg.num_layers, batch, cfg.seq_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def _cached_attention(layer: dict[str, jax.Array], x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                      start: jax.Array, cfg: ModelConfig, compute_dtype: jnp.dtype
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`transformer.attention` for T new rows at positions start..start+T-1, against the cache.

    Args:
        x: [B, T, D] normalized input; k_cache, v_cache: [B, S, K, H] of this layer.

    Returns:
        [B, T, D] float32 and the caches with the new rows' keys and values written in.
    """
    B, T, _ = x.shape
    N, K, H, S = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.seq_len
    x = x.astype(compute_dtype)
    w = {name: layer[name].astype(compute_dtype) for name in ("w_q", "w_k", "w_v", "w_o")}
    bias = transformer.with_bias
    q, k = transformer.qk_norm(layer, bias(layer, "b_q", jnp.einsum("btd,dh->bth", x, w["w_q"])),
                               bias(layer, "b_k", jnp.einsum("btd,dh->bth", x, w["w_k"])), cfg)
    q, k = q.reshape(B, T, N, H), k.reshape(B, T, K, H)
    v = bias(layer, "b_v", jnp.einsum("btd,dh->bth", x, w["w_v"])).reshape(B, T, K, H)
    q = transformer.apply_rope(q, cfg.rope_theta, start, cfg.rope_fraction)
    k = transformer.apply_rope(k, cfg.rope_theta, start, cfg.rope_fraction)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
    # Row i (position start + i) sees keys 0..start+i. Cache rows past that hold zeros or stale padding,
    # and are always rewritten before the mask lets anyone see them.
    visible = jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None]  # [T, S]
    o = jax.nn.dot_product_attention(q, k_cache.astype(compute_dtype), v_cache.astype(compute_dtype),
                                     mask=visible[None, None])
    return jnp.einsum("bth,hd->btd", o.reshape(B, T, N * H), w["w_o"]).astype(jnp.float32), k_cache, v_cache


def apply_cached(params, tokens: jax.Array, cfg: ModelConfig, router_bias: jax.Array, cache: KVCache,
                 compute_dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, KVCache]:
    """`transformer.apply` for T new tokens after the `cache.length` cached ones; routed experts without drops.

    Args:
        tokens: [B, T] int32 at positions cache.length .. cache.length + T - 1 (< cfg.seq_len).

    Returns:
        logits [B, T, V] float32 and the cache grown by T.
    """
    start = cache.length
    dense, routed = transformer.mlps(cfg, compute_dtype, build_moe(cfg, purpose="decode"))

    def block(mlp, x, layer_bias_kv):
        layer, bias, k_cache, v_cache = layer_bias_kv
        B, T, D = x.shape
        attn, k_cache, v_cache = _cached_attention(layer, rms_norm(x, layer["attn_norm"], cfg.norm_eps), k_cache,
                                                   v_cache, start, cfg, compute_dtype)
        x = x + attn
        y, _ = mlp(layer, rms_norm(x, layer["mlp_norm"], cfg.norm_eps).reshape(B * T, D), bias)
        return x + y.reshape(B, T, D), (k_cache, v_cache)

    x = params["embed"][tokens]
    Ld = cfg.dense_layers  # the cache's first Ld layers are the dense blocks'
    ks, vs = [], []
    if Ld:
        x, (k, v) = jax.lax.scan(functools.partial(block, dense), x,
                                 (params["dense_layers"], None, cache.k[:Ld], cache.v[:Ld]))
        ks, vs = [k], [v]
    x, (k, v) = jax.lax.scan(functools.partial(block, routed), x, (params["layers"], router_bias, cache.k[Ld:],
                                                                    cache.v[Ld:]))
    k, v = (jnp.concatenate([*ks, k]), jnp.concatenate([*vs, v])) if Ld else (k, v)
    x = rms_norm(x, params["final_norm"], cfg.norm_eps).astype(compute_dtype)
    logits = transformer.lm_head(x, params["lm_head"].astype(compute_dtype))
    return logits, KVCache(k, v, start + tokens.shape[1])


def sample_token(logits: jax.Array, key: jax.Array, sampling: Sampling, vocab_size: int) -> jax.Array:
    """The next token [B] int32 from logits [B, V]; ids >= `vocab_size` (a padded vocabulary) are never drawn.

    Top-k keeps the k largest logits; top-p then keeps the most likely tokens until their probability
    reaches p (the token that crosses p included, so at least one is left).
    """
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits.astype(jnp.float32), -jnp.inf)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p  # mass before this token < p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill_length(prompt_len: int, seq_len: int) -> int:
    """The padded prompt length `prefill` compiles for: the next power of two (at least 8), at most seq_len,
    so prompts of many lengths share a few compiled programs."""
    return min(seq_len, max(8, 1 << (prompt_len - 1).bit_length()))


class Sampler(NamedTuple):
    """Jitted KV-cache decoding of one model (`make_sampler`)."""

    prefill: Callable  # (params, router_bias, prompt [B, P], key) -> (cache, first new token [B])
    step: Callable  # (params, router_bias, cache, token [B], key) -> (cache, next token [B])


def make_sampler(cfg: ModelConfig, sampling: Sampling, vocab_size: int,
                 compute_dtype: jnp.dtype = jnp.float32) -> Sampler:
    """`prefill` and `step` for `cfg`, drawing tokens by `sampling` among the tokenizer's `vocab_size` ids.

    `prefill` pads the prompt on the right to `prefill_length` (the padding's keys sit past the cache's
    length, where the mask hides them until real tokens overwrite them) and returns the cache filled
    with the P prompt tokens. Compile once per padded length; `step` compiles once.
    """

    def prefill(params, router_bias, prompt, key):
        B, P = prompt.shape
        padded = jnp.zeros((B, prefill_length(P, cfg.seq_len)), jnp.int32).at[:, :P].set(prompt)
        logits, cache = apply_cached(params, padded, cfg, router_bias, init_cache(cfg, B, compute_dtype),
                                     compute_dtype)
        return cache._replace(length=jnp.asarray(P, jnp.int32)), sample_token(logits[:, P - 1], key, sampling,
                                                                             vocab_size)

    def step(params, router_bias, cache, token, key):
        logits, cache = apply_cached(params, token[:, None], cfg, router_bias, cache, compute_dtype)
        return cache, sample_token(logits[:, 0], key, sampling, vocab_size)

    return Sampler(jax.jit(prefill), jax.jit(step, donate_argnums=(2,)))


def check_prompt(prompt: np.ndarray, seq_len: int, eos_id: int, source: str = "the prompt") -> np.ndarray:
    """The prompt's ids as `generate` decodes them: [eos] for an empty one; DataError naming `source` if it
    does not leave room for one new token in the model's context."""
    prompt = np.asarray(prompt, np.int32).ravel()
    if prompt.size == 0:
        return np.asarray([eos_id], np.int32)
    if prompt.size >= seq_len:
        raise DataError(f"{source} is {prompt.size} tokens; the model's context (model.seq_len) is {seq_len}, so a "
                        f"prompt may have at most {seq_len - 1}. Shorten it (keep its last part) and run again.")
    return prompt


def generate(sampler: Sampler, params, router_bias, prompt: np.ndarray, *, seq_len: int, max_new_tokens: int,
             eos_id: int, seed: int, source: str = "the prompt") -> Iterator[int]:
    """The new tokens of one prompt, one at a time as they are drawn; stops at eos (not yielded).

    An empty prompt starts from eos (every training document follows one). A prompt of seq_len tokens
    or more is refused (DataError naming `source`): the model has never seen a position past
    seq_len, and cutting the prompt silently would answer another question. `max_new_tokens` past
    the context is cut to what fits, with a warning. Token i is drawn with `fold_in(key(seed), i)`:
    the same seed gives the same text.
    """
    prompt = check_prompt(prompt, seq_len, eos_id, source)
    room = seq_len - prompt.size
    if max_new_tokens > room:
        warnings.warn(f"{source}: --max-new-tokens {max_new_tokens} does not fit the context of {seq_len} after "
                      f"{prompt.size} prompt tokens; generating at most {room}.", stacklevel=2)
        max_new_tokens = room
    if max_new_tokens <= 0:
        return
    key = jax.random.key(seed)
    cache, token = sampler.prefill(params, router_bias, jnp.asarray(prompt[None]), jax.random.fold_in(key, 0))
    for i in range(max_new_tokens):
        value = int(token[0])
        if value == eos_id:
            return
        yield value
        if i + 1 < max_new_tokens:
            cache, token = sampler.step(params, router_bias, cache, token, jax.random.fold_in(key, i + 1))
