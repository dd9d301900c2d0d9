"""FP8 matmuls (`model.fp8`, issue 53): the rounding is the formats' own grid with current scaling, a projection
and its gradients equal an explicit quantize-dequantize reference, every dispatch backend (ep on 8 devices
included) computes `dense`'s FP8 function, and what cannot run FP8 is refused before anything compiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import load_benchmark, relative_error, tiny_model

from moelab import presets
from moelab.config import MeshConfig, ModelConfig, RunConfig, TrainConfig, load_yaml, override
from moelab.errors import ConfigError
from moelab.model import fp8, transformer
from moelab.model.moe import Dispatch, build_moe
from moelab.parallel import mesh as mesh_lib
from moelab.train.step import loss_and_grad

FORMATS = {"e4m3": (fp8.E4M3, ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (fp8.E5M2, ml_dtypes.float8_e5m2, 57344.0)}


def _reference_qdq(x: np.ndarray, fmt: str, axis) -> np.ndarray:
    """The definition, in numpy with ml_dtypes' FP8 types: scale = max |x| / max (at least float32's smallest
    normal number), round x / scale, multiply back."""
    _, numpy_type, top = FORMATS[fmt]
    amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
    scale = np.maximum(amax / np.float32(top), np.finfo(np.float32).tiny).astype(np.float32)
    return (np.clip(x / scale, -top, top).astype(numpy_type).astype(np.float32) * scale).astype(np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", [-1, None])
def test_rounding_is_the_formats_grid_under_current_scaling(fmt, axis):
    """Heavy tails, an all-zero row and a row of ~1e-37 (whose max / the format's max is float32-subnormal, which
    a CPU flushes to zero: it made 0 / 0 = NaN before the scale had a floor): each row's (or the tensor's) largest
    |x| maps to the format's max exactly, the rest to its grid, zeros stay zero, nothing becomes NaN."""
    rng = np.random.default_rng(0)
    x = (rng.standard_t(2, (7, 40)) * np.geomspace(1e-3, 1e3, 7)[:, None]).astype(np.float32)
    x[2] = 0.0
    x[6] = rng.choice([-1.0, 1.0], 40) * rng.uniform(2e-38, 1e-37, 40)  # normal floats, as are their roundings
    got = np.asarray(fp8.quantize_dequantize(jnp.asarray(x), FORMATS[fmt][0], axis))
    # the same grid point everywhere; XLA may form amax / max as amax * (1 / max), a float32 ulp off numpy's scale,
    # while a different grid point would be an e5m2 or e4m3 step away (12.5-25%)
    np.testing.assert_allclose(got, _reference_qdq(x, fmt, axis), rtol=3e-7, atol=0)
    assert np.isfinite(got).all() and (got[2] == 0).all()
    if axis == -1:  # each row's largest magnitude survives exactly; the ~1e-37 row rounds on the grid, not to 0
        assert np.count_nonzero(got[6]) == 40
        rows = [0, 1, 3, 4, 5]
        np.testing.assert_allclose(np.abs(got[rows]).max(1), np.abs(x[rows]).max(1), rtol=1e-6)
    err = np.abs(got - x) / np.maximum(np.abs(x), 1e-30)
    assert 0 < np.median(err[x != 0]) < (0.07 if fmt == "e4m3" else 0.13)  # 3 and 2 mantissa bits


