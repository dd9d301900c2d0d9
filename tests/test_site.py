"""`moelab lab site`: the static site of a lab with one experiment of each kind (module fixture).

A confirmed run (built live with `lab run --site`), a refuted one, one amended, one failed mid-run and one
abandoned, on one ledger; then the site is read as a reader would (index, pages, timeline, links, bundle),
rebuilt (nothing, then one page, changes), refused on a broken chain, and loaded in headless Chromium.
"""

import html
import json
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import LAB_RUN, experiment_spec, run_cli_redirected

from moelab.errors import DataError
from moelab.lab.bundle import open_bundle
from moelab.lab.ledger import append, open_ledger, records
from moelab.lab.site import INDEX, SITE_JSON, TIMELINE, build_site, publish_site
from moelab.lab.verify import verify_bundle

STEPS = 10


def spec(exp_id: str, high: float, **extra) -> dict:
    return experiment_spec(exp_id, high=high, steps=STEPS, title=f"Site test {exp_id}", overrides=LAB_RUN, **extra)


def cli(mp, args, cwd):
    return run_cli_redirected(mp, args, cwd)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(folder, ledger, site, monkeypatch): the five experiments run, the site built live and then in full."""
    where = tmp_path_factory.mktemp("lab")
    ledger, site = where / "lab.sqlite", where / "site"
    mp = pytest.MonkeyPatch()

    def ok(*args):
        code, out, err = cli(mp, [*args, "--ledger", str(ledger)], where)
        assert code == 0, err
        return out

    for exp_id, high in (("s-confirmed", 10.0), ("s-refuted", 0.5), ("s-amended", 10.0), ("s-failed", 10.0),
                         ("s-abandoned", 10.0)):
        (where / f"{exp_id}.yaml").write_text(yaml.safe_dump(spec(exp_id, high)))
        ok("lab", "register", f"{exp_id}.yaml")
    rebuilt = []
    real_build = build_site

    def counting_build(*args, **kwargs):  # what a reader who reloads the page would have seen after each rebuild
        built = real_build(*args, **kwargs)
        page = Path(args[2]) / "exp" / "s-confirmed.html"
        points = re.findall(r'<polyline points="([^"]*)"', page.read_text()) if page.is_file() else []
        rebuilt.append(sum(len(p.split()) for p in points))
        return built

    mp.setattr("moelab.lab.site.build_site", counting_build)
    ok("lab", "run", "s-confirmed", "--root", "runs", "--site", str(site))
    mp.setattr("moelab.lab.site.build_site", real_build)
    ok("lab", "run", "s-refuted", "--root", "runs")
    (where / "s-amended.yaml").write_text(yaml.safe_dump(spec("s-amended", 9.0)))
    ok("lab", "amend", "s-amended", "s-amended.yaml", "--reason", "the band moves to 9 nats after a pilot")
    ok("lab", "abandon", "s-abandoned", "--reason", "the budget moved to s-amended")

    from moelab.lab.tracking import LedgerSink

    log = LedgerSink.log

    def fail_mid_run(self, record):  # the run dies at step 6, after its first eval reached the ledger
        if record.get("step", 0) >= 6:
            raise RuntimeError("node lost at step 6")
        log(self, record)

    with mp.context() as m:
        m.setattr(LedgerSink, "log", fail_mid_run)
        code, _, err = cli(mp, ["lab", "run", "s-failed", "--root", "runs", "--ledger", str(ledger)], where)
    assert code == 1, err
    ok("lab", "site", "--root", "runs", "--out", str(site))
    yield where, ledger, site, rebuilt, mp
    mp.undo()


def _page(site, exp_id):
    return (site / "exp" / f"{exp_id}.html").read_text()


def _row(index_html: str, exp_id: str) -> str:
    """The index row of `exp_id`, tags dropped."""
    row = re.search(rf'<tr><td data-label="experiment"><a href="exp/{exp_id}.html">.*?</tr>', index_html).group(0)
    return " ".join(re.sub(r"<[^>]+>", " ", html.unescape(row)).split())


def test_counts_read_as_words_not_as_experiment_s():
    from moelab.lab.site import counted

    assert [counted(n, "experiment") for n in (0, 1, 2)] == ["0 experiments", "1 experiment", "2 experiments"]


def test_the_index_lists_every_experiment_with_its_status_prediction_outcome_and_amendments(lab):
    _, _, site, _, _ = lab
    index = (site / INDEX).read_text()
    assert "The lab: 5 experiments" in index
    confirmed, refuted = _row(index, "s-confirmed"), _row(index, "s-refuted")
    assert "finished" in confirmed and "confirmed" in confirmed
    assert "pre-registered: eval/mean expected 5 (threshold at most 10)" in confirmed
    assert "finished" in refuted and "refuted" in refuted and "(threshold at most 0.5)" in refuted
    assert "registered" in _row(index, "s-amended") and "amended: the band moves to 9 nats" in _row(index, "s-amended")
    assert "failed" in _row(index, "s-failed") and "train failed" in _row(index, "s-failed")
    assert "abandoned: the budget moved to s-amended" in _row(index, "s-abandoned")
    head = records(open_ledger(lab[1]))[-1]
    assert head.kind == "run" and f"Built from ledger record {head.seq} (sha256 <code>{head.hash}</code>" in index


def test_a_page_holds_the_registered_spec_amendments_runs_against_the_band_steps_and_a_bundle_that_verifies(lab):
    _, _, site, _, _ = lab
    page = _page(site, "s-confirmed")
    for heading in ("Question", "Hypothesis and prediction", "Spec as registered", "Amendments (0)", "Runs", "Steps",
                    "Bundle", "Router", "Incidents (", "Data-mixture log ("):
        assert heading in page, heading
    # What the router did (issue 50): the main run's settings from its config.yaml, and its drops per phase.
    assert "capacity factor" in page and "balancing rule" in page and "dropped fraction (mean)" in page
    assert page.count("<svg") == 3 and "pre-registered high edge" in page  # the metric, the domains, train loss
    bundle = re.search(r'<a href="\.\./(bundles/s-confirmed-r\d+\.tar\.gz)">', page).group(1)
    with open_bundle(site / bundle) as folder:
        assert verify_bundle(folder).ok and f"moelab lab verify {Path(bundle).name}" in page
    amended = _page(site, "s-amended")
    assert "Amendments (1)" in amended and "Reason: the band moves to 9 nats after a pilot" in amended
    assert "\n-  - 10.0\n" in html.unescape(amended) and "\n+  - 9.0\n" in html.unescape(amended)  # the diff, both sides
    assert "No bundle yet: the experiment is registered" in amended
    failed = _page(site, "s-failed")
    assert "node lost at step 6" in failed and "<polyline" in failed  # the error and the curve up to the failure


def test_the_spec_reads_as_prose_and_lists_and_times_read_to_the_second(lab):
    """Issue 54: the spec as labelled lists with the prose as paragraphs (the YAML one click away, in <details>),
    a [low, high] threshold on one line, and every timestamp to the second, in UTC, without microseconds."""
    _, _, site, _, _ = lab
    page = _page(site, "s-confirmed")
    spec_part = page[page.index('id="spec"'):page.index('id="amendments"')]
    assert "<dt>hypothesis</dt><dd>" in spec_part and "<dt>band</dt><dd>null, 10</dd>" in spec_part
    assert "<details><summary>the spec as YAML</summary><pre>" in spec_part
    assert re.search(r"registered \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", page)
    for text in (page, (site / INDEX).read_text()):
        assert not re.search(r"\d\d:\d\d:\d\d\.\d{3,}", text)  # no fraction of a second anywhere


def test_the_live_site_grew_after_each_eval_of_the_run(lab):
    """`lab run --site`: a rebuild before the first step, after each step event and after each eval; the
    experiment's page shows more of the curve as the run goes."""
    _, _, _, rebuilt, _ = lab
    assert len(rebuilt) >= 5, rebuilt  # before the run, started, the evals at steps 5 and 10, finished
    assert rebuilt[0] == 0 and rebuilt == sorted(rebuilt) and len(set(rebuilt[2:])) >= 2, rebuilt


