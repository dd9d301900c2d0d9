"""`moelab export`: a Mixtral-expressible model loads in transformers as Mixtral, the default recipe (sigmoid
router with its bias, shared experts) as Glm4Moe, each with moelab's dropless logits; `--check` runs that
comparison itself; LatentMoE round-trips through moelab's own layout; targets are never half-written."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import relative_error, run_cli

from moelab import presets
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer
from moelab.export import check, writer
from moelab.model import transformer
from moelab.model.moe import build_moe
from moelab.train.weights import RunWeights, load_run

TINY = presets.resolve("tiny", {})


def _random_run(with_bias: bool = False, **moe_fields) -> RunWeights:
    """tiny with `moe_fields`, random weights with non-unit norm gains so a swapped or missing norm shows, and
    with `with_bias` a router bias large enough to change choices."""
    moe = dataclasses.replace(TINY.model.moe, **moe_fields)
    cfg = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, moe=moe))
    params = transformer.init(cfg.model, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    for name in ("attn_norm", "mlp_norm"):
        params["layers"][name] = 1 + 0.3 * jax.random.normal(next(keys), params["layers"][name].shape)
    params["final_norm"] = 1 + 0.3 * jax.random.normal(next(keys), params["final_norm"].shape)
    params["layers"]["w_router"] = 20 * params["layers"]["w_router"]  # decisive routing: top-k ties would not show
    bias = transformer.init_router_bias(cfg.model)
    if with_bias:
        bias = 0.3 * jax.random.normal(next(keys), bias.shape)
    return RunWeights(cfg, params, bias, 0, ByteTokenizer())


def _mixtral_run() -> RunWeights:
    """tiny as Mixtral expresses it: softmax router, no shared experts, no latent, no bias."""
    return _random_run(router_score="softmax", num_shared_experts=0, latent_dim=None, balancing="none",
                       dispatch="dense")


def _transformers_logits(folder, tokens: np.ndarray, dtype: str = "float32") -> np.ndarray:
    import torch  # the test extras install torch's CPU build and transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens.copy())).logits.float().numpy()


@pytest.mark.slow
def test_a_mixtral_style_export_loads_in_transformers_with_moelabs_logits(tmp_path):
    """`slow` (issue 59: ~9 s, transformers' model built and run): the fast suite keeps what implies it, an
    import-export-import giving back the tensors bitwise and an imported Mixtral giving transformers' logits
    (tests/test_hf_import.py)."""
    run = _mixtral_run()
    result = writer.export_run(run, tmp_path / "mixtral")
    assert result["layout"] == "mixtral" and result["hf_class"] == "MixtralForCausalLM"
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 48), 0, 257))
    ours, _ = transformer.apply(run.params, jnp.asarray(tokens), run.cfg.model, run.router_bias,
                                dispatch=build_moe(run.cfg.model))
    # Same function in float32; torch and XLA sum in other orders (~1e-6), far below any wrong weight (order 1).
    assert relative_error(_transformers_logits(tmp_path / "mixtral", tokens), ours) < 1e-4


@pytest.mark.parametrize("moe_fields", [  # tiny's own MoE without the latent: the trained run's test below
    # fine experts, 2 shared of another width (padded to whole expert widths), weights neither renormalized nor 1
    dict(num_experts=16, num_experts_per_token=4, expert_dim=32, num_shared_experts=2, shared_expert_dim=48,
         normalize_weights=False, routed_scaling=2.5),
    pytest.param(dict(num_shared_experts=0),  # transformers builds a width-0 shared MLP, and says so
                 marks=pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")),
], ids=["fine-padded-shared-scaled", "no-shared"])
def test_sigmoid_routed_models_export_as_glm4_moe_with_moelabs_dropless_logits(tmp_path, moe_fields):
    """The router's bias is random (large enough to change choices), so a bias that did not travel, or one added
    to the combine weights, shows; the run's `capacity` dispatch is replaced by `dropless` for the comparison."""
    run = _random_run(with_bias=True, latent_dim=None, **moe_fields)
    result = writer.export_run(run, tmp_path / "glm")
    assert result["layout"] == "glm4_moe" and result["hf_class"] == "Glm4MoeForCausalLM" and result["why"] is None
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 64), 0, 257))
    ours = check.moelab_logits(run, tokens)
    # Same function in float32, summed in other orders: measured ~3e-7; a wrong weight or choice is order 0.1-1.
    assert np.max(np.abs(_transformers_logits(tmp_path / "glm", tokens) - ours)) <= check.TOLERANCE
    unbiased = check.moelab_logits(run._replace(router_bias=jnp.zeros_like(run.router_bias)), tokens)
    assert np.max(np.abs(unbiased - ours)) > 0.01  # the bias changes choices: the match above says it travelled


