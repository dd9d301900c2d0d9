"""`moelab lab report`: a real tiny run through the ledger, its report's sections, verdicts and HTML.

One experiment trains once (module fixture); an amendment that changes only the band re-runs it as a
skip (same step version), so the second report reads the same run with a refuting band.
"""

import contextlib
import html
import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import LAB_RUN, experiment_spec, run_cli, run_cli_redirected

from moelab.lab.ledger import append, open_ledger, records, verify
from moelab.lab.plots import mixture_plot, router_load_heatmap
from moelab.lab.registry import CONFIRMED, INCONCLUSIVE, REFUTED, Prediction, verdict
from moelab.lab.report import SECTION_IDS

SPEC = experiment_spec("rep-tiny", expected=4.0, title="Report smoke test", overrides=LAB_RUN)


def section(html_text, sid):
    match = re.search(rf'<section id="{sid}">(.*?)</section>', html_text, re.DOTALL)
    assert match, f"section {sid} missing"
    return match.group(1)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A ledger with rep-tiny registered and run once: (ledger, spec path, run root, monkeypatch-free runner)."""
    tmp = tmp_path_factory.mktemp("lab")
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    ledger, root = tmp / "ledger.sqlite", tmp / "runs"
    mp = pytest.MonkeyPatch()
    try:
        code, _, err = _cli(mp, ["lab", "register", str(spec_path), "--ledger", str(ledger)])
        assert code == 0, err
        code, _, err = _cli(mp, ["lab", "run", "rep-tiny", "--ledger", str(ledger), "--root", str(root)])
        assert code == 0, err
    finally:
        mp.undo()
    return ledger, spec_path, root


def pred_csv(*bands):
    """prediction.csv as `moelab ladder fit` writes it (the target's rows, then its band): one row per
    (step, loss_pred, lo80, hi80, lo95, hi95)."""
    return "run,params,step,tokens,lr,loss_pred,lo80,hi80,lo95,hi95\n" + "".join(
        f"rep-tiny,1000000,{b[0]},{b[0] * 4096},0.003,{','.join(map(str, b[1:]))}\n" for b in bands)


OPTIONAL_FILES = ("prediction.csv", "mixture_log.jsonl", "router_load.jsonl", "samples.jsonl")


@contextlib.contextmanager
def run_files(run_dir, files, aside):
    """Put `files` ({name: text}) in the run directory and move every other optional file aside, then restore."""
    aside.mkdir()
    moved = [n for n in OPTIONAL_FILES if (run_dir / n).exists()]
    for name in moved:
        (run_dir / name).rename(aside / name)
    try:
        for name, text in files.items():
            (run_dir / name).write_text(text)
        yield
    finally:
        for name in files:
            (run_dir / name).unlink()
        for name in moved:
            (aside / name).rename(run_dir / name)


def _cli(mp, args):
    """run_cli without capsys (module fixture): the report command prints only the path on stdout."""
    return run_cli_redirected(mp, args)


# ----------------------------------------------------------------------------------------------
# verdict on synthetic values


@pytest.mark.parametrize("band,value,expected", [
    ((None, 2.5), 2.4, CONFIRMED), ((None, 2.5), 2.6, REFUTED), ((None, 2.5), 2.5, CONFIRMED),
    ((1.0, None), 0.9, REFUTED), ((1.0, None), 1.1, CONFIRMED),
    ((1.0, 2.0), 1.5, CONFIRMED), ((1.0, 2.0), 0.5, REFUTED), ((1.0, 2.0), 2.5, REFUTED),
    ((1.0, 2.0), None, INCONCLUSIVE), ((1.0, 2.0), float("nan"), INCONCLUSIVE),
    (None, 2.0, INCONCLUSIVE),  # a point prediction alone has no tolerance
])
def test_verdict(band, value, expected):
    p = Prediction("eval/mean", "rule", expected=2.0, band=band)
    assert verdict(p, value) == expected


SVG = "{http://www.w3.org/2000/svg}"


def standalone(svg):
    """The root of a figure that renders as a file of its own: well-formed XML in the SVG namespace, sized."""
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg" and {"width", "height", "viewBox"} <= set(root.attrib), root.attrib
    return root


def test_router_load_heatmap_is_a_standalone_svg_colouring_each_cell_by_its_load_and_checks_shape():
    root = standalone(router_load_heatmap(np.array([[0.5, 0.1], [0.2, 0.2]]), step=5))
    cells = {r.find(f"{SVG}title").text: r.get("fill") for r in root.iter(f"{SVG}rect")
             if r.find(f"{SVG}title") is not None}
    middle = cells["layer 1, expert 0: 0.2"]
    assert cells == {"layer 0, expert 0: 0.5": "#fde725", "layer 0, expert 1: 0.1": "#440154",  # viridis' two ends
                     "layer 1, expert 0: 0.2": middle, "layer 1, expert 1: 0.2": middle}
    assert middle not in ("#fde725", "#440154")
    assert root.find(f"{SVG}title").text == "router load at step 5"
    with pytest.raises(ValueError, match=r"router load must be \[layers, experts\], got shape \(8,\)"):
        router_load_heatmap(np.ones(8))


def test_mixture_plot_stacks_the_shares_of_the_tokens_drawn_between_snapshots():
    """100 code + 100 prose tokens by step 5, then 20 + 80 more: code is half of steps 0-5 and a fifth of
    steps 5-10 (not the cumulative 120/300), prose on top of it up to 1."""
    root = standalone(mixture_plot([{"step": 5, "tokens": {"code": 100, "prose": 100}},
                                    {"step": 10, "tokens": {"code": 120, "prose": 180}}]))
    frame = next(r for r in root.iter(f"{SVG}rect") if r.get("stroke"))
    top, bottom = float(frame.get("y")), float(frame.get("y")) + float(frame.get("height"))
    areas = {a.find(f"{SVG}title").text: [tuple(map(float, xy.split(","))) for xy in a.get("points").split()]
             for a in root.iter(f"{SVG}polygon")}
    assert set(areas) == {"code", "prose"}

    def upper_edge(name):  # the share the area reaches in each stretch, from its first half of points
        points = areas[name][:len(areas[name]) // 2]
        return [round((bottom - y) / (bottom - top), 3) for _, y in points[::2]]

    assert upper_edge("code") == [0.5, 0.2] and upper_edge("prose") == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------
# the real run


def test_report_sections_and_confirmed_verdict(lab, tmp_path, monkeypatch, capsys):
    ledger, _, root = lab
    out = tmp_path / "rep"
    with run_files(next((root / "rep-tiny").glob("train-*")), {}, tmp_path / "aside"):  # the notes for absent files
        code, stdout, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(out)],
                                    monkeypatch, capsys)
    assert code == 0, err
    assert stdout.strip() == str(out / "report.html")
    page, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    for sid in SECTION_IDS:
        assert len(re.sub(r"<[^>]+>", "", section(page, sid)).strip()) > 20, sid
        assert f'<a id="{sid}"></a>' in md
    assert "CONFIRMED" in section(page, "hypothesis")
    assert section(page, "loss-curve").count("<svg") == 1
    assert "No predicted band" in section(page, "loss-curve")
    assert "eval/code" in section(page, "per-domain-eval") and "<svg" in section(page, "per-domain-eval")
    assert "No mixture log" in section(page, "mixture")
    assert "No per-layer router load" in section(page, "router") and "<svg" in section(page, "router")
    assert "<svg" in section(page, "norms-incidents")
    assert "None: the spec ran as registered" in section(page, "amendments")
    assert "No samples" in section(page, "samples")
    repro = section(page, "reproducibility")
    assert "moelab lab run rep-tiny" in repro and "config.yaml" in repro
    assert "never (one uninterrupted run)" in repro
    assert (out / "loss_curve.svg").is_file() and "![loss_curve](loss_curve.svg)" in md
    figures = [p for s in json.loads((out / "report.json").read_text())["sections"] for p in s["parts"]
               if p["kind"] == "img"]
    for part in figures:  # each file hashes as report.json says, renders alone, and is inline in the page as it is
        data = (out / f"{part['name']}.svg").read_bytes()
        assert sha256(data).hexdigest() == part["sha256"] and data.decode() in page, part["name"]
        standalone(data)
    assert len(figures) == page.count("<svg") >= 3

    # the default directory: the run's own, with whatever the loop wrote (a mixture log, once it does)
    code, stdout, _ = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger)], monkeypatch, capsys)
    assert code == 0 and stdout.strip().startswith(str(root / "rep-tiny"))
    assert stdout.strip().endswith("report/report.html")


def test_the_router_section_states_the_routing_the_run_used_and_its_drops_per_phase(lab, tmp_path, monkeypatch,
                                                                                 capsys):
    """Issue 50: the seed's mechanisms (capacity factor, waves, the balancer and its knobs) and the tokens they
    dropped are on the report, as stated tables: read from the run's config.yaml and metrics."""
    ledger, _, root = lab
    out = tmp_path / "rep"
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    run_dir = next((root / "rep-tiny").glob("train-*"))
    moe = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["moe"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    router = next(s for s in json.loads((out / "report.json").read_text())["sections"] if s["id"] == "router")
    settings, drops = [p for p in router["parts"] if p["kind"] == "table"]
    stated = dict(zip(settings["keys"], (row[1] for row in settings["rows"])))
    assert stated["dispatch"] == moe["dispatch"] and stated["balancing"] == moe["balancing"]
    assert float(stated["capacity_factor"]) == moe["capacity_factor"]
    assert set(stated) - {"dispatch", "experts", "capacity_factor", "balancing"} == set(
        __import__("moelab.config", fromlist=["BALANCER_KNOBS"]).BALANCER_KNOBS[moe["balancing"]])
    by_phase = {}
    for m in metrics:
        if "drop_fraction" in m:
            by_phase.setdefault(m["phase"], []).append(m["drop_fraction"])
    assert len(by_phase) == 2  # the 80/20 pre- and mid-training phases
    assert [row[:2] for row in drops["rows"]] == [[phase, str(len(v))] for phase, v in by_phase.items()]
    for row, logged in zip(drops["rows"], by_phase.values()):
        assert float(row[2]) == pytest.approx(sum(logged) / len(logged), rel=1e-3, abs=1e-6)  # printed to 4 digits
    assert len(drops["rows"][0]) == 3  # one device, no `ep`: no sender / receiver columns of "-" (issue 62)
    from moelab.lab.view import DROPS_WORTH_A_NOTE
    notes = " ".join(p["text"] for p in router["parts"] if p["kind"] == "note")
    worst = max(sum(v) / len(v) for v in by_phase.values())
    assert ("dropped" in notes and "capacity_factor" in notes) == (worst > DROPS_WORTH_A_NOTE)


def test_the_report_names_the_ledger_head_and_record_count_that_verify_head_checks_later(lab, tmp_path, monkeypatch,
                                                                                        capsys):
    """A reader who kept the report can tell when the ledger was cut short, which the chain alone cannot."""
    ledger, _, root = lab
    run_dir = next((root / "rep-tiny").glob("train-*"))
    chain = verify(open_ledger(ledger))
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path / "r")],
                           monkeypatch, capsys)
    assert code == 0, err
    repro = section((tmp_path / "r" / "report.html").read_text(), "reproducibility")
    md = (tmp_path / "r" / "report.md").read_text()
    for text in (chain.head_hash, f"{chain.num_records} (chain intact)"):
        assert text in repro and text in md, text
    # Paths are relative (to the report's folder in the table, to the run's directory in the commands), so
    # a copied report tree still points at its run; the commands work from the run's directory.
    assert str(tmp_path) not in repro and str(root) not in repro
    assert f"# from the run&#x27;s own directory ({os.path.relpath(run_dir, tmp_path / 'r')}):" in repro
    [command] = [line for line in md.splitlines() if line.startswith("moelab lab verify")]
    assert command == f"moelab lab verify --ledger {os.path.relpath(ledger, run_dir)} --head {chain.head_hash}"
    monkeypatch.chdir(run_dir)
    code, out, err = run_cli(command.split()[1:], monkeypatch, capsys)
    assert code == 0 and f"is record {chain.num_records}: 0 records came after it" in out, err
    # Not reproduced yet: the export command pastes as it stands, from the same directory (issue 62: it lacked
    # --ledger and its backticks showed literally).
    [export] = [line for line in md.splitlines() if line.startswith("moelab lab export")]
    assert "`" not in repro.split("Not reproduced yet")[1].split("</pre>")[0]
    code, out, err = run_cli(export.replace("BUNDLE", str(tmp_path / "bundle")).split()[1:], monkeypatch, capsys)
    assert code == 0 and (tmp_path / "bundle").is_dir(), err


