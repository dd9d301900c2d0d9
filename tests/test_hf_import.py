"""`moelab import` (issue 51): tiny random Mixtral, Glm4Moe, Qwen3-MoE and OLMoE models built with `transformers`,
saved sharded, imported, give transformers' logits and expert choices; an export imports back bitwise; training
continues from an import and resumes bitwise; bad folders exit 2 naming the file and the field, leaving
nothing behind."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli

from moelab.export import hf_import, writer
from moelab.model import transformer
from moelab.model.moe import build_moe
from moelab.model.router import route
from moelab.train.weights import load_run

VOCAB, LENGTH = 300, 256  # >= 257 ids: the byte tokenizer fits; 256 positions: a RoPE layout bug shows


def _mixtral(tmp_path):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=LENGTH, rope_theta=10000.0)
    return _saved(MixtralForCausalLM(cfg), tmp_path / "mixtral")


def _glm4_moe(tmp_path):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(1)
    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, n_group=2, topk_group=1,
                        first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True, norm_topk_prob=True,
                        routed_scaling_factor=2.5, max_position_embeddings=LENGTH)
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():  # a correction bias that changes choices: a bias bug cannot pass unseen. Positive, as
        # GLM-4.5's and DeepSeek-V3's are: with a negative one an expert outside the chosen groups (scored 0) can
        # tie another and win, and torch and XLA break such ties differently (`router.within_best_groups`).
        for layer in _moe_layers(model):
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.rand(8))
    return _with_norm_gains(_saved(model, tmp_path / "glm4_moe"))


def _glm4_moe_bias(tmp_path):
    """GLM-4.5's published configs set attention_bias: q, k and v projections with biases, here random (a bias read
    into the wrong place, or left out, shows in the logits)."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(4)
    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                        max_position_embeddings=LENGTH)
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(0.5 * torch.randn(proj.bias.shape))
    return _saved(model, tmp_path / "glm4_moe_bias")


def _qwen3_moe(tmp_path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=LENGTH, mlp_only_layers=[0])
    return _with_norm_gains(_saved(Qwen3MoeForCausalLM(cfg), tmp_path / "qwen3_moe"))


def _olmoe(tmp_path):
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(3)
    cfg = OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      max_position_embeddings=LENGTH, eos_token_id=VOCAB - 1, pad_token_id=0)
    return _with_norm_gains(_saved(OlmoeForCausalLM(cfg), tmp_path / "olmoe"))


def _with_norm_gains(saved):
    """QK-norm gains away from their init of ones, saved again: a gain read into the wrong place shows."""
    import torch

    model, folder = saved
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
    return _saved(model, folder)


def _moe_layers(model) -> list:
    """The decoder layers with a router (`mlp.gate`): all but the dense first ones (Glm4Moe's first_k_dense_replace,
    Qwen3-MoE's mlp_only_layers)."""
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def _saved(model, folder):
    import torch

    with torch.no_grad():  # routers away from their near-uniform init: each token's choice is its own, not the bias's
        for layer in _moe_layers(model):
            gate = layer.mlp.gate
            gate.weight.mul_(30.0) if gate.weight.abs().max() < 0.5 else None
    model.save_pretrained(folder, max_shard_size="40KB")  # several shards and an index
    assert (folder / "model.safetensors.index.json").is_file()
    return model.eval(), folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    made = {"mixtral": _mixtral(tmp), "glm4_moe": _glm4_moe(tmp), "qwen3_moe": _qwen3_moe(tmp), "olmoe": _olmoe(tmp),
            "glm4_moe_bias": _glm4_moe_bias(tmp)}
    return {name: (model, folder, hf_import.import_checkpoint(folder, tmp / f"run-{name}"), tmp / f"run-{name}")
            for name, (model, folder) in made.items()}


@pytest.mark.parametrize("name", ["mixtral", "glm4_moe", "qwen3_moe", "olmoe", "glm4_moe_bias"])
def test_an_imported_model_gives_transformers_logits_and_expert_choices(imported, name):
    """float32, 2 x 256 tokens: the same function (max |logit difference| <= 1e-4, the export check's bound:
    torch and XLA sum in other orders; a wrong or transposed weight moves logits by order 0.1-1), and the
    same experts chosen for every token of every layer: the ones transformers' own routers chose in that forward."""
    model, _, summary, out = imported[name]
    assert summary["architecture"] == type(model).__name__ and summary["tensors_left_out"] == []
    run = load_run(out)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))
    theirs, routed = _transformers_forward(model, tokens)
    ours, _ = transformer.apply(run.params, jnp.asarray(tokens, jnp.int32), run.cfg.model, run.router_bias,
                                dispatch=build_moe(run.cfg.model, purpose="decode"))
    assert float(np.max(np.abs(np.asarray(ours) - theirs))) <= 1e-4
    m = run.cfg.model
    assert len(routed) == m.num_moe_layers == m.num_layers - (name in ("glm4_moe", "qwen3_moe", "glm4_moe_bias"))
    for i, (h, expected) in enumerate(routed):  # each MoE layer's router, on transformers' input to it
        chosen = route(jnp.asarray(h), run.params["layers"]["w_router"][i], run.router_bias[i], m.moe)
        np.testing.assert_array_equal(np.sort(np.asarray(chosen.expert_idx), -1), np.sort(expected, -1))