def test_a_latent_model_exports_in_moelabs_layout_naming_what_transformers_lacks():
    layout, why = writer.choose_layout(TINY.model, transformer.init_router_bias(TINY.model))
    assert layout == "moelab" and "model.moe.latent_dim=32" in why
    for hf_class in writer.HF_CLASSES.values():  # the refusal names what rules out each of the four
        assert f"not {hf_class}: " in why


@pytest.mark.parametrize("qk_norm, dense_layers, layout", [
    ("head", 1, "qwen3_moe"), ("full", 0, "olmoe"), (None, 0, "mixtral")])
def test_a_softmax_model_trained_from_scratch_exports_as_the_class_that_computes_it(qk_norm, dense_layers, layout):
    """Softmax routing, no shared experts, latent or bias: per-head QK-norm (with dense first blocks) is
    Qwen3-MoE's, QK-norm over the projection OLMoE's, none Mixtral's; an imported run tries its own class first."""
    m = dataclasses.replace(TINY.model, qk_norm=qk_norm, dense_layers=dense_layers, moe=dataclasses.replace(
        TINY.model.moe, router_score="softmax", num_shared_experts=0, latent_dim=None, balancing="none"))
    bias = transformer.init_router_bias(m)
    assert writer.choose_layout(m, bias) == (layout, None)
    assert writer.choose_layout(m, bias, writer.HF_CLASSES[layout])[0] == layout


@pytest.fixture(scope="module")
def trained(trained_tiny_run):
    return load_run(trained_tiny_run)


@pytest.mark.parametrize("max_shard_bytes", [writer.MAX_SHARD_BYTES, 200_000])
def test_moelab_layout_round_trips_with_identical_logits_and_the_router_bias(trained, tmp_path, max_shard_bytes):
    assert np.any(np.asarray(trained.router_bias) != 0)  # hist balancing moved the bias: it must travel
    result = writer.export_run(trained, tmp_path / "tiny", max_shard_bytes=max_shard_bytes)
    assert result["layout"] == "moelab" and "sigmoid" in result["why"]
    sharded = max_shard_bytes < writer.MAX_SHARD_BYTES
    files = sorted(p.name for p in (tmp_path / "tiny").iterdir())
    assert (writer.INDEX in files) == sharded and (writer.WEIGHTS in files) != sharded
    if sharded:
        assert sum(name.endswith(".safetensors") for name in files) > 1
    cfg, params, bias = writer.load_export(tmp_path / "tiny")
    # the export is the model's function: dropless, so a forward never depends on which tokens share a batch
    assert cfg == dataclasses.replace(trained.cfg.model, moe=dataclasses.replace(trained.cfg.model.moe,
                                                                                   dispatch="dropless"))
    np.testing.assert_array_equal(bias, trained.router_bias)
    tokens = jnp.asarray(np.arange(2 * 64).reshape(2, 64) % 257)
    ours, _ = transformer.apply(trained.params, tokens, cfg, trained.router_bias, dispatch=build_moe(cfg))
    back, _ = transformer.apply(jax.tree.map(jnp.asarray, params), tokens, cfg, jnp.asarray(bias),
                                dispatch=build_moe(cfg))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ours))
    assert "load_export" in (tmp_path / "tiny" / "README.md").read_text()


def test_a_bfloat16_moelab_layout_export_reads_back_as_the_params_check_compares_with(trained, tmp_path):
    """`check.exported_params` (what --check runs moelab on) must be what the writer stores: bfloat16-rounded
    weights, the router's float32."""
    writer.export_run(trained, tmp_path / "bf16", dtype="bfloat16")
    _, params, bias = writer.load_export(tmp_path / "bf16")
    expected = check.exported_params(trained.params, "bfloat16")
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, expected))
    np.testing.assert_array_equal(bias, trained.router_bias)
    assert not np.array_equal(params["layers"]["w_q"], trained.params["layers"]["w_q"])  # it was rounded


