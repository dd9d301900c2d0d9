"""The GPU benchmark suite's logic on CPU: tiny shapes, every output file and key, and its arithmetic.

The suite itself (`benchmarks/gpu_suite.sh`) runs in tiny mode into a temporary folder; compiled
programs are cached across test runs in the system temp folder, so a warm run takes ~20 s and a
cold one (8 train steps to compile) about a minute on two idle cores.
"""

from __future__ import annotations

import collections
import json
import re
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_benchmark
from moelab import accounting, presets
from moelab.model import transformer
from moelab.model.moe import build_moe
from moelab.train import memory_plan
from moelab.train.state import init_state

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


mfu = load_benchmark("mfu")
moe_layer = load_benchmark("moe_layer")
profile_summary = load_benchmark("profile_summary")
suite_table = load_benchmark("suite_table")

MFU_KEYS = {"preset", "backend", "status", "step_time_s", "tokens_per_s", "flops_per_token", "model_flops_per_step",
            "mfu_datasheet", "mfu_measured_peak", "matmul_peak_flops", "peak_memory_bytes", "batch_size", "seq_len"}
LAYER_KEYS = {"seconds", "useful_tflops_per_s", "drop_fraction", "peak_memory_bytes", "status"}


@pytest.mark.slow
def test_suite_tiny_writes_every_file_and_the_table(tmp_path):
    """The whole GPU suite script at tiny shapes on the CPU, so it stays ready for a lent device (issue 9).

    `slow` (issue 27): ~50 s of subprocesses on 2 cores; CI runs it (`make test-slow`), and the fast suite
    keeps each part's logic (profile parsing, targets, merging, the CUDA lowering checks below)."""
    env = {**os.environ, "MOELAB_SUITE_TINY": "1", "MOELAB_PYTHON": sys.executable,
           "MOELAB_JAX_CACHE": str(Path(tempfile.gettempdir()) / "moelab-jax-cache-tests")}
    env.pop("XLA_FLAGS", None)  # one CPU device, as on the GPU machine; not conftest's eight
    proc = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), str(tmp_path)], env=env, capture_output=True, check=False,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in suite_table.EXPECTED_FILES:
        result = json.loads((tmp_path / name).read_text())
        assert result["status"] == "ok", (name, result.get("error"))
    matmul = json.loads((tmp_path / "matmul.json").read_text())
    assert matmul["matmul_peak_flops"] > 0 and {"matmul_n", "fraction_of_datasheet"} <= set(matmul)
    layer = json.loads((tmp_path / "moe_layer.json").read_text())
    assert set(layer["backends"]) == {"capacity", "grouped", "dropless", "ep", "grouped[16x32x16w4s3]",
                                      "grouped[16x32x16w4s3-rows-unfused]", "capacity-fp8"}
    for backend in layer["backends"].values():
        assert LAYER_KEYS <= set(backend)
    for backend in ("capacity", "grouped"):  # the first part ran with --profile
        _assert_profile(layer["backends"][backend]["profile"])
    assert layer["check"]["passed"] and layer["check"]["max_relative_error"] < 1e-3  # float32 accumulation
    assert "max relative error" in proc.stdout
    breakdown = layer["breakdown"]
    assert breakdown["ideal_batched_matmul"]["useful_tflops_per_s"] > 0
    for backend in moe_layer.BREAKDOWN_BACKENDS:
        parts = breakdown[backend]["parts"]
        assert set(parts) == {"router", "backend_at_width_16", "expert_matmuls"}
        assert all(part["seconds"] > 0 for part in parts.values())
    for preset, backend in suite_table.MFU_RUNS:
        result = json.loads((tmp_path / f"mfu_{preset}_{backend}.json").read_text())
        assert MFU_KEYS <= set(result), MFU_KEYS - set(result)
        assert (result["preset"], result["backend"], result["tiny"]) == (preset, backend, True)
        assert np.isfinite(result["final_loss"]) and result["tokens_per_s"] > 0
        assert result["attention"] == "xla"  # cuDNN is for GPUs
        _assert_profile(result["profile"])
    # The table comes last and shows every run.
    table = proc.stdout[proc.stdout.index("Train step"):]
    assert table.count("ok (tiny)") == len(suite_table.MFU_RUNS)
    assert "| grouped | expert_matmuls |" in proc.stdout
    assert "| layer grouped |" in proc.stdout and "| gpu-medium grouped |" in proc.stdout  # the profile table
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["jax"] == jax.__version__ and len(record["commit"] or "") == 40
    assert set(record["mfu"]) == {f"{p}:{b}" for p, b in suite_table.MFU_RUNS}
    assert [t["verdict"] for t in record["targets"]] == ["n/a (no GPU)"] * 7
    fp8 = json.loads((tmp_path / "fp8_loss.json").read_text())  # issue 53: the same seed, bf16 and FP8
    assert fp8["fp8"]["fp8"] and not fp8["bf16"][0]["fp8"] and fp8["fp8"]["loss"] != fp8["bf16"][0]["loss"]
    assert "FP8 against bf16 (tiny, 2 steps, seed 0)" in proc.stdout