def test_pages_are_portable_relative_links_no_host_path_no_script_no_network(lab):
    where, _, site, _, _ = lab
    pages = sorted(site.rglob("*.html"))
    assert len(pages) == 7
    for page in pages:
        text = page.read_text()
        assert str(where) not in text and str(Path.home()) + "/" not in text and str(Path.cwd()) not in text, page
        assert "<script" not in text and "@import" not in text and "url(" not in text
        for link in re.findall(r'(?:href|src)="([^"]+)"', text):
            assert "://" not in link and not link.startswith("/"), (page, link)
            assert (page.parent / link).resolve().is_file(), (page, link)
        assert re.sub(r'xmlns="http://www\.w3\.org/2000/svg"', "", text).count("http") == 0, page


def test_a_rebuild_writes_only_what_changed(lab, tmp_path):
    where, ledger, site, _, _ = lab
    copy, book = shutil.copytree(site, tmp_path / "site"), open_ledger(shutil.copy(ledger, tmp_path / "lab.sqlite"))
    again = build_site(book, where / "runs", copy)
    assert again.written == [] and again.unchanged == 7
    append(book, "metric", "s-failed", {"run": "tiny", "step": 6, "eval/mean": 3.0, "eval/code": 3.0})  # one eval more
    for only in (None, "s-failed"):
        built = build_site(book, where / "runs", copy, only=only)
        assert built.written == (["exp/s-failed.html"] if only is None else []), built.written
    append(book, "metric", "s-confirmed", {"run": "tiny", "step": 11, "eval/mean": 3.0, "eval/code": 3.0})
    built = build_site(book, where / "runs", copy)  # an ended experiment's new record: a new bundle, a new outcome
    assert set(built.written) == {"exp/s-confirmed.html", "index.html", f"bundles/s-confirmed-r{again.head_seq + 2}.tar.gz"}
    assert len(list((copy / "bundles").glob("s-confirmed-r*"))) == 1  # the stale bundle is gone
    assert json.loads((copy / SITE_JSON).read_text())["ledger"]["num_records"] == again.head_seq + 2


