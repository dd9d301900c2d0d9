"""Greedy decoding for intermediate samples: fixed prompts, continued by the model at each eval.

    prompts = sample_prompts(corpus.heldout, cfg.model.seq_len)
    decode, _ = make_greedy_decode(cfg.model, len(next(iter(prompts.values()))), tokenizer.vocab_size, jnp.bfloat16)
    rows = generate_samples(decode, params, router_bias, prompts, tokenizer, step)

Each domain's prompt is the first tokens of its held-out stream. The model continues them greedily,
one full forward of [domains, seq_len] per new token inside one jitted `fori_loop`; no KV cache is
needed at the sizes this runs at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.model import transformer

__all__ = ["sample_prompts", "make_greedy_decode", "generate_samples", "PROMPT_TOKENS", "CONTINUATION_TOKENS",
           "EOS_MARK"]

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
    Positions past it hold 0s, which causal attention never lets the filled ones see. The `ep` dispatch
    needs a mesh-bound backend, so samples route with `capacity`, the same routing without the mesh.
    """
    if cfg.moe.dispatch == "ep":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="capacity"))
    seq_len = cfg.seq_len
    num_new = max(0, min(CONTINUATION_TOKENS, seq_len - prompt_len))
    valid = jnp.arange(cfg.vocab_size) < vocab_size

    def decode(params, router_bias, prompts):
        n = prompts.shape[0]
        buf = jnp.zeros((n, seq_len), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(i, buf):
            logits, _ = transformer.apply(params, buf, cfg, router_bias, compute_dtype)
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
