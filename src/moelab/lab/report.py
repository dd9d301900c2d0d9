"""The report of a registered experiment: report.json, and the HTML page and Markdown rendered from it.

    moelab lab report demo-tiny                  # -> <run dir>/report/report.html, report.md, report.json
    moelab lab report demo-tiny --out /tmp/rep   # somewhere else

`write_report` reads the experiment from the ledger (spec, amendments, run records) and its training
step's output directory (`lab.view.read_run`: metrics, summary, config, incidents and, when present,
prediction.csv, mixture log, data.json, router load, samples). Every section has a stable id
(`SECTION_IDS`); a section whose source file is absent stays, with a note saying what is missing, so
the page's shape never depends on the run.

report.json holds the sections as stated: each part's text, each table's cells, each figure's name and
SHA-256 (of its .svg file, drawn by `lab.plots`), and the facts a part states beside its words (an
amendment's ledger record, the key of each reproducibility row). report.html (self-contained, each figure's
SVG inline, byte for byte its file's text; no script) and report.md (figures linked as the .svg files beside
it) are renderings of it and nothing else, so `moelab lab verify` re-renders them from report.json and
checks report.json's facts against the records (`stated_tables`) instead of reading the prose: any
sentence can be reworded. The reproducibility section names the ledger's record count and head hash at
writing time, so a reader who keeps the report can later prove the ledger was not cut short (`moelab lab
verify --head`).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.files import sha256_file, write_bytes, write_json, write_text
from moelab.lab.ledger import Ledger, verify
from moelab.lab.plots import forecast_plot, line_plot, mixture_plot, router_load_heatmap
from moelab.lab.registry import REPRODUCTION, Experiment, band_text, load_experiment, verdict
from moelab.lab.view import (RunFiles, against_band, drop_table, drops_note, find_run_dir, read_run, router_settings,
                             series, when)
from moelab.ladder.contract import self_check, trust, trust_text
from moelab.train.outputs import CONFIG, MIXTURE_LOG, ROUTER_LOAD, SAMPLES

__all__ = ["SECTION_IDS", "STATED", "REPORT_FORMAT", "REPORT_VERSION", "REPORT_JSON", "Section", "stated_tables",
           "json_tables", "build_sections", "report_document", "html_section", "markdown_section", "render_html",
           "render_markdown", "figure_name", "write_report"]

SECTION_IDS = ("hypothesis", "loss-curve", "per-domain-eval", "mixture", "router", "norms-incidents", "amendments",
               "samples", "reproducibility")
# tables `lab verify` recomputes
STATED = ("hypothesis", "per-domain-eval", "mixture", "router", "norms-incidents", "samples")
# Version 2: the router section states its settings and the dropped fraction per phase (issue 50).
REPORT_FORMAT, REPORT_VERSION, REPORT_JSON = "moelab-report", 2, "report.json"
MAX_SAMPLE_EVALS = 3  # samples shown for the first, middle and last eval that has any


# ----------------------------------------------------------------------------------------------
# sections: lists of parts, stated in report.json and rendered to HTML and Markdown from it


@dataclass
class Section:
    id: str
    title: str
    parts: list[dict] = field(default_factory=list)  # {"kind": p|note|pre|table|img, ...}: report.json's parts
    figures: dict[str, bytes] = field(default_factory=dict)  # an img part's SVG (UTF-8), written beside report.json

    def p(self, text: str, **facts: Any) -> None:
        self.parts.append({"kind": "p", "text": text, **facts})

    def note(self, text: str) -> None:
        self.parts.append({"kind": "note", "text": text})

    def pre(self, text: str, **facts: Any) -> None:
        self.parts.append({"kind": "pre", "text": text, **facts})

    def table(self, head: Sequence[str], rows: Sequence[Sequence[Any]], keys: Sequence[str] | None = None) -> None:
        """`keys` names each row's fact (a key/value table), so a check finds a row by its key, not its words."""
        part = {"kind": "table", "head": list(head), "rows": [[_cell(c) for c in r] for r in rows]}
        self.parts.append(part if keys is None else {**part, "keys": list(keys)})

    def img(self, name: str, svg: str) -> None:
        data = svg.encode()
        self.figures[name] = data
        self.parts.append({"kind": "img", "name": name, "sha256": hashlib.sha256(data).hexdigest()})


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _weights(weights: dict | None) -> str:
    """A mixture's weights as a reader scans them: 'code 0.45, prose 0.35, arithmetic 0.2' (not raw JSON)."""
    return ", ".join(f"{k} {v:g}" for k, v in (weights or {}).items()) or "—"