def test_report_reads_optional_files(lab, tmp_path, monkeypatch, capsys):
    ledger, _, root = lab
    run_dir = next((root / "rep-tiny").glob("train-*"))
    extra = {
        "prediction.csv": pred_csv((5, 5.0, 4.5, 5.5, 4.0, 6.0), (10, 4.0, 3.5, 4.5, 3.0, 5.0)),
        "mixture_log.jsonl": "\n".join(json.dumps(r) for r in [
            {"step": 0, "kind": "change", "phase": "pretrain", "weights": {"code": 0.5, "prose": 0.5},
             "message": "start pretrain"},
            {"step": 5, "kind": "snapshot", "tokens": {"code": 100, "prose": 100}, "total": 200},
            {"step": 5, "kind": "change", "phase": "midtrain", "weights": {"code": 0.2, "prose": 0.8},
             "message": "switch to midtrain <b>"},
            {"step": 10, "kind": "snapshot", "tokens": {"code": 120, "prose": 180}, "total": 300}]) + "\n",
        "router_load.jsonl": json.dumps({"step": 10, "load": np.full((2, 8), 0.125).tolist()}) + "\n",
        "samples.jsonl": "\n".join(json.dumps({"step": s, "domain": "code", "prompt": "def f(",
                                                "continuation": f"x{s})"}) for s in (5, 10)) + "\n",
        "data.json": json.dumps({"store_hash": "ab12" * 16, "stores": [{"location": "s3://b/web", "domains": {
            "web": {"tokens": {"train": 9000, "heldout": 1000}, "sources": [
                {"path": "/d/web-0.jsonl", "bytes": 12345, "sha256": "cd34" * 16}]}}}]}),
    }
    with run_files(run_dir, extra, tmp_path / "aside"):
        code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path)],
                                    monkeypatch, capsys)
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    assert "CONFIRMED" in section(page, "hypothesis")
    assert "Predicted band from" in section(page, "loss-curve")
    mixture = section(page, "mixture")
    assert "switch to midtrain &lt;b&gt;" in mixture and "<svg" in mixture  # messages are escaped
    assert "ab12" * 16 in mixture and "/d/web-0.jsonl" in mixture and "cd34" * 16 in mixture and "9000" in mixture
    assert section(page, "router").count("<svg") == 2
    assert "x10)" in section(page, "samples") and "def f(" in section(page, "samples")


