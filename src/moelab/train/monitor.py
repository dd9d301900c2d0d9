"""Norm and spike monitoring: norms per module group inside the step, incident rules on the host.

    # inside the jitted train step (pure jnp, a few fused reductions):
    metrics |= group_norms(params, "params") | group_norms(grads, "grads") | group_norms(updates, "updates")
    metrics |= router_bias_norms(state.router_bias)
    # on the host, once per step:
    monitor = Monitor(cfg.monitor)
    incidents = monitor.observe(step, {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    ceiling = monitor.loss_ceiling()  # the next step's spike threshold, for `cfg.monitor.skip_spikes`

Why per module group: a real run once spiked near step 500 because of a hard-coded router bias, and
the global grad norm alone could not say where. Each group's norm is its own series, so an incident
names the module (`router_bias`, `grads/experts`, ...).

The rules (`Monitor.observe`):

- `loss_spike`: the floor (minimum) of the last `recent_window` losses exceeds the mean of the
  `trailing_window` losses before them by more than max(min_jump, num_sigmas * their std). Using the
  floor means one bad batch never fires; a spike has to last `recent_window` observations, so an
  incident comes `recent_window - 1` observations after the onset (its `values["onset_step"]`).
- `norm_spike`: the same on every `norm/*` series, with a relative jump so one rule fits norms of any
  scale: max(min_jump * |mean|, num_sigmas * std, NORM_FLOOR). NORM_FLOOR covers the zero baseline.
- `non_finite`: any metric NaN or +-inf. Non-finite values never enter a spike series' history.
- `grad_norm_ceiling`: `grad_norm` above `cfg.grad_norm_ceiling` when set.

Episodes, not floods: once a rule fires for a (rule, module) that pair is *open* and stays silent
until the series is back within its threshold for `recent_window` observations in a row (for the
spike rules: the whole recent window at or below the current threshold; for `non_finite` and the
ceiling: that many finite / below-ceiling values). Then it re-arms, and the next episode fires again.
A sustained shift ends its episode on its own once the trailing window has absorbed the new level.

Windows count observations, not steps: feed every step, or the windows stretch accordingly. The
history lives only in memory; after a restart the rules are quiet until the windows refill.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from moelab.config import MonitorConfig

__all__ = ["GROUPS", "NORM_FLOOR", "Incident", "Monitor", "group_norms", "router_bias_norms"]

# The module groups, in the order `group_norms` emits them (a jitted function's dict output comes back
# sorted by key instead).
GROUPS = ("embed", "attention", "router", "experts", "shared_experts", "latent", "dense_mlp", "norms", "lm_head")

# Leaf name (the last dict key on its path) -> group. Every parameter must be listed: an unlisted one
# raises in `group_norms`, so a new parameter cannot go unmonitored by accident.
_GROUP_OF = {
    "embed": "embed",
    "w_q": "attention",
    "w_k": "attention",
    "w_v": "attention",
    "w_o": "attention",
    "b_q": "attention",  # `model.attention_bias`
    "b_k": "attention",
    "b_v": "attention",
    "q_norm": "attention",  # `model.qk_norm`'s gains: part of how attention scores
    "k_norm": "attention",
    "w_router": "router",
    "w_gate": "experts",
    "w_up": "experts",
    "w_down": "experts",
    "w_shared_gate": "shared_experts",
    "w_shared_up": "shared_experts",
    "w_shared_down": "shared_experts",
    "w_latent_down": "latent",
    "latent_norm": "latent",
    "w_latent_up": "latent",
    "w_mlp_gate": "dense_mlp",  # `model.dense_layers`' SwiGLU
    "w_mlp_up": "dense_mlp",
    "w_mlp_down": "dense_mlp",
    "attn_norm": "norms",
    "mlp_norm": "norms",
    "final_norm": "norms",
    "lm_head": "lm_head",
}

# The smallest jump of a norm series that counts, in the norm's own units. It only matters where the
# relative and sigma terms are ~0, i.e. a series that sat at (or near) zero: a router bias that was
# never moved, a frozen group's grads. 1e-3 sits far above float32 round-off of such arrays (~1e-7 per
# entry, ~1e-5 for a [L, E] bias of 10^4 entries) and far below any bias that changes routing: sigmoid
# scores live in [0, 1], and the +5.0 bias of the step-500 incident is 5000x this floor.
NORM_FLOOR = 1e-3


# ----------------------------------------------------------------------------------------------
# norms, inside jit


def _leaf_name(path: tuple) -> str:
    key = path[-1] if path else None
    if not isinstance(key, jax.tree_util.DictKey):
        raise ValueError(f"group_norms expects nested dicts of arrays; the leaf at {jax.tree_util.keystr(path)} "
                         "is not under a dict key.")
    return str(key.key)


def group_norms(tree: Any, prefix: str) -> dict[str, jax.Array]:
    """L2 norm of each module group of a params-shaped tree (params, grads or optimizer updates).

    Args:
        tree: nested dicts of arrays laid out like `transformer.init`'s params; each leaf is grouped
            by its own name (`w_router` -> `router`), so stacked layers and top-level arrays mix freely.
        prefix: what the tree holds, e.g. "params", "grads", "updates".

    Returns:
        `norm/{prefix}/{group}` -> float32 [] for each group in GROUPS that the tree has (the latent,
        shared-expert and dense-MLP groups only exist when the model has them).

    Raises:
        ValueError: a leaf whose name belongs to no group, or a leaf not under a dict key.
    """
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix={prefix!r} must be a non-empty name without '/', e.g. 'grads'.")
    squares: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = _leaf_name(path)
        if name not in _GROUP_OF:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} belongs to no monitor group; "
                             f"add {name!r} to _GROUP_OF in moelab/train/monitor.py (groups: {', '.join(GROUPS)}).")
        group = _GROUP_OF[name]
        square = jnp.sum(jnp.square(leaf.astype(jnp.float32)))
        squares[group] = squares[group] + square if group in squares else square
    return {f"norm/{prefix}/{group}": jnp.sqrt(squares[group]) for group in GROUPS if group in squares}


def router_bias_norms(bias: jax.Array) -> dict[str, jax.Array]:
    """The router balancing bias [L, E] as two scalars: `norm/router_bias` (L2 over all entries), which
    the norm_spike rule watches, and `router_bias/max_abs`, the largest shift any expert gets."""
    bias = bias.astype(jnp.float32)
    return {"norm/router_bias": jnp.sqrt(jnp.sum(jnp.square(bias))), "router_bias/max_abs": jnp.max(jnp.abs(bias))}


# ----------------------------------------------------------------------------------------------
# incidents, on the host


def _json_number(v: Any) -> Any:
    # Strict JSON has no NaN / Infinity; a non-finite value is what a non_finite incident is about, so
    # keep it readable as a string instead of dropping it.
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


@dataclass(frozen=True)
class Incident:
    """One rule firing: at `step`, `rule` saw trouble in `module` (e.g. "router_bias", "loss").

    `values` holds the evidence: for the spike rules `value`, `floor`, `threshold`, `trailing_mean`,
    `trailing_std` and `onset_step` (the first step of the recent window); for `non_finite` the
    `value`; for `grad_norm_ceiling` the `value` and the `ceiling`.
    """

    step: int
    rule: str
    module: str
    values: dict[str, float | int] = field(default_factory=dict)

    def to_json(self) -> dict:
        """Plain data for JSONL and the ledger; non-finite numbers become the strings "nan" / "inf"."""
        return {"step": self.step, "rule": self.rule, "module": self.module,
                "values": {k: _json_number(v) for k, v in self.values.items()}}


def _spike_threshold(trailing: list[float], cfg: MonitorConfig, relative: bool) -> tuple[float, float, float]:
    """(threshold, mean, std) of a trailing window: the level a spike's floor must exceed."""
    # Plain Python over <= a few hundred floats: ~4x faster than building numpy arrays, and this runs
    # for every norm series on every step.
    mean = sum(trailing) / len(trailing)
    std = math.sqrt(sum((v - mean) ** 2 for v in trailing) / len(trailing))
    if relative:
        margin = max(cfg.min_jump * abs(mean), cfg.num_sigmas * std, NORM_FLOOR)
    else:
        margin = max(cfg.min_jump, cfg.num_sigmas * std)
    return mean + margin, mean, std


