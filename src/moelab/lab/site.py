"""The open lab's notebook: one static site of every experiment on a ledger, rebuilt as runs go.

    build_site(open_ledger("lab/ledger.sqlite"), root="runs/lab", out="site")   # index, timeline, one page each
    build_site(ledger, root, out, only="demo-ladder")                           # after an eval: that one's pages
    publish_site("site", "s3://bucket/lab")                                     # only the files that changed

What a reader gets, all from the ledger (and, for a predicted band, the run directories under ROOT), as
`lab.view.experiment_view` reads it (the report reads the same layer, and both draw with `lab.plots`):
`index.html` lists every experiment with its question, status, the pre-registered prediction against the
outcome, the verdict, its amendments and last change; `exp/<id>.html` holds the spec as registered, the
hypothesis and decision rule, every amendment with its reason and diff, each run's curves against the
predicted band and the live forecast (inline SVG), incidents, the data-mixture log, the DAG's steps and
the experiment's bundle (`lab export`, written once the experiment ends) with the command that verifies
it; `timeline.html` lists the ledger's events across experiments. Refuted, failed, abandoned and amended
experiments get the same rows and pages as confirmed ones.

Trust: the chain is verified before anything is written (a broken one raises ConfigError naming the
record; nothing is written), and every page names the newest ledger record it reflects (seq and hash),
which `moelab lab verify --head HASH` proves is still in the chain. `site.json` names the whole ledger's
head at build time and the SHA-256 of every file, which `publish_site` compares to upload only changes.

Portable: relative links only, no script, no font or style from a network, no absolute path of the
building machine (record paths are shown relative to ROOT), and a layout that reads at phone width.
Incremental and atomic: pages hold no build time, so a page whose records did not change is byte-for-byte
the same and is not rewritten; a changed one is written whole (`moelab.files`: a temporary name, renamed
into place), so a reader never sees half a page. A new eval changes its experiment's page only (the index and timeline
show events, not metrics).
"""

from __future__ import annotations

import contextlib
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from moelab.errors import ConfigError
from moelab.files import sha256_file, write_bytes
from moelab.lab.bundle import TAR_SUFFIX, export_bundle
from moelab.lab.ledger import Ledger, Record, records, verify
from moelab.lab.plots import svg_curves
from moelab.lab.registry import (ABANDONED, CONFIRMED, FAILED, FINISHED, INCONCLUSIVE, REFUTED, REGISTERED, RUNNING,
                                 TRAIN_STEP, band_text, load_experiment)
from moelab.lab.view import (ExperimentView, RunView, against_band, drop_table, drops_note, experiment_view,
                             router_settings, series, when)
from moelab.ladder import contract

__all__ = ["INDEX", "TIMELINE", "SITE_JSON", "build_site", "publish_site", "Built", "counted"]

INDEX, TIMELINE, SITE_JSON = "index.html", "timeline.html", "site.json"
EVENT_KINDS = ("experiment", "amendment", "run")  # what the index and timeline read; metrics stream beside them
STREAM_KINDS = ("metric", "incident", "mixture")


# ----------------------------------------------------------------------------------------------
# HTML


_CSS = """body{font:16px/1.45 system-ui,sans-serif;margin:0 auto;max-width:60rem;padding:0 .8rem;color:#222}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:1.6rem;border-bottom:1px solid #ddd}
.wide{overflow-x:auto}table{border-collapse:collapse;font-size:.9rem}td,th{border:1px solid #ddd;padding:.2rem .4rem;
text-align:left;vertical-align:top}pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.5rem;
font-size:.85rem}code{word-break:break-all}svg.plot{width:100%;height:auto;max-width:640px;font-size:11px}
svg .t{font-weight:bold}.badge{padding:0 .35rem;border-radius:.3rem;color:#fff;background:#666;white-space:nowrap}
.confirmed,.finished,.passed{background:#2b8a3e}.refuted,.failed{background:#b02a2a}.inconclusive,.abandoned,.uninformative,.skipped{background:#8a6d00}
.running{background:#1f5fa8}.registered{background:#666}.note,.legend{color:#555}.legend{font-size:.85rem;margin-top:0}
nav a{margin-right:1rem}
@media (max-width:40rem){table.cards tr:first-child{display:none}table.cards,table.cards tr,table.cards td{display:block}
table.cards tr{border:1px solid #ccc;margin:.5rem 0}table.cards td{border:0}
table.cards td::before{content:attr(data-label) ": ";font-weight:bold}}
footer{margin:2rem 0 1rem;font-size:.85rem;color:#555}"""