def test_amended_band_refutes_and_lists_the_amendment(lab, tmp_path, monkeypatch, capsys):
    ledger, _, root = lab
    amended = {**SPEC, "prediction": {**SPEC["prediction"], "expected": 0.4, "band": [None, 0.5]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(amended))
    ledger_copy = tmp_path / "ledger.sqlite"  # keep the module's ledger as registered for the other tests
    shutil.copy(ledger, ledger_copy)
    for args in (["lab", "amend", "rep-tiny", str(path), "--reason", "tighter band"],
                 ["lab", "run", "rep-tiny", "--spec", str(path), "--root", str(root)],  # a skip: same config
                 ["lab", "report", "rep-tiny", "--out", str(tmp_path / "rep")]):
        code, _, err = run_cli([*args, "--ledger", str(ledger_copy)], monkeypatch, capsys)
        assert code == 0, (args, err)
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "REFUTED" in section(page, "hypothesis")
    amendments = section(page, "amendments")
    assert "tighter band" in amendments and "prediction.band" in amendments


def test_bad_input_exits_2(lab, tmp_path, monkeypatch, capsys):
    ledger, spec_path, _ = lab
    code, _, err = run_cli(["lab", "report", "no-such", "--ledger", str(ledger)], monkeypatch, capsys)
    assert code == 2 and "unknown experiment id 'no-such'" in err
    fresh = tmp_path / "fresh.sqlite"
    code, _, err = run_cli(["lab", "register", str(spec_path), "--ledger", str(fresh)], monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(fresh)], monkeypatch, capsys)
    assert code == 2 and "no finished run" in err and "moelab lab run rep-tiny" in err


