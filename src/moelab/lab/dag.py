"""Steps with versioned configs in content-hashed directories, run locally or on Ray.

    from moelab.lab.dag import Step, execute, plan, versioned
    steps = [
        Step("data", make_data, {"seed": versioned(0)}),
        Step("train", train_model, {"lr": versioned(3e-3), "log_every": 10}, deps=("data",)),
    ]
    plan(steps, "runs/lab/x")      # what would run, resume, wait or skip
    execute(steps, "runs/lab/x")   # run what is not done yet, in dependency order

A step's *version* is the SHA-256 of its name, its versioned config fields (those wrapped in
`versioned`) and its dependencies' versions; it writes into ROOT/<name>-<version[:8]>. Change a
versioned field and that step and everything downstream get new directories and run again; the
rest are skipped. Fields not wrapped (log cadence, paths of scratch files) may change freely, and so
may the step function itself. This is the executor of Marin (marin-community/marin,
`marin/execution/executor.py`) cut down to what the lab needs; what the steps of an experiment are
is `lab.experiment`'s business, not this module's.

Each step directory holds `STATUS` (RUNNING, SUCCESS, FAILED or PREEMPTED, written atomically),
`step.json` (version, config, dependencies, host, times, the traceback of a failure) and
`result.json` (the step function's return value, when it has one). A lock
(ROOT/.locks/<dir>.lock, `flock`) makes one process run a step while others wait for it. A step
that crashes is left FAILED (or RUNNING with no process holding its lock, after a hard kill), never
SUCCESS; before it runs again its partial output is moved aside to <dir>.failed-<UTC time>, so
nothing half-written is reused or lost. A KeyboardInterrupt that reaches the runner counts as a
crash (recorded, then re-raised); `train` turns Ctrl-C inside its loop into `Preempted` instead.

A step function that raises `moelab.config.Preempted` (as `train` does on SIGTERM / SIGINT, after
saving a checkpoint) is left PREEMPTED instead: by raising it the function says that its directory
holds a consistent state to continue from. The next `execute` runs it again *in place*, in the same
directory, and `train` resumes from its newest checkpoint there. Steps downstream wait, as for a
failure.

Backends: `local` runs the steps one after another in this process; `ray` submits each step as a
Ray task once its dependencies have succeeded, so independent steps run in parallel, on any node
that holds the step's `resources` (one CPU by default; {"num_gpus": 1} only on a node with a GPU).
Ray joins the cluster at `address` (HOST:PORT, what `ray start --head` printed), else at RAY_ADDRESS,
else starts a local one; it is imported only when that backend is chosen. Before anything runs, an
address that does not answer within a few seconds, and a step that no node of the cluster could
hold (a GPU step on CPU-only nodes), are refused (ConfigError): Ray would hang or wait forever.

A Ray worker that dies inside a step (a killed process, a lost node) is not the step's failure: the
step is run again, up to MAX_ATTEMPTS times in all, each lost attempt and each retry an event. A
`resumable` step (a training step: `train` continues from its newest sealed checkpoint) is retried
in its own directory, and so is one that lost its worker on every attempt, on the next `execute`;
any other one in a fresh directory, its partial output moved aside. Step directories must be on
storage that every node sees (a shared filesystem).

Why one module of ~600 lines: versions, locks, status files and the two backends are one state machine
(a step's directory moves RUNNING -> SUCCESS / FAILED / PREEMPTED under its lock, whichever backend runs
it); split, each backend would need the other's view of a directory's state.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from moelab.errors import ConfigError, Preempted
from moelab.files import write_text
from moelab.lab.ledger import canonical_json

__all__ = ["RUNNING", "SUCCESS", "FAILED", "PREEMPTED", "BACKENDS", "MAX_ATTEMPTS", "Versioned", "versioned", "Step",
           "StepContext", "PlannedStep", "StepOutcome", "order_steps", "step_versions", "read_status", "plan",
           "check_backend", "check_ray_address", "execute"]

RUNNING, SUCCESS, FAILED, PREEMPTED = "RUNNING", "SUCCESS", "FAILED", "PREEMPTED"
BACKENDS = ("local", "ray")
STATUS_FILE, INFO_FILE, RESULT_FILE = "STATUS", "step.json", "result.json"
MAX_ATTEMPTS = 3  # runs of a step whose Ray worker keeps dying, in all (Ray's own default allows 3 retries)
REACH_TIMEOUT_S = 3.0  # how long a Ray address may take to accept a connection before it is refused


@dataclass(frozen=True)
class Versioned:
    """A config value that is part of the step's version: changing it changes the output directory."""

    value: Any