def counted(n: int, noun: str) -> str:
    """'1 experiment', '2 experiments': what a reader sees instead of '1 experiment(s)'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _badge(word: str | None) -> str:
    return f'<span class="badge {_e(word)}">{_e(word)}</span>' if word else ""


def _table(header: list[str], rows: list[list[str]], cards: bool = False) -> str:
    """A table of already-escaped cells, scrolling sideways on a narrow screen rather than widening the page;
    with `cards`, each row becomes a card of labelled lines there instead (the index, the timeline)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td data-label="{h}">{c}</td>' if cards else f"<td>{c}</td>"
                                    for h, c in zip(header, row)) + "</tr>" for row in rows)
    return f'<div class="wide"><table{" class=cards" if cards else ""}><tr>{head}</tr>{body}</table></div>'


def _page(title: str, body: str, home: str, head: Record) -> str:
    """A whole page: `home` is the relative way back to the site's root ("" or "../")."""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
            f'<style>{_CSS}</style></head><body><nav><a href="{home}{INDEX}">Experiments</a>'
            f'<a href="{home}{TIMELINE}">Timeline</a></nav>{body}'
            f'<footer>Built from ledger record {head.seq} (sha256 <code>{head.hash}</code>, written {_e(when(head.created_at))}).'
            f' Check it is still in the chain: <code>moelab lab verify --head {head.hash[:16]}</code>.</footer>'
            "</body></html>\n")


def _predicted(view: ExperimentView) -> str:
    p = view.experiment.spec.prediction
    expected = "" if p.expected is None else f"{p.expected:g} "
    return f"pre-registered: {_e(p.metric)} {('expected ' + expected) if expected else ''}(threshold {band_text(p.band)})"


def _readable(value: Any) -> str:
    """A spec for reading: mappings as labelled lists, lists as lists, prose as paragraphs, a list of numbers on
    one line; the YAML it was registered as stays one click away."""
    if isinstance(value, dict):
        return "<dl>" + "".join(f"<dt>{_e(str(k))}</dt><dd>{_readable(v)}</dd>" for k, v in value.items()) + "</dl>"
    if isinstance(value, list):
        def numbers(items):
            return all(isinstance(v, (int, float, type(None))) for v in items)

        if numbers(value):
            return _e(", ".join("null" if v is None else f"{v:g}" for v in value))
        if all(isinstance(v, list) and numbers(v) for v in value):  # e.g. ladder rungs [[32, 1], [48, 2]]: one line
            return _e(", ".join(f"[{_readable(v)}]" for v in value))
        return "<ul>" + "".join(f"<li>{_readable(v)}</li>" for v in value) + "</ul>"
    if isinstance(value, str) and len(value) > 80:
        return "".join(f"<p>{_e(' '.join(para.split()))}</p>" for para in value.split("\n\n") if para.strip())
    return _e("null" if value is None else str(value))


def _trust(view: ExperimentView) -> str:
    """The ladder prediction's self-check beside the verdict once it stands (`contract.trust`): a badge, and
    nothing for an experiment without a ladder or not yet finished."""
    if view.trust is None or view.status != FINISHED:
        return ""
    return f'<br>prediction: {_badge(view.trust["self_check"])}'


def _outcome(view: ExperimentView) -> str:
    """The observed value once the main run finished; "-" before (the page has the live curve), so the index does
    not change with every eval."""
    if view.observed is None or view.status != FINISHED:
        return "-"
    return f"{view.observed:.4g}"


Hosts = tuple[tuple[str, str], ...]  # (absolute path on the building machine, what a page says instead)


def _host_paths(root: Path, ledger: Ledger) -> Hosts:
    """The building machine's paths a record or message may name, longest first, with their stand-ins."""
    pairs = {str(Path.home()): "~", str(Path.cwd()): ".",  # a later name wins where two paths are the same
             str(Path(ledger.path).resolve().parent): "LEDGER_DIR", str(root.resolve()): "ROOT"}
    return tuple(sorted(((k, v) for k, v in pairs.items() if k not in ("", "/")), key=lambda kv: -len(kv[0])))


