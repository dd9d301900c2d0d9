"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path for conftest.py)."""

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np


def run_cli(args, monkeypatch, capsys):
    """Run `moelab ARGS` in-process as a user would; returns (exit code, stdout, stderr)."""
    from moelab import cli

    monkeypatch.setattr(sys, "argv", ["moelab", *args])
    code = _exit_code(cli.main)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _exit_code(main) -> int:
    try:
        main()
    except SystemExit as e:
        return e.code
    return 0


def run_cli_redirected(mp, args, cwd=None):
    """`run_cli` without capsys, for module-scoped fixtures: (exit code, stdout, stderr), run from `cwd` if given.

    `mp` is a pytest.MonkeyPatch; argv and the directory are restored afterwards.
    """
    from moelab import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mp.context() as m:
        if cwd is not None:
            m.chdir(cwd)
        m.setattr(sys, "argv", ["moelab", *args])
        code = _exit_code(cli.main)
    return code, out.getvalue(), err.getvalue()


def load_benchmark(name: str):
    """`benchmarks/NAME.py` as a module (the benchmarks are scripts, not a package), loaded once."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


def float_scatter_adds(jaxpr_text: str) -> list[str]:
    """Lines of a printed jaxpr that scatter-add floats (integer counting, e.g. bincount, is cheap)."""
    return [line.strip() for line in jaxpr_text.splitlines()
            if "scatter-add" in line and any(f":{t}[" in line for t in ("f32", "bf16", "f16"))]


def dispatch_gradient_jaxpr(dispatch_fn, cfg, num_tokens: int) -> str:
    """The printed jaxpr of d(sum of a dispatch's outputs) / d(rows, combine weights, expert weights), bf16.

    `dispatch_fn(h, routing, experts)` is a `moelab.model.moe.Dispatch` (or a backend function); the routing comes from `cfg`'s
    router on random rows, so the gradient of the router itself (not dispatch's business) is left out.
    """
    import jax
    import jax.numpy as jnp

    from moelab.model import moe
    from moelab.model.router import route

    params = moe.init(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (num_tokens, cfg.d_model))
    routing = route(x, params["w_router"], jnp.zeros((cfg.moe.num_experts,)), cfg.moe)
    experts = {name: params[name].astype(jnp.bfloat16) for name in ("w_gate", "w_up", "w_down")}

    def loss(h, weights, experts):
        out, _ = dispatch_fn(h, routing._replace(weights=weights), experts)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return str(jax.make_jaxpr(grad)(x.astype(jnp.bfloat16), routing.weights, experts))


def relative_error(a, b) -> float:
    """max|a - b| / max|b| in float64; NaN (which fails every `<` check) if either holds a NaN or inf.

    Relative to the tensor's largest entry, not elementwise: an entry near zero by cancellation has a
    huge elementwise relative error from rounding alone. The backends add the same products in
    different orders (buffers, ragged groups, masked dense sums, per-device partial sums), so they
    agree to float32 rounding (~1e-7 per op, ~1e-6 after a few layers), not bit for bit; 1e-5 leaves
    that margin and still catches any wrong row, weight or expert, which shows up at order 1. NumPy's
    max propagates NaN; XLA's max on CPU can skip it, which once hid unwritten (NaN) kernel outputs.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("nan")
    scale = np.max(np.abs(b))
    if scale == 0.0:
        return float(np.max(np.abs(a)))
    return float(np.max(np.abs(a - b)) / scale)


# A short checkpointed CLI run, and what "ends the same" means for two runs of it: the fault tests
# (test_faults.py) and the checkpoint tests compare an interrupted run with an uninterrupted one.
TIMING_KEYS = {"tokens_per_s", "compile_s"}  # wall-clock figures differ between runs; everything else must not


def without_timing(record: dict) -> dict:
    """`record` less its wall-clock figures: what two runs of the same recipe must agree on."""
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


def train_args(out, steps: int = 24) -> list[str]:
    """`moelab train` arguments for the tiny preset with a checkpoint every 4 steps into `out`."""
    return ["train", "--preset", "tiny", "--steps", str(steps), "--out", str(out), "--checkpoint-every", "4",
            "--set", "train.log_every=2", "--set", "train.eval_every=12", "--set", "train.eval_batches=1"]


def train_command(out, steps: int = 24) -> list[str]:
    """The same run as a subprocess command line (for runs a test kills)."""
    return [sys.executable, "-m", "moelab.cli", *train_args(out, steps)]


def final_state(out, steps: int):
    """The state of the newest checkpoint under `out`, which must be step `steps`."""
    from moelab import presets
    from moelab.config import CheckpointConfig
    from moelab.train.checkpoint import Checkpointer
    from moelab.train.state import init_state

    restored = Checkpointer(out / "checkpoints", CheckpointConfig()).restore_newest(init_state(presets.get("tiny")))
    assert restored is not None and restored.step == steps
    return restored.state


def metric_records(out) -> list[dict]:
    import json

    return [without_timing(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(reference, other, steps: int) -> None:
    """Bitwise the same final params, optimizer state and router state, and the same metric records."""
    import jax

    for x, y in zip(jax.tree.leaves(final_state(reference, steps)), jax.tree.leaves(final_state(other, steps))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise: same values, same dtype
    assert metric_records(reference) == metric_records(other)


def wait_for(path, proc, timeout: float = 240) -> None:
    """Wait until `path` exists while `proc` runs; fails if it ends first or time runs out."""
    import time

    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "process ended early"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def apply_on_one_device(params, tokens, cfg, router_bias, compute_dtype=None, **kwargs):
    """`transformer.apply` with `cfg.moe.dispatch`'s single-device backend, the dispatch the model now requires."""
    import jax.numpy as jnp

    from moelab.model import transformer
    from moelab.model.moe import build_moe

    return transformer.apply(params, tokens, cfg, router_bias, compute_dtype or jnp.float32,
                             dispatch=build_moe(cfg), **kwargs)


def loss_on_one_device(params, tokens, cfg, router_bias, compute_dtype=None, **kwargs):
    """`transformer.loss` with `cfg.moe.dispatch`'s single-device backend (see `apply_on_one_device`)."""
    import jax.numpy as jnp

    from moelab.model import transformer
    from moelab.model.moe import build_moe

    return transformer.loss(params, tokens, cfg, router_bias, compute_dtype or jnp.float32,
                            dispatch=build_moe(cfg), **kwargs)


def tiny_model(*, seq_len: int = 8, moe: dict | None = None, **fields):
    """The tests' tiny model: vocab 64, d_model 32, 2 layers, 4 heads over 2 KV heads, 4 experts top-2 of width
    16. `fields` replace ModelConfig fields, `moe` MoEConfig fields: each test names only what it varies."""
    from moelab.config import ModelConfig, MoEConfig

    experts = {"num_experts": 4, "num_experts_per_token": 2, "expert_dim": 16, **(moe or {})}
    shape = {"vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, **fields}
    return ModelConfig(seq_len=seq_len, moe=MoEConfig(**experts), **shape)


# The lab tests' run config beside train.steps (report, bundle, site): one compile serves them all through the
# session's compilation cache.
LAB_RUN = {"train.eval_every": 5, "train.log_every": 1, "train.eval_batches": 1, "train.seed": 0}


def experiment_spec(exp_id: str, *, high: float = 10.0, expected: float | None = None, steps: int = 10,
                    title: str | None = None, overrides: dict | None = None, **extra) -> dict:
    """A pre-registered spec on the tiny preset: eval/mean after `steps` steps below `high` nats (`expected`:
    high / 2 unless given). `overrides` add run-config overrides (`LAB_RUN`, say); `extra` replaces or adds
    spec keys (a `ladder:` instead of `config:`)."""
    spec = {
        "id": exp_id,
        "title": title or f"Test experiment {exp_id}",
        "question": f"Does {exp_id} end below {high:g} nats?",
        "hypothesis": f"The tiny preset's eval/mean after {steps} steps is below {high:g} nats.",
        "prediction": {"metric": "eval/mean", "expected": high / 2 if expected is None else expected, "band": [None, high],
                       "decision_rule": f"Confirmed if eval/mean at the last step is below {high:g}."},
        "owner": "tests",
        "config": {"preset": "tiny", "overrides": {"train.steps": steps, **(overrides or {})}},
    }
    return {**spec, **extra}
