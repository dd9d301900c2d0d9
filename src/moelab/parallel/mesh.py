"""The device mesh ("replica", "expert"), the sharding rules, and multi-host start.

    mesh = make_mesh(cfg.mesh)                       # ConfigError if there are too few devices
    state = jax.device_put(state, state_shardings(state, mesh))
    tokens = place_batch(np_tokens, mesh)            # [B, S+1] sharded over both axes

Layout (design §3): data parallel across `replica` groups (racks), expert parallel inside each.
- the batch is sharded over ("replica", "expert") jointly: every device holds B / (R X) sequences;
- routed experts' weights (`w_gate`, `w_up`, `w_down`, and their optimizer moments) are sharded
  over `expert` on their expert axis and replicated over `replica`;
- everything else (attention, router, norms, shared experts, embeddings, router bias) is replicated.

Axis-type convention (design §6): the mesh's axes are `AxisType.Auto`, and every array that
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


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A `NamedSharding` for every leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s) by `param_spec`."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: NamedSharding(mesh, param_spec(path, leaf)), tree)


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
