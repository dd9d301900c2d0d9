"""`moelab ladder`: plan rungs, run them, fit the curve law, compare recipes.

    moelab ladder plan --preset frontier-535b               # reproduces the ladder-d* presets
    moelab ladder run experiments/ladder-cpu.yaml --out runs/ladder
    moelab ladder fit --curves CURVES.csv --target TARGET.csv --out PRED.csv --json
    moelab ladder compare runs/ladder-baseline runs/ladder-candidate
    moelab ladder task TASK_POINTS.csv --target-compute 2.4e15 --json   # the target's task accuracy
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from moelab.cli.common import JsonOpt, PresetOpt, err_console, out_console, print_problem
from moelab.cli.train import run_training
from moelab.errors import ConfigError
from moelab.ladder import DEFAULT_BAND, DEFAULT_LAW, NUM_BOOTSTRAP

ladder_app = typer.Typer(no_args_is_help=True, add_completion=False,
                         help="Scaling ladder: rungs of one recipe, a fitted law, predictions of the target.")

RecipeArg = Annotated[Optional[Path], typer.Argument(help="A ladder recipe YAML (see experiments/ladder-cpu.yaml).",
                                                     show_default=False)]


def _recipe(recipe: Path | None, preset: str | None):
    from moelab.ladder.rungs import load_recipe, preset_recipe

    if (recipe is None) == (preset is None):
        raise ConfigError("give exactly one of RECIPE.yaml or --preset NAME, e.g. `moelab ladder plan --preset "
                          "frontier-535b`.")
    return load_recipe(recipe) if recipe is not None else preset_recipe(preset)


@ladder_app.command()
def plan(
    recipe: RecipeArg = None,
    preset: PresetOpt = None,
    fix: Annotated[bool, typer.Option(
        "--fix", help="Write the recipe with its warnings resolved to --out (each change printed with its reason), "
                      "then plan the fixed recipe.")] = False,
    out: Annotated[Optional[Path], typer.Option(help="With --fix: the fixed recipe YAML to write.")] = None,
    runs: Annotated[Optional[Path], typer.Option(
        help="With --fix: a `ladder run --out` folder of this recipe; its fitted noise sizes the seeds per rung "
             "for a +-3% band.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The rungs of a recipe and its target: shape, parameters, tokens, steps, FLOPs; --fix resolves its warnings."""
    from moelab.ladder.rungs import check_monotone, lr_rule_text, plan_rows, rungs_of

    if (out is not None or runs is not None) and not fix:
        raise ConfigError("--out and --runs go with --fix: `moelab ladder plan RECIPE --fix --out FIXED.yaml`.")
    if fix and (recipe is None or out is None):
        raise ConfigError("--fix rewrites a recipe file: give RECIPE.yaml and --out FIXED.yaml "
                          "(e.g. `moelab ladder plan experiments/ladder-cpu.yaml --fix --out runs/fixed.yaml`).")
    r = _recipe(recipe, preset)
    if fix:
        r = _fix(recipe, r, out, runs, quiet=json_out)
    configs = rungs_of(r)
    check_monotone(configs)
    rows = plan_rows(configs + [r.target])
    if json_out:
        print(json.dumps(rows))
        return
    table = Table("name", "d", "layers", "active", "total", "tokens", "steps", "LR", "FLOPs", title="ladder plan")
    for row in rows:
        table.add_row(row["name"], str(row["d_model"]), str(row["num_layers"]), f"{row['active_params']:.4g}",
                      f"{row['total_params']:.4g}", f"{row['tokens']:.4g}", f"{row['steps']:,}", f"{row['lr']:.3g}",
                      f"{row['train_flops']:.3g}")
    out_console.print(table)
    out_console.print(lr_rule_text(r))
    # a preset's data is the frontier's (not on this machine); a recipe's is read
    _warn_recipe(configs, r.target, read_data=preset is None)
    if preset is not None:
        out_console.print(f"These are {escape(preset)}'s published rung shapes, kept as published so the ladder is the "
                          "one its run planned: any warning above is what they cost the fit, not a mistake to fix "
                          "here (a recipe file of your own can follow it).", highlight=False)


