"""A registered experiment as a DAG of steps (`lab.dag`), run with every step's events on its ledger.

    plan_experiment(ledger, "demo-ladder", "runs/lab")   # what would run, resume, wait or skip
    run_experiment(ledger, "demo-ladder", "runs/lab", progress=training_progress)

A spec with `config:` is one training step, "train". A spec with `ladder:` is the ladder of
`ladder.run` as steps: one training step per rung ("rung-<name>"), "fit" (the curve law on every
rung's evals and the target's predicted band), then the main run "train", watched against that
band. Every field of a run's config is versioned, so a changed recipe re-runs exactly the rungs
that changed and everything after them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Mapping

from moelab.config import RunConfig, from_dict, load_yaml, to_dict
from moelab.data.store import store_hashes
from moelab.lab.dag import PlannedStep, Step, StepContext, StepOutcome, execute, plan, versioned
from moelab.lab.ledger import Ledger, append, check_chain, export_jsonl, open_ledger
from moelab.lab.registry import Spec, check_unchanged, git_state, load_experiment, resolve_run_config
from moelab.ladder.rungs import recipe_from_data
from moelab.train.outputs import CONFIG, Sink

if TYPE_CHECKING:
    from moelab.train.loop import Hooks

__all__ = ["Progress", "LEDGER_EXPORT", "publisher", "run_training", "training_step", "fit_ladder", "ladder_steps", "experiment_steps",
           "plan_experiment", "run_experiment"]

Progress = Callable[[RunConfig], ContextManager["Hooks | None"]]
"""How a training step shows its progress: a context manager per run that yields the loop's Hooks."""


def _on_eval_sink(on_eval: Callable[[], None], base: type) -> Sink:
    """A sink with `base`'s no-ops (tracking.NullSink, passed in: JAX loads only when a step trains) whose `log`
    calls `on_eval()` after each metrics record that holds an eval."""

    class OnEval(base):
        def log(self, record: dict) -> None:
            if any(k.startswith("eval/") for k in record):
                on_eval()

    return OnEval()


def run_training(ctx: StepContext, progress: Progress | None = None,
                 on_eval: Callable[[], None] | None = None) -> dict:
    """Step function: train the RunConfig in `ctx.config` into the step's directory; returns the summary.
    `on_eval` is called after each eval has reached the sinks (a local step only: it is no JSON config)."""
    from moelab.lab import tracking  # JAX loads only when a training step runs
    from moelab.train.loop import Watcher, train

    cfg = from_dict({**ctx.config["run"], "name": ctx.config["name"]})
    sinks: list[Sink] = []
    if ctx.config.get("ledger"):  # a registered experiment's run: metrics, mixture, samples on its ledger
        sinks.append(tracking.LedgerSink(ctx.config["ledger"], ctx.config["experiment"], cfg.name))
        if tracking.wandb_available():
            sinks.append(tracking.WandbSink(ctx.output_dir, to_dict(cfg), cfg.name, group=ctx.config["experiment"]))
    if on_eval is not None:  # after the ledger sink appended the eval: sinks run in order
        sinks.append(_on_eval_sink(on_eval, tracking.NullSink))
    if ctx.config.get("publish"):  # the run's files and the ledger's export, to a bucket on a cadence
        sinks.append(publisher(ctx.config["ledger"], ctx.output_dir, ctx.config["publish"],
                               ctx.config["publish_every"]))
    watchers: list[Watcher] = []
    if ctx.config.get("predicted_by"):  # watched against a fit step's prediction, kept beside the run
        from moelab.ladder.contract import PREDICTION, keep_copy
        from moelab.ladder.on_track import load_on_track

        # The fit's prediction and sidecar (its noise, for the forecast, and its self-check), kept in the run.
        watchers.append(load_on_track(keep_copy(ctx.deps[ctx.config["predicted_by"]] / PREDICTION, ctx.output_dir)))
    with progress(cfg) if progress is not None else contextlib.nullcontext() as hooks:
        return train(cfg, ctx.output_dir, hooks, sinks=sinks, watchers=watchers)


LEDGER_EXPORT = "ledger.jsonl"


def publisher(ledger_path: str | Path, out: Path, destination: str, every_s: float) -> Sink:
    """A Publisher of a lab run's files plus the ledger exported beside them (refreshed before each upload)."""
    from moelab.train.publish import Publisher

    export = out / LEDGER_EXPORT
    return Publisher(out, destination, every_s, extra=[export],
                     before=lambda: export_jsonl(open_ledger(ledger_path), export))


def training_step(name: str, cfg: RunConfig, deps: tuple[str, ...] = (),
                  resources: Mapping[str, float] | None = None, predicted_by: str | None = None) -> Step:
    """A step that trains `cfg`. Every field but the run's name is versioned: each one can change the outputs,
    and so is the content hash of each token store the data reads (`data.store`), which the path alone is not.

    With `predicted_by` (the name of a `fit_ladder` step among `deps`), each eval is checked against
    that step's predicted band. The step is `resumable`: on Ray, a retry after a lost worker continues
    from the newest checkpoint in its directory.
    """
    run = to_dict(cfg)
    run_name = run.pop("name")
    config = {"run": versioned(run), "name": run_name, "predicted_by": predicted_by}
    hashes = store_hashes(cfg.data)
    if hashes:  # the tokens themselves: a store prepared again from changed sources is a new version
        config["store_hashes"] = versioned(hashes)
    return Step(name, run_training, config, deps, dict(resources or {}), resumable=True)