def test_an_fp8_projection_and_its_gradients_equal_the_explicit_reference():
    """y = Q4(x) @ Q4(w); the backward reads the output's gradient as Q5(g): dx = Q5(g) @ Q4(w)^T and
    dw = Q4(x)^T @ Q5(g) (Q4: e4m3 per row of x, per tensor of w; Q5: e5m2 per row of g)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 32)).astype(np.float32) * np.geomspace(0.1, 10, 16)[:, None].astype(np.float32)
    w = rng.standard_normal((32, 24)).astype(np.float32)
    g = rng.standard_normal((16, 24)).astype(np.float32)
    y, pullback = jax.vjp(lambda x, w: fp8.project("td,dh->th", x, w, True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(g))
    qx, qw, qg = _reference_qdq(x, "e4m3", -1), _reference_qdq(w, "e4m3", None), _reference_qdq(g, "e5m2", -1)
    assert relative_error(y, qx.astype(np.float64) @ qw) < 1e-6
    assert relative_error(dx, qg.astype(np.float64) @ qw.T) < 1e-6
    assert relative_error(dw, qx.T.astype(np.float64) @ qg) < 1e-6
    assert relative_error(y, x @ w) > 1e-3  # not vacuous: FP8 moved the result


def _fp8_model(backend: str, **moe) -> ModelConfig:
    return tiny_model(num_layers=3, dense_layers=1, fp8=True, qk_norm="head",
                      moe={"dispatch": backend, "capacity_factor": 2.0, "num_shared_experts": 1, "latent_dim": 16, **moe})


def _loss_and_grads(cfg, dispatch, grads: bool = True):
    """(loss, grads) of the 4x-scaled model on one fixed batch; (loss, None) with `grads` False (a forward only)."""
    params = jax.tree.map(lambda p: 4.0 * p, transformer.init(cfg, jax.random.key(0)))  # routing matters at 4x
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    bias = 0.05 * jax.random.normal(jax.random.key(2), (cfg.num_moe_layers, cfg.moe.num_experts))

    def loss(params):
        return transformer.loss(params, tokens, cfg, bias, jnp.float32, dispatch=dispatch)[0]

    return jax.jit(jax.value_and_grad(loss))(params) if grads else (jax.jit(loss)(params), None)


def _assert_same(got, want, what: str, bound: float = 1e-5) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        assert relative_error(a, b) < bound, f"{what}: d loss / {jax.tree_util.keystr(path)}"
    assert relative_error(got[0], want[0]) < bound, what


_DENSE_REFERENCE: dict = {}


def _dense_reference():
    if not _DENSE_REFERENCE:
        cfg = _fp8_model("dense")
        _DENSE_REFERENCE["fp8"] = _loss_and_grads(cfg, build_moe(cfg))
        plain = dataclasses.replace(cfg, fp8=False)
        _DENSE_REFERENCE["plain"] = _loss_and_grads(plain, build_moe(plain), grads=False)  # its loss alone is read
    return _DENSE_REFERENCE


@pytest.mark.parametrize("backend", ["capacity", "dropless"])
def test_every_backend_computes_denses_fp8_function(backend):
    """A dense first block, QK-norm, LatentMoE and a shared expert: every projection and expert GEMM in FP8. Rows
    round per row, so each backend's rows round as the oracle's do: loss and every gradient agree to float32
    round-off, while FP8 moves the loss itself. (`grouped` has no FP8 path: the config refuses it, below.)"""
    reference = _dense_reference()
    cfg = _fp8_model(backend)
    got = _loss_and_grads(cfg, build_moe(cfg))
    _assert_same(got, reference["fp8"], backend)
    assert relative_error(reference["fp8"][0], reference["plain"][0]) > 1e-3


@pytest.mark.slow
def test_ep_on_eight_devices_computes_the_single_device_fp8_function():
    """`ep` on 2 x 4 devices with FP8 experts equals `capacity` on one device with room for every row: each row
    rounds alike on whichever device it lands. At init scale: the 4x-scaled model of the test above is chaotic
    enough that ep's other float32 summation order (1e-7) turns over e5m2 roundings of the gradients (a 25% step
    each) and the gradients part by up to 4%; unscaled they agree to 7e-7 while FP8 moves them ~10% from float32.
    `slow`: two 2 x 4 compiles, ~14 s on 2 cores, and `make test` stands at 7 of its 8 minutes; the fast suite
    keeps every single-device backend against `dense` (above), and `ep` against `dense` in bf16 (test_parallel)."""
    model = _fp8_model("ep", capacity_factor=8.0, transport_capacity_factor=8.0)
    cfg = RunConfig(model=model, train=TrainConfig(batch_size=8), mesh=MeshConfig(replica=2, expert=4))
    single = override(cfg, {"model.moe.dispatch": "capacity", "mesh.replica": 1, "mesh.expert": 1})
    params = transformer.init(model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, model.seq_len + 1), 0, model.vocab_size)
    bias = 0.05 * jax.random.normal(jax.random.key(2), (model.num_moe_layers, model.moe.num_experts))

    def run(cfg, mesh=None):
        (loss, _), grads = jax.jit(loss_and_grad(cfg, mesh))(params, tokens, (bias, jnp.bool_(False)))
        return loss, grads

    _assert_same(run(cfg, mesh_lib.make_mesh(cfg.mesh)), run(single), "ep")


def test_a_dispatch_built_without_fp8_cannot_run_an_fp8_models_experts():
    cfg = _fp8_model("capacity")
    with pytest.raises(ValueError, match=r"model.fp8=True, but the dispatch was built with fp8=False"):
        _loss_and_grads(cfg, Dispatch("capacity", capacity_factor=cfg.moe.capacity_factor))
    with pytest.raises(ConfigError, match="model.fp8"):
        ModelConfig(fp8="yes")


class _Device:
    def __init__(self, capability: str):
        self.compute_capability = capability


@pytest.mark.parametrize("capability, backend, refused", [
    ("8.0", "capacity", "compute capability 8.9"), ("9.0", "grouped", "dispatch=capacity"), ("9.0", "capacity", None),
])
def test_a_gpu_that_cannot_run_fp8_is_refused_before_compiling_naming_the_field(capability, backend, refused,
                                                                                 monkeypatch):
    """An A100 (8.0) has no FP8 tensor cores: refused by name when the dispatch is built, before any trace. The
    Pallas grouped GEMM has no FP8 path: the config itself refuses it, on any machine (so `moelab plan` on a CPU
    says what a GPU launch would). An H100 / H200 (9.0) with `capacity` runs."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(capability)])
    if refused is None:
        assert build_moe(_fp8_model(backend)).fp8
        return
    with pytest.raises(ConfigError, match=rf"model.fp8=true.*{refused}"):
        build_moe(_fp8_model(backend))


