"""The training mixture: a tokenized corpus with held-out splits, phases, and a sampler keyed on (seed, step).

`build_corpus` turns each domain's documents into two int32 token streams, train and held-out (whole
documents, each followed by eos). `phase_at` says which phase, and so which domain weights, a step trains
under. `sample_batch` draws a batch from those weights that depends only on (seed, step), so a resumed run
reproduces the uninterrupted one; `eval_batches` gives fixed held-out windows; `unigram_entropy` is the loss a
model that ignores context would reach, the bar a trained model must beat. `MixtureLog` publishes the
mixture as training goes (the run's `mixture_log.jsonl`). With `data.store` (or a domain's own `store`) the
streams are read window by window from token stores prepared by `moelab data prepare` (`moelab.data.store`): same
sampler, same semantics, and neither memory nor start-up grows with the corpus.

    corpus = build_corpus(cfg.data)                  # generated content from data.seed, not train.seed
    _, phase = phase_at(cfg.data, step, cfg.train.steps)
    batch = sample_batch(corpus, phase.weights, cfg.train.seed, step, cfg.train.batch_size, cfg.model.seq_len)
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moelab.config import DataConfig, PhaseConfig, RunConfig
from moelab.errors import DataError
from moelab.data.sources import load_documents
from moelab.data.store import Store, TokenStream, open_store
from moelab.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "Batch",
    "Corpus",
    "MixtureLog",
    "SNAPSHOT_MAX_INTERVAL_S",
    "allocate_rows",
    "build_corpus",
    "change_message",
    "eval_batches",
    "phase_at",
    "phase_boundaries",
    "realized_tokens",
    "sample_batch",
    "split_documents",
    "unigram_entropy",
]


class Batch(NamedTuple):
    """Training rows and the domain each came from."""

    tokens: np.ndarray  # int32 [B, seq_len + 1]: inputs are tokens[:, :-1], targets tokens[:, 1:]
    domain: np.ndarray  # int32 [B]: index into Corpus.domains


@dataclass(frozen=True, eq=False)  # eq=False: `==` on dicts of arrays would raise, so compare by identity
class Corpus:
    """Token streams per domain: each document's tokens followed by eos, concatenated in document order."""

    domains: tuple[str, ...]
    train: dict[str, np.ndarray | TokenStream]  # int32 [num_train_tokens]; or read from a token store
    heldout: dict[str, np.ndarray | TokenStream]  # int32 [num_heldout_tokens]
    tokenizer: Tokenizer
    provenance: dict | None = None  # from token stores: `store_hash` and each store's `Store.summary()`


# ----------------------------------------------------------------------------------------------
# building the corpus