def _scrub(text: str, hosts: Hosts) -> str:
    """`text` with the building machine's absolute paths replaced (ROOT/..., ~/...): pages name no host path."""
    for prefix, label in hosts:
        text = text.replace(prefix + "/", label + "/").replace(prefix, label)
    return text


def _experiment_page(view: ExperimentView, bundle: str | None, bundle_note: str) -> str:
    exp, spec = view.experiment, view.experiment.spec
    p = spec.prediction
    reg = exp.registration
    parts = [f"<h1>{_e(spec.title)}</h1>",
             f"<p><code>{_e(exp.id)}</code> {_badge(view.status)} {_badge(view.verdict)} "
             f"owner {_e(spec.owner)}, registered {_e(when(reg.created_at))} (ledger record {reg.seq})</p>",
             f"<h2 id=\"question\">Question</h2><p>{_e(spec.question)}</p>",
             f"<h2 id=\"hypothesis\">Hypothesis and prediction</h2><p>{_e(spec.hypothesis)}</p>",
             _table(["metric", "expected (pre-registered)", "threshold (pre-registered)", "decision rule", "observed", "verdict"],
                    [[_e(p.metric), _e("-" if p.expected is None else f"{p.expected:g}"), _e(band_text(p.band)),
                      _e(p.decision_rule), _outcome(view), _badge(view.verdict) or _e(view.status)]])]
    if view.status == FINISHED and view.trust is not None:
        parts.append(f'<p id="trust">{_e(contract.trust_text(view.trust, view.verdict))}</p>')
    registered = yaml.safe_dump(reg.body["spec"], sort_keys=False, width=10**6)
    parts.append(f"<h2 id=\"spec\">Spec as registered</h2><p>content hash <code>{_e(reg.body.get('spec_hash'))}</code>,"
                 f" git commit <code>{_e(reg.body.get('git_commit'))}</code></p>{_readable(reg.body['spec'])}"
                 f"<details><summary>the spec as YAML</summary><pre>{_e(registered)}</pre></details>")
    parts.append(f"<h2 id=\"amendments\">Amendments ({len(exp.amendments)})</h2>")
    if not exp.amendments:
        parts.append('<p class="note">None: the spec in force is the one registered.</p>')
    for i, a in enumerate(exp.amendments, 1):
        parts.append(f"<h3>Amendment {i}: {_e(when(a.created_at))} (ledger record {a.seq})</h3>"
                     f"<p>Reason: {_e(a.body.get('reason'))}</p><pre>{_e(str(a.body.get('diff', '')))}</pre>")
    parts.append("<h2 id=\"runs\">Runs</h2>")
    if not view.runs:
        parts.append('<p class="note">Nothing has trained yet.</p>')
    for run in view.runs:  # the main run first, the ladder's rungs after it
        parts.append(_run_section(run, p.metric, p.band, view.main is not None and run.name == view.main))
    parts.append("<h2 id=\"steps\">Steps</h2>")
    rows = [[_e(step), _e(e[-1].body.get("event")), _e(e[-1].body.get("attempt", "")),
             _e(str(Path(e[-1].body["output_dir"]).name) if e[-1].body.get("output_dir") else ""),
             _e(when(e[-1].created_at)), _e(str(e[-1].body.get("error") or e[-1].body.get("reason") or ""))]
            for step, e in view.steps.items()]
    parts.append(_table(["step", "last event", "attempt", "directory", "at", "error or reason"], rows) if rows else
                 '<p class="note">No step has run.</p>')
    parts.append("<h2 id=\"bundle\">Bundle</h2>")
    if bundle is not None:
        parts.append(f'<p><a href="../{_e(bundle)}">{_e(Path(bundle).name)}</a>: the spec, its amendments, the ledger '
                     "records and chain, every step's files and the report, hashed. Check it anywhere:</p>"
                     f"<pre>moelab lab verify {_e(Path(bundle).name)}</pre>")
    else:
        parts.append(f'<p class="note">{_e(bundle_note)} Write one with <code>moelab lab export {_e(exp.id)} --out '
                     f'{_e(exp.id)}{TAR_SUFFIX}</code> and check it with <code>moelab lab verify {_e(exp.id)}{TAR_SUFFIX}'
                     "</code>.</p>")
    return _page(f"{exp.id}: {spec.title}", "".join(parts), "../", view.head)


