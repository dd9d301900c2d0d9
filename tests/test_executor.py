"""The step runner (`lab.dag`): completed steps are skipped, a changed versioned field re-runs exactly what lies
downstream, --dry-run predicts what runs, crashes never pass for success, and a preempted step resumes in place.
The same DAGs on Ray, on a cluster of two nodes: test_ray_cluster.py."""

import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from helpers import run_cli

from moelab.errors import ConfigError, Preempted
from moelab.lab.dag import (FAILED, PREEMPTED, RUNNING, SUCCESS, Step, _decide, _execute_job, _jobs, execute, plan,
                            read_status, versioned)

STEP_FILES = {"STATUS", "step.json"}  # what the runner writes before the step function starts


def compute(ctx):
    """A step that logs that it ran and writes a value built from its config and its inputs' values.

    It fails (after writing part of its output) when its unversioned `fail` flag is set, and it checks
    that it starts in an empty directory: partial output of an earlier attempt must never be reused.
    """
    with open(ctx.config["log"], "a") as f:
        f.write(ctx.name + "\n")
    leftovers = {p.name for p in ctx.output_dir.iterdir()} - STEP_FILES
    assert not leftovers, f"{ctx.name} started in a directory holding {leftovers}"
    inputs = [(ctx.deps[d] / "value.txt").read_text() for d in sorted(ctx.deps)]
    value = f"{ctx.name}{ctx.config['x']}({','.join(inputs)})"
    (ctx.output_dir / "value.txt").write_text(value)
    if ctx.config["fail"]:
        raise RuntimeError(f"{ctx.name} failed on purpose")
    return {"value": value}


def diamond(log, x=None, fail=None, note=""):
    """a -> b -> c and a -> d. `x` maps step names to their versioned field; `note` is unversioned."""
    x = {"a": 1, "b": 1, "c": 1, "d": 1, **(x or {})}

    def step(name, deps=()):
        return Step(name, compute, {"x": versioned(x[name]), "log": str(log), "fail": name == fail, "note": note},
                    deps)

    return [step("a"), step("b", ("a",)), step("c", ("b",)), step("d", ("a",))]


def ran(log):
    """The steps that ran since the log was last read, and empties it."""
    names = log.read_text().split() if log.exists() else []
    log.write_text("")
    return sorted(names)


def to_run(planned):
    return sorted(p.name for p in planned if p.action == "run")


