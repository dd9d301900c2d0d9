"""`moelab lab export / verify BUNDLE / reproduce`: one tiny experiment, run once in a git repository of its
own (module fixture), bundled, checked, tampered with, and rerun.

The repository is made here (a commit holding the spec and a copy of src/moelab), so the tests never
depend on the state of the checkout they run from; a clone of it stands in for a newer checkout (the
worktree path), a dirty one, and a repository without the commit.
"""

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import LAB_RUN, experiment_spec, run_cli_redirected
from mutations import fresh_copy

from moelab.lab.bundle import CHAIN, MANIFEST, RECORDS
from moelab.lab.ledger import open_ledger, records
from moelab.lab.verify import verify_bundle

EXP = "bun-tiny"
STEPS = 10
SPEC = experiment_spec(EXP, expected=4.0, steps=STEPS, title="Bundle and reproduction test", overrides=LAB_RUN)
SRC = Path(__file__).resolve().parents[1] / "src" / "moelab"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def cli(mp, args, cwd):
    """`moelab ARGS` in-process from `cwd`; (exit code, stdout, stderr)."""
    return run_cli_redirected(mp, args, cwd)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(repository, ledger, bundle folder, monkeypatch): bun-tiny registered, run and exported at the repo's HEAD."""
    repo = tmp_path_factory.mktemp("repo")
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "tests@moelab")
    git(repo, "config", "user.name", "tests")
    (repo / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    shutil.copytree(SRC, repo / "src" / "moelab", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):  # what `pip install -e` of the commit needs
        shutil.copyfile(SRC.parents[1] / name, repo / name)
    git(repo, "add", "spec.yaml", "src", "pyproject.toml", "README.md")
    git(repo, "commit", "-q", "-m", "the experiment")
    ledger, bundle = repo / "lab.sqlite", repo / "bundle"
    mp = pytest.MonkeyPatch()
    for args in (["lab", "register", "spec.yaml"], ["lab", "run", EXP, "--root", "runs"],
                 ["lab", "export", EXP, "--out", str(bundle)]):
        code, _, err = cli(mp, [*args, "--ledger", str(ledger)], repo)
        assert code == 0, err
    yield repo, ledger, bundle, mp
    mp.undo()


def reseal(folder):
    """Rewrite MANIFEST.sha256 over the files as they are now: what a forger who edits a file would do."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n"
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    (folder / MANIFEST).write_text("".join(lines))


def num_records(ledger):
    return len(records(open_ledger(ledger)))


def test_an_exported_bundle_verifies_alone_as_folder_and_tar_gz(lab, tmp_path):
    repo, ledger, bundle, mp = lab
    head = records(open_ledger(ledger))[-1].hash
    info = json.loads((bundle / "bundle.json").read_text())
    assert info["ledger"]["head_hash"] == head and set(info["steps"]) == {"train"}
    assert info["steps"]["train"]["git_commit"] == git(repo, "rev-parse", "HEAD")
    for name in ("spec/registered.yaml", RECORDS, CHAIN, "steps/train/config.yaml", "steps/train/metrics.jsonl",
                 "steps/train/mixture_log.jsonl", "steps/train/summary.json", "report/report.md", "report/report.html"):
        assert (bundle / name).is_file(), name
    assert not (bundle / "steps/train/checkpoints").exists()
    own = [json.loads(line) for line in (bundle / RECORDS).read_text().splitlines()]
    assert {r["kind"] for r in own} >= {"experiment", "run", "metric", "mixture"} and all(r["key"] == EXP for r in own)
    # Any sha256sum checks the manifest too.
    assert subprocess.run(["sha256sum", "--quiet", "-c", MANIFEST], cwd=bundle).returncode == 0

    code, out, err = cli(mp, ["lab", "verify", str(bundle)], tmp_path)  # from elsewhere: the bundle alone
    assert code == 0, err
    assert head in out and f"{len(own)} ledger records" in out
    tar = tmp_path / "b.tar.gz"
    code, out, err = cli(mp, ["lab", "export", EXP, "--out", str(tar), "--ledger", str(ledger)], tmp_path)
    assert code == 0, err
    code, out, err = cli(mp, ["lab", "verify", str(tar), "--json"], tmp_path)
    assert code == 0 and json.loads(out)["ok"] and json.loads(out)["head_hash"] == head
    code, _, err = cli(mp, ["lab", "export", EXP, "--out", str(tar), "--ledger", str(ledger)], tmp_path)
    assert code == 2 and "already exists" in err


def test_export_refuses_an_unrun_experiment_or_unknown_id_with_exit_2_and_writes_nothing(lab, tmp_path):
    repo, ledger, _, mp = lab
    spec = tmp_path / "unrun.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "id": "bun-unrun"}))
    assert cli(mp, ["lab", "register", str(spec), "--ledger", str(ledger)], repo)[0] == 0
    for exp_id, message in (("bun-unrun", "has no finished training step"), ("nope", "unknown experiment id 'nope'")):
        code, out, err = cli(mp, ["lab", "export", exp_id, "--ledger", str(ledger), "--out", str(tmp_path / "b")],
                             repo)
        assert code == 2 and message in " ".join(err.split()), err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["unrun.yaml"]  # no bundle, no temporary folder


def _edit_metric_record(folder):
    """Change the loss in the experiment's first metric record: its stored hash no longer recomputes."""
    lines = (folder / RECORDS).read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "metric")
    row = json.loads(lines[i])
    row["body"]["loss"] += 0.5
    lines[i] = json.dumps(row)
    (folder / RECORDS).write_text("\n".join(lines) + "\n")
    return f"record {row['seq']} (metric '{EXP}') does not match its hash"


