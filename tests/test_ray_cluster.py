"""The Ray backend (`lab.dag`) on a cluster of two nodes started here with `ray start`, a head and a second node
with one CPU and a resource of its own each (`node_a`, `node_b`): steps run where their resources say and Ray
gives them what they asked for; a rung whose worker is killed mid-training is retried from its checkpoint, with
the lost attempt and the retry on the ledger; a GPU step on CPU-only nodes is refused before anything runs; an
address that does not answer exits 2 with nothing recorded. The generic DAG behaviours of test_executor.py run
on the same cluster. One cluster serves the whole module."""

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# `slow` (issue 27): a two-node cluster and trainings in fresh Ray workers, ~2 min on 2 cores. The fast suite
# keeps the same DAG rules on the local backend (test_executor), which these tests reuse.
pytestmark = pytest.mark.slow

from helpers import run_cli
from test_executor import _tiny_spec, diamond, die, die_until_allowed, ran, with_preemptible_b

from moelab import presets
from moelab.lab.dag import FAILED, PREEMPTED, SUCCESS, Step, execute, plan, read_status, versioned
from moelab.lab.experiment import training_step
from moelab.lab.ledger import append, open_ledger, records, verify
from moelab.train.checkpoint import MANIFEST

TESTS = Path(__file__).parent
RAY = Path(sys.executable).with_name("ray")  # the environment's own `ray` command


# ----------------------------------------------------------------------------------------------
# the cluster


@dataclass(frozen=True)
class Cluster:
    address: str  # HOST:PORT of the head, as `ray start --head` wrote it
    temp_dir: Path  # every process of this cluster names it on its command line


def _ray_start(temp_dir: Path, *args: str) -> None:
    env = {**os.environ,
           # Ray 2.60's `ray start` turns token authentication on when it finds a token (~/.ray/auth_token);
           # a cluster on this host for one test needs none, and every driver would need the token.
           "RAY_AUTH_MODE": "disabled",
           # The workers unpickle step functions defined in these test modules. They inherit the rest of
           # this environment too: the session's JAX compilation cache and its eight host devices.
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(RAY), "start", "--num-cpus=1", f"--temp-dir={temp_dir}", "--disable-usage-stats",
                           f"--object-store-memory={80 * 2**20}", *args], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def _cluster_processes(temp_dir: Path) -> set[int]:
    """This cluster's processes: those whose command line names its temp dir (the daemons), and their descendants
    (workers and agents, which rename themselves)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            table[int(entry.name)] = (ppid, cmdline)
    own = {pid for pid, (_, cmdline) in table.items() if str(temp_dir).encode() in cmdline and pid != os.getpid()}
    while children := {pid for pid, (ppid, _) in table.items() if ppid in own} - own:
        own |= children
    return own


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_cluster(temp_dir: Path) -> None:
    """`ray stop --force` for this cluster's processes only (`ray stop` would stop every Ray cluster on the machine):
    SIGKILL, as --force sends; the GCS server outlives a SIGTERM by more than 15 s."""
    own = _cluster_processes(temp_dir)
    for pid in own:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in own) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A head node (`node_a`) and a second node (`node_b`) on this host, one CPU each, 80 MiB object stores, in a
    fresh temp dir (short: Ray's socket paths must fit in 107 bytes) with ports Ray picks, so it shares nothing with
    another Ray cluster on this machine."""
    temp_dir = Path(tempfile.mkdtemp(prefix="moelab-ray-", dir="/tmp"))
    try:
        _ray_start(temp_dir, "--head", "--port=0", "--include-dashboard=false", '--resources={"node_a": 1}')
        address = (temp_dir / "ray_current_cluster").read_text().strip()
        _ray_start(temp_dir, f"--address={address}", '--resources={"node_b": 1}')
        yield Cluster(address, temp_dir)
    finally:
        _stop_cluster(temp_dir)


def record_event(ledger, event):
    append(ledger, "run", "ray-test", event)


# ----------------------------------------------------------------------------------------------
# a rung's worker killed mid-training


RUNG = {"train.steps": 40, "train.batch_size": 2, "train.eval_batches": 1, "train.warmup_steps": 1,
        "train.eval_every": 40, "train.log_every": 1, "model.seq_len": 16, "data.max_bytes_per_domain": 50_000,
        "checkpoint.every": 5}  # the tiny preset, a few seconds of training: a kill lands between checkpoints