def split_documents(documents: Sequence[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """Split whole documents into (train, held-out), holding out evenly spaced ones.

    `round(heldout_fraction * n)` documents are held out, at least one and at most n - 1. Evenly spaced
    picks spread the held-out set over the whole (sorted) domain, e.g. over all of the stdlib's packages,
    without a random draw.
    """
    n = len(documents)
    if n < 2:
        raise ValueError(f"need at least 2 documents to hold some out, got {n}.")
    num_heldout = min(n - 1, max(1, round(heldout_fraction * n)))
    heldout = {int((i + 0.5) * n / num_heldout) for i in range(num_heldout)}
    train_docs = [doc for i, doc in enumerate(documents) if i not in heldout]
    heldout_docs = [doc for i, doc in enumerate(documents) if i in heldout]
    return train_docs, heldout_docs


def build_corpus(cfg: DataConfig) -> Corpus:
    """Load, split and tokenize every domain of `cfg`.

    The default config (three embedded domains, 4 MB cap, byte tokenizer) builds in well under a second.
    With `tokenizer="bpe"` the BPE is trained on the train documents of all domains, never the held-out ones.
    `cfg.seed` seeds the synthetic arithmetic domain; the run's `train.seed` never reaches here, so runs
    with different seeds are evaluated on the same held-out set.

    Raises:
        DataError: a domain has fewer than two documents, or its files are bad (see `load_documents`).
    """
    if cfg.store or any(d.store for d in cfg.domains):
        return _corpus_from_stores(cfg)
    train_docs: dict[str, list[str]] = {}
    heldout_docs: dict[str, list[str]] = {}
    for domain in cfg.domains:
        documents = load_documents(domain, cfg.max_bytes_per_domain, cfg.seed, cfg.arithmetic_digits)
        if len(documents) < 2:
            raise DataError(
                f"data.domains[{domain.name}] yields {len(documents)} document(s); it needs at least 2 so that "
                "whole documents can be held out for evaluation. Add data or raise data.max_bytes_per_domain."
            )
        train_docs[domain.name], heldout_docs[domain.name] = split_documents(documents, cfg.heldout_fraction)
    tokenizer = build_tokenizer(cfg, train_docs)
    return Corpus(
        domains=tuple(train_docs),
        train={name: _tokenize(tokenizer, docs) for name, docs in train_docs.items()},
        heldout={name: _tokenize(tokenizer, docs) for name, docs in heldout_docs.items()},
        tokenizer=tokenizer,
    )


def _corpus_from_stores(cfg: DataConfig) -> Corpus:
    """The corpus read from the token stores the domains name (`data.store` or their own `store`).

    Every store must carry the same tokenizer, of the kind `data.tokenizer` names. `provenance.store_hash` is
    the one store's content hash, or with several stores a hash of each domain's store hash.

    Raises:
        DataError: a store is missing, incomplete, damaged or lacks a domain; the stores' tokenizers differ.
    """
    opened: dict[str, Store] = {}
    train, heldout = {}, {}
    for domain in cfg.domains:
        location = domain.store or cfg.store
        if location not in opened:
            opened[location] = open_store(location)
        store = opened[location]
        train[domain.name], heldout[domain.name] = store.streams(domain.name)
    hashes = {location: store.manifest["files"].get("tokenizer.json", {}).get("sha256", "byte")
              for location, store in opened.items()}
    if len(set(hashes.values())) > 1:
        raise DataError(f"the token stores {', '.join(opened)} were prepared with different tokenizers; prepare every "
                        "domain with one tokenizer (one data.tokenizer, or the same tokenizer.json).")
    store = next(iter(opened.values()))
    kind = store.manifest["tokenizer"]["kind"]
    if (kind == "byte") != (cfg.tokenizer == "byte"):
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}, but the token store {store.location} was prepared with "
                        f"{'the byte tokenizer' if kind == 'byte' else 'a Hugging Face tokenizer (its tokenizer.json)'}; "
                        "set data.tokenizer as it was when the store was prepared.")
    if len(opened) == 1:
        store_hash = store.store_hash
    else:
        per_domain = {d.name: opened[d.store or cfg.store].store_hash for d in cfg.domains}
        store_hash = hashlib.sha256(json.dumps(per_domain, sort_keys=True).encode()).hexdigest()
    provenance = {"store_hash": store_hash, "stores": [s.summary() for s in opened.values()]}
    return Corpus(domains=tuple(d.name for d in cfg.domains), train=train, heldout=heldout,
                  tokenizer=store.tokenizer(), provenance=provenance)


def _tokenize(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    return np.concatenate([part for doc in documents for part in (tokenizer.encode(doc), eos)])


# ----------------------------------------------------------------------------------------------
# phases


def phase_boundaries(cfg: DataConfig, total_steps: int) -> list[int]:
    """The first step of each phase: cumulative phase fractions of `total_steps`, rounded to the nearest step.

    With fractions 0.8 / 0.2 and 1000 steps: `[0, 800]`.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1.")
    starts, cumulative = [], 0.0
    for phase in cfg.phases:
        starts.append(round(cumulative * total_steps))
        cumulative += phase.fraction
    return starts


def phase_at(cfg: DataConfig, step: int, total_steps: int) -> tuple[int, PhaseConfig]:
    """The index and config of the phase that `step` (0-based) trains under.

    A phase whose share rounds to zero steps is skipped.
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"step={step} must be in [0, total_steps={total_steps}).")
    index = bisect.bisect_right(phase_boundaries(cfg, total_steps), step) - 1
    return index, cfg.phases[index]


# ----------------------------------------------------------------------------------------------
# sampling


