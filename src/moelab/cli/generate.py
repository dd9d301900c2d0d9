"""`moelab generate`: sample text from a trained run, streamed to the terminal.

    moelab generate runs/tiny --prompt "def main(" --max-new-tokens 80
    moelab generate runs/tiny --prompt "417 + 86 =" --temperature 0          # greedy
    moelab generate runs/tiny --prompts prompts.jsonl --json                  # {"prompt": ...} per line
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moelab.cli.common import JsonOpt, err_console
from moelab.errors import ConfigError, DataError

__all__ = ["generate", "RunArg", "TokenizerOpt"]

RunArg = Annotated[Path, typer.Argument(help="A run directory written by `moelab train` (its --out).",
                                        show_default=False)]
TokenizerOpt = Annotated[Optional[Path], typer.Option(
    "--tokenizer", help="A tokenizer.json to use instead of the run's own (for runs that did not save one).")]


def _read_prompts(path: Path) -> list[str]:
    """The `prompt` field of each line of a JSONL file; DataError naming the file and line otherwise."""
    if not path.is_file():
        raise DataError(f"--prompts {path} does not exist; give a JSONL file with one {{\"prompt\": \"...\"}} per line.")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"--prompts {path}, line {number}: not JSON ({e}); write one "
                            "{\"prompt\": \"...\"} object per line.") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(f"--prompts {path}, line {number}: needs a string field \"prompt\", "
                            "e.g. {\"prompt\": \"def main(\"}.")
        prompts.append(row["prompt"])
    if not prompts:
        raise DataError(f"--prompts {path} holds no prompt; write one {{\"prompt\": \"...\"}} per line.")
    return prompts


class _TextStream:
    """Prints the text of a growing token list as it grows. Decoding the whole list each time (not token by
    token) keeps multi-byte characters whole; a trailing U+FFFD is held back until its bytes are complete."""

    def __init__(self, tokenizer, file) -> None:
        self.tokenizer, self.file, self.ids, self.shown = tokenizer, file, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        self.file.write(text[self.shown:])
        self.file.flush()
        self.shown = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)


def generate(
    run: RunArg,
    prompt: Annotated[Optional[str], typer.Option(help="The text to continue (\"\" starts a new document).")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help="A JSONL file, one {\"prompt\": \"...\"} per line.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate per prompt (fewer at eos or at "
                                                     "the end of the model's context).")] = 64,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[Optional[int], typer.Option(help="Draw only among the k most likely tokens.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Draw only among the most likely tokens holding this "
                                                        "much probability, e.g. 0.95.")] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed: the same seed gives the same text.")] = 0,
    tokenizer: TokenizerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Sample from a run's newest checkpoint, streaming the text (KV-cache decoding, no expert drops).

    A prompt of model.seq_len tokens or more is refused (exit 2); generation stops at the end of a
    document (eos), after --max-new-tokens, or at the end of the model's context. With --json each prompt
    prints one line {"prompt", "completion", "tokens", "stopped"} instead of streaming.
    """
    if (prompt is None) == (prompts is None):
        raise ConfigError("give exactly one of --prompt TEXT or --prompts FILE.jsonl, e.g. "
                          "`moelab generate runs/tiny --prompt \"def main(\"`.")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} is invalid: must be >= 1.")
    texts = [prompt] if prompt is not None else _read_prompts(prompts)
    from moelab.model import decode
    from moelab.train.state import compute_dtype
    from moelab.train.weights import load_run

    try:
        sampling = decode.Sampling(temperature, top_k, top_p)
    except ValueError as e:
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    weights = load_run(run, tokenizer)
    tok, model = weights.tokenizer, weights.cfg.model
    sampler = decode.make_sampler(model, sampling, tok.vocab_size, compute_dtype(weights.cfg))
    sources = ["--prompt"] if prompts is None else [f"--prompts {prompts}, prompt {i + 1}" for i in range(len(texts))]
    # Every prompt is checked before the first is decoded: a bad one fails the command with nothing printed.
    ids = [decode.check_prompt(tok.encode(text), model.seq_len, tok.eos_id, source)
           for text, source in zip(texts, sources)]
    err_console.print(f"[dim]{run} at step {weights.step}[/]", highlight=False)
    for number, (text, prompt_ids, source) in enumerate(zip(texts, ids, sources)):
        stream = _TextStream(tok, io.StringIO() if json_out else sys.stdout)
        if not json_out:
            if number:
                sys.stdout.write("\n" + "-" * 40 + "\n")
            sys.stdout.write(text)
        for token in decode.generate(sampler, weights.params, weights.router_bias, prompt_ids,
                                     seq_len=model.seq_len, max_new_tokens=max_new_tokens, eos_id=tok.eos_id,
                                     seed=seed, source=source):
            stream.add(token)
        limit = min(max_new_tokens, model.seq_len - len(prompt_ids))
        stopped = "length" if len(stream.ids) >= limit else "eos"
        if json_out:
            print(json.dumps({"prompt": text, "completion": stream.text(), "tokens": len(stream.ids),
                              "stopped": stopped}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
