"""The MoE block: router, optional LatentMoE projection, routed experts, shared experts.

    y = up(dispatch(norm(x @ W_latent_down), route(x))) + shared(x)

The router always reads the full-width x (architecture §3). Under LatentMoE (`cfg.moe.latent_dim` set)
only the routed path runs at the latent width: rows are projected down and RMS-normalized before
dispatch, and the combined output is projected back up. Shared experts are dense SwiGLU MLPs on every
token; the N of them are stored fused as one SwiGLU of width N * shared_expert_dim, which is the same
function with the same parameter count (the hidden units of the N MLPs are simply concatenated).
The routed experts run as one frozen `Dispatch` says, built once for its purpose by `build_moe`: the
backend and its capacity (training drops what overflows; decoding drops nothing), FP8, and, under a mesh,
the axes this device's tokens are a slice of. `apply` runs per device inside the train step's `shard_map`
(`moelab.parallel.spmd`): the router scores and picks experts for this device's own tokens, and only
what the math needs crosses devices: the expert rows of `ep`'s all-to-all inside the rack, the balancer's
per-expert histogram and the load counts. Nothing of shape [tokens, experts] leaves a device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.errors import ConfigError
from moelab.model import balancing, exchange
from moelab.model import dispatch as backends
from moelab.model import fp8 as fp8_lib
from moelab.model import router as router_lib
from moelab.model.layers import INIT_STD, residual_init_std, rms_norm, swiglu
from moelab.model.router import Routing, expert_load, route

__all__ = ["PURPOSES", "Dispatch", "build_moe", "drops_by_purpose", "init", "apply"]

# What a block is built for: `train` (the config's backend and capacity), `eval` (the same: the in-loop held-out
# loss, `eval/mean`, is measured as the model trains, drops counted), `decode` (one device, no token dropped:
# decoding, scoring text, export checks).
PURPOSES = ("train", "eval", "decode")


@dataclass(frozen=True)
class Dispatch:
    """How one MoE block runs its routed experts: one value, built once for its purpose (`build_moe`).

    `dispatch(h, routing, experts) -> (out, stats)` runs the backend on this device's rows; under a mesh
    (`token_axes`) the counts in `stats` are summed over the devices, so every device reads the step's totals.
    """

    backend: str  # dense | capacity | dropless | grouped (`moelab.model.dispatch`) | ep (`moelab.model.exchange`)
    purpose: str = "train"  # one of PURPOSES
    capacity_factor: float | None = None  # capacity / ep: rows per expert, x the fair share; None: room for every row
    transport_capacity_factor: float | None = None  # ep: rows per sender pool, x the fair share; None: capacity_factor
    num_waves: int = 1  # ep: static waves of the all-to-all
    fp8: bool = False  # the expert GEMMs in FP8 (`model.fp8`)
    token_axes: tuple[str, ...] = ()  # the mesh axes this device's tokens are a slice of; () on one device
    tiled_for_gpu: bool | None = None  # grouped: the GEMM's tiles a GPU's (True) or a CPU's; None: this machine's

    def __post_init__(self) -> None:
        if self.backend not in (*backends.BACKENDS, "ep"):
            raise ValueError(f"backend={self.backend!r} must be one of {', '.join((*backends.BACKENDS, 'ep'))}.")
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose={self.purpose!r} must be one of {', '.join(PURPOSES)}.")

    @property
    def drops(self) -> str:
        """The drop policy in words, as the run's log states it."""
        if self.backend in ("dense", "dropless", "grouped") or self.capacity_factor is None:
            return f"{self.backend}: no token dropped"
        return (f"{self.backend} at capacity factor {self.capacity_factor:g}: assignments past an expert's capacity "
                "are dropped and counted")

    def __call__(self, h: jax.Array, routing: Routing, experts: dict[str, jax.Array]
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if self.backend == "ep":
            out, stats = self._exchange(h, routing, experts)
        elif self.backend == "capacity":
            E, k = experts["w_gate"].shape[0], routing.expert_idx.shape[1]
            factor = E / k if self.capacity_factor is None else self.capacity_factor  # E / k: C = T
            out, stats = backends.capacity(h, routing, experts, factor, fp8=self.fp8)
        elif self.backend == "grouped":
            out, stats = backends.grouped(h, routing, experts, fp8=self.fp8, on_gpu=self.tiled_for_gpu)
        else:
            out, stats = {"dense": backends.dense, "dropless": backends.dropless}[self.backend](h, routing, experts,
                                                                                              fp8=self.fp8)
        if self.token_axes:  # every stat is a count: the step's is the sum over the devices
            stats = {name: jax.lax.psum(value, self.token_axes) for name, value in stats.items()}
        return out, stats

    def _exchange(self, h, routing, experts):
        """`ep` on this device's T rows: the pool and receiver sizes for T, then the exchange over "expert"."""
        T, k = routing.expert_idx.shape
        El, X = experts["w_gate"].shape[0], jax.lax.axis_size("expert")
        cf = self.capacity_factor
        pool = exchange.pool_size(T, k, X, El, self.num_waves, cf if self.transport_capacity_factor is None
                                  else self.transport_capacity_factor)
        capacity = exchange.receiver_capacity(T, k, El * X, X, self.num_waves, pool, cf)
        out, counts = exchange.exchange(h, routing.expert_idx, routing.weights, experts, num_waves=self.num_waves,
                                        pool=pool, capacity=capacity, fp8=self.fp8)
        return out, {"load": expert_load(routing.expert_idx, El * X),
                     "dropped": counts["dropped_at_sender"] + counts["dropped_at_receiver"],
                     "assignments": jnp.asarray(T * k, jnp.float32), **counts}


def build_moe(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None, purpose: str = "train") -> Dispatch:
    """The one way to get a `Dispatch`: `cfg`'s routed experts as `purpose` runs them, on `mesh` or one device.

    - `train` and `eval`: `cfg.moe.dispatch` at `cfg.moe.capacity_factor`. On a mesh the block runs per device inside
      the step's `shard_map`, its tokens a slice over every mesh axis; `ep` needs the mesh (its experts are split
      over "expert"). Evaluation keeps the training capacity, so `eval/mean` is the model as it trains (a run's
      summary says so: `drops_by_purpose`).
    - `decode`: one device, no token dropped: `dropless`, or on a GPU `grouped` (`dropless` has no fast kernel
      there). FP8 on a GPU has no grouped kernel: there it is `capacity` with room for every row (C = T: [E, T, D]
      buffers), and it warns so.

    Raises:
        ValueError: an unknown purpose, or `ep` for train / eval without a mesh.
        ConfigError: `dropless` for training on a GPU; FP8 on a GPU without FP8 tensor cores.
    """
    m = cfg.moe
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r} must be one of {', '.join(PURPOSES)}.")
    backends.check_fp8(cfg.fp8)
    on_gpu = jax.default_backend() == "gpu"
    if purpose == "decode":
        if cfg.fp8 and on_gpu:
            warnings.warn("model.fp8 on a GPU: decoding runs the `capacity` backend with room for every row (C = T, "
                          "[E, T, D] buffers): the grouped GEMM has no FP8 kernel.", stacklevel=2)
            return Dispatch("capacity", purpose, None, fp8=True)
        return Dispatch("grouped" if on_gpu else "dropless", purpose, fp8=cfg.fp8)
    if m.dispatch == "dropless" and on_gpu:
        raise ConfigError(
            "model.moe.dispatch='dropless' does not run on a GPU: XLA lowers jax.lax.ragged_dot there to a dense "
            "fallback, which asked for 112.5 GiB at 16,384 tokens on an H200 (2026-12-04). Use "
            "--set model.moe.dispatch=grouped: the same dropless function through moelab's Pallas grouped GEMM.")
    if m.dispatch == "ep" and mesh is None:
        raise ValueError("model.moe.dispatch='ep' needs the ('replica', 'expert') mesh to run on: pass mesh=...")
    token_axes = tuple(mesh.axis_names) if mesh is not None and (mesh.size > 1 or m.dispatch == "ep") else ()
    return _training(cfg, purpose, token_axes)


