"""`moelab plan` (issue 38): the state it counts is the state the shardings hold, its total is within 10%
of XLA's compiled memory analysis, the frontier fits its rack, and bad input exits 2 naming the field."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from helpers import load_benchmark, run_cli
from moelab import accounting, presets
from moelab.config import override
from moelab.parallel import mesh as mesh_lib
from moelab.train import hlo, memory_plan, run_length, traffic
from moelab.train.state import init_state, state_shardings


def _tiny_on(shard: str, dense_layers: int = 0):
    return override(presets.get("tiny"), {"mesh.replica": 2, "mesh.expert": 4, "model.moe.dispatch": "ep",
                                          "mesh.shard": shard, "model.dense_layers": dense_layers})


@pytest.mark.parametrize("shard, dense_layers", [("replicate", 0), ("optimizer", 0), ("rack", 0), ("full", 0), ("full", 1)])
def test_the_state_it_counts_is_what_the_shardings_put_on_a_device(shard, dense_layers):
    cfg = _tiny_on(shard, dense_layers)
    shardings = state_shardings(cfg, mesh_lib.make_mesh(cfg.mesh))
    abstract = jax.eval_shape(lambda: init_state(cfg))

    def on_one_device(tree, shard_tree):
        return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                   for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shard_tree)))

    counted = memory_plan.state_bytes(cfg)
    assert counted["params"] == on_one_device(abstract.params, shardings.params)
    assert counted["moments"] == on_one_device(abstract.opt_state, shardings.opt_state)
    if shard != "replicate":  # the split layouts hold less
        assert counted["moments"] < memory_plan.state_bytes(_tiny_on("replicate"))["moments"]


@pytest.mark.slow
def test_the_tiny_plan_is_within_10_percent_of_xla_on_8_devices():
    """`slow`: the real train step compiled on 8 simulated devices in a child process, ~10 s, and `make test`
    is near its 8 minutes; the fast suite keeps the state count exact (above). Measured: -7.2%; the
    collectives counted / compiled: all-to-all, all-gather and reduce-scatter 1.0, all-reduce 0.9995."""
    row = load_benchmark("plan_vs_xla").measure("tiny")
    assert abs(row["plan_vs_xla"]) <= 0.10, row
    assert row["comm_bytes_compiled"]["all-to-all"] > 0  # the ep step's exchanges, read from its HLO
    assert all(abs(ratio - 1) <= 0.06 for ratio in row["comm_counted_vs_compiled"].values()), row  # 0.96 measured


@pytest.mark.slow
@pytest.mark.parametrize("case, bound", [("ladder-d1024", 0.08), ("frontier-535b", 0.04)])
def test_the_mid_size_and_frontier_plans_agree_with_xla(case, bound):
    """`slow`: compiles the 535B step on 64 simulated devices and a d1024 rung on 8 (~20 s each on 2 cores).
    Measured (the per-device step of issue 58): ladder-d1024 -5.9%, frontier-535b -1.6% (162.3 vs 164.8 GB), and
    both under 186 GB; the collectives counted / compiled: all-to-all, all-gather and reduce-scatter 1.0,
    all-reduce 1.0008 and 1.0016."""
    row = load_benchmark("plan_vs_xla").measure(case)
    assert abs(row["plan_vs_xla"]) <= bound, row  # two points past what was measured: XLA's count is deterministic
    assert all(abs(ratio - 1) <= 0.02 for ratio in row["comm_counted_vs_compiled"].values()), row
    assert row["xla_bytes"] <= 186e9


def test_the_frontier_fits_its_rack_of_186_gb(monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "frontier-535b", "--mesh", "replica=11,expert=64", "--hbm", "186GB",
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and plan["total"] <= 186e9
    assert plan["rows_per_microbatch"] == 1 and plan["microbatches"] == 16
    assert plan["mesh"]["shard"] == "rack"
    assert plan["comm_bytes"]["all_reduce_across_racks"] > 0 and plan["comm_seconds"]["all_to_all_in_rack"] > 0
    # Across racks only the gradient, once a step: the 2 (R - 1) / R ring all-reduce of one device's float32 shard
    # (every parameter over the 64 of a rack), whatever the 16 microbatches; in bfloat16 if asked, half.
    shard = 4 * accounting.count_params(presets.get("frontier-535b").model).total / 64
    assert plan["comm_bytes"]["all_reduce_across_racks"] == pytest.approx(2 * 10 / 11 * shard, rel=0.01)
    halved = traffic.communication(override(presets.get("frontier-535b"), {"train.grad_reduce_dtype": "bfloat16"}))
    assert halved["all_reduce_across_racks"] == pytest.approx(plan["comm_bytes"]["all_reduce_across_racks"] / 2, rel=1e-3)
    assert {k: v for k, v in halved.items() if k != "all_reduce_across_racks"} == \
        {k: v for k, v in plan["comm_bytes"].items() if k != "all_reduce_across_racks"}
    assert plan["comm_bytes"]["all_gather_across_racks"] == 0


def test_the_seed_layout_does_not_fit_and_the_plan_says_what_to_change(monkeypatch, capsys):
    """The frontier as the seed shipped it: everything but the experts replicated, float32, no remat."""
    code, out, err = run_cli(["plan", "--preset", "frontier-535b", "--hbm", "186GB", "--json",
                              "--set", "mesh.shard=replicate", "--set", "model.remat=none",
                              "--set", "train.moment_dtype=float32"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is False and plan["total"] > 300 * 2**30
    tips = {tip["set"]: tip for tip in plan["advice"]}
    assert "mesh.shard=full" in tips and "model.remat=full" in tips
    # each tip re-planned alone: its total is what that one setting gives, below the plan's, lowest first
    assert all(tip["total"] < plan["total"] and tip["fits"] == (tip["total"] <= 186e9) for tip in plan["advice"])
    assert [tip["total"] for tip in plan["advice"]] == sorted(tip["total"] for tip in plan["advice"])


def test_on_one_device_the_plan_advises_only_what_changes_the_total_as_train_takes_it(monkeypatch, capsys):
    """Issue 54: `--hbm 80` (no unit) is refused naming the flag; on one device the layouts change nothing, so they
    are not advised; every tip pastes into `moelab train --set`, says what it alone gives and whether that fits;
    one unit (GB) throughout."""
    code, out, err = run_cli(["plan", "--preset", "gpu-medium", "--hbm", "80"], monkeypatch, capsys)
    assert code == 2 and "--hbm='80' has no unit: write 80GB" in " ".join(err.split())
    code, out, err = run_cli(["plan", "--preset", "gpu-medium", "--hbm", "80GB", "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is False and plan["advice"]
    assert not any(tip["set"].startswith("mesh.shard") for tip in plan["advice"])
    from moelab.config import override
    for tip in plan["advice"]:
        key, value = tip["set"].split("=")
        override(presets.get("gpu-medium"), {key: value})  # as `--set` reads it: the config takes it
    code, out, err = run_cli(["plan", "--preset", "gpu-medium", "--hbm", "80GB"], monkeypatch, capsys)
    assert "GiB" not in out and "--set model.remat=full  ->" in out and ("fits" in out or "still over" in out)


@pytest.mark.parametrize("args, field", [
    (["--hbm", "lots"], "--hbm"),
    (["--hbm", "-3GB"], "--hbm"),
    (["--mesh", "replica=two"], "--mesh replica"),
    (["--microbatches", "0"], "--microbatches"),
    (["--microbatches", "3"], "train.microbatches"),
    (["--platform", "tpu"], "--platform"),
    (["--nvlink", "fast"], "--nvlink"),
])
def test_bad_planner_input_exits_2_naming_the_field(args, field, monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "tiny", *args], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert field in err


def test_collectives_in_a_loop_count_once_per_iteration_by_what_each_device_sends():
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %ag = f32[32]{0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %a2a = f32[8]{0} all-to-all(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %rs = f32[2]{0} reduce-scatter(%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}
  ROOT %ar = f32[8]{0} all-reduce(%a), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}
}
"""
    counted = hlo.collective_bytes(text, num_devices=8)
    # What one device sends: 3/4 of a gathered result over groups of 4, 1/2 of an exchange over pairs, and
    # (n - 1) results of a reduce-scatter over 4; an all-reduce over groups of one moves nothing.
    assert counted["all-gather"] == 5 * 32 * 4 * 3 // 4 and counted["all-to-all"] == 5 * 8 * 4 // 2
    assert counted["reduce-scatter"] == 2 * 4 * 3 and counted["all-reduce"] == 0