def test_a_broken_chain_is_refused_with_exit_2_naming_the_record_and_nothing_is_written(lab, tmp_path):
    where, ledger, _, _, mp = lab
    broken = shutil.copy(ledger, tmp_path / "lab.sqlite")
    with sqlite3.connect(broken) as conn:
        conn.execute("UPDATE records SET body = replace(body, 'the budget', 'a budget') WHERE kind = 'run' AND "
                     "body LIKE '%abandoned%'")
    seq = next(r.seq for r in records(open_ledger(ledger)) if r.body.get("event") == "abandoned")
    code, _, err = cli(mp, ["lab", "site", "--root", "runs", "--out", str(tmp_path / "site"), "--ledger", str(broken)],
                       where)
    assert code == 2 and f"fails its hash check at record {seq}" in " ".join(err.split()), err
    assert not (tmp_path / "site").exists()


def test_a_file_as_out_and_a_publish_url_that_cannot_be_reached_exit_2_with_the_fix(lab, tmp_path, monkeypatch):
    """Both were tracebacks: mkdir under a file, and an fsspec backend that connects as it is built (ftp://)."""
    import fsspec.core

    where, ledger, site, _, mp = lab
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    code, _, err = cli(mp, ["lab", "site", "--root", "runs", "--out", str(taken), "--ledger", str(ledger)], where)
    assert code == 2 and "is a file; the site is a folder" in " ".join(err.split()) and taken.read_text() == "mine"

    def unreachable(url, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(fsspec.core, "url_to_fs", unreachable)
    with pytest.raises(DataError, match="connecting to ftp://lab.example/site/site.json failed: unreachable"):
        publish_site(site, "ftp://lab.example/site")
    for args in (["--out", str(taken / "site")], ["--out", str(tmp_path / "s"), "--publish", str(taken)]):
        code, _, err = cli(mp, ["lab", "site", "--root", "runs", "--ledger", str(ledger), *args], where)
        assert code == 2 and "cannot write" in err and "Traceback" not in err, (args, err)
    assert taken.read_text() == "mine"


def test_a_finished_or_abandoned_experiment_cannot_be_abandoned_and_the_ledger_is_unchanged(lab):
    """Abandoning a finished experiment would bury its verdict (the site shows the last event); twice, nothing."""
    where, ledger, _, _, mp = lab
    before = len(records(open_ledger(ledger)))
    for exp_id, message in (("s-confirmed", "has finished"), ("s-refuted", "has finished"),
                            ("s-abandoned", "abandoned already (record")):
        code, _, err = cli(mp, ["lab", "abandon", exp_id, "--reason", "tidying up", "--ledger", str(ledger)], where)
        assert code == 2 and message in " ".join(err.split()), (exp_id, err)
    assert len(records(open_ledger(ledger))) == before


def test_a_page_write_is_atomic_a_failed_rename_leaves_the_old_page(lab, tmp_path, monkeypatch):
    from moelab import files
    from moelab.lab import site as site_lib

    page = tmp_path / "p.html"
    page.write_text("old")

    def refuse(*args):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", refuse)  # site pages are written through moelab.files
    with pytest.raises(OSError):
        site_lib._write_if_changed(page, b"new")
    assert page.read_text() == "old"


def test_publish_to_a_folder_copies_only_changed_files(lab, tmp_path):
    where, ledger, site, _, _ = lab
    copy = shutil.copytree(site, tmp_path / "site")
    first = publish_site(copy, str(tmp_path / "public"))
    assert len(first) == len(json.loads((copy / SITE_JSON).read_text())["files"]) and "index.html" in first
    assert publish_site(copy, str(tmp_path / "public")) == []
    (copy / "exp" / "s-failed.html").write_text("edited by hand")
    build_site(open_ledger(ledger), where / "runs", copy, only="s-abandoned")  # leaves s-failed's page as it is
    assert publish_site(copy, str(tmp_path / "public")) == ["exp/s-failed.html"]
    assert (tmp_path / "public" / "exp" / "s-failed.html").read_text() == "edited by hand"


def _chromium(tmp_path, *args):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed; make test installs it first (tools/need-chromium)"
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--window-size=390,800", "--virtual-time-budget=2000", *args],
        capture_output=True, text=True, timeout=60, check=False)