def _training(cfg: ModelConfig, purpose: str, token_axes: tuple[str, ...] = ()) -> Dispatch:
    """`cfg.moe.dispatch` at the training capacity, its tokens a slice over `token_axes`."""
    m = cfg.moe
    ep = m.dispatch == "ep"
    return Dispatch(m.dispatch, purpose, m.capacity_factor if m.dispatch in ("capacity", "ep") else None,
                    m.resolved_transport_capacity_factor if ep else None, m.num_waves if ep else 1, cfg.fp8, token_axes)


def drops_by_purpose(cfg: ModelConfig) -> dict[str, str]:
    """What each purpose's MoE blocks drop, in words (`Dispatch.drops`): the training steps, the evaluations behind
    `eval/*` (the training capacity: the model as it trains) and decoding (no token dropped). Read off the config
    alone (a mesh only adds the axes a block's tokens are split over), so no device is needed."""
    training = _training(cfg, "train").drops
    return {"train": training, "eval": training, "samples": build_moe(cfg, purpose="decode").drops}


def init(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Parameters of one MoE block, float32.

    Returns:
        `w_router` [D, E], `w_gate` [E, Din, F], `w_up` [E, Din, F], `w_down` [E, F, Din] where Din is
        `cfg.expert_input_dim`; with LatentMoE also `w_latent_down` [D, Dl], `latent_norm` [Dl],
        `w_latent_up` [Dl, D]; with shared experts `w_shared_gate` [D, Ns*Fs], `w_shared_up`
        [D, Ns*Fs], `w_shared_down` [Ns*Fs, D].
    """
    m = cfg.moe
    D, E, F, Din = cfg.d_model, m.num_experts, m.expert_dim, cfg.expert_input_dim
    out_std = residual_init_std(cfg.num_layers)
    keys = iter(jax.random.split(key, 10))

    def normal(shape, std=INIT_STD):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    params = {
        "w_router": normal((D, E)),
        "w_gate": normal((E, Din, F)),
        "w_up": normal((E, Din, F)),
        "w_down": normal((E, F, Din), out_std if m.latent_dim is None else INIT_STD),
    }
    if m.latent_dim is not None:
        params["w_latent_down"] = normal((D, m.latent_dim))
        params["latent_norm"] = jnp.ones((m.latent_dim,), jnp.float32)
        params["w_latent_up"] = normal((m.latent_dim, D), out_std)
    if m.num_shared_experts > 0:
        Fs = m.num_shared_experts * m.resolved_shared_expert_dim
        params["w_shared_gate"] = normal((D, Fs))
        params["w_shared_up"] = normal((D, Fs))
        params["w_shared_down"] = normal((Fs, D), out_std)
    return params


def apply(
    params: dict[str, jax.Array],
    x: jax.Array,
    bias: jax.Array,
    cfg: ModelConfig,
    compute_dtype: jnp.dtype = jnp.float32,
    *,
    dispatch: Dispatch,
    rebalance: bool | jax.Array = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs the MoE block on a flat batch of tokens.

    Args:
        params: from `init`.
        x: [T, D] normalized block input (float32; the router reads it as is).
        bias: [E] router balancing bias (state; no gradient flows into it).
        cfg: the model config.
        compute_dtype: dtype of the matmuls' inputs (float32 or bfloat16). The router and the latent
            norm's statistics stay float32.
        dispatch: how the routed experts run (`build_moe`; required: a default would pick a backend the caller
            did not name). With `dispatch.token_axes`, x is this device's slice of the tokens, and the
            statistics and the balancer's estimates are the whole step's.
        rebalance: [] bool (or a Python bool): route under the bias solved on this batch
            (`balancing.rebalance_on_batch`) instead of `bias`; a Python False adds nothing to the
            program, a traced flag one `lax.cond`.

    Returns:
        y [T, D] float32 and stats: `load` [E], `dropped` [], `assignments` [], `entropy` [] (the
        routing entropy), plus what the balancing rule measures (`balancing.Balancer.measure`).
    """
    m = cfg.moe
    axes = dispatch.token_axes or None
    if rebalance is not False:
        bias = jax.lax.cond(rebalance, lambda b: balancing.rebalance_on_batch(x, params["w_router"], b, m, axes),
                            lambda b: b.astype(jnp.float32), bias)
    routing = route(x, params["w_router"], bias, m)

    def cast(a: jax.Array) -> jax.Array:
        return a.astype(compute_dtype)

    if dispatch.fp8 != cfg.fp8:
        raise ValueError(f"model.fp8={cfg.fp8}, but the dispatch was built with fp8={dispatch.fp8}: build it with "
                         "build_moe(cfg, mesh, purpose).")
    xc = cast(x)
    if m.latent_dim is not None:
        h = fp8_lib.project("td,dl->tl", xc, cast(params["w_latent_down"]), cfg.fp8)
        h = cast(rms_norm(h, params["latent_norm"], cfg.norm_eps))  # [T, Dl]
    else:
        h = xc  # [T, D]
    experts = {name: cast(params[name]) for name in ("w_gate", "w_up", "w_down")}  # the backend rounds them for FP8

    routed, stats = dispatch(h, routing, experts)

    if m.latent_dim is not None:
        routed = fp8_lib.project("tl,ld->td", cast(routed), cast(params["w_latent_up"]), cfg.fp8)
    y = routed.astype(jnp.float32)

    if m.num_shared_experts > 0:
        y = y + swiglu(xc, *(cast(params[f"w_shared_{name}"]) for name in ("gate", "up", "down")), fp8=cfg.fp8)
    entropy = router_lib.routing_entropy(jax.lax.stop_gradient(routing.scores))
    if axes:  # a mean over equal slices of the tokens
        entropy = jax.lax.pmean(entropy, axes)
    stats = {**stats, "entropy": entropy, **balancing.balancer(m, axes).measure(routing, bias)}
    return y, stats