def _drop_record(folder):
    lines = (folder / RECORDS).read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if json.loads(line)["body"].get("event") == "started")
    seq = json.loads(lines[i])["seq"]
    (folder / RECORDS).write_text("\n".join(lines[:i] + lines[i + 1:]) + "\n")
    return f"record {seq} (run '{EXP}') is one of the experiment's, but {RECORDS} does not hold it"


def _cut_link(folder):
    lines = (folder / CHAIN).read_text().splitlines()
    seq = json.loads(lines[3])["seq"]
    (folder / CHAIN).write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    return f"record {seq + 1} does not link to record {seq - 1}"


def _change_reported_value(folder):
    md = folder / "report/report.md"
    text, n = re.subn(r"(\| eval/mean \| 4 \| at most 10 \| )[0-9.]+", r"\g<1>3.21", md.read_text())
    assert n == 1
    md.write_text(text)
    return "report/report.md: the hypothesis section is not what report/report.json states"


def _change_final_eval(folder):
    path = folder / "steps/train/metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[-1]["eval/mean"] -= 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "report/report.json: the hypothesis table does not state"


def _change_config(folder):
    path = folder / "steps/train/config.yaml"
    text, n = re.subn(r"(?m)^  steps: 10$", "  steps: 11", path.read_text())
    assert n == 1
    path.write_text(text)
    return "steps/train/config.yaml is not the config of step version"


@pytest.mark.parametrize("tamper, resealed", [
    pytest.param(lambda f: (f / "steps/train/metrics.jsonl").open("a").write("\n") and
                 "steps/train/metrics.jsonl was changed", False, id="changed file"),
    pytest.param(lambda f: (f / "steps/train/summary.json").unlink() or "steps/train/summary.json is missing", False,
                 id="missing file"),
    pytest.param(lambda f: (f / "steps/train/extra.txt").write_text("x") and "steps/train/extra.txt is not listed",
                 False, id="added file"),
    pytest.param(_edit_metric_record, True, id="edited record"),
    pytest.param(_drop_record, True, id="dropped record"),
    pytest.param(_cut_link, True, id="cut chain"),
    pytest.param(_change_reported_value, True, id="report number"),
    pytest.param(_change_final_eval, True, id="metrics under the report"),
    pytest.param(_change_config, True, id="config"),
])
def test_verify_names_what_was_tampered_with_and_exits_1(lab, tamper, resealed, tmp_path):
    """A changed, missing or added file fails its manifest; a forger who also rewrites the manifest is caught
    by the record's hash, the chain's links, the report's numbers or the step's version."""
    _, _, bundle, mp = lab
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    expected = tamper(copy)
    if resealed:
        reseal(copy)
    assert not verify_bundle(copy).ok
    code, out, err = cli(mp, ["lab", "verify", str(copy)], tmp_path)
    assert code == 1 and out == ""
    assert expected in err, err
    if resealed:
        assert f"is not the one {MANIFEST} lists" not in err  # the manifest holds: a deeper check named it


def test_reproduce_in_place_is_bitwise_recorded_and_in_the_report(lab):
    repo, ledger, bundle, mp = lab
    original = json.loads((bundle / "bundle.json").read_text())["steps"]["train"]["record"]
    code, out, err = cli(mp, ["lab", "reproduce", EXP, "--ledger", str(ledger), "--json"], repo)  # by id
    assert code == 0, err
    result = json.loads(out)
    train = result["steps"]["train"]
    assert result["verdict"] == "reproduced" and result["where"] == "here" and result["same_platform"] is True
    assert train["params"] == "equal" and train["until"] == STEPS
    assert [s for s, _ in train["per_step"]] == list(range(1, STEPS + 1))  # log_every 1: every step compared
    assert {v for _, v in train["per_step"]} == {"reproduced"}
    record = records(open_ledger(ledger))[-1]
    assert (record.seq, record.hash) == (result["record"]["seq"], result["record"]["hash"])
    assert record.kind == "run" and record.key == EXP and record.body["event"] == "reproduction"
    assert record.body["steps"]["train"]["original"] == original

    from moelab.lab.report import write_report

    text = (write_report(open_ledger(ledger), EXP, repo / "report").parent / "report.md").read_text()
    assert re.search(rf"\| {record.seq} \| [^|]+ \| train \| {STEPS} of {STEPS} \| [0-9a-f]{{12}} \| same \| none \| "
                     rf"reproduced \| equal \| — \| record {original['seq']} \|", text)


