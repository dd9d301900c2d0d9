"""The device mesh ("replica", "expert"), the sharding rules, and multi-host start.

    mesh = make_mesh(cfg.mesh)                       # ConfigError if there are too few devices
    state = jax.device_put(state, state_shardings(state, mesh))
    tokens = place_batch(np_tokens, mesh)            # [B, S+1] sharded over both axes

Layout (architecture §3): data parallel across `replica` groups (racks), expert parallel inside each.
- the batch is sharded over ("replica", "expert") jointly: every device holds B / (R X) sequences;
- routed experts' weights (`w_gate`, `w_up`, `w_down`, and their optimizer moments) are sharded
  over `expert` on their expert axis;
- the rest of the state (attention, router, norms, shared experts, embeddings) by `mesh.shard`:
  `replicate` keeps it on every device; `optimizer` splits every Adam moment over the whole mesh
  (ZeRO-1; the experts' moments over `replica` as well); `rack` splits the non-expert parameters and
  every moment over `expert` only, whole on each rack (HSDP: the update is local, nothing but the
  gradient crosses racks); `full` splits the parameters as `rack` and the moments as `optimizer`. A split
  array is cut along its largest dimension that the axis divides (never a stacked layer axis, which
  `scan` walks); one that no dimension fits stays whole. The router bias, its load average and the step are always replicated.

Nothing in the model names these layouts: the step's per-device program (`moelab.parallel.spmd`) gathers a
parameter split over the rack where a layer reads it, and the optimizer's update runs under jit on the
state as laid out. `moelab plan` counts what each layout holds per device and moves per step.

Axis-type convention (architecture §6): the mesh's axes are `AxisType.Auto`, and every array that
crosses a jit boundary is placed with a `NamedSharding` first (`state_shardings`, `place_batch`).
Auto lets the model code stay sharding-agnostic: GSPMD propagates the batch sharding through
attention and the router, and the one place that must know the layout, the expert-parallel
dispatch, states it with `shard_map` in_specs / out_specs. Explicit axes would instead require an
`out_sharding=` on every ambiguous gather and einsum of the model.

Multi-host: call `initialize_distributed()` before anything touches a JAX device. It starts
`jax.distributed` from `JAX_COORDINATOR_ADDRESS` + `JAX_NUM_PROCESSES` + `JAX_PROCESS_ID`, or lets
JAX detect a Slurm / Open MPI launch; with none of these it does nothing (one process). Every process
runs every step, eval and checkpoint save; only the one where `is_writer()` holds writes the run's
own files and logs, so hosts sharing an output directory do not each append the same lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moelab.config import MeshConfig
from moelab.errors import ConfigError

__all__ = [
    "AXES",
    "BATCH_AXES",
    "EXPERT_WEIGHTS",
    "initialize_distributed",
    "is_writer",
    "on_any_process",
    "on_every_process",
    "from_process_0",
    "make_mesh",
    "param_spec",
    "leaf_spec",
    "state_shardings",
    "batch_sharding",
    "place_batch",
]

AXES = ("replica", "expert")
BATCH_AXES = ("replica", "expert")  # the batch (and the flat token axis) is split over both
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # [..., E, a, b]: the arrays sharded over "expert"


def initialize_distributed(environ: Mapping[str, str] = os.environ) -> bool:
    """Starts multi-process JAX when the environment describes a multi-process launch.

    Reads, in order:
    - `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`:
      passed to `jax.distributed.initialize` as they are;
    - a Slurm (`SLURM_NTASKS` > 1) or Open MPI (`OMPI_COMM_WORLD_SIZE` > 1) launch: JAX reads the
      coordinator, process count and id from the launcher itself.

    Must run before the first JAX computation or `jax.devices()` call (JAX's own rule).

    Returns:
        True if `jax.distributed` was started, False for a single-process run.
    """
    if "JAX_COORDINATOR_ADDRESS" in environ or "JAX_NUM_PROCESSES" in environ:
        missing = [k for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in environ]
        if missing:
            raise ConfigError(
                f"multi-host start needs JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Set all three on every process (e.g. JAX_COORDINATOR_ADDRESS="
                "10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0), or none for a single-process run."
            )
        jax.distributed.initialize(
            coordinator_address=environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(environ["JAX_NUM_PROCESSES"]),
            process_id=int(environ["JAX_PROCESS_ID"]),
        )
        return True
    if int(environ.get("SLURM_NTASKS", "1")) > 1 or int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False


def on_any_process(flag: bool) -> bool:
    """Whether `flag` holds on some process (a tiny all-gather; just `flag` on one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def on_every_process(flag: bool) -> bool:
    """Whether `flag` holds on every process (a tiny all-gather; just `flag` on one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def from_process_0(check: Callable[[], bool]) -> bool:
    """`check()` as process 0 answers it, on every process; only process 0 runs it."""
    if jax.process_count() == 1:
        return check()
    answer = check() if jax.process_index() == 0 else False
    return bool(multihost_utils.broadcast_one_to_all(np.int32(answer)))


def is_writer() -> bool:
    """Whether this process writes the run's files and logs and publishes to tracking: process 0 only."""
    return jax.process_index() == 0


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The ("replica", "expert") mesh of `cfg.replica x cfg.expert` devices, Auto axis types.

    Uses the first `cfg.num_devices` of `devices` (default: all of JAX's devices, every process's);
    `expert` is the minor axis, so on a multi-host GPU system an expert group is a run of
    consecutive devices: one host or one NVLink rack.

    Raises:
        ConfigError: the mesh needs more devices than there are, naming both numbers.
    """
    devices = list(jax.devices() if devices is None else devices)
    if cfg.num_devices > len(devices):
        platform = devices[0].platform if devices else "none"
        hint = (" On CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{cfg.num_devices} (set before JAX starts)." if platform == "cpu" else "")
        raise ConfigError(
            f"mesh replica={cfg.replica} x expert={cfg.expert} needs {cfg.num_devices} devices, but only "
            f"{len(devices)} {platform} device(s) are available; use a smaller --mesh.{hint}"
        )
    return jax.make_mesh(
        (cfg.replica, cfg.expert), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: cfg.num_devices]
    )


def param_spec(path: tuple, leaf: Any) -> P:
    """The sharding rule: routed experts' arrays over `expert` on their expert axis; the rest replicated.

    `path` is a key path from `jax.tree_util.tree_map_with_path`. The rule keys on the last dict
    key, so it covers the params and any optimizer state that mirrors them (Adam's mu and nu).
    A routed expert array is [..., E, a, b]: [L, E, Din, F] stacked, [E, Din, F] for one layer.
    """
    name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), None)
    if name in EXPERT_WEIGHTS and np.ndim(leaf) >= 3:
        return P(*([None] * (np.ndim(leaf) - 3)), "expert", None, None)
    return P()


# TrainState fields that are never split: tiny, and read whole by every device each step.
REPLICATED_STATE = ("router_bias", "router_load", "step")
MOMENTS = ("opt_state", "mu", "nu")  # a path through one of these is optimizer state
STACKED = ("layers", "dense_layers")  # params keys whose arrays have a leading layer axis (scanned over)


def _attr_names(path: tuple) -> set[str]:
    return {k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)}


def _split_dim(shape: tuple[int, ...], size: int, skip: set[int]) -> int | None:
    """The largest dimension of `shape` that `size` divides, outside `skip`; None if there is none."""
    fits = [d for d in range(len(shape)) if d not in skip and shape[d] % size == 0 and shape[d] >= size]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def leaf_spec(path: tuple, leaf: Any, axes: Mapping[str, int], layout: str = "replicate") -> P:
    """Where one leaf of the train state (or of a params tree) lives under `layout` (`mesh.shard`).

    Routed experts follow `param_spec` in every layout. Under `optimizer` and `full`, optimizer
    moments are split over the whole mesh: under `optimizer` ("replica" and "expert" on one dimension when
    it divides, else "expert"), under `full` inside the device's own parameter shard (the parameter's
    dimension split expert-major, else "replica" on another); an expert's moments add "replica" on one of
    their own dimensions. Under `rack` and `full`, non-expert parameters are split over "expert"; under
    `rack` their moments too, and no moment over "replica". Leaves under a stacked key (`STACKED`) never split their
    leading layer axis. `axes` is the mesh's axis sizes (`mesh.shape`), so a planner can ask without devices.
    """
    base = param_spec(path, leaf)
    names = _attr_names(path)
    shape = tuple(np.shape(leaf))
    if layout == "replicate" or names & set(REPLICATED_STATE) or len(shape) == 0:
        return base
    moment = bool(names & set(MOMENTS))
    if not moment and layout not in ("full", "rack"):
        return base
    keys = {k.key for k in path if isinstance(k, jax.tree_util.DictKey)}
    spec = list(base) + [None] * (len(shape) - len(base))
    stacked = bool(keys & set(STACKED))
    taken = {d for d, axis in enumerate(spec) if axis is not None} | ({0} if stacked else set())
    replica, expert = axes["replica"], axes["expert"]
    across_racks = moment and replica > 1 and layout != "rack"
    if "expert" in spec:  # a routed expert's array: already over "expert"; its moments go over "replica" too
        dim = _split_dim(shape, replica, taken) if across_racks else None
        if dim is not None:
            spec[dim] = "replica"
        return P(*spec)
    if across_racks and layout == "optimizer":
        dim = _split_dim(shape, replica * expert, taken)
        if dim is not None:
            spec[dim] = ("replica", "expert")
            return P(*spec)
    dim = _split_dim(shape, expert, taken) if expert > 1 else None
    if dim is not None:
        spec[dim] = "expert"
    if across_racks and layout == "full":
        # The moments within the device's own parameter shard (expert-major), so each device updates a slice of what
        # it holds and only the new values cross racks: on the parameter's dimension when it divides, else another.
        if dim is not None and shape[dim] % (expert * replica) == 0:
            spec[dim] = ("expert", "replica")
        else:
            other = _split_dim(shape, replica, taken | ({dim} if dim is not None else set()))
            if other is not None:
                spec[other] = "replica"
    return P(*spec)


def state_shardings(tree: Any, mesh: Mesh, layout: str = "replicate") -> Any:
    """A `NamedSharding` for every leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s) by `leaf_spec`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, leaf_spec(path, leaf, mesh.shape, layout)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sequences over both mesh axes: [B, ...] with B split R X ways."""
    return NamedSharding(mesh, P(BATCH_AXES))


def place_batch(tokens: np.ndarray, mesh: Mesh) -> jax.Array:
    """The global [B, S+1] batch as one array sharded over the mesh.

    Every process builds the same global batch (data order depends only on (seed, step)), so each
    one cuts out the rows of its own devices; this works unchanged on one host or many.
    """
    tokens = np.asarray(tokens)
    return jax.make_array_from_callback(tokens.shape, batch_sharding(mesh), lambda index: tokens[index])
