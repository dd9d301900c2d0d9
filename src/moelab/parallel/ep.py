"""One MoE layer on a mesh, called from a global program: what the layer's tests and benchmark run.

    layer = moe_on_mesh(cfg, mesh)                    # cfg.moe.dispatch 'ep': experts over "expert"
    y, stats = layer(params, x, bias)                 # x [T, D] split over the mesh; stats the step's totals

The train step runs the whole model per device (`moelab.parallel.spmd`), so every MoE block in it already
routes its own tokens. A layer measured or checked alone needs the same per-device block
(`moelab.model.moe.apply` under the `Dispatch` of `build_moe(cfg, mesh)`) under a `shard_map` of its own:
tokens split over both mesh axes, routed experts over "expert", every other weight whole. Its gradients,
taken from outside, are the global ones (a whole weight's is summed over the devices by the map's transpose).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moelab.config import ModelConfig
from moelab.model import moe
from moelab.parallel.mesh import BATCH_AXES, EXPERT_WEIGHTS
from moelab.parallel.spmd import mean_over_devices

__all__ = ["moe_on_mesh"]


def moe_on_mesh(cfg: ModelConfig, mesh: Mesh, purpose: str = "train", compute_dtype: jnp.dtype = jnp.float32,
                rebalance: bool = False) -> Callable:
    """`layer(params, x [T, D], bias [E]) -> (y [T, D], stats)`: `moe.apply` per device over `mesh`.

    `params` are one block's (`moe.init`), `x` all T tokens (T divisible by the mesh's devices); the stats are
    the whole layer's (counts summed, means averaged over the devices).
    """
    dispatch = moe.build_moe(cfg, mesh, purpose)
    names = jax.eval_shape(lambda: moe.init(cfg, jax.random.key(0)))
    specs = {name: P("expert", None, None) if name in EXPERT_WEIGHTS else P() for name in names}

    def local(params, x, bias):
        y, stats = moe.apply(params, x, bias, cfg, compute_dtype, dispatch=dispatch, rebalance=rebalance)
        return y, {name: mean_over_devices(value) for name, value in stats.items()}

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(BATCH_AXES, None), P()),
                         out_specs=(P(BATCH_AXES, None), P()))
