"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path for conftest.py)."""

import sys


def run_cli(args, monkeypatch, capsys):
    """Run `moelab ARGS` in-process as a user would; returns (exit code, stdout, stderr)."""
    from moelab import cli

    monkeypatch.setattr(sys, "argv", ["moelab", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def float_scatter_adds(jaxpr_text: str) -> list[str]:
    """Lines of a printed jaxpr that scatter-add floats (integer counting, e.g. bincount, is cheap)."""
    return [line.strip() for line in jaxpr_text.splitlines()
            if "scatter-add" in line and any(f":{t}[" in line for t in ("f32", "bf16", "f16"))]


def dispatch_gradient_jaxpr(dispatch_fn, cfg, num_tokens: int) -> str:
    """The printed jaxpr of d(sum of a dispatch's outputs) / d(rows, combine weights, expert weights), bf16.

    `dispatch_fn(h, routing, experts, capacity_factor)` is a backend; the routing comes from `cfg`'s
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
        out, _ = dispatch_fn(h, routing._replace(weights=weights), experts, cfg.moe.capacity_factor)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return str(jax.make_jaxpr(grad)(x.astype(jnp.bfloat16), routing.weights, experts))