def _run_section(run: RunView, metric: str, band: tuple | None, main: bool) -> str:
    """A run's plots and tables. The main run's first plot is its pre-registered metric against the fit's
    predicted band, the live forecast and the registered band's edges; then every eval domain; then train loss."""
    parts = [f"<h3>{_e(run.name)}{' (the main run)' if main else ''}</h3>"]
    evals = sorted({k for r in run.metrics for k in r if k.startswith("eval/")})
    if main:
        curves = {metric: series(run.metrics, metric)}
        shaded = None
        if run.band is not None:
            shaded = (run.band["step"], run.band["lo95"], run.band["hi95"])
            curves["predicted by the fit"] = (run.band["step"], run.band["loss_pred"])
        if any("forecast/final" in r for r in run.metrics):
            curves["live forecast of the final value"] = series(run.metrics, "forecast/final")
        lines = {f"pre-registered {'low' if i == 0 else 'high'} edge": edge
                 for i, edge in enumerate(band or ()) if edge is not None}
        title = f"{run.name}: {metric}" + (" against the predicted 95% band" if shaded else "")
        parts.append(svg_curves(curves, title, band=shaded, hlines=lines))
        record = against_band(run.metrics, run.band, metric)
        if record:
            parts.append(f'<p class="note">{_e(record)}</p>')
        if run.band_problem:  # a prediction it was watched against, unreadable: said, not hidden
            parts.append(f'<p class="note">No predicted band: {_e(run.band_problem)}.</p>')
    if evals:
        parts.append(svg_curves({k: series(run.metrics, k) for k in evals}, f"{run.name}: held-out loss by domain"))
    if any("loss" in r for r in run.metrics):
        parts.append(svg_curves({"train loss": series(run.metrics, "loss")}, f"{run.name}: train loss"))
    if evals:
        last = next(r for r in reversed(run.metrics) if any(k in r for k in evals))
        parts.append(_table(["step", *map(_e, evals)], [[_e(last["step"]), *(f"{last[k]:.4f}" if k in last else "-"
                                                                           for k in evals)]]))
    parts.append(_router_tables(run, main))
    parts.append(f"<h4>Incidents ({len(run.incidents)})</h4>")
    parts.append(_table(["step", "rule", "module", "values"],
                        [[_e(i.get("step")), _e(i.get("rule")), _e(i.get("module")),
                          _e(json.dumps(i.get("values"), sort_keys=True))] for i in run.incidents])
                 if run.incidents else '<p class="note">None: no spike, norm or off-track rule fired.</p>')
    parts.append(f"<h4>Data-mixture log ({len(run.mixture)})</h4>")
    parts.append(_table(["step", "phase", "kind", "weights or tokens read", "message"],
                        [[_e(m.get("step")), _e(m.get("phase")), _e(m.get("kind")),
                          _e(", ".join(f"{k} {v:g}" for k, v in sorted((m.get("weights") or m.get("tokens") or {}).items())
                                       if isinstance(v, (int, float)))), _e(m.get("message"))]
                         for m in run.mixture]) if run.mixture else '<p class="note">No mixture entries.</p>')
    return "".join(parts)


def _router_tables(run: RunView, main: bool) -> str:
    """What the router did: the main run's routing settings (from its config.yaml) and, for any run, the tokens
    it dropped per phase; the same rows as the report's router section (`lab.view`)."""
    parts = ["<h4>Router</h4>"]
    if main and run.moe is not None:
        parts.append(_table(["setting", "value"], [[_e(what), _e(value)] for _, what, value in router_settings(run.moe)]))
    elif main:
        parts.append('<p class="note">No router settings: the run\'s config.yaml was not found.</p>')
    columns, drops = drop_table(run.metrics)
    fraction = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    parts.append(_table(columns, [[_e(phase), _e(n), *(fraction(v) for v in means)] for phase, n, *means in drops])
                 if drops else '<p class="note">No drop_fraction logged.</p>')
    note = drops_note(drops)
    if note:
        parts.append(f'<p class="note">{_e(note)}</p>')
    return "".join(parts)


def _page_name(exp_id: str) -> str:
    """exp/<id>.html, with anything but letters, digits, '.', '_' and '-' escaped: any static host serves it."""
    safe = "".join(c if c.isalnum() or c in "._-" else f"~{ord(c):x}" for c in exp_id)
    return f"exp/{safe}.html"