def test_a_run_preempted_and_resumed_in_place_names_each_stop_under_reproducibility(lab, tmp_path, monkeypatch,
                                                                                   capsys):
    ledger, _, _ = lab
    ledger_copy = tmp_path / "ledger.sqlite"  # keep the module's ledger as run for the other tests
    shutil.copy(ledger, ledger_copy)
    book = open_ledger(ledger_copy)
    [finished] = [r.body for r in records(book, kind="run") if r.body["event"] == "finished"]
    # What the executor records for a run stopped at step 4 and then resumed in the same directory.
    stop = append(book, "run", "rep-tiny", {**finished, "event": "preempted", "status": "PREEMPTED", "preempted_at": 4})
    append(book, "run", "rep-tiny", {**finished, "event": "started", "status": "RUNNING", "resumed_at": 4})
    append(book, "run", "rep-tiny", finished)
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger_copy), "--out", str(tmp_path / "r")],
                           monkeypatch, capsys)
    assert code == 0, err
    repro = section((tmp_path / "r" / "report.html").read_text(), "reproducibility")
    assert f"step 4 (ledger record {stop.seq})" in repro and "never (one uninterrupted run)" not in repro


def test_the_report_of_a_run_still_preempted_exits_2_saying_how_to_resume_it(lab, tmp_path, monkeypatch, capsys):
    _, spec_path, root = lab
    fresh = tmp_path / "fresh.sqlite"
    code, _, err = run_cli(["lab", "register", str(spec_path), "--ledger", str(fresh)], monkeypatch, capsys)
    assert code == 0, err
    event = {"step": "train", "output_dir": str(next((root / "rep-tiny").glob("train-*")))}
    append(open_ledger(fresh), "run", "rep-tiny", {**event, "event": "started", "status": "RUNNING"})
    append(open_ledger(fresh), "run", "rep-tiny", {**event, "event": "preempted", "status": "PREEMPTED",
                                                   "preempted_at": 4})
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(fresh)], monkeypatch, capsys)
    assert code == 2 and "preempted at step 4" in err and "resume it with `moelab lab run rep-tiny`" in err


