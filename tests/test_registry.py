"""Pre-registration as a user meets it: register, show, amend; an edited spec cannot run unamended; a
ledger edited by hand takes no new rows; bad input exits 2 with one message naming the field."""

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import run_cli

from moelab.lab.experiment import run_experiment
from moelab.lab.ledger import ChainBroken, open_ledger, records, verify
from moelab.lab.registry import parse_spec, read_spec_file, resolve_run_config, spec_hash

REPO = Path(__file__).resolve().parents[1]
DEMO_SPEC = REPO / "experiments" / "demo-spec.yaml"


def spec_data(**changes):
    data = {
        "id": "exp-a",
        "title": "A short run",
        "question": "Does it learn?",
        "hypothesis": "The loss falls below 4 nats.",
        "prediction": {"metric": "eval/mean", "expected": 3.5, "band": [None, 4.0],
                       "decision_rule": "Confirmed if eval/mean < 4 at the last step."},
        "owner": "tester",
        "config": {"preset": "tiny", "overrides": {"train.steps": 2}},
    }
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def write_spec(path, data, comment=""):
    path.write_text(comment + yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def lab(tmp_path, monkeypatch, capsys):
    """A ledger path, a spec file and a `moelab lab ...` runner bound to both."""
    monkeypatch.chdir(tmp_path)  # step directories of `lab run` land under tmp_path/runs
    ledger = tmp_path / "lab" / "ledger.sqlite"
    spec = write_spec(tmp_path / "spec.yaml", spec_data())

    def run(*args):
        return run_cli(["lab", *args, "--ledger", str(ledger)], monkeypatch, capsys)

    return ledger, spec, run


def test_the_demo_spec_is_valid_and_runs_the_tiny_preset():
    spec = parse_spec(read_spec_file(DEMO_SPEC), str(DEMO_SPEC))
    cfg = resolve_run_config(spec)
    assert spec.id == "demo-tiny" and cfg.name == "tiny" and cfg.train.steps == 300
    assert spec.prediction.band == (None, 2.5)


def test_registration_stores_the_spec_its_hash_the_git_commit_and_a_time(lab):
    ledger, spec, run = lab
    code, out, _ = run("register", str(spec), "--json")
    assert code == 0
    shown = json.loads(out)
    body = shown["registration"]["body"]
    assert body["spec"] == spec_data() and body["spec_hash"] == spec_hash(spec_data())
    assert body["source"] == str(spec) and shown["registration"]["created_at"].endswith("Z")
    assert "git_commit" in body and "git_dirty" in body
    [record] = records(open_ledger(ledger))
    assert record.kind == "experiment" and record.key == "exp-a" and verify(open_ledger(ledger)).ok


def test_git_commit_is_the_head_of_the_repository_holding_the_spec(tmp_path, monkeypatch, capsys):
    """A registration records the HEAD of the repository the spec lives in (here a fresh one, so the test
    needs no checkout of this project), and whether tracked files had uncommitted changes."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "tests@moelab")
    git("config", "user.name", "tests")
    spec = repo / "experiments" / DEMO_SPEC.name
    spec.parent.mkdir()
    spec.write_text(DEMO_SPEC.read_text())
    git("add", ".")
    git("commit", "-q", "-m", "spec")
    commit = git("rev-parse", "HEAD")
    code, out, _ = run_cli(["lab", "register", str(spec), "--json", "--ledger", str(tmp_path / "l.sqlite")],
                           monkeypatch, capsys)
    body = json.loads(out)["registration"]["body"]
    assert code == 0 and body["git_commit"] == commit and body["git_dirty"] is False


def test_an_amendment_of_a_spec_outside_git_records_moelabs_checkout_and_labels_the_diff_a_and_b(
        lab, tmp_path, monkeypatch):
    """A spec copied out of the checkout (into tmp_path, no repository) used to record `git commit none`: the
    commit is then that of the checkout moelab runs from (here a fresh repository standing in for it). The
    diff goes from `a/` + the file registered to `b/` + the amending file, not the new name on both sides."""
    from moelab.lab import registry

    ledger, spec, run = lab
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # tmp_path is in no repository
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for args in (["init", "-q"], ["-c", "user.email=t@moelab", "-c", "user.name=t", "commit", "-q",
                                  "--allow-empty", "-m", "code"]):
        subprocess.run(["git", "-C", str(checkout), *args], check=True, capture_output=True)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.setattr(registry, "_PACKAGE_DIR", checkout)
    assert run("register", str(spec))[0] == 0
    (tmp_path / "edited").mkdir()
    edited = write_spec(tmp_path / "edited" / "spec-v2.yaml", spec_data(title="Another title"))
    code, out, err = run("amend", "exp-a", str(edited), "--reason", "a clearer title", "--json")
    assert code == 0, err
    body = json.loads(out)["body"]
    assert body["git_commit"] == commit and body["git_dirty"] is False
    old_label, new_label = str(spec).lstrip("/"), str(edited).lstrip("/")
    assert body["diff"].startswith(f"--- a/{old_label}\n+++ b/{new_label}\n")
    _, out, _ = run("show", "exp-a", "--markdown")
    assert "none (not in a git repository)" not in out and f"`{commit[:12]}`" in out


def test_markdown_is_issue_ready_with_question_hypothesis_prediction_and_provenance(lab):
    _, spec, run = lab
    code, out, _ = run("register", str(spec), "--markdown")
    assert code == 0
    assert out.startswith("## [exp-a] A short run\n")
    for text in ("### Question", "Does it learn?", "### Hypothesis", "below 4 nats", "| `eval/mean` | 3.5 | < 4 |",
                 "Confirmed if eval/mean < 4", "preset: tiny", spec_hash(spec_data())):
        assert text in out, text


def test_running_an_edited_spec_is_refused_until_an_amendment_records_the_change(lab):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    write_spec(spec, spec_data(config={"preset": "tiny", "overrides": {"train.steps": 5}}))

    code, out, err = run("run", "exp-a", "--dry-run")
    assert code == 2 and out == ""
    assert "was edited after 'exp-a' was registered" in err and "config.overrides.train.steps" in err
    assert "moelab lab amend exp-a" in err

    code, out, _ = run("amend", "exp-a", str(spec), "--reason", "two steps are too few to see anything")
    assert code == 0 and "config.overrides.train.steps" in out and "+    train.steps: 5" in out
    assert run("run", "exp-a", "--dry-run")[0] == 0

    code, out, _ = run("show", "exp-a", "--json")
    shown = json.loads(out)
    [amendment] = shown["amendments"]
    assert amendment["body"]["reason"] == "two steps are too few to see anything"
    assert amendment["body"]["changes"] == {"config.overrides.train.steps": [2, 5]}
    assert amendment["body"]["previous_hash"] == spec_hash(spec_data())
    assert shown["spec"]["config"]["overrides"]["train.steps"] == 5
    assert shown["registration"]["body"]["spec"] == spec_data(), "the registration itself never changes"
    code, out, _ = run("show", "exp-a", "--markdown")
    assert "### Amendments" in out and "two steps are too few" in out and "`config.overrides.train.steps`" in out


def test_comments_and_formatting_are_not_edits(lab):
    _, spec, run = lab
    assert run("register", str(spec))[0] == 0
    spec.write_text("# a note added after registration\n" + yaml.safe_dump(spec_data(), sort_keys=True, indent=4))
    assert run("run", "exp-a", "--dry-run")[0] == 0


def test_run_checks_the_file_given_with_spec_instead_of_the_registered_path(lab, tmp_path):
    _, spec, run = lab
    assert run("register", str(spec))[0] == 0
    edited = write_spec(tmp_path / "copy.yaml", spec_data(title="Another title"))
    code, _, err = run("run", "exp-a", "--dry-run", "--spec", str(edited))
    assert code == 2 and "changed: title" in err


@pytest.mark.parametrize("args, message", [
    (["amend", "exp-a", "SPEC", "--reason", "  "], "--reason is empty"),
    (["amend", "exp-a", "SPEC", "--reason", "no change"], "there is nothing to amend"),
    (["amend", "exp-b", "SPEC", "--reason", "x"], "unknown experiment id 'exp-b'"),
])
def test_amendments_need_a_reason_a_change_and_a_known_id(args, message, lab):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    code, out, err = run(*[str(spec) if a == "SPEC" else a for a in args])
    assert code == 2 and message in err and out == ""
    assert len(records(open_ledger(ledger))) == 1


def test_an_amendment_cannot_rename_the_experiment(lab):
    _, spec, run = lab
    assert run("register", str(spec))[0] == 0
    write_spec(spec, spec_data(id="exp-z"))
    code, _, err = run("amend", "exp-a", str(spec), "--reason", "rename")
    assert code == 2 and "cannot rename an experiment" in err


REQUIRED = ["id", "title", "question", "hypothesis", "prediction", "owner"]


@pytest.mark.parametrize("field", REQUIRED + ["prediction.metric", "prediction.decision_rule", "config"])
def test_a_spec_missing_a_required_field_exits_2_naming_it_and_creates_no_ledger(field, lab):
    ledger, spec, run = lab
    data = spec_data()
    if field.startswith("prediction."):
        del data["prediction"][field.split(".")[1]]
    else:
        del data[field]
    write_spec(spec, data)
    code, out, err = run("register", str(spec))
    assert code == 2 and out == "" and "Traceback" not in err
    assert "missing required field(s)" in err and field in err and "experiments/demo-spec.yaml" in err
    assert not ledger.exists()


@pytest.mark.parametrize("change, message", [
    ({"prediction": {"metric": "eval/mean", "decision_rule": "r"}}, "prediction.expected or prediction.band"),
    ({"prediction": {"metric": "m", "decision_rule": "r", "band": [3, 2]}}, "prediction.band=[3, 2]"),
    ({"prediction": {"metric": "m", "decision_rule": "r", "expected": "low"}}, "prediction.expected='low'"),
    ({"id": "../escape"}, "id='../escape' is invalid"),
    ({"colour": "red"}, "unknown key colour"),
    ({"ladder": {"rungs": 4}}, "give one of config or ladder"),
    ({"config": {"preset": "tiny", "overrides": {"model.num_heads": 3}}}, "config: model.num_heads=3"),
    ({"config": {"preset": "nope"}}, "unknown preset 'nope'"),
    ({"config": {"preset": "tiny", "train": {"steps": 3}}}, "config: train cannot sit beside preset"),
    ({"config": {"preset": "tiny", "overrides": {"mesh.expert": 4}}}, "config: model.moe.dispatch='capacity' "
                                                                      "cannot run with mesh.expert=4"),
    ({"resources": {"num_gpus": -1}}, "resources="),
])
def test_an_invalid_spec_exits_2_naming_the_field_and_the_value(change, message, lab):
    ledger, spec, run = lab
    write_spec(spec, spec_data(**change))
    code, _, err = run("register", str(spec))
    assert code == 2 and message in err and not ledger.exists()


def test_a_missing_or_unparsable_spec_file_exits_2_naming_the_file(lab, tmp_path):
    _, _, run = lab
    code, _, err = run("register", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml does not exist" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("id: [unclosed\n")
    code, _, err = run("register", str(bad))
    assert code == 2 and "bad.yaml is not valid YAML at line" in err


def test_a_duplicate_id_exits_2_and_the_first_registration_stands(lab, tmp_path):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    other = write_spec(tmp_path / "other.yaml", spec_data(title="Same id, other content"))
    code, _, err = run("register", str(other))
    assert code == 2 and "'exp-a' is already registered" in err and "moelab lab amend exp-a" in err
    [record] = records(open_ledger(ledger))
    assert record.body["spec"]["title"] == "A short run"


@pytest.mark.parametrize("command", [["show", "nope"], ["run", "nope"], ["run", "nope", "--dry-run"]])
def test_an_unknown_experiment_id_exits_2_listing_the_known_ones(command, lab):
    _, spec, run = lab
    assert run("register", str(spec))[0] == 0
    code, _, err = run(*command)
    assert code == 2 and "unknown experiment id 'nope'" in err and "the registered ones are: exp-a" in err


def test_a_ladder_spec_with_a_bad_recipe_is_refused_at_registration(lab):
    _, spec, run = lab
    write_spec(spec, spec_data(config=None, ladder={"recipe": "frontier", "budgets": [1e17, 1e18]}))
    code, _, err = run("register", str(spec))
    assert code == 2 and "ladder must have the keys target and rungs" in err


def test_a_ladder_spec_plans_rungs_then_fit_then_the_main_run(lab):
    _, spec, run = lab
    ladder = {"target": {"preset": "tiny", "overrides": {"train.steps": 40}}, "rungs": [[16, 1], [32, 1]]}
    write_spec(spec, spec_data(config=None, ladder=ladder))
    assert run("register", str(spec))[0] == 0
    code, out, err = run("run", "exp-a", "--dry-run", "--json")
    assert code == 0, err
    assert [s["name"] for s in json.loads(out)] == ["rung-ladder-d16-l1", "rung-ladder-d32-l1", "fit", "train"]


def test_a_ledger_edited_by_hand_is_reported_by_verify_after_a_registration(lab):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    conn = sqlite3.connect(ledger)
    with conn:
        conn.execute("UPDATE records SET body = replace(body, 'below 4 nats', 'below 5 nats')")
    conn.close()
    code, _, err = run("verify")
    assert code == 1 and "record 1 (experiment 'exp-a')" in err


def edit_row(ledger, seq):
    """Change one row's body the way someone with the sqlite3 shell would, leaving its hash as it was."""
    conn = sqlite3.connect(ledger)
    with conn:
        changed = conn.execute("UPDATE records SET body = replace(body, 'tester', 'someone else') WHERE seq = ?",
                               (seq,)).rowcount
    conn.close()
    assert changed == 1


@pytest.mark.parametrize("command", ["run", "run --dry-run", "amend", "register"])
def test_a_command_that_writes_refuses_an_edited_ledger_naming_the_bad_row_and_writes_and_runs_nothing(
        command, lab, tmp_path):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    retitled = write_spec(tmp_path / "retitled.yaml", spec_data(title="A short run, retitled"))
    assert run("amend", "exp-a", str(retitled), "--reason", "a clearer title")[0] == 0
    edit_row(ledger, 2)
    before = records(open_ledger(ledger))
    args = {"run": ["run", "exp-a"], "run --dry-run": ["run", "exp-a", "--dry-run"],
            "amend": ["amend", "exp-a", str(write_spec(tmp_path / "again.yaml", spec_data(title="Third"))),
                      "--reason", "another title"],
            "register": ["register", str(write_spec(tmp_path / "b.yaml", spec_data(id="exp-b")))]}[command]

    code, out, err = run(*args)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "at record 2: record 2 (amendment 'exp-a') does not match its hash" in err
    assert "Restore the ledger from a copy" in err and "moelab lab verify" in err
    assert records(open_ledger(ledger)) == before
    assert not (tmp_path / "runs").exists(), "no step may start on a broken chain"


def test_run_experiment_refuses_an_edited_ledger_before_any_step_starts(lab, tmp_path):
    """`moelab demo` and library callers go through run_experiment, not the `lab run` command."""
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    edit_row(ledger, 1)
    with pytest.raises(ChainBroken, match="record 1"):
        run_experiment(open_ledger(ledger), "exp-a", tmp_path / "runs")
    assert len(records(open_ledger(ledger))) == 1 and not (tmp_path / "runs").exists()


def test_show_prints_the_ledger_head_hash_and_record_count_in_every_format(lab, tmp_path):
    ledger, spec, run = lab
    assert run("register", str(spec))[0] == 0
    retitled = write_spec(tmp_path / "retitled.yaml", spec_data(title="A short run, retitled"))
    assert run("amend", "exp-a", str(retitled), "--reason", "a clearer title")[0] == 0
    head = verify(open_ledger(ledger)).head_hash

    for fmt in ([], ["--markdown"]):
        code, out, err = run("show", "exp-a", *fmt)
        assert code == 0, err
        assert f"holds 2 records (chain intact); head sha256 `{head}`" in out, fmt
        assert f"moelab lab verify --head {head[:16]}" in out
    code, out, _ = run("show", "exp-a", "--json")
    shown = json.loads(out)["ledger"]
    assert code == 0 and shown["head_hash"] == head and shown["num_records"] == 2 and shown["ok"]

    edit_row(ledger, 2)  # a reader of `show` must not mistake a broken chain's head for a good one
    code, out, _ = run("show", "exp-a", "--markdown")
    assert code == 0 and "chain broken at record 2" in out and "holds" not in out


def test_a_prediction_whose_expected_value_its_own_band_refutes_is_not_recorded(lab):
    """Registered, it could only come out refuted by the outcome it expects; amended to one, likewise."""
    ledger, spec, run = lab
    bad = dict(spec_data()["prediction"], expected=4.5)  # band [null, 4.0]
    write_spec(spec, spec_data(prediction=bad))
    code, _, err = run("register", str(spec))
    assert code == 2 and "prediction.expected=4.5 lies outside prediction.band=[None, 4.0]" in " ".join(err.split())
    assert not ledger.exists() or not records(open_ledger(ledger))
    write_spec(spec, spec_data())
    assert run("register", str(spec))[0] == 0
    write_spec(spec, spec_data(prediction=bad))
    code, _, err = run("amend", "exp-a", str(spec), "--reason", "raise the point")
    assert code == 2 and "lies outside prediction.band" in err and len(records(open_ledger(ledger))) == 1
