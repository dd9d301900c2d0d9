"""`moelab export --check`: an export loaded by `transformers` against the run it came from.

    result = check_export("exports/default", load_run("runs/default"))
    result["max_abs_diff"], result["passed"], result["greedy"]["same"]

The comparisons, so that nobody has to write them:

- **logits**: `AutoModelForCausalLM.from_pretrained(folder)` in float32 against moelab's float32 forward
  of the weights the export holds (the run's own, or for a bfloat16 export the same rounded to bfloat16,
  router kept float32), with the `dropless` dispatch (the function transformers computes; `load_export`
  says why not the training `capacity`), over `CHECK_BATCH` rows of `CHECK_LEN` random token ids;
  passes when max |difference| <= `TOLERANCE`. This is the export's exactness: any wrong, transposed
  or missing weight moves logits by order 0.1-1.
- **greedy generation**: `GREEDY_NEW_TOKENS` tokens after `GREEDY_PROMPT`, by transformers' `generate`
  and by moelab's KV-cache sampler at temperature 0, on the same weights; reported, not part of the
  pass: a near-tie between two tokens may break either way within the tolerance.
- **bfloat16 inference** (a bfloat16 export only): transformers computing in bfloat16 against the
  float32 run, what a user of the bfloat16 model gets: the median over positions of the largest
  logit difference, its maximum and how often the argmax agrees. Not part of the pass either: the
  maximum is a routing flip, an expert choice near a tie that rounding turns over, which moves that
  position's logits by order 1 in moelab's own bfloat16 compute just the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moelab.errors import DataError
from moelab.model import decode, transformer
from moelab.model.moe import build_moe

__all__ = ["TOLERANCE", "CHECK_BATCH", "CHECK_LEN", "GREEDY_PROMPT", "GREEDY_NEW_TOKENS", "check_export",
           "moelab_logits", "exported_params"]

# Issue 32's bound: the same function in float32, summed in other orders by torch and XLA (measured 2e-7 to
# 1.1e-5 on the README's runs), far below what one wrong weight does (order 0.1 to 1).
TOLERANCE = 1e-4
CHECK_BATCH, CHECK_LEN = 2, 128  # CHECK_LEN is cut to model.seq_len
GREEDY_PROMPT = "def "
GREEDY_NEW_TOKENS = 32


def exported_params(params: dict, dtype: str) -> dict:
    """The params as an export in `dtype` holds them, back in float32: rounded to bfloat16 except the router's
    weight (`moelab.export.writer` keeps it float32)."""
    if dtype == "float32":
        return params

    def rounded(path, a):
        return a if path[-1].key == "w_router" else jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(rounded, params)


def moelab_logits(run: Any, tokens: np.ndarray) -> np.ndarray:
    """moelab's float32 logits [B, S, V] of `tokens` [B, S] under the `dropless` dispatch (no token dropped)."""
    cfg = run.cfg.model
    logits, _ = transformer.apply(run.params, jnp.asarray(tokens, jnp.int32), cfg, run.router_bias,
                                  dispatch=build_moe(cfg, purpose="decode"))
    return np.asarray(logits)


def _moelab_greedy(run: Any, prompt: np.ndarray, new_tokens: int) -> list[int]:
    cfg = run.cfg.model
    sampler = decode.make_sampler(cfg, decode.Sampling(temperature=0.0), run.tokenizer.vocab_size)
    return list(decode.generate(sampler, run.params, run.router_bias, prompt, seq_len=cfg.seq_len,
                                max_new_tokens=new_tokens, eos_id=run.tokenizer.eos_id, seed=0))


def _load_transformers(folder: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), output_loading_info=True)
    wrong = {kind: keys for kind, keys in info.items() if keys and kind in ("missing_keys", "unexpected_keys",
                                                                            "mismatched_keys")}
    if wrong:  # transformers would fill a missing weight at random: the comparison would only say "far off"
        raise DataError(f"{folder} does not load cleanly in transformers ({wrong}); export it again.")
    return model.eval()


def _transformers_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


def _transformers_greedy(model, prompt: np.ndarray, new_tokens: int, eos: int) -> list[int]:
    import torch

    with torch.no_grad():
        generated = model.generate(torch.from_numpy(prompt[None].astype(np.int64)), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos)
    ids = [int(t) for t in generated[0, prompt.size:]]
    return ids[:ids.index(eos)] if eos in ids else ids  # moelab's generate stops before eos; transformers' keeps it


def check_export(folder: str | Path, run: Any, *, dtype: str = "float32") -> dict:
    """Compare the export in `folder` (written from `run` in `dtype`) with the run, as the module docstring says.

    Returns:
        {"hf_class", "dtype", "tokens" [B, S], "max_abs_diff", "max_abs_logit", "tolerance", "passed",
        "greedy": {"prompt", "new_tokens", "moelab", "transformers" (token ids), "same"}}, and for bfloat16
        "bfloat16_inference": {"median_abs_diff", "max_abs_diff", "argmax_agreement"}.
    """
    folder = Path(folder)
    held = run._replace(params=exported_params(run.params, dtype))
    model = _load_transformers(folder, "float32")
    length = min(CHECK_LEN, run.cfg.model.seq_len)
    tokens = np.random.default_rng(0).integers(0, run.tokenizer.vocab_size, (CHECK_BATCH, length))
    ours = moelab_logits(held, tokens)
    diff = float(np.max(np.abs(_transformers_logits(model, tokens) - ours)))

    prompt = np.asarray(run.tokenizer.encode(GREEDY_PROMPT), np.int32)
    new_tokens = min(GREEDY_NEW_TOKENS, run.cfg.model.seq_len - prompt.size)
    ours_greedy = _moelab_greedy(held, prompt, new_tokens)
    theirs_greedy = _transformers_greedy(model, prompt, new_tokens, run.tokenizer.eos_id)
    result = {"hf_class": type(model).__name__, "dtype": dtype, "tokens": list(tokens.shape), "max_abs_diff": diff,
              "max_abs_logit": float(np.max(np.abs(ours))), "tolerance": TOLERANCE, "passed": diff <= TOLERANCE,
              "greedy": {"prompt": GREEDY_PROMPT, "new_tokens": new_tokens, "moelab": ours_greedy,
                         "transformers": theirs_greedy, "same": ours_greedy == theirs_greedy}}
    if dtype == "bfloat16":
        full = moelab_logits(run, tokens)
        theirs = _transformers_logits(_load_transformers(folder, "bfloat16"), tokens)
        per_position = np.max(np.abs(theirs - full), axis=-1)
        result["bfloat16_inference"] = {"median_abs_diff": float(np.median(per_position)),
                                        "max_abs_diff": float(per_position.max()),
                                        "argmax_agreement": float(np.mean(theirs.argmax(-1) == full.argmax(-1)))}
    return result