def allocate_rows(weights: dict[str, float], domains: Sequence[str], batch_size: int) -> np.ndarray:
    """Rows per domain (in `domains` order) by largest remainder, so the batch's mix is as exact as it can be.

    Each domain gets floor(w * B) rows for its normalized weight w; the rows left over go to the largest
    fractional parts, ties to the earlier domain. A domain of weight 0, or missing from `weights`, gets none.
    """
    unknown = sorted(set(weights) - set(domains))
    if unknown:
        raise ValueError(f"weights name domains {unknown} that are not in the corpus ({', '.join(domains)}).")
    w = np.array([weights.get(name, 0.0) for name in domains], dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights={weights} must be non-negative with a positive sum.")
    quotas = w / w.sum() * batch_size
    rows = np.floor(quotas).astype(np.int64)
    remainders = np.where(w > 0, quotas - rows, -1.0)  # -1: a weight-0 domain never takes a leftover row
    leftover = batch_size - int(rows.sum())
    rows[np.argsort(-remainders, kind="stable")[:leftover]] += 1
    return rows


def sample_batch(
    corpus: Corpus, weights: dict[str, float], seed: int, step: int, batch_size: int, seq_len: int
) -> Batch:
    """A training batch that depends only on (seed, step): rows split by `allocate_rows`, random windows.

    Each row is a window of seq_len + 1 tokens at a uniformly random offset of its domain's train stream;
    a window may span documents (eos separates them). Rows come in random order, so any contiguous shard of
    the batch mixes domains.

    Raises:
        DataError: a domain with positive weight has fewer than seq_len + 1 train tokens.
    """
    rows = allocate_rows(weights, corpus.domains, batch_size)
    window = seq_len + 1
    for name in corpus.domains:
        if weights.get(name, 0.0) > 0 and len(corpus.train[name]) < window:
            raise DataError(
                f"domain {name} has {len(corpus.train[name])} train tokens, fewer than one row of seq_len + 1 = "
                f"{window}; add data to it, shorten model.seq_len, or give it weight 0."
            )
    rng = np.random.default_rng([seed, step])
    domain = rng.permutation(np.repeat(np.arange(len(corpus.domains), dtype=np.int32), rows))
    tokens = np.empty((batch_size, window), dtype=np.int32)
    for index, name in enumerate(corpus.domains):
        picked = np.flatnonzero(domain == index)
        if picked.size:
            stream = corpus.train[name]
            starts = rng.integers(0, len(stream) - window + 1, size=picked.size)
            tokens[picked] = stream[starts[:, None] + np.arange(window)]
    return Batch(tokens=tokens, domain=domain)


def realized_tokens(batch: Batch, domains: Sequence[str]) -> dict[str, int]:
    """Trained-on tokens per domain in `batch`: seq_len per row (the targets), every domain listed."""
    per_row = batch.tokens.shape[1] - 1
    counts = np.bincount(batch.domain, minlength=len(domains))
    return {name: int(counts[i]) * per_row for i, name in enumerate(domains)}


# ----------------------------------------------------------------------------------------------
# evaluation


def eval_batches(corpus: Corpus, domain: str, num_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """Fixed held-out windows of `domain`: `num_batches` arrays of int32 [batch_size, seq_len + 1].

    The windows start evenly spaced over the held-out stream. A stream too short for that many disjoint
    windows is read as a ring (it ends with eos, so a window across the end is still packed text), which
    repeats tokens instead of failing on tiny configs.

    Raises:
        DataError: the held-out stream has fewer than seq_len + 1 tokens.
    """
    if domain not in corpus.heldout:
        raise ValueError(f"domain {domain!r} is not in the corpus ({', '.join(corpus.domains)}).")
    stream = corpus.heldout[domain]
    window = seq_len + 1
    if len(stream) < window:
        raise DataError(
            f"domain {domain} has {len(stream)} held-out tokens, fewer than one row of seq_len + 1 = {window}; "
            "add data to it, raise data.heldout_fraction, or shorten model.seq_len."
        )
    num_windows = num_batches * batch_size
    stride = max(window, len(stream) // num_windows)
    starts = np.arange(num_windows) * stride
    windows = stream[(starts[:, None] + np.arange(window)) % len(stream)]
    return list(windows.reshape(num_batches, batch_size, window))


def unigram_entropy(corpus: Corpus, domain: str | None = None) -> float:
    """Entropy in nats/token of the held-out unigram distribution (eos included), of one domain or all.

    H = -sum_t p(t) log p(t), where p(t) is token t's share of the held-out tokens. It is the loss of the
    best model that ignores context, so a trained model's held-out loss must come in below it.
    """
    streams = [corpus.heldout[domain]] if domain is not None else [corpus.heldout[name] for name in corpus.domains]
    counts = np.bincount(np.concatenate(streams))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------------------------
# the mixture log

SNAPSHOT_MAX_INTERVAL_S = 3600.0  # a slow run still publishes its realized mixture at least hourly


def _fmt(weight: float) -> str:
    return f"{weight:.2f}"


def change_message(old: tuple[str, dict[str, float]] | None, new: tuple[str, dict[str, float]], step: int,
                   total_steps: int) -> str:
    """One line for a mixture change, e.g. "phase pretrain -> midtrain at step 240 (80% of 300 steps):
    arithmetic 0.10 -> 0.50, code 0.45 -> 0.25, prose 0.45 -> 0.25"; `old` is None for the initial mixture."""
    name, weights = new
    if old is None:
        listed = ", ".join(f"{d} {_fmt(w)}" for d, w in sorted(weights.items()))
        return f"initial mixture: phase {name} at step {step} of {total_steps}: {listed}"
    old_name, old_weights = old
    domains = sorted(set(weights) | set(old_weights))
    changed = [f"{d} {_fmt(old_weights.get(d, 0.0))} -> {_fmt(weights.get(d, 0.0))}" for d in domains
               if old_weights.get(d, 0.0) != weights.get(d, 0.0)]
    share = 100 * step / total_steps
    return (f"phase {old_name} -> {name} at step {step} ({share:.0f}% of {total_steps} steps): "
            f"{', '.join(changed) or 'weights unchanged'}")


def _rebuild_counts(cfg: RunConfig, domains: Sequence[str], steps_done: int) -> dict[str, int]:
    """Tokens per domain trained in steps 0..steps_done-1 under the current phase schedule."""
    counts = np.zeros(len(domains), dtype=np.int64)
    starts = phase_boundaries(cfg.data, cfg.train.steps) + [cfg.train.steps]
    for phase, lo, hi in zip(cfg.data.phases, starts, starts[1:]):
        num_steps = max(0, min(hi, steps_done) - lo)
        if num_steps:
            counts += num_steps * allocate_rows(phase.weights, domains, cfg.train.batch_size) * cfg.model.seq_len
    return {d: int(n) for d, n in zip(domains, counts)}


class MixtureLog:
    """The mixture log's entries as training goes: changes of phase and snapshots of realized tokens.

        {"step": 0, "kind": "change", "phase": "pretrain", "weights": {...}, "message": "initial mixture ..."}
        {"step": 100, "kind": "snapshot", "tokens": {"code": 23040, ...}, "total": 51200}

    A change at step s means steps s, s+1, ... train under the new weights. A snapshot at step s counts
    the tokens trained on (targets: seq_len per row) in steps 0..s-1 per domain, so `total` is exactly
    s * batch_size * seq_len. The loop calls `before_step(step)` (a change entry or None),
    `after_step(done, batch)` (a snapshot entry when one is due, or None) and `snapshot(done)` (one now,
    e.g. at the end). `counts` go into the checkpoint's meta as `realized_tokens`, so a resume continues
    them even if `train.steps` changed (which moves phase boundaries of the steps to come, not of the
    steps already trained); without them (`counts=None`) they are rebuilt from the phase schedule, which
    is what `sample_batch` allocates rows by (`allocate_rows` depends only on the weights, not the seed).
    """

    def __init__(self, cfg: RunConfig, domains: Sequence[str], start: int = 0,
                 counts: dict[str, int] | None = None, kept: Sequence[dict] = ()):
        self.cfg, self.domains = cfg, tuple(domains)
        self.counts = dict(counts) if counts is not None else _rebuild_counts(cfg, self.domains, start)
        changes = [e for e in kept if e["kind"] == "change"]
        # The mixture in force before `start`: the last published change, so a resume whose new
        # `train.steps` moves a phase boundary publishes the switch where it now happens.
        self._current = (changes[-1]["phase"], changes[-1]["weights"]) if changes else None
        self._last_snapshot = time.monotonic()

    def before_step(self, step: int) -> dict | None:
        _, phase = phase_at(self.cfg.data, step, self.cfg.train.steps)
        new = (phase.name, dict(phase.weights))
        if self._current == new:
            return None
        message = change_message(self._current, new, step, self.cfg.train.steps)
        self._current = new
        return {"step": step, "kind": "change", "phase": phase.name, "weights": new[1], "message": message}

    def after_step(self, done: int, batch: Batch) -> dict | None:
        for domain, n in realized_tokens(batch, self.domains).items():
            self.counts[domain] = self.counts.get(domain, 0) + n
        every = self.cfg.train.mixture_snapshot_every
        if done % every == 0 or time.monotonic() - self._last_snapshot >= SNAPSHOT_MAX_INTERVAL_S:
            return self.snapshot(done)
        return None

    def snapshot(self, done: int) -> dict:
        self._last_snapshot = time.monotonic()
        tokens = {d: int(self.counts.get(d, 0)) for d in self.domains}
        return {"step": done, "kind": "snapshot", "tokens": tokens, "total": sum(tokens.values())}
