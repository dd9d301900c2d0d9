"""The arithmetic exact-match task: held-out `a op b = c` problems, scored by greedy answer and answer loss.

    problems = heldout_problems(run.cfg.data)          # [Problem("417 + 86 =", " 503"), ...]
    score = score_problems(run, problems)               # TaskScore(accuracy, task_loss, problems)

Each problem is one row, `[eos] a op b =` followed by the answer ` c` and the newline that ends it, scored in
one teacher-forced forward:
- task loss: the mean cross-entropy (nats) of the answer's tokens (` c` and the newline) given the problem,
  averaged over problems;
- exact match: greedy decoding from the problem writes ` c` and then the newline exactly when each of those
  tokens is the argmax given the true tokens before it, so accuracy needs no decoding loop and is what a
  greedy sampler would score. The newline makes `503` followed by `7` wrong.

The problems are the run's own held-out arithmetic documents (the split its eval uses, from `data.seed`), so
a ladder's rungs and target, which share the data section, are scored on the same set.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import numpy as np

from moelab.config import DataConfig
from moelab.data.mixture import split_documents
from moelab.data.sources import iter_documents
from moelab.errors import DataError

__all__ = ["Problem", "TaskScore", "heldout_problems", "parse_problems", "problem_rows", "score_rows", "score_problems"]

TASK = "arithmetic"


class Problem(NamedTuple):
    prompt: str  # "417 + 86 ="
    answer: str  # " 503": what follows the prompt up to (not including) the newline


class TaskScore(NamedTuple):
    accuracy: float  # share of problems whose greedy answer is exactly right
    task_loss: float  # mean over problems of the answer tokens' mean cross-entropy (nats)
    problems: int


def parse_problems(document: str) -> list[Problem]:
    """The `a op b = c` lines of an arithmetic document as problems; other lines are skipped."""
    problems = []
    for line in document.splitlines():
        prompt, sep, answer = line.rpartition(" =")
        if sep and prompt and answer.strip().lstrip("-").isdigit():
            problems.append(Problem(prompt + sep, answer))
    return problems


def heldout_problems(cfg: DataConfig, limit: int | None = None) -> list[Problem]:
    """The held-out problems of `cfg`'s arithmetic domain, in document order; at most `limit`."""
    domain = next((d for d in cfg.domains if d.name == TASK and d.kind == "embedded"), None)
    if domain is None:
        raise DataError(f"the run's data has no embedded `{TASK}` domain (domains: "
                        f"{', '.join(d.name for d in cfg.domains)}), so it has no held-out problems to score; "
                        "the task needs a run trained on the default mixture or one that keeps that domain.")
    documents = list(iter_documents(domain, cfg.max_bytes_per_domain, cfg.seed, cfg.arithmetic_digits))
    _, heldout = split_documents(documents, cfg.heldout_fraction)
    problems = [p for doc in heldout for p in parse_problems(doc)]
    return problems[:limit] if limit is not None else problems


def problem_rows(tokenizer: Any, problems: Sequence[Problem], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows `[eos] prompt answer newline` padded to `width`, and a mask of the positions (in the
    targets, `row[1:]`) that hold the answer and the newline.

    Prompt and continuation are encoded apart, as lm-evaluation-harness does, so a tokenizer that would merge
    across `= 5` still scores exactly the answer's tokens.
    """
    prompts = tokenizer.encode_batch([p.prompt for p in problems])
    answers = tokenizer.encode_batch([p.answer + "\n" for p in problems])
    rows = np.zeros((len(problems), width), np.int32)
    mask = np.zeros((len(problems), width - 1), bool)
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        ids = [tokenizer.eos_id, *prompt, *answer]
        if len(ids) > width:
            raise DataError(f"arithmetic problem {problems[i].prompt!r} is {len(ids)} tokens, more than the "
                            f"model's seq_len + 1 = {width}.")
        rows[i, :len(ids)] = ids
        mask[i, len(ids) - 1 - len(answer):len(ids) - 1] = True
    return rows, mask


@functools.lru_cache(maxsize=8)
def _token_scores(cfg, vocab_size: int):
    """One jitted scorer per model, so `--every-checkpoint` compiles once, not once per checkpoint."""
    from moelab.evals.loss import make_token_scores

    return make_token_scores(cfg, vocab_size)


def score_rows(run: Any, rows: np.ndarray, mask: np.ndarray, *, batch_size: int = 64
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the mean cross-entropy (nats) of the masked targets, and whether every masked target is the
    model's argmax given the tokens before it (what greedy decoding would write). `rows` [N, seq_len + 1],
    `mask` [N, seq_len] over the targets `rows[:, 1:]`. The last batch is padded to `batch_size`, so one
    program compiles per model."""
    width = rows.shape[1]
    scores = _token_scores(run.cfg.model, run.tokenizer.vocab_size)
    nats, greedy = [], []
    for start in range(0, len(rows), batch_size):
        chunk = np.zeros((batch_size, width), np.int32)
        part = rows[start:start + batch_size]
        chunk[:len(part)] = part
        n, g = scores(run.params, run.router_bias, chunk)
        nats.append(np.asarray(n, np.float64)[:len(part)])
        greedy.append(np.asarray(g)[:len(part)])
    nats, greedy = np.concatenate(nats), np.concatenate(greedy)
    return (nats * mask).sum(axis=1) / mask.sum(axis=1), np.all(greedy | ~mask, axis=1)


def score_problems(run: Any, problems: Sequence[Problem], *, batch_size: int = 64) -> TaskScore:
    """Accuracy and task loss of a run (`moelab.train.weights.RunWeights`) on `problems`."""
    if not problems:
        raise DataError("no arithmetic problems to score: the held-out split holds none (raise "
                        "data.max_bytes_per_domain or data.heldout_fraction).")
    rows, mask = problem_rows(run.tokenizer, problems, run.cfg.model.seq_len + 1)
    loss, correct = score_rows(run, rows, mask, batch_size=batch_size)
    return TaskScore(float(correct.mean()), float(loss.mean()), len(problems))