def test_reproduce_with_a_changed_config_differs_at_the_first_step_naming_the_metric(lab):
    repo, ledger, bundle, mp = lab
    code, out, err = cli(mp, ["lab", "reproduce", str(bundle), "--ledger", str(ledger), "--steps-fraction", "0.2",
                              "--set", "data.seed=1"], repo)
    assert code == 1, err
    row = r"train\s+│ differs\s+│ 2 of 10 steps │ not compared\s+│ step 1: loss [0-9.]+ recorded, [0-9.]+ now"
    assert re.search(row, out), out
    assert "train (2 logged steps): 1-2 differs" in out
    body = records(open_ledger(ledger))[-1].body
    assert body["overrides"] == {"data.seed": 1} and body["steps"]["train"]["first_difference"]["metric"] == "loss"


def _clone(repo, where):
    subprocess.run(["git", "clone", "-q", str(repo), str(where)], check=True)
    git(where, "config", "user.email", "tests@moelab")
    git(where, "config", "user.name", "tests")
    return where


def _tampered(bundle, where):
    shutil.copytree(bundle, where)
    (where / "steps/train/metrics.jsonl").open("a").write("\n")
    return where


@pytest.mark.parametrize("case, message", [
    ("dirty", "has uncommitted changes to tracked files (spec.yaml)"),
    ("unknown commit", "is not in the repository at"),
    ("tampered bundle", "fails verification, so it cannot be reproduced: steps/train/metrics.jsonl was changed"),
    ("bad fraction", "--steps-fraction=0.0 must be in (0, 1]"),
    ("bad set", "train.nonsense"),
])
def test_reproduce_refuses_with_exit_2_and_records_nothing(lab, case, message, tmp_path):
    repo, ledger, bundle, mp = lab
    where, args = repo, []
    if case == "dirty":
        where = _clone(repo, tmp_path / "clone")
        (where / "spec.yaml").write_text("edited: true\n")
    elif case == "unknown commit":
        where = tmp_path / "other"
        where.mkdir()
        git(where, "init", "-q")
    elif case == "tampered bundle":
        bundle = _tampered(bundle, tmp_path / "bundle")
    elif case == "bad fraction":
        args = ["--steps-fraction", "0"]
    else:
        args = ["--set", "train.nonsense=1"]
    before = num_records(ledger)
    code, out, err = cli(mp, ["lab", "reproduce", str(bundle), "--ledger", str(ledger), *args], where)
    assert code == 2 and out == ""
    assert message in " ".join(err.split()), err
    assert num_records(ledger) == before


# same-env is `slow` too (issue 27: a worktree and a rerun, ~10 s on 2 cores); reproduce in place stays.
@pytest.mark.slow
@pytest.mark.parametrize("env", [pytest.param(["--same-env"], id="same-env"),
                                 pytest.param([], marks=pytest.mark.network, id="own-env")])
def test_reproduce_at_an_older_commit_runs_it_in_a_worktree(lab, env, tmp_path):
    """A newer checkout (a clone with one more commit) reruns the recorded commit in a temporary worktree, with
    this environment's packages (--same-env) or its own (a venv and `pip install -e`: minutes, so `slow`)."""
    repo, ledger, bundle, mp = lab
    clone = _clone(repo, tmp_path / "clone")
    (clone / "NEWS").write_text("a later commit\n")
    git(clone, "add", "NEWS")
    git(clone, "commit", "-q", "-m", "later")
    code, out, err = cli(mp, ["lab", "reproduce", str(bundle), "--ledger", str(ledger), *env,
                              "--steps-fraction", "0.2", "--json"], clone)
    assert code == 0, err
    result = json.loads(out)
    assert result["where"] == "worktree" and result["verdict"] == "reproduced"
    assert result["steps"]["train"]["per_step"] == [[1, "reproduced"], [2, "reproduced"]]
    assert git(clone, "worktree", "list").count("\n") == 0  # the temporary worktree is gone again


def _run_folder(folder, losses, grad_norms, params_sha256="a" * 64):
    folder.mkdir()
    rows = [{"step": i + 1, "loss": loss, "grad_norm": g, "tokens_per_s": 100.0 * i}
            for i, (loss, g) in enumerate(zip(losses, grad_norms))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"params_sha256": params_sha256}))
    return folder