def _report_and_chromium(lab, tmp_path, monkeypatch, capsys):
    """(chromium's path, the report's HTML path) for the module's run."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed; make test installs it first (tools/need-chromium)"
    ledger, _, _ = lab
    code, stdout, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path / "r")],
                                monkeypatch, capsys)
    assert code == 0, err
    return chromium, Path(stdout.strip())


def test_html_loads_in_headless_chromium(lab, tmp_path, monkeypatch, capsys):
    chromium, report = _report_and_chromium(lab, tmp_path, monkeypatch, capsys)
    done = _chromium(chromium, tmp_path, "--dump-dom", f"file://{report}")
    assert done.returncode == 0, done.stderr[-2000:]
    for sid in SECTION_IDS:
        assert f'<section id="{sid}">' in done.stdout, sid
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console


def _chromium(chromium, tmp_path, *args):
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_report_fits_a_1024_px_window_in_headless_chromium(lab, tmp_path, monkeypatch, capsys):
    """Laid out by Chromium at 1024 px: the page does not scroll sideways and no plot, table or command
    reaches past the window (measured on the DOM by a script added to a copy of the page); a screenshot
    of the same window is taken beside it for a reader."""
    chromium, report = _report_and_chromium(lab, tmp_path, monkeypatch, capsys)
    probe = ("<script>const over = [...document.querySelectorAll('svg,table,pre')].filter("
             "e => e.getBoundingClientRect().right > window.innerWidth + 1).length;"
             "document.body.setAttribute('data-fit', JSON.stringify({page: document.documentElement.scrollWidth, "
             "view: window.innerWidth, over: over, imgs: document.querySelectorAll('svg').length}));</script></body>")
    page = tmp_path / "r" / "probe.html"
    page.write_text(report.read_text().replace("</body>", probe))
    done = _chromium(chromium, tmp_path, "--window-size=1024,768", "--virtual-time-budget=2000", "--dump-dom",
                     f"file://{page}")
    assert done.returncode == 0, done.stderr[-2000:]
    fit = json.loads(html.unescape(re.search(r"data-fit=\"([^\"]+)\"", done.stdout).group(1)))
    assert fit["imgs"] >= 3 and fit["over"] == 0 and fit["page"] <= fit["view"], fit
    shot = tmp_path / "report.png"
    done = _chromium(chromium, tmp_path, "--window-size=1024,2000", f"--screenshot={shot}", f"file://{report}")
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", done.stderr[-2000:]


def test_report_plots_the_live_forecast_and_states_the_self_check(lab, tmp_path, monkeypatch, capsys):
    """A run watched against a prediction: forecast/final in its eval records, the sidecar's self-check."""
    ledger, _, root = lab
    run_dir = next((root / "rep-tiny").glob("train-*"))
    metrics = (run_dir / "metrics.jsonl").read_text()
    forecast = [{"step": s, "forecast/final": f, "forecast/lo95": f - 0.1, "forecast/hi95": f + 0.1}
                for s, f in ((5, 4.2), (10, 4.6))]
    check = {"self_check": {"held_out": ["ladder-d80-l3"], "final_error": -0.052, "mape_after_10pct": 0.04,
                            "trusted": False}}
    extra = {"prediction.csv": pred_csv((5, 5.0, 4.5, 5.5, 4.0, 6.0), (10, 4.0, 3.8, 4.2, 3.7, 4.3)),
             "prediction.json": json.dumps(check)}
    try:
        (run_dir / "metrics.jsonl").write_text(metrics + "".join(json.dumps(r) + "\n" for r in forecast))
        with run_files(run_dir, extra, tmp_path / "aside"):
            code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path)],
                                   monkeypatch, capsys)
    finally:
        (run_dir / "metrics.jsonl").write_text(metrics)
    assert code == 0, err
    loss = section((tmp_path / "report.html").read_text(), "loss-curve")
    assert loss.count("<svg") == 2 and "forecast/final" in loss
    assert "refitted without ladder-d80-l3, the law predicted its final loss -5.20% off" in loss
    assert "FAILED: the prediction is not to be trusted" in loss