def _index_page(views: list[ExperimentView], head: Record) -> str:
    rows = [[f'<a href="{_e(_page_name(v.experiment.id))}">{_e(v.experiment.id)}</a><br>{_e(v.experiment.spec.title)}',
             _e(v.experiment.spec.question), _badge(v.status), _predicted(v), _outcome(v),
             (_badge(v.verdict) or "-") + _trust(v), str(len(v.experiment.amendments)),
             f"{_e(when(v.last_event.created_at))}<br>{_e(_event_words(v.last_event))}"] for v in views]
    counts = {s: sum(v.status == s for v in views) for s in (REGISTERED, RUNNING, FINISHED, FAILED, ABANDONED)}
    verdicts = {s: sum(v.verdict == s for v in views) for s in (CONFIRMED, REFUTED, INCONCLUSIVE)}
    summary = ", ".join(f"{n} {s}" for s, n in {**counts, **verdicts}.items() if n)
    body = (f"<h1>The lab: {counted(len(views), 'experiment')}</h1><p>{_e(summary) or 'Nothing registered yet.'}. Every "
            "experiment is listed as registered, whatever its outcome: refuted, failed and abandoned ones stay "
            "on the record beside confirmed ones.</p>"
            + _table(["experiment", "question", "status", "pre-registered prediction", "observed", "verdict",
                      "amendments", "last change"], rows, cards=True))
    return _page("The lab", body, "", head)


def _event_words(record: Record) -> str:
    body = record.body
    if record.kind == "experiment":
        return "registered"
    if record.kind == "amendment":
        return f"amended: {body.get('reason')}"
    event, step = body.get("event"), body.get("step")
    if event == "abandoned":
        return f"abandoned: {body.get('reason')}"
    if event == "reproduction":
        return f"reproduced: {body.get('verdict')}"
    return f"{step} {event}" + (f" ({body.get('error')})" if body.get("error") else "")


def _timeline_page(views: list[ExperimentView], events: list[Record], head: Record) -> str:
    titles = {v.experiment.id: v for v in views}
    rows = []
    for record in reversed(events):  # newest first
        view = titles.get(record.key)
        link = f'<a href="{_e(_page_name(record.key))}">{_e(record.key)}</a>' if view else _e(record.key)
        words = _event_words(record)
        if record.kind == "run" and record.body.get("step") == TRAIN_STEP and record.body.get("event") == "finished":
            words += f": concluded {view.verdict}" if view and view.verdict else ""
        rows.append([_e(when(record.created_at)), str(record.seq), link, _e(words)])
    body = (f"<h1>Timeline: {len(events)} event(s)</h1><p>What was registered, amended, run and concluded, newest "
            "first (metric, incident and mixture records are on each experiment's page).</p>"
            + _table(["time", "record", "experiment", "event"], rows, cards=True))
    return _page("The lab: timeline", body, "", head)


# ----------------------------------------------------------------------------------------------
# building