@pytest.mark.parametrize("losses, grads, params, run_sd, verdict, first", [
    ([3.0, 2.5, 2.0], [1.0, 0.9, 0.8], "a", None, "reproduced", None),
    ([3.0, 2.5, 2.001], [1.0, 0.91, 0.8], "b", 0.01, "within noise", (2, "grad_norm")),
    ([3.0, 2.5, 2.001], [1.0, 0.9, 0.8], "a", None, "differs", (3, "loss")),
    ([3.0, 2.6, 2.0], [1.0, 0.91, 0.8], "a", 0.01, "differs", (2, "loss")),  # 0.1 > 1.96 * sqrt(2) * 0.01
    ([3.001, 2.6, 2.0], [1.0, 0.9, 0.8], "a", 0.01, "differs", (2, "loss")),  # step 1 only within noise
    ([3.0, 2.5, 2.0], [1.0, 0.9, 0.8], "b", None, "differs", (3, "params_sha256")),
])
def test_compare_runs_reads_bitwise_then_the_stated_noise_then_differs(losses, grads, params, run_sd, verdict,
                                                                        first, tmp_path):
    """Throughput never counts; a loss within 1.96 * sqrt(2) * run_sd is within noise (other metrics have no
    stated noise and do not decide); the first step with the run's verdict is named, losses before other metrics."""
    from moelab.lab.reproduce import compare_runs

    recorded = _run_folder(tmp_path / "recorded", [3.0, 2.5, 2.0], [1.0, 0.9, 0.8])
    rerun = _run_folder(tmp_path / "rerun", losses, grads, params * 64)
    result = compare_runs("train", recorded, rerun, 3, 3, run_sd)
    assert result.verdict == verdict and result.to_json()["run_sd"] == run_sd  # the ledger states what it was held to
    got = result.first_difference
    assert (None if got is None else (got["step"], got["metric"])) == first
    partial = compare_runs("train", recorded, rerun, 2, 3, run_sd)  # steps 1-2 only; no weights to compare
    assert [s for s, _ in partial.per_step] == [1, 2] and partial.params == "not compared"


def test_the_stated_run_sd_is_scaled_to_each_reruns_size_by_the_fits_noise_scale():
    """A weighted ladder fit states run_sd at noise.ref_params; a rung half that size is noisier by 2^kappa.
    A sidecar written before the scale existed states one run_sd for every size."""
    from moelab import presets
    from moelab.accounting import count_params
    from moelab.errors import ConfigError
    from moelab.lab.reproduce import _run_sd_at

    cfg = presets.get("tiny")
    params = count_params(cfg.model).active
    noise = {"run_sd": 0.02, "size_exponent": 0.7, "ref_params": 2.0 * params}
    assert _run_sd_at(noise, cfg) == pytest.approx(0.02 * 2.0**0.7, rel=1e-12)
    assert _run_sd_at({"run_sd": 0.02}, cfg) == 0.02
    assert _run_sd_at(None, cfg) is None
    with pytest.raises(ConfigError, match="ref_params=0: not a scale"):
        _run_sd_at({"run_sd": 0.02, "size_exponent": 0.7, "ref_params": 0}, cfg)


def test_a_rerun_on_other_tokens_than_the_record_is_refused(tmp_path):
    """The record trained on a token store (its step's versioned store hash); a config that now reads none (or
    another content) is refused by name before anything runs."""
    from moelab import presets
    from moelab.errors import ConfigError
    from moelab.lab.verify import Bundle
    from moelab.lab.reproduce import _check_stores

    (tmp_path / "steps/train").mkdir(parents=True)
    (tmp_path / "steps/train/step.json").write_text(json.dumps({"versioned": {"store_hashes": {"code": "ab12"}}}))
    bundle = Bundle(tmp_path, {"steps": {"train": {"dir": "steps/train"}}}, None)
    with pytest.raises(ConfigError, match="step train trained domain code on token store content ab12, but its "
                                          r"config now reads none \(built in memory\)"):
        _check_stores(bundle, "train", presets.get("tiny"))


# ----------------------------------------------------------------------------------------------
# fuzzed: every mutation is a finding, never a traceback (issue 29)

FUZZ_EXAMPLES = 100  # in `make test` (about 4 s); test_verify_survives_many_more_mutations runs 600 under `slow`


def _bundle_files(bundle):
    return sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())


def _fuzz_verify(bundle, tmp, mutation, resealed):
    copy = fresh_copy(bundle, tmp / "fuzz")
    changed = mutation.apply(copy)
    if resealed and mutation.operation not in ("symlink", "directory", "delete"):
        reseal(copy)
    check = verify_bundle(copy)  # must return, whatever the damage
    if changed and not resealed:
        assert not check.ok, mutation  # every file is under the manifest's hash
    chained = mutation.file in (RECORDS, CHAIN) or mutation.file.startswith("spec/")
    if changed and resealed and chained:
        assert not check.ok, mutation  # the records' hashes and the chain hold what a resealed manifest does not
    for problem in check.problems:
        assert "Traceback" not in problem


