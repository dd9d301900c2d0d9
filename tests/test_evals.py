"""`moelab eval`: loss, perplexity and bits per byte per domain agree with the model's own loss, every token
is scored once, and bad input exits 2."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cli

from moelab.evals import loss as eval_loss
from moelab.model import transformer
from moelab.model.moe import Dispatch
from moelab.train.weights import load_run


@pytest.fixture(scope="module")
def trained(trained_tiny_run):
    return load_run(trained_tiny_run)


def test_windows_predict_every_token_after_the_first_exactly_once():
    stream = np.arange(1, 24, dtype=np.int32)  # 23 tokens, 22 targets
    rows, mask = eval_loss.windows(stream, 8)
    targets = rows[:, 1:][mask]
    np.testing.assert_array_equal(targets, stream[1:])
    assert rows.shape == (3, 9) and mask.sum() == 22


def test_eval_loss_is_the_models_own_loss_and_bits_per_byte_follow_from_it(trained):
    seq_len = trained.cfg.model.seq_len
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(seq_len))  # [eos] + 128 bytes: one full window
    scores = eval_loss.evaluate_documents(trained, {"letters": [text]}, batch_size=2)
    s = scores["letters"]
    tokens = jnp.asarray(eval_loss.token_stream(trained.tokenizer, [text])[None])
    assert tokens.shape == (1, seq_len + 1)
    model = trained.cfg.model
    dropless = Dispatch("dropless")
    _, aux = transformer.loss(trained.params, tokens, model, trained.router_bias, dispatch=dropless)
    assert s.tokens == seq_len and s.bytes == seq_len and s.documents == 1
    assert s.loss == pytest.approx(float(aux["ce"]), rel=1e-5)  # the same sum, in float64 here, float32 there
    assert s.perplexity == pytest.approx(math.exp(s.loss))
    assert s.bits_per_byte == pytest.approx(s.loss * s.tokens / s.bytes / math.log(2))


@pytest.mark.parametrize("max_tokens, documents", [(25, 3), (22, 2), (None, 30)])
def test_max_tokens_counts_only_the_documents_its_tokens_reach(trained, max_tokens, documents):
    """30 documents of 10 byte tokens, each after an eos: 25 tokens reach into the third; 22 end on the eos
    before it (the third has no token scored). The table once said all 30 whatever --max-tokens kept."""
    scores = eval_loss.evaluate_documents(trained, {"d": ["abcdefghij"] * 30}, batch_size=2, max_tokens=max_tokens)
    assert scores["d"].documents == documents and scores["d"].tokens == (max_tokens or 30 * 11 - 1)


def test_eval_command_scores_each_data_file_as_a_domain(trained_tiny_run, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": f"{a} + {a} = {2 * a}"}) + "\n" for a in range(30)))
    code, out, err = run_cli(["eval", str(trained_tiny_run), "--data", str(tmp_path / "notes.txt"), "--data",
                              str(tmp_path / "web.jsonl"), "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result["domains"]) == {"notes", "web"}
    web = result["domains"]["web"]
    assert web["documents"] == 30 and web["tokens"] == web["bytes"] + 30 - 1  # a byte token each, and the eos between documents
    assert all(0 < d["bits_per_byte"] < 10 for d in result["domains"].values())


@pytest.mark.parametrize("args, expected", [
    ([], "give --data"),
    (["--data", "missing.txt"], "--data missing.txt: no such file"),
    (["--data", "missing*.jsonl"], "--data missing*.jsonl: the pattern matches no file"),
])
def test_eval_bad_input_exits_2(args, expected, trained_tiny_run, monkeypatch, capsys):
    code, out, err = run_cli(["eval", str(trained_tiny_run), *args], monkeypatch, capsys)
    message = " ".join(err.split())  # Rich wraps the paragraph
    assert code == 2 and out == "" and expected in message and "Traceback" not in err
    assert "data.domains" not in message  # a field the user never wrote: they passed a file


def _mc_task(folder):
    """An offline multiple-choice lm-eval task: a YAML and its local JSONL (sums, the right answer among four)."""
    rows = [{"question": f"{a} + {b} =", "choices": [f" {a + b + d}" for d in (0, 1, 10, -1)], "answer": 0}
            for a, b in [(12, 30), (41, 7), (25, 25), (63, 19)]]
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums.yaml").write_text(
        "task: moelab_sums_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'sums.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def test_the_harness_adapters_loglikelihood_is_moelabs_own_loss(trained):
    from moelab.evals.harness import make_lm

    class Request:  # what lm-eval hands an LM: its arguments in `args`
        def __init__(self, *args):
            self.args = args

    seq_len, model = trained.cfg.model.seq_len, trained.cfg.model
    text = "".join(chr(ord("a") + (i * 5) % 26) for i in range(seq_len))
    lm = make_lm(trained, batch_size=2)
    (whole, _), (split, _) = lm.loglikelihood([Request("", text), Request(text[:50], text[50:])])
    tokens = jnp.asarray(eval_loss.token_stream(trained.tokenizer, [text])[None])
    dropless = Dispatch("dropless")
    _, aux = transformer.loss(trained.params, tokens, model, trained.router_bias, dispatch=dropless)
    assert whole == pytest.approx(-seq_len * float(aux["ce"]), rel=1e-5)
    assert -split < -whole and -split > 0  # the continuation's part of the same sum
    [rolling] = lm.loglikelihood_rolling([Request(text)])
    assert rolling == pytest.approx(whole, rel=1e-6)


@pytest.mark.slow
def test_eval_tasks_runs_a_local_multiple_choice_task_and_names_an_unknown_one(trained_tiny_run, tmp_path,
                                                                                  monkeypatch, capsys):
    """`slow` (issue 27): lm-eval's import and task building, ~50 s on 2 cores. The fast suite keeps the
    adapter's loglikelihoods equal to moelab's own loss (test_the_harness_adapters_loglikelihood...)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # nothing from the hub: the task is the local YAML + JSONL
    _mc_task(tmp_path)
    code, out, err = run_cli(["eval", str(trained_tiny_run), "--tasks", "moelab_sums_mc", "--include-path",
                              str(tmp_path), "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)["tasks"]["moelab_sums_mc"]
    assert result["sample_len"] == 4 and 0.0 <= result["acc,none"] <= 1.0
    code, out, err = run_cli(["eval", str(trained_tiny_run), "--tasks", "no_such_task", "--include-path",
                              str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and out == "" and "no_such_task is not an lm-eval task" in err


def test_the_harness_runs_without_git_errors_or_progress_bars_and_restores_them(tmp_path, monkeypatch, capfd):
    """Outside a git checkout lm-eval's `git describe` printed `fatal: not a git repository`, and HF datasets
    and lm-eval drew progress bars, on every `moelab eval --tasks`: inside `_quiet_harness` neither prints."""
    pytest.importorskip("lm_eval", reason="lm-eval (the `evals` extra) is not installed")
    import datasets
    import lm_eval.api.task
    import lm_eval.evaluator

    from moelab.evals.harness import _quiet_harness

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # not in a git repository, wherever TMPDIR is
    datasets.enable_progress_bars()
    with _quiet_harness():
        assert lm_eval.evaluator.get_git_commit_hash() is None
        assert datasets.are_progress_bars_disabled()
        list(lm_eval.api.task.tqdm(range(3)))
    assert capfd.readouterr().err == ""
    assert not datasets.are_progress_bars_disabled()
    lm_eval.evaluator.get_git_commit_hash()
    assert "not a git repository" in capfd.readouterr().err  # what it prints unpatched: the test can fail
