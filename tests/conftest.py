"""Test-session setup: eight simulated CPU devices for the multi-device tests (architecture §4).

XLA reads the flag once, when JAX starts its CPU backend, so it must be in the environment before
any test module imports jax; pytest imports this file first. Single-device code is unaffected: an
array that is not placed explicitly lives on device 0, as with one device.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# Most of the suite's time is XLA compiling tiny programs; LLVM's optimization passes are most of each compile
# and buy nothing at these sizes. Without them a tiny train run takes 16% less (measured for issue 59). XLA's own
# HLO passes (fusion, sharding, collectives) are unchanged, and XLA compiles CPU code without fast-math, so no
# floating-point operation is reordered either way. `moelab.train.hlo` compiles the planner's check this way too.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_backend_optimization_level=0"

# scipy's L-BFGS-B (the ladder fits) calls OpenBLAS for tiny products; its thread pool only adds
# contention on a 2-core CI machine (measured: ~3 ms vs ~0.1 ms per call under load).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# A persistent compilation cache for this session, shared with the subprocesses tests start: the tiny
# models compile the same train step again and again (every `train` call builds its own jit), and a
# cache hit turns seconds of XLA compile into a file read. A fresh folder per session: nothing carries
# over between sessions or machines. It changes no result: a hit is the same compiled program.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="moelab-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


import pytest  # noqa: E402  (after the environment above, which must precede any JAX import)


# The heaviest files first, as measured by benchmarks/suite_time.py (issue 27; re-measured for issue 59, when
# test_hf_import, test_fp8 and test_memory_plan had grown past 19 s unlisted and ran last): the two workers take
# one file at a time in this order (`--no-loadscope-reorder`), so the long files start early and the short ones
# fill in at the end instead of one worker finishing a long file alone. test_readme.py leads (its `slow`
# quick-start run takes ~3 minutes; its fast checks are seconds), then three files that are all `slow` (they lead
# `make test-slow`); then `make test`'s, longest first. Unlisted files keep pytest's order after these; a name here that no
# longer exists only costs its place.
HEAVY_FIRST = ("test_readme.py", "test_multiprocess.py", "test_ray_cluster.py", "test_ladder_forecast.py",
               "test_dispatch.py", "test_router_balance.py", "test_export.py", "test_generate.py",
               "test_sharded_state.py", "test_parallel.py", "test_tracking.py", "test_multihost_writes.py",
               "test_faults.py", "test_checkpoint.py", "test_hf_import.py", "test_fp8.py", "test_model.py",
               "test_bundle.py", "test_site.py", "test_monitor.py", "test_memory_plan.py", "test_ladder_fit.py",
               "test_gpu_suite.py", "test_grouped_matmul.py", "test_train.py", "test_executor.py", "test_config.py",
               "test_report.py", "test_object_storage.py", "test_arithmetic_task.py", "test_ladder_task.py",
               "test_evals.py", "test_data.py", "test_registry.py", "test_bad_inputs.py", "test_ladder_fix.py",
               "test_ledger.py", "test_ladder_checks.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    """Files in HEAVY_FIRST's order; the same on every xdist worker (they must collect alike)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


@pytest.fixture(scope="session")
def trained_tiny_run(tmp_path_factory):
    """One `tiny` run trained 20 steps (checkpoint at the end), shared by the tests that use a finished
    run: generate, export, eval. Read it; never write into it."""
    from moelab import presets
    from moelab.train.loop import train

    out = tmp_path_factory.mktemp("trained-tiny") / "run"
    cfg = presets.resolve("tiny", {"train.steps": 20, "train.eval_every": 20, "train.eval_batches": 1})
    train(cfg, out)
    return out