def figure_name(name: str) -> str:
    """The file an img part's SVG is written to, beside report.json."""
    return f"{name}.svg"


def _hypothesis(experiment: Experiment, run: RunFiles) -> Section:
    spec, sec = experiment.spec, Section("hypothesis", "Hypothesis and outcome")
    p = spec.prediction
    value, step = run.final_value(p.metric)
    outcome = verdict(p, value)
    sec.p(f"Question: {' '.join(spec.question.split())}")
    sec.p(f"Hypothesis: {' '.join(spec.hypothesis.split())}")
    sec.table(["metric", "expected (pre-registered)", "threshold (pre-registered)", "observed", "at step", "verdict"],
              [[p.metric, p.expected, band_text(p.band), value, step, outcome.upper()]])
    sec.p(f"Decision rule: {' '.join(p.decision_rule.split())}")
    sec.p(trust_text(trust(run.prediction) if run.prediction is not None else None, outcome))
    if p.band is None:
        sec.note("The prediction has no threshold, only an expected value, so the verdict cannot be decided "
                 "automatically; read the decision rule against the observed value.")
    if value is None:
        sec.note(f"The run logged no {p.metric}; the verdict is inconclusive.")
    sec.note("The verdict checks the pre-registered threshold only; any further condition in the decision rule is for "
             "the reader. The ladder's 95% band, below, is another thing: where the predicted curve should run.")
    return sec


def _self_check_text(pred_path: Path) -> str | None:
    """The prediction's leave-largest-out self-check, from its sidecar JSON, as one sentence."""
    check = self_check(pred_path)
    if check is None:
        return None
    if "skipped" in check:
        return f"Self-check skipped: {check['skipped']}"
    outcome = {"passed": "inside the target's band",
               "uninformative": f"uninformative: its band (+-{check.get('band95_half_width', float('nan')):.1%}) is too "
                                "wide to tell a good recipe from a bad one, so the prediction is not trusted"
               }.get(check.get("verdict") or ("passed" if check.get("trusted") else ""),
                     "FAILED: the prediction is not to be trusted")
    return (f"Self-check before training: refitted without {', '.join(check['held_out'])}, the law predicted its "
            f"final loss {check['final_error']:+.2%} off (MAPE {check['mape_after_10pct']:.2%}), {outcome}.")


def _relative(path: str | Path, start: Path | None) -> str:
    """`path` as seen from `start` (the report's folder): a copied report tree keeps pointing at its run."""
    return str(path) if start is None else os.path.relpath(Path(path).resolve(), Path(start).resolve())


def _loss_curve(run: RunFiles, report_dir: Path | None = None) -> Section:
    sec = Section("loss-curve", "Loss curve")
    metrics, band = run.metrics, run.band
    curves = {"train loss": series(metrics, "loss"), "eval/mean": series(metrics, "eval/mean")}
    sec.img("loss_curve", line_plot(curves, "loss", "loss (nats / token)", band))
    if run.prediction is None:
        sec.note("No predicted band: the run has no prediction.csv (from `moelab ladder`) beside it or on its record.")
        return sec
    if band is None:
        sec.note(f"No predicted band: {run.band_problem}.")
        return sec
    sec.p(f"Predicted band from {_relative(run.prediction, report_dir)}.")
    record = against_band(metrics, band)
    if record:
        sec.p(record)
    check = _self_check_text(run.prediction)
    if check:
        sec.p(check)
    if series(metrics, "forecast/final")[0]:
        sec.img("forecast", forecast_plot(metrics, band))
        sec.p("The forecast uses the prediction as its prior and the run's own evals so far (forecast/final), plus "
              "the drift the ladder's curves of the same schedule shape showed from that point to their end (in "
              "predictions `ladder fit` writes since 2026-12-07); the "
              "shaded strip is the pre-registered band of the final step, which never moves.")
    return sec