def test_the_exported_byte_tokenizer_gives_moelabs_ids(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(writer.byte_tokenizer_json())
    hf, ours = HFTokenizer.load(path), ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # é, 漢字, tabs\t!"
    np.testing.assert_array_equal(hf.encode(text), ours.encode(text))
    assert hf.decode(ours.encode(text)) == text and hf.eos_id == ours.eos_id == 256


def test_export_refuses_an_existing_target_without_force_and_replaces_it_with(trained_tiny_run, tmp_path,
                                                                                monkeypatch, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    code, out, err = run_cli(["export", str(trained_tiny_run), "--out", str(target)], monkeypatch, capsys)
    assert code == 2 and out == "" and "already exists; pass --force" in err
    assert (target / "mine.txt").read_text() == "keep me"
    code, out, err = run_cli(["export", str(trained_tiny_run), "--out", str(target), "--force", "--json"],
                             monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["layout"] == "moelab"
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                       "tokenizer.json"]
    readme = (target / "README.md").read_text()  # names the run, not where it lives on this machine
    assert readme.startswith(f"# {trained_tiny_run.name}\n") and str(trained_tiny_run.parent) not in readme
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left beside it


def test_a_failed_export_leaves_nothing_half_written(trained, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_readme", broken)
    with pytest.raises(OSError):
        writer.export_run(trained, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def trained_default_run(tmp_path_factory):
    """tiny's recipe without the latent, the default shape (sigmoid router with a hist-balanced bias, one shared
    expert, top-2 of 8), trained 10 steps: the run issue 32 must load in transformers."""
    from moelab.train.loop import train

    out = tmp_path_factory.mktemp("trained-default") / "run"
    train(presets.resolve("tiny", {"model.moe.latent_dim": None, "train.steps": 10, "train.eval_every": 10,
                                   "train.eval_batches": 1}), out)
    return out


def test_check_of_a_trained_default_run_prints_logits_within_1e4_and_the_same_greedy_text(
        trained_default_run, tmp_path, monkeypatch, capsys):
    from safetensors.numpy import load_file

    code, out, err = run_cli(["export", str(trained_default_run), "--out", str(tmp_path / "x"), "--check"],
                             monkeypatch, capsys)
    assert code == 0, err
    assert "transformers Glm4MoeForCausalLM" in out and "after 'def ': the same." in out
    measured = float(re.search(r"max \|logits difference\| (\S+) over 2x128 tokens", out).group(1))
    assert measured <= check.TOLERANCE
    bias = np.asarray(load_run(trained_default_run).router_bias)
    assert np.any(bias != 0)  # the balancing moved the bias: it must travel, and it must choose
    tensors = load_file(str(tmp_path / "x" / writer.WEIGHTS))
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.gate.e_score_correction_bias"], bias[1])


def test_a_bfloat16_export_is_the_rounded_run_and_holds_bfloat16_inference_within_tolerance(
        trained_default_run, tmp_path, monkeypatch, capsys):
    """The pass is exactness against the rounded weights (1e-4); transformers computing in bfloat16 is bounded
    by its median per-position difference, since its max is a routing flip (`moelab.export.check`)."""
    from safetensors.numpy import load_file

    code, out, err = run_cli(["export", str(trained_default_run), "--out", str(tmp_path / "x"), "--check",
                              "--dtype", "bfloat16", "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["dtype"] == "bfloat16" and result["check"]["passed"]
    assert result["check"]["max_abs_diff"] <= check.TOLERANCE and result["check"]["greedy"]["same"]
    inference = result["check"]["bfloat16_inference"]
    # bfloat16 rounds every matmul input to 8 significant bits (2^-9 relative) and transformers keeps its residual
    # stream in bfloat16 too; on logits of size 1-10 that is a few 1e-2 per position (measured 0.02-0.05 on
    # tiny-shaped runs). A wrong weight moves the logits by their own size.
    assert 0 < inference["median_abs_diff"] <= 0.1 and inference["argmax_agreement"] >= 0.9
    dtypes = {name: str(a.dtype) for name, a in load_file(str(tmp_path / "x" / writer.WEIGHTS)).items()}
    assert {d for name, d in dtypes.items() if ".mlp.gate." not in name} == {"bfloat16"}
    assert {d for name, d in dtypes.items() if ".mlp.gate." in name} == {"float32"}  # moelab routes in float32


def test_check_refuses_a_latent_run_naming_the_option_and_writes_nothing(trained_tiny_run, tmp_path, monkeypatch,
                                                                         capsys):
    code, out, err = run_cli(["export", str(trained_tiny_run), "--out", str(tmp_path / "x"), "--check"],
                             monkeypatch, capsys)
    assert code == 2 and out == ""
    assert "model.moe.latent_dim=32" in err and "Export without --check for moelab's own layout" in err
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_unknown_dtype(trained_tiny_run, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["export", str(trained_tiny_run), "--out", str(tmp_path / "x"), "--dtype", "float16"],
                             monkeypatch, capsys)
    assert code == 2 and "--dtype float16 is not supported: use one of float32, bfloat16" in err


def test_a_failed_check_exits_1_saying_by_how_much(trained_default_run, tmp_path, monkeypatch, capsys):
    def far_off(folder, run, dtype):  # what a wrong weight gives; the real comparison is tested above
        return {"hf_class": "Glm4MoeForCausalLM", "dtype": dtype, "tokens": [2, 128], "max_abs_diff": 0.5,
                "max_abs_logit": 3.0, "tolerance": check.TOLERANCE, "passed": False,
                "greedy": {"prompt": "def ", "new_tokens": 32, "moelab": [1, 2], "transformers": [1, 3], "same": False}}

    monkeypatch.setattr(check, "check_export", far_off)
    code, out, err = run_cli(["export", str(trained_default_run), "--out", str(tmp_path / "x"), "--check"],
                             monkeypatch, capsys)
    assert code == 1
    assert "max |logits difference| 5.00e-01" in out and "differs (moelab [1, 2], transformers [1, 3])" in out
    assert "Check failed" in err and "differ from moelab's by 0.5, more than 0.0001" in err