def test_plots_are_legible_the_loss_range_follows_the_curves_and_step_0_is_plotted(lab, tmp_path, monkeypatch,
                                                                                   capsys):
    """Every plot is at least 900 px wide with text that reads at 12 px or more in the page's 960 px column; a band
    much wider than the curves does not set the y-range; the per-domain series start at step 0 (eval_initial)
    like the table; long cells and commands wrap."""
    from moelab.lab.plots import curve_ylim
    from moelab.lab.report import _with_initial

    ledger, _, _ = lab
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path)],
                           monkeypatch, capsys)
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    roots = [ET.fromstring(m) for m in re.findall(r"<svg .*?</svg>", page, re.DOTALL)]
    assert roots
    for root in roots:
        width = float(root.get("viewBox").split()[2])
        shown = min(1.0, 960 / width)  # a figure wider than the column (max-width 60rem) is scaled down to it
        sizes = [float(e.get("font-size")) for e in root.iter() if e.get("font-size")]
        assert sizes and min(sizes) * shown >= 12, (width, sizes)
        if width < 600:  # the router heatmap is sized by its experts; the line plots are not
            continue
        assert width >= 900, width
    assert sum(float(r.get("viewBox").split()[2]) >= 900 for r in roots) >= 3
    assert "white-space:pre-wrap" in page and "overflow-wrap:anywhere" in page
    lo, hi = curve_ylim({"eval/mean": ([10, 20], [2.0, 1.8])})
    assert 1.7 < lo < 1.8 and 2.0 < hi < 2.1  # a 0-7 band would not widen it
    assert _with_initial([{"step": 10, "eval/code": 2.0}], {"code": 5.5}, "eval/code") == ([0, 10], [5.5, 2.0])