def _fix(path: Path, recipe, out: Path, runs: Path | None, quiet: bool):
    """`plan --fix`: write the fixed recipe (`ladder.fix.write_fixed_recipe`), print the changes; returns it."""
    from moelab.ladder.fix import write_fixed_recipe

    fixed, changes = write_fixed_recipe(path, recipe, out, runs)
    if not quiet:
        kept = [c for c in changes if c.before == c.after]  # what a rule could not fix: said, left as it is
        for c in changes:
            what = "kept as it is" if c in kept else f"{escape(str(c.before))} -> {escape(str(c.after))}"
            out_console.print(f"[bold]{escape(c.field)}[/]: {what}\n  {escape(c.why)}.")
        out_console.print(f"Wrote {out} ({len(changes) - len(kept)} change(s), {len(kept)} warning(s) not fixed); "
                          "its plan:" if changes else f"Nothing to fix; wrote {out} unchanged. Its plan:")
    return fixed


def _warn_recipe(rungs, target, read_data: bool = True) -> None:
    """Print the recipe's warnings (`rungs.recipe_warnings`); `read_data` also reads its data."""
    from moelab.ladder.rungs import recipe_warnings

    for warning in recipe_warnings(rungs, target, read_data):
        print_problem("Warning", warning, "yellow")