def _with_initial(metrics: list[dict], initial: dict, key: str) -> tuple[list, list]:
    """The eval series of `key` with step 0 from the summary's eval_initial when the records lack it."""
    steps, values = series(metrics, key)
    if 0 not in steps and isinstance(initial.get(key[5:]), (int, float)):
        steps, values = [0, *steps], [float(initial[key[5:]]), *values]
    return steps, values


def _per_domain(run: RunFiles, plots: bool = True) -> Section:
    """Initial and final value of every eval/* metric, and (with `plots`) their curves from step 0."""
    sec = Section("per-domain-eval", "Per-domain eval")
    keys = sorted({k for r in run.metrics for k in r if k.startswith("eval/")})
    if not keys:
        sec.note("The run logged no eval/* metrics.")
        return sec
    initial = run.summary.get("eval_initial", {})
    sec.table(["metric", "initial", "final", "at step"],
              [[key, initial.get(key[5:]), *run.final_value(key)] for key in keys])
    if plots:
        curves = {key: _with_initial(run.metrics, initial, key) for key in keys}  # step 0 as the table has it
        sec.img("per_domain_eval", line_plot(curves, "eval loss per domain", "loss (nats / token)"))
    return sec


def _data_sources(sec: Section, run: RunFiles) -> None:
    """The token stores the run read (OUT/data.json): content hash, sources with their hashes, tokens per domain."""
    if run.data is None:
        sec.note("Data built in memory at start-up (no token store): sources as in the config.")
        return
    provenance = run.data
    sec.p(f"Trained on token store content {provenance['store_hash']}.")
    sec.table(["store", "domain", "train tokens", "held-out tokens", "source", "bytes", "SHA-256"],
              [[store["location"], name, domain["tokens"]["train"], domain["tokens"]["heldout"], source["path"],
                source["bytes"], source["sha256"]]
               for store in provenance["stores"] for name, domain in store["domains"].items()
               for source in domain["sources"]])


def _mixture(run: RunFiles, plots: bool = True) -> Section:
    sec = Section("mixture", "Data mixture")
    _data_sources(sec, run)
    rows = run.mixture
    if not rows:
        sec.note(f"No mixture log: {run.out / MIXTURE_LOG} does not exist (or is empty) for this run.")
        return sec
    snapshots = [r for r in rows if r.get("kind") == "snapshot" and r.get("tokens")]
    changes = [r for r in rows if r.get("kind") == "change"]
    if not snapshots:
        sec.note("The mixture log holds no token snapshots, so there is no plot.")
    elif plots:
        sec.img("mixture", mixture_plot(snapshots))
    if changes:
        sec.table(["step", "phase", "weights", "message"],
                  [[c.get("step"), c.get("phase"), _weights(c.get("weights")), c.get("message")]
                   for c in changes])
    else:
        sec.note("No mixture changes were logged.")
    return sec


def _router(run: RunFiles, plots: bool = True) -> Section:
    """What the router did: the routing it ran with, the tokens it dropped per phase, its load and MaxVio."""
    sec = Section("router", "Router: settings, drops, load and MaxVio")
    if run.moe is not None:
        settings = router_settings(run.moe)
        sec.table(["setting", "value"], [[what, value] for _, what, value in settings], keys=[k for k, _, _ in settings])
    else:
        sec.note(f"No router settings: {run.out / CONFIG} is absent or holds no model.moe section.")
    columns, drops = drop_table(run.metrics)
    if drops:
        sec.table(columns, drops)
        note = drops_note(drops)
        if note:
            sec.note(note)
    else:
        sec.note("The run logged no drop_fraction, so its drops per phase are unknown.")
    if not plots:
        return sec
    if run.router_load is not None:
        sec.img("router_load", router_load_heatmap(run.router_load, run.router_step))
    else:
        sec.note(f"No per-layer router load: {run.out / ROUTER_LOAD} is absent, so there is no heatmap.")
    curves = {k: series(run.metrics, k) for k in ("router/maxvio", "router/maxvio_global")}
    curves = {k: v for k, v in curves.items() if v[0]}
    if curves:
        sec.img("maxvio", line_plot(curves, "MaxVio", "max violation"))
    else:
        sec.note("The run logged no router/maxvio metrics.")
    return sec