def test_lab_show_diff_names_what_two_experiments_differ_in(lab, tmp_path, monkeypatch, capsys):
    """Spec text and the *resolved* config are compared (an override equal to the preset's default is no
    difference), and the outcome of a run experiment is set against one that has not run."""
    ledger = tmp_path / "ledger.sqlite"
    shutil.copy(lab[0], ledger)  # the module's ledger stays as the other tests expect it
    overrides = {k: v for k, v in SPEC["config"]["overrides"].items() if k != "train.seed"}  # 0 is tiny's default
    other = {**SPEC, "id": "rep-tiny-lr", "hypothesis": "A lower LR does as well.",
             "config": {"preset": "tiny", "overrides": {**overrides, "train.lr": 1e-3}}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert run_cli(["lab", "register", str(tmp_path / "other.yaml"), "--ledger", str(ledger)], monkeypatch, capsys)[0] == 0
    code, out, err = run_cli(["lab", "show", "rep-tiny", "--diff", "rep-tiny-lr",
                                                   "--ledger", str(ledger), "--json"], monkeypatch, capsys)
    assert code == 0, err
    diff = json.loads(out)
    assert diff["spec"] == {"hypothesis": [SPEC["hypothesis"], other["hypothesis"]]}
    assert diff["config"] == {"config.train.lr": [0.003, 0.001]}
    assert diff["outcome"]["verdict"] == [CONFIRMED, "not run"] and not diff["identical"]
    code, out, _ = run_cli(["lab", "show", "rep-tiny", "--diff", "rep-tiny-lr", "--ledger",
                                                 str(ledger), "--markdown"], monkeypatch, capsys)
    assert code == 0 and "| `config.train.lr` | 0.003 | 0.001 |" in out and "### outcome" in out
    code, out, _ = run_cli(["lab", "show", "rep-tiny", "--diff", "rep-tiny", "--ledger",
                                                 str(ledger), "--markdown"], monkeypatch, capsys)
    assert code == 0 and "Same spec, same resolved config, same outcome." in out
    code, _, err = run_cli(["lab", "show", "rep-tiny", "--diff", "nope", "--ledger", str(ledger)], monkeypatch, capsys)
    assert code == 2 and "nope" in err


def test_a_ray_worker_lost_and_retried_is_named_under_reproducibility(lab, tmp_path, monkeypatch, capsys):
    ledger = tmp_path / "ledger.sqlite"
    shutil.copy(lab[0], ledger)
    lost = append(open_ledger(ledger), "run", "rep-tiny", {"step": "train", "event": "failed", "attempt": 1,
                                                           "worker_lost": True, "error": "worker lost on attempt 1"})
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path / "r")],
                           monkeypatch, capsys)
    assert code == 0, err
    repro = section((tmp_path / "r" / "report.html").read_text(), "reproducibility")
    assert f"train attempt 1 (ledger record {lost.seq})" in repro
    code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(lab[0]), "--out", str(tmp_path / "r0")],
                           monkeypatch, capsys)
    assert code == 0 and "the step retried</td><td>never" in section((tmp_path / "r0" / "report.html").read_text(),
                                                                      "reproducibility").replace("\n", "")


def test_the_verdict_carries_the_predictions_trust_everywhere_it_is_shown(lab, tmp_path, monkeypatch, capsys):
    """Issue 54: beside the verdict, the ladder prediction behind the run (its final value, 95% band and
    self-check): in the report's first section, `lab show`, the site's index and experiment page. An
    uninformative self-check says "not trusted" in each."""
    ledger, _, root = lab
    run_dir = next((root / "rep-tiny").glob("train-*"))
    sidecar = {"targets": [{"run": "rep-tiny", "loss_pred": 4.1234, "lo95": 3.5, "hi95": 4.75}],
               "self_check": {"held_out": ["ladder-d80-l3"], "final_error": -0.02, "mape_after_10pct": 0.03,
                              "band95_half_width": 0.19, "verdict": "uninformative", "trusted": False}}
    extra = {"prediction.csv": pred_csv((5, 5.0, 4.5, 5.5, 4.0, 6.0), (10, 4.0, 3.8, 4.2, 3.7, 4.3)),
             "prediction.json": json.dumps(sidecar)}
    words = "Ladder prediction 4.123 (95% band 3.500-4.750); self-check UNINFORMATIVE, so not trusted (the check"
    with run_files(run_dir, extra, tmp_path / "aside"):
        code, _, err = run_cli(["lab", "report", "rep-tiny", "--ledger", str(ledger), "--out", str(tmp_path / "r")],
                               monkeypatch, capsys)
        assert code == 0, err
        assert words in section((tmp_path / "r" / "report.html").read_text(), "hypothesis")
        code, out, err = run_cli(["lab", "show", "rep-tiny", "--ledger", str(ledger)], monkeypatch, capsys)
        assert code == 0 and "Verdict: " in out and words in " ".join(out.split()), err
        assert out.index("Verdict: ") < out.index("Question")  # the outcome before the spec and its records
        code, _, err = run_cli(["lab", "site", "--ledger", str(ledger), "--root", str(root), "--out",
                                str(tmp_path / "site")], monkeypatch, capsys)
        assert code == 0, err
    index = (tmp_path / "site" / "index.html").read_text()
    assert 'prediction: <span class="badge uninformative">uninformative</span>' in index
    page = next((tmp_path / "site" / "exp").glob("*.html")).read_text()
    assert words in page
    # Issue 62: a verdict beside an untrusted prediction says whose it is, and the curve's evals against the band
    # are counted where the curve is shown (the band [3.7, 4.3] at step 10 holds no tiny eval/mean near 5).
    alone = "CONFIRMED, is the pre-registered threshold&#x27;s alone"
    assert alone in page and alone.replace("&#x27;", "'") in " ".join(out.split())
    report = (tmp_path / "r" / "report.html").read_text()
    assert alone in section(report, "hypothesis")
    for text in (section(report, "loss-curve"), page):
        assert re.search(r"eval/mean: \d+ of \d+ evals fell outside the ladder(&#x27;|')s 95% band, the first at step \d+", text)