@dataclass(frozen=True)
class Built:
    """What a build did: the files it wrote (relative to the site), how many it left as they were, the head."""

    out: Path
    written: list[str]
    unchanged: int
    num_experiments: int
    head_seq: int
    head_hash: str


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Write `data` to `path` through a temporary name and a rename (atomic for a reader); False when the file
    already holds exactly `data` (then it is not touched)."""
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, data)
    return True


def _bundle(ledger: Ledger, view: ExperimentView, out: Path, written: list[str]) -> tuple[str | None, str]:
    """The experiment's bundle in the site (bundles/<id>-r<seq>.tar.gz, seq its newest record), exported once an
    experiment has ended and kept until a newer record replaces it; (relative path or None, why none)."""
    if view.status not in (FINISHED, FAILED, ABANDONED):
        return None, f"No bundle yet: the experiment is {view.status}; the site adds one when it ends."
    stem = _page_name(view.experiment.id)[len("exp/"):-len(".html")]
    name = f"bundles/{stem}-r{view.head.seq}{TAR_SUFFIX}"
    if not (out / name).is_file():
        try:
            export_bundle(ledger, view.experiment.id, out / name)
        except ConfigError as e:
            return None, f"No bundle: {e}"
        written.append(name)
        for old in (out / "bundles").glob(f"{stem}-r*{TAR_SUFFIX}"):
            if old.name != Path(name).name:
                old.unlink()
    return name, ""


def build_site(ledger: Ledger, root: str | Path, out: str | Path, only: str | None = None,
               bundles: bool = True) -> Built:
    """Write (or bring up to date) the site of every experiment on `ledger` into `out`.

    Refused (ConfigError, nothing written) when the ledger's chain does not verify. With `only`, the pages of
    that experiment alone are rendered (plus the index and timeline, which change only with its events): what a
    live rebuild after an eval needs. A file whose content is unchanged is not rewritten.
    """
    root, out = Path(root), Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; the site is a folder. Pass a folder (new or a site built before).")
    check = verify(ledger)
    if not check.ok:
        raise ConfigError(f"the ledger {ledger.path} fails its hash check at record {check.broken_seq}: "
                          f"{check.problem}. No site was written: pages built from a broken chain would carry the "
                          f"damage. Restore the ledger from a copy you trust; `moelab lab verify --ledger {ledger.path}`"
                          " shows the details.")
    if check.num_records == 0:
        raise ConfigError(f"the ledger {ledger.path} holds no record: register an experiment first with "
                          "`moelab lab register SPEC.yaml`.")
    every = records(ledger)
    by_key: dict[str, list[Record]] = {}
    for record in every:
        if record.kind in STREAM_KINDS:
            by_key.setdefault(record.key, []).append(record)
    ids = [r.key for r in every if r.kind == "experiment"]
    views = [experiment_view(load_experiment(ledger, i), by_key.get(i, []), root) for i in ids]
    events = [r for r in every if r.kind in EVENT_KINDS]
    written: list[str] = []
    unchanged = 0
    hosts = _host_paths(root, ledger)

    def put(name: str, text: str) -> None:
        nonlocal unchanged
        if _write_if_changed(out / name, _scrub(text, hosts).encode()):  # no page names a path of this machine
            written.append(name)
        else:
            unchanged += 1

    with _writes_to(out, "--out"):
        for view in views:
            if only is not None and view.experiment.id != only:
                continue
            bundle, note = (_bundle(ledger, view, out, written) if bundles else
                            (None, "Bundles were not built into this site."))
            put(_page_name(view.experiment.id), _experiment_page(view, bundle, note))
        event_head = events[-1]
        put(INDEX, _index_page(views, event_head))
        put(TIMELINE, _timeline_page(views, events, event_head))
        files = {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(out.rglob("*"))
                 if p.is_file() and p.name != SITE_JSON and not p.name.startswith(".")}
        info = {"format": "moelab-site", "version": 1, "ledger": {"num_records": check.num_records,
                                                                   "head_hash": check.head_hash},
                "experiments": len(views), "files": files}
        _write_if_changed(out / SITE_JSON, (json.dumps(info, indent=1, sort_keys=True) + "\n").encode())
    return Built(out, written, unchanged, len(views), check.num_records, check.head_hash)


@contextlib.contextmanager
def _writes_to(where: str | Path, option: str) -> Iterator[None]:
    """A folder the site cannot be written into (a file in the way, no permission, a read-only disk) as one
    ConfigError naming the path and the option, not a traceback. Pages already written stay whole (atomic)."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{option} {where}: cannot write {e.filename or where} ({e.strerror or e}). Choose a "
                          "folder you can write to, with no file in the way of its pages.") from None


# ----------------------------------------------------------------------------------------------
# publishing


def publish_site(site: str | Path, destination: str) -> list[str]:
    """Copy the site to `destination` (s3://, gs://, any fsspec URL, or a folder), only the files whose SHA-256
    differs from the site.json published there before; site.json goes last, so a reader of the destination
    never sees a manifest ahead of its files. Returns the files copied."""
    from moelab.data.remote import exists, join, publish, read_bytes

    site = Path(site)
    local = json.loads((site / SITE_JSON).read_text())["files"]
    target = join(destination, SITE_JSON)
    published: dict[str, str] = {}
    if exists(target):
        try:
            published = json.loads(read_bytes(target))["files"]
        except (ValueError, KeyError, TypeError):
            published = {}  # a manifest we cannot read: copy everything again
    copied = [name for name, digest in local.items() if published.get(name) != digest]
    with _writes_to(destination, "--publish"):  # a local destination; object storage raises DataError itself
        for name in copied:
            publish(site / name, join(destination, name))
        publish(site / SITE_JSON, target)
    return copied