def _assert_profile(profile: dict) -> None:
    """A traced run's summary: kernels with time, categories that account for all of it."""
    assert profile["kernel_ms_per_call"] > 0 and profile["top"]
    assert sum(c["share"] for c in profile["categories"].values()) == pytest.approx(1.0)
    assert all(t["ms"] > 0 and t["category"] in profile["categories"] for t in profile["top"])


@pytest.mark.parametrize("kernel, expected", [
    ("gmm_dx", "grouped GEMM (Pallas)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("gemm_fusion_dot_123", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_wgmma_f16", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_wgmma_tilesize128x256x64", "matmul"),
    ("ncclDevKernel_SendRecv", "collectives"),
    ("loop_gather_fusion_4", "row moves"),
    ("void cub::DeviceRadixSortOnesweepKernel", "sort"),
    ("input_reduce_fusion_7", "other XLA kernels"),
])
def test_profile_categories_name_gpu_kernels(kernel, expected):
    assert profile_summary.category(kernel) == expected
    # The suite's table shows every category the rules can give, once.
    assert sorted(profile_summary.LABELS) == sorted([label for label, _ in profile_summary.CATEGORIES]
                                                    + [profile_summary.OTHER])


def test_profile_summary_reads_the_gpu_streams_and_not_the_op_lines():
    """A GPU trace's device plane: kernels on stream lines; the "XLA Ops" line repeats their time by HLO op."""
    Event = collections.namedtuple("Event", "name duration_ns")
    Line = collections.namedtuple("Line", "name events")
    Plane = collections.namedtuple("Plane", "name lines")
    gpu = Plane("/device:GPU:0", [
        Line("Stream #13(Compute)", [Event("gmm", 3e6), Event("gmm_dx", 2e6), Event("loop_gather_fusion", 1e6),
                                     Event("gmm", 3e6)]),
        Line("XLA Ops", [Event("custom-call.1", 9e6)]),
    ])
    host = Plane("/host:CPU", [Line("tf_XLA", [Event("should_not_count", 5e6)])])
    summary = profile_summary.summarize([host, gpu], calls=2)
    assert summary["plane"] == "/device:GPU:0"
    assert summary["kernel_ms_per_call"] == pytest.approx(4.5)
    assert summary["top"][0] == {"name": "gmm", "category": "grouped GEMM (Pallas)", "ms": 3.0, "share": 6 / 9,
                                 "launches_per_call": 1.0}
    assert summary["categories"]["row moves"]["ms"] == pytest.approx(0.5)


def test_a_failing_profiler_costs_the_profile_not_the_run(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")

    monkeypatch.setattr(jax.profiler, "trace", broken)
    assert profile_summary.profile_call(lambda: jnp.ones(2)) == {
        "error": "RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"}


@pytest.mark.slow
def test_runs_killed_while_profiling_keep_their_timing(tmp_path, monkeypatch):
    """The suite caps each run; the figures are on disk before the profile starts.

    `slow` (issue 27): two timed runs, ~35 s on 2 cores; the fast suite keeps a failing profiler costing
    only the profile (test_a_failing_profiler_costs_the_profile_not_the_run)."""
    class Killed(BaseException):  # what a timeout's SIGKILL would end: nothing after it runs
        pass

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(mfu, "profile_call", killed)
    args = mfu.argparse.Namespace(steps=1, warmup=0, windows=1, budget_s=1.0, profile=True, out_dir=str(tmp_path),
                                  tiny=True, batch_size=None)
    with pytest.raises(Killed):
        mfu.run_one("gpu-small", "capacity", args, {"n": 256, "flops_per_s": 1e9})
    kept = json.loads((tmp_path / "mfu_gpu-small_capacity.json").read_text())
    assert kept["status"] == "ok" and kept["step_time_s"] > 0 and kept["tokens_per_s"] > 0
    assert kept["profile"] == {"error": "killed before the profile finished"}

    # The layer benchmark likewise.
    monkeypatch.setattr(moe_layer, "profile_call", killed)
    out = tmp_path / "moe_layer.json"
    monkeypatch.setattr(sys, "argv", ["moe_layer.py", "--tokens", "256", "--d", "64", "--experts", "8", "--topk",
                                      "2", "--width", "32", "--iters", "1", "--backends", "capacity", "--profile",
                                      "--out", str(out)])
    with pytest.raises(Killed):
        moe_layer.main()
    layer = json.loads(out.read_text())["backends"]["capacity"]
    assert layer["status"] == "ok" and layer["useful_tflops_per_s"] > 0
    assert layer["profile"] == {"error": "killed before the profile finished"}


def test_mfu_remeasures_on_xla_attention_when_cudnn_fails_to_compile(monkeypatch):
    """A cuDNN failure past its trace-time checks costs a re-measurement, not the run; the note says why."""
    monkeypatch.setattr(transformer, "_attention_implementation", lambda dtype: "cudnn")
    seen = []

    def fake_timing(cfg, *args):
        seen.append(transformer._attention_implementation(jnp.bfloat16))
        if seen[-1] == "cudnn":
            raise RuntimeError("cuDNN graph failed to build")
        return {"step_time_s": 1.0}

    monkeypatch.setattr(mfu, "time_train_step", fake_timing)
    args = mfu.argparse.Namespace(steps=1, warmup=0, windows=1, budget_s=1.0, profile=False)
    timing, attention = mfu.timed_with_attention(presets.get("gpu-small"), args)
    assert seen == ["cudnn", None] and timing == {"step_time_s": 1.0}
    assert attention["attention"] == "xla" and "cuDNN graph failed" in attention["attention_note"]
    assert transformer._attention_implementation(jnp.bfloat16) == "cudnn"  # restored afterwards

    def other_failure(cfg, *args):
        raise MemoryError("out of memory")

    monkeypatch.setattr(mfu, "time_train_step", other_failure)
    with pytest.raises(MemoryError):
        mfu.timed_with_attention(presets.get("gpu-small"), args)


def _fake_suite(out: Path, layer_tflops: float, mfu_by_backend: dict, tokens_per_s: dict) -> None:
    (out / "matmul.json").write_text(json.dumps({"status": "ok", "platform": "gpu"}))
    (out / "moe_layer.json").write_text(json.dumps({"backends": {
        "capacity": {"status": "ok", "useful_tflops_per_s": layer_tflops},
        "dropless": {"status": "error", "error": "out of memory"}}}))
    for preset in suite_table.MOE_PRESETS:
        for backend, value in mfu_by_backend.items():
            (out / f"mfu_{preset}_{backend}.json").write_text(json.dumps(
                {"status": "ok", "mfu_datasheet": value, "tokens_per_s": tokens_per_s[backend]}))
        (out / f"mfu_{preset}-dense_dense.json").write_text(json.dumps({"status": "ok", "tokens_per_s": 1000.0}))


def test_targets_take_the_best_finished_run_and_judge_it_against_each_bar(tmp_path):
    _fake_suite(tmp_path, 480.0, {"capacity": 0.40, "grouped": 0.46}, {"capacity": 800.0, "grouped": 900.0})
    got = {t["target"]: (t["best_run"], t["value"], t["verdict"]) for t in suite_table.targets(tmp_path)}
    assert got["MoE layer useful TFLOP/s"] == ("capacity", 480.0, "met")
    assert got["gpu-medium MFU (989 TFLOP/s)"] == ("grouped", 0.46, "met")
    assert got["gpu-medium MoE / dense tokens/s"] == ("grouped", 0.9, "met")
    _fake_suite(tmp_path, 400.0, {"capacity": 0.30}, {"capacity": 800.0})
    (tmp_path / "mfu_gpu-medium_grouped.json").write_text(json.dumps({"status": "timeout"}))
    got = {t["target"]: (t["best_run"], t["value"], t["verdict"]) for t in suite_table.targets(tmp_path)}
    assert got["MoE layer useful TFLOP/s"][2] == "missed"
    assert got["gpu-medium MFU (989 TFLOP/s)"] == ("capacity", 0.30, "missed")
    assert got["gpu-small MoE / dense tokens/s"] == ("grouped", 0.9, "met")  # gpu-small's grouped file is still there
    assert got["gpu-medium MoE / dense tokens/s"] == ("capacity", 0.8, "missed")
    (tmp_path / "moe_layer.json").unlink()
    assert suite_table.targets(tmp_path)[0]["verdict"] == "not measured"


def _layer_file(out: Path, check_passed: bool | None, tokens: int = 16384) -> None:
    layer = {"tokens": tokens, "d": 2048, "experts": 64, "topk": 8, "width": 1024, "backends": {
        "capacity": {"status": "ok", "useful_tflops_per_s": 300.0},
        "grouped": {"status": "ok", "useful_tflops_per_s": 500.0}}}
    if check_passed is not None:
        layer["check"] = {"status": "ok", "passed": check_passed, "max_relative_error": 0.003 if check_passed else 1.0}
    (out / "moe_layer.json").write_text(json.dumps(layer))


def test_a_grouped_speed_counts_only_when_its_kernel_passed_the_check(tmp_path):
    _fake_suite(tmp_path, 0.0, {"capacity": 0.3}, {"capacity": 800.0})
    for passed, want in ((True, ("grouped", 500.0, "met")), (False, ("capacity", 300.0, "missed")),
                         (None, ("capacity", 300.0, "missed"))):
        _layer_file(tmp_path, passed)
        [layer_target] = [t for t in suite_table.targets(tmp_path) if t["target"].startswith("MoE layer")]
        assert (layer_target["best_run"], layer_target["value"], layer_target["verdict"]) == want, passed


def test_targets_see_the_gpu_in_any_run_and_refuse_tiny_shapes(tmp_path):
    _fake_suite(tmp_path, 0.0, {"capacity": 0.5}, {"capacity": 900.0})
    _layer_file(tmp_path, True)
    (tmp_path / "matmul.json").write_text(json.dumps({"status": "timeout"}))  # the matmul run was killed
    (tmp_path / "mfu_gpu-medium_capacity.json").write_text(json.dumps(
        {"status": "ok", "platform": "gpu", "mfu_datasheet": 0.5, "tokens_per_s": 900.0}))
    verdicts = {t["target"]: t["verdict"] for t in suite_table.targets(tmp_path)}
    assert {v for t, v in verdicts.items() if "FP8" not in t} == {"met"}
    assert {v for t, v in verdicts.items() if "FP8" in t} == {"not measured"}  # no FP8 run in this suite
    _layer_file(tmp_path, True, tokens=256)  # a GPU run with MOELAB_SUITE_TINY=1
    assert {t["verdict"] for t in suite_table.targets(tmp_path)} == {"n/a (tiny shapes)"}


def test_fp8_targets_compare_each_fp8_run_with_its_bf16_twin(tmp_path):
    """Issue 53's bars: the FP8 layer's speed over bf16 `capacity`'s (time ratio), gpu-medium's FP8 tokens/s over
    bf16's, and |FP8 - bf16| of the comparison run's final loss, which is met at or below its bar."""
    _fake_suite(tmp_path, 400.0, {"capacity": 0.3, "capacity-fp8": 0.33}, {"capacity": 1000.0, "capacity-fp8": 1100.0})
    layer = json.loads((tmp_path / "moe_layer.json").read_text())
    layer["backends"] |= {"capacity": {"status": "ok", "seconds": 0.002}, "capacity-fp8": {"status": "ok", "seconds": 0.0015}}
    (tmp_path / "moe_layer.json").write_text(json.dumps(layer))
    for loss, verdict in ((0.001, "met"), (-0.004, "missed")):
        (tmp_path / "fp8_loss.json").write_text(json.dumps({"status": "ok", "fp8_vs_bf16_loss": loss}))
        got = {t["target"]: (t["value"], t["verdict"]) for t in suite_table.targets(tmp_path)}
        assert got["FP8 / bf16 expert layer speed"] == (pytest.approx(4 / 3), "met")
        assert got["gpu-medium FP8 / bf16 tokens/s"] == (pytest.approx(1.1), "missed")
        assert got["|FP8 - bf16| final loss"] == (abs(loss), verdict)


def test_mfu_arithmetic_comes_from_accounting():
    cfg = presets.get("gpu-small")
    timing = {"step_time_s": 0.25}
    result = mfu.report(cfg, timing, {"n": 8192, "flops_per_s": 700e12})
    tokens = cfg.train.batch_size * cfg.model.seq_len
    assert result["tokens_per_step"] == tokens
    assert result["tokens_per_s"] == pytest.approx(tokens / 0.25)
    assert result["model_flops_per_step"] == accounting.flops_per_token(cfg.model) * tokens
    assert result["mfu_datasheet"] == pytest.approx(accounting.flops_per_token(cfg.model) * tokens / 0.25 / 989e12)
    assert result["mfu_measured_peak"] == pytest.approx(result["mfu_datasheet"] * 989 / 700)
    # Every device run records the planner's total beside its measured peak (issue 49); here, off a GPU, as CPU compiles.
    assert result["planned_memory_bytes"] == memory_plan.plan(cfg, platform="cpu").total


@pytest.mark.parametrize("name", ["gpu-small", "gpu-medium"])
def test_dense_counterparts_match_active_flops(name):
    moe_cfg, dense_cfg = presets.get(name), presets.get(f"{name}-dense")
    ratio = accounting.flops_per_token(dense_cfg.model) / accounting.flops_per_token(moe_cfg.model)
    assert abs(ratio - 1) < 0.01
    m = dense_cfg.model.moe
    assert (m.num_experts, m.num_experts_per_token, m.dispatch, m.num_shared_experts, m.latent_dim) == (1, 1, "dense",
                                                                                                       0, None)
    same = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "seq_len", "vocab_size")
    assert all(getattr(dense_cfg.model, f) == getattr(moe_cfg.model, f) for f in same)
    assert dense_cfg.train == moe_cfg.train
    # The tiny dense counterpart the suite runs on CPU matches its shrunk MoE too.
    tiny_dense = mfu.resolve_config(f"{name}-dense", "dense", True, None)
    tiny_moe = mfu.resolve_config(name, "capacity", True, None)
    assert accounting.flops_per_token(tiny_dense.model) == pytest.approx(accounting.flops_per_token(tiny_moe.model),
                                                                         rel=0.01)


def test_gpu_presets_shapes():
    small, medium = presets.get("gpu-small").model, presets.get("gpu-medium").model
    for m, d, width, seq in ((small, 1024, 512, 2048), (medium, 2048, 1024, 4096)):
        assert (m.d_model, m.resolved_head_dim, m.num_heads // m.num_kv_heads, m.seq_len) == (d, 128, 4, seq)
        assert (m.moe.num_experts, m.moe.num_experts_per_token, m.moe.expert_dim, m.moe.latent_dim) == (64, 8, width,
                                                                                                        width)
        assert (m.moe.num_shared_experts, m.moe.resolved_shared_expert_dim, m.moe.dispatch, m.moe.balancing) == (2, width, "capacity",
                                                                                                 "hist")
    assert presets.get("gpu-small").train.compute_dtype == "bfloat16"


def test_layer_useful_flops():
    assert moe_layer.useful_flops(16384, 8, 2048, 1024) == 6 * 16384 * 8 * 3 * 2048 * 1024


def test_layer_tile_variants_parse_and_reject_typos():
    assert moe_layer.parse_variant("128x256x64w8s3") == {
        "tiles": {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3,
                  "rows_together": True},
        "fuse_gather": True}
    assert moe_layer.parse_variant("128x256x64w8s3-rows")["tiles"]["rows_together"] is False
    assert moe_layer.parse_variant("128x256x64w8s3-unfused")["fuse_gather"] is False
    both = moe_layer.parse_variant("128x256x64w8s3-rows-unfused")
    assert (both["tiles"]["rows_together"], both["fuse_gather"]) == (False, False)
    for variant in moe_layer.GROUPED_VARIANTS:  # the defaults divide the benchmark's shape (d 2048, width 1024)
        t = moe_layer.parse_variant(variant)["tiles"]
        assert 2048 % t["block_k"] == 0 and 1024 % t["block_n"] == 0 and 1024 % t["block_k"] == 0
        # and fit 227 KiB of shared memory: the largest bf16 tiles per pipeline stage (dx: dy + w; dw: x + dy)
        per_stage = 2 * max(t["block_m"] * t["block_n"] + t["block_k"] * t["block_n"],
                            t["block_m"] * t["block_k"] + t["block_m"] * t["block_n"])
        assert per_stage * t["num_stages"] <= 227 * 1024, variant
    for typo in ("128x128", "128x128x64w4s3-cols", "128x128x64w4s3-unfused-rows"):
        with pytest.raises(SystemExit, match="BMxBNxBK"):
            moe_layer.parse_variant(typo)


# `slow` (issue 27): gpu-small's forward and backward compiled twice per policy, ~20-30 s on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_keeps_the_function(remat):
    cfg = mfu.resolve_config("gpu-small", "capacity", True, None).model
    params = transformer.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.vocab_size)
    bias = transformer.init_router_bias(cfg)

    def loss_and_grads(model_cfg):
        fn = lambda p: transformer.loss(p, tokens, model_cfg, bias, jnp.float32, dispatch=build_moe(model_cfg))[0]
        return jax.jit(jax.value_and_grad(fn))(params)

    (ref, ref_grads), (got, got_grads) = loss_and_grads(cfg), loss_and_grads(replace(cfg, remat=remat))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_attention_uses_the_default_off_gpu():
    assert transformer._attention_implementation(jnp.bfloat16) is None  # this CPU session
    assert transformer._attention_implementation(jnp.float32) is None


@pytest.mark.slow
def test_attention_falls_back_to_xla_with_a_warning_when_cudnn_declines(monkeypatch):
    """Asked for cuDNN on this CPU machine, the kernel declines at trace time ("cuDNN is not detected");
    the step still gets XLA's attention, and a warning says why.

    `slow` (issue 27): ~9 s of compile on 2 cores; the fast suite keeps the default off GPU (above) and the
    CUDA lowering of the gpu-medium step (below)."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, n, 8), jnp.bfloat16) for i, n in enumerate((4, 2, 2)))
    want = transformer.causal_attention(q, k, v)
    monkeypatch.setattr(transformer, "_attention_implementation", lambda dtype: "cudnn")
    with pytest.warns(UserWarning, match="cudnn attention declined"):
        got = jax.jit(transformer.causal_attention)(q, k, v)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# Not `dropless`: on a GPU it is refused before lowering (tests/test_dispatch.py, issue 39).
@pytest.mark.parametrize("backend", ["grouped", "capacity", "ep"])
def test_gpu_medium_train_step_lowers_for_cuda_donated_and_without_host_callbacks(backend, monkeypatch):
    """The real gpu-medium step (full shapes, abstract arrays) exported for CUDA on this CPU machine.

    Catches what would otherwise fail only on the GPU: an op the Triton or CUDA lowering rejects, a
    tile that does not divide a real width. Also pins two speed properties of the step: the old
    state's buffers are donated (the outputs alias them) and nothing calls back to the host. With the
    default backend patched to "gpu", `grouped` takes its GPU tiles and compiled kernels; attention
    stays on XLA's path (cuDNN's lowering needs the library, absent here).
    """
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(transformer, "_attention_implementation", lambda dtype: None)
    cfg = mfu.resolve_config("gpu-medium", backend, False, None)
    step = mfu.make_train_step(cfg, mfu.mesh_lib.make_mesh(cfg.mesh))
    state = jax.eval_shape(lambda: init_state(cfg))
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32)
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(step, platforms=["cuda"], disabled_checks=disabled)(state, tokens).mlir_module()
    kernels = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?\bname = "(\w+)"', text)
    # One scanned layer body: 3 kernels forward, 6 backward; remat "dots" keeps the forward outputs (named
    # EXPERT_MATMUL) as it keeps XLA's dots, rather than running the 3 forward kernels again.
    assert cfg.model.remat == "dots"
    assert sorted(kernels) == (["gmm"] * 3 + ["gmm_dw"] * 3 + ["gmm_dx"] * 3 if backend == "grouped" else [])
    assert text.count("tf.aliasing_output") == len(jax.tree.leaves(state))  # every state buffer is reused
    targets = set(re.findall(r"custom_call @([\w$.]+)", text))
    assert not [t for t in targets if "callback" in t.lower()], targets


def _layer_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "moe_layer.py"), "--tokens", "256", "--d", "64", "--experts",
                           "8", "--topk", "2", "--width", "32", "--iters", "1", "--budget-s", "0.1", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_layer_merge_after_a_first_part_that_timed_out_starts_afresh(tmp_path):
    """The suite leaves a stub when the first part is killed; the second part must still record its runs."""
    out = tmp_path / "moe_layer.json"
    out.write_text(json.dumps({"benchmark": "moe_layer", "status": "timeout", "error": "killed after 100s"}))
    proc = _layer_cli("--backends", "capacity", "--merge", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and set(result["backends"]) == {"capacity"} and result["tokens"] == 256


def test_layer_merge_refuses_results_of_another_shape(tmp_path):
    out = tmp_path / "moe_layer.json"
    out.write_text(json.dumps({"tokens": 999, "d": 64, "experts": 8, "topk": 2, "width": 32, "capacity_factor": 1.15,
                               "backends": {}}))
    proc = _layer_cli("--backends", "", "--merge", "--out", str(out))
    assert proc.returncode != 0 and "another shape (tokens=999" in proc.stderr
    assert json.loads(out.read_text())["tokens"] == 999  # left as it was


@pytest.mark.parametrize("script, argv, message", [
    ("mfu", ["--run", "nope:capacity", "--out-dir", "."], "unknown preset 'nope'"),
    ("mfu", ["--preset", "gpu-small", "--backend", "dense", "--tiny"], "--backend dense does not fit preset gpu-small"),
    ("moe_layer", ["--grouped-variants", "12x"], "is not BMxBNxBKwWARPSsSTAGES"),
    ("suite_table", ["/nonexistent-outdir"], "is not a folder"),
])
def test_benchmark_scripts_exit_2_on_bad_arguments_before_any_work(script, argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        {"mfu": mfu, "moe_layer": moe_layer, "suite_table": suite_table}[script].main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_mfu_makes_an_out_dir_that_does_not_exist_yet(tmp_path, monkeypatch, capsys):
    """Issue 39: `--out-dir` of a new folder was a traceback at the end of the run."""
    out = tmp_path / "new" / "folder"
    monkeypatch.setattr(sys, "argv", ["mfu.py", "--matmul-only", "--tiny", "--out-dir", str(out), "--json"])
    mfu.main()
    assert json.loads((out / "matmul.json").read_text())["status"] == "ok"


# A stand-in for the suite's python on the GPU path: it logs each call, writes the files the real script would
# (status ok), sleeps $FAKE_SLEEP seconds when asked, and hands suite_table.py to the real interpreter.
FAKE_PYTHON = r'''#!/usr/bin/env bash
case "$*" in *suite_table.py*) exec "$REAL_PYTHON" "$@";; esac
echo "$*" >> "$FAKE_LOG"
out_dir="" out="" runs=()
while [ $# -gt 0 ]; do
  case "$1" in --out-dir) out_dir=$2; shift;; --out) out=$2; shift;; --run) runs+=("$2"); shift;;
               --json-out) fp8_out=$2; shift;; --matmul-only) runs+=(matmul);; esac; shift
done
if [ -n "${fp8_out:-}" ]; then
  echo '{"status": "ok", "preset": "gpu-small", "steps": 150, "bf16": [{"loss": 2.0, "eval_mean": 2.1}],'\
' "fp8": {"loss": 2.002, "eval_mean": 2.101}, "fp8_vs_bf16_loss": 0.001, "fp8_vs_bf16_eval": 0.0005}' > "$fp8_out"
fi
for r in "${runs[@]}"; do
  # Each run advances the suite's clock (MOELAB_SUITE_CLOCK) by FAKE_SECONDS: its budget, not the machine's speed.
  [ -n "${FAKE_SECONDS:-}" ] && echo $(( $(cat "$MOELAB_SUITE_CLOCK") + FAKE_SECONDS )) > "$MOELAB_SUITE_CLOCK"
  if [ "$r" = matmul ]; then
    echo '{"status": "ok", "device": "fake", "matmul_n": 8, "matmul_peak_flops": 1e12, "fraction_of_datasheet": 0.001}' \
      > "$out_dir/matmul.json"
  else
    printf '{"status": "ok", "preset": "%s", "backend": "%s", "batch_size": 1, "seq_len": 8, "step_time_s": 1.0, '\
'"tokens_per_s": 8.0, "mfu_datasheet": 0.1, "mfu_measured_peak": 0.2}\n' "${r%%:*}" "${r##*:}" \
      > "$out_dir/mfu_${r%%:*}_${r##*:}.json"
  fi
done
[ -n "$out" ] && printf '{"status": "ok", "backends": {}}\n' > "$out"
exit 0
'''


def _suite_on_gpu_path(tmp_path: Path, **env_extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    env = {**os.environ, "MOELAB_SUITE_TINY": "0", "MOELAB_PYTHON": str(fake), "REAL_PYTHON": sys.executable,
           "FAKE_LOG": str(log), **env_extra}
    proc = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), str(out)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_gpu_path_writes_every_file_with_dropless_refused_and_few_processes(tmp_path):
    """Issue 39: on a GPU the train-step runs share processes, the issue's figures come first, and
    dropless (refused on a GPU) gets a file naming grouped instead of an out-of-memory crash."""
    proc, calls = _suite_on_gpu_path(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "out"
    statuses = {name: json.loads((out / name).read_text())["status"] for name in suite_table.EXPECTED_FILES}
    assert statuses == {name: "refused" if "dropless" in name else "ok" for name in suite_table.EXPECTED_FILES}
    assert "grouped" in json.loads((out / "mfu_gpu-medium_dropless.json").read_text())["error"]
    assert not any("dropless" in call for call in calls)
    assert len(calls) == 10  # matmul, four train-step processes, four layer parts, the FP8 loss comparison
    assert "--matmul-only" in calls[0] and "--run gpu-medium:grouped" in calls[1] and "--profile" in calls[1]


def test_gpu_path_stubs_what_the_budget_leaves_out(tmp_path):
    """A run that would start with under 20 s of the budget left is not started; its files say why. The suite
    runs on a fake clock that each run advances by 1 s (no wall time: a loaded machine cannot change the
    outcome): 27 s of budget leave 22 s for the matmul and 21 s for the first train-step process, and under
    20 s for every process after it."""
    clock = tmp_path / "clock"
    clock.write_text("0")
    proc, calls = _suite_on_gpu_path(tmp_path, MOELAB_SUITE_BUDGET_S="27", MOELAB_SUITE_CLOCK=str(clock),
                                     FAKE_SECONDS="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "out"
    statuses = {name: json.loads((out / name).read_text())["status"] for name in suite_table.EXPECTED_FILES}
    assert statuses["matmul.json"] == "ok" and statuses["mfu_gpu-medium_grouped.json"] == "ok"
    assert statuses["mfu_gpu-small-dense_dense.json"] == "skipped"
    assert "suite budget of 27s" in (out / "mfu_gpu-small-dense_dense.json").read_text()


early_training = load_benchmark("early_training")


@pytest.mark.slow
def test_early_training_records_both_curves_step_by_step(tmp_path, monkeypatch, capsys):
    """Issue 39's measurement on the tiny preset: the MoE and its dense twin on the same batches.

    `slow`: two train steps compiled (MoE and dense, ~25 s on 2 cores); the GPU presets' runs are the
    benchmark's, not the suite's."""
    out = tmp_path / "early.json"
    monkeypatch.setattr(sys, "argv", ["early_training.py", "--preset", "tiny", "--steps", "3", "--data", "text",
                                      "--set", "model.embed_std=1.0", "--out", str(out), "--json"])
    early_training.main()
    result = json.loads(out.read_text())
    assert result["set"] == ["model.embed_std=1.0"] and result["steps"] == 3
    moe_curve, dense_curve = result["moe"], result["dense"]
    assert len(moe_curve["loss"]) == len(dense_curve["loss"]) == 3
    assert all(0 <= d <= 1 for d in moe_curve["drop_fraction"]) and dense_curve["drop_fraction"] == [0.0] * 3
    assert len(moe_curve["drop_by_layer"][0]) == presets.get("tiny").model.num_layers
    assert moe_curve["loss"][0] == pytest.approx(dense_curve["loss"][0], rel=0.05)  # both start near log V


@pytest.mark.parametrize("argv, message", [(["--set", "model.embed_std"], "must look like section.field=value"),
                                           (["--set", "model.embed_std=0"], "model.embed_std")])
def test_early_training_exits_2_naming_a_bad_set(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["early_training.py", "--preset", "tiny", *argv])
    with pytest.raises(SystemExit) as exit_info:
        early_training.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