def test_report_table_cells_break_only_long_tokens_never_words():
    """Issue 54: `overflow-wrap: anywhere` on every cell split "step" into "ste p" in a narrow column; now only a
    token over 24 characters (a hash, a path) may wrap anywhere, so a word stays whole and the table still fits."""
    from moelab.lab.report import _CSS, _cell_html

    assert _cell_html("step") == "step" and _cell_html("pre-training phase") == "pre-training phase"
    long = "a" * 40
    assert _cell_html(f"commit {long}") == f'commit <span class="long">{long}</span>'
    assert ".long{overflow-wrap:anywhere}" in _CSS and "td,th{" in _CSS
    assert "overflow-wrap:anywhere}" not in _CSS.split(".long")[0]  # cells themselves never break words


def test_the_router_settings_are_read_from_config_yaml_even_with_a_knob_this_moelab_no_longer_knows(tmp_path):
    """`view.read_moe_config` reads config.yaml as a config is read; an unknown key in `model.moe` (a knob an older
    moelab had) is left out, a value the config refuses or a missing file shows no settings rather than failing."""
    from moelab.lab.view import read_moe_config

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"moe": {
        "num_experts": 16, "dispatch": "ep", "transport_capacity_factor": 2.0, "old_knob": 3}}}))
    moe = read_moe_config(tmp_path)
    assert (moe.num_experts, moe.dispatch, moe.resolved_transport_capacity_factor) == (16, "ep", 2.0)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"moe": {"num_experts": -1}}}))
    assert read_moe_config(tmp_path) is None
    assert read_moe_config(tmp_path / "missing") is None


def test_drops_worth_a_look_are_flagged_and_ep_columns_shown_only_under_ep():
    """Issue 62: a ladder's rungs dropped 16-32% of their assignments against the target's 6.6%, unflagged; the
    sender / receiver columns were all "-" on one device."""
    from moelab.lab.view import DROP_COLUMNS, drop_table, drops_note

    rung = [{"step": 10, "phase": "pre", "drop_fraction": 0.32}, {"step": 20, "phase": "pre", "drop_fraction": 0.30}]
    assert "dropped 31.0% of its token-expert assignments" in drops_note(drop_table(rung)[1])
    assert drops_note(drop_table([{"step": 10, "phase": "pre", "drop_fraction": 0.01}])[1]) is None
    assert drop_table(rung) == (DROP_COLUMNS[:3], [["pre", 2, pytest.approx(0.31)]])
    ep = [{"step": 10, "phase": "pre", "drop_fraction": 0.1, "drop_fraction_at_sender": 0.04,
           "drop_fraction_at_receiver": 0.06}]
    assert drop_table(ep) == (DROP_COLUMNS, [["pre", 1, 0.1, 0.04, 0.06]])
