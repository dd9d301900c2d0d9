"""Config validation, YAML round-trips, dotted overrides, presets and the accounting of each."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from moelab import accounting, presets
from moelab.config import (ModelConfig, MoEConfig, PhaseConfig, RunConfig, TrainConfig, changed_fields, dump_yaml, from_dict, load_yaml, override, parse_overrides, to_dict)
from moelab.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model.num_heads": 3}, "model.num_heads"),
        ({"model.num_kv_heads": 3}, "model.num_kv_heads"),
        ({"model.moe.num_experts_per_token": 9}, "model.moe.num_experts_per_token"),
        ({"model.moe.capacity_factor": 0}, "model.moe.capacity_factor"),
        ({"model.moe.capacity_factor": -1.0}, "model.moe.capacity_factor"),
        ({"model.moe.dispatch": "magic"}, "model.moe.dispatch"),
        ({"train.lr": -1.0}, "train.lr"),
        ({"model.embed_std": 0.0}, "model.embed_std"),
        ({"train.steps": 0}, "train.steps"),
        ({"model.moe.num_experts": 6, "mesh.expert": 4}, "model.moe.num_experts"),
        ({"train.batch_size": 6, "mesh.expert": 4}, "train.batch_size"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        override(presets.get("tiny"), overrides)


def _float_fields(cls: type, prefix: str) -> list[str]:
    """Dotted names of every float field (float or float | None) of `cls` and the sections inside it."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out += _float_fields(tp, f"{prefix}{name}.")
        elif tp is float or float in typing.get_args(tp):
            out.append(prefix + name)
    return out


FLOAT_FIELDS = _float_fields(RunConfig, "")


def test_the_float_field_list_covers_every_section():
    """Guards the test below: an empty or partial list would make it pass without checking anything."""
    assert {name.split(".")[0] for name in FLOAT_FIELDS} == {"model", "data", "train", "monitor", "plan"}
    assert {"model.moe.capacity_factor", "train.lr", "plan.tokens_per_s"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "1e999", "-1e999", "nan"])
def test_every_float_field_refuses_non_finite_values_naming_the_field(field, value):
    """inf passes a range check such as `lr > 0`, so finiteness is one rule for every float field, not a
    check per field; "1e999" is how YAML 1.1 and `--set` hand over a number that overflows."""
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}=.* must be a finite number"):
        override(presets.get("tiny"), {field: value})


def test_constructed_configs_refuse_non_finite_floats_too():
    with pytest.raises(ConfigError, match=r"train\.lr=inf .*finite"):
        TrainConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match=r"model\.moe\.capacity_factor=nan .*finite"):
        MoEConfig(capacity_factor=float("nan"))
    with pytest.raises(ConfigError, match=r"data\.phases\[all\]\.weights\.code=inf .*finite"):
        PhaseConfig("all", 1.0, {"code": float("inf")})


@pytest.mark.parametrize("weight, message", [("lots", "'lots' must be a number"), (float("inf"), "inf is invalid"),
                                             ("1e999", "'1e999' is invalid"), (None, "None must be a number")])
def test_phase_weights_must_be_finite_numbers(weight, message):
    data = {"data": {"phases": [{"name": "all", "fraction": 1.0, "weights": {"code": weight, "prose": 1}}]}}
    with pytest.raises(ConfigError, match=rf"data\.phases\[0\]\.weights\.code={re.escape(message)}"):
        from_dict(data)


def test_a_domain_without_a_name_is_refused_naming_the_missing_key():
    with pytest.raises(ConfigError, match=r"data\.domains\[0\]\.name is required.*name, kind, paths"):
        from_dict({"data": {"domains": [{"kind": "files", "paths": ["a.txt"]}]}})


@pytest.mark.parametrize("latent", [64, 128])
def test_a_latent_as_wide_as_the_model_or_wider_is_refused(latent):
    with pytest.raises(ConfigError, match=rf"model\.moe\.latent_dim={latent} .*smaller than model\.d_model=64"):
        override(presets.get("tiny"), {"model.moe.latent_dim": latent})
    assert override(presets.get("tiny"), {"model.moe.latent_dim": 48}).model.moe.latent_dim == 48


@pytest.mark.parametrize("field", ["model.moe.latent_dim", "model.moe.shared_expert_dim", "model.head_dim",
                                   "checkpoint.every", "checkpoint.keep_every"])
def test_an_unsettable_field_set_to_0_says_how_to_unset_it(field):
    """`=0` is what a user types to turn LatentMoE off; the message must show the `=null` that does it."""
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}=0 is invalid: .*or null to unset it.*--set {re.escape(field)}=null"):
        override(presets.get("tiny"), {field: 0})
    assert override(presets.get("tiny"), {field: None}) is not None  # null is accepted


