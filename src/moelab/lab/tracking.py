"""Live tracking: metric sinks, the published mixture log, and intermediate predictions (greedy samples).

    from moelab.lab.tracking import LedgerSink, WandbSink, wandb_available
    sinks = [LedgerSink("lab/ledger.sqlite", "exp-id", "tiny")]
    if wandb_available():
        sinks.append(WandbSink("runs/tiny", to_dict(cfg), "tiny"))
    train(cfg, "runs/tiny", sinks=sinks)  # train closes the sinks when it returns or raises

A *sink* receives everything the training loop writes to its JSONL files (`Sink`): each logged metrics
record, each incident, each mixture-log entry and each eval's samples. The loop keeps writing
`OUT/metrics.jsonl`, `incidents.jsonl`, `mixture_log.jsonl` and `samples.jsonl` itself (it trims them
on a resume); sinks mirror them elsewhere: `JsonlSink` into another directory, `LedgerSink` onto the lab
ledger (kinds metric / incident / mixture / sample), `WandbSink` into a W&B run (offline unless
WANDB_API_KEY or WANDB_MODE says otherwise; `wandb` is an optional extra, imported only here).
On a multi-host run only process 0 publishes (`moelab.parallel.mesh.is_writer`): built on any other
process, each of these sinks is a `NullSink` instead, which opens no file, ledger or W&B run.

The mixture log (`MixtureLog`) has two kinds of entry:

    {"step": 0, "kind": "change", "phase": "pretrain", "weights": {...}, "message": "initial mixture ..."}
    {"step": 100, "kind": "snapshot", "tokens": {"code": 23040, ...}, "total": 51200}

A change at step s means steps s, s+1, ... train under the new weights. A snapshot at step s counts the
tokens trained on (targets: seq_len per row) in steps 0..s-1 per domain, so `total` is exactly
s * batch_size * seq_len. The counts travel in the checkpoint's meta (`realized_tokens`), so a resume
continues them even if `train.steps` changed (which moves phase boundaries of the steps to come, not
of the steps already trained); a checkpoint without them is rebuilt from the phase schedule, which is
what `sample_batch` allocates rows by (`allocate_rows` depends only on the weights, not the seed).

Samples (`make_greedy_decode`, `sample_prompts`): at each eval the model continues a fixed prompt per
domain (the first tokens of its held-out stream) greedily, one full forward of [domains, seq_len] per
new token inside one jitted `fori_loop`; no KV cache is needed at the sizes this runs at.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig
from moelab.data.mixture import Batch, Corpus, allocate_rows, phase_at, phase_boundaries, realized_tokens
from moelab.lab.ledger import append, open_ledger
from moelab.model import transformer
from moelab.parallel import mesh as mesh_lib

__all__ = ["Sink", "NullSink", "JsonlSink", "LedgerSink", "WandbSink", "wandb_available", "MixtureLog",
           "change_message", "sample_prompts", "make_greedy_decode", "generate_samples", "PROMPT_TOKENS",
           "CONTINUATION_TOKENS", "SNAPSHOT_MAX_INTERVAL_S", "EOS_MARK"]

PROMPT_TOKENS = 32  # per domain, clipped to seq_len // 2
CONTINUATION_TOKENS = 48  # greedy tokens per sample, clipped to what is left of seq_len
SNAPSHOT_MAX_INTERVAL_S = 3600.0  # a slow run still publishes its realized mixture at least hourly
EOS_MARK = " <eos> "  # shown where a sample ends a document; the byte tokenizer would drop eos silently


class Sink(Protocol):
    """Where the training loop's outputs go besides its JSONL files. Every method gets plain JSON data."""

    def log(self, record: dict) -> None: ...  # one metrics.jsonl record

    def incident(self, incident: dict) -> None: ...  # one incidents.jsonl entry

    def mixture(self, entry: dict) -> None: ...  # one mixture_log.jsonl entry

    def samples(self, step: int, rows: list[dict]) -> None: ...  # one eval's samples.jsonl rows

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# sinks