def _fuzz(lab, tmp_path_factory, examples):
    from hypothesis import HealthCheck, given, settings, strategies as st
    from mutations import mutations

    _, _, bundle, _ = lab
    tmp = tmp_path_factory.mktemp("fuzz")

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutation=mutations(_bundle_files(bundle)), resealed=st.booleans())
    def run(mutation, resealed):
        _fuzz_verify(bundle, tmp, mutation, resealed)

    run()


def test_verify_reports_every_mutation_of_a_bundle_as_a_finding_never_a_traceback(lab, tmp_path_factory):
    _fuzz(lab, tmp_path_factory, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_verify_survives_many_more_mutations(lab, tmp_path_factory):
    """The same property over 600 examples (about a minute on 2 cores); the fast test runs 100."""
    _fuzz(lab, tmp_path_factory, 600)


def test_the_issues_example_names_the_chain_file_and_its_line_and_exits_1(lab, tmp_path):
    _, _, bundle, mp = lab
    copy = fresh_copy(bundle, tmp_path / "copy")
    lines = (copy / CHAIN).read_text().splitlines()
    (copy / CHAIN).open("a").write('{"step": 1, "loss": 0.1}\n')
    code, out, err = cli(mp, ["lab", "verify", str(copy)], tmp_path)
    assert code == 1 and "Traceback" not in err
    assert f"{CHAIN} line {len(lines) + 1} lacks 'seq'" in " ".join(err.split()), err


@pytest.mark.parametrize("where", ["outside", "absolute", "dotdot"])
def test_links_and_paths_out_of_a_bundle_are_refused_without_reading_them(lab, tmp_path, where):
    _, _, bundle, mp = lab
    copy = fresh_copy(bundle, tmp_path / "copy")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the bundle")
    if where == "outside":
        (copy / "steps/train/summary.json").unlink()
        (copy / "steps/train/summary.json").symlink_to(secret)
        expected = "steps/train/summary.json is a symbolic link"
    else:
        info = json.loads((copy / "bundle.json").read_text())
        info["steps"]["train"]["dir"] = str(tmp_path) if where == "absolute" else "../../elsewhere"
        (copy / "bundle.json").write_text(json.dumps(info))
        reseal(copy)
        expected = "which is not a path inside the bundle"
    check = verify_bundle(copy)
    assert not check.ok and any(expected in p for p in check.problems), check.problems
    code, _, err = cli(mp, ["lab", "verify", str(copy)], tmp_path)
    assert code == 1 and "outside the bundle" not in err


def _mutate_ledger(path, table_op, row_pick, column, value, byte_at):
    """One damage to a ledger copy: an SQL edit of one row (or its deletion / duplication), or a flipped byte."""
    import sqlite3

    if table_op == "flip":
        data = bytearray(path.read_bytes())
        data[int(byte_at * len(data))] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    if table_op == "truncate":
        path.write_bytes(path.read_bytes()[:int(byte_at * path.stat().st_size)])
        return
    conn = sqlite3.connect(path)
    seqs = [r[0] for r in conn.execute("SELECT seq FROM records ORDER BY seq")]
    seq = seqs[int(row_pick * len(seqs))]
    if table_op == "update":
        conn.execute(f"UPDATE records SET {column} = ? WHERE seq = ?", (value, seq))
    elif table_op == "delete":
        conn.execute("DELETE FROM records WHERE seq = ?", (seq,))
    conn.commit()
    conn.close()


def test_ledger_readers_answer_every_damage_with_a_finding(lab, tmp_path_factory):
    """A ledger edited outside moelab (any column of any row, to any type; a row deleted; bytes flipped or cut)
    is a broken chain or a refusal naming the file, never a traceback; an SQL edit that changes a row breaks it."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from moelab.errors import ConfigError, DataError
    from moelab.lab.ledger import verify

    import sqlite3

    _, ledger, _, _ = lab
    tmp = tmp_path_factory.mktemp("ledger-fuzz")
    pristine = tmp_path_factory.mktemp("ledger-pristine") / "ledger.sqlite"
    source, target = sqlite3.connect(ledger), sqlite3.connect(pristine)
    source.backup(target)  # one consistent file, whatever sits in the fixture's write-ahead log
    source.close()
    target.close()

    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(op=st.sampled_from(["update", "delete", "flip", "truncate"]), row=st.floats(0, 1, exclude_max=True),
           column=st.sampled_from(["seq", "kind", "key", "created_at", "body", "prev_hash", "hash"]),
           value=st.one_of(st.none(), st.integers(-3, 10**6), st.floats(allow_nan=False), st.text(max_size=20),
                           st.binary(max_size=8), st.just('{"loss": 0.1}')),
           byte_at=st.floats(0, 1, exclude_max=True))
    def run(op, row, column, value, byte_at):
        copy = tmp / "ledger.sqlite"
        for leftover in tmp.glob("ledger.sqlite*"):  # a previous example's -wal / -shm would replay into this one
            leftover.unlink()
        shutil.copyfile(pristine, copy)
        before = [tuple(r) for r in _sql_rows(copy)]
        try:
            _mutate_ledger(copy, op, row, column, value, byte_at)
        except Exception:  # sqlite refused the edit itself (a UNIQUE seq, a NOT NULL): nothing to read
            return
        try:
            check = verify(open_ledger(copy))
            records(open_ledger(copy)) if check.ok else None
        except (ConfigError, DataError) as e:
            assert str(copy) in str(e) or "ledger record" in str(e), e  # names the file or the record
            return
        if op in ("update", "delete") and [tuple(r) for r in _sql_rows(copy)] != before:
            last = op == "delete" and row >= (len(before) - 1) / len(before)
            assert not check.ok or last, (op, column, value)  # cutting the last row leaves a shorter valid chain

    run()


def _sql_rows(path):
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT * FROM records ORDER BY seq").fetchall()
    finally:
        conn.close()


def _edit_jsonl(name, key, line=0):
    def edit(folder):
        path = folder / name
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        rows[line][key] = 0.123 if not isinstance(rows[line][key], str) else "edited"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return f"{name} line {line + 1} (step {rows[line].get('step')}) is not ledger record"
    return edit


def _rearrange_jsonl(name, how):
    """Delete, swap or repeat whole lines: each row still is a ledger record, so only the order and the count
    can tell (issue 31 follow-up: a deleted incident passed `lab verify`)."""
    def edit(folder):
        path = folder / name
        lines = path.read_text().splitlines(keepends=True)
        if how == "delete":
            del lines[2]
            expected = "lacks ledger record"
        elif how == "swap":
            lines[2], lines[3] = lines[3], lines[2]
            expected = "line 4 (step"
        else:
            lines.insert(3, lines[2])
            expected = "line 4 (step"
        path.write_text("".join(lines))
        return expected
    return edit


def _restate_report(folder, edit):
    """report.json edited by `edit(document)`, report.md and report.html rendered again from it: a forger who
    knows the format leaves only report.json's facts against the records to catch the edit."""
    from moelab.lab.report import render_html, render_markdown

    path = folder / "report/report.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    figures = {p["name"]: (folder / "report" / f"{p['name']}.svg").read_bytes()
               for s in document["sections"] for p in s["parts"] if p["kind"] == "img"}
    (folder / "report/report.md").write_text(render_markdown(document))
    (folder / "report/report.html").write_text(render_html(document, figures))