def test_unknown_keys_are_named_with_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k.*num_experts_per_token"):
        override(presets.get("tiny"), {"model.moe.top_k": 2})
    with pytest.raises(ConfigError, match=r"Unknown key model\.hidden"):
        from_dict({"model": {"hidden": 3}})


def test_every_preset_round_trips_through_yaml(tmp_path):
    for name in presets.PRESETS:
        cfg = presets.get(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_yaml(cfg))
        assert load_yaml(path) == cfg


def test_malformed_yaml_and_missing_file_raise_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")


def test_overrides_parse_yaml_scalars_and_reject_missing_equals():
    parsed = parse_overrides(["train.lr=1e-3", "model.moe.latent_dim=null", "train.steps=5"])
    assert parsed == {"train.lr": "1e-3", "model.moe.latent_dim": None, "train.steps": 5}
    cfg = override(presets.get("tiny"), parsed)  # `1e-3` is a YAML 1.1 string; float fields accept it
    assert (cfg.train.lr, cfg.model.moe.latent_dim, cfg.train.steps) == (1e-3, None, 5)
    with pytest.raises(ConfigError, match="section.field=value"):
        parse_overrides(["train.lr"])


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="tiny"):
        presets.get("nope")


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.expert": 4}, r"model\.moe\.dispatch='capacity' cannot run with mesh\.expert=4: .*set model\.moe\.dispatch=ep"),
    ({"mesh.replica": 2, "model.moe.dispatch": "grouped"},
     r"model\.moe\.dispatch='grouped' runs on one device, but the mesh has 2: .*Use dispatch 'ep'"),
])
def test_a_dispatch_backend_that_cannot_run_on_the_mesh_is_refused_naming_both_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        override(presets.get("tiny"), overrides)


def test_any_backend_runs_data_parallel_and_ep_runs_on_any_mesh():
    tiny = presets.get("tiny")
    assert override(tiny, {"mesh.replica": 2}).model.moe.dispatch == "capacity"
    assert override(tiny, {"mesh.expert": 4, "model.moe.dispatch": "ep"}).mesh.expert == 4
    assert override(tiny, {"model.moe.dispatch": "ep"}).mesh.expert == 1


def test_the_frontier_preset_passes_the_validation_train_applies_on_its_own_mesh():
    """`train` accepts what RunConfig accepts (every cross-section rule lives there), reloads it from the
    config.yaml it saves, and checks the tokenizer fits the vocabulary; only the device count is left to
    `make_mesh`. The frontier shards 384 experts over 64 devices, so it must name the `ep` backend."""
    from moelab.train.loop import prepare_corpus

    cfg = presets.get("frontier-535b")
    assert (cfg.mesh.replica, cfg.mesh.expert, cfg.model.moe.dispatch) == (11, 64, "ep")
    assert from_dict(to_dict(cfg)) == cfg
    assert prepare_corpus(cfg).tokenizer.vocab_size <= cfg.model.vocab_size
    with pytest.raises(ConfigError, match="dispatch='capacity' cannot run with mesh.expert=64"):
        override(cfg, {"model.moe.dispatch": "capacity"})


def test_resolve_reads_a_preset_a_yaml_file_and_a_spec_mapping_alike(tmp_path):
    sets = {"train.steps": 5, "model.moe.num_experts": 16}
    expected = override(presets.get("tiny"), sets)
    path = tmp_path / "run.yaml"
    path.write_text(dump_yaml(presets.get("tiny")))
    assert presets.resolve("tiny", sets) == expected
    assert presets.resolve(path, sets) == expected
    assert presets.resolve({"preset": "tiny", "overrides": sets}) == expected
    assert presets.resolve({"preset": "tiny", "overrides": {"train.steps": 3}}, sets) == expected  # the caller's last
    assert presets.resolve(to_dict(expected)) == expected


def test_resolve_applies_all_overrides_at_once_so_a_pair_valid_only_together_passes():
    cfg = presets.resolve({"preset": "tiny", "overrides": {"mesh.expert": 4}}, {"model.moe.dispatch": "ep"})
    assert (cfg.mesh.expert, cfg.model.moe.dispatch) == (4, "ep")


@pytest.mark.parametrize("source, message", [
    ({"preset": "tiny", "steps": 3}, "steps cannot sit beside preset; put changes under overrides"),
    ({"preset": "tiny", "overrides": [1]}, r"overrides=\[1\] must map dotted fields to values"),
    ({"preset": "nope"}, "unknown preset 'nope'"),
    (3, "must be a preset name, a YAML file or a mapping"),
])
def test_resolve_refuses_a_bad_source_by_name(source, message):
    with pytest.raises(ConfigError, match=message):
        presets.resolve(source)