class NullSink:
    """Drops everything: what the sinks below are on a process that does not write (`is_writer()`)."""

    def log(self, record: dict) -> None:
        pass

    def incident(self, incident: dict) -> None:
        pass

    def mixture(self, entry: dict) -> None:
        pass

    def samples(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


class _WriterOnly:
    """Base of the sinks below: built where `is_writer()` is False, the sink is a `NullSink` instead.

    So N hosts of one run open one W&B run, one set of files and one stream of ledger records. (When
    `__new__` returns an object that is not an instance of the class, Python skips `__init__`.)
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls) if mesh_lib.is_writer() else NullSink()


class JsonlSink(_WriterOnly):
    """Appends to `metrics.jsonl`, `incidents.jsonl`, `mixture_log.jsonl`, `samples.jsonl` in `directory`.

    The formats are the loop's own; use it to mirror a run's logs into another directory.
    """

    FILES = {"log": "metrics.jsonl", "incident": "incidents.jsonl", "mixture": "mixture_log.jsonl",
             "samples": "samples.jsonl"}

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files = {kind: open(self.directory / name, "a") for kind, name in self.FILES.items()}

    def _write(self, kind: str, rows: Sequence[dict]) -> None:
        f = self._files[kind]
        f.writelines(json.dumps(row) + "\n" for row in rows)
        f.flush()

    def log(self, record: dict) -> None:
        self._write("log", [record])

    def incident(self, incident: dict) -> None:
        self._write("incident", [incident])

    def mixture(self, entry: dict) -> None:
        self._write("mixture", [entry])

    def samples(self, step: int, rows: list[dict]) -> None:
        self._write("samples", rows)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class LedgerSink(_WriterOnly):
    """Appends each output as a ledger record keyed by the experiment id; every body names the run.

    Kinds: `metric` (a metrics record), `incident`, `mixture` (a mixture-log entry), `sample` (one row
    per domain and eval). Each append is its own transaction, so concurrent writers keep the chain linear.
    """

    def __init__(self, ledger_path: str | Path, experiment_id: str, run_name: str):
        self.ledger = open_ledger(ledger_path, create=True)
        self.experiment_id, self.run_name = experiment_id, run_name

    def _append(self, kind: str, body: dict) -> None:
        append(self.ledger, kind, self.experiment_id, {"run": self.run_name, **body})

    def log(self, record: dict) -> None:
        self._append("metric", record)

    def incident(self, incident: dict) -> None:
        self._append("incident", incident)

    def mixture(self, entry: dict) -> None:
        self._append("mixture", entry)

    def samples(self, step: int, rows: list[dict]) -> None:
        for row in rows:
            self._append("sample", row)

    def close(self) -> None:
        pass


def wandb_available() -> bool:
    """Whether the optional `wandb` package is installed (`pip install moelab[wandb]`)."""
    return importlib.util.find_spec("wandb") is not None


# metrics.jsonl keys -> W&B names; router/*, norm/*, eval/* keep theirs, other scalars go under train/.
_WANDB_NAMES = {"tokens": "throughput/tokens", "tokens_per_s": "throughput/tokens_per_s"}
_WANDB_KEPT_PREFIXES = ("router/", "norm/", "eval/")


def _wandb_name(key: str) -> str:
    if key in _WANDB_NAMES:
        return _WANDB_NAMES[key]
    return key if key.startswith(_WANDB_KEPT_PREFIXES) else f"train/{key}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class WandbSink(_WriterOnly):
    """Logs to a W&B run whose files live under `OUT/wandb`.

    Offline (`mode="offline"`, synced later with `wandb sync OUT/wandb/offline-run-*`) unless WANDB_MODE
    is set (W&B's own setting wins) or WANDB_API_KEY is, which means online. Scalars are logged at the
    record's step as `train/loss`, `train/lr`, `throughput/tokens_per_s`, `router/*`, `norm/*`, `eval/*`;
    incidents as `incidents/count` plus `incidents/<rule>`; the mixture as `mixture/weight/<domain>`
    and `mixture/tokens/<domain>`; samples as the table `samples` (all rows so far, re-logged at each eval
    because a logged W&B table cannot grow). The run's id is kept in `OUT/wandb/moelab_run_id`, so a
    sink made again for the same OUT (a resumed run) logs into the same W&B run.
    """

    def __init__(self, out_dir: str | Path, config: dict, run_name: str, project: str = "moelab",
                 group: str | None = None):
        import wandb  # optional dependency: only a run that asks for W&B needs it

        self._wandb = wandb
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {}
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            kwargs["mode"] = "offline"
            # An offline run is written, not narrated: W&B's ~30 lines per run would bury the step events.
            kwargs["settings"] = wandb.Settings(silent=os.environ.get("WANDB_SILENT", "true").lower() == "true")
        # One W&B run per OUT: a resumed training (after a preemption, say) continues the run it started.
        id_file = out / "wandb" / "moelab_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=run_name, group=group, config=config, dir=str(out), id=run_id,
                              resume="allow", **kwargs)
        self._num_incidents = 0
        self._sample_rows: list[list] = []

    def log(self, record: dict) -> None:
        scalars = {_wandb_name(k): v for k, v in record.items() if k != "step" and _is_number(v)}
        self.run.log(scalars, step=record["step"])

    def incident(self, incident: dict) -> None:
        self._num_incidents += 1
        self.run.log({"incidents/count": self._num_incidents, f"incidents/{incident['rule']}": 1},
                     step=incident["step"])

    def mixture(self, entry: dict) -> None:
        if entry["kind"] == "change":
            data = {f"mixture/weight/{d}": w for d, w in entry["weights"].items()}
            self.run.summary["mixture/last_change"] = entry["message"]
        else:
            data = {f"mixture/tokens/{d}": n for d, n in entry["tokens"].items()}
        self.run.log(data, step=entry["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        self._sample_rows += [[r["step"], r["domain"], r["prompt"], r["continuation"]] for r in rows]
        table = self._wandb.Table(columns=["step", "domain", "prompt", "continuation"], data=self._sample_rows)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


# ----------------------------------------------------------------------------------------------
# the mixture log


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

    The loop calls `before_step(step)` (a change entry or None), `after_step(done, batch)` (a snapshot
    entry when one is due, or None) and `snapshot(done)` (one now, e.g. at the end). `counts` go into the
    checkpoint meta as `realized_tokens`.
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


# ----------------------------------------------------------------------------------------------
# intermediate predictions


def sample_prompts(corpus: Corpus, seq_len: int) -> dict[str, np.ndarray]:
    """The fixed prompt of each domain: the first min(PROMPT_TOKENS, seq_len // 2) held-out tokens."""
    length = max(1, min(PROMPT_TOKENS, seq_len // 2))
    return {d: np.asarray(corpus.heldout[d][:length], dtype=np.int32) for d in corpus.domains}


def make_greedy_decode(cfg: RunConfig, prompt_len: int, vocab_size: int
                       ) -> tuple[Callable[[Any, jax.Array, jax.Array], jax.Array], int]:
    """A jitted `decode(params, router_bias, prompts [N, prompt_len]) -> [N, num_new]` and `num_new`.

    Each new token is the argmax over the first `vocab_size` logits (the tokenizer's ids; a padded
    model vocabulary has ids no tokenizer decodes) at the last filled position of a [N, seq_len] buffer.
    Positions past it hold 0s, which causal attention never lets the filled ones see. The `ep` dispatch
    needs a mesh-bound backend, so samples route with `capacity`, the same routing without the mesh.
    """
    model = cfg.model
    if model.moe.dispatch == "ep":
        model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, dispatch="capacity"))
    seq_len = model.seq_len
    num_new = max(0, min(CONTINUATION_TOKENS, seq_len - prompt_len))
    dtype = jnp.bfloat16 if cfg.train.compute_dtype == "bfloat16" else jnp.float32
    valid = jnp.arange(model.vocab_size) < vocab_size

    def decode(params, router_bias, prompts):
        n = prompts.shape[0]
        buf = jnp.zeros((n, seq_len), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(i, buf):
            logits, _ = transformer.apply(params, buf, model, router_bias, dtype)
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
