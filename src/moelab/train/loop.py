"""The training loop: a jitted train step, per-domain eval, and the run that writes its outputs.

    from moelab import presets
    from moelab.train.loop import train
    summary = train(presets.get("tiny"), "runs/tiny")

`train` writes `OUT/config.yaml`, `OUT/metrics.jsonl` (one JSON object per logged step) and
`OUT/summary.json`. Progress is reported through callbacks so the core imports no UI library; the
CLI plugs in a Rich progress bar. Everything a user can get wrong (config, data files, vocabulary)
is checked before `OUT` is created, so bad input leaves nothing half-written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moelab.config import ConfigError, RunConfig, dump_yaml
from moelab.data.mixture import Corpus, build_corpus, eval_batches, phase_at, sample_batch
from moelab.model import transformer
from moelab.train.schedule import learning_rate
from moelab.train.state import TrainState, init_state, make_optimizer

__all__ = ["Hooks", "make_train_step", "make_eval_step", "evaluate", "prepare_corpus", "train"]

# Metric names are a contract: reports and tests read these keys from metrics.jsonl.
STEP_METRICS = ("loss", "ce", "lr", "grad_norm", "drop_fraction")


def compute_dtype(cfg: RunConfig) -> jnp.dtype:
    return jnp.bfloat16 if cfg.train.compute_dtype == "bfloat16" else jnp.float32


def make_train_step(cfg: RunConfig) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """A jitted `step(state, tokens [B, S+1]) -> (state, metrics)`; the old state's buffers are donated."""
    tx = make_optimizer(cfg.train)
    schedule = learning_rate(cfg.train)
    dtype = compute_dtype(cfg)

    def step(state: TrainState, tokens: jax.Array) -> tuple[TrainState, dict]:
        def loss_fn(params):
            return transformer.loss(params, tokens, cfg.model, state.router_bias, dtype)

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "ce": aux["ce"],
            "lr": schedule(state.step),
            "grad_norm": optax.tree.norm(grads),
            "drop_fraction": aux["drop_fraction"],
            "expert_load": aux["expert_load"],
        }
        return TrainState(params, opt_state, state.router_bias, state.step + 1), metrics

    return jax.jit(step, donate_argnums=0)


def make_eval_step(cfg: RunConfig) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """A jitted `eval(params, router_bias, tokens) -> mean CE per row [B]`."""
    dtype = compute_dtype(cfg)

    def eval_step(params, router_bias, tokens):
        _, aux = transformer.loss(params, tokens, cfg.model, router_bias, dtype)
        return aux["ce_per_row"]

    return jax.jit(eval_step)


def evaluate(eval_step, params, router_bias, eval_sets: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """Mean held-out cross-entropy (nats/token) per domain."""
    return {
        domain: float(np.mean([np.mean(eval_step(params, router_bias, b)) for b in batches]))
        for domain, batches in eval_sets.items()
    }


def prepare_corpus(cfg: RunConfig) -> Corpus:
    """Load and tokenize the data; checks that the model's vocabulary holds the tokenizer's."""
    corpus = build_corpus(cfg.data, seed=cfg.train.seed)
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({corpus.tokenizer.vocab_size} tokens); set --set model.vocab_size={corpus.tokenizer.vocab_size} or more."
        )
    return corpus


@dataclass
class Hooks:
    """Callbacks the caller plugs in (all optional): progress, every logged record, every eval."""

    on_step: Callable[[int], None] | None = None  # after each step, with the number of steps done
    on_log: Callable[[dict], None] | None = None  # each record written to metrics.jsonl
    on_eval: Callable[[int, dict[str, float]], None] | None = None


def _jsonable(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


def train(cfg: RunConfig, out_dir: str | Path, hooks: Hooks | None = None) -> dict:
    """Train `cfg` from scratch and write config, metrics and summary to `out_dir`.

    Returns the summary: final `step`, `loss`, `eval` per domain, `eval_initial` per domain,
    `tokens` and `tokens_per_s`.
    """
    hooks = hooks or Hooks()
    corpus = prepare_corpus(cfg)  # may raise DataError / ConfigError: before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_yaml(cfg))

    t, m = cfg.train, cfg.model
    eval_sets = {d: eval_batches(corpus, d, t.eval_batches, t.batch_size, m.seq_len) for d in corpus.domains}
    state = init_state(cfg)
    train_step, eval_step = make_train_step(cfg), make_eval_step(cfg)
    tokens_per_step = t.batch_size * m.seq_len

    initial_eval = evaluate(eval_step, state.params, state.router_bias, eval_sets)
    last_eval = initial_eval
    if hooks.on_eval:
        hooks.on_eval(0, initial_eval)

    window_start, window_steps = time.perf_counter(), 0
    tokens_per_s = 0.0
    record: dict = {}
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(t.steps):
            phase_index, phase = phase_at(cfg.data, step, t.steps)
            batch = sample_batch(corpus, phase.weights, t.seed, step, t.batch_size, m.seq_len)
            state, metrics = train_step(state, jnp.asarray(batch.tokens))
            window_steps += 1
            done = step + 1
            is_eval = done % t.eval_every == 0 or done == t.steps
            if done % t.log_every == 0 or is_eval:
                metrics = jax.device_get(metrics)  # the one host sync per logged step
                now = time.perf_counter()
                tokens_per_s = window_steps * tokens_per_step / (now - window_start)
                record = {"step": done, **_jsonable(metrics), "tokens": done * tokens_per_step,
                          "tokens_per_s": tokens_per_s, "phase": phase.name}
                if is_eval:
                    last_eval = evaluate(eval_step, state.params, state.router_bias, eval_sets)
                    record.update({f"eval/{d}": v for d, v in last_eval.items()})
                    if hooks.on_eval:
                        hooks.on_eval(done, last_eval)
                log.write(json.dumps(record) + "\n")
                log.flush()
                if hooks.on_log:
                    hooks.on_log(record)
                window_start, window_steps = time.perf_counter(), 0
            if hooks.on_step:
                hooks.on_step(done)

    summary = {
        "step": t.steps,
        "loss": record.get("loss"),
        "eval": last_eval,
        "eval_initial": initial_eval,
        "tokens": t.steps * tokens_per_step,
        "tokens_per_s": tokens_per_s,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