def collect(ctx):
    """The fit's place in a ladder: a step after the rungs that reads what their runs finished with."""
    return {name: json.loads((path / "summary.json").read_text())["step"] for name, path in ctx.deps.items()}


def kill_after_first_checkpoint(run_dir: Path, killed: dict, stop: threading.Event) -> None:
    """Wait for a sealed checkpoint of the run, then SIGKILL the worker training it (step.json names its pid)."""
    while not stop.is_set():
        sealed = sorted(int(p.parent.name) for p in run_dir.glob(f"checkpoints/*/{MANIFEST}")
                        if p.parent.name.isdigit())
        if sealed:
            pid = json.loads((run_dir / "step.json").read_text())["pid"]
            assert pid != os.getpid(), "the step runs in a Ray worker, not in this process"
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, sealed=sealed, finished=(run_dir / "summary.json").exists())
            return
        time.sleep(0.01)


@pytest.mark.slow
def test_rungs_spread_over_two_nodes_and_a_killed_worker_is_retried_from_its_checkpoint(cluster, tmp_path):
    """`slow` (issue 27): two 40-step trainings in fresh Ray workers, ~80 s on 2 cores. The fast suite keeps
    Ray's retries (worker deaths, in-place resume, below) and the local backend's kill-and-resume."""
    ledger = open_ledger(tmp_path / "ledger.sqlite", create=True)
    steps = [training_step(f"rung-{n}", presets.resolve("tiny", {**RUNG, "name": f"rung-{n}"}),
                           resources={"num_cpus": 1, f"node_{n}": 1}) for n in "ab"]
    steps.append(Step("fit", collect, {"after": versioned("rungs")}, ("rung-a", "rung-b")))
    root = tmp_path / "root"
    rung_b = next(p.output_dir for p in plan(steps, root) if p.name == "rung-b")
    killed, stop = {}, threading.Event()
    killer = threading.Thread(target=kill_after_first_checkpoint, args=(rung_b, killed, stop), daemon=True)
    killer.start()
    try:
        outcomes = {o.name: o for o in execute(steps, root, "ray", functools.partial(record_event, ledger),
                                               address=cluster.address)}
    finally:
        stop.set()
        killer.join()
    assert {n: o.status for n, o in outcomes.items()} == {"rung-a": SUCCESS, "rung-b": SUCCESS, "fit": SUCCESS}
    assert killed["sealed"] and not killed["finished"], "the worker died mid-run, after a checkpoint"

    events = [r.body for r in records(ledger)]
    a, b = ([e for e in events if e["step"] == name] for name in ("rung-a", "rung-b"))
    assert [(e["event"], e["attempt"]) for e in b] == [("started", 1), ("failed", 1), ("retrying", 2),
                                                         ("started", 2), ("finished", 2)]
    assert b[1]["worker_lost"] and b[1]["error"].startswith("worker lost on attempt 1 of 3: WorkerCrashedError")
    assert b[2]["in_place"] and b[2]["reason"] == b[1]["error"]
    assert b[0]["pid"] == killed["pid"] != b[3]["pid"] and b[3]["in_place"] and b[3]["moved_aside"] is None
    # Each rung got what it asked for, on its own node; the retry went back to node_b.
    assert a[0]["ray_resources"] == {"CPU": 1.0, "node_a": 1.0}
    assert b[0]["ray_resources"] == b[3]["ray_resources"] == {"CPU": 1.0, "node_b": 1.0}
    assert a[0]["ray_node"] != b[0]["ray_node"] == b[3]["ray_node"]
    fit_started = next(i for i, e in enumerate(events) if e["step"] == "fit" and e["event"] == "started")
    assert events.index(b[-1]) < fit_started and outcomes["fit"].result == {"rung-a": 40, "rung-b": 40}

    # Resumed, not restarted: from the newest sealed checkpoint, each step logged once, in the same directory.
    summary = outcomes["rung-b"].result
    assert summary["step"] == 40 and max(killed["sealed"]) <= summary["resumed_from"] < 40
    assert [json.loads(line)["step"] for line in (rung_b / "resumes.jsonl").read_text().splitlines()] == [
        summary["resumed_from"]]
    assert [json.loads(line)["step"] for line in (rung_b / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 41))
    assert json.loads((rung_b / "step.json").read_text())["lost_attempts"] == [1]
    assert not list(root.glob("*.failed-*")) and verify(ledger).ok


