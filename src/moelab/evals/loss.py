"""Loss, perplexity and bits per byte of a run on any text: the user's files, a data section's domains.

    docs = domain_documents(read_data_yaml("my-data.yaml"))          # {domain: [text, ...]}
    scores = evaluate_documents(load_run("runs/tiny"), docs)        # {domain: DomainScore}

Each domain's documents become one token stream, every document preceded by eos as in training
(`[eos] doc1 [eos] doc2 ...`), cut into windows of seq_len + 1 tokens that overlap by one: each
token after the leading eos is predicted exactly once, with as much of its own window before it
as the cut leaves. Per domain:

    loss = sum of next-token cross-entropies (nats) / predicted tokens      (eos predictions included)
    perplexity = exp(loss)
    bits per byte = sum of cross-entropies / ln 2 / UTF-8 bytes of the documents

Bits per byte does not depend on the tokenizer, so runs with other vocabularies compare on it. The
routed experts run `dropless` (no token dropped, whatever the training dispatch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import DataConfig, ModelConfig
from moelab.data.sources import iter_documents
from moelab.errors import DataError
from moelab.model import transformer
from moelab.model.moe import build_moe

__all__ = ["DomainScore", "domain_documents", "token_stream", "windows", "make_token_losses", "make_token_scores",
           "evaluate_documents"]


class DomainScore(NamedTuple):
    loss: float  # mean nats per predicted token
    perplexity: float
    bits_per_byte: float
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes of the documents
    documents: int  # documents scored (with --max-tokens, those the kept tokens reach)


def domain_documents(cfg: DataConfig) -> dict[str, list[str]]:
    """Every document of each of `cfg`'s domains (user files in full; embedded ones up to max_bytes_per_domain)."""
    return {d.name: list(iter_documents(d, cfg.max_bytes_per_domain, cfg.seed, cfg.arithmetic_digits))
            for d in cfg.domains}


def token_stream(tokenizer: Any, documents: Sequence[str]) -> np.ndarray:
    """`[eos] doc1 [eos] doc2 ...` as int32 ids."""
    pieces = []
    for ids in tokenizer.encode_batch(list(documents)):
        pieces += [np.asarray([tokenizer.eos_id], np.int32), np.asarray(ids, np.int32)]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows [n, seq_len + 1] overlapping by one token, and a mask [n, seq_len] of the targets that are real
    (the last window is padded)."""
    predicted = len(stream) - 1
    n = max(1, math.ceil(predicted / seq_len))
    padded = np.zeros(n * seq_len + 1, np.int32)
    padded[:len(stream)] = stream
    starts = np.arange(n) * seq_len
    rows = padded[starts[:, None] + np.arange(seq_len + 1)[None, :]]
    mask = (starts[:, None] + 1 + np.arange(seq_len)[None, :]) <= predicted
    return rows, mask


def make_token_losses(cfg: ModelConfig) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """A jitted `losses(params, router_bias, tokens [B, S+1]) -> [B, S]`: each target's cross-entropy in nats,
    with the routed experts `dropless`."""
    dispatch = build_moe(cfg, purpose="decode")

    def losses(params, router_bias, tokens):
        logits, _ = transformer.apply(params, tokens[:, :-1], cfg, router_bias, dispatch=dispatch)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]

    return jax.jit(losses)


def make_token_scores(cfg: ModelConfig, vocab_size: int) -> Callable[[Any, jax.Array, jax.Array], tuple]:
    """A jitted `scores(params, router_bias, tokens [B, S+1]) -> (nats [B, S], target is the argmax [B, S])`,
    logits past the tokenizer's `vocab_size` masked out (a padded vocabulary must not win a greedy pick);
    the routed experts `dropless`. What task scoring needs: a continuation's loss and whether greedy
    decoding would write it."""
    dispatch = build_moe(cfg, purpose="decode")

    def scores(params, router_bias, tokens):
        logits, _ = transformer.apply(params, tokens[:, :-1], cfg, router_bias, dispatch=dispatch)
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
        targets = tokens[:, 1:]
        nats = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return nats, jnp.argmax(logits, axis=-1) == targets

    return jax.jit(scores)


def evaluate_documents(run: Any, documents: Mapping[str, Sequence[str]], *, batch_size: int = 8,
                       max_tokens: int | None = None,
                       on_batch: Callable[[str, int, int], None] | None = None) -> dict[str, DomainScore]:
    """Score a run (`moelab.train.weights.RunWeights`) on each domain's documents.

    Args:
        documents: {domain: [text, ...]}.
        batch_size: windows per forward (the last batch is padded to it, so one program compiles).
        max_tokens: score at most this many tokens per domain (the first ones); None: all. The bytes and
            documents then count only what those tokens cover (a document cut short counts once).
        on_batch: called as (domain, batches done, batches in the domain) after each forward.
    """
    cfg = run.cfg.model
    losses = make_token_losses(cfg)
    scores = {}
    for domain, docs in documents.items():
        docs = [d for d in docs if d]
        if not docs:
            raise DataError(f"domain {domain} has no text to evaluate; give it a non-empty file.")
        stream = token_stream(run.tokenizer, docs)
        num_docs = len(docs)
        if max_tokens is not None and len(stream) > max_tokens + 1:
            stream = stream[:max_tokens + 1]
            text = run.tokenizer.decode(stream)  # the bytes the kept tokens stand for
            num_bytes = len(text.encode("utf-8"))
            # Each document starts after an eos; it is scored if a token after its eos is still a target.
            num_docs = int(np.count_nonzero(stream[:-1] == run.tokenizer.eos_id))
        else:
            num_bytes = sum(len(d.encode("utf-8")) for d in docs)
        rows, mask = windows(stream, cfg.seq_len)
        total, num_batches = 0.0, math.ceil(len(rows) / batch_size)
        for b in range(num_batches):
            chunk, keep = rows[b * batch_size:(b + 1) * batch_size], mask[b * batch_size:(b + 1) * batch_size]
            pad = batch_size - len(chunk)
            chunk = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), np.int32)])
            keep = np.concatenate([keep, np.zeros((pad, keep.shape[1]), bool)])
            nats = np.asarray(losses(run.params, run.router_bias, jnp.asarray(chunk)), np.float64)
            total += float(np.sum(nats[keep]))
            if on_batch is not None:
                on_batch(domain, b + 1, num_batches)
        tokens = int(mask.sum())
        loss = total / tokens
        scores[domain] = DomainScore(loss, math.exp(loss), total / math.log(2) / max(num_bytes, 1), tokens, num_bytes,
                                     num_docs)
    return scores