def fit_ladder(ctx: StepContext) -> dict:
    """Step function: fit the curve law on the rung steps' evals and predict the target (`ladder.run`)."""
    from moelab.ladder.run import fit_and_predict

    rungs = [(load_yaml(ctx.deps[name] / CONFIG), ctx.deps[name]) for name in ctx.config["rungs"]]
    target = from_dict(ctx.config["target"])
    return fit_and_predict(rungs, target, ctx.output_dir, num_bootstrap=ctx.config["bootstrap"])


def ladder_steps(spec: Spec) -> list[Step]:
    """rungs -> fit -> the main run ("train"), watched against the fit's predicted band."""
    # SciPy (the fit) loads for a ladder spec only, not with every `moelab lab` command.
    from moelab.ladder import NUM_BOOTSTRAP
    from moelab.ladder.run import plan_ladder

    rung_configs, target = plan_ladder(recipe_from_data(spec.ladder, f"experiment {spec.id}: ladder"))
    rungs = [training_step(f"rung-{cfg.name}", cfg, resources=spec.resources) for cfg in rung_configs]
    names = tuple(step.name for step in rungs)
    fit = Step("fit", fit_ladder, {"rungs": list(names), "target": versioned(to_dict(target)),
                                   "bootstrap": versioned(NUM_BOOTSTRAP)}, names)
    main = training_step("train", target, ("fit",), spec.resources, predicted_by="fit")
    return [*rungs, fit, main]


def experiment_steps(spec: Spec) -> list[Step]:
    """The DAG of a registered spec: `config:` is one training step; `ladder:` is rungs -> fit -> main run."""
    if spec.ladder is not None:
        return ladder_steps(spec)
    return [training_step("train", resolve_run_config(spec), resources=spec.resources)]


def _experiment_dag(ledger: Ledger, exp_id: str, spec_path: str | Path | None):
    experiment = load_experiment(ledger, exp_id)
    check_unchanged(experiment, spec_path if spec_path is not None else experiment.source)
    return experiment, experiment_steps(experiment.spec)


def plan_experiment(ledger: Ledger, exp_id: str, root: str | Path,
                    spec_path: str | Path | None = None) -> list[PlannedStep]:
    """`plan` for a registered experiment, after the same checks as `run_experiment`."""
    _, steps = _experiment_dag(ledger, exp_id, spec_path)
    return plan(steps, Path(root) / exp_id)


def _record_run_event(ledger: Ledger, exp_id: str, provenance: dict, event: dict) -> None:
    append(ledger, "run", exp_id, {**event, **provenance})


def _record_then(record: Callable[[dict], None], then: Callable[[], None], event: dict) -> None:
    record(event)
    then()


def run_experiment(ledger: Ledger, exp_id: str, root: str | Path, spec_path: str | Path | None = None,
                   backend: str = "local", progress: Progress | None = None,
                   publish: tuple[str, float] | None = None, address: str | None = None,
                   on_change: Callable[[], None] | None = None) -> list[StepOutcome]:
    """Execute a registered experiment's DAG under ROOT/<id>, each step's events on the ledger.

    On the local backend each training step runs under `progress(cfg)` (e.g. the CLI's progress
    bar); Ray workers train quietly. Refused (ConfigError) when the spec file (`spec_path`, by
    default the one it was registered or last amended from) differs from the version in force: amend
    it first. Refused (ChainBroken) when the ledger's chain does not check out, before any step
    starts: its events would go on a broken chain. `address` joins a Ray cluster (`lab.dag.execute`).
    `on_change()` (e.g. a lab site's rebuild) is called after each step event is on the ledger and, for steps
    that train in this process (the local backend), after each eval.
    """
    check_chain(ledger)
    experiment, steps = _experiment_dag(ledger, exp_id, spec_path)
    # Neither is part of a version: where a training step publishes its metrics and how it shows its
    # progress change no output directory. A progress bar lives in this process: Ray gets none.
    tracked = {"ledger": str(Path(ledger.path).absolute()), "experiment": exp_id}
    if publish is not None:  # (URL, seconds): where and how often training steps publish their files
        tracked |= {"publish": publish[0], "publish_every": publish[1]}
    train = run_training
    if backend == "local" and (progress is not None or on_change is not None):
        train = functools.partial(run_training, progress=progress, on_eval=on_change)
    steps = [dataclasses.replace(s, fn=train, config={**s.config, **tracked}) if s.fn is run_training else s
             for s in steps]
    commit, dirty = git_state(Path.cwd())
    provenance = {"spec_hash": experiment.spec_hash, "git_commit": commit, "git_dirty": dirty, "backend": backend}
    on_event = functools.partial(_record_run_event, ledger, exp_id, provenance)
    if on_change is not None:
        on_event = functools.partial(_record_then, on_event, on_change)
    return execute(steps, Path(root) / exp_id, backend=backend, on_event=on_event, address=address)
