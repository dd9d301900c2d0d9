"""`moelab plan` (issue 38): the state it counts is the state the shardings hold, its total is within 10%
of XLA's compiled memory analysis, the frontier fits its rack, and bad input exits 2 naming the field."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from helpers import load_benchmark, run_cli
from moelab import presets
from moelab.config import override
from moelab.parallel import mesh as mesh_lib
from moelab.train import memory_plan
from moelab.train.state import init_state, state_shardings


def _tiny_on(shard: str):
    return override(presets.get("tiny"), {"mesh.replica": 2, "mesh.expert": 4, "model.moe.dispatch": "ep",
                                          "mesh.shard": shard})


@pytest.mark.parametrize("shard", ["replicate", "optimizer", "full"])
def test_the_state_it_counts_is_what_the_shardings_put_on_a_device(shard):
    cfg = _tiny_on(shard)
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
    is near its 8 minutes; the fast suite keeps the state count exact (above). Measured: -6.7%."""
    row = load_benchmark("plan_vs_xla").measure("tiny")
    assert abs(row["plan_vs_xla"]) <= 0.10, row
    assert row["comm_bytes_compiled"]["all-to-all"] > 0  # the ep step's exchanges, read from its HLO


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ladder-d1024", "frontier-535b"])
def test_the_mid_size_and_frontier_plans_are_within_10_percent_of_xla(case):
    """`slow`: compiles the 535B step on 64 simulated devices and a d1024 rung on 8 (~20 s each on 2 cores).
    Measured: ladder-d1024 -1.8%, frontier-535b -0.3% (158.1 vs 158.6 GiB), and both under 186 GB."""
    row = load_benchmark("plan_vs_xla").measure(case)
    assert abs(row["plan_vs_xla"]) <= 0.10, row
    assert row["xla_bytes"] <= 186e9


def test_the_frontier_fits_its_rack_of_186_gb(monkeypatch, capsys):
    code, out, err = run_cli(["plan", "--preset", "frontier-535b", "--mesh", "replica=11,expert=64", "--hbm", "186GB",
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and plan["total"] <= 186e9
    assert plan["rows_per_microbatch"] == 1 and plan["microbatches"] == 16
    assert plan["comm_bytes"]["all_reduce_across_racks"] > 0 and plan["comm_seconds"]["all_to_all"] > 0


def test_the_seed_layout_does_not_fit_and_the_plan_says_what_to_change(monkeypatch, capsys):
    """The frontier as the seed shipped it: everything but the experts replicated, float32, no remat."""
    code, out, err = run_cli(["plan", "--preset", "frontier-535b", "--hbm", "186GB", "--json",
                              "--set", "mesh.shard=replicate", "--set", "model.remat=none",
                              "--set", "train.moment_dtype=float32"], monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is False and plan["total"] > 300 * 2**30
    assert any("mesh.shard=full" in tip for tip in plan["advice"])
    assert any("remat" in tip for tip in plan["advice"])


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
    hlo = """HloModule m

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
    counted = memory_plan.collective_bytes(hlo, num_devices=8)
    # What one device sends: 3/4 of a gathered result over groups of 4, 1/2 of an exchange over pairs, and
    # (n - 1) results of a reduce-scatter over 4; an all-reduce over groups of one moves nothing.
    assert counted["all-gather"] == 5 * 32 * 4 * 3 // 4 and counted["all-to-all"] == 5 * 8 * 4 // 2
    assert counted["reduce-scatter"] == 2 * 4 * 3 and counted["all-reduce"] == 0