def _parts(document, sid):
    return next(s["parts"] for s in document["sections"] if s["id"] == sid)


def _edit_report_section(section, how):
    """report.json's samples table or amendments list, edited and re-rendered: both were read by no check (a
    table row could be dropped, an amendment hidden) until the verify recomputed them from the bundled files
    and records."""
    def edit(folder):
        def change(document):
            parts = _parts(document, section)
            if how == "row":
                next(p for p in parts if p["kind"] == "table")["rows"][0] = ["0", "code", "def", "edited"]
            else:
                parts.insert(0, {"kind": "p", "text": "1. a change nobody made (now; ledger record 3); changed: x",
                                 "record": 3})
        _restate_report(folder, change)
        if how == "row":
            return f"report/report.json: the {section} table does not state"
        return "report/report.json: the amendments section names record(s) [3]"
    return edit


def _restate_router(folder):
    """The router's stated capacity factor (a key/value row) edited and re-rendered: caught against config.yaml."""
    def change(document):
        table = next(p for p in _parts(document, "router") if p["kind"] == "table" and "keys" in p)
        table["rows"][table["keys"].index("capacity_factor")][1] = "9.99"
    _restate_report(folder, change)
    return "report/report.json: the router table does not state"


def _restate_observed(folder):
    def change(document):
        next(p for p in _parts(document, "hypothesis") if p["kind"] == "table")["rows"][0][3] = "3.21"
    _restate_report(folder, change)
    return "report/report.json: the hypothesis table does not state the bundled metrics' numbers"


def _restate_head(folder):
    def change(document):
        table = next(p for p in _parts(document, "reproducibility") if p["kind"] == "table")
        table["rows"][table["keys"].index("ledger_head")][1] = "0" * 64
    _restate_report(folder, change)
    return "report/report.json names ledger head 0000000000000000... at record"