def _transformers_forward(model, tokens) -> tuple[np.ndarray, list]:
    """transformers' logits, and per MoE layer (its router's input [T, D], the experts it chose [T, k]), caught by
    a hook on the router module (`mlp.gate`), which in transformers 5 returns (logits, weights, expert indices)."""
    import torch

    routed = []

    def catch(module, args, out):
        _, _, chosen = out
        routed.append((args[0].reshape(-1, args[0].shape[-1]).numpy().copy(), chosen.numpy().copy()))

    hooks = [layer.mlp.gate.register_forward_hook(catch) for layer in _moe_layers(model)]
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens)).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits.numpy(), routed


@pytest.mark.parametrize("name", ["mixtral", "glm4_moe", "qwen3_moe", "olmoe", "glm4_moe_bias"])
def test_import_export_import_gives_back_the_tensors_and_the_params(imported, name, tmp_path):
    """Import -> export writes the original checkpoint's class and tensors (same names, bitwise; the dense first
    blocks included), and `--check` passes on it; export -> import reads the same params and router bias back,
    bitwise."""
    from safetensors.numpy import load_file

    from moelab.export.check import check_export

    _, folder, _, out = imported[name]
    run = load_run(out)
    result = writer.export_run(run, tmp_path / "export", source=out)
    assert result["layout"] == name.removesuffix("_bias") and result["hf_class"] == json.loads((folder / "config.json").read_text())[
        "architectures"][0]
    assert check_export(tmp_path / "export", run)["passed"]
    original = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = {k: v for f in sorted((tmp_path / "export").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(original) <= set(exported)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    hf_import.import_checkpoint(tmp_path / "export", tmp_path / "again")
    again = load_run(tmp_path / "again")
    for a, b in zip(jax_leaves(again.params), jax_leaves(run.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(again.router_bias), np.asarray(run.router_bias))


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _copy(folder, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    return copy


def _edit_config(**changes):
    def edit(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _truncate_first_shard(folder):
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:20])


def _drop_tensor(folder):
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("edit, names", [
    (_edit_config(architectures=["LlamaForCausalLM"]), ["config.json", "architectures", "LlamaForCausalLM"]),
    (_edit_config(sliding_window=128), ["config.json", "sliding_window=128"]),
    (_edit_config(hidden_size=48), ["model.embed_tokens.weight", "shape"]),
    (_edit_config(num_local_experts=None), ["config.json", "num_local_experts is missing"]),
    (_edit_config(num_local_experts="eight"), ["config.json", "not a number"]),
    (_edit_config(quantization_config={"quant_method": "fp8"}), ["config.json", "quantization_config", "fp8"]),
    (_truncate_first_shard, ["model-00001", "safetensors"]),
    (_drop_tensor, ["model.layers.1.self_attn.k_proj.weight", "missing"]),
    (lambda f: (f / "config.json").write_text("{not json"), ["config.json", "not JSON"]),
])
def test_a_folder_moelab_cannot_import_exits_2_naming_the_file_and_field_and_writes_nothing(
        imported, edit, names, tmp_path, monkeypatch, capsys):
    _, folder, _, _ = imported["mixtral"]
    copy = _copy(folder, tmp_path)
    edit(copy)
    code, out, err = run_cli(["import", str(copy), "--out", str(tmp_path / "run")], monkeypatch, capsys)
    text = " ".join(err.split())
    assert code == 2 and out == "" and all(n in text for n in names), err
    assert not (tmp_path / "run").exists() and [p.name for p in tmp_path.iterdir()] == ["copy"]


@pytest.mark.parametrize("name, field, value", [
    ("glm4_moe", "first_k_dense_replace", 3), ("mixtral", "rope_scaling", {"factor": 2}),
    ("qwen3_moe", "mlp_only_layers", [1]), ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "use_sliding_window", True), ("olmoe", "clip_qkv", 8.0), ("olmoe", "attention_bias", True),
])
def test_values_moelab_does_not_model_are_refused_by_name(imported, name, field, value, tmp_path, monkeypatch, capsys):
    """No MoE block left, dense blocks anywhere but first, RoPE scaling, sliding windows, clipped projections:
    refused naming the field, never approximated."""
    _, folder, _, _ = imported[name]
    copy = _copy(folder, tmp_path)
    _edit_config(**{field: value})(copy)
    code, _, err = run_cli(["import", str(copy), "--out", str(tmp_path / "run")], monkeypatch, capsys)
    assert code == 2 and field in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_training_continues_from_an_import_under_ep_on_8_devices(imported, tmp_path, monkeypatch, capsys):
    """The imported Glm4Moe trained expert-parallel on 2 x 4 simulated devices (`--mesh` changes the dispatch to
    `ep`: allowed, the weights keep their shapes): the held-out loss falls from the imported model's. Measured
    5.70 -> 4.53 in 20 steps. `slow`: an `ep` train step compiled on the 2 x 4 mesh, ~20 s on 2 cores."""
    import shutil

    _, _, _, imported_run = imported["glm4_moe"]
    out = tmp_path / "run"
    shutil.copytree(imported_run, out)
    code, _, err = run_cli(["train", str(out / "config.yaml"), "--out", str(out), "--steps", "20", "--mesh",
                            "replica=2,expert=4", "--set", "train.eval_every=10", "--set", "train.eval_batches=1"],
                           monkeypatch, capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["platform"]["num_devices"] == 8
    assert summary["eval_mean"] < summary["eval_initial"]["mean"] - 0.1, summary


def test_an_import_born_on_a_mesh_holds_the_same_weights_in_their_shards(imported, tmp_path):
    """`--mesh replica=2,expert=4` (8 simulated devices): each tensor goes straight into its shards (experts over
    "expert"); restored on one device the params and bias are the single-device import's, bitwise."""
    import jax

    from moelab.config import MeshConfig
    from moelab.config import load_yaml

    _, folder, _, single = imported["glm4_moe"]
    summary = hf_import.import_checkpoint(folder, tmp_path / "ep", mesh=MeshConfig(replica=2, expert=4))
    assert summary["mesh"] == {"replica": 2, "expert": 4}
    cfg = load_yaml(tmp_path / "ep" / "config.yaml")
    assert cfg.model.moe.dispatch == "ep" and cfg.mesh.expert == 4
    sharded, reference = load_run(tmp_path / "ep"), load_run(single)
    for x, y in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(sharded.router_bias), np.asarray(reference.router_bias))


def test_a_key_config_json_leaves_out_reads_as_transformers_reads_it(imported, tmp_path):
    """transformers' own defaults, not moelab's: a Glm4Moe config without partial_rotary_factor rotates half of each
    head (Glm4MoeConfig's 0.5), a Mixtral one without rope_theta uses 1e6 and rms_norm_eps 1e-5."""
    from moelab.export.hf_import import model_config

    _, cfg = model_config({"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 300, "hidden_size": 32,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 0},
                          tmp_path / "config.json")
    assert cfg.rope_fraction == 0.5 and cfg.norm_eps == 1e-5 and cfg.moe.num_shared_experts == 1
    _, cfg = model_config({"architectures": ["MixtralForCausalLM"], "vocab_size": 300, "hidden_size": 32,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 4,
                           "num_experts_per_tok": 2, "intermediate_size": 16}, tmp_path / "config.json")
    assert cfg.rope_theta == 1e6 and cfg.norm_eps == 1e-5


def test_a_tensor_moelab_would_drop_is_refused_unless_it_is_a_prediction_layer(imported, tmp_path, monkeypatch,
                                                                              capsys):
    """An extra tensor inside the model's layers (an attention bias config.json did not announce) would be dropped
    silently: refused, naming it. One past the last layer (GLM-4.5's multi-token prediction) is left out, listed."""
    from safetensors.numpy import save_file

    _, folder, _, _ = imported["mixtral"]
    for name, refused in (("model.layers.0.self_attn.q_proj.bias", True), ("model.layers.2.eh_proj.weight", False)):
        copy = _copy(folder, tmp_path / name)
        save_file({name: np.zeros(4, np.float32)}, str(copy / "extra.safetensors"))
        index = copy / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"][name] = "extra.safetensors"
        index.write_text(json.dumps(data))
        code, out, err = run_cli(["import", str(copy), "--out", str(tmp_path / name / "run"), "--json"], monkeypatch,
                                 capsys)
        if refused:
            assert code == 2 and name in err, err
        else:
            assert code == 0 and json.loads(out)["tensors_left_out"] == [name], err


def test_a_config_that_reshapes_the_imported_weights_is_refused_naming_only_what_reshapes(imported, monkeypatch,
                                                                                         capsys):
    _, _, _, out = imported["mixtral"]
    code, _, err = run_cli(["train", str(out / "config.yaml"), "--out", str(out), "--steps", "2", "--set",
                            "model.moe.expert_dim=32", "--set", "model.moe.dispatch=dropless"], monkeypatch, capsys)
    text = " ".join(err.split())
    assert code == 2 and "model.moe.expert_dim changes their shapes" in text and "dispatch" not in text.split("shapes")[0]


def test_moelabs_own_export_layout_is_refused_by_import_saying_how_to_load_it(tmp_path):
    from moelab.errors import ConfigError

    with pytest.raises(ConfigError, match="moelab's own export layout, not a transformers checkpoint: load it with "
                                          "moelab.export.writer.load_export"):
        hf_import.model_config({"format": "moelab", "model": {}}, tmp_path / "config.json")