def _norms_incidents(run: RunFiles, plots: bool = True) -> Section:
    sec = Section("norms-incidents", "Norms and incidents")
    metrics = run.metrics
    keys = sorted({k for r in metrics for k in r if k.startswith("norm/")})
    for group in ("params", "grads", "updates") if plots else ():
        group_keys = [k for k in keys if k.startswith(f"norm/{group}/")]
        if group_keys:
            sec.img(f"norms_{group}", line_plot({k[len(f'norm/{group}/'):]: series(metrics, k) for k in group_keys},
                                                f"norm/{group}", "L2 norm", log_y=True))
    other = [k for k in keys if k.count("/") == 1]
    if other and plots:
        sec.img("norms_other", line_plot({k: series(metrics, k) for k in other}, "other norms", "L2 norm"))
    if not keys:
        sec.note("The run logged no norm/* metrics.")
    if run.incidents:
        sec.table(["step", "rule", "module", "values"],
                  [[i.get("step"), i.get("rule"), i.get("module"), json.dumps(i.get("values"), sort_keys=True)]
                   for i in run.incidents])
    else:
        sec.p("No incidents.")
    return sec


def _amendments(experiment: Experiment) -> Section:
    """Each amendment's paragraph and diff carry its ledger record (`record`): what `lab verify` checks."""
    sec = Section("amendments", "Amendments")
    if not experiment.amendments:
        sec.p("None: the spec ran as registered.")
    for n, a in enumerate(experiment.amendments, 1):
        sec.p(f"{n}. {a.body['reason']} ({when(a.created_at)}; ledger record {a.seq}); changed: "
              f"{', '.join(a.body['changes'])}", record=a.seq)
        sec.pre(a.body["diff"], record=a.seq)
    return sec


def _printable(text: str | None) -> str | None:
    # An early model emits arbitrary bytes; control characters would garble the table and the page.
    if text is None:
        return None
    return "".join(c if c.isprintable() else "\u23ce" if c == "\n" else "\ufffd" for c in text)