def _swap_figure(folder):
    """Another figure of the same report under the loss curve's name: every SVG file still an SVG."""
    (folder / "report/loss_curve.svg").write_bytes((folder / "report/per_domain_eval.svg").read_bytes())
    return "report/loss_curve.svg is not the figure report/report.json names (its SHA-256 differs)"


def _edit_json(name, key):
    def edit(folder):
        path = folder / name
        data = json.loads(path.read_text())
        data[key] = 0.123
        path.write_text(json.dumps(data))
        return f"{name} is not the result ledger record"
    return edit


@pytest.mark.parametrize("edit", [
    pytest.param(_edit_jsonl("steps/train/metrics.jsonl", "loss", 5), id="metrics"),
    pytest.param(_edit_jsonl("steps/train/mixture_log.jsonl", "phase"), id="mixture"),
    pytest.param(_edit_jsonl("steps/train/samples.jsonl", "continuation"), id="samples"),
    pytest.param(_edit_json("steps/train/summary.json", "loss"), id="summary"),
    pytest.param(_edit_json("steps/train/result.json", "tokens"), id="result"),
    pytest.param(lambda f: (f / "steps/train/incidents.jsonl").open("a").write('{"step": 3, "rule": "spike"}\n') and
                 "steps/train/incidents.jsonl line 1: no ledger record holds this row", id="incident"),
    pytest.param(_rearrange_jsonl("steps/train/metrics.jsonl", "delete"), id="metrics-row-deleted"),
    pytest.param(_rearrange_jsonl("steps/train/metrics.jsonl", "swap"), id="metrics-rows-swapped"),
    pytest.param(_rearrange_jsonl("steps/train/metrics.jsonl", "repeat"), id="metrics-row-repeated"),
    pytest.param(_edit_report_section("samples", "row"), id="report-samples"),
    pytest.param(_edit_report_section("amendments", "insert"), id="report-amendments"),
    pytest.param(_restate_observed, id="report-observed-value"),
    pytest.param(_restate_router, id="report-router-settings"),
    pytest.param(_restate_head, id="report-ledger-head"),
    pytest.param(_swap_figure, id="report-figure"),
])
def test_a_file_a_ledger_record_commits_to_is_checked_against_the_record_even_resealed(lab, tmp_path, edit):
    """Issue 31: editing a bundled metric and rewriting the manifest line once passed `lab verify`. The report
    too: report.json (re-rendered into report.md and report.html) against the records, each figure against the
    SHA-256 report.json names."""
    _, _, bundle, mp = lab
    copy = fresh_copy(bundle, tmp_path / "copy")
    expected = edit(copy)
    reseal(copy)
    code, _, err = cli(mp, ["lab", "verify", str(copy)], tmp_path)
    assert code == 1 and expected in " ".join(err.split()), err


def test_rewording_a_sentence_of_the_report_template_does_not_break_verify(lab, tmp_path, monkeypatch):
    """The prose the old verify matched ('ledger records when this report was written') and the decision-rule
    sentence, reworded: a bundle exported under the new words verifies under the new and the old template, and
    the fixture's bundle (old words) under the new one."""
    from moelab.lab import report

    repo, ledger, bundle, mp = lab
    old, new = "ledger records when this report was written", "records on the ledger as this report was written"
    table, paragraph = report.Section.table, report.Section.p

    def reworded_table(self, head, rows, keys=None):
        table(self, [h.replace("observed", "seen") for h in head], [[new if c == old else c for c in r] for r in rows],
              keys)

    def reworded_p(self, text, **facts):
        paragraph(self, text.replace("Decision rule:", "The rule that decides it:"), **facts)

    monkeypatch.setattr(report.Section, "table", reworded_table)
    monkeypatch.setattr(report.Section, "p", reworded_p)
    reworded = tmp_path / "reworded"
    code, _, err = cli(mp, ["lab", "export", EXP, "--out", str(reworded), "--ledger", str(ledger)], repo)
    assert code == 0, err
    md = (reworded / "report/report.md").read_text()
    assert new in md and old not in md and "The rule that decides it:" in md and "| seen |" in md
    for folder in (reworded, bundle):  # new words and old, checked by the reworded template
        code, _, err = cli(mp, ["lab", "verify", str(folder)], tmp_path)
        assert code == 0, err
    monkeypatch.undo()
    code, _, err = cli(mp, ["lab", "verify", str(reworded)], tmp_path)  # new words, checked by the template as it is
    assert code == 0, err


@pytest.mark.parametrize("version, why", [(1, "before its report was stated as"),
                                          (2, "while the report's figures were PNG files")])