class Monitor:
    """Stateful host-side rules over the scalar metrics of each step; see the module docstring."""

    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self._history: dict[str, deque[float]] = {}  # spike series, finite values only
        self._steps: dict[str, deque[int]] = {}  # the step of each value in _history
        self._open: set[tuple[str, str]] = set()  # (rule, module) pairs inside an episode
        self._clean: dict[tuple[str, str], int] = {}  # consecutive in-bounds observations (non_finite, ceiling)
        self._last_step: int | None = None

    def observe(self, step: int, metrics: dict[str, float]) -> list[Incident]:
        """Feed one step's scalar metrics; returns the incidents that open at this step (often none).

        Raises:
            ValueError: `step` does not increase (a replayed or reordered step would corrupt the windows).
            TypeError: a metric that is not a scalar.
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"Monitor.observe got step={step} after step={self._last_step}; steps must increase.")
        self._last_step = step
        incidents: list[Incident] = []
        for name, raw in metrics.items():
            value = float(raw)
            finite = math.isfinite(value)
            if self._episode_by_count(("non_finite", name), bad=not finite):
                incidents.append(Incident(step, "non_finite", name, {"value": value}))
            if not finite:
                continue
            if name == "loss":
                incidents += self._spike(step, name, value, "loss_spike", "loss", relative=False)
            elif name.startswith("norm/"):
                incidents += self._spike(step, name, value, "norm_spike", name[len("norm/"):], relative=True)
            if name == "grad_norm" and self.cfg.grad_norm_ceiling is not None:
                over = value > self.cfg.grad_norm_ceiling
                if self._episode_by_count(("grad_norm_ceiling", "grad_norm"), bad=over):
                    incidents.append(Incident(step, "grad_norm_ceiling", "grad_norm",
                                              {"value": value, "ceiling": self.cfg.grad_norm_ceiling}))
        return incidents

    def loss_ceiling(self) -> float:
        """The loss above which the next observed step counts as spiking; inf until the history allows one.

        This is the threshold the next step's loss will be judged against (its trailing window is the
        one that will sit before its recent window). An incident needs `recent_window` such steps in a
        row; `cfg.skip_spikes` acts per step, so a single bad batch's update can be dropped inside the
        jitted step without a host sync.
        """
        t, r = self.cfg.trailing_window, self.cfg.recent_window
        history = list(self._history.get("loss", ()))
        if len(history) < t + r - 1:
            return math.inf
        trailing = history[len(history) - (t + r - 1):][:t]
        return _spike_threshold(trailing, self.cfg, relative=False)[0]

    # -- episodes --------------------------------------------------------------------------------

    def _episode(self, key: tuple[str, str], triggered: bool, cleared: bool) -> bool:
        """Whether an incident opens now: only on a trigger while armed; an open episode closes (re-arms)
        when `cleared`."""
        if key in self._open:
            if cleared:
                self._open.discard(key)
            return False
        if triggered:
            self._open.add(key)
            return True
        return False

    def _episode_by_count(self, key: tuple[str, str], bad: bool) -> bool:
        """Episodes of per-value rules: cleared after `recent_window` good observations in a row."""
        self._clean[key] = 0 if bad else self._clean.get(key, 0) + 1
        return self._episode(key, triggered=bad, cleared=self._clean[key] >= self.cfg.recent_window)

    def _spike(self, step: int, name: str, value: float, rule: str, module: str, relative: bool) -> list[Incident]:
        t, r = self.cfg.trailing_window, self.cfg.recent_window
        if name not in self._history:
            self._history[name], self._steps[name] = deque(maxlen=t + r), deque(maxlen=t + r)
        history, steps = self._history[name], self._steps[name]
        history.append(value)
        steps.append(step)
        if len(history) < t + r:
            return []
        values = list(history)
        threshold, mean, std = _spike_threshold(values[:t], self.cfg, relative)
        floor, peak = min(values[t:]), max(values[t:])
        if not self._episode((rule, module), triggered=floor > threshold, cleared=peak <= threshold):
            return []
        evidence = {"value": value, "floor": floor, "threshold": threshold, "trailing_mean": mean,
                    "trailing_std": std, "onset_step": steps[t]}
        return [Incident(step, rule, module, evidence)]
