"""Rerun a recorded experiment at its commit and configs, and say whether it came out the same.

    with open_bundle("demo-ladder.tar.gz") as folder:
        result = reproduce(folder, "lab/ledger.sqlite", steps_fraction=0.1)   # `moelab lab reproduce`
    result.verdict   # "reproduced", "within noise" or "differs"

Every training step of the bundle (a ladder's rungs and its main run) trains again from its bundled
config.yaml into a temporary folder, for its first ceil(F * steps) steps (`steps_fraction` F; the same
schedule, stopped early, so those steps are the recorded run's own), then each logged step's metrics
are compared with the recorded ones:

- *reproduced*: every metric bitwise equal (and, for a whole run, the final weights' SHA-256,
  `train.state.weights_sha256`). Expected on the platform that recorded it (`summary.json`'s platform).
- *within noise*: not bitwise, but every loss (loss, ce, eval/*) within 1.96 * sqrt(2) * run_sd of the
  recorded one: the 95% range of the difference of two runs, with run_sd the run-to-run spread that
  the record states (a ladder fit's `noise.run_sd` in prediction.json, scaled to each run's size as
  the fit's `noise.size_exponent` says). Other metrics (norms, router
  statistics) have no stated noise and are not held to one. A record without a stated noise has no
  such verdict.
- *differs*: anything else, with the first diverging step and metric.

Which code runs: the commit the record names. If it is the repository's HEAD (the repository that
holds the current directory, as at recording) and no tracked file is modified, the steps run here, in
this process. Another commit of the repository is checked out in a temporary git worktree and run there
by a fresh environment (`python -m venv` + `pip install -e`: minutes), or by this environment's
packages with `same_env` (quick; right when the dependencies did not change). A commit the repository
does not have, a record made outside git, or uncommitted changes where the steps would run in place
are refused (ConfigError) before anything runs or is recorded.

The fit step of a ladder is not rerun: it is a function of the rungs' metrics, which are compared.
The reproduction goes on the ledger as one `run` record (event `reproduction`) that names the
original run record of each step; the experiment's report lists it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from moelab import presets
from moelab.accounting import count_params
from moelab.config import CheckpointConfig, RunConfig, dump_yaml, from_dict, to_dict
from moelab.data.store import store_hashes
from moelab.errors import ConfigError
from moelab.lab.experiment import Progress
from moelab.lab.ledger import Record, append, check_chain, open_ledger, records
from moelab.lab.registry import REPRODUCTION
from moelab.lab.verify import Bundle, load_bundle, verify_bundle
from moelab.ladder.fit import noise_scale
from moelab.ladder.contract import size_scale_of
from moelab.train.outputs import CONFIG, METRICS, SUMMARY, read_jsonl

__all__ = ["REPRODUCED", "WITHIN_NOISE", "DIFFERS", "NOISE_FACTOR", "StepComparison", "Reproduction",
           "compare_runs", "reproduce"]

REPRODUCED, WITHIN_NOISE, DIFFERS = "reproduced", "within noise", "differs"
_RANK = {REPRODUCED: 0, WITHIN_NOISE: 1, DIFFERS: 2}
NOISE_FACTOR = 1.96 * math.sqrt(2)  # 95% of the difference of two runs, each with the stated run_sd
# Not compared: wall-clock throughput, and what a watcher adds (the rerun trains without the prediction).
_UNCOMPARED = ("tokens_per_s", "on_track", "forecast/")
PLATFORM_FILE = "platform.json"  # what a rerun's driver writes: the platform it computed on


def _is_loss(metric: str) -> bool:
    return metric in ("loss", "ce") or metric.startswith("eval/")


def _metric_order(metric: str) -> tuple:
    """Which metric names a divergence: the losses first (what a reader checks), then the rest by name."""
    return (0 if metric == "loss" else 1 if metric == "ce" else 2 if metric == "eval/mean" else
            3 if _is_loss(metric) else 4, metric)


# ----------------------------------------------------------------------------------------------
# comparing


@dataclass(frozen=True)
class StepComparison:
    """One training step of the experiment, rerun and compared with its record."""

    name: str
    verdict: str
    until: int  # the steps rerun: 1..until of the run's `steps`
    steps: int
    per_step: list[tuple[int, str]]  # (logged step, verdict), in order
    first_difference: dict | None = None  # {step, metric, recorded, reproduced}: the first step with `verdict`
    params: str = "not compared"  # "equal", "differs", or "not compared" (a partial rerun, or no hash recorded)
    run_sd: float | None = None  # the run sd its losses were held to (the stated one at this run's size)

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "until": self.until, "steps": self.steps, "compared_steps": len(self.per_step),
                "first_difference": self.first_difference, "params": self.params, "run_sd": self.run_sd}


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step" and not k.startswith(_UNCOMPARED)}


def _compare_row(recorded: dict, reproduced: dict | None, tolerance: float | None) -> tuple[str, dict | None]:
    """(verdict, the metric that names it) for one logged step."""
    if reproduced is None:
        return DIFFERS, {"metric": "(no metrics record)", "recorded": None, "reproduced": None}
    want, got = _numbers(recorded), _numbers(reproduced)
    differing = sorted((k for k in want if got.get(k) != want[k]
                        and not (isinstance(got.get(k), float) and math.isnan(got[k]) and math.isnan(want[k]))),
                       key=_metric_order)
    if not differing:
        return REPRODUCED, None
    beyond = differing if tolerance is None else [
        k for k in differing if _is_loss(k) and not (k in got and abs(got[k] - want[k]) <= tolerance)]
    name = (beyond or differing)[0]
    return (DIFFERS if beyond else WITHIN_NOISE), {"metric": name, "recorded": want[name], "reproduced": got.get(name)}


def compare_runs(name: str, recorded: Path, reproduced: Path, until: int, steps: int,
                 run_sd: float | None) -> StepComparison:
    """Compare a rerun (folder `reproduced`) with its record (folder `recorded`) over steps 1..until."""
    tolerance = None if run_sd is None else NOISE_FACTOR * run_sd
    rows = {r["step"]: r for r in read_jsonl(reproduced / METRICS)}
    per_step, differences = [], {}
    for row in read_jsonl(recorded / METRICS):
        if row["step"] > until:
            break
        verdict, difference = _compare_row(row, rows.get(row["step"]), tolerance)
        per_step.append((row["step"], verdict))
        if difference is not None:
            differences.setdefault(verdict, {"step": row["step"], **difference})
    params = "not compared"
    if until == steps:
        want = json.loads((recorded / SUMMARY).read_text()).get("params_sha256") if (recorded / SUMMARY).is_file() \
            else None
        got = json.loads((reproduced / SUMMARY).read_text()).get("params_sha256") \
            if (reproduced / SUMMARY).is_file() else None
        if want and got:
            params = "equal" if want == got else "differs"
    verdict = max((v for _, v in per_step), key=_RANK.get, default=REPRODUCED)
    first = differences.get(verdict)  # the first step of the run's verdict: where it diverged, or left bitwise
    if params == "differs" and verdict == REPRODUCED:  # every logged number equal, the weights not
        verdict, first = DIFFERS, {"step": steps, "metric": "params_sha256", "recorded": want, "reproduced": got}
    return StepComparison(name, verdict, until, steps, per_step, first, params, run_sd)


# ----------------------------------------------------------------------------------------------
# which code runs


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def _commit_of(bundle: Bundle, names: list[str]) -> str:
    commits = {bundle.info["steps"][n].get("git_commit") for n in names}
    if None in commits:
        raise ConfigError(f"experiment {bundle.experiment.id!r} was run outside a git repository (its run records "
                          "name no commit), so the code that ran is unknown and cannot be checked out again. "
                          "Nothing was run or recorded.")
    if len(commits) > 1:
        listed = ", ".join(f"{n} at {bundle.info['steps'][n]['git_commit'][:12]}" for n in names)
        raise ConfigError(f"the steps of {bundle.experiment.id!r} ran at different commits ({listed}); reproduce "
                          "reruns one commit. Nothing was run or recorded.")
    return commits.pop()


def locate_code(repo: Path, commit: str) -> str:
    """"here" when `commit` is the clean HEAD of the repository holding `repo`, "worktree" when it is another
    commit of it; ConfigError (nothing run) when it is not a repository, lacks the commit, or is dirty at it."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise ConfigError(f"{repo} is not inside a git repository, so commit {commit[:12]} (where the experiment "
                          "ran) cannot be checked out. Run `moelab lab reproduce` from a clone of the repository "
                          "that recorded it. Nothing was run or recorded.")
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ConfigError(f"commit {commit} (where the experiment ran) is not in the repository at "
                          f"{top.stdout.strip()}: fetch it (`git fetch origin {commit}`, or clone the repository "
                          "that has it) and run `moelab lab reproduce` again. Nothing was run or recorded.")
    if _git(repo, "rev-parse", "HEAD").stdout.strip() != commit:
        return "worktree"
    changed = _git(repo, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    if changed:
        files = ", ".join(line[3:] for line in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5
                                                               else "")
        raise ConfigError(f"the working tree at {top.stdout.strip()} has uncommitted changes to tracked files "
                          f"({files}), so running here would not run commit {commit[:12]} as recorded. Commit or "
                          "stash them (`git stash`), then run `moelab lab reproduce` again. Nothing was run or "
                          "recorded.")
    return "here"


# ----------------------------------------------------------------------------------------------
# rerunning


class _StopHere(Exception):
    """Raised by the rerun's step hook after the last step to reproduce."""


def _rerun_here(cfg: RunConfig, out: Path, until: int, progress: Progress | None) -> None:
    """Train `cfg` into `out` in this process, stopping after step `until` (the same schedule as the whole run)."""
    from moelab.train.loop import Hooks, run_platform, train

    def stop(done: int) -> None:
        if shown.on_step:
            shown.on_step(done)
        if done >= until < cfg.train.steps:
            raise _StopHere

    with progress(cfg) if progress is not None else contextlib.nullcontext() as hooks:
        shown = hooks or Hooks()
        try:
            train(cfg, out, dataclasses.replace(shown, on_step=stop))
        except _StopHere:
            pass
    (out / PLATFORM_FILE).write_text(json.dumps(run_platform()))


# The same as `_rerun_here`, for another commit's code: only its `train(cfg, out, Hooks(on_step=...))`.
_DRIVER = """
import json, platform, sys
import jax
from moelab.config import load_yaml
from moelab.train.loop import Hooks, train

class StopHere(Exception):
    pass

config, out, until = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = load_yaml(config)
def stop(done):
    if done >= until < cfg.train.steps:
        raise StopHere
try:
    train(cfg, out, Hooks(on_step=stop))
except StopHere:
    pass
with open(out + "/platform.json", "w") as f:
    json.dump({"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
               "device_kind": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
               "machine": platform.machine(), "system": platform.system()}, f)
"""


def _worktree_python(repo: Path, commit: str, tmp: Path, same_env: bool) -> tuple[Path, dict]:
    """Check `commit` out into tmp/src and give the interpreter (and environment) that runs its code."""
    src = tmp / "src"
    done = _git(repo, "worktree", "add", "--detach", str(src), commit)
    if done.returncode != 0:
        raise ConfigError(f"git could not check out commit {commit[:12]} into a worktree ({done.stderr.strip()}). "
                          "Nothing was recorded.")
    if not (src / "src" / "moelab").is_dir():
        raise ConfigError(f"commit {commit[:12]} has no src/moelab: it is not a moelab checkout, so it cannot "
                          "train. Nothing was recorded.")
    env = dict(os.environ)
    if same_env:  # the worktree's package shadows the installed one
        env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), *filter(None, [env.get("PYTHONPATH")])])
        return Path(sys.executable), env
    venv.create(tmp / "venv", with_pip=True)
    python = tmp / "venv" / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(src)], capture_output=True,
                               text=True)
    if installed.returncode != 0:
        raise ConfigError(f"installing commit {commit[:12]}'s environment failed (pip: "
                          f"{installed.stderr.strip().splitlines()[-1] if installed.stderr.strip() else 'no output'}). "
                          "Pass --same-env to run its code with this environment's packages, or install it yourself "
                          "in a checkout of that commit and run reproduce there. Nothing was recorded.")
    return python, env


