"""The run: a config trained into a run directory, resumed where it stopped, its outputs written.

    from moelab import presets
    from moelab.train.loop import train
    summary = train(presets.get("tiny"), "runs/tiny")

`train` writes the run directory of `moelab.train.outputs` (`OUT/config.yaml`, `metrics.jsonl`, ...,
`summary.json`). The steps it drives are `moelab.train.step`'s; where it starts is `moelab.train.resume`'s.
What plugs in comes as arguments, so train/ knows nothing of the lab or the ladder: sinks (`outputs.Sink`;
`moelab.lab.tracking` mirrors the outputs to the ledger or W&B), watchers (`Watcher`;
`moelab.ladder.on_track.OnTrack` checks each eval against a predicted band) and progress callbacks (`Hooks`; the
CLI plugs in a Rich progress bar). Everything a user can get wrong (config, data files, vocabulary) is checked
before `OUT` is created, so bad input leaves nothing half-written.

Multi-host: every process runs every step, eval, sample decode and checkpoint save (they are
collectives), but only process 0 (`mesh.is_writer()`) writes the files above and publishes to sinks; on
the others they are opened on os.devnull, so N hosts sharing `OUT` do not write each line N times.
"""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moelab import accounting
from moelab.config import ModelConfig, RunConfig
from moelab.errors import ConfigError, Preempted, SaveFailed
from moelab.data.mixture import Corpus, MixtureLog, build_corpus, eval_batches, phase_at, sample_batch
from moelab.model import decode
from moelab.model.moe import drops_by_purpose
from moelab.parallel import mesh as mesh_lib
from moelab.train import outputs, run_length
from moelab.train.checkpoint import Checkpointer
from moelab.train.monitor import Incident, Monitor
from moelab.train.outputs import Sink
from moelab.train.resume import Start, check_config, check_same_store, restore, store_hash
from moelab.train.state import TrainState, compute_dtype, init_sharded_state, weights_sha256
from moelab.train.step import evaluate, make_eval_step, make_train_step
from moelab.train.weights import checkpoint_steps

__all__ = ["Hooks", "Watcher", "prepare_corpus", "run_platform", "train"]


def prepare_corpus(cfg: RunConfig) -> Corpus:
    """Load and tokenize the data; checks that the model's vocabulary holds the tokenizer's."""
    corpus = build_corpus(cfg.data)
    if corpus.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({corpus.tokenizer.vocab_size} tokens); set --set model.vocab_size={corpus.tokenizer.vocab_size} or more."
        )
    return corpus


@dataclass
class Hooks:
    """Callbacks the caller plugs in (all optional): progress, every logged record, every eval.

    They run on every process of a multi-host run, with the same values; show progress only where
    `moelab.parallel.mesh.is_writer()` holds.
    """

    on_step: Callable[[int], None] | None = None  # after each step, with the number of steps done
    on_log: Callable[[dict], None] | None = None  # each record written to metrics.jsonl
    on_eval: Callable[[int, dict[str, float]], None] | None = None
    on_stage: Callable[[str], None] | None = None  # slow work before the steps: "compiling the train step", ...
    on_resume: Callable[[int, Path], None] | None = None  # resuming from this step's checkpoint directory

    def stage(self, name: str) -> None:
        if self.on_stage:
            self.on_stage(name)


class Watcher(Protocol):
    """Watches a run's evals from outside the loop; `moelab.ladder.on_track.OnTrack` (the predicted band) is one.

    `check_run(cfg)` runs once, before anything is built (e.g. to warn that it watches for another run).
    `watch(step, eval_mean)` runs at each eval, on every process, with its `eval/mean`; it returns fields
    for that eval's metrics record (`on_track`) and incidents as {"rule", "module", "values"}, which the
    loop stamps with the step, writes to incidents.jsonl and publishes like the monitor's own.
    """

    def check_run(self, cfg: RunConfig) -> None: ...

    def watch(self, step: int, eval_mean: float) -> tuple[dict[str, Any], list[dict]]: ...