def versioned(value: Any) -> Versioned:
    return Versioned(value)


@dataclass(frozen=True)
class Step:
    """One node of the DAG: `fn(StepContext)` computes the step into `StepContext.output_dir`."""

    name: str  # letters, digits, . _ -; the directory is <name>-<hash8>
    fn: Callable[["StepContext"], Any]  # returns None or JSON-able data (saved as result.json)
    config: Mapping[str, Any] = field(default_factory=dict)  # values wrapped in `versioned` enter the version
    deps: tuple[str, ...] = ()  # names of steps that must succeed first
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray only: what the task needs, e.g. {"num_gpus": 1}; Ray hides GPUs from tasks that ask for
    none. Defaults to one CPU. Not part of the version."""
    resumable: bool = False
    """The function continues from what its directory holds (as `train` does from its newest sealed
    checkpoint), so a retry after a lost Ray worker runs in place. Not part of the version."""

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "._-" for c in self.name) or self.name[0] in "._-":
            raise ConfigError(f"step name {self.name!r} is invalid: use letters, digits, '.', '_' or '-', starting "
                              "with a letter or digit (it names a directory).")
        object.__setattr__(self, "deps", tuple(self.deps))


@dataclass(frozen=True)
class StepContext:
    """What a step function gets: where to write, its config (unwrapped), its dependencies' outputs."""

    name: str
    version: str  # full SHA-256 hex
    output_dir: Path
    config: dict
    deps: dict[str, Path]  # dependency name -> its output directory


@dataclass(frozen=True)
class PlannedStep:
    name: str
    version: str
    output_dir: Path
    action: str  # "run", "resume" (PREEMPTED: run again in place), "wait" (another process holds its lock), "skip"
    reason: str


@dataclass(frozen=True)
class StepOutcome:
    name: str
    version: str
    output_dir: Path
    action: str  # "ran", "skipped", "blocked" (a dependency did not succeed) or "not started" (preempted run)
    status: str | None  # SUCCESS, FAILED or PREEMPTED; None when blocked or not started
    waited: bool = False  # another process held the step's lock first
    error: str | None = None  # why it did not succeed: the exception, or what the preemption saved where
    result: Any = None
    preempted_at: int | None = None  # PREEMPTED: the (training) step it stopped at; it resumes from there


# ----------------------------------------------------------------------------------------------
# the DAG and its versions


def order_steps(steps: list[Step]) -> list[Step]:
    """The steps in dependency order (stable otherwise); ConfigError on a duplicate, unknown dep or cycle."""
    by_name: dict[str, Step] = {}
    for step in steps:
        if step.name in by_name:
            raise ConfigError(f"two steps are named {step.name!r}; step names must be unique in a DAG.")
        by_name[step.name] = step
    for step in steps:
        unknown = [d for d in step.deps if d not in by_name]
        if unknown:
            raise ConfigError(f"step {step.name!r} depends on {unknown[0]!r}, which is not a step of this DAG "
                              f"(steps: {', '.join(by_name)}).")
    ordered: list[Step] = []
    state: dict[str, str] = {}

    def visit(step: Step, path: tuple[str, ...]) -> None:
        if state.get(step.name) == "done":
            return
        if state.get(step.name) == "visiting":
            cycle = " -> ".join(path[path.index(step.name):] + (step.name,))
            raise ConfigError(f"the steps form a cycle ({cycle}); a DAG cannot depend on itself.")
        state[step.name] = "visiting"
        for dep in step.deps:
            visit(by_name[dep], path + (step.name,))
        state[step.name] = "done"
        ordered.append(step)

    for step in steps:
        visit(step, ())
    return ordered