@ladder_app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="A ladder recipe YAML.", show_default=False)],
    out: Annotated[Path, typer.Option(help="Output directory (rungs, curves, prediction).")] = Path("runs/ladder"),
    task: Annotated[bool, typer.Option("--task", help="Also predict the target's final accuracy on the arithmetic "
                                       "task: each rung keeps a checkpoint per quarter of its steps, each is scored "
                                       "(task_points.csv), and the prediction goes to task_prediction.json.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Also print the fitted law, its noise and its prior.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train the rungs (resumable), fit the curve law, and predict the target with bands."""
    from moelab.ladder.contract import PREDICTION, sidecar_path
    from moelab.ladder.run import TASK_PREDICTION, plan_ladder, run_ladder

    ladder = _recipe(recipe, None)
    rungs, target = plan_ladder(ladder)
    _warn_recipe(rungs, target)
    summary = run_ladder(ladder, out, run_training, progress=_bootstrap_bar, task=task)
    if json_out:
        print(json.dumps(summary))
        return
    _print_fit(summary, verbose)
    if task:
        _print_task(summary["task"], out / TASK_PREDICTION)
    pred = out / PREDICTION
    out_console.print(f"Prediction for the target in {pred}; fit summary in {sidecar_path(pred)}.")
    out_console.print(f"Train the target against it: moelab train {out / 'target.yaml'} --predicted "
                      f"{pred} --out {out / 'target'}")


@ladder_app.command()
def fit(
    curves: Annotated[Path, typer.Option(help="CURVES.csv with the columns run, params, step, tokens, lr, loss.")],
    target: Annotated[Path, typer.Option(
        help="TARGET.csv with the columns run, params, step, tokens, lr: the planned schedule.")],
    out: Annotated[Path, typer.Option(
        help="PRED.csv to write: the target's rows plus loss_pred, lo80, hi80, lo95, hi95.")],
    bootstrap: Annotated[int, typer.Option(help="Bootstrap refits (two-level residual resamples) for the bands.")] = NUM_BOOTSTRAP,
    same_data_order: Annotated[bool, typer.Option(
        help="Curves of one size whose runs and the target share one seed and data order (a schedule sweep): "
             "the target also borrows the noise the curves share at each of its steps.")] = False,
    exclude: Annotated[Optional[list[str]], typer.Option(
        help="A run of CURVES.csv to leave out of the fit (repeatable), recorded in the sidecar's `excluded`.")] = None,
    law: Annotated[str, typer.Option(
        help="The curve law: tissue (an EMA of the LR drop), multipower (Luo et al. 2025's multi-power drop), or "
             "tissue with the peak LR and batch let in where the rungs identify them: tissue-lr (S1 scaled by the "
             "peak LR^rho), convex (S1 and the anneal gain, Schaipp et al. 2025), timescale (peak LR / batch), "
             "noise-temperature (the noise an anneal removes, scaled by peak LR / batch); tissue-free-alpha (no "
             "prior on alpha from 4 sizes on). See docs/scaling-ladder.md, \"The peak LR and the batch\".")] = DEFAULT_LAW,
    band: Annotated[str, typer.Option(
        help="bootstrap (run and checkpoint noise, the fit's uncertainty) or calibrated (also the law's misfit on "
             "runs it did not see: leave a size, horizon or schedule out).")] = DEFAULT_BAND,
    verbose: Annotated[bool, typer.Option("--verbose", help="Also print the fitted law, its noise and its prior.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Fit the schedule-aware curve law on external curves and predict a target's curve with bands.

    CURVES.csv: run, params, step, tokens, lr, loss (one row per eval of each run; params: active non-embedding
    parameters). TARGET.csv: run, params, step, tokens, lr.
    """
    from moelab.ladder.predict import fit_curves

    summary = fit_curves(curves, target, out, num_bootstrap=bootstrap, same_data_order=same_data_order,
                         exclude={name: "--exclude" for name in exclude or []}, progress=_bootstrap_bar,
                         law=law, band=band)
    if json_out:
        print(json.dumps(summary))
        return
    _print_fit(summary, verbose)
    out_console.print(f"Wrote {out} and its sidecar {out.with_suffix('.json')}.")


def _bootstrap_bar(refits):
    """The bootstrap's refits with a progress bar on stderr (it is most of a fit's time)."""
    from rich.progress import track

    return track(refits, description="bootstrap refits", console=err_console, transient=True)


def human_count(n: float) -> str:
    """14162304 -> '14M', 1.2e9 -> '1.2B': a parameter or token count as people say it."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def _print_fit(summary: dict, verbose: bool = False) -> None:
    """The prediction first, in plain words: each target's final loss and band, then whether the self-check
    says to trust it and the notes; the fit's internals (law, noise, prior, calibration) after, with `verbose`."""
    for t in summary["targets"]:
        out_console.print(f"[bold]Prediction[/] for {escape(t['run'])} ({human_count(t['params'])} params, "
                          f"{human_count(t['final_tokens'])} tokens): final loss {t['loss_pred']:.4f}, 95% band "
                          f"{t['lo95']:.4f} to {t['hi95']:.4f} (+-{t['band95_half_width']:.1%}).")
    check = summary["self_check"]
    if "skipped" in check:
        out_console.print(f"Self-check skipped, so nothing says whether to trust it: {check['skipped']}")
    else:
        held = escape(", ".join(check["held_out"]))
        plain = {"passed": "[green]PASSED[/]: trust the prediction",
                 "failed": "[bold red]FAILED[/]: do not trust the prediction; fix the recipe first",
                 "uninformative": f"[bold yellow]UNINFORMATIVE[/]: its band (+-{check['band95_half_width']:.1%}) is too "
                                  "wide to tell a good recipe from a bad one, so do not trust the prediction yet"
                 }[check["verdict"]]
        out_console.print(f"Self-check {plain}. (Refitted without {held}, the law predicted it "
                          f"{check['final_error']:+.2%} off at the end, {check['band95_coverage']:.0%} of its evals "
                          "inside the band.)")
    for note in summary["notes"]:
        loud = note.startswith("SELF-CHECK")  # its verdict is the line above: here, only why (said once)
        print_problem("Why" if loud else "Note", note.split(": ", 1)[1] if loud else note,
                      "bold red" if loud else "yellow")
    if not verbose:
        out_console.print("[dim]The fitted law, its noise and its prior: --verbose, or the sidecar.[/]")
        return
    out_console.print(f"Fitted law: {summary['law']}")
    for name, value in summary["params"].items():
        if not (name in ("A", "alpha") and "(one size)" in summary["law"]):
            out_console.print(f"  {name} = {value:.6g}")
    noise = summary["noise"]
    if noise.get("size_exponent", 0.0) > 0:
        out_console.print(f"Noise: smaller runs stray further from the law, as N^-{noise['size_exponent']:.2f} (sd "
                          f"{noise['run_sd']:.3g} between runs, {noise['checkpoint_sd']:.3g} within one, at N = "
                          f"{human_count(noise['ref_params'])}); each band carries the noise of its run's own size.")
    shared = summary.get("shared_noise")
    if shared:
        rows = ", ".join(f"{escape(name)} {n}" for name, n in shared["rows_borrowing"].items())
        out_console.print(f"Same data order: the curves share sd {shared['shared_sd']:.3g} of noise at a step (their "
                          f"own: {shared['own_sd']:.3g}); rows borrowing it: {rows}.")
    prior = summary["fit"]["alpha_prior"]
    if prior:
        out_console.print(f"Prior on the size exponent alpha: log-normal around {prior['median']:g} "
                          f"(x{math.exp(prior['log_sd']):.3g} per sd), weighted as one run; the fitted alpha sits "
                          f"{prior['z']:+.2f} sd from it.")
    misfit = summary.get("misfit")
    if misfit:
        out_console.print(f"Band calibrated ({misfit['scheme']}, {len(misfit['held_out'])} held-out runs, seeds "
                          f"averaged): the law missed "
                          f"runs it did not see by up to {misfit['q95']:.2%} (95%), added to every band in quadrature.")


@ladder_app.command()
def compare(
    baseline: Annotated[Path, typer.Argument(help="A `ladder run` output directory: the baseline recipe.")],
    candidate: Annotated[Path, typer.Argument(help="A `ladder run` output directory: the candidate recipe.")],
    json_out: JsonOpt = False,
) -> None:
    """Compute-equivalent speedup: compute the baseline needs to reach the candidate's loss, over the candidate's."""
    from moelab.ladder.speedup import compare_ladders

    rows = compare_ladders(baseline, candidate)
    if json_out:
        print(json.dumps({"baseline": str(baseline), "candidate": str(candidate), "rungs": rows,
                          "speedup": rows[-1]["speedup"]}))
        return
    table = Table("candidate rung", "FLOPs", "loss", "speedup", title=f"{candidate} over {baseline}")
    for row in rows:
        table.add_row(row["run"], f"{row['train_flops']:.3g}", f"{row['loss']:.4f}", f"{row['speedup']:.3f}x")
    out_console.print(table)


@ladder_app.command()
def task(
    points: Annotated[Path, typer.Argument(help="TASK_POINTS.csv: run,compute,task_loss,accuracy,final (one row per "
                                                "rung checkpoint, from `moelab eval RUN --arithmetic --every-checkpoint`).")],
    target_compute: Annotated[float, typer.Option(help="The target's training FLOPs (`moelab flops`).")],
    bootstrap: Annotated[int, typer.Option(help="Bootstrap refits over the rung runs for the 95% band.")] = 400,
    problems: Annotated[Optional[int], typer.Option(
        help="Problems the target's accuracy will be measured on: adds that measurement's binomial noise to the "
             "band.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Predict the target's final task accuracy: compute -> task loss -> accuracy, fitted on the rungs."""
    from moelab.ladder.task import predict_task, read_task_points

    if bootstrap < 20:
        raise ConfigError(f"--bootstrap {bootstrap} is too few refits for a 95% band; use 20 or more (default 400).")
    if problems is not None and problems < 1:
        raise ConfigError(f"--problems {problems} is invalid: the number of problems scored, an integer >= 1.")
    pred = predict_task(read_task_points(points), target_compute, num_bootstrap=bootstrap, problems=problems)
    result = {**pred.as_json(), "target_compute": target_compute}
    if json_out:
        print(json.dumps(result))
        return
    _print_task(result)


def _print_task(result: dict, saved: Path | None = None) -> None:
    """One line for a task prediction (`TaskPrediction.as_json`), its notes; or why the rungs could not place it."""
    if "error" in result:
        err_console.print(f"Warning: no task prediction: {escape(result['error'])}")
        return
    out_console.print(f"task: the target at {result['target_compute']:.3g} FLOPs scores accuracy "
                      f"{result['task_predicted']:.3f} [{result['task_lo95']:.3f}, {result['task_hi95']:.3f}], task "
                      f"loss {result['task_loss_predicted']:.4f} [{result['task_loss_lo95']:.4f}, "
                      f"{result['task_loss_hi95']:.4f}] (95%, {result['runs']} rung runs)"
                      + (f"; in {saved}" if saved else ""))
    for note in result["notes"]:
        err_console.print(f"note: {escape(note)}")