# Added to a copy of each page: what Chromium laid out, as a data attribute --dump-dom prints.
PROBE = ("<script>const a = [...document.querySelectorAll('a[href]')].map(e => e.href);"
         "const broken = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).length;"
         "document.body.setAttribute('data-probe', JSON.stringify({links: a, broken: broken, "
         "wide: document.documentElement.scrollWidth > window.innerWidth + 1}));</script></body>")


def test_chromium_loads_every_page_from_the_index_and_finds_no_broken_link_image_or_console_error(lab, tmp_path):
    """Every page reachable from the index, at a phone's 390 px width: each link resolves to a file of the
    site (a bundle too), no image is broken, nothing is wider than the window, and the console is empty."""
    _, _, site, _, _ = lab
    copy = shutil.copytree(site, tmp_path / "site")
    seen, todo = set(), [copy / INDEX]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        probe = page.with_name(f".probe-{page.name}")
        probe.write_text(page.read_text().replace("</body>", PROBE))
        done = _chromium(tmp_path, "--dump-dom", probe.as_uri())
        assert done.returncode == 0, done.stderr[-2000:]
        console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
        assert not console, (page, console)
        found = json.loads(html.unescape(re.search(r'data-probe="([^"]+)"', done.stdout).group(1)))
        assert found["broken"] == 0 and not found["wide"], (page, found)
        for link in found["links"]:
            target = Path(re.sub(r"^file://", "", link.split("#")[0]))
            assert target.is_file() and copy in target.parents, (page, link)
            if target.suffix == ".html":
                todo.append(target)
    assert {p.name for p in seen} >= {INDEX, TIMELINE, "s-confirmed.html", "s-failed.html", "s-amended.html"}


def test_a_spec_reads_as_lists_on_one_line_where_they_are_numbers():
    """Issue 62: the demo's rungs [[32, 1], [32, 2], [48, 2]] rendered as nested bullet lists ("- - 32 / - 1")."""
    from moelab.lab.site import _readable

    text = _readable({"rungs": [[32, 1], [32, 2], [48, 2]], "band": [None, 2.3], "notes": ["a", "b"]})
    assert "<dd>[32, 1], [32, 2], [48, 2]</dd>" in text and "<dd>null, 2.3</dd>" in text
    assert "<ul><li>a</li><li>b</li></ul>" in text
