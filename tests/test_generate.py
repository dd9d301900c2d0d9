"""KV-cache sampling (`moelab.model.decode`) and `moelab generate`: the cache computes what a full
recompute computes, sampling is reproducible from its seed, and bad input exits 2 before any output."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import relative_error, run_cli

from moelab import presets
from moelab.config import dump_yaml, load_yaml
from moelab.model import decode, transformer
from moelab.model.moe import Dispatch

CFG = presets.resolve("tiny", {}).model


def _peaked_params(cfg=CFG):
    """tiny's random init with the embedding and head scaled up: at init the logits are nearly flat and greedy
    decoding repeats one byte, which would let a broken cache pass; scaled, the argmax changes every token."""
    params = transformer.init(cfg, jax.random.key(0))
    params = {**params, "embed": 50 * params["embed"], "lm_head": 20 * params["lm_head"]}
    if cfg.qk_norm is not None:  # gains away from one, so a cache that skipped the norm would decode otherwise
        layers = params["layers"]
        params["layers"] = {**layers, **{k: 1 + 0.5 * jax.random.normal(jax.random.key(7), layers[k].shape)
                                         for k in ("q_norm", "k_norm")}}
    return params


# The plain model's case is `slow` (issue 59: ~5 s); the fast suite runs the cache with every option on.
@pytest.mark.parametrize("qk_norm, rope_fraction, dense_layers", [pytest.param(None, 1.0, 0, marks=pytest.mark.slow),
                                                                  ("full", 0.5, 1)])
def test_greedy_decoding_with_the_cache_equals_full_recompute_token_for_token(qk_norm, rope_fraction, dense_layers):
    """Also with QK-norm over the whole projection (OLMoE's), RoPE on half of each head and a dense first block
    (GLM-4.5's; issue 51): the cache normalizes and rotates as the forward does, each block in its own cache row."""
    cfg = dataclasses.replace(CFG, qk_norm=qk_norm, rope_fraction=rope_fraction, dense_layers=dense_layers)
    params = _peaked_params(cfg)
    bias = 0.1 * jax.random.normal(jax.random.key(1), (cfg.num_moe_layers, cfg.moe.num_experts))  # biased selection
    prompt = np.asarray(jax.random.randint(jax.random.key(2), (2, 11), 0, 256))
    sampler = decode.make_sampler(cfg, decode.Sampling(temperature=0), 257)
    key = jax.random.key(0)
    cache, token = sampler.prefill(params, bias, jnp.asarray(prompt), key)
    cached = [np.asarray(token)]
    for _ in range(30):
        last_cache, last_token = jax.tree.map(jnp.copy, cache), token  # `step` donates (reuses) its cache
        cache, token = sampler.step(params, bias, cache, token, key)
        cached.append(np.asarray(token))
    cached = np.stack(cached, axis=1)

    # The oracle: one full forward over the whole sequence per new token (jitted once on a fixed-length buffer;
    # causal attention keeps the zeros past the filled positions out of the logits read).
    dropless = Dispatch("dropless")
    full = jax.jit(lambda tokens: transformer.apply(params, tokens, cfg, bias, dispatch=dropless)[0])
    P, new = prompt.shape[1], 31
    buf = np.zeros((2, P + new), np.int32)
    buf[:, :P] = prompt
    for i in range(new):
        buf[:, P + i] = np.asarray(jnp.argmax(full(jnp.asarray(buf))[:, P + i - 1, :257], axis=-1))
    recomputed = buf[:, P:]
    assert len(set(recomputed[0].tolist())) > 5  # a varied continuation, not one repeated byte
    np.testing.assert_array_equal(cached, recomputed)
    # The last cached step's logits are the full forward's at that position (float32 rounding apart).
    step_logits, _ = jax.jit(decode.apply_cached, static_argnums=2)(params, last_token[:, None], cfg, bias, last_cache)
    assert relative_error(step_logits[:, 0], full(jnp.asarray(buf))[:, P + new - 2]) < 1e-5


def test_top_k_and_top_p_leave_only_the_most_likely_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05, 0.0]]))
    keys = jax.random.split(jax.random.key(0), 400)

    def drawn(sampling, vocab_size=5, logits=logits):
        draw = jax.jit(jax.vmap(lambda k: decode.sample_token(logits, k, sampling, vocab_size)[0]))
        return set(np.asarray(draw(keys)).tolist())

    assert drawn(decode.Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert drawn(decode.Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert drawn(decode.Sampling(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7: the crossing token stays
    assert drawn(decode.Sampling(temperature=1.0, top_p=0.4)) == {0}
    assert drawn(decode.Sampling(temperature=0)) == {0}
    # A padded vocabulary's extra ids are never drawn, even when they are the most likely.
    assert drawn(decode.Sampling(), vocab_size=2, logits=jnp.asarray([[0.0, 0.0, 9.0]])) == {0, 1}


def _generate(run, monkeypatch, capsys, *args):
    return run_cli(["generate", str(run), *args], monkeypatch, capsys)


def test_generate_is_reproducible_from_its_seed(trained_tiny_run, monkeypatch, capsys):
    args = ["--prompt", "def ", "--max-new-tokens", "24", "--temperature", "1.0", "--json"]
    code, first, err = _generate(trained_tiny_run, monkeypatch, capsys, *args, "--seed", "3")
    assert code == 0, err
    _, again, _ = _generate(trained_tiny_run, monkeypatch, capsys, *args, "--seed", "3")
    _, other, _ = _generate(trained_tiny_run, monkeypatch, capsys, *args, "--seed", "4")
    row = json.loads(first)
    assert row["prompt"] == "def " and row["tokens"] == 24 and row["stopped"] == "length"
    assert first == again
    assert json.loads(other)["completion"] != row["completion"]


def test_generate_streams_each_prompt_of_a_jsonl_file(trained_tiny_run, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "417 + 86 ="}\n\n{"prompt": ""}\n')
    code, out, err = _generate(trained_tiny_run, monkeypatch, capsys, "--prompts", str(prompts),
                               "--temperature", "0", "--max-new-tokens", "12")
    assert code == 0, err
    assert out.startswith("417 + 86 =") and "-" * 40 in out
    code, out, _ = _generate(trained_tiny_run, monkeypatch, capsys, "--prompts", str(prompts), "--temperature", "0",
                             "--max-new-tokens", "12", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["417 + 86 =", ""] and all(r["tokens"] <= 12 for r in rows)


def _without_tokenizer(run, tmp_path):
    """A copy of the run whose config says data.tokenizer: bpe and which has no tokenizer.json (an old run)."""
    copy = tmp_path / "old-run"
    shutil.copytree(run, copy)
    cfg = load_yaml(copy / "config.yaml")
    (copy / "config.yaml").write_text(dump_yaml(dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, tokenizer="bpe"))))
    return copy


@pytest.mark.parametrize("case", ["no run", "no checkpoint", "prompt too long", "no tokenizer", "bad jsonl",
                                  "both prompt options"])
def test_generate_bad_input_exits_2_with_one_paragraph_and_no_output(case, trained_tiny_run, tmp_path,
                                                                     monkeypatch, capsys):
    run, args = trained_tiny_run, ["--prompt", "x"]
    if case == "no run":
        run = tmp_path / "nothing"
    elif case == "no checkpoint":
        run = tmp_path / "fresh"
        run.mkdir()
        shutil.copy(trained_tiny_run / "config.yaml", run / "config.yaml")
    elif case == "prompt too long":
        args = ["--prompt", "a" * 128]  # tiny's seq_len is 128: at most 127 prompt tokens
    elif case == "no tokenizer":
        run = _without_tokenizer(trained_tiny_run, tmp_path)
    elif case == "bad jsonl":
        bad = tmp_path / "p.jsonl"
        bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
        args = ["--prompts", str(bad)]
    else:
        args = ["--prompt", "x", "--prompts", "p.jsonl"]
    code, out, err = _generate(run, monkeypatch, capsys, *args)
    assert code == 2 and out == ""
    assert "Traceback" not in err
    message = err[err.index("Error:"):]
    assert message.count("\n") == 1  # one paragraph
    expected = {"no run": "is not a moelab run", "no checkpoint": "has no checkpoint",
                "prompt too long": "is 128 tokens; the model's context (model.seq_len) is 128",
                "no tokenizer": "--tokenizer", "bad jsonl": "line 2", "both prompt options": "exactly one of"}[case]
    assert expected in message


def test_a_folder_that_is_not_a_run_names_the_runs_below_it_or_what_a_run_holds(tmp_path, monkeypatch, capsys):
    """A lab root holds its runs two levels down (ROOT/EXPERIMENT/STEP-VERSION); the error used to suggest
    `runs/demo/steps/train-demo-tiny-...`, a layout nothing writes."""
    for run in ("demo-tiny/train-main-1a2b3c4d", "demo-tiny/rung-0-5e6f7a8b"):
        (tmp_path / "root" / run / "checkpoints").mkdir(parents=True)
        (tmp_path / "root" / run / "config.yaml").write_text("name: x\n")
    (tmp_path / "root" / "demo-tiny" / "fit-9c0d1e2f").mkdir()  # a step that is not a training: not suggested
    code, _, err = _generate(tmp_path / "root", monkeypatch, capsys, "--prompt", "x")
    message = " ".join(err.split())  # Rich wraps the paragraph
    assert code == 2 and "is not a moelab run" in message
    runs = [str(tmp_path / "root" / "demo-tiny" / r) for r in ("rung-0-5e6f7a8b", "train-main-1a2b3c4d")]
    assert f"The runs below it: {runs[0]}, {runs[1]}; give one of those." in message and "fit-" not in message
    (tmp_path / "empty").mkdir()
    code, _, err = _generate(tmp_path / "empty", monkeypatch, capsys, "--prompt", "x")
    message = " ".join(err.split())
    assert code == 2 and "it holds config.yaml and checkpoints/" in message and "steps/" not in message


def test_reading_a_run_that_is_saving_a_checkpoint_changes_nothing_on_disk(trained_tiny_run, tmp_path):
    """generate / eval / export read runs that may still be training: a newest step without its manifest
    (a save in progress) and an Orbax temporary folder are skipped and left alone, not moved aside or deleted."""
    from moelab.train.weights import load_run

    run = tmp_path / "run"
    shutil.copytree(trained_tiny_run, run, ignore=shutil.ignore_patterns("wandb"))
    ckpts = run / "checkpoints"
    [sealed] = [p for p in ckpts.iterdir() if p.name.isdigit()]
    saving = ckpts / str(int(sealed.name) + 10)
    shutil.copytree(sealed, saving)
    (saving / "moelab_manifest.json").unlink()
    (ckpts / f"{int(sealed.name) + 20}.orbax-checkpoint-tmp-1").mkdir()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    weights = load_run(run)
    assert weights.step == int(sealed.name)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_damaged_checkpoint_files_are_refused_by_name_never_a_traceback(trained_tiny_run, tmp_path_factory):
    """Fuzzed (issue 29): any file of the newest checkpoint damaged, deleted or replaced; `load_run` then finds no
    valid checkpoint (each step is sealed by a digest of its files) and says so, or loads the untouched run."""
    from hypothesis import HealthCheck, given, settings

    from mutations import fresh_copy, mutations
    from moelab.errors import DataError
    from moelab.train.weights import load_run

    files = sorted(p.relative_to(trained_tiny_run).as_posix()
                   for p in (trained_tiny_run / "checkpoints").rglob("*") if p.is_file())
    tmp = tmp_path_factory.mktemp("ckpt-fuzz")

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(mutation=mutations(files))
    def run(mutation):
        copy = fresh_copy(trained_tiny_run, tmp / "run")
        changed = mutation.apply(copy)
        try:
            load_run(copy)
        except DataError as e:
            assert str(copy) in str(e), e
            return
        assert not changed, mutation

    run()
