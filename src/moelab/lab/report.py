"""The report of a registered experiment: one self-contained HTML page and a Markdown twin.

    moelab lab report demo-tiny                  # -> <run dir>/report/report.html and report.md
    moelab lab report demo-tiny --out /tmp/rep   # somewhere else

`write_report` reads the experiment from the ledger (spec, amendments, run records) and its
training step's output directory (metrics.jsonl, summary.json, config.yaml, incidents.jsonl and,
when present, prediction.csv, mixture_log.jsonl, data.json, router_load.jsonl, samples.jsonl). Every section
is an element with a stable id (`SECTION_IDS`); a section whose source file is absent stays, with a
note saying what is missing, so the page's shape never depends on the run. Plots are matplotlib
(Agg) PNGs, inline as base64 in the HTML and written beside the Markdown. The page has no script.
The reproducibility section names the ledger's record count and head hash at writing time, so a
reader who keeps the report can later prove the ledger was not cut short (`moelab lab verify --head`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display, and no backend guessing on a CI box
import matplotlib.pyplot as plt
import numpy as np

from moelab.data.store import sha256_file
from moelab.errors import ConfigError
from moelab.lab.ledger import Ledger, verify
from moelab.lab.registry import TRAIN_STEP, Experiment, Prediction, load_experiment
from moelab.ladder.contract import sidecar_path
from moelab.train.outputs import (CONFIG, DATA, INCIDENTS, METRICS, MIXTURE_LOG, ROUTER_LOAD, SAMPLES, read_jsonl,
                                 read_summary)

__all__ = ["SECTION_IDS", "REPRODUCTION", "CONFIRMED", "REFUTED", "INCONCLUSIVE", "verdict", "experiment_verdict", "stated_tables",
           "find_run_dir", "router_load_heatmap", "Section", "build_sections", "render_html", "render_markdown",
           "write_report"]

CONFIRMED, REFUTED, INCONCLUSIVE = "confirmed", "refuted", "inconclusive"
SECTION_IDS = ("hypothesis", "loss-curve", "per-domain-eval", "mixture", "router", "norms-incidents", "amendments",
               "samples", "reproducibility")
REPRODUCTION = "reproduction"  # the run event `moelab lab reproduce` records
MAX_SAMPLE_EVALS = 3  # samples shown for the first, middle and last eval that has any


# ----------------------------------------------------------------------------------------------
# verdict


def verdict(prediction: Prediction, value: float | None) -> str:
    """The outcome of `prediction` given the run's final `value` of its metric.

    With a band: confirmed when low <= value <= high (an open side always holds), refuted otherwise.
    A point prediction alone (`expected`, no band) names no tolerance, so it cannot decide: inconclusive.
    A missing or non-finite value is inconclusive too.

    >>> verdict(Prediction("eval/mean", "below 2.5", band=(None, 2.5)), 2.1)
    'confirmed'
    """
    if value is None or not math.isfinite(value) or prediction.band is None:
        return INCONCLUSIVE
    low, high = prediction.band
    inside = (low is None or value >= low) and (high is None or value <= high)
    return CONFIRMED if inside else REFUTED


# ----------------------------------------------------------------------------------------------
# reading a run


def find_run_dir(experiment: Experiment) -> tuple[Path, dict]:
    """The training step's output directory of the newest finished run, and that ledger record's body."""
    finished = [r for r in experiment.runs if r.body.get("step") == TRAIN_STEP
                and r.body.get("event") in ("finished", "skipped") and r.body.get("output_dir")]
    if not finished:
        train_events = [r.body for r in experiment.runs if r.body.get("step") == TRAIN_STEP]
        if train_events and train_events[-1].get("event") == "preempted":
            raise ConfigError(f"experiment {experiment.id!r} has no finished run: its training step was preempted at "
                              f"step {train_events[-1].get('preempted_at')} with a checkpoint saved; resume it with "
                              f"`moelab lab run {experiment.id}`.")
        events = ", ".join(sorted({str(r.body.get("event")) for r in experiment.runs})) or "none"
        raise ConfigError(f"experiment {experiment.id!r} has no finished run (run events on the ledger: {events}); "
                          f"run it first with `moelab lab run {experiment.id}`.")
    body = finished[-1].body
    out = Path(body["output_dir"])
    if not (out / METRICS).is_file():
        raise ConfigError(f"experiment {experiment.id!r} ran into {out}, but {out / METRICS} is missing; "
                          "was the directory moved or deleted? Re-run with `moelab lab run`.")
    return out, body


def _final_value(metrics: list[dict], summary: dict, metric: str) -> tuple[float | None, int | None]:
    """The last logged value of `metric` and its step; summary.json's `eval` backs up `eval/<domain>`."""
    for row in reversed(metrics):
        if isinstance(row.get(metric), (int, float)):
            return float(row[metric]), row.get("step")
    if metric.startswith("eval/") and metric[5:] in summary.get("eval", {}):
        return float(summary["eval"][metric[5:]]), summary.get("step")
    return None, None


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], float(r[key])) for r in metrics if isinstance(r.get(key), (int, float))]
    return [s for s, _ in rows], [v for _, v in rows]