def _versioned_fields(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, Versioned):
        return {prefix or ".": config.value}
    out: dict[str, Any] = {}
    if isinstance(config, Mapping):
        for key, value in config.items():
            out.update(_versioned_fields(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(config, (list, tuple)):
        for i, value in enumerate(config):
            out.update(_versioned_fields(value, f"{prefix}[{i}]"))
    return out


def _unwrap(config: Any) -> Any:
    if isinstance(config, Versioned):
        return config.value
    if isinstance(config, Mapping):
        return {key: _unwrap(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(_unwrap(v) for v in config)
    return config


def step_versions(steps: list[Step]) -> dict[str, str]:
    """Each step's version: sha256 of its name, versioned fields and its dependencies' versions."""
    versions: dict[str, str] = {}
    for step in order_steps(steps):
        content = {"name": step.name, "versioned": _versioned_fields(step.config),
                   "deps": {d: versions[d] for d in step.deps}}
        versions[step.name] = hashlib.sha256(canonical_json(content).encode()).hexdigest()
    return versions


@dataclass(frozen=True)
class _Job:
    """A step bound to its version and paths: what a backend executes (pickled for Ray)."""

    step: Step
    version: str
    output_dir: Path
    lock_path: Path
    dep_dirs: dict[str, Path]
    attempt: int = 1  # > 1: a Ray retry after the worker of the previous attempt was lost


def _jobs(steps: list[Step], root: str | Path) -> list[_Job]:
    root = Path(root).absolute()  # Ray workers may start in another directory
    versions = step_versions(steps)
    dirs = {s.name: root / f"{s.name}-{versions[s.name][:8]}" for s in steps}
    return [_Job(s, versions[s.name], dirs[s.name], root / ".locks" / f"{dirs[s.name].name}.lock",
                 {d: dirs[d] for d in s.deps}) for s in order_steps(steps)]


# ----------------------------------------------------------------------------------------------
# status files and locks


def read_status(output_dir: str | Path) -> str | None:
    """RUNNING, SUCCESS, FAILED or PREEMPTED; None when the step has not started there."""
    try:
        return (Path(output_dir) / STATUS_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _lock_held(lock_path: Path) -> bool:
    """Whether another process (or another open of the file) holds the step's lock right now."""
    try:
        f = open(lock_path, "rb")
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _read_info(output_dir: Path) -> dict:
    """step.json of the step's latest attempt; {} when it is missing or unreadable."""
    try:
        return json.loads((output_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _holder(output_dir: Path) -> str:
    info = _read_info(output_dir)
    return f"{info['host']} pid {info['pid']}" if "host" in info else "another process"


def _decide(job: _Job, locked: bool) -> tuple[str, str]:
    """(action, reason) for a step as things stand: the one rule that `plan` reports and `_execute_job` acts on.

    `locked`: another process holds the step's lock (`plan` looks; the executor passes False once it holds the
    lock itself). A resumable step whose Ray worker was lost continues in place: the driver recorded the loss in
    step.json (after the last attempt, for the next `execute`), or `job` is the driver's retry (`attempt` > 1)
    of a step that the dead worker left RUNNING or FAILED (the driver records the loss only where it finds the
    step RUNNING and its lock free).
    """
    status = read_status(job.output_dir)
    if status == SUCCESS:
        return "skip", "SUCCESS"
    if locked:
        return "wait", f"RUNNING in {_holder(job.output_dir)}"
    info = _read_info(job.output_dir)
    if job.step.resumable and status in (RUNNING, FAILED) and (job.attempt > 1 or "worker_lost" in info):
        return "resume", "its Ray worker was lost; runs again in place, from its checkpoint"
    if status == RUNNING:
        return "run", "crashed while RUNNING (no process holds its lock); partial output will be moved aside"
    if status == FAILED:
        return "run", "FAILED before; partial output will be moved aside"
    if status == PREEMPTED:
        return "resume", f"preempted at step {info.get('preempted_at')}; runs again in place, from its checkpoint"
    if job.output_dir.exists():
        return "run", "directory without a status; it will be moved aside"
    return "run", "not run yet"


def plan(steps: list[Step], root: str | Path) -> list[PlannedStep]:
    """What `execute` would do now, step by step, without running or writing anything."""
    return [PlannedStep(j.step.name, j.version, j.output_dir, *_decide(j, _lock_held(j.lock_path)))
            for j in _jobs(steps, root)]


# ----------------------------------------------------------------------------------------------
# running one step


def _move_aside(output_dir: Path) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    target = output_dir.with_name(f"{output_dir.name}.failed-{stamp}")
    output_dir.rename(target)
    return target


def _execute_job(job: _Job, on_event: Callable[[dict], None] | None, *dep_outcomes: StepOutcome) -> StepOutcome:
    """Do what `_decide` says for one step; the same code in this process (local) or a Ray worker (ray)."""
    name, out = job.step.name, job.output_dir
    base = {"step": name, "version": job.version, "output_dir": str(out), "host": socket.gethostname(),
            "pid": os.getpid(), "attempt": job.attempt}

    def emit(event: str, **fields: Any) -> None:
        if on_event is not None:
            on_event({**base, "event": event, **fields})

    def outcome(action: str, status: str | None, **fields: Any) -> StepOutcome:
        return StepOutcome(name, job.version, out, action, status, **fields)

    blocked = [o.name for o in dep_outcomes if o.status != SUCCESS]
    if blocked:
        return outcome("blocked", None, error=f"dependency {', '.join(blocked)} did not succeed")
    if _decide(job, locked=False)[0] == "skip":  # SUCCESS is final: no lock needed (or probed) to trust it
        emit("skipped", status=SUCCESS)
        return outcome("skipped", SUCCESS)
    job.lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(job.lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process runs this step: wait for it, then look again
            waited = True
        try:
            action, _ = _decide(job, locked=False)  # asked again: another process may have run it meanwhile
            if action == "skip":
                emit("skipped", status=SUCCESS, waited=waited)
                return outcome("skipped", SUCCESS, waited=waited)
            status, previous = read_status(out), _read_info(out)
            preempted = status == PREEMPTED
            lost = action == "resume" and not preempted  # its Ray worker died (`_decide` says when that resumes)
            if action == "resume":  # it left a state to continue from: run again in the same directory
                key, value = ("preemptions", "preempted_at") if preempted else ("lost_attempts", "attempt")
                resumed = {k: previous[k] for k in ("preemptions", "lost_attempts") if k in previous}
                resumed[key] = [*resumed.get(key, []), previous.get(value)]
                moved = None
            else:
                resumed = {}
                moved = str(_move_aside(out)) if out.exists() else None
            out.mkdir(parents=True, exist_ok=bool(resumed))
            config = _unwrap(job.step.config)
            info = {**base, "versioned": _versioned_fields(job.step.config), "config": config,
                    "deps": {d: str(p) for d, p in job.dep_dirs.items()}, "started_at": _now(), **resumed}
            write_text(out / INFO_FILE, canonical_json(info))
            write_text(out / STATUS_FILE, RUNNING)
            try:
                emit("started", status=RUNNING, moved_aside=moved,
                     **({"resumed_at": resumed["preemptions"][-1]} if preempted else {}),
                     **({"in_place": True} if lost else {}))
                result = job.step.fn(StepContext(name, job.version, out, config, dict(job.dep_dirs)))
                if result is not None:
                    write_text(out / RESULT_FILE, canonical_json(result))
            except Preempted as e:  # the step saved a state to continue from: keep the directory for a resume
                message = str(e)
                write_text(out / INFO_FILE, canonical_json({**info, "finished_at": _now(),
                                                               "preempted_at": e.step, "preempted": message}))
                write_text(out / STATUS_FILE, PREEMPTED)
                emit("preempted", status=PREEMPTED, preempted_at=e.step, checkpoint=str(e.path), message=message)
                return outcome("ran", PREEMPTED, waited=waited, error=message, preempted_at=e.step)
            except BaseException as e:
                error = f"{type(e).__name__}: {e}"
                write_text(out / INFO_FILE, canonical_json({**info, "finished_at": _now(),
                                                               "error": traceback.format_exc()}))
                write_text(out / STATUS_FILE, FAILED)
                emit("failed", status=FAILED, error=error)
                if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: recorded, then honoured
                    raise
                return outcome("ran", FAILED, waited=waited, error=error)
            write_text(out / INFO_FILE, canonical_json({**info, "finished_at": _now()}))
            write_text(out / STATUS_FILE, SUCCESS)  # last: SUCCESS means every other file is complete
            emit("finished", status=SUCCESS, result=result)
            return outcome("ran", SUCCESS, waited=waited, result=result)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------
# backends


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray, which is not installed: pip install 'moelab[ray]' "
                          "(or use --backend local).") from None
    return ray


def check_ray_address(address: str, source: str = "--address") -> None:
    """ConfigError unless something answers at a Ray address, HOST:PORT or ray://HOST:PORT, within REACH_TIMEOUT_S.

    `ray.init` keeps retrying an address where nothing listens for a long time; a TCP connect tells in seconds.
    `source` names where the address came from (the option or RAY_ADDRESS) in the message.
    """
    if address in ("auto", "local"):  # Ray's own lookup of a cluster on this host, or a new one: nothing to dial
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{source}={address!r} is not a Ray address: use HOST:PORT, the address `ray start --head` "
                          "printed, e.g. --address 10.0.0.5:6379.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        why = e.strerror or f"no answer within {REACH_TIMEOUT_S:g} s"
        raise ConfigError(f"the Ray cluster at {source}={address} does not answer ({why}). Start its head there "
                          f"(`ray start --head --port {port}` on {host}) or pass the address that `ray start --head` "
                          f"printed; `ray status --address {address}` checks it. Nothing was run or recorded."
                          ) from None


def _join_ray(ray, address: str | None) -> None:
    """Connect this process to the cluster at `address`, else at RAY_ADDRESS, else to a new local one."""
    source = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:  # "local" starts a fresh cluster even when one from `ray start` runs on this host
        ray.init(address="local", include_dashboard=False)
        return
    check_ray_address(address, source)
    try:
        ray.init(address=address)  # join that cluster: its workers need moelab installed
    except ConnectionError as e:  # something answers there, but not a Ray head that lets this process in
        raise ConfigError(f"could not join the Ray cluster at {source}={address}: {str(e).splitlines()[0]}. Check that "
                          f"it is the address `ray start --head` printed and that the cluster runs Ray "
                          f"{ray.__version__}, as this machine does. Nothing was run or recorded.") from None


def _ray_options(resources: Mapping[str, float]) -> dict:
    options = {"num_cpus": resources.get("num_cpus", 1), "max_retries": 0}  # retried here, on the record
    if "num_gpus" in resources:
        options["num_gpus"] = resources["num_gpus"]
    custom = {k: v for k, v in resources.items() if k not in ("num_cpus", "num_gpus")}
    if custom:
        options["resources"] = custom
    return options


def _amounts(resources: Mapping[str, float]) -> str:
    """{CPU: 1, GPU: 1, ...} without Ray's bookkeeping entries (memory, object store, node:<ip>)."""
    shown = {k: v for k, v in resources.items()
             if k not in ("memory", "object_store_memory") and not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _check_placeable(jobs: list[_Job], nodes: list[dict]) -> None:
    """ConfigError naming a step still to run that no live node could hold, before anything runs.

    Ray would queue such a step forever (a GPU step on CPU-only nodes, say); running it on what there
    is instead (a GPU step on a CPU) is never what was asked for. An autoscaling cluster must have
    started the nodes first.
    """
    alive = [n for n in nodes if n.get("Alive")]
    for job in jobs:
        options = _ray_options(job.step.resources)
        request = {"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
        request = {k: v for k, v in request.items() if v}
        if read_status(job.output_dir) == SUCCESS or any(
                all(n["Resources"].get(k, 0) >= v for k, v in request.items()) for n in alive):
            continue
        have = "; ".join(f"{n['NodeManagerAddress']} {_amounts(n['Resources'])}" for n in alive) or "none alive"
        raise ConfigError(f"step {job.step.name} asks Ray for {_amounts(request)}, but no node of the cluster has that "
                          f"(nodes: {have}): it would wait forever, and moelab does not run it on less. Add a node "
                          "that has it (e.g. `ray start --address HEAD:PORT --num-gpus 1` on a GPU machine) or change "
                          "the experiment's resources (`moelab lab amend`). Nothing was run or recorded.")


def _execute_on_ray(job: _Job, on_event: Callable[[dict], None] | None) -> StepOutcome:
    """`_execute_job` in a Ray worker; each event says which node ran it and what Ray gave it."""
    import ray

    context = ray.get_runtime_context()
    where = {"ray_node": context.get_node_id(), "ray_resources": context.get_assigned_resources()}
    return _execute_job(job, None if on_event is None else (lambda event: on_event({**event, **where})))


def _emit(on_event: Callable[[dict], None] | None, job: _Job, event: str, **fields: Any) -> None:
    """An event the driver records for a step (its worker cannot: it is gone)."""
    if on_event is not None:
        on_event({"step": job.step.name, "version": job.version, "output_dir": str(job.output_dir),
                  "attempt": job.attempt, "event": event, **fields})


def _worker_lost(job: _Job, error: Exception, on_event: Callable[[dict], None] | None) -> StepOutcome:
    """A Ray worker died inside a step: mark it FAILED on disk (its lock is free now) and on the record.

    A step the worker had already left PREEMPTED (and put on the record) stays PREEMPTED: it can resume.
    """
    if read_status(job.output_dir) == PREEMPTED:
        info = _read_info(job.output_dir)
        return StepOutcome(job.step.name, job.version, job.output_dir, "ran", PREEMPTED,
                           error=info.get("preempted"), preempted_at=info.get("preempted_at"))
    message = (f"worker lost on attempt {job.attempt} of {MAX_ATTEMPTS}: {type(error).__name__}: "
               f"{str(error).splitlines()[0] if str(error) else ''}")
    if read_status(job.output_dir) == RUNNING and not _lock_held(job.lock_path):
        write_text(job.output_dir / INFO_FILE, canonical_json({**_read_info(job.output_dir), "finished_at": _now(),
                                                                  "worker_lost": message}))
        write_text(job.output_dir / STATUS_FILE, FAILED)
    _emit(on_event, job, "failed", status=FAILED, worker_lost=True, error=message)
    return StepOutcome(job.step.name, job.version, job.output_dir, "ran", FAILED, error=message)


def _run_on_ray(ray, jobs: list[_Job], on_event: Callable[[dict], None] | None) -> dict[str, StepOutcome]:
    """Submit each step once its dependencies have succeeded; run a step whose worker died again."""
    remote = ray.remote(_execute_on_ray)

    def submit(job: _Job):
        return remote.options(**_ray_options(job.step.resources)).remote(job, on_event)

    outcomes: dict[str, StepOutcome] = {}
    waiting, running = list(jobs), {}
    while waiting or running:
        for job in list(waiting):  # dependency order: a blocked step blocks its dependents in the same pass
            if all(d in outcomes for d in job.step.deps):
                waiting.remove(job)
                blocked = [d for d in job.step.deps if outcomes[d].status != SUCCESS]
                if blocked:
                    outcomes[job.step.name] = StepOutcome(job.step.name, job.version, job.output_dir, "blocked", None,
                                                          error=f"dependency {', '.join(blocked)} did not succeed")
                else:
                    running[submit(job)] = job
        if not running:
            continue
        [done], _ = ray.wait(list(running), num_returns=1)
        job = running.pop(done)
        try:
            outcomes[job.step.name] = ray.get(done)
        except ray.exceptions.RayError as e:
            lost = _worker_lost(job, e, on_event)
            if lost.status == FAILED and job.attempt < MAX_ATTEMPTS:
                retry = dataclasses.replace(job, attempt=job.attempt + 1)
                _emit(on_event, retry, "retrying", in_place=job.step.resumable, reason=lost.error)
                running[submit(retry)] = retry
            else:
                outcomes[job.step.name] = lost
    return outcomes


def _execute_ray(jobs: list[_Job], on_event: Callable[[dict], None] | None,
                 address: str | None) -> dict[str, StepOutcome]:
    ray = _import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        _join_ray(ray, address)
    try:
        _check_placeable(jobs, ray.nodes())
        return _run_on_ray(ray, jobs, on_event)
    finally:
        if started_here:
            ray.shutdown()


def check_backend(backend: str, address: str | None = None) -> None:
    """ConfigError for an unknown backend, or a Ray address given to another backend."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend={backend!r} is invalid: use one of {', '.join(BACKENDS)}.")
    if address is not None and backend != "ray":
        raise ConfigError(f"--address={address} joins a Ray cluster: add --backend ray (the {backend} backend runs "
                          "every step in this process).")


def execute(steps: list[Step], root: str | Path, backend: str = "local",
            on_event: Callable[[dict], None] | None = None, address: str | None = None) -> list[StepOutcome]:
    """Run every step that is not SUCCESS yet, dependencies first; return one outcome per step.

    A failed step blocks the steps downstream of it; independent branches still run. A preempted
    step means the whole run was asked to stop (SIGTERM / SIGINT), so the local backend starts no
    further step ("not started"); the next `execute` resumes the PREEMPTED one in its own directory.
    `on_event` gets a dict for each step that starts, finishes, fails, is preempted or is skipped
    (with Ray, in the worker: it must be picklable, e.g. a `functools.partial` of a top-level
    function, and so must each step's function). `address` (ray only) is the cluster to join, HOST:PORT;
    None: RAY_ADDRESS, else a new local cluster.
    """
    check_backend(backend, address)
    jobs = _jobs(steps, root)
    if backend == "ray":
        outcomes = _execute_ray(jobs, on_event, address)
    else:
        outcomes, preempted = {}, False
        for job in jobs:
            if preempted:  # a scheduler's SIGTERM is for the whole process: a new step would be killed mid-run
                outcomes[job.step.name] = StepOutcome(job.step.name, job.version, job.output_dir, "not started", None,
                                                      error="the run was preempted before this step started")
                continue
            outcomes[job.step.name] = _execute_job(job, on_event, *[outcomes[d] for d in job.step.deps])
            preempted = outcomes[job.step.name].status == PREEMPTED
    return [outcomes[j.step.name] for j in jobs]