def test_a_bundle_of_an_older_format_version_is_refused_naming_its_format(lab, tmp_path, version, why):
    """Version 1 came before report.json (its report could be checked only by its wording); version 2 held PNG figures."""
    _, _, bundle, mp = lab
    copy = fresh_copy(bundle, tmp_path / "copy")
    info = json.loads((copy / "bundle.json").read_text())
    (copy / "bundle.json").write_text(json.dumps({**info, "version": version}))
    if version == 1:
        (copy / "report/report.json").unlink()
    reseal(copy)
    code, out, err = cli(mp, ["lab", "verify", str(copy)], tmp_path)
    err = " ".join(err.split())
    assert code == 1 and out == ""
    assert f"says format 'moelab-bundle' version {version}: a bundle written {why}" in err, err
    assert f"moelab lab export {EXP} --out NEW" in err, err


LADDER_SPEC = {
    **{k: v for k, v in experiment_spec("bun-ladder", expected=4.0, steps=40, title="A ladder experiment's bundle")
       .items() if k != "config"},
    "ladder": {"target": {"preset": "tiny", "overrides": {"name": "bun-target", "train.steps": 40,
                                                           "train.eval_batches": 1}},
               "rungs": [[32, 1], [48, 1]], "rung_batch_size": 16},
}


@pytest.mark.slow
def test_a_ladder_experiments_bundle_verifies_and_the_watched_runs_prediction_is_the_fits_result(tmp_path,
                                                                                               monkeypatch):
    """`slow`: two rungs, a fit and a 40-step target, ~40 s on 2 cores. A training step watched against a fit
    keeps a copy of the fit's prediction.json; it is checked against the fit's record, not the run's (a fresh
    demo bundle once failed its own verify on that), and an edit of it resealed is still a finding."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(LADDER_SPEC))
    ledger, bundle = tmp_path / "lab.sqlite", tmp_path / "bundle"
    for args in (["lab", "register", "spec.yaml"], ["lab", "run", "bun-ladder", "--root", "runs"],
                 ["lab", "export", "bun-ladder", "--out", str(bundle)]):
        code, _, err = cli(monkeypatch, [*args, "--ledger", str(ledger)], tmp_path)
        assert code == 0, err
    check = verify_bundle(bundle)
    assert check.ok, check.problems
    fit_seq = json.loads((bundle / "bundle.json").read_text())["steps"]["fit"]["record"]["seq"]
    copy = fresh_copy(bundle, tmp_path / "copy")
    prediction = json.loads((copy / "steps/train/prediction.json").read_text())
    prediction["notes"] = prediction["notes"][1:]
    (copy / "steps/train/prediction.json").write_text(json.dumps(prediction))
    reseal(copy)
    problems = verify_bundle(copy).problems
    assert any(p.startswith(f"steps/train/prediction.json is not the result ledger record {fit_seq} holds: notes")
               for p in problems), problems
    # The experiment page shows the main run first, its rungs after it (issue 54)
    code, _, err = cli(monkeypatch, ["lab", "site", "--root", "runs", "--out", "site", "--ledger", str(ledger)],
                       tmp_path)
    assert code == 0, err
    page = (tmp_path / "site" / "exp" / "bun-ladder.html").read_text()
    runs = page[page.index('id="runs"'):]
    assert 0 <= runs.index("bun-target") < runs.index("rung-")


def test_a_resumed_runs_files_verify_and_a_row_deleted_after_the_resume_does_not(tmp_path):
    """A resume from the checkpoint at step 4 cut the files there and logged steps 5-6 again (the metrics with
    another tokens_per_s; the step-5 incident the same): the records it left behind are not missing rows, but
    a row the resumed run committed is (`bundle._check_streamed`)."""
    from moelab.lab.verify import _check_streamed

    def metric(step, speed):
        return {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": speed}

    first = [("metric", metric(s, 100.0)) for s in range(1, 7)] + [("incident", {"step": 5, "rule": "spike"})]
    first.sort(key=lambda kind_body: kind_body[1]["step"])
    again = [("metric", metric(5, 90.0)), ("incident", {"step": 5, "rule": "spike"}), ("metric", metric(6, 90.0))]
    own = [{"seq": seq, "kind": kind, "body": {"run": "r", **body}}
           for seq, (kind, body) in enumerate(first + again, start=10)]
    files = {"metrics.jsonl": [metric(s, 100.0) for s in range(1, 5)] + [metric(5, 90.0), metric(6, 90.0)],
             "incidents.jsonl": [{"step": 5, "rule": "spike"}], "mixture_log.jsonl": [], "samples.jsonl": []}
    for name, rows in files.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _check_streamed(tmp_path, "steps/train", own) == []
    (tmp_path / "incidents.jsonl").write_text("")
    problems = _check_streamed(tmp_path, "steps/train", own)
    assert len(problems) == 1 and problems[0].startswith("steps/train/incidents.jsonl lacks ledger record 18 (step 5)")