def _read_prediction(out: Path, run_body: dict) -> tuple[Path | None, dict[str, list[float]]]:
    named = run_body.get("predicted") or (run_body.get("result") or {}).get("predicted")
    for path in ([Path(named)] if named else []) + [out / "prediction.csv", out.parent / "prediction.csv"]:
        if path.is_file():
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            cols = ("step", "loss_pred", "lo80", "hi80", "lo95", "hi95")
            if rows and all(c in rows[0] for c in cols):
                return path, {c: [float(r[c]) for r in rows] for c in cols}
    return None, {}


def _read_router_load(out: Path) -> tuple[int | None, np.ndarray | None]:
    rows = read_jsonl(out / ROUTER_LOAD)
    if rows:
        return rows[-1].get("step"), np.asarray(rows[-1]["load"], dtype=np.float64)
    if (out / "router_load.npy").is_file():
        return None, np.load(out / "router_load.npy")
    return None, None


# ----------------------------------------------------------------------------------------------
# plots


# Plots render about 1,000 px wide (10 in at 110 dpi, less the trimmed margins): legible at a normal page
# width, legends at 9 pt.
_FIGSIZE, _DPI, _LEGEND_PT = (10, 4.4), 110, 9


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _line_plot(series: dict[str, tuple[list, list]], title: str, ylabel: str, band: dict | None = None,
               log_y: bool = False) -> bytes:
    """Lines over steps, with a predicted band behind them; the y-range is the lines' (a wide band is clipped,
    so it never flattens the curves it surrounds)."""
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    if band:
        ax.fill_between(band["step"], band["lo95"], band["hi95"], alpha=0.15, color="C2", label="predicted 95%")
        ax.fill_between(band["step"], band["lo80"], band["hi80"], alpha=0.25, color="C2", label="predicted 80%")
        ax.plot(band["step"], band["loss_pred"], "--", color="C2", label="predicted")
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
    limits = curve_ylim(series)
    if log_y:
        ax.set_yscale("log")
    elif band and limits:
        ax.set_ylim(*limits)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.legend(fontsize=_LEGEND_PT, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)


