"""`moelab export`: a Mixtral-expressible model loads in transformers with the same logits; any other
round-trips through moelab's own layout with identical logits; targets are never half-written."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import relative_error, run_cli

from moelab import presets
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer
from moelab.export import writer
from moelab.model import transformer
from moelab.train.weights import RunWeights, load_run

TINY = presets.resolve("tiny", {})


def _mixtral_run() -> RunWeights:
    """tiny as Mixtral expresses it (softmax router, no shared experts, no latent, no bias), random weights with
    non-unit norm gains so a swapped or missing norm shows."""
    moe = dataclasses.replace(TINY.model.moe, router_score="softmax", num_shared_experts=0, latent_dim=None,
                              balancing="none", dispatch="dense")
    cfg = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, moe=moe))
    params = transformer.init(cfg.model, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    for name in ("attn_norm", "mlp_norm"):
        params["layers"][name] = 1 + 0.3 * jax.random.normal(next(keys), params["layers"][name].shape)
    params["final_norm"] = 1 + 0.3 * jax.random.normal(next(keys), params["final_norm"].shape)
    params["layers"]["w_router"] = 20 * params["layers"]["w_router"]  # decisive routing: top-k ties would not show
    return RunWeights(cfg, params, transformer.init_router_bias(cfg.model), 0, ByteTokenizer())


def test_a_mixtral_style_export_loads_in_transformers_with_moelabs_logits(tmp_path):
    import torch  # the test extras install torch's CPU build and transformers
    from transformers import MixtralForCausalLM

    run = _mixtral_run()
    result = writer.export_run(run, tmp_path / "mixtral")
    assert result["layout"] == "mixtral"
    model = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral", torch_dtype=torch.float32).eval()
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 48), 0, 257))
    ours, _ = transformer.apply(run.params, jnp.asarray(tokens), run.cfg.model, run.router_bias)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens.copy())).logits.numpy()
    # Same function in float32; torch and XLA sum in other orders (~1e-6), far below any wrong weight (order 1).
    assert relative_error(theirs, ours) < 1e-4


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
    assert cfg == trained.cfg.model
    np.testing.assert_array_equal(bias, trained.router_bias)
    tokens = jnp.asarray(np.arange(2 * 64).reshape(2, 64) % 257)
    ours, _ = transformer.apply(trained.params, tokens, cfg, trained.router_bias)
    back, _ = transformer.apply(jax.tree.map(jnp.asarray, params), tokens, cfg, jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ours))
    assert "load_export" in (tmp_path / "tiny" / "README.md").read_text()


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