def test_changed_fields_names_each_differing_leaf_by_its_dotted_path():
    tiny = presets.get("tiny")
    new = override(tiny, {"train.steps": 5, "model.moe.latent_dim": None})
    assert changed_fields(to_dict(tiny), to_dict(new)) == {"model.moe.latent_dim": (32, None), "train.steps": (300, 5)}
    assert changed_fields({"x": 1}, {"x": 1, "y": {"z": 2}}) == {"y.z": (None, 2)}


def test_mixtral_style_yaml_loads():
    cfg = load_yaml("experiments/mixtral-style.yaml")
    assert cfg.model.moe.router_score == "softmax"
    assert cfg.model.moe.num_shared_experts == 0 and cfg.model.moe.latent_dim is None


def test_accounting_matches_a_hand_count():
    cfg = ModelConfig(
        vocab_size=10, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1, seq_len=16,
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=6, num_shared_experts=1,
                      shared_expert_dim=5, latent_dim=4),
    )
    # Per layer, by hand: q 8*8, k 8*4, v 8*4, o 8*8 = 192; norms 16; router 8*4 = 32;
    # latent down 8*4 + up 4*8 + norm 4 = 68; one expert 3*4*6 = 72; shared 3*8*5 = 120.
    common = 192 + 16 + 32 + 68 + 120
    counts = accounting.count_params(cfg)
    assert counts.embedding == 2 * 10 * 8
    assert counts.total == 2 * (common + 4 * 72) + 160 + 8
    assert counts.active == 2 * (common + 2 * 72) + 8
    # 6 x (active + lm head) + causal attention 6 * L * S * heads * head_dim
    assert accounting.flops_per_token(cfg) == 6 * (counts.active + 80) + 6 * 2 * 16 * 2 * 4


def test_frontier_preset_is_535b_total_23b_active_and_27e23_flops():
    figures = accounting.summarize(presets.get("frontier-535b"))
    assert 530e9 < figures["total_params"] < 540e9
    assert 22e9 < figures["active_params"] < 24e9
    assert 2.5e24 < figures["train_flops"] < 2.9e24
    assert abs(figures["tokens"] - 18.75e12) / 18.75e12 < 1e-4


@pytest.mark.parametrize("name, d, layers, heads, kv", [
    ("ladder-d768", 768, 8, 6, 1), ("ladder-d1024", 1024, 12, 8, 2),
    ("ladder-d1536", 1536, 16, 12, 3), ("ladder-d2048", 2048, 22, 16, 4),
])
def test_ladder_presets_keep_the_frontier_routing_geometry(name, d, layers, heads, kv):
    m = presets.get(name).model
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.resolved_head_dim) == (d, layers, heads, kv, 128)
    assert (m.moe.num_experts, m.moe.num_experts_per_token, m.moe.num_shared_experts) == (384, 8, 2)
    assert m.moe.expert_dim == m.moe.latent_dim == m.moe.resolved_shared_expert_dim == d // 2
    assert (m.vocab_size, m.seq_len) == (128256, 4096)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainConfig().lr = 1.0  # type: ignore[misc]
    assert isinstance(RunConfig().model, ModelConfig)


@pytest.mark.parametrize("latent, shared, dense", [(None, 0, 0), (16, 0, 0), (None, 2, 0), (16, 2, 0), (None, 2, 1)])
def test_accounting_total_equals_the_parameters_the_model_initializes(latent, shared, dense):
    import jax
    import numpy as np

    from moelab.model import transformer

    cfg = ModelConfig(vocab_size=40, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, seq_len=8,
                      dense_layers=dense, moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=24,
                                                        num_shared_experts=shared, shared_expert_dim=12,
                                                        latent_dim=latent))
    params = transformer.init(cfg, jax.random.key(0))
    assert accounting.count_params(cfg).total == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    if dense:  # a dense block is all active, at the MoE block's active width by default: 2 x 24 + 2 x 12
        assert cfg.resolved_dense_ffn_dim == 72 and params["dense_layers"]["w_mlp_gate"].shape == (1, 32, 72)
        moe_only = accounting.count_params(dataclasses.replace(cfg, dense_layers=0))
        assert moe_only.total - accounting.count_params(cfg).total == 2 * 24 * 3 * 32 + 4 * 32  # experts, router
        assert moe_only.active - accounting.count_params(cfg).active == 4 * 32  # the router alone


@pytest.mark.parametrize("dense_layers, dense_ffn_dim, field", [(2, None, "model.dense_layers"),
                                                                (-1, None, "model.dense_layers"),
                                                                (1, 0, "model.dense_ffn_dim")])
