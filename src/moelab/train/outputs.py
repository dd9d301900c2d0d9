"""The run directory's contract: its file names, JSONL writing and reading, the summary, and sinks.

`moelab.train.loop.train(cfg, OUT)` writes, and the ladder, the lab and its report read:

    config.yaml         the run's config, rewritten at each start (a resume may change the safe fields)
    metrics.jsonl       one record per logged step: `step`, scalars, `tokens`, `tokens_per_s`, `phase`,
                        `eval/<domain>` and `eval/mean` at an eval, watchers' fields (`on_track`), `incidents`
    incidents.jsonl     one {"step", "rule", "module", "values"} per monitor or watcher incident
    mixture_log.jsonl   phase changes and realized-token snapshots (`moelab.data.mixture.MixtureLog`)
    samples.jsonl       {"step", "domain", "prompt", "continuation"} per domain at each eval (`moelab.model.decode`)
    router_load.jsonl   {"step", "load": [layer][expert]}: the router's load EMA at each eval
    resumes.jsonl       {"step", "changes"}: one line per resume, with the config fields it changed
    tokenizer.json      the run's Hugging Face tokenizer (BPE or loaded); absent for the byte tokenizer
    data.json           a run on token stores: `store_hash` and each store's sources, hashes and token counts
    summary.json        written when the run finishes: `step`, `loss`, `eval`, `eval_initial`, `eval_mean`,
                        `tokens`, `tokens_per_s` (steady: after the first step), `compile_s` (that first step,
                        which compiles), `incidents`, `resumed_from`
    checkpoints/        `moelab.train.checkpoint`

Every JSONL line has a `step`; a resume from step s keeps each log's lines up to s (`read_logs_until`)
and redoes the rest. A *sink* (`Sink`) receives what the run writes to metrics, incidents, mixture
and samples, to mirror it elsewhere (`moelab.lab.tracking`: the ledger, W&B, another directory).
Multi-host: only the writing process (process 0) writes these files and publishes to sinks; the
others open them on os.devnull (`writer=False`). No JAX here, so readers of finished runs stay light.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from moelab.config import RunConfig, dump_yaml
from moelab.errors import ConfigError
from moelab.files import atomic_path

__all__ = ["CONFIG", "METRICS", "INCIDENTS", "MIXTURE_LOG", "SAMPLES", "ROUTER_LOAD", "RESUMES", "SUMMARY",
           "DATA", "CHECKPOINTS", "LOGS", "Sink", "RunLogs", "read_jsonl", "read_jsonl_until", "read_logs_until",
           "read_summary", "finished_summary", "open_run_file", "write_config", "append_resume", "write_summary",
           "write_data", "TOKENIZER", "write_tokenizer", "IMPORTED", "PROFILE"]

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
INCIDENTS = "incidents.jsonl"
MIXTURE_LOG = "mixture_log.jsonl"
SAMPLES = "samples.jsonl"
ROUTER_LOAD = "router_load.jsonl"
RESUMES = "resumes.jsonl"
SUMMARY = "summary.json"
DATA = "data.json"
TOKENIZER = "tokenizer.json"
# Written by `moelab import` (its source and architecture): until the run logs its first step, `train` starts
# from the imported weights with any config that keeps their shapes.
IMPORTED = "imported.json"
CHECKPOINTS = "checkpoints"
PROFILE = "profile"  # `moelab train --profile`: the JAX profiler's trace (plugins/profile/<time>/)
LOGS = (METRICS, INCIDENTS, MIXTURE_LOG, SAMPLES, ROUTER_LOAD)  # cut back to the checkpoint on a resume


class Sink(Protocol):
    """Where the training loop's outputs go besides its JSONL files. Every method gets plain JSON data."""

    def log(self, record: dict) -> None: ...  # one metrics.jsonl record

    def incident(self, incident: dict) -> None: ...  # one incidents.jsonl entry

    def mixture(self, entry: dict) -> None: ...  # one mixture_log.jsonl entry

    def samples(self, step: int, rows: list[dict]) -> None: ...  # one eval's samples.jsonl rows

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# reading


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSONL log; [] if it does not exist."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_jsonl_until(path: Path, step: int) -> list[str]:
    """Lines of a JSONL log whose `step` is at most `step`: what survives a resume from `step`."""
    if not path.is_file():
        return []
    kept, lines = [], path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line else None
            if record is not None and record["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # a line torn by a kill mid-write: past the checkpoint anyway
                break
            raise ConfigError(f"{path}:{number} is not a moelab log line (no step), so this is not the run its "
                              f"checkpoint belongs to; pass a new --out, or move {path} away.") from None
    return kept


def read_logs_until(out: Path, step: int) -> dict[str, list[str]]:
    """Each log's lines that a run resuming from `step` keeps; none for a fresh start (step 0)."""
    return {name: read_jsonl_until(out / name, step) if step else [] for name in LOGS}


def read_summary(out: Path) -> dict:
    """The summary of a finished run; {} if it has none yet."""
    path = out / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else {}


def finished_summary(out: Path, steps: int) -> dict | None:
    """The summary a finished run wrote, if it covers `steps` steps (None for a missing or torn one)."""
    try:
        summary = json.loads((out / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("step") == steps else None


# ----------------------------------------------------------------------------------------------
# writing


def open_run_file(path: Path, mode: str, writer: bool) -> IO[str]:
    """`path` opened for writing on the process that writes the run's files (`writer`); os.devnull on the others."""
    return open(path if writer else os.devnull, mode)


def write_config(out: Path, cfg: RunConfig, writer: bool) -> None:
    with open_run_file(out / CONFIG, "w", writer) as f:
        f.write(dump_yaml(cfg))


def append_resume(out: Path, step: int, changes: Mapping[str, tuple[Any, Any]], writer: bool) -> None:
    """One resumes.jsonl line: the step resumed from and the config fields changed, as [old, new]."""
    with open_run_file(out / RESUMES, "a", writer) as f:
        f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def write_data(out: Path, provenance: dict | None, writer: bool) -> None:
    """data.json: where the tokens came from (`Corpus.provenance`); nothing for a corpus built in memory."""
    if provenance is not None:
        with open_run_file(out / DATA, "w", writer) as f:
            f.write(json.dumps(provenance, indent=1) + "\n")


def write_tokenizer(out: Path, tokenizer: Any, writer: bool) -> None:
    """OUT/tokenizer.json for a Hugging Face tokenizer (`save`), so sampling and export need no sources;
    the byte tokenizer has no file. Written under a temporary name and renamed: never half a file."""
    if writer and hasattr(tokenizer, "save"):
        with atomic_path(out / TOKENIZER) as tmp:
            tokenizer.save(tmp)


def write_summary(out: Path, summary: dict, writer: bool) -> None:
    with open_run_file(out / SUMMARY, "w", writer) as f:
        f.write(json.dumps(summary, indent=2) + "\n")


class RunLogs:
    """The run's JSONL logs, open for writing while the steps run; each entry also goes to `sinks`.

    A context manager: entering rewrites each log with its `kept` lines (`read_logs_until`) and opens it
    to append the rest; leaving closes them (not the sinks, which `train` closes). Metrics, mixture,
    samples and router load are flushed at each write, incidents with the next metrics record (which
    lists them). Where `writer` is False the logs are opened on os.devnull and nothing is published:
    a run's outputs go out once, from process 0.
    """

    def __init__(self, out: Path, kept: Mapping[str, list[str]], sinks: Sequence[Sink], writer: bool):
        self.out, self.kept, self.writer = out, kept, writer
        self._sinks = sinks if writer else ()
        self._files: dict[str, IO[str]] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RunLogs:
        with contextlib.ExitStack() as stack:
            for name in LOGS:
                f = self._files[name] = stack.enter_context(open_run_file(self.out / name, "w", self.writer))
                f.writelines(line + "\n" for line in self.kept[name])
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def _write(self, name: str, rows: Sequence[dict], flush: bool = True) -> None:
        f = self._files[name]
        f.writelines(json.dumps(row) + "\n" for row in rows)
        if flush:
            f.flush()

    def _publish(self, kind: str, *payload: Any) -> None:
        for sink in self._sinks:
            getattr(sink, kind)(*payload)

    def log(self, record: dict) -> None:
        self._write(METRICS, [record])
        self._files[INCIDENTS].flush()
        self._publish("log", record)

    def incident(self, incident: dict) -> None:
        self._write(INCIDENTS, [incident], flush=False)
        self._publish("incident", incident)

    def mixture(self, entry: dict | None) -> None:
        """A mixture-log entry; None (nothing due this step) writes nothing."""
        if entry is not None:
            self._write(MIXTURE_LOG, [entry])
            self._publish("mixture", entry)

    def samples(self, step: int, rows: list[dict]) -> None:
        self._write(SAMPLES, rows)
        self._publish("samples", step, rows)

    def router_load(self, step: int, load: list) -> None:
        """The router's running load per layer and expert (an EMA), for the report's heatmap."""
        self._write(ROUTER_LOAD, [{"step": step, "load": load}])
