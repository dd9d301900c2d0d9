"""Contingency planning: re-plan the token budget, LR decay and phase boundary after lost compute.

The rule comes from the run moelab is modelled on: if hardware is lost within the first 25% of the token
budget, shorten the budget and re-tune the LR decay and the data mixture instead of keeping the old plan;
later than that, keep the budget and take the delay. `moelab replan PLAN.yaml --event SPEC` is

    result = replan(load_yaml(path), parse_event(spec))
    rows = comparison_rows(result)  # (field, old, new) for a side-by-side table
    Path(out).write_text(dump_yaml(result.new))  # `moelab train` accepts it

Events (`parse_event`):
- `devices_lost:step=S,count=N`: from step S on, N of the plan's devices are gone for the rest of the run.
- `steps_lost:step=S,count=N`: at step S the run loses N steps of work (a rollback to the checkpoint at
  step S - N); those steps are trained again, costing their wall-clock time.

The time model, kept deliberately simple:
- the run went as planned until the event: step S is reached at S x tokens_per_step / plan.tokens_per_s;
- throughput scales linearly with devices: losing N of D devices leaves tokens_per_s x (D - N) / D;
- a rollback costs the lost steps' time and nothing else (restart overheads are ignored);
- plan.deadline_hours counts from the start of the run; None means the old plan fits it exactly.

Within the first EARLY_FRACTION of the budget (the event's step included when it sits exactly on the
boundary) the rule is "shrink": the new budget is the tokens already kept plus what the remaining wall clock
trains at the new throughput, rounded down to whole steps and never above the old budget. WSD decay and the
phase boundaries are fractions of `train.steps`, so keeping `train.decay_fraction` and the phase fractions
moves them in proportion. Later events are "keep": same budget, and the report says how late it finishes.

The new config changes only `train.steps` and `plan` (devices, throughput, and the deadline written out).
`mesh` is left alone: after `devices_lost`, pick the mesh for the devices that remain with `--set mesh.*`.
Re-planning that new config for a second event treats its lower throughput as if it held from step 0,
which overstates the time already spent, so a second re-plan errs toward a smaller budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from moelab import accounting
from moelab.config import RunConfig, TrainConfig
from moelab.errors import ConfigError
from moelab.data.mixture import phase_boundaries
from moelab.train.schedule import decay_start, warmup_steps

__all__ = [
    "EARLY_FRACTION",
    "EVENT_KINDS",
    "Event",
    "Replan",
    "check_event",
    "comparison_rows",
    "parse_event",
    "replan",
]

EARLY_FRACTION = 0.25  # events at or before this share of the token budget shrink it; later ones keep it
EVENT_KINDS = ("devices_lost", "steps_lost")
_EVENT_KEYS = ("step", "count")
_EXAMPLE = "devices_lost:step=1200,count=8"


@dataclass(frozen=True)
class Event:
    """Compute lost during a run: `count` devices from `step` on, or `count` steps rolled back at `step`."""

    kind: str  # one of EVENT_KINDS
    step: int  # 0-based; steps 0 .. step - 1 were trained before the event
    count: int  # devices lost (devices_lost) or steps of work lost (steps_lost)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ConfigError(
                f"event kind {self.kind!r} is unknown; the kinds are: {', '.join(EVENT_KINDS)} (e.g. {_EXAMPLE})."
            )
        for name, low in (("step", 0), ("count", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"event.{name}={value!r} is invalid: must be an integer >= {low} (e.g. {_EXAMPLE}).")

    @property
    def spec(self) -> str:
        """The event as `parse_event` reads it."""
        return f"{self.kind}:step={self.step},count={self.count}"


@dataclass(frozen=True)
class Replan:
    """The old plan, the new one, and the numbers that differ between them."""

    old: RunConfig
    new: RunConfig  # old with new train.steps; plan.num_devices / tokens_per_s / deadline_hours made current
    event: Event
    rule: str  # "shrink" (event within the first EARLY_FRACTION of the budget) or "keep"
    resume_step: int  # first step trained after the event: event.step, or event.step - count after a rollback
    event_hours: float  # wall clock at the event, as planned
    budget_tokens_old: int
    budget_tokens_new: int
    decay_start_old: int  # first step of the LR decay (WSD), or the end of warmup (cosine)
    decay_start_new: int
    phase_boundaries_old: tuple[int, ...]  # first step of every phase after the first
    phase_boundaries_new: tuple[int, ...]
    deadline_hours: float  # plan.deadline_hours, or the old plan's exact finish when that was None
    finish_hours_old: float  # when the old plan finishes had nothing been lost
    finish_hours_new: float  # when the new plan finishes, event included
    delay_hours: float  # finish_hours_new - deadline_hours: > 0 late, <= 0 on time with that much slack
    explanation: str  # one line: which rule applied and what it changed


# ----------------------------------------------------------------------------------------------
# events


def parse_event(spec: str) -> Event:
    """Read `KIND:step=S,count=N` (see the module docstring); checks against a plan are in `check_event`.

    Raises:
        ConfigError: unknown kind, a missing, repeated or unknown key, or a value that is not an integer >= 0
            (count >= 1).
    """
    kind, colon, rest = spec.strip().partition(":")
    kind = kind.strip()
    if kind not in EVENT_KINDS:
        raise ConfigError(
            f"--event {spec!r} has unknown kind {kind!r}; the kinds are: {', '.join(EVENT_KINDS)} "
            f"(e.g. {_EXAMPLE})."
        )
    if not colon or not rest.strip():
        raise ConfigError(f"--event {spec!r} gives no keys; write {kind}:step=S,count=N (e.g. {_EXAMPLE}).")
    values: dict[str, int] = {}
    for item in rest.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--event {spec!r}: {item!r} must look like key=value; write {kind}:step=S,count=N.")
        if key not in _EVENT_KEYS:
            raise ConfigError(
                f"Unknown key event.{key} in --event {spec!r}; the keys allowed here are: {', '.join(_EVENT_KEYS)}."
            )
        if key in values:
            raise ConfigError(f"--event {spec!r} gives event.{key} twice; give each of step and count once.")
        try:
            values[key] = int(raw.strip())
        except ValueError:
            raise ConfigError(
                f"event.{key}={raw.strip()!r} in --event {spec!r} is invalid: must be a whole number "
                f"(e.g. {_EXAMPLE})."
            ) from None
    missing = [key for key in _EVENT_KEYS if key not in values]
    if missing:
        raise ConfigError(
            f"--event {spec!r} is missing event.{missing[0]}; the keys required are: {', '.join(_EVENT_KEYS)} "
            f"(e.g. {kind}:step=S,count=N)."
        )
    return Event(kind, values["step"], values["count"])


def check_event(event: Event, cfg: RunConfig) -> None:
    """Raise ConfigError unless `event` can happen in the run `cfg` plans."""
    steps, num_devices = cfg.train.steps, cfg.plan.num_devices
    if not event.step < steps:
        raise ConfigError(
            f"event.step={event.step} in --event {event.spec} is invalid: must be in [0, train.steps={steps})."
        )
    if event.kind == "devices_lost" and event.count >= num_devices:
        raise ConfigError(
            f"event.count={event.count} in --event {event.spec} is invalid: must be in [1, {num_devices - 1}], "
            f"fewer than plan.num_devices={num_devices}; losing every device stops the run, so write a new plan."
        )
    if event.kind == "steps_lost" and event.count > event.step:
        raise ConfigError(
            f"event.count={event.count} in --event {event.spec} is invalid: must be in [1, event.step={event.step}]; "
            "a rollback cannot go back before step 0."
        )


# ----------------------------------------------------------------------------------------------
# the rule


def replan(cfg: RunConfig, event: Event) -> Replan:
    """Apply the contingency rule to the plan `cfg` after `event`; see the module docstring.

    Raises:
        ConfigError: the event does not fit the plan (`check_event`); plan.tokens_per_s is unknown; the
            deadline has passed at the event; the remaining compute cannot train even one more step; or the
            shrunk plan would move the LR decay, warmup or a phase boundary onto steps already trained.
    """
    check_event(event, cfg)
    plan, steps = cfg.plan, cfg.train.steps
    if plan.tokens_per_s is None:
        raise ConfigError(
            "plan.tokens_per_s=None: replan needs the measured throughput of the plan's "
            f"plan.num_devices={plan.num_devices} devices; set plan.tokens_per_s in the plan (tokens per second)."
        )
    # Exact rationals: the new step count is a floor, and float noise in e.g. (deadline - t) x tps / tokens
    # turns an exact 9000 into 8999.999 and loses a whole step.
    tokens_per_step = accounting.tokens_per_step(cfg)
    step_seconds = tokens_per_step / Fraction(plan.tokens_per_s)
    deadline = Fraction(plan.deadline_hours) * 3600 if plan.deadline_hours is not None else steps * step_seconds
    event_seconds = event.step * step_seconds
    if event_seconds >= deadline:
        raise ConfigError(
            f"plan.deadline_hours={float(deadline / 3600):g} has passed at the event: step {event.step} is reached "
            f"at {float(event_seconds / 3600):.2f} h under the plan; set a later plan.deadline_hours."
        )
    if event.kind == "devices_lost":
        num_devices = plan.num_devices - event.count
        tokens_per_s = Fraction(plan.tokens_per_s) * num_devices / plan.num_devices
        resume = event.step
    else:
        num_devices, tokens_per_s, resume = plan.num_devices, Fraction(plan.tokens_per_s), event.step - event.count
    new_step_seconds = tokens_per_step / tokens_per_s

    # Tokens are proportional to steps, so "within the first 25% of the budget" is a comparison of steps.
    rule = "shrink" if event.step <= Fraction(EARLY_FRACTION) * steps else "keep"
    if rule == "shrink":
        affordable = resume + math.floor((deadline - event_seconds) / new_step_seconds)
        if affordable <= resume:
            hours_left = float((deadline - event_seconds) / 3600)
            raise ConfigError(
                f"the plan cannot fit: after --event {event.spec}, the {hours_left:.3g} h "
                f"left before plan.deadline_hours={float(deadline / 3600):g} train less than one step of "
                f"{tokens_per_step:,} tokens at {_rate(float(tokens_per_s))} tokens/s; set a later plan.deadline_hours."
            )
        new_steps = min(steps, affordable)
    else:
        new_steps = steps
    new = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=new_steps),
        # The deadline is written out explicitly: None would mean "fits exactly" for the *new* budget and speed.
        plan=dataclasses.replace(
            plan, num_devices=num_devices, tokens_per_s=float(tokens_per_s), deadline_hours=float(deadline / 3600)
        ),
    )
    _check_trained_steps_unchanged(cfg, new, resume)

    finish_new = event_seconds + (new_steps - resume) * new_step_seconds
    return Replan(
        old=cfg,
        new=new,
        event=event,
        rule=rule,
        resume_step=resume,
        event_hours=float(event_seconds / 3600),
        budget_tokens_old=steps * tokens_per_step,
        budget_tokens_new=new_steps * tokens_per_step,
        decay_start_old=_decay_start(cfg.train),
        decay_start_new=_decay_start(new.train),
        phase_boundaries_old=tuple(phase_boundaries(cfg.data, steps)[1:]),
        phase_boundaries_new=tuple(phase_boundaries(cfg.data, new_steps)[1:]),
        deadline_hours=float(deadline / 3600),
        finish_hours_old=float(steps * step_seconds / 3600),
        finish_hours_new=float(finish_new / 3600),
        delay_hours=float((finish_new - deadline) / 3600),
        explanation=_explain(cfg, new, event, rule, float(finish_new / 3600), float(deadline / 3600)),
    )


def _decay_start(train: TrainConfig) -> int:
    # A cosine schedule decays from the end of warmup; schedule.decay_start is the WSD boundary only.
    return decay_start(train) if train.schedule == "wsd" else warmup_steps(train)


def _check_trained_steps_unchanged(old: RunConfig, new: RunConfig, resume: int) -> None:
    """Fail if the new plan disagrees with the old one on the steps already trained (0 .. resume - 1).

    Those steps saw the old plan's LR and data mixture; a new config that would have given them another LR
    or another phase cannot be resumed from their checkpoint. A boundary may move only while both of its
    positions are still ahead of the resume step.
    """
    if new.train.steps == old.train.steps:
        return
    fix = "set a later plan.deadline_hours so that the budget shrinks less"
    t_old, t_new = old.train, new.train
    if resume > 0 and warmup_steps(t_new) != warmup_steps(t_old):
        raise ConfigError(
            f"the new budget of {t_new.steps} steps is shorter than train.warmup_steps={t_old.warmup_steps}, which "
            f"would change the warmup of the {resume} steps already trained; {fix}."
        )
    if t_old.schedule == "cosine" and resume > warmup_steps(t_old):
        raise ConfigError(
            f"train.schedule='cosine' cannot be re-decayed after step {resume}: the cosine of {t_new.steps} steps "
            f"differs from the one already trained on; plan with train.schedule='wsd', or {fix}."
        )
    d_old, d_new = _decay_start(t_old), _decay_start(t_new)
    if d_new != d_old and min(d_new, d_old) < resume:
        raise ConfigError(
            f"the new budget of {t_new.steps} steps would start the LR decay at step {d_new}, before step {resume} "
            f"where training resumes (the steps before it were trained at peak LR, with the decay at {d_old}); "
            f"lower train.decay_fraction={t_old.decay_fraction} in the plan, or {fix}."
        )
    starts_old = phase_boundaries(old.data, t_old.steps)
    starts_new = phase_boundaries(new.data, t_new.steps)
    for phase, b_old, b_new in zip(old.data.phases[1:], starts_old[1:], starts_new[1:]):
        if b_new != b_old and min(b_new, b_old) < resume:
            raise ConfigError(
                f"the new budget of {t_new.steps} steps would start phase {phase.name} at step {b_new}, before step "
                f"{resume} where training resumes (the steps before it were trained on the earlier mixture, with "
                f"the phase at {b_old}); lower data.phases[{phase.name}].fraction in the plan, or {fix}."
            )


def _explain(
    old: RunConfig, new: RunConfig, event: Event, rule: str, finish_hours: float, deadline_hours: float
) -> str:
    steps = old.train.steps
    where = f"{event.spec} at {100 * event.step / steps:.1f}% of the budget"
    if rule == "shrink":
        where += f" (within the first {EARLY_FRACTION:.0%})"
        if new.train.steps == steps:
            return (
                f"{where}: the compute left by the {deadline_hours:.2f} h deadline still trains the whole budget; "
                "kept."
            )
        return (
            f"{where}: the budget shrinks to what the compute left trains by the {deadline_hours:.2f} h deadline, "
            f"{steps:,} -> {new.train.steps:,} steps; LR decay and phase boundaries keep their fractions."
        )
    where += f" (after the first {EARLY_FRACTION:.0%})"
    late = round(finish_hours - deadline_hours, 2)  # as printed, so float noise never reads "-0.00 h before"
    timing = f"{late:.2f} h after" if late > 0 else f"{-late:.2f} h before" if late < 0 else "right at"
    return (
        f"{where}: the budget is kept; the run finishes at {finish_hours:.2f} h, {timing} the "
        f"{deadline_hours:.2f} h deadline."
    )


# ----------------------------------------------------------------------------------------------
# the comparison table


def comparison_rows(result: Replan) -> list[tuple[str, str, str]]:
    """(field, old, new) rows for a side-by-side table of the two plans, as text."""
    old, new = result.old, result.new
    tokens_per_step = accounting.tokens_per_step(old)
    rows = [
        ("train.steps", f"{old.train.steps:,}", f"{new.train.steps:,}"),
        ("token budget", f"{result.budget_tokens_old:,}", f"{result.budget_tokens_new:,}"),
        ("tokens per step", f"{tokens_per_step:,}", f"{tokens_per_step:,}"),
        ("plan.num_devices", f"{old.plan.num_devices}", f"{new.plan.num_devices}"),
        ("plan.tokens_per_s", _rate(old.plan.tokens_per_s), _rate(new.plan.tokens_per_s)),
        ("warmup end (step)", f"{warmup_steps(old.train):,}", f"{warmup_steps(new.train):,}"),
        ("LR decay start (step)", f"{result.decay_start_old:,}", f"{result.decay_start_new:,}"),
    ]
    for phase, b_old, b_new in zip(old.data.phases[1:], result.phase_boundaries_old, result.phase_boundaries_new):
        rows.append((f"{phase.name} start (step)", f"{b_old:,}", f"{b_new:,}"))
    rows += [
        ("finish (h)", f"{result.finish_hours_old:.2f}", f"{result.finish_hours_new:.2f}"),
        ("deadline (h)", f"{result.deadline_hours:.2f}", f"{result.deadline_hours:.2f}"),
        ("finish - deadline (h)", _signed_hours(result.finish_hours_old - result.deadline_hours),
         _signed_hours(result.delay_hours)),
    ]
    return rows


def _rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "unknown"
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 1000 else f"{tokens_per_s:.4g}"


def _signed_hours(hours: float) -> str:
    return f"{round(hours, 2) + 0.0:+.2f}"  # + 0.0 turns a rounded -0.0 into 0.0: "+0.00", never "-0.00"