def test_dense_layers_leave_at_least_one_moe_block_and_have_a_width(dense_layers, dense_ffn_dim, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(num_layers=2, dense_layers=dense_layers, dense_ffn_dim=dense_ffn_dim)


# ----------------------------------------------------------------------------------------------
# data ergonomics: YAML-relative paths, a preset with your own domains


def test_relative_data_paths_in_a_yaml_are_read_against_its_folder(tmp_path, monkeypatch):
    from moelab.config import load_yaml

    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "run.yaml").write_text(
        "data:\n  tokenizer: tok/tokenizer.json\n  store: ../stores/web\n"
        "  domains:\n    - {name: web, kind: files, paths: ['data/*.jsonl', /abs/x.txt, 's3://bucket/y.jsonl']}\n")
    monkeypatch.chdir(tmp_path)
    data = load_yaml(Path("exp/run.yaml")).data
    assert data.domains[0].paths == (str(folder / "data/*.jsonl"), "/abs/x.txt", "s3://bucket/y.jsonl")
    assert data.store == str(folder / "../stores/web") and data.tokenizer == str(folder / "tok/tokenizer.json")
    assert data.phases == (PhaseConfig("pretrain", 1.0, {"web": 1.0}),)  # no phases given: one, equal weights


def test_a_preset_takes_your_own_domains_by_set_or_a_data_yaml_without_its_embedded_phases(tmp_path):
    from moelab import presets
    from moelab.cli.common import resolve_config

    mine = [{"name": "web", "kind": "files", "paths": ["/d/web.jsonl"]}, {"name": "books", "kind": "files",
                                                                          "paths": ["/d/b.txt"]}]
    cfg = presets.resolve("tiny", {"data.domains": mine})
    assert [d.name for d in cfg.data.domains] == ["web", "books"]
    assert cfg.data.phases == (PhaseConfig("pretrain", 1.0, {"web": 1.0, "books": 1.0}),)
    (tmp_path / "data.yaml").write_text("data:\n  domains:\n    - {name: web, kind: files, paths: [web.jsonl]}\n"
                                        "  phases:\n    - {name: a, fraction: 0.5, weights: {web: 1}}\n"
                                        "    - {name: b, fraction: 0.5, weights: {web: 1}}\n")
    cfg = resolve_config(None, "tiny", ["train.steps=7"], tmp_path / "data.yaml")
    assert cfg.model == presets.get("tiny").model and cfg.train.steps == 7
    assert cfg.data.domains[0].paths == (str(tmp_path / "web.jsonl"),) and len(cfg.data.phases) == 2
    with pytest.raises(ConfigError, match=r"data.phases\[a\].weights"):
        presets.resolve("tiny", {"data.domains": mine, "data.phases": [{"name": "a", "fraction": 1.0,
                                                                         "weights": {"code": 1}}]})


@pytest.mark.parametrize("balancing, knob, value", [
    ("sign", "hist_bins", 64), ("none", "sign_gamma", 0.5), ("hist", "aux_loss_weight", 0.1),
    ("aux", "balance_rate", 0.5), ("exact", "hist_bins", 16),
])
def test_a_knob_of_another_balancer_is_refused_naming_it(balancing, knob, value):
    """Issue 50: a balancer knob its rule does not read was silently ignored; now it names the field and the rule."""
    with pytest.raises(ConfigError, match=rf"model.moe.{knob}=.*only balancing .* reads it.*uses balancing '{balancing}'"):
        MoEConfig(balancing=balancing, num_experts=8, num_experts_per_token=2, **{knob: value})
    MoEConfig(balancing=balancing, **{knob: MoEConfig.__dataclass_fields__[knob].default})  # the default is fine


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_accounting_counts_the_qk_norm_gains_the_model_initializes(qk_norm):
    import jax
    import numpy as np

    from moelab.model import transformer

    cfg = ModelConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=8, qk_norm=qk_norm,
                      moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=24))
    params = transformer.init(cfg, jax.random.key(0))
    assert accounting.count_params(cfg).total == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    with pytest.raises(ConfigError, match="model.qk_norm"):
        ModelConfig(qk_norm="layer")


def test_quantile_balancing_is_refused_with_expert_groups_naming_the_rule_that_fits():
    """The quantile rules solve the bias for plain top-k; under group-limited selection they would solve the wrong one."""
    with pytest.raises(ConfigError, match="model.moe.balancing='hist'.*'sign'"):
        MoEConfig(num_experts=8, num_groups=2, balancing="hist")
    assert MoEConfig(num_experts=8, num_groups=2, balancing="sign").num_groups == 2