def _rerun_elsewhere(python: Path, env: dict, cfg: RunConfig, out: Path, until: int, where: Path) -> None:
    out.mkdir(parents=True)
    config = out.parent / f"{out.name}.yaml"
    config.write_text(dump_yaml(cfg))
    done = subprocess.run([str(python), "-c", _DRIVER, str(config), str(out), str(until)], cwd=where, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the rerun of {out.name} at the recorded commit failed:\n{tail}")


# ----------------------------------------------------------------------------------------------
# the whole reproduction


@dataclass(frozen=True)
class Reproduction:
    experiment: str
    verdict: str  # the worst of the steps'
    steps: list[StepComparison]
    commit: str
    where: str  # "here" or "worktree"
    same_platform: bool | None  # None: the record states no platform (a run older than the field)
    run_sd: float | None  # the run-to-run spread the record states (at its noise.ref_params); None: none stated
    record: Record  # the ledger record of this reproduction
    notes: list[str]


def _training_steps(bundle: Bundle) -> list[str]:
    names = []
    for name in bundle.steps():
        step = json.loads((bundle.step_dir(name) / "step.json").read_text())
        if "run" in step.get("versioned", {}):
            names.append(name)
    return names


def _stated_noise(bundle: Bundle) -> dict | None:
    """The run-to-run noise the record states: a ladder fit's `noise` (prediction.json), if any step has one."""
    for name in ("fit", *bundle.steps()):
        path = bundle.folder / "steps" / name / "prediction.json"
        if name in bundle.info["steps"] and path.is_file():
            noise = json.loads(path.read_text()).get("noise", {})
            if isinstance(noise.get("run_sd"), (int, float)) and math.isfinite(noise["run_sd"]):
                return noise
    return None


def _run_sd_at(noise: dict | None, cfg: RunConfig) -> float | None:
    """The stated run sd for a run of `cfg`'s size: a weighted fit states it at noise.ref_params and
    how it scales with size (`ladder.fit.noise_scale`); an older sidecar has no scale."""
    if noise is None:
        return None
    try:
        exponent, ref = size_scale_of(noise)
    except ValueError:
        raise ConfigError(f"the record's ladder fit states noise size_exponent={noise.get('size_exponent')!r}, "
                          f"ref_params={noise.get('ref_params')!r}: not a scale `moelab ladder fit` writes; the "
                          "bundle's prediction.json is damaged.") from None
    return float(noise["run_sd"]) * noise_scale(count_params(cfg.model).active, exponent, ref)


def _config(bundle: Bundle, name: str, overrides: dict[str, Any]) -> RunConfig:
    cfg = from_dict(yaml.safe_load((bundle.step_dir(name) / CONFIG).read_text()))
    if overrides:
        cfg = presets.resolve(to_dict(cfg), overrides)
    # No intermediate checkpoints (where and how often to save changes no number): a partial rerun saves none.
    return dataclasses.replace(cfg, checkpoint=CheckpointConfig(every=None, keep_last=1))


def _check_stores(bundle: Bundle, name: str, cfg: RunConfig) -> None:
    """Refuse to rerun a step on other tokens: each token store its config reads must hold the content the
    record trained on (the step's versioned store hashes). DataError when a store is gone."""
    step = json.loads((bundle.step_dir(name) / "step.json").read_text())
    recorded = step.get("versioned", {}).get("store_hashes") or {}
    now = store_hashes(cfg.data)
    changed = sorted(d for d in set(recorded) | set(now) if recorded.get(d) != now.get(d))
    if changed:
        d, in_memory = changed[0], "none (built in memory)"
        raise ConfigError(f"step {name} trained domain {d} on token store content {recorded.get(d) or in_memory}, but "
                          f"its config now reads {now.get(d) or in_memory}: the rerun would see other tokens. Put the "
                          "recorded store back where the config's data.store points (its manifest is in the bundle, "
                          f"steps/{name}/store-*-manifest.json). Nothing was run or recorded.")


def _check_ledger(ledger_path: Path, bundle: Bundle):
    """The ledger the reproduction goes on, checked before anything runs: intact, and not holding another
    experiment under the bundle's id."""
    book = open_ledger(ledger_path, create=True)
    check_chain(book)
    registered = records(book, kind="experiment", key=bundle.experiment.id)
    if registered and registered[0].hash != bundle.experiment.registration.hash:
        raise ConfigError(f"the ledger {ledger_path} holds another experiment named {bundle.experiment.id!r} "
                          f"(record {registered[0].seq}, not the bundle's registration), so a reproduction there "
                          "would point at the wrong one. Pass --ledger with another ledger. Nothing was run.")
    return book


def _span(per_step: list[tuple[int, str]]) -> Iterator[tuple[int, int, str]]:
    """Consecutive logged steps with one verdict, as (first, last, verdict)."""
    start = 0
    for i in range(1, len(per_step) + 1):
        if i == len(per_step) or per_step[i][1] != per_step[start][1]:
            yield per_step[start][0], per_step[i - 1][0], per_step[start][1]
            start = i


def reproduce(folder: str | Path, ledger_path: str | Path, steps_fraction: float = 1.0,
              overrides: dict[str, Any] | None = None, repo: str | Path | None = None, same_env: bool = False,
              progress: Progress | None = None) -> Reproduction:
    """Rerun the bundle's training steps and compare; record the result on `ledger_path`.

    `repo` (default: the current directory) is where the repository is looked up, as `lab run` records it;
    `overrides` ({dotted.field: value}) changes every rerun's config: a what-if whose verdict says how far
    the record holds under it. Refused (ConfigError, nothing run or recorded) when the bundle fails
    verification, the fraction is not in (0, 1], the code cannot be located, or the ledger is not usable.
    """
    if not (isinstance(steps_fraction, (int, float)) and 0 < steps_fraction <= 1):
        raise ConfigError(f"--steps-fraction={steps_fraction!r} must be in (0, 1], e.g. 0.1 for the first 10% of "
                          "each run's steps.")
    folder, repo = Path(folder), Path(repo if repo is not None else Path.cwd())
    check = verify_bundle(folder)
    if not check.ok:
        raise ConfigError(f"the bundle {folder} fails verification, so it cannot be reproduced: "
                          f"{'; '.join(check.problems[:3])}{' ...' if len(check.problems) > 3 else ''}. "
                          f"`moelab lab verify {folder}` lists every problem. Nothing was run or recorded.")
    bundle = load_bundle(folder)
    overrides = dict(overrides or {})
    names = _training_steps(bundle)
    configs = {n: _config(bundle, n, overrides) for n in names}  # a bad --set fails here, before any run
    until = {n: math.ceil(steps_fraction * cfg.train.steps) for n, cfg in configs.items()}
    for n in names:
        logged = [r["step"] for r in read_jsonl(bundle.step_dir(n) / METRICS)]
        if not any(s <= until[n] for s in logged):
            raise ConfigError(f"--steps-fraction {steps_fraction:g} reruns {until[n]} step(s) of {n}, which logged "
                              f"no metrics before step {logged[0] if logged else '?'}: nothing to compare. Raise "
                              f"it to at least {(logged[0] if logged else 1) / configs[n].train.steps:.3g}.")
    for n in names:
        _check_stores(bundle, n, configs[n])
    commit = _commit_of(bundle, names)
    where = locate_code(repo, commit)
    book = _check_ledger(Path(ledger_path), bundle)
    noise = _stated_noise(bundle)
    run_sd = None if noise is None else float(noise["run_sd"])
    notes = []
    if any(bundle.info["steps"][n].get("git_dirty") for n in names):
        notes.append(f"the record says the tree had uncommitted changes when it ran: commit {commit[:12]} alone "
                     "may not be the code that ran")
    with tempfile.TemporaryDirectory(prefix="moelab-reproduce-") as tmp:
        tmp = Path(tmp)
        try:
            if where == "worktree":
                python, env = _worktree_python(repo, commit, tmp, same_env)
            for n in names:
                out = tmp / "runs" / n
                if where == "here":
                    _rerun_here(configs[n], out, until[n], progress)
                else:
                    _rerun_elsewhere(python, env, configs[n], out, until[n], tmp / "src")
            comparisons = [compare_runs(n, bundle.step_dir(n), tmp / "runs" / n, until[n], configs[n].train.steps,
                                        _run_sd_at(noise, configs[n])) for n in names]
            recorded_platforms = [_read_json(bundle.step_dir(n) / SUMMARY).get("platform") for n in names]
            platform = _read_json(tmp / "runs" / names[0] / PLATFORM_FILE)
        finally:
            if where == "worktree":
                _git(repo, "worktree", "remove", "--force", str(tmp / "src"))
    same_platform = None if None in recorded_platforms else all(p == platform for p in recorded_platforms)
    verdict = max((c.verdict for c in comparisons), key=_RANK.get)
    body = {"event": REPRODUCTION, "verdict": verdict, "steps_fraction": steps_fraction, "overrides": overrides,
            "git_commit": commit, "ran": "worktree, this environment" if where == "worktree" and same_env else where,
            "platform": platform, "same_platform": same_platform, "run_sd": run_sd,
            "bundle": {"manifest_sha256": check.manifest_sha256, "ledger_head": check.head_hash},
            "steps": {c.name: {**c.to_json(), "original": bundle.info["steps"][c.name]["record"]}
                      for c in comparisons}}
    record = append(book, "run", bundle.experiment.id, body)
    return Reproduction(bundle.experiment.id, verdict, comparisons, commit, where, same_platform, run_sd, record,
                        notes)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def spans(comparison: StepComparison) -> str:
    """The per-step verdicts in one line: "1-30 reproduced; 40 differs"."""
    return "; ".join(f"{a}{'' if a == b else f'-{b}'} {v}" for a, b, v in _span(comparison.per_step))
