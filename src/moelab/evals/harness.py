"""lm-evaluation-harness tasks on a moelab run, through a moelab `LM` adapter.

    results = run_tasks(load_run("runs/tiny"), ["my_mc_task"], include_path="tasks/")   # a local YAML task

`MoelabLM` answers the harness's three request kinds:
- `loglikelihood(context, continuation)`: the summed log-probability of the continuation's tokens after
  `[eos] + context` (every document starts after eos in training), and whether each was the argmax;
  the sequence keeps its last seq_len + 1 tokens when longer;
- `loglikelihood_rolling(text)`: the text's summed log-probability, windows as `moelab.evals.loss`;
- `generate_until(context, {until, max_gen_toks})`: greedy KV-cache decoding (`moelab.model.decode`) until
  eos, a stop string or the token budget.
lm-eval is an optional dependency (`pip install lm_eval`), imported only here. `run_tasks` keeps lm-eval's
chatter that says nothing about the tasks off the terminal (`_quiet_harness`).
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
from typing import Any
from unittest import mock

import jax.numpy as jnp
import numpy as np

from moelab.errors import ConfigError
from moelab.evals.loss import make_token_scores, token_stream, windows
from moelab.model import decode

__all__ = ["make_lm", "run_tasks"]


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.api.model import LM
    except ImportError:
        raise ConfigError("--tasks needs lm-evaluation-harness: `pip install lm_eval` (about 25 small packages, "
                          "~170 MB with scikit-learn), then run again.") from None
    return lm_eval, LM


def make_lm(run: Any, batch_size: int = 8):
    """A harness `LM` for a run (`moelab.train.weights.RunWeights`)."""
    _, LM = _import_lm_eval()
    cfg, tok = run.cfg.model, run.tokenizer
    S = cfg.seq_len
    scored = make_token_scores(cfg, tok.vocab_size)  # tokens [B, S+1] -> (nats [B, S], target is argmax [B, S])

    def score_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out_nats, out_greedy = [], []
        for b in range(0, len(rows), batch_size):
            chunk = rows[b:b + batch_size]
            padded = np.zeros((batch_size, S + 1), np.int32)
            padded[:len(chunk)] = chunk
            nats, greedy = scored(run.params, run.router_bias, jnp.asarray(padded))
            out_nats.append(np.asarray(nats, np.float64)[:len(chunk)])
            out_greedy.append(np.asarray(greedy)[:len(chunk)])
        return np.concatenate(out_nats), np.concatenate(out_greedy)

    class MoelabLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            rows, spans = [], []
            for request in requests:
                context, continuation = request.args[:2]
                ctx = np.concatenate([[tok.eos_id], tok.encode(context)]).astype(np.int32)
                cont = tok.encode(continuation)
                ids = np.concatenate([ctx, cont])[-(S + 1):]
                row = np.zeros(S + 1, np.int32)
                row[:len(ids)] = ids
                rows.append(row)
                spans.append((len(ids) - 1 - len(cont), len(ids) - 1))  # target positions of the continuation
            nats, greedy = score_rows(np.stack(rows))
            return [(-float(nats[i, a:b].sum()), bool(greedy[i, a:b].all())) for i, (a, b) in enumerate(spans)]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            results = []
            for request in requests:
                rows, mask = windows(token_stream(tok, [request.args[0]]), S)
                nats, _ = score_rows(rows)
                results.append(-float(nats[mask].sum()))
            return results

        def generate_until(self, requests, disable_tqdm: bool = False):
            sampler = decode.make_sampler(cfg, decode.Sampling(temperature=0), tok.vocab_size)
            results = []
            for request in requests:
                context, kwargs = request.args[0], request.args[1] if len(request.args) > 1 else {}
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                prompt = np.concatenate([[tok.eos_id], tok.encode(context)]).astype(np.int32)[-(S - 1):]
                ids, text = [], ""
                for token in decode.generate(sampler, run.params, run.router_bias, prompt, seq_len=S,
                                             max_new_tokens=min(int(kwargs.get("max_gen_toks", 64)), S - len(prompt)),
                                             eos_id=tok.eos_id, seed=0):
                    ids.append(token)
                    text = tok.decode(ids)
                    if any(stop in text for stop in until):
                        break
                for stop in until:
                    text = text.split(stop)[0]
                results.append(text)
            return results

    return MoelabLM()


def run_tasks(run: Any, tasks: list[str], *, include_path: str | None = None, limit: int | None = None,
              batch_size: int = 8) -> dict:
    """Run harness `tasks` (installed ones, or YAML tasks under `include_path`) on `run`; returns the harness's
    `results` per task. An unknown task name is a ConfigError listing how to find or define one."""
    lm_eval, _ = _import_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks: {', '.join(unknown)} is not an lm-eval task here; list the installed ones with "
                          "`lm-eval ls tasks`, or define one in a YAML file and pass its folder as --include-path.")
    with _quiet_harness():
        out = lm_eval.simple_evaluate(model=make_lm(run, batch_size), tasks=tasks, task_manager=manager, limit=limit,
                                      bootstrap_iters=0, log_samples=False)
    return out["results"]


def _git_describe_quietly() -> str | None:
    """lm-eval's `get_git_commit_hash` (the `git describe --always` it records) with git's stderr dropped."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@contextlib.contextmanager
def _quiet_harness():
    """Silence what lm-eval prints besides the results: `fatal: not a git repository` (its `git describe`,
    run outside a checkout), HF datasets' "Generating test split" bars and lm-eval's bar over building the
    requests (a few documents each, gone in a blink). Everything is restored afterwards."""
    import datasets  # a dependency of lm-eval
    import lm_eval.api.task
    import lm_eval.evaluator
    from tqdm import tqdm

    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _git_describe_quietly), \
                mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(tqdm, disable=True)):
            yield
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