# ----------------------------------------------------------------------------------------------
# the GPU: every train step of the H200 record of 2026-12-04 that reported its peak memory

RECORD = "benchmarks/results/h200-2026-12-04.json"
RERUNS = "benchmarks/results/h200-2026-12-04-reruns"
# (preset, backend) -> the measured `peak_memory_bytes`, copied from the record so that a change to either
# the figure or the record fails here (`test_the_pinned_peaks_are_the_records`).
MEASURED_PEAKS = {
    ("gpu-small", "grouped"): 62_356_528_384,
    ("gpu-medium", "capacity"): 85_987_720_704,
    ("gpu-medium", "grouped"): 84_662_714_368,
    ("gpu-medium-dense", "dense"): 29_879_584_256,
    ("gpu-small", "capacity"): 67_945_111_040,  # the reruns
    ("gpu-small-dense", "dense"): 41_515_970_304,
    ("gpu-medium", "ep"): 85_989_490_944,
}


def _record_runs() -> dict:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    runs = [run for run in json.loads((root / RECORD).read_text())["mfu"].values() if run.get("status") == "ok"]
    runs += [json.loads(path.read_text()) for path in sorted((root / RERUNS).glob("*.json"))]
    return {(run["preset"], run["backend"]): run for run in runs if run.get("peak_memory_bytes")}