def test_completed_steps_are_skipped_and_dry_run_matches_what_runs(tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    planned = plan(diamond(log), root)
    assert to_run(planned) == ["a", "b", "c", "d"] and not root.exists(), "a dry run writes nothing"
    outcomes = execute(diamond(log), root)
    assert ran(log) == to_run(planned)
    assert [(o.name, o.action, o.status) for o in outcomes] == [(n, "ran", SUCCESS) for n in "abcd"]
    by_name = {o.name: o for o in outcomes}
    assert by_name["c"].result == {"value": "c1(b1(a1()))"}
    assert by_name["c"].output_dir == root / f"c-{by_name['c'].version[:8]}"
    assert json.loads((by_name["c"].output_dir / "result.json").read_text()) == {"value": "c1(b1(a1()))"}

    assert [p.action for p in plan(diamond(log), root)] == ["skip"] * 4
    assert [o.action for o in execute(diamond(log), root)] == ["skipped"] * 4 and ran(log) == []


@pytest.mark.parametrize("changed, downstream", [("a", "abcd"), ("b", "bc"), ("c", "c"), ("d", "d")])
def test_changing_a_versioned_field_reruns_exactly_the_steps_downstream_of_it(changed, downstream, tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    first = {o.name: o for o in execute(diamond(log), root)}
    ran(log)
    steps = diamond(log, x={changed: 2})
    planned = plan(steps, root)
    assert to_run(planned) == sorted(downstream)
    outcomes = {o.name: o for o in execute(steps, root)}
    assert ran(log) == sorted(downstream), "the dry run must say exactly what then runs"
    for name, o in outcomes.items():
        assert o.status == SUCCESS
        assert (o.output_dir != first[name].output_dir) == (name in downstream)
        assert (o.action == "ran") == (name in downstream)
    assert all(o.output_dir.exists() for o in first.values()), "older versions stay where they were"


def test_unversioned_fields_change_neither_versions_nor_what_runs(tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    first = [o.output_dir for o in execute(diamond(log), root)]
    ran(log)
    steps = diamond(tmp_path / "other-log", note="a comment")
    assert [p.output_dir for p in plan(steps, root)] == first
    assert [o.action for o in execute(steps, root)] == ["skipped"] * 4


def test_a_step_that_crashes_is_left_failed_and_its_partial_output_is_not_reused(tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    outcomes = {o.name: o for o in execute(diamond(log, fail="b"), root)}
    assert ran(log) == ["a", "b", "d"], "c depends on b and must not start"
    assert (outcomes["b"].action, outcomes["b"].status) == ("ran", FAILED)
    assert "b failed on purpose" in outcomes["b"].error
    assert (outcomes["c"].action, outcomes["c"].status) == ("blocked", None)
    assert outcomes["a"].status == outcomes["d"].status == SUCCESS
    b_dir = outcomes["b"].output_dir
    assert read_status(b_dir) == FAILED and not outcomes["c"].output_dir.exists()
    assert "RuntimeError: b failed on purpose" in json.loads((b_dir / "step.json").read_text())["error"]

    planned = {p.name: p for p in plan(diamond(log), root)}
    assert to_run(planned.values()) == ["b", "c"] and "FAILED before" in planned["b"].reason
    outcomes = {o.name: o for o in execute(diamond(log), root)}  # the fix is unversioned: same directories
    assert ran(log) == ["b", "c"]  # `compute` asserts that b starts in an empty directory
    assert outcomes["b"].output_dir == b_dir and read_status(b_dir) == SUCCESS
    [aside] = root.glob(f"{b_dir.name}.failed-*")
    assert read_status(aside) == FAILED and (aside / "value.txt").exists(), "the failed attempt is kept aside"


def preemptible(ctx):
    """A step that is preempted at step 3 of its first run, after saving a "checkpoint" that its next run reads.

    Like `train`, it continues from what it finds in its directory; it fails if that is not its own checkpoint.
    """
    with open(ctx.config["log"], "a") as f:
        f.write(ctx.name + "\n")
    checkpoint = ctx.output_dir / "checkpoint.txt"
    if not checkpoint.exists():
        checkpoint.write_text("3")
        raise Preempted(3, checkpoint)
    value = f"{ctx.name}(resumed from {checkpoint.read_text()})"
    (ctx.output_dir / "value.txt").write_text(value)
    return {"value": value}


def with_preemptible_b(log):
    """a -> b -> c and a -> d, where b is `preemptible`."""
    a, b, c, d = diamond(log)
    return [a, Step("b", preemptible, b.config, b.deps), c, d]


def die(ctx):
    """A step whose process dies (test_ray_cluster.py: its Ray workers import this module, which loads no JAX)."""
    (ctx.output_dir / "value.txt").write_text("half")
    os._exit(9)


def die_until_allowed(ctx):
    """A resumable step: it saves a "checkpoint", then its worker dies, until the file `allow` exists."""
    checkpoint = ctx.output_dir / "checkpoint.txt"
    if not checkpoint.exists():
        checkpoint.write_text("3")
    if not Path(ctx.config["allow"]).exists():
        os._exit(9)
    return {"value": f"resumed from {checkpoint.read_text()}"}


def test_a_preempted_step_blocks_downstream_then_resumes_in_its_own_directory(tmp_path):
    log, root, events = tmp_path / "log", tmp_path / "root", []
    outcomes = {o.name: o for o in execute(with_preemptible_b(log), root, on_event=events.append)}
    assert ran(log) == ["a", "b"], "the run was asked to stop: neither c (after b) nor the independent d starts"
    assert (outcomes["d"].action, outcomes["d"].status) == ("not started", None)
    b = outcomes["b"]
    assert (b.action, b.status, b.preempted_at) == ("ran", PREEMPTED, 3) and "stopped at step 3" in b.error
    assert (outcomes["c"].action, outcomes["c"].status) == ("not started", None)
    assert read_status(b.output_dir) == PREEMPTED and (b.output_dir / "checkpoint.txt").read_text() == "3"
    [stop] = [e for e in events if e["step"] == "b" and e["event"] != "started"]
    assert (stop["event"], stop["status"], stop["preempted_at"]) == ("preempted", PREEMPTED, 3)
    assert stop["checkpoint"] == str(b.output_dir / "checkpoint.txt"), "the event says where the checkpoint is"

    planned = {p.name: p for p in plan(with_preemptible_b(log), root)}
    assert (planned["b"].action, planned["c"].action) == ("resume", "run")
    assert "preempted at step 3" in planned["b"].reason and "FAILED" not in planned["b"].reason
    events.clear()
    outcomes = {o.name: o for o in execute(with_preemptible_b(log), root, on_event=events.append)}
    assert ran(log) == ["b", "c", "d"]
    assert outcomes["b"].output_dir == b.output_dir and read_status(b.output_dir) == SUCCESS
    assert outcomes["b"].result == {"value": "b(resumed from 3)"}, "b continued from its own checkpoint"
    assert outcomes["c"].result == {"value": "c1(b(resumed from 3))"}
    assert not list(root.glob("b-*.failed-*")), "a preempted step's directory is never moved aside"
    started = next(e for e in events if e["step"] == "b" and e["event"] == "started")
    assert started["resumed_at"] == 3 and started["moved_aside"] is None
    assert json.loads((b.output_dir / "step.json").read_text())["preemptions"] == [3]


KILLED_STEP = """
import os, sys
from moelab.lab.dag import Step, execute, versioned

def killed(ctx):
    (ctx.output_dir / "value.txt").write_text("half")
    os._exit(9)  # no exception, no cleanup: what the OOM killer or a lost node does

execute([Step("a", killed, {"x": versioned(1), "log": sys.argv[2], "fail": False, "note": ""})], sys.argv[1])
"""


def test_a_step_killed_mid_run_is_never_success_and_runs_again_from_scratch(tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    steps = diamond(log)[:1]
    done = subprocess.run([sys.executable, "-c", KILLED_STEP, str(root), str(log)], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    [planned] = plan(steps, root)
    assert read_status(planned.output_dir) == RUNNING
    assert planned.action == "run" and "crashed while RUNNING" in planned.reason
    [outcome] = execute(steps, root)
    assert outcome.status == SUCCESS and (outcome.output_dir / "value.txt").read_text() == "a1()"
    assert len(list(root.glob("a-*.failed-*"))) == 1


def test_a_step_locked_by_another_process_is_waited_for_and_then_skipped(tmp_path, monkeypatch):
    log, root = tmp_path / "log", tmp_path / "root"
    steps = diamond(log)[:1]
    [planned] = plan(steps, root)
    lock_path = root / ".locks" / f"{planned.output_dir.name}.lock"
    lock_path.parent.mkdir(parents=True)
    holder = open(lock_path, "a")  # a second open file: flock treats it like another process
    fcntl.flock(holder, fcntl.LOCK_EX)
    assert plan(steps, root)[0].action == "wait"
    flock, waiting = fcntl.flock, threading.Event()

    def flock_and_tell(file, operation):
        if operation == fcntl.LOCK_EX:  # blocking: the runner found the lock held (so `waited` is set) and waits
            waiting.set()
        return flock(file, operation)

    monkeypatch.setattr(fcntl, "flock", flock_and_tell)

    def finish_elsewhere():  # only once the runner waits: released earlier, it would not have waited at all
        waiting.wait(timeout=30)
        planned.output_dir.mkdir()
        (planned.output_dir / "STATUS").write_text(SUCCESS)
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()

    other = threading.Thread(target=finish_elsewhere)
    other.start()
    [outcome] = execute(steps, root)
    other.join()
    assert (outcome.action, outcome.status, outcome.waited) == ("skipped", SUCCESS, True) and ran(log) == []


# (resumable, attempt): a plain step, then a resumable one, each on its first attempt and on a Ray retry (the
# driver retries a step whose worker it saw die).
STEP_KINDS = [(False, 1), (False, 2), (True, 1), (True, 2)]
# What an earlier attempt left in the step's directory: STATUS ("": none; None: no directory) and step.json,
# then the one right action for each of STEP_KINDS.
LEFT_BEHIND = [
    ("nothing", None, {}, ["run", "run", "run", "run"]),
    ("no-status", "", {}, ["run", "run", "run", "run"]),
    ("crashed-running", RUNNING, {"attempt": 1}, ["run", "run", "run", "resume"]),
    ("running-worker-lost", RUNNING, {"attempt": 3, "worker_lost": "lost"}, ["run", "run", "resume", "resume"]),
    ("failed", FAILED, {"attempt": 1, "error": "Traceback"}, ["run", "run", "run", "resume"]),
    ("failed-worker-lost", FAILED, {"attempt": 3, "worker_lost": "lost"}, ["run", "run", "resume", "resume"]),
    ("preempted", PREEMPTED, {"attempt": 1, "preempted_at": 3}, ["resume", "resume", "resume", "resume"]),
    ("success", SUCCESS, {"attempt": 1}, ["skip", "skip", "skip", "skip"]),
]


@pytest.mark.parametrize("status, info, resumable, attempt, expected", [
    pytest.param(status, info, resumable, attempt, actions[i],
                 id=f"{name}-{'resumable' if resumable else 'plain'}-attempt{attempt}")
    for name, status, info, actions in LEFT_BEHIND for i, (resumable, attempt) in enumerate(STEP_KINDS)])
def test_the_runner_does_what_plan_reports_whatever_state_a_step_was_left_in(status, info, resumable, attempt,
                                                                              expected, tmp_path):
    """What the runner did is read off the step's directory: a run starts empty, the last attempt's output moved
    aside; a resume starts with that output in place; a skip does not call the step. A second copy of the rule
    in the runner would disagree with `plan` here. (A held lock, "wait": the test after this one.)"""
    root, found = tmp_path / "root", []

    def record_what_it_finds(ctx):
        found.append({p.name for p in ctx.output_dir.iterdir()})

    step = Step("s", record_what_it_finds, resumable=resumable)
    job = dataclasses.replace(_jobs([step], root)[0], attempt=attempt)
    if status is not None:
        job.output_dir.mkdir(parents=True)
        (job.output_dir / "partial.txt").write_text("the last attempt's output")
        (job.output_dir / "step.json").write_text(json.dumps(info))
        if status:
            (job.output_dir / "STATUS").write_text(status)
    # plan's jobs are first attempts; a retry's decision is only ever taken by the runner, by the same rule
    reported = plan([step], root)[0].action if attempt == 1 else _decide(job, locked=False)[0]

    outcome = _execute_job(job, None)
    did = "skip" if not found else "resume" if "partial.txt" in found[0] else "run"
    assert did == reported == expected
    assert outcome.status == SUCCESS and (outcome.action == "skipped") == (did == "skip")
    moved = list(root.glob(f"{job.output_dir.name}.failed-*"))
    assert [(m / "partial.txt").exists() for m in moved] == ([True] if did == "run" and status is not None else [])
    if did == "run":
        assert found[0] == STEP_FILES, "a run starts in an empty directory"


@pytest.mark.parametrize("steps, message", [
    ([Step("a", compute), Step("a", compute)], "two steps are named 'a'"),
    ([Step("a", compute, deps=("z",))], "depends on 'z', which is not a step"),
    ([Step("a", compute, deps=("b",)), Step("b", compute, deps=("a",))], "cycle (a -> b -> a)"),
])
def test_an_ill_formed_dag_is_refused_before_anything_runs(steps, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(steps, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_step_name_that_is_not_a_directory_name_is_refused():
    with pytest.raises(ConfigError, match="step name '../up' is invalid"):
        Step("../up", compute)


# ----------------------------------------------------------------------------------------------
# `moelab lab run`


def _tiny_spec(exp_id: str, title: str, question: str, steps: int, **overrides) -> dict:
    """A spec that trains the tiny preset for `steps` steps on small batches: seconds on a CPU."""
    return {
        "id": exp_id, "title": title, "question": question, "hypothesis": "It finishes.", "owner": "tests",
        "prediction": {"metric": "loss", "band": [None, 10.0], "decision_rule": "The run finishes below 10."},
        "config": {"preset": "tiny", "overrides": {
            "train.steps": steps, "train.batch_size": 2, "train.eval_batches": 1, "train.warmup_steps": 1,
            "model.seq_len": 16, "data.max_bytes_per_domain": 50_000, **overrides}},
    }


def test_lab_run_trains_a_registered_config_and_puts_every_step_on_the_ledger(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = _tiny_spec("tiny-smoke", "Two steps of the tiny preset", "Does the lab run train?", steps=2)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    lab = ["--ledger", str(tmp_path / "ledger.sqlite")]
    assert run_cli(["lab", "register", "spec.yaml", *lab], monkeypatch, capsys)[0] == 0

    code, out, _ = run_cli(["lab", "run", "tiny-smoke", "--dry-run", "--json", *lab], monkeypatch, capsys)
    [planned] = json.loads(out)
    assert code == 0 and planned["action"] == "run" and not Path(planned["output_dir"]).exists()
    code, out, err = run_cli(["lab", "run", "tiny-smoke", "--json", *lab], monkeypatch, capsys)
    [outcome] = json.loads(out)
    assert code == 0 and outcome["status"] == SUCCESS and outcome["output_dir"] == planned["output_dir"]
    assert re.search(r"^tiny .* 2/2 .*loss", err, re.M), err  # the local step's progress bar, at 2 of 2 steps
    run_dir = Path(outcome["output_dir"])
    assert run_dir.parent == tmp_path / "runs" / "lab" / "tiny-smoke" and run_dir.name.startswith("train-")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 2 and outcome["result"] == summary
    assert (run_dir / "wandb" / "moelab_run_id").is_file()  # a ledger run is tracked in W&B (offline), no --publish needed

    code, out, _ = run_cli(["lab", "run", "tiny-smoke", "--json", *lab], monkeypatch, capsys)
    assert code == 0 and json.loads(out)[0]["action"] == "skipped"
    code, out, _ = run_cli(["lab", "show", "tiny-smoke", "--json", *lab], monkeypatch, capsys)
    shown = json.loads(out)
    assert [r["body"]["event"] for r in shown["runs"]] == ["started", "finished", "skipped"]
    assert all(r["body"]["spec_hash"] == shown["spec_hash"] for r in shown["runs"])
    assert shown["runs"][1]["body"]["result"]["step"] == 2
    assert run_cli(["lab", "verify", *lab], monkeypatch, capsys)[0] == 0


@pytest.mark.slow
def test_lab_run_stopped_by_ctrl_c_exits_75_and_the_next_lab_run_resumes_from_the_checkpoint(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches `train` as SIGINT: it saves and raises Preempted, which `lab run` records as PREEMPTED.

    `slow` (issue 27): two trainings of their own, ~10 s on 2 cores; the fast suite keeps a preempted step
    blocking what depends on it and resuming in place (the DAG tests above) and test_checkpoint's reruns."""
    from moelab.lab import tracking  # imports JAX

    monkeypatch.chdir(tmp_path)
    spec = _tiny_spec("tiny-ctrl-c", "Ctrl-C, then resume", "Does a stopped lab run resume?", steps=3,
                      **{"train.log_every": 1})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    lab = ["--ledger", str(tmp_path / "ledger.sqlite")]
    assert run_cli(["lab", "register", "spec.yaml", *lab], monkeypatch, capsys)[0] == 0
    publish, pressed = tracking.LedgerSink.log, []

    def log_then_press_ctrl_c(sink, record):  # once, at step 1: a deterministic point inside the loop
        publish(sink, record)
        if not pressed:
            pressed.append(record["step"])
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(tracking.LedgerSink, "log", log_then_press_ctrl_c)
    code, out, err = run_cli(["lab", "run", "tiny-ctrl-c", "--json", *lab], monkeypatch, capsys)
    [outcome] = json.loads(out)
    assert code == 75 and pressed == [1], err
    assert (outcome["status"], outcome["preempted_at"]) == (PREEMPTED, 1)
    assert "Preempted: train at step 1" in err and f"Rerun `moelab lab run tiny-ctrl-c --json {lab[0]} {lab[1]}`" in err
    run_dir = Path(outcome["output_dir"])
    assert read_status(run_dir) == PREEMPTED and (run_dir / "checkpoints" / "1").is_dir()

    code, out, _ = run_cli(["lab", "run", "tiny-ctrl-c", "--dry-run", "--json", *lab], monkeypatch, capsys)
    [planned] = json.loads(out)
    assert code == 0 and planned["action"] == "resume" and "preempted at step 1" in planned["reason"]
    code, out, err = run_cli(["lab", "run", "tiny-ctrl-c", "--json", *lab], monkeypatch, capsys)
    [outcome] = json.loads(out)
    assert code == 0 and outcome["status"] == SUCCESS and outcome["output_dir"] == str(run_dir), err
    assert (outcome["result"]["resumed_from"], outcome["result"]["step"]) == (1, 3), "resumed, not restarted"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not list(run_dir.parent.glob("*.failed-*"))

    code, out, _ = run_cli(["lab", "show", "tiny-ctrl-c", "--json", *lab], monkeypatch, capsys)
    runs = [r["body"] for r in json.loads(out)["runs"]]
    assert [r["event"] for r in runs] == ["started", "preempted", "started", "finished"]
    assert runs[1]["preempted_at"] == 1 and str(run_dir / "checkpoints") in runs[1]["message"]
    assert runs[2]["resumed_at"] == 1


def test_lab_run_rejects_an_unknown_backend_with_exit_2(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["lab", "run", "x", "--backend", "slurm", "--ledger", str(tmp_path / "l.sqlite")],
                           monkeypatch, capsys)
    assert code == 2 and "--backend='slurm' is invalid: use one of local, ray" in err