def test_fp8_with_the_grouped_backend_is_refused_by_the_config_on_a_cpu_too():
    with pytest.raises(ConfigError, match=r"model.fp8=true with model.moe.dispatch='grouped'.*dispatch=capacity"):
        _fp8_model("grouped")


def test_tile_scales_keep_a_small_tile_that_a_row_scale_flushes_to_zero():
    """`benchmarks/fp8_error.py`'s "tiles 128" (DeepSeek-V3's 1x128): a row whose first tile holds 1e3 flushes the
    second tile's 1e-4 values to zero under one scale per row (1e-4 / (1e3 / 448) is below e4m3's smallest
    subnormal, 2^-9); on its own scale each tile rounds to e4m3's relative grid (error <= 2^-4)."""
    tiles = load_benchmark("fp8_error")._tiles(128)
    x = np.concatenate([np.full(128, 1e3), np.linspace(1e-4, 2e-4, 128)]).astype(np.float32)[None]
    row, scale = fp8._quantize(jnp.asarray(x), fp8.E4M3, -1)
    assert not np.any(np.asarray(row.astype(jnp.float32) * scale)[0, 128:])
    q, unit = tiles(jnp.asarray(x), fp8.E4M3, -1)
    assert np.all(np.asarray(unit) == 1.0)
    np.testing.assert_allclose(np.asarray(q)[0, 128:], x[0, 128:], rtol=2.0**-4)
    w = np.random.default_rng(0).normal(size=(2, 200, 130)).astype(np.float32)
    w[0, 0, 0] = 1e4  # one expert's block (0, 0) only: the other blocks keep their own scale
    qw, _ = tiles(jnp.asarray(w), fp8.E4M3, (1, 2))
    np.testing.assert_allclose(np.asarray(qw)[0, 128:, 128:], w[0, 128:, 128:], rtol=2.0**-4)


@pytest.mark.slow
def test_the_fp8_error_table_has_every_parameter_and_fp8_above_bf16():
    """`benchmarks/fp8_error.py` on a one-layer tiny at init: a row per parameter (per layer), and bf16's gradient
    error below FP8's (measured on tiny at init: 0.007 against 0.059). `slow`: three compiles of the model's
    value_and_grad (float32, bf16, FP8), ~14 s on 2 cores; the fast tier keeps the tile variant's own test."""
    bench = load_benchmark("fp8_error")
    cfg = presets.resolve("tiny", {"model.num_layers": 1, "model.seq_len": 32})
    params = transformer.init(cfg.model, jax.random.key(0))
    result = bench.measure(cfg, params, transformer.init_router_bias(cfg.model), bench.batches(cfg, 1, 4),
                           ["fp8"])
    rows = result["variants"]
    assert set(rows) == {"bf16", "fp8"}
    assert len(rows["fp8"]["gradient_error"]) == len(jax.tree.leaves(params))  # one layer: one row each
    assert rows["bf16"]["mean_gradient_error"] < rows["fp8"]["mean_gradient_error"]


@pytest.mark.slow
def test_tiny_in_fp8_ends_within_the_bf16_seeds_spread(tmp_path):
    """`benchmarks/fp8_loss.py`: tiny, 300 steps from seeds 0, 1, 2, each in bf16 and in FP8 (issue 61's bar).

    The FP8 seeds' mean eval/mean lies within the bf16 seeds' [min, max]. Measured 2026-12-07 (2 cores): bf16
    1.8593 / 1.8209 / 1.8267, FP8 1.8653 / 1.8152 / 1.8299 (mean 1.8368, inside [1.8209, 1.8593]); paired by seed,
    FP8 - bf16 = +0.06% +- 0.19% (standard error). The 2.2% of issue 53 compared FP8 seed 0 with the bf16 mean,
    and seed 0 is the highest bf16 seed. A broken scale or format moves the loss by far more than the spread.
    Under this test's 8 simulated devices: bf16 1.8632 / 1.8107 / 1.8174, FP8 1.8677 / 1.8116 / 1.8294 (mean
    1.8362). `slow`: six 300-step runs, ~10 minutes on 2 cores here (the simulated devices slow each run to ~1.5
    minutes; ~45 s alone)."""
    result = load_benchmark("fp8_loss").compare("tiny", 300, 3, tmp_path)
    evals = [r["eval_mean"] for r in result["bf16"]]
    fp8_mean = sum(r["eval_mean"] for r in result["fp8_runs"]) / 3
    assert min(evals) <= fp8_mean <= max(evals), (fp8_mean, evals)
    assert result["fp8_inside_seed_range"]
    # It ran in FP8: each seed's initial eval reads the same weights and batches both ways, so only the FP8 GEMMs
    # can move it; and the runs' own configs say so.
    for plain, rounded in zip(result["bf16"], result["fp8_runs"]):
        assert rounded["eval_initial"] != plain["eval_initial"]
    assert load_yaml(tmp_path / "fp8-seed0" / "config.yaml").model.fp8