def test_the_pinned_peaks_are_the_records():
    runs = _record_runs()
    assert {key: run["peak_memory_bytes"] for key, run in runs.items()} == MEASURED_PEAKS


@pytest.mark.parametrize("preset, backend", sorted(MEASURED_PEAKS))
def test_the_plan_is_within_10_percent_of_the_h200_peak(preset, backend):
    """Planned on this CPU as the GPU compiles it (fused attention), at the record's batch, sequence and
    remat. Measured when pinned: +0.2% (gpu-small capacity / grouped, gpu-small-dense), +1.7% to +2.0%
    (gpu-medium), +3.9% (gpu-medium-dense); before issue 49 +87% and +245% under remat dots."""
    run = _record_runs()[preset, backend]
    cfg = override(presets.get(preset), {"model.moe.dispatch": backend, "model.remat": run["remat"],
                                         "train.batch_size": run["batch_size"], "model.seq_len": run["seq_len"]})
    planned = memory_plan.plan(cfg, platform="gpu").total
    assert abs(planned / MEASURED_PEAKS[preset, backend] - 1) <= 0.10, (planned, MEASURED_PEAKS[preset, backend])


def test_xla_attention_scores_are_left_out_on_a_gpu_and_counted_on_cpu():
    """The GPU plan traces cuDNN's residuals: none of XLA's [S, S] scores, whatever GQA's layout. Read off the
    residual list itself (no saved array ends in [S, S] as the GPU plan traces the loss; the CPU trace has them),
    and the bytes differ by at least one float32 copy of the scores."""
    import jax.numpy as jnp

    from moelab.model import transformer
    from moelab.model.moe import build_moe
    from moelab.train import residuals

    S = 256
    cfg = override(presets.get("tiny"), {"model.seq_len": S, "model.num_kv_heads": 2})
    m = cfg.model
    params = jax.eval_shape(lambda: transformer.init(m, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((4, S + 1), jnp.int32)
    bias = jax.ShapeDtypeStruct((m.num_moe_layers, m.moe.num_experts), jnp.float32)

    def saved_shapes(attend) -> list[tuple]:
        def loss(p, t, b):
            return transformer.loss(p, t, m, b, jnp.bfloat16, dispatch=build_moe(m), attend=attend)[0]
        return [aval.shape for aval, where in residuals.saved_residuals(loss, params, tokens, bias)
                if where != "argument"]

    assert not [s for s in saved_shapes(residuals.fused_attention) if s[-2:] == (S, S)]
    assert [s for s in saved_shapes(transformer.causal_attention) if s[-2:] == (S, S)]
    gpu, cpu = memory_plan.activation_bytes(cfg, 4, "gpu"), memory_plan.activation_bytes(cfg, 4, "cpu")
    scores = m.num_layers * 4 * m.num_heads * S * S * 4  # float32, one copy
    assert cpu.saved - gpu.saved >= scores


def test_a_step_whose_temporaries_exceed_xlas_gpu_budget_is_flagged(monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "gpu-small", "--hbm", "80GB", "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and plan["compiler_recomputes"] is True  # 68 GB fits 80, not 0.95 x (60 - 9)
    code, out, _ = run_cli(["plan", "--preset", "gpu-small", "--hbm", "141GB", "--json"], monkeypatch, capsys)
    assert json.loads(out)["compiler_recomputes"] is False


def test_plan_gives_the_step_time_and_the_runs_days_on_a_device(monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "gpu-medium", "--device", "h200", "--json"], monkeypatch, capsys)
    assert code == 0, err
    time = json.loads(out)["time"]
    h200, (measured, _) = run_length.DEVICES["h200"], run_length.MEASURED_MFU["h200"]
    assert (time["peak_flops"], time["mfu"]) == (h200.peak_flops, measured)  # the device's datasheet, its measured MFU
    cfg = presets.get("gpu-medium")
    flops = accounting.flops_per_token(cfg.model) * accounting.tokens_per_step(cfg) / cfg.mesh.num_devices
    assert time["compute_seconds"] * time["mfu"] * time["peak_flops"] == pytest.approx(flops)
    assert time["days"] * 86400 == pytest.approx(time["steps"] * time["step_seconds"])
    code, out, _ = run_cli(["plan", "--preset", "gpu-medium", "--device", "h200", "--mfu", "0.638", "--json"],
                           monkeypatch, capsys)
    assert json.loads(out)["time"]["compute_seconds"] == pytest.approx(time["compute_seconds"] / 2)


@pytest.mark.parametrize("args, field", [
    (["--device", "tpu7"], "--device"),
    (["--device", "h200", "--mfu", "0"], "--mfu"),
    (["--device", "h200", "--mfu", "1.5"], "--mfu"),
    (["--device", "gb200"], "--mfu"),
    (["--device", "h200", "--nvlink", "0"], "--nvlink"),
    (["--peak-flops", "-1", "--mfu", "0.3"], "--peak-flops"),
])
def test_bad_timing_input_exits_2_naming_the_flag(args, field, monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "tiny", *args], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert field in err


def test_the_optimizer_layout_adds_one_gather_of_the_new_parameters_across_racks():
    """ZeRO-1 over racks: the gradient moves as under `replicate` (once a step), and the new parameters, updated
    where their moments are, are all-gathered over the whole mesh once: S (n - 1) / n bytes a device."""
    cfg = _tiny_on("optimizer")
    comm, plain = traffic.communication(cfg), traffic.communication(_tiny_on("replicate"))
    assert {k: v for k, v in comm.items() if k != "all_gather_across_racks"} == \
        {k: v for k, v in plain.items() if k != "all_gather_across_racks"}
    assert comm["all_gather_across_racks"] > 0 == plain["all_gather_across_racks"]


def test_dense_first_layers_are_in_the_gradient_the_optimizer_layout_sends():
    """`model.dense_layers` (issue 51): a dense block's parameters are non-expert parameters like attention's, so
    ZeRO-1 gathers them with the rest: S (n - 1) / n bytes a device, S every parameter but the experts' (here
    every non-expert array has a dimension the 8 devices divide, so its moments split over the whole mesh)."""
    cfg = _tiny_on("optimizer", dense_layers=1)
    m = cfg.model
    experts = m.num_moe_layers * m.moe.num_experts * 3 * m.expert_input_dim * m.moe.expert_dim
    non_expert = 4 * (accounting.count_params(m).total - experts)  # float32
    split = traffic.param_bytes(cfg)
    assert split.updated_whole == non_expert
    experts_per_device = 4 * experts / 4  # their moments split over the 2 racks too: each device's quarter, halved
    assert traffic.communication(cfg)["all_gather_across_racks"] == int(non_expert * 7 / 8 + experts_per_device / 2)


# ----------------------------------------------------------------------------------------------
# the step time: what overlap may hide


def _timed(comm_seconds: dict[str, float], dispatch: str = "ep", waves: int = 3, mfu: float = 0.5) -> dict:
    """`run_length.estimate` of tiny at `mfu` on a 1 PFLOP/s device with these communication seconds."""
    from types import SimpleNamespace

    cfg = override(presets.get("tiny"), {"model.moe.dispatch": dispatch, "model.moe.num_waves": waves})
    return run_length.estimate(cfg, SimpleNamespace(comm_seconds=comm_seconds), 1e15, mfu, "test")


def test_with_no_overlap_shown_the_step_is_compute_then_communication(monkeypatch):
    monkeypatch.setattr(run_length, "SHOWN_OVERLAP", {})
    time = _timed({"all_to_all_in_rack": 2.0, "all_reduce_across_racks": 3.0})
    assert time["step_seconds_overlapped"] == time["step_seconds"] == time["compute_seconds"] + 5.0
    assert (time["in_rack_seconds"], time["across_racks_seconds"]) == (2.0, 3.0)
    assert time["all_to_all_hideable_seconds"] == pytest.approx(2.0 * 2 / 3)  # 3 waves: the first cannot hide


def test_overlap_hides_only_the_shown_share_and_never_more_than_the_compute(monkeypatch):
    """A share a compiled schedule showed hides that share of its collective's time, capped at the compute (a
    collective hides behind compute, not behind another collective)."""
    monkeypatch.setattr(run_length, "SHOWN_OVERLAP", {"all_to_all_in_rack": 0.5})
    comm = {"all_to_all_in_rack": 1e-9, "all_reduce_across_racks": 1e-9}
    small = _timed(comm)
    assert small["step_seconds"] - small["step_seconds_overlapped"] == pytest.approx(0.5e-9)
    big = _timed({"all_to_all_in_rack": 1e3, "all_reduce_across_racks": 1.0})
    assert big["step_seconds"] - big["step_seconds_overlapped"] == pytest.approx(big["compute_seconds"])
    assert big["days_overlapped"] < big["days"]
    assert _timed(comm, dispatch="capacity", waves=1)["all_to_all_hideable_seconds"] == 0


def test_the_residuals_read_off_the_jaxpr_are_the_ones_jax_prints():
    """`residuals.saved_residuals` against JAX's own listing (`jax.ad_checkpoint.print_saved_residuals`): the same
    residuals, each as an argument, a scan's output or other; on tiny under remat `dots` (the layer scan) and on a
    checkpointed function outside any scan (JAX saves through a `reduce_precision` there)."""
    import contextlib
    import io
    import re

    import jax.numpy as jnp

    from moelab.model import transformer
    from moelab.model.moe import build_moe
    from moelab.train import residuals

    def printed(fn, *args) -> list[tuple[str, str]]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(fn, *args)
        where = {"from the argument": "argument", "output of scan": "scan"}
        return sorted((shape, next((v for k, v in where.items() if why.startswith(k)), "other"))
                      for shape, why in re.findall(r"^(\S+) (.*)$", out.getvalue(), flags=re.M))

    def ours(fn, *args) -> list[tuple[str, str]]:
        return sorted((aval.str_short(short_dtypes=True), where) for aval, where in residuals.saved_residuals(fn, *args))

    m = override(presets.get("tiny"), {"model.remat": "dots", "model.num_layers": 2}).model
    params = jax.eval_shape(lambda: transformer.init(m, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((2, m.seq_len + 1), jnp.int32)
    bias = jax.ShapeDtypeStruct((m.num_moe_layers, m.moe.num_experts), jnp.float32)

    def loss(p, t, b):
        return transformer.loss(p, t, m, b, jnp.bfloat16, dispatch=build_moe(m))[0]

    def outside_a_scan(x, w):
        return jnp.sum(jax.checkpoint(lambda x: jnp.sin(x @ w) @ w)(x))

    x, w = jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32)
    for fn, args in ((loss, (params, tokens, bias)), (outside_a_scan, (x, w))):
        assert ours(fn, *args) == printed(fn, *args)


def test_the_plan_reads_true_for_one_device_and_for_a_config_that_does_not_fit(monkeypatch, capsys):
    """Issue 62: one device says no link and no communication; a step time for a config that does not fit carries
    a caveat."""
    code, out, err = run_cli(["plan", "--preset", "gpu-medium", "--device", "h100"], monkeypatch, capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "links:" not in text and "communication: none (one device)" in text
    assert "(one device: nothing to communicate)" in text and "across racks" not in text
    assert "as if it fit: it does not (87.7 GB of 80.0 GB)" in text and "take a setting above" in text
    assert "attention fused, as XLA compiles it on a GPU" in text


def test_the_frontier_plan_names_what_dominates_and_promises_no_tip_it_does_not_give(monkeypatch, capsys):
    """Issue 62: the recompute warning gives the docs' 0.95 and promises a setting only where one is listed; a line
    says what dominates the step."""
    code, out, err = run_cli(["plan", "--preset", "frontier-535b", "--mesh", "replica=11,expert=64", "--device",
                              "h200"], monkeypatch, capsys)
    assert code == 0, err
    text = " ".join(out.split())
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95." in text and "no single setting makes it fit" in text
    assert "(it fits on gb200 (186 GB): --device)" in text  # a known device it fits: the plan names it
    assert "take a setting above" not in text and re.search(r"Compute dominates \(\d+% of the step\)", text)