def _samples(run: RunFiles) -> Section:
    sec = Section("samples", "Samples")
    rows = run.samples
    if not rows:
        sec.note(f"No samples: {run.out / SAMPLES} does not exist (or is empty) for this run.")
        return sec
    steps = sorted({r["step"] for r in rows})
    shown = sorted({steps[0], steps[len(steps) // 2], steps[-1]})[:MAX_SAMPLE_EVALS]
    sec.table(["step", "domain", "prompt", "continuation"],
              [[r["step"], r.get("domain"), _printable(r.get("prompt")), _printable(r.get("continuation"))]
               for r in rows if r["step"] in shown])
    return sec


def _reproducibility(experiment: Experiment, run: RunFiles, ledger: Ledger, report_dir: Path | None = None) -> Section:
    """Versions and hashes, and the commands that rerun and check the run, written from the run's own
    directory (paths relative to it; the table's relative to the report's folder)."""
    sec = Section("reproducibility", "Reproducibility")
    out, run_body = run.out, run.record
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
    facts = {
        "git_commit": ["git commit of the run", commit],
        "spec_sha256": ["spec sha256", run_body.get("spec_hash") or experiment.spec_hash],
        "version": ["step version (config hash)", run_body.get("version")],
        "config_sha256": [f"{CONFIG} sha256", sha256_file(out / CONFIG) if (out / CONFIG).is_file() else None],
        "output_dir": ["output directory", _relative(out, report_dir)],
        "preempted": ["preempted, then resumed from the checkpoint at",
                      ", ".join(stops) or "never (one uninterrupted run)"],
        "worker_lost": ["a worker lost (Ray), the step retried", ", ".join(lost) or "never"],
        "ledger": ["ledger", _relative(ledger.path, report_dir)],
        "ledger_records": ["ledger records when this report was written", f"{chain.num_records} ({chain.status})"],
        "ledger_head": ["ledger head sha256", chain.head_hash],
    }
    sec.table(["what", "value"], list(facts.values()), keys=list(facts))
    book, root = _relative(ledger.path, out), _relative(out.parent.parent, out)
    sec.pre(f"# from the run's own directory ({_relative(out, report_dir)}):\n"
            f"moelab lab run {experiment.id} --ledger {book} --root {root}\n"
            f"# the training step it runs, with the resolved config:\n"
            f"moelab train {CONFIG} --out .\n"
            f"# the ledger still holds every record this report read (fails if rows were cut off or rewritten):\n"
            f"moelab lab verify --ledger {book} --head {chain.head_hash}")
    _reproductions(sec, experiment, book)
    return sec


def _reproductions(sec: Section, experiment: Experiment, book: str) -> None:
    """The experiment's reruns by `moelab lab reproduce` (ledger records of event `reproduction`), each step's
    verdict and first difference; the record names the original run records it was compared with. None yet: the
    commands that make one, as they paste (`book`: the ledger's path from the report's folder, as above)."""
    done = [r for r in experiment.runs if r.body.get("event") == REPRODUCTION]
    if not done:
        sec.p("Not reproduced yet. To rerun it at its commit and compare, from the same folder as the commands above:")
        sec.pre(f"moelab lab export {experiment.id} --ledger {book} --out BUNDLE\nmoelab lab reproduce BUNDLE")
        return
    rows, platforms = [], {True: "same", False: "other", None: "unknown"}
    for r in done:
        b = r.body
        for name, step in b["steps"].items():
            first = step.get("first_difference")
            rows.append([r.seq, when(r.created_at), name, f"{step['until']} of {step['steps']}", str(b["git_commit"])[:12],
                         platforms[b.get("same_platform")],
                         ", ".join(f"{k}={v}" for k, v in b.get("overrides", {}).items()) or "none",
                         step["verdict"], step.get("params"),
                         "—" if first is None else f"step {first['step']}: {first['metric']}",
                         f"record {step['original']['seq']}"])
    sec.p("Reproductions (`moelab lab reproduce`): each training step rerun at the recorded commit and compared "
          "with its original run, logged step by logged step.")
    sec.table(["ledger record", "time", "step", "steps rerun", "commit", "platform", "changed", "verdict",
               "final weights", "first difference", "original"], rows)


def _tables(sections: list[dict]) -> dict[str, list[list[str]]]:
    """Each section's table rows, all its tables in order, by section id; headers left out (they are wording)."""
    return {s["id"]: [row for part in s["parts"] if part["kind"] == "table" for row in part["rows"]] for s in sections}


def stated_tables(experiment: Experiment, run: RunFiles) -> dict[str, list[list[str]]]:
    """The rows the report's `STATED` tables hold for this run (no plot is drawn): the hypothesis table (observed
    value, its step, the verdict), the per-domain evals, the data sources and mixture changes, the router's
    settings and drops per phase, the incidents and the samples. `moelab lab verify BUNDLE` recomputes them from the bundle's files and compares them with its
    report.json (`json_tables`)."""
    sections = [_hypothesis(experiment, run), _per_domain(run, plots=False), _mixture(run, plots=False),
                _router(run, plots=False), _norms_incidents(run, plots=False), _samples(run)]
    return _tables([{"id": s.id, "parts": s.parts} for s in sections])


def json_tables(document: dict) -> dict[str, list[list[str]]]:
    """The rows of the `STATED` tables that report.json holds, as `stated_tables` gives them."""
    return {sid: rows for sid, rows in _tables(document["sections"]).items() if sid in STATED}


def build_sections(ledger: Ledger, exp_id: str, report_dir: Path | None = None) -> tuple[Experiment, list[Section]]:
    """The experiment and the report's sections, in `SECTION_IDS` order; paths in the text are relative to
    `report_dir` when given."""
    experiment = load_experiment(ledger, exp_id)
    run = read_run(*find_run_dir(experiment))
    sections = [_hypothesis(experiment, run), _loss_curve(run, report_dir), _per_domain(run), _mixture(run),
                _router(run), _norms_incidents(run), _amendments(experiment), _samples(run),
                _reproducibility(experiment, run, ledger, report_dir)]
    assert tuple(s.id for s in sections) == SECTION_IDS
    return experiment, sections


def report_document(title: str, sections: list[Section]) -> dict:
    """What report.json holds: the format, the title and every section's parts."""
    return {"format": REPORT_FORMAT, "version": REPORT_VERSION, "title": title,
            "sections": [{"id": s.id, "title": s.title, "parts": s.parts} for s in sections]}


# ----------------------------------------------------------------------------------------------
# rendering: report.json -> HTML and Markdown, and nothing else (`lab verify` renders them again)

_CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0;max-width:100%}td,th{border:1px solid #ccc;padding:.25rem .5rem;
text-align:left;vertical-align:top;overflow-wrap:break-word}.long{overflow-wrap:anywhere}pre{background:#f5f5f5;padding:.5rem;white-space:pre-wrap;
overflow-wrap:anywhere}.note{color:#666;font-style:italic}
svg{max-width:100%;height:auto}section{border-top:1px solid #ddd;margin-top:1.5rem}"""


_LONG = 24  # characters: a token longer than this (a hash, a path, a command) may break anywhere; words never do


def _cell_html(text: str) -> str:
    """A table cell: each token over `_LONG` characters in a span that may wrap anywhere, so a table fits the
    window without breaking a word like "step" mid-word (issue 54)."""
    return " ".join(f'<span class="long">{html.escape(t)}</span>' if len(t) > _LONG else html.escape(t)
                    for t in text.split(" "))


def _html_part(part: dict, figures: dict[str, bytes]) -> str:
    kind = part["kind"]
    if kind == "p":
        return f"<p>{html.escape(part['text'])}</p>"
    if kind == "note":
        return f'<p class="note">{html.escape(part["text"])}</p>'
    if kind == "pre":
        return f"<pre>{html.escape(part['text'])}</pre>"
    if kind == "table":
        head = "".join(f"<th>{html.escape(h)}</th>" for h in part["head"])
        body = "".join("<tr>" + "".join(f"<td>{_cell_html(c)}</td>" for c in row) + "</tr>" for row in part["rows"])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return figures[part["name"]].decode()  # the file's own text: what report.json's SHA-256 names


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_part(part: dict) -> str:
    kind = part["kind"]
    if kind == "p":
        return part["text"]
    if kind == "note":
        return f"_{part['text']}_"
    if kind == "pre":
        return f"```\n{part['text'].rstrip()}\n```"
    if kind == "table":
        lines = ["| " + " | ".join(part["head"]) + " |", "|" + "---|" * len(part["head"])]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in part["rows"]]
        return "\n".join(lines)
    return f"![{part['name']}]({figure_name(part['name'])})"


def html_section(section: dict, figures: dict[str, bytes]) -> str:
    return (f'<section id="{section["id"]}">\n<h2>{html.escape(section["title"])}</h2>\n'
            + "\n".join(_html_part(p, figures) for p in section["parts"]) + "\n</section>")


def render_html(document: dict, figures: dict[str, bytes]) -> str:
    """report.html: `document` (report.json) with its figures (the .svg files' bytes, by name) inline."""
    title = html.escape(document["title"])
    body = "\n".join(html_section(s, figures) for s in document["sections"])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
            f'<link rel="icon" href="data:,"><style>{_CSS}</style></head>\n'
            f"<body>\n<h1>{title}</h1>\n{body}\n</body></html>\n")


def markdown_section(section: dict) -> str:
    return "\n\n".join([f'<a id="{section["id"]}"></a>\n## {section["title"]}',
                        *(_md_part(p) for p in section["parts"])])


def render_markdown(document: dict) -> str:
    """report.md: `document` (report.json), its figures linked as the files beside it."""
    return "\n\n".join([f"# {document['title']}", *(markdown_section(s) for s in document["sections"])]) + "\n"


def write_report(ledger: Ledger, exp_id: str, out_dir: str | Path | None = None) -> Path:
    """Write report.json, report.html (self-contained), report.md and its SVGs for `exp_id`; returns the HTML path.

    `out_dir` defaults to the run's output directory / "report". ConfigError for an unknown id or an
    experiment without a finished run.
    """
    run_dir, _ = find_run_dir(load_experiment(ledger, exp_id))
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    experiment, sections = build_sections(ledger, exp_id, report_dir=out)
    out.mkdir(parents=True, exist_ok=True)
    document = report_document(f"[{experiment.id}] {experiment.spec.title}", sections)
    figures = {name: data for s in sections for name, data in s.figures.items()}
    for name, data in figures.items():
        write_bytes(out / figure_name(name), data)
    write_json(out / REPORT_JSON, document)
    write_text(out / "report.md", render_markdown(document))
    write_text(out / "report.html", render_html(document, figures))
    return out / "report.html"