# ----------------------------------------------------------------------------------------------
# `moelab lab run --backend ray --address`: bad input exits 2 with nothing recorded


def _registered(tmp_path, monkeypatch, capsys, exp_id: str, **fields) -> list[str]:
    """A tiny experiment registered in tmp_path's ledger; returns the --ledger arguments."""
    monkeypatch.chdir(tmp_path)
    spec = {**_tiny_spec(exp_id, "Two steps of the tiny preset", "Where does it run?", steps=2), **fields}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    lab = ["--ledger", str(tmp_path / "ledger.sqlite")]
    assert run_cli(["lab", "register", "spec.yaml", *lab], monkeypatch, capsys)[0] == 0
    return lab


def _kinds(tmp_path) -> list[str]:
    return [r.kind for r in records(open_ledger(tmp_path / "ledger.sqlite"))]


def test_lab_run_refuses_a_gpu_step_that_no_node_of_the_cluster_has_a_gpu_for(cluster, tmp_path, monkeypatch, capsys):
    """Ray would queue it forever; moelab says so before anything runs, naming what each node has."""
    lab = _registered(tmp_path, monkeypatch, capsys, "tiny-gpu", resources={"num_gpus": 1})
    code, out, err = run_cli(["lab", "run", "tiny-gpu", "--backend", "ray", "--address", cluster.address, *lab],
                             monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert "step train asks Ray for {CPU: 1, GPU: 1}, but no node of the cluster has that" in err
    assert "{CPU: 1, node_a: 1}" in err and "{CPU: 1, node_b: 1}" in err, "each node's resources are named"
    assert "`ray start --address HEAD:PORT --num-gpus 1`" in err and "Nothing was run or recorded." in err
    assert _kinds(tmp_path) == ["experiment"] and not (tmp_path / "runs").exists()


def _closed_port() -> int:
    with socket.socket() as s:  # a port just free: nothing listens on it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("given_by", ["--address", "RAY_ADDRESS"])
def test_lab_run_on_a_ray_address_that_does_not_answer_exits_2_and_records_nothing(given_by, tmp_path, monkeypatch,
                                                                                   capsys):
    lab = _registered(tmp_path, monkeypatch, capsys, "tiny-nowhere")
    dead = f"127.0.0.1:{_closed_port()}"
    args = ["lab", "run", "tiny-nowhere", "--backend", "ray", *lab]
    if given_by == "--address":
        args += ["--address", dead]
    else:
        monkeypatch.setenv("RAY_ADDRESS", dead)
    started = time.monotonic()
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and time.monotonic() - started < 30, "checked in seconds, not after ray.init's long retries"
    paragraph = err[err.index("Error"):]
    assert f"the Ray cluster at {given_by}={dead} does not answer (Connection refused)" in paragraph
    assert f"`ray start --head --port {dead.split(':')[1]}` on 127.0.0.1" in paragraph
    assert "Nothing was run or recorded." in paragraph and paragraph.count("\n") == 1, "one paragraph"
    assert _kinds(tmp_path) == ["experiment"]


@pytest.mark.parametrize("args, message", [
    (["--address", "10.0.0.5:6379"], "--address=10.0.0.5:6379 joins a Ray cluster: add --backend ray"),
    (["--backend", "ray", "--address", "10.0.0.5"], "--address='10.0.0.5' is not a Ray address: use HOST:PORT"),
])
def test_lab_run_refuses_an_address_it_cannot_use_with_exit_2(args, message, tmp_path, monkeypatch, capsys):
    lab = _registered(tmp_path, monkeypatch, capsys, "tiny-where")
    code, _, err = run_cli(["lab", "run", "tiny-where", *args, *lab], monkeypatch, capsys)
    assert code == 2 and message in err and _kinds(tmp_path) == ["experiment"]


# ----------------------------------------------------------------------------------------------
# the DAG's rules on Ray (the functions and steps of test_executor.py)


@pytest.fixture(scope="module")
def connected(cluster):
    """This process joined to the cluster once, so its workers are reused from test to test."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_the_ray_backend_runs_a_three_step_dag(connected, tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    ledger = open_ledger(tmp_path / "ledger.sqlite", create=True)
    steps = diamond(log)[:3]  # a -> b -> c
    outcomes = execute(steps, root, backend="ray", on_event=functools.partial(record_event, ledger))
    assert [(o.name, o.action, o.status) for o in outcomes] == [(n, "ran", SUCCESS) for n in "abc"]
    assert outcomes[-1].result == {"value": "c1(b1(a1()))"} and ran(log) == ["a", "b", "c"]
    events = [r.body for r in records(ledger)]
    assert [(e["step"], e["event"]) for e in events] == [(n, e) for n in "abc" for e in ("started", "finished")]
    assert all(e["pid"] != os.getpid() for e in events), "the steps ran in Ray workers"
    assert verify(ledger).ok, "workers appended to the ledger concurrently with the chain intact"
    # Same versions and directories as the local backend: the local one now finds everything done.
    assert [p.action for p in plan(steps, root)] == ["skip"] * 3
    assert [o.action for o in execute(steps, root, backend="ray")] == ["skipped"] * 3


def test_a_failing_step_on_ray_is_failed_and_blocks_what_depends_on_it(connected, tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    outcomes = {o.name: o for o in execute(diamond(log, fail="a")[:3], root, backend="ray")}
    assert outcomes["a"].status == FAILED and read_status(outcomes["a"].output_dir) == FAILED
    assert [outcomes[n].action for n in "bc"] == ["blocked", "blocked"] and ran(log) == ["a"]


def test_steps_whose_ray_worker_always_dies_fail_after_three_attempts_and_a_resumable_one_resumes_next_time(
        connected, tmp_path):
    """`a` is not resumable: each retry starts in a fresh directory, the lost attempt's output moved aside; what
    depends on it is blocked. `r` is: retried in place, then left FAILED with its state kept, and the next run (here
    the local backend's) continues from that state instead of starting over."""
    log, root, allow = tmp_path / "log", tmp_path / "root", tmp_path / "allow"
    ledger = open_ledger(tmp_path / "ledger.sqlite", create=True)
    resumable = Step("r", die_until_allowed, {"allow": str(allow)}, resumable=True)
    steps = [Step("a", die, {"x": versioned(1)}), *diamond(log)[1:3], resumable]
    outcomes = {o.name: o for o in execute(steps, root, "ray", functools.partial(record_event, ledger))}
    for name in "ar":
        assert outcomes[name].status == FAILED and "worker lost on attempt 3 of 3" in outcomes[name].error
        assert read_status(outcomes[name].output_dir) == FAILED
        events = [r.body for r in records(ledger) if r.body["step"] == name]
        assert [(e["event"], e["attempt"]) for e in events] == [
            ("started", 1), ("failed", 1), ("retrying", 2), ("started", 2), ("failed", 2), ("retrying", 3),
            ("started", 3), ("failed", 3)]
        assert all(e["in_place"] == (name == "r") for e in events if e["event"] == "retrying")
    assert [outcomes[n].action for n in "bc"] == ["blocked", "blocked"] and ran(log) == []
    assert len(list(root.glob("a-*.failed-*"))) == 2 and not list(root.glob("r-*.failed-*"))

    planned = {p.name: p for p in plan(steps, root)}
    assert planned["a"].action == "run" and "moved aside" in planned["a"].reason
    assert (planned["r"].action, planned["r"].reason) == ("resume", "its Ray worker was lost; runs again in place, "
                                                                    "from its checkpoint")
    allow.touch()
    [outcome] = execute([resumable], root)
    assert outcome.status == SUCCESS and outcome.result == {"value": "resumed from 3"}
    assert json.loads((outcome.output_dir / "step.json").read_text())["lost_attempts"] == [1, 2, 3]
    assert not list(root.glob("r-*.failed-*"))


def test_a_preempted_step_on_ray_blocks_what_depends_on_it_and_resumes_in_place(connected, tmp_path):
    log, root = tmp_path / "log", tmp_path / "root"
    steps = with_preemptible_b(log)[:3]  # a -> b -> c
    outcomes = {o.name: o for o in execute(steps, root, backend="ray")}
    assert (outcomes["b"].status, outcomes["b"].preempted_at) == (PREEMPTED, 3)
    assert read_status(outcomes["b"].output_dir) == PREEMPTED
    assert outcomes["c"].action == "blocked" and ran(log) == ["a", "b"]
    outcomes = {o.name: o for o in execute(steps, root, backend="ray")}
    assert outcomes["b"].result == {"value": "b(resumed from 3)"} and outcomes["c"].status == SUCCESS
    assert ran(log) == ["b", "c"] and not list(root.glob("b-*.failed-*"))
