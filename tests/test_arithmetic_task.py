"""The arithmetic exact-match task (`moelab.evals.arithmetic`, `moelab eval --arithmetic`) on the shared
trained tiny run: its accuracy is what greedy decoding answers, its loss the answer tokens' own loss."""

import json

import numpy as np
import pytest

from helpers import run_cli
from moelab.data.tokenizer import ByteTokenizer
from moelab.evals.arithmetic import (Problem, heldout_problems, parse_problems, problem_rows, score_problems,
                                     score_rows)
from moelab.evals.loss import make_token_losses
from moelab.model import decode


@pytest.fixture(scope="module")
def weights(trained_tiny_run):
    from moelab.train.weights import load_run

    return load_run(trained_tiny_run)


_SAMPLERS = {}


def _greedy(weights, prompt: str, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens greedy decoding writes after `[eos] prompt` (fewer if it writes eos)."""
    tok, cfg = weights.tokenizer, weights.cfg.model
    if cfg not in _SAMPLERS:  # one compiled sampler for every prompt
        _SAMPLERS[cfg] = decode.make_sampler(cfg, decode.Sampling(temperature=0), tok.vocab_size)
    ids = np.concatenate([[tok.eos_id], tok.encode(prompt)]).astype(np.int32)
    return list(decode.generate(_SAMPLERS[cfg], weights.params, weights.router_bias, ids, seq_len=cfg.seq_len,
                                max_new_tokens=num_tokens, eos_id=tok.eos_id, seed=0))


def test_problems_are_the_lines_of_the_held_out_arithmetic_documents(weights):
    assert parse_problems("417 + 86 = 503\n3 - 9 = -6\nnot a sum\n") == [Problem("417 + 86 =", " 503"),
                                                                        Problem("3 - 9 =", " -6")]
    problems = heldout_problems(weights.cfg.data)
    assert len(problems) > 50 and heldout_problems(weights.cfg.data, limit=7) == problems[:7]
    for p in problems[:50]:  # each one is true arithmetic
        a, op, b, _ = p.prompt.split()
        assert int(p.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_the_mask_covers_exactly_the_answer_and_its_newline():
    tok = ByteTokenizer()
    rows, mask = problem_rows(tok, [Problem("41 + 8 =", " 49")], width=24)
    targets = rows[0, 1:]
    assert tok.decode(targets[mask[0]].tolist()) == " 49\n"
    assert tok.decode(rows[0, 1:1 + len("41 + 8 =")].tolist()) == "41 + 8 =" and not mask[0, :len("41 + 8 =")].any()


def test_accuracy_is_what_greedy_decoding_answers_and_the_loss_is_the_answer_tokens_own(weights):
    """Not vacuous at a size that gets no sum right: the model's own greedy continuations count as right,
    and the same continuations with one token changed as wrong."""
    tok, width = weights.tokenizer, weights.cfg.model.seq_len + 1
    problems = heldout_problems(weights.cfg.data, limit=8)
    rows, mask = problem_rows(tok, problems, width)
    own, own_mask = np.zeros_like(rows), np.zeros_like(mask)
    for i, p in enumerate(problems):
        ids = [tok.eos_id, *tok.encode(p.prompt)]
        continuation = _greedy(weights, p.prompt, 4)
        own[i, :len(ids) + len(continuation)] = ids + continuation
        own_mask[i, len(ids) - 1:len(ids) - 1 + len(continuation)] = True
    _, right = score_rows(weights, own, own_mask, batch_size=5)  # a padded last batch too
    assert right.all()
    changed = own.copy()
    first = own_mask.argmax(axis=1) + 1  # the first continuation token of each row
    changed[np.arange(len(own)), first] = (own[np.arange(len(own)), first] + 1) % tok.vocab_size
    assert not score_rows(weights, changed, own_mask)[1].any()

    true = score_problems(weights, problems)
    expected = np.mean([tok.decode(_greedy(weights, p.prompt, len(tok.encode(p.answer + "\n"))))
                        == p.answer + "\n" for p in problems])
    assert true.accuracy == expected and true.problems == 8
    # The task loss: each problem's answer-token mean of the plain token losses, averaged.
    nats = np.asarray(make_token_losses(weights.cfg.model)(weights.params, weights.router_bias, rows), np.float64)
    assert true.task_loss == pytest.approx(np.mean([nats[i][mask[i]].mean() for i in range(len(problems))]),
                                           rel=1e-5)


def test_eval_arithmetic_scores_every_checkpoint_and_refuses_bad_flags(trained_tiny_run, monkeypatch, capsys):
    code, out, err = run_cli(["eval", str(trained_tiny_run), "--arithmetic", "--every-checkpoint", "--limit", "20",
                              "--json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out)
    steps = [row["step"] for row in result["checkpoints"]]
    assert steps == sorted(steps) and steps[-1] == 20
    assert all(0.0 <= row["accuracy"] <= 1.0 and row["task_loss"] > 0 and row["problems"] == 20
               for row in result["checkpoints"])
    for args, message in [(["--every-checkpoint"], "add --arithmetic"), (["--arithmetic", "--limit", "0"], "--limit"),
                          (["--arithmetic", "--tasks", "x"], "apart from --data and --tasks")]:
        code, out, err = run_cli(["eval", str(trained_tiny_run), *args], monkeypatch, capsys)
        assert code == 2 and out == "" and message in err, (args, err)


def test_a_ladders_task_points_are_each_checkpoints_score_cached_by_run(trained_tiny_run, weights, tmp_path, monkeypatch):
    """`ladder.task_points.score_runs`: one point per kept checkpoint at its training FLOPs, the last one final,
    the same score `score_problems` gives; a second call scores only the run the cache has not seen."""
    from moelab.ladder import task_points
    from moelab.train.weights import checkpoint_steps

    cfg, cache = weights.cfg, tmp_path / "task_points.csv"
    steps = checkpoint_steps(trained_tiny_run)
    points = task_points.score_runs([("a", cfg, trained_tiny_run)], cache, problems=8)
    assert [p.compute for p in points] == [task_points.checkpoint_compute(cfg, s) for s in steps]
    assert [p.final for p in points] == [s == steps[-1] for s in steps]
    score = score_problems(weights, heldout_problems(cfg.data, 8))
    assert (points[-1].accuracy, points[-1].task_loss) == pytest.approx((score.accuracy, score.task_loss))
    import moelab.evals.arithmetic as arithmetic

    scored = []
    monkeypatch.setattr(arithmetic, "score_problems", lambda run, problems: scored.append(1) or score)
    both = task_points.score_runs([("a", cfg, trained_tiny_run), ("b", cfg, trained_tiny_run)], cache, problems=8)
    assert both[:len(points)] == points and len(scored) == len(steps) and {p.run for p in both} == {"a", "b"}
    assert task_points.with_task_checkpoints(cfg).checkpoint.keep_every == max(1, cfg.train.steps // 4)