def curve_ylim(series: dict[str, tuple[list, list]]) -> tuple[float, float] | None:
    """The y-range of the lines alone, 5% padded; None without a finite value."""
    values = np.array([v for _, ys in series.values() for v in ys], dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    pad = 0.05 * max(float(values.max() - values.min()), 1e-3)
    return float(values.min()) - pad, float(values.max()) + pad


def _with_initial(metrics: list[dict], initial: dict, key: str) -> tuple[list, list]:
    """The eval series of `key` with step 0 from the summary's eval_initial when the records lack it."""
    steps, values = _series(metrics, key)
    if 0 not in steps and isinstance(initial.get(key[5:]), (int, float)):
        steps, values = [0, *steps], [float(initial[key[5:]]), *values]
    return steps, values


def router_load_heatmap(load: np.ndarray, step: int | None = None) -> bytes:
    """PNG of a router load array [L, E] (fraction of assignments per expert, per layer) as a heatmap."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"router load must be [layers, experts], got shape {load.shape}")
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * load.shape[1] + 2), max(2, 0.45 * load.shape[0] + 1.2)))
    im = ax.imshow(load, aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax, label="load")
    ax.set(xlabel="expert", ylabel="layer", title="router load" + (f" at step {step}" if step is not None else ""))
    ax.set_xticks(range(load.shape[1]))
    ax.set_yticks(range(load.shape[0]))
    return _png(fig)


def _mixture_plot(snapshots: list[dict]) -> bytes:
    domains = sorted({d for s in snapshots for d in s["tokens"]})
    steps = [s["step"] for s in snapshots]
    cumulative = np.array([[s["tokens"].get(d, 0) for d in domains] for s in snapshots], dtype=np.float64)
    # Shares of the tokens drawn since the previous snapshot: what the mixture was in that stretch.
    drawn = np.diff(np.vstack([np.zeros(len(domains)), cumulative]), axis=0)
    shares = drawn / np.maximum(drawn.sum(axis=1, keepdims=True), 1e-12)
    if steps[0] > 0:  # each share holds from the previous snapshot (or step 0) to its own step
        steps, shares = [0, *steps], np.vstack([shares[:1], shares])
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    ax.stackplot(steps, shares.T, labels=domains, alpha=0.85, step="pre")
    ax.set(title="data mixture (share of tokens drawn)", xlabel="step", ylabel="share", ylim=(0, 1))
    ax.legend(fontsize=_LEGEND_PT, loc="upper right")
    return _png(fig)


# ----------------------------------------------------------------------------------------------
# sections: a list of parts, rendered to HTML and Markdown by the same data


@dataclass
class Section:
    id: str
    title: str
    parts: list[tuple] = field(default_factory=list)  # (p|note|pre, text), (table, head, rows), (img, name, png)

    def p(self, text: str) -> None:
        self.parts.append(("p", text))

    def note(self, text: str) -> None:
        self.parts.append(("note", text))

    def pre(self, text: str) -> None:
        self.parts.append(("pre", text))

    def table(self, head: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.parts.append(("table", list(head), [[_cell(c) for c in r] for r in rows]))

    def img(self, name: str, png: bytes) -> None:
        self.parts.append(("img", name, png))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _band_text(band: tuple | None) -> str:
    if band is None:
        return "none"
    low, high = band
    return f"[{'-inf' if low is None else f'{low:g}'}, {'+inf' if high is None else f'{high:g}'}]"


def _hypothesis(experiment: Experiment, metrics: list[dict], summary: dict) -> Section:
    spec, sec = experiment.spec, Section("hypothesis", "Hypothesis and outcome")
    p = spec.prediction
    value, step = _final_value(metrics, summary, p.metric)
    outcome = verdict(p, value)
    sec.p(f"Question: {' '.join(spec.question.split())}")
    sec.p(f"Hypothesis: {' '.join(spec.hypothesis.split())}")
    sec.table(["metric", "expected", "band", "observed", "at step", "verdict"],
              [[p.metric, p.expected, _band_text(p.band), value, step, outcome.upper()]])
    sec.p(f"Decision rule: {' '.join(p.decision_rule.split())}")
    if p.band is None:
        sec.note("The prediction has no band, only an expected value, so the verdict cannot be decided "
                 "automatically; read the decision rule against the observed value.")
    if value is None:
        sec.note(f"The run logged no {p.metric}; the verdict is inconclusive.")
    sec.note("The verdict checks the band only; any further condition in the decision rule is for the reader.")
    return sec


def _forecast_plot(metrics: list[dict], band: dict) -> bytes:
    """The live forecast of the final loss at each eval against the pre-registered final band (flat)."""
    steps, final = _series(metrics, "forecast/final")
    _, lo = _series(metrics, "forecast/lo95")
    _, hi = _series(metrics, "forecast/hi95")
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    ax.axhspan(band["lo95"][-1], band["hi95"][-1], alpha=0.15, color="C2", label="pre-registered final 95%")
    ax.axhline(band["loss_pred"][-1], ls="--", color="C2", label="pre-registered final")
    ax.fill_between(steps, lo, hi, alpha=0.25, color="C0", label="forecast 95%")
    ax.plot(steps, final, marker="o", markersize=3, color="C0", label="forecast/final")
    ax.set(title="forecast of the final loss", xlabel="step", ylabel="final loss (nats / token)")
    ax.legend(fontsize=_LEGEND_PT, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)


def _self_check_text(pred_path: Path) -> str | None:
    """The prediction's leave-largest-out self-check, from its sidecar JSON, as one sentence."""
    try:
        check = json.loads(sidecar_path(pred_path).read_text())["self_check"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "skipped" in check:
        return f"Self-check skipped: {check['skipped']}"
    verdict = {"passed": "inside the target's band",
               "uninformative": f"uninformative: its band (+-{check.get('band95_half_width', float('nan')):.1%}) is too "
                                "wide to tell a good recipe from a bad one, so the prediction is not trusted"
               }.get(check.get("verdict") or ("passed" if check.get("trusted") else ""),
                     "FAILED: the prediction is not to be trusted")
    return (f"Self-check before training: refitted without {', '.join(check['held_out'])}, the law predicted its "
            f"final loss {check['final_error']:+.2%} off (MAPE {check['mape_after_10pct']:.2%}), {verdict}.")


def _relative(path: str | Path, start: Path | None) -> str:
    """`path` as seen from `start` (the report's folder): a copied report tree keeps pointing at its run."""
    return str(path) if start is None else os.path.relpath(Path(path).resolve(), Path(start).resolve())


def _loss_curve(metrics: list[dict], out: Path, run_body: dict, report_dir: Path | None = None) -> Section:
    sec = Section("loss-curve", "Loss curve")
    pred_path, band = _read_prediction(out, run_body)
    series = {"train loss": _series(metrics, "loss"), "eval/mean": _series(metrics, "eval/mean")}
    sec.img("loss_curve", _line_plot(series, "loss", "loss (nats / token)", band or None))
    if pred_path is None:
        sec.note("No predicted band: the run has no prediction.csv (from `moelab ladder`) beside it or on its record.")
        return sec
    sec.p(f"Predicted band from {_relative(pred_path, report_dir)}.")
    check = _self_check_text(pred_path)
    if check:
        sec.p(check)
    if _series(metrics, "forecast/final")[0]:
        sec.img("forecast", _forecast_plot(metrics, band))
        sec.p("The forecast uses the prediction as its prior and the run's own evals so far (forecast/final); the "
              "shaded strip is the pre-registered band of the final step, which never moves.")
    return sec


def _per_domain_table(metrics: list[dict], summary: dict) -> Section:
    """The per-domain section's table alone (no plot): initial and final value of every eval/* metric."""
    sec = Section("per-domain-eval", "Per-domain eval")
    keys = sorted({k for r in metrics for k in r if k.startswith("eval/")})
    if not keys:
        sec.note("The run logged no eval/* metrics.")
        return sec
    initial = summary.get("eval_initial", {})
    rows = []
    for key in keys:
        value, step = _final_value(metrics, summary, key)
        rows.append([key, initial.get(key[5:]), value, step])
    sec.table(["metric", "initial", "final", "at step"], rows)
    return sec


def _per_domain(metrics: list[dict], summary: dict) -> Section:
    sec = _per_domain_table(metrics, summary)
    keys = sorted({k for r in metrics for k in r if k.startswith("eval/")})
    if not keys:
        return sec
    initial = summary.get("eval_initial", {})
    series = {key: _with_initial(metrics, initial, key) for key in keys}  # step 0 as the table has it
    sec.img("per_domain_eval", _line_plot(series, "eval loss per domain", "loss (nats / token)"))
    return sec


def _data_sources(sec: Section, out: Path) -> None:
    """The token stores the run read (OUT/data.json): content hash, sources with their hashes, tokens per domain."""
    if not (out / DATA).is_file():
        sec.note("Data built in memory at start-up (no token store): sources as in the config.")
        return
    provenance = json.loads((out / DATA).read_text())
    sec.p(f"Trained on token store content {provenance['store_hash']}.")
    sec.table(["store", "domain", "train tokens", "held-out tokens", "source", "bytes", "SHA-256"],
              [[store["location"], name, domain["tokens"]["train"], domain["tokens"]["heldout"], source["path"],
                source["bytes"], source["sha256"]]
               for store in provenance["stores"] for name, domain in store["domains"].items()
               for source in domain["sources"]])


def _mixture(out: Path, plots: bool = True) -> Section:
    sec = Section("mixture", "Data mixture")
    _data_sources(sec, out)
    rows = read_jsonl(out / MIXTURE_LOG)
    if not rows:
        sec.note(f"No mixture log: {out / MIXTURE_LOG} does not exist (or is empty) for this run.")
        return sec
    snapshots = [r for r in rows if r.get("kind") == "snapshot" and r.get("tokens")]
    changes = [r for r in rows if r.get("kind") == "change"]
    if not snapshots:
        sec.note("The mixture log holds no token snapshots, so there is no plot.")
    elif plots:
        sec.img("mixture", _mixture_plot(snapshots))
    if changes:
        sec.table(["step", "phase", "weights", "message"],
                  [[c.get("step"), c.get("phase"), json.dumps(c.get("weights"), sort_keys=True), c.get("message")]
                   for c in changes])
    else:
        sec.note("No mixture changes were logged.")
    return sec


def _router(metrics: list[dict], out: Path) -> Section:
    sec = Section("router", "Router load and MaxVio")
    step, load = _read_router_load(out)
    if load is not None:
        sec.img("router_load", router_load_heatmap(load, step))
    else:
        sec.note(f"No per-layer router load: {out / ROUTER_LOAD} is absent, so there is no heatmap.")
    series = {k: _series(metrics, k) for k in ("router/maxvio", "router/maxvio_global")}
    series = {k: v for k, v in series.items() if v[0]}
    if series:
        sec.img("maxvio", _line_plot(series, "MaxVio", "max violation"))
    else:
        sec.note("The run logged no router/maxvio metrics.")
    return sec


def _norms_incidents(metrics: list[dict], out: Path, plots: bool = True) -> Section:
    sec = Section("norms-incidents", "Norms and incidents")
    keys = sorted({k for r in metrics for k in r if k.startswith("norm/")})
    for group in ("params", "grads", "updates") if plots else ():
        group_keys = [k for k in keys if k.startswith(f"norm/{group}/")]
        if group_keys:
            sec.img(f"norms_{group}", _line_plot({k[len(f'norm/{group}/'):]: _series(metrics, k) for k in group_keys},
                                                 f"norm/{group}", "L2 norm", log_y=True))
    other = [k for k in keys if k.count("/") == 1]
    if other and plots:
        sec.img("norms_other", _line_plot({k: _series(metrics, k) for k in other}, "other norms", "L2 norm"))
    if not keys:
        sec.note("The run logged no norm/* metrics.")
    incidents = read_jsonl(out / INCIDENTS)
    seen = {json.dumps(i, sort_keys=True) for i in incidents}
    for row in metrics:  # incidents carried inside metrics records, if the loop logs them there
        for i in row.get("incidents", []) if isinstance(row.get("incidents"), list) else []:
            if json.dumps(i, sort_keys=True) not in seen:
                incidents.append(i)
                seen.add(json.dumps(i, sort_keys=True))
    if incidents:
        sec.table(["step", "rule", "module", "values"],
                  [[i.get("step"), i.get("rule"), i.get("module"), json.dumps(i.get("values"), sort_keys=True)]
                   for i in sorted(incidents, key=lambda i: i.get("step") or 0)])
    else:
        sec.p("No incidents.")
    return sec


def _amendments(experiment: Experiment) -> Section:
    sec = Section("amendments", "Amendments")
    if not experiment.amendments:
        sec.p("None: the spec ran as registered.")
    for n, a in enumerate(experiment.amendments, 1):
        sec.p(f"{n}. {a.body['reason']} ({a.created_at}; ledger record {a.seq}); changed: "
              f"{', '.join(a.body['changes'])}")
        sec.pre(a.body["diff"])
    return sec


def _printable(text: str | None) -> str | None:
    # An early model emits arbitrary bytes; control characters would garble the table and the page.
    if text is None:
        return None
    return "".join(c if c.isprintable() else "\u23ce" if c == "\n" else "\ufffd" for c in text)


def _samples(out: Path) -> Section:
    sec = Section("samples", "Samples")
    rows = read_jsonl(out / SAMPLES)
    if not rows:
        sec.note(f"No samples: {out / SAMPLES} does not exist (or is empty) for this run.")
        return sec
    steps = sorted({r["step"] for r in rows})
    shown = sorted({steps[0], steps[len(steps) // 2], steps[-1]})[:MAX_SAMPLE_EVALS]
    sec.table(["step", "domain", "prompt", "continuation"],
              [[r["step"], r.get("domain"), _printable(r.get("prompt")), _printable(r.get("continuation"))]
               for r in rows if r["step"] in shown])
    return sec


def _reproducibility(experiment: Experiment, out: Path, run_body: dict, ledger: Ledger,
                     report_dir: Path | None = None) -> Section:
    """Versions and hashes, and the commands that rerun and check the run, written from the run's own
    directory (paths relative to it; the table's relative to the report's folder)."""
    sec = Section("reproducibility", "Reproducibility")
    chain = verify(ledger)  # the head a reader keeps: the chain cannot show rows cut off its end by itself
    commit = run_body.get("git_commit") or "none (not in a git repository)"
    if run_body.get("git_dirty"):
        commit += " (with uncommitted changes)"
    # A preempted run resumes in its own directory: each stop is one row of the ledger with that directory.
    stops = [f"step {r.body.get('preempted_at')} (ledger record {r.seq})" for r in experiment.runs
             if r.body.get("event") == "preempted" and r.body.get("output_dir") == str(out)]
    # A Ray worker that died inside any step (a rung too): the driver put each lost attempt on the record.
    lost = [f"{r.body.get('step')} attempt {r.body.get('attempt')} (ledger record {r.seq})" for r in experiment.runs
            if r.body.get("worker_lost")]
    sec.table(["what", "value"], [
        ["git commit of the run", commit],
        ["spec sha256", run_body.get("spec_hash") or experiment.spec_hash],
        ["step version (config hash)", run_body.get("version")],
        [f"{CONFIG} sha256", sha256_file(out / CONFIG) if (out / CONFIG).is_file() else None],
        ["output directory", _relative(out, report_dir)],
        ["preempted, then resumed from the checkpoint at", ", ".join(stops) or "never (one uninterrupted run)"],
        ["a worker lost (Ray), the step retried", ", ".join(lost) or "never"],
        ["ledger", _relative(ledger.path, report_dir)],
        ["ledger records when this report was written", f"{chain.num_records} ({chain.status})"],
        ["ledger head sha256", chain.head_hash],
    ])
    book, root = _relative(ledger.path, out), _relative(out.parent.parent, out)
    sec.pre(f"# from the run's own directory ({_relative(out, report_dir)}):\n"
            f"moelab lab run {experiment.id} --ledger {book} --root {root}\n"
            f"# the training step it runs, with the resolved config:\n"
            f"moelab train {CONFIG} --out .\n"
            f"# the ledger still holds every record this report read (fails if rows were cut off or rewritten):\n"
            f"moelab lab verify --ledger {book} --head {chain.head_hash}")
    _reproductions(sec, experiment)
    return sec


def _reproductions(sec: Section, experiment: Experiment) -> None:
    """The experiment's reruns by `moelab lab reproduce` (ledger records of event `reproduction`), each step's
    verdict and first difference; the record names the original run records it was compared with."""
    done = [r for r in experiment.runs if r.body.get("event") == REPRODUCTION]
    if not done:
        sec.p(f"Not reproduced yet: `moelab lab export {experiment.id} --out BUNDLE`, then `moelab lab reproduce "
              "BUNDLE` reruns it at its commit and compares.")
        return
    rows, platforms = [], {True: "same", False: "other", None: "unknown"}
    for r in done:
        b = r.body
        for name, step in b["steps"].items():
            first = step.get("first_difference")
            rows.append([r.seq, r.created_at, name, f"{step['until']} of {step['steps']}", str(b["git_commit"])[:12],
                         platforms[b.get("same_platform")],
                         ", ".join(f"{k}={v}" for k, v in b.get("overrides", {}).items()) or "none",
                         step["verdict"], step.get("params"),
                         "—" if first is None else f"step {first['step']}: {first['metric']}",
                         f"record {step['original']['seq']}"])
    sec.p("Reproductions (`moelab lab reproduce`): each training step rerun at the recorded commit and compared "
          "with its original run, logged step by logged step.")
    sec.table(["ledger record", "time", "step", "steps rerun", "commit", "platform", "changed", "verdict",
               "final weights", "first difference", "original"], rows)


def stated_tables(experiment: Experiment, metrics: list[dict], summary: dict,
                  out: Path | None = None) -> dict[str, list[list[str]]]:
    """The tables the report states, as printed (header row first), by section id: the hypothesis table (observed
    value, its step, the verdict) and the per-domain eval table and, given the run's folder `out`, the data
    sources and mixture changes, the incidents and the samples. `moelab lab verify BUNDLE` recomputes them from
    the bundle's files and compares them with its report (no plot is drawn for that)."""
    sections = [_hypothesis(experiment, metrics, summary), _per_domain_table(metrics, summary)]
    if out is not None:
        sections += [_mixture(out, plots=False), _norms_incidents(metrics, out, plots=False), _samples(out)]
    return {s.id: [row for part in s.parts if part[0] == "table" for row in (part[1], *part[2])] for s in sections}


def experiment_verdict(experiment: Experiment) -> tuple[str, float | None]:
    """(verdict, observed value) of a run experiment's prediction: what the report's first section states."""
    out, _ = find_run_dir(experiment)
    value, _ = _final_value(read_jsonl(out / METRICS), read_summary(out), experiment.spec.prediction.metric)
    return verdict(experiment.spec.prediction, value), value


def build_sections(ledger: Ledger, exp_id: str,
                   report_dir: Path | None = None) -> tuple[Experiment, Path, list[Section]]:
    """The experiment, its run directory and the report's sections, in `SECTION_IDS` order; paths in the text
    are relative to `report_dir` when given."""
    experiment = load_experiment(ledger, exp_id)
    out, run_body = find_run_dir(experiment)
    metrics, summary = read_jsonl(out / METRICS), read_summary(out)
    sections = [_hypothesis(experiment, metrics, summary), _loss_curve(metrics, out, run_body, report_dir),
                _per_domain(metrics, summary), _mixture(out), _router(metrics, out), _norms_incidents(metrics, out),
                _amendments(experiment), _samples(out), _reproducibility(experiment, out, run_body, ledger, report_dir)]
    assert tuple(s.id for s in sections) == SECTION_IDS
    return experiment, out, sections


# ----------------------------------------------------------------------------------------------
# rendering

_CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0;max-width:100%}td,th{border:1px solid #ccc;padding:.25rem .5rem;
text-align:left;vertical-align:top;overflow-wrap:anywhere}pre{background:#f5f5f5;padding:.5rem;white-space:pre-wrap;
overflow-wrap:anywhere}.note{color:#666;font-style:italic}
img{max-width:100%}section{border-top:1px solid #ddd;margin-top:1.5rem}"""


def _html_part(part: tuple) -> str:
    kind = part[0]
    if kind == "p":
        return f"<p>{html.escape(part[1])}</p>"
    if kind == "note":
        return f'<p class="note">{html.escape(part[1])}</p>'
    if kind == "pre":
        return f"<pre>{html.escape(part[1])}</pre>"
    if kind == "table":
        head = "".join(f"<th>{html.escape(h)}</th>" for h in part[1])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in part[2])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    data = base64.b64encode(part[2]).decode()
    return f'<img alt="{html.escape(part[1])}" src="data:image/png;base64,{data}">'


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_part(part: tuple) -> str:
    kind = part[0]
    if kind == "p":
        return part[1]
    if kind == "note":
        return f"_{part[1]}_"
    if kind == "pre":
        return f"```\n{part[1].rstrip()}\n```"
    if kind == "table":
        lines = ["| " + " | ".join(part[1]) + " |", "|" + "---|" * len(part[1])]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in part[2]]
        return "\n".join(lines)
    return f"![{part[1]}]({part[1]}.png)"


def render_html(title: str, sections: list[Section]) -> str:
    body = "\n".join(f'<section id="{s.id}">\n<h2>{html.escape(s.title)}</h2>\n'
                     + "\n".join(_html_part(p) for p in s.parts) + "\n</section>" for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
            f'<link rel="icon" href="data:,"><style>{_CSS}</style></head>\n'
            f"<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def render_markdown(title: str, sections: list[Section]) -> str:
    blocks = [f"# {title}"]
    for s in sections:
        blocks.append(f'<a id="{s.id}"></a>\n## {s.title}')
        blocks += [_md_part(p) for p in s.parts]
    return "\n\n".join(blocks) + "\n"


def write_report(ledger: Ledger, exp_id: str, out_dir: str | Path | None = None) -> Path:
    """Write report.html (self-contained) and report.md (+ its PNGs) for `exp_id`; returns the HTML path.

    `out_dir` defaults to the run's output directory / "report". ConfigError for an unknown id or an
    experiment without a finished run.
    """
    run_dir, _ = find_run_dir(load_experiment(ledger, exp_id))
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    experiment, run_dir, sections = build_sections(ledger, exp_id, report_dir=out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"[{experiment.id}] {experiment.spec.title}"
    for s in sections:
        for part in s.parts:
            if part[0] == "img":
                (out / f"{part[1]}.png").write_bytes(part[2])
    (out / "report.md").write_text(render_markdown(title, sections))
    (out / "report.html").write_text(render_html(title, sections))
    return out / "report.html"