def _jsonable(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


@contextlib.contextmanager
def _stop_requests():
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps (main thread only)."""
    requested = {"signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum, _frame):
        requested["signal"] = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_platform() -> dict[str, Any]:
    """Where a run computed: Python (it also builds the embedded corpus from its standard library), JAX, the
    backend, device kind and count, and the machine. Two runs compare bitwise only where these match."""
    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
            "machine": platform.machine(), "system": platform.system()}


def train(cfg: RunConfig, out_dir: str | Path, hooks: Hooks | None = None, *, sinks: Sequence[Sink] = (),
          watchers: Sequence[Watcher] = (), profile: tuple[int, int] | None = None) -> dict:
    """Train `cfg` into `out_dir`, resuming from its newest valid checkpoint if there is one.

    Writes the run directory of `moelab.train.outputs`: `config.yaml`, `metrics.jsonl`,
    `incidents.jsonl`, `mixture_log.jsonl` (phase changes and realized-token snapshots), `samples.jsonl`
    (greedy continuations of fixed prompts at each eval), `router_load.jsonl`, `checkpoints/`,
    `summary.json` (and `resumes.jsonl` on a resume). Every record, incident, mixture entry and sample
    also goes to each of `sinks` (e.g. `moelab.lab.tracking`'s), which `train` closes when it returns or
    raises. Each of `watchers` sees every eval's `eval/mean` (`Watcher`): with
    `moelab.ladder.on_track.load_on_track(PRED.csv)` each eval is checked against the predicted 95% band,
    and two misses in a row are an `off_track` incident. With `profile` (START, STOP) the JAX profiler traces
    steps START+1 to STOP into `OUT/profile` (a Perfetto trace beside TensorBoard's). Returns the summary: final `step`, `loss`,
    `eval` and `eval_initial` per domain (with their `mean`), `eval_mean`, `tokens`, `tokens_per_s` (after
    the first step), `mfu` (of the devices' datasheet peak, where `run_length` knows it; also in every logged
    record), `compile_s` (the first step), `incidents`, `moe_drops` (what the MoE blocks drop in training,
    in the evals and in the samples: `moe.drops_by_purpose`). Raises Preempted on SIGTERM / SIGINT.

    On a multi-host run every process trains, evaluates, saves checkpoints (Orbax coordinates
    `checkpoints/`) and returns the same summary, but only process 0 writes the other files and
    publishes to `sinks`.
    """
    hooks = hooks or Hooks()
    out = Path(out_dir)
    for watcher in watchers:
        watcher.check_run(cfg)
    changes = check_config(cfg, out)
    mesh = mesh_lib.make_mesh(cfg.mesh)  # ConfigError if there are too few devices
    try:
        corpus = prepare_corpus(cfg)  # may raise DataError / ConfigError: before anything is written
    except KeyboardInterrupt:  # Ctrl-C while the data loads: nothing written yet, and the same exit as later
        raise Preempted(0, None) from None
    t, m = cfg.train, cfg.model
    held_out = {d: eval_batches(corpus, d, t.eval_batches, t.batch_size, m.seq_len) for d in corpus.domains}  # likewise
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output directory {out} is an existing file: pass a directory path (--out).")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the output directory {out} ({e.strerror}): pass a writable path (--out).") from None
    try:
        return _train(cfg, out, hooks, changes, mesh, corpus, held_out, sinks, watchers, profile)
    except KeyboardInterrupt:  # Ctrl-C outside the steps' own handler: building, compiling, the first eval
        raise _stopped_before_a_checkpoint(out, created) from None
    except OSError as e:  # a log or config write: a full disk, a file-size limit, a lost mount
        raise SaveFailed(f"writing {e.filename or 'a run file'} failed ({e.strerror or e}); the checkpoints saved "
                         "so far are untouched. Free disk space or fix the folder, then rerun the same command "
                         "to resume.") from e
    finally:
        for sink in sinks:
            sink.close()


def _stopped_before_a_checkpoint(out: Path, created: bool) -> Preempted:
    """Ctrl-C before the steps' signal handler was on: with a checkpoint in `out` (a resume, or a save this run
    made) it stays as it is, as after a preemption; with none, what this run made goes: `out` if it created it,
    else its empty `checkpoints/` (a rerun rewrites the rest). Preempted either way: exit 75, rerun to go on."""
    steps = checkpoint_steps(out)
    if steps:
        return Preempted(max(steps), out / outputs.CHECKPOINTS / str(max(steps)))
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return Preempted(0, None, f", and {out}, which this run created, is removed")
    with contextlib.suppress(OSError):
        (out / outputs.CHECKPOINTS).rmdir()  # only if empty
    return Preempted(0, None)


@dataclass
class _Trace:
    """`moelab train --profile START:STOP`: the JAX profiler on from before step START+1 to after step STOP (a resumed
    run inside the range starts at its first step), written to `folder` with a Perfetto trace."""

    folder: Path
    start: int
    stop: int
    running: bool = False

    def before(self, step: int) -> None:
        if not self.running and self.start <= step < self.stop:
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.running = True

    def after(self, done: int) -> None:
        if self.running and done >= self.stop:
            self.close()

    def close(self) -> None:
        """Stops a trace under way (at STOP, or when the run stops early), so what it saw is written."""
        if self.running:
            self.running = False
            jax.profiler.stop_trace()


@dataclass
class _Run:
    """One run's parts, built once by `_train` and read by every step: its config, mesh and data, the compiled
    steps, its writers and callbacks, and the incidents this process opened (for the summary's count)."""

    cfg: RunConfig
    mesh: Mesh
    corpus: Corpus
    hooks: Hooks
    watchers: Sequence[Watcher]
    checkpoints: Checkpointer
    logs: outputs.RunLogs
    train_step: Callable
    evaluate_state: Callable[[TrainState], dict[str, float]]
    sample: Callable[[TrainState, int], list[dict]]
    trace: _Trace | None = None
    incidents: list[dict] = field(default_factory=list)

    def report(self, found: list[dict]) -> None:
        for incident in found:
            self.logs.incident(incident)
        self.incidents.extend(found)


def _train(cfg: RunConfig, out: Path, hooks: Hooks, changes: dict, mesh: Mesh, corpus: Corpus,
           held_out: dict[str, list[np.ndarray]], sinks: Sequence[Sink], watchers: Sequence[Watcher],
           profile: tuple[int, int] | None) -> dict:
    """`train` once its inputs are checked and `out` exists: build, resume, write the run's files, run the steps."""
    t, m = cfg.train, cfg.model
    checkpoints = Checkpointer(out / outputs.CHECKPOINTS, cfg.checkpoint)
    # A finished run is left as it is, known from its summary and sealed last checkpoint before anything
    # compiles (process 0 reads them; every process agrees).
    previous = outputs.finished_summary(out, t.steps)
    if mesh_lib.from_process_0(lambda: previous is not None) and checkpoints.is_finished(t.steps):
        checkpoints.close()
        warnings.warn(f"{out} already finished its {t.steps} steps; nothing to do (its summary.json is unchanged). "
                      "Pass a larger --steps to train on, or a new --out for a new run.", stacklevel=2)
        return previous or {"step": t.steps, "resumed_from": t.steps}
    hooks.stage("building the model")
    eval_sets = {d: [mesh_lib.place_batch(b, mesh) for b in batches] for d, batches in held_out.items()}
    state = init_sharded_state(cfg, mesh)
    train_step, eval_step = make_train_step(cfg, mesh), make_eval_step(cfg, mesh)
    prompts = decode.sample_prompts(corpus.heldout, m.seq_len)
    greedy, _ = decode.make_greedy_decode(m, len(next(iter(prompts.values()))), corpus.tokenizer.vocab_size,
                                          compute_dtype(cfg))

    def evaluate_state(state: TrainState) -> dict[str, float]:
        return evaluate(eval_step, state.params, state.router_bias, eval_sets)

    def sample(state: TrainState, step: int) -> list[dict]:
        return decode.generate_samples(greedy, state.params, state.router_bias, prompts, corpus.tokenizer, step)

    start = restore(cfg, out, checkpoints, state)
    if start.imported_from is not None:
        hooks.stage(f"starting from the weights imported from {start.imported_from}")
    elif start.meta is not None and hooks.on_resume:
        hooks.on_resume(start.step, checkpoints.directory / str(start.step))
    check_same_store(start, corpus, checkpoints)
    writer = mesh_lib.is_writer()
    if start.meta is not None:
        eval_initial = start.meta["eval_initial"]
        outputs.append_resume(out, start.step, changes, writer)
        if start.step < t.steps:
            # Compiled here, not at the first eval: there the bar would stall unexplained and the summary's
            # throughput would hold the compile. One batch per domain and one sample, both discarded.
            hooks.stage("compiling the eval step")
            first_batches = {d: batches[:1] for d, batches in eval_sets.items()}
            evaluate(eval_step, start.state.params, start.state.router_bias, first_batches)
            hooks.stage("compiling the sampler")
            sample(start.state, start.step)
    else:
        hooks.stage("compiling the eval step")
        eval_initial = evaluate_state(start.state)
    outputs.write_config(out, cfg, writer)
    outputs.write_data(out, corpus.provenance, writer)
    outputs.write_tokenizer(out, corpus.tokenizer, writer)
    if hooks.on_eval and start.step == 0:
        hooks.on_eval(0, eval_initial)
    logs = outputs.RunLogs(out, start.kept, sinks, writer)  # opened by the steps
    trace = _Trace(out / outputs.PROFILE, *profile) if profile is not None else None
    run = _Run(cfg, mesh, corpus, hooks, watchers, checkpoints, logs, train_step, evaluate_state, sample, trace)
    summary = _run_steps(run, start, eval_initial)
    outputs.write_summary(out, summary, writer)
    return summary


@dataclass
class _Throughput:
    """The train step's wall time: this process's first step (the compile) apart, then the steady state, and
    the window since the last logged record."""

    tokens_per_step: int
    window_start: float  # from after the decode's compile: that is not training time
    model: ModelConfig  # whose training FLOPs per token MFU counts (`accounting.mfu`)
    peak_flops: float | None  # every device's datasheet peak together; None where unknown (no MFU shown)
    window_steps: int = 0
    steady_since: float | None = None
    steady_steps: int = 0
    compile_s: float | None = None  # the first step: the train step's compile, reported apart

    def step_done(self) -> None:
        self.window_steps += 1
        if self.steady_since is None:  # the first step compiled: time the steady state, and the window, from here
            self.steady_since = time.perf_counter()
            self.compile_s = self.steady_since - self.window_start
            self.window_start, self.window_steps = self.steady_since, 0
        else:
            self.steady_steps += 1

    def window_tokens_per_s(self) -> float:
        # Logged at the first step, the window holds no steady step: that step (compile included) is all.
        if self.window_steps:
            return self.window_steps * self.tokens_per_step / (time.perf_counter() - self.window_start)
        return self.tokens_per_step / self.compile_s

    def new_window(self) -> None:
        self.window_start, self.window_steps = time.perf_counter(), 0

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """Model FLOPs utilization at `tokens_per_s`: useful training FLOPs per second over the peak (None unknown)."""
        if self.peak_flops is None or tokens_per_s is None:
            return None
        return accounting.mfu(self.model, tokens_per_s, self.peak_flops)

    def steady_tokens_per_s(self) -> float | None:
        """Every step after the first (evals and saves included); None when this process ran fewer than two."""
        if not self.steady_steps:
            return None
        return self.steady_steps * self.tokens_per_step / (time.perf_counter() - self.steady_since)


def _peak_flops(mesh: Mesh) -> float | None:
    """The datasheet peak of the devices the run's mesh holds, together (`run_length.datasheet_peak_flops`; not
    every device the process sees: a one-device run on an 8-GPU host uses one), None where it is unknown."""
    peak = run_length.datasheet_peak_flops(mesh.devices.flat[0].device_kind)
    return None if peak is None else peak * mesh.devices.size


def _run_steps(run: _Run, start: Start, eval_initial: dict[str, float]) -> dict:
    """The steps from `start.step` to `train.steps`: train, log, evaluate, watch, sample, save; returns the summary.

    Raises Preempted, once the checkpoint of the step under way is saved, when a stop was requested.
    """
    cfg, corpus, logs = run.cfg, run.corpus, run.logs
    t, m = cfg.train, cfg.model
    state, last_eval, record = start.state, eval_initial, {}
    if start.step == t.steps:  # finished, but its summary was never written: summarize the final state again
        last_eval = run.evaluate_state(state)
        record = json.loads(start.kept[outputs.METRICS][-1]) if start.kept[outputs.METRICS] else {}
    monitor = Monitor(cfg.monitor)
    trace = run.trace or _Trace(Path(), 0, 0)  # (0, 0): never traces
    with _stop_requests() as stop, logs, contextlib.closing(trace):
        # No `realized_tokens` in a fresh start or a checkpoint older than the mixture log: rebuilt from the phases.
        realized = start.meta.get("realized_tokens") if start.meta else None
        mixture = MixtureLog(cfg, corpus.domains, start.step, realized,
                             [json.loads(x) for x in start.kept[outputs.MIXTURE_LOG]])
        if start.step == 0:
            run.hooks.stage("compiling the sampler")
            logs.samples(0, run.sample(state, 0))
        run.hooks.stage("compiling the train step")
        clock = _Throughput(accounting.tokens_per_step(cfg), time.perf_counter(), m, _peak_flops(run.mesh))
        for step in range(start.step, t.steps):
            logs.mixture(mixture.before_step(step))
            _, phase = phase_at(cfg.data, step, t.steps)
            batch = sample_batch(corpus, phase.weights, t.seed, step, t.batch_size, m.seq_len)
            ceiling = jnp.float32(monitor.loss_ceiling())
            trace.before(step)
            state, metrics = run.train_step(state, mesh_lib.place_batch(batch.tokens, run.mesh), ceiling)
            scalars = _jsonable(jax.device_get({k: v for k, v in metrics.items() if np.ndim(v) == 0}))
            done = step + 1
            trace.after(done)  # the metrics' device_get waited for the step: the trace holds all of it
            clock.step_done()
            snapshot = mixture.after_step(done, batch)
            if snapshot is None and done == t.steps:
                snapshot = mixture.snapshot(done)  # the end always gets one
            logs.mixture(snapshot)
            new_incidents = [i.to_json() for i in monitor.observe(done, scalars)]
            run.report(new_incidents)
            is_eval = done % t.eval_every == 0 or done == t.steps
            if done % t.log_every == 0 or is_eval or new_incidents:
                tokens_per_s = clock.window_tokens_per_s()
                record = {"step": done, **scalars, "tokens": done * clock.tokens_per_step,
                          "tokens_per_s": tokens_per_s, "phase": phase.name}
                if clock.peak_flops is not None:
                    record["mfu"] = clock.mfu(tokens_per_s)
                evaluated = _log(run, state, done, record, new_incidents, is_eval)
                last_eval = last_eval if evaluated is None else evaluated
                clock.new_window()
            # Every process stops after this step if any saw a signal: saving the checkpoint is a collective,
            # so a host that stopped alone would wait forever. The loop already waits for each step's
            # metrics, so the flags' all-gather adds no sync of its own.
            stopping = mesh_lib.on_any_process(stop["signal"] is not None)
            _checkpoint(run, state, done, eval_initial, mixture, stopping, snapshot is None)
            if run.hooks.on_step:
                run.hooks.on_step(done)
    run.checkpoints.close()
    return _summary(cfg, start, state, record, last_eval, eval_initial, clock, len(run.incidents))


def _evaluate(run: _Run, state: TrainState, done: int, record: dict) -> tuple[dict[str, float], list[dict]]:
    """An eval step: the held-out losses into `record`, each watcher's fields and incidents, the samples and
    the router load; returns the eval and the incidents the watchers opened."""
    last_eval = run.evaluate_state(state)
    record.update({f"eval/{d}": v for d, v in last_eval.items()})
    opened = []
    for watcher in run.watchers:
        fields, found = watcher.watch(done, last_eval["mean"])
        record.update(fields)
        found = [Incident(done, **incident).to_json() for incident in found]
        run.report(found)
        opened += found
    run.logs.samples(done, run.sample(state, done))
    run.logs.router_load(done, jax.device_get(state.router_load).tolist())
    if run.hooks.on_eval:
        run.hooks.on_eval(done, last_eval)
    return last_eval, opened


def _log(run: _Run, state: TrainState, done: int, record: dict, new_incidents: list[dict],
         is_eval: bool) -> dict[str, float] | None:
    """A logged step: `record` (and, at an eval, its held-out losses and the watchers' fields) to the metrics,
    with the incidents the step opened; returns the eval when there was one."""
    last_eval = None
    if is_eval:
        last_eval, opened = _evaluate(run, state, done, record)
        new_incidents = new_incidents + opened
    if new_incidents:
        record["incidents"] = new_incidents
    run.logs.log(record)
    if run.hooks.on_log:
        run.hooks.on_log(record)
    return last_eval


def _checkpoint(run: _Run, state: TrainState, done: int, eval_initial: dict, mixture: MixtureLog, stopping: bool,
                no_snapshot: bool) -> None:
    """Saves at the cadence, at the end and on a stop; a stop before the end then raises Preempted."""
    t, every = run.cfg.train, run.cfg.checkpoint.every
    if stopping or done == t.steps or (every and done % every == 0):
        path = run.checkpoints.save(done, state, {"seed": t.seed, "eval_initial": eval_initial,
                                                  "store_hash": store_hash(run.corpus),
                                                  "realized_tokens": mixture.counts})
        if stopping and done < t.steps:
            if no_snapshot:  # publish the realized mixture up to the stop
                run.logs.mixture(mixture.snapshot(done))
            run.checkpoints.close()
            raise Preempted(done, path)


def _summary(cfg: RunConfig, start: Start, state: TrainState, record: dict, last_eval: dict, eval_initial: dict,
             clock: _Throughput, new_incidents: int) -> dict:
    """summary.json: the run's final figures (`train`'s docstring lists them)."""
    tokens_per_s = clock.steady_tokens_per_s()  # read once: it moves with the clock
    return {
        "step": cfg.train.steps,
        "loss": record.get("loss"),
        "eval": last_eval,
        "eval_initial": eval_initial,
        "eval_mean": last_eval["mean"],
        "tokens": accounting.train_tokens(cfg),
        # Steady state: every step this process ran after its first (which compiles), evals and saves
        # included; None when it ran fewer than two.
        "tokens_per_s": tokens_per_s,
        "mfu": clock.mfu(tokens_per_s),  # of the devices' datasheet peak; None where unknown
        "compile_s": clock.compile_s,  # this process's first step (the train step's compile); None if it ran none
        "incidents": len(start.kept[outputs.INCIDENTS]) + new_incidents,
        "resumed_from": start.step or None,
        # What `moelab lab reproduce` compares a rerun with: bitwise-equal weights, and the platform that
        # made them (a rerun elsewhere is held to the run-to-run noise instead).
        "params_sha256": weights_sha256(state),
        "platform": run_platform(),
        "moe_drops": drops_by_purpose(cfg.model),
    }
