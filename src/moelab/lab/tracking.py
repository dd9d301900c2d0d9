"""Live tracking: sinks that mirror a run's outputs to the lab ledger, W&B or another directory.

    from moelab.lab.tracking import LedgerSink, WandbSink, wandb_available
    sinks = [LedgerSink("lab/ledger.sqlite", "exp-id", "tiny")]
    if wandb_available():
        sinks.append(WandbSink("runs/tiny", to_dict(cfg), "tiny"))
    train(cfg, "runs/tiny", sinks=sinks)  # train closes the sinks when it returns or raises

A *sink* (`moelab.train.outputs.Sink`) receives everything the training loop writes to its JSONL files:
each logged metrics record, each incident, each mixture-log entry and each eval's samples. The loop keeps
writing `OUT/metrics.jsonl`, `incidents.jsonl`, `mixture_log.jsonl` and `samples.jsonl` itself (it trims
them on a resume; `moelab.train.outputs`); sinks mirror them elsewhere: `JsonlSink` into another
directory, `LedgerSink` onto the lab ledger (kinds metric / incident / mixture / sample), `WandbSink`
into a W&B run (offline unless WANDB_API_KEY or WANDB_MODE says otherwise; `wandb` is an optional
extra, imported only here). On a multi-host run only process 0 publishes
(`moelab.parallel.mesh.is_writer`): built on any other process, each of these sinks is a `NullSink`
instead, which opens no file, ledger or W&B run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from pathlib import Path
from typing import Any, Sequence

from moelab.lab.ledger import append, open_ledger
from moelab.parallel import mesh as mesh_lib
from moelab.train.outputs import INCIDENTS, METRICS, MIXTURE_LOG, SAMPLES

__all__ = ["NullSink", "JsonlSink", "LedgerSink", "WandbSink", "wandb_available"]


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

    FILES = {"log": METRICS, "incident": INCIDENTS, "mixture": MIXTURE_LOG, "samples": SAMPLES}

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


# metrics.jsonl keys -> W&B names; router/*, router_bias/*, norm/*, eval/*, forecast/* keep theirs (the
# README's names), other scalars go under train/.
_WANDB_NAMES = {"tokens": "throughput/tokens", "tokens_per_s": "throughput/tokens_per_s", "mfu": "throughput/mfu"}
_WANDB_KEPT_PREFIXES = ("router/", "router_bias/", "norm/", "eval/", "forecast/")


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
    record's step as `train/loss`, `train/lr`, `throughput/tokens_per_s`, `throughput/mfu` (where the device's peak is
    known), `router/*`, `router_bias/*`, `norm/*`,
    `eval/*`, `forecast/*`;
    incidents as `incidents/count` plus `incidents/<rule>`; the mixture as `mixture/weight/<domain>`
    and `mixture/tokens/<domain>`; samples as the table `samples` (all rows so far, re-logged at each eval
    because a logged W&B table cannot grow). The run's id is kept in `OUT/wandb/moelab_run_id`, so a
    sink made again for the same OUT (a resumed run) logs into the same W&B run; the last step it logged is
    kept beside it (`moelab_last_step`), and the resumed sink logs only later steps. A resume re-publishes
    from its checkpoint step (a phase switch that a new `train.steps` moved there, say), and W&B refuses a
    step below its last one online and holds it twice once an offline run is synced.
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
        id_file, self._step_file = out / "wandb" / "moelab_run_id", out / "wandb" / "moelab_last_step"
        resumed = id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        # The steps the W&B run already holds (-1: none): a resumed sink logs only past them.
        self._held = int(self._step_file.read_text()) if resumed and self._step_file.is_file() else -1
        self._last = self._held
        self.run = wandb.init(project=project, name=run_name, group=group, config=config, dir=str(out), id=run_id,
                              resume="allow", **kwargs)
        self._num_incidents = 0
        self._sample_rows: list[list] = []

    def _log(self, data: dict, step: int) -> None:
        """`run.log` at `step` unless the run held it before this sink began; records the last step logged."""
        if step <= self._held:
            return
        self.run.log(data, step=step)
        if step > self._last:
            self._last = step
            self._step_file.write_text(f"{step}\n")

    def log(self, record: dict) -> None:
        scalars = {_wandb_name(k): v for k, v in record.items() if k != "step" and _is_number(v)}
        self._log(scalars, record["step"])

    def incident(self, incident: dict) -> None:
        self._num_incidents += 1
        self._log({"incidents/count": self._num_incidents, f"incidents/{incident['rule']}": 1}, incident["step"])

    def mixture(self, entry: dict) -> None:
        if entry["kind"] == "change":
            data = {f"mixture/weight/{d}": w for d, w in entry["weights"].items()}
            self.run.summary["mixture/last_change"] = entry["message"]
        else:
            data = {f"mixture/tokens/{d}": n for d, n in entry["tokens"].items()}
        self._log(data, entry["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        self._sample_rows += [[r["step"], r["domain"], r["prompt"], r["continuation"]] for r in rows]
        table = self._wandb.Table(columns=["step", "domain", "prompt", "continuation"], data=self._sample_rows)
        self._log({"samples": table}, step)

    def close(self) -> None:
        self.run.finish()
